"""Shared test helpers: tiny random Hugging Face checkpoints built offline from a config.

``make_tiny_hf_model(tmp_path)`` writes a complete HF model directory (config.json,
generation_config.json, safetensors weights, and a real byte-level BPE tokenizer trained in code
on a few sentences) in well under a second, with no downloads. Every stage's tests can use it as
a stand-in for a real checkpoint:

>>> from tests.helpers import make_tiny_hf_model
>>> src = make_tiny_hf_model(tmp_path, arch="qwen2", hidden=64, layers=2)
>>> model = transformers.AutoModelForCausalLM.from_pretrained(src)
>>> tok = transformers.AutoTokenizer.from_pretrained(src)

Sizes default to multiples of 16 so every decoder Linear is NVFP4-quantizable; pass e.g.
``intermediate=40`` to get a ``down_proj`` whose input size is not (kept dense by quantize).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ARCHS = ("qwen2", "llama", "qwen3", "mistral")

# A Qwen-style ChatML template, so code that applies chat templates has one to apply.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A reasoning model's template (QwQ, DeepSeek-R1 distills, Qwen3's thinking switch): the generation prompt opens
# <think> itself, unless enable_thinking=false (a chat template kwarg) renders an empty, closed think block.
THINKING_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? The answer is 72.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "Let's think step by step. 1 + 2 = 3, 3 * 4 = 12, 12 - 5 = 7, 100 / 4 = 25.",
    "<think> reasoning </think> <answer> 42 </answer> #### 18",
]


def make_tiny_tokenizer(vocab_size: int = 384):
    """A byte-level BPE ``PreTrainedTokenizerFast`` (any text encodes) with ChatML special tokens.

    Trained in code on a fixed corpus, so it is deterministic and needs no network. Its length is
    at most ``vocab_size``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(
    arch: str = "qwen2",
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int = 512,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
):
    """A transformers config for a tiny decoder of the given architecture."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    cls = {
        "qwen2": transformers.Qwen2Config,
        "llama": transformers.LlamaConfig,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }[arch]
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate if intermediate is not None else 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = hidden // heads
    return cls(**kwargs)


def make_tiny_hf_model(
    tmp_path: Path,
    arch: str = "qwen2",
    hidden: int = 64,
    layers: int = 2,
    *,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int = 512,
    dtype: torch.dtype = torch.bfloat16,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    tokenizer: bool = True,
    max_shard_size: str | int | None = None,
    name: str = "src",
    init_std: float = 0.02,
) -> Path:
    """Write a tiny random HF causal-LM checkpoint to ``tmp_path / name`` and return that path.

    - ``arch``: qwen2 (q/k/v biases), llama, qwen3 (q/k norms), mistral.
    - ``dtype``: the on-disk weight dtype (bf16, fp16 or fp32).
    - ``max_shard_size``: e.g. ``"20KB"`` to force several shards plus ``model.safetensors.index.json``.
    - ``init_std``: std of the normal init of every weight (biases and norms get small random
      values too, so tests notice when one is dropped or mis-copied).
    - ``tokenizer``: also save the byte-level BPE tokenizer (tokenizer.json + config, chat template).
    """
    import transformers

    out = Path(tmp_path) / name
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(
        arch,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        vocab=vocab,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.02 * torch.randn_like(p))
            else:
                p.normal_(0.0, init_std)
    model = model.to(dtype)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id
    )
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kw)
    if tokenizer:
        tok = make_tiny_tokenizer(min(vocab, 384))
        tok.save_pretrained(out)
    return out


def read_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def assert_engine_switch_keeps_samples(tmp_path: Path, monkeypatch, env: str, cls, method: str, seed: int, **shape):
    """A tiny qerl-quantized model (``make_tiny_hf_model`` with ``shape``; qerl's quantizer shares the
    q/k/v and gate/up global scales, so the engine fuses them) in the graph engine with ``env`` at 1
    and at 0: ``cls.method`` (spied) returns a result only at 1, the fast path ran, and the sampled
    tokens and log-probs are identical. GPU only."""
    from qerl_cli.engine import LLMEngine, SamplingParams
    from qerl_cli.models import load_model
    from qerl_cli.quantize import QuantizeConfig, quantize
    from tests.test_engine_gpu import PROMPTS

    src = make_tiny_hf_model(tmp_path, arch="qwen2", init_std=0.05, **shape)
    quantize(QuantizeConfig(src=src, out=tmp_path / "q", device="cpu", progress=False))
    model = load_model(tmp_path / "q", device="cuda", dtype=torch.bfloat16)
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=seed)
    real, ran = getattr(cls, method), []

    def spy(self, *args):
        y = real(self, *args)
        ran.append(y is not None)
        return y

    monkeypatch.setattr(cls, method, spy)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(env, flag)
        ran.clear()
        runs[flag] = LLMEngine(model, None, max_num_seqs=8).generate(PROMPTS, sp, n=2)
        assert any(ran) == (flag == "1"), (env, flag)
    for a, b in zip(runs["1"], runs["0"]):
        for c1, c2 in zip(a, b):
            assert c1.token_ids == c2.token_ids and c1.logprobs == c2.logprobs, env


def random_lora_model(cfg: dict, *, device: str = "cpu", dtype=torch.float32, quantized: bool = True, r: int = 4,
                      alpha: float = 8, std: float = 0.2, targets: tuple[str, ...] | None = None):
    """A random decoder (HF-style ``cfg`` dict) with non-zero LoRA on ``targets`` (all seven by default), its
    q/k/v and gate/up fused, and the adapters' inference copies in ``dtype``: what the engine sets up
    before grouping (``group_lora``)."""
    from qerl_cli.layers.attention import fuse_projections
    from qerl_cli.layers.lora import LoraSpec, lora_modules, lora_parameters
    from qerl_cli.models import ModelConfig, build_random_model

    spec = LoraSpec(r=r, alpha=alpha) if targets is None else LoraSpec(r=r, alpha=alpha, targets=targets)
    model = build_random_model(ModelConfig.from_hf(cfg), device=device, dtype=dtype, quantized=quantized, lora=spec)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.normal_(0, std)
    fuse_projections(model)
    for _, m in lora_modules(model):
        m.refresh_inference_copies(dtype)
    return model


def logit_keys(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Integer keys in logit order, written independently of the kernels' ``_radix_key``: the bits of
    16-bit logits, of x = logits / T for fp32; -0 keyed as +0."""
    if logits.element_size() == 2:
        b = logits.view(torch.int16).to(torch.int64)
        b = torch.where(b == -(2**15), 0, b)
        return torch.where(b < 0, b ^ 0x7FFF, b) + 2**15
    b = (logits.float() * (1.0 / temperature)).view(torch.int32).to(torch.int64)
    b = torch.where(b == -(2**31), 0, b)
    return torch.where(b < 0, b ^ 0x7FFFFFFF, b) + 2**31


def mask_from_cut(logits: torch.Tensor, temperature: float, cut) -> torch.Tensor:
    """[B, V] bool: the tokens a ``triton_truncation.Cut`` keeps, applied in torch (the rule the Gumbel
    kernel applies on the fly)."""
    x = logits.float() * (1.0 / temperature)
    k = logit_keys(logits, temperature)
    kc = cut.kcut[:, None]
    stay = (x >= (cut.pmax.max(-1).values + cut.log_min_p)[:, None]) & (k >= kc)
    if cut.ties is None:
        return stay & (k > kc)
    rank = (stay & (k == kc)).long().cumsum(-1) - 1
    return stay & ((k > kc) | (rank < cut.keep[:, None]))


def assert_same_nucleus(kept: torch.Tensor, logits: torch.Tensor, sp) -> None:
    """``kept`` equals the sorted reference's truncation of ``logits`` under ``sp``, except where the
    reference's fp32 cumulative sum puts a token within 1e-5 of top_p (exact sums may round it the
    other way)."""
    from qerl_cli.engine.sampler import truncated_logprobs

    ref = torch.isfinite(truncated_logprobs(logits.float(), sp))
    bad = (kept != ref).nonzero().tolist()
    if not bad:
        return
    import dataclasses

    survive = torch.isfinite(truncated_logprobs(logits.float(), dataclasses.replace(sp, top_p=1.0)))
    x = (logits.float() / sp.temperature).double()
    for r, i in bad:
        order = torch.sort(x[r], descending=True, stable=True).indices
        p = torch.softmax(x[r].masked_fill(~survive[r], float("-inf")), -1)
        pos = (order == i).nonzero().item()
        above = p[order[:pos]].sum().item()
        assert abs(above - sp.top_p) < 1e-5, (r, i, above, sp)


def run_in_interpreter(script: str) -> None:
    """Run ``script`` in a fresh interpreter with Triton's CPU interpreter on (``TRITON_INTERPRET=1``,
    read at import) and assert it ends by printing ``ok``."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout[-2000:], r.stderr[-3000:])


# PEFT's fields that leave a target out of some layers, as PEFT writes them (int and list, string and list, list and
# regex): tests/test_merge.py merges adapters saved with each, tests/test_adapters.py checks which pairs PEFT wraps
PEFT_LAYER_FIELDS = {
    "layers_to_transform_int": dict(layers_to_transform=1),
    "layers_to_transform_0": dict(layers_to_transform=0),
    "layers_to_transform_list": dict(layers_to_transform=[0, 2]),
    "layers_pattern_str": dict(layers_to_transform=[1], layers_pattern="layers"),
    "layers_pattern_list": dict(layers_to_transform=[2], layers_pattern=["h", "layers"]),
    "exclude_modules_list": dict(exclude_modules=["v_proj", "model.layers.1.mlp.down_proj"]),
    "exclude_modules_regex": dict(exclude_modules=r".*\.1\.self_attn\..*"),
}
