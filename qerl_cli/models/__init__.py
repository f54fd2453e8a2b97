"""The decoder model shared by rollout, train-step and eval, and its loader.

>>> model = load_model(qdir, device="cuda", dtype=torch.bfloat16, lora=LoraSpec(r=16, alpha=16))
>>> logits = model.compute_logits(model.forward_train(ids, mask))
"""

from qerl_cli.layers.lora import LoraSpec
from qerl_cli.models.config import PRESETS, ModelConfig, preset
from qerl_cli.models.decoder import CausalLM
from qerl_cli.models.loader import build_random_model, load_model

__all__ = ["PRESETS", "CausalLM", "LoraSpec", "ModelConfig", "build_random_model", "load_model", "preset"]
