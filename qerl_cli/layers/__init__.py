"""Building blocks of the one decoder implementation: QLinear, LoRA, RMSNorm (AQN slot), rotary, attention.

Every module keeps the Hugging Face attribute names so checkpoint and PEFT keys map 1:1.
"""

from qerl_cli.layers.attention import Attention
from qerl_cli.layers.linear import QLinear
from qerl_cli.layers.lora import LoRALinear, LoraSpec, apply_lora, lora_parameters
from qerl_cli.layers.norm import RMSNorm
from qerl_cli.layers.rotary import RotaryEmbedding

__all__ = ["Attention", "LoRALinear", "LoraSpec", "QLinear", "RMSNorm", "RotaryEmbedding", "apply_lora", "lora_parameters"]
