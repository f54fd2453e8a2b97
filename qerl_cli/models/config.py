"""ModelConfig: the few numbers the decoder needs, parsed from a Hugging Face config.json.

Parsing is explicit per family (Llama, Mistral, Qwen2/2.5, Qwen3) instead of going through
transformers' AutoConfig, so an unsupported model fails here with a one-line error naming the
field rather than deep inside a forward pass, and no remote code is ever consulted.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qerl_cli.errors import BadInputError

ARCHS = {  # model_type -> (q/k/v bias default, q/k norm)
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}
_ARCH_CLASSES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> ModelConfig:
        arch = cfg.get("model_type")
        if arch not in ARCHS:
            arch = next((_ARCH_CLASSES[a] for a in cfg.get("architectures") or [] if a in _ARCH_CLASSES), arch)
        if arch not in ARCHS:
            raise BadInputError(
                f"{source}: unsupported architecture model_type={cfg.get('model_type')!r} "
                f"architectures={cfg.get('architectures')} (supported: {', '.join(sorted(ARCHS))})"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(cfg.get(key), int):
                raise BadInputError(f"{source}: missing or non-integer {key!r}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise BadInputError(f"{source}: hidden_act {act!r} is not supported (only silu)")
        default_bias, qk_norm = ARCHS[arch]
        heads = cfg["num_attention_heads"]
        kv = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        attn_bias = cfg.get("attention_bias")
        qkv_bias = default_bias if attn_bias is None else bool(attn_bias)
        if arch == "qwen2":
            qkv_bias = True  # Qwen2 always has q/k/v biases and never an o_proj bias
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        sliding = cfg.get("sliding_window") if (arch == "mistral" or cfg.get("use_sliding_window")) else None
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=bool(attn_bias) if arch in ("llama", "qwen3") else False,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=qk_norm,
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise BadInputError(f"{path}: not found (is {model_dir} a Hugging Face model directory?)") from None
        except ValueError as e:
            raise BadInputError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf(cfg, str(path))

    def to_dict(self) -> dict:
        return asdict(self)


# Shapes of public checkpoints, for benchmarks that build random weights on the GPU.
PRESETS = {
    "qwen2.5-7b": dict(arch="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                       num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1e6, max_position_embeddings=32768,
                       qkv_bias=True, eos_token_ids=(151645, 151643)),
    "qwen2.5-32b": dict(arch="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_layers=64,
                        num_heads=40, num_kv_heads=8, head_dim=128, rope_theta=1e6, max_position_embeddings=32768,
                        qkv_bias=True, eos_token_ids=(151645, 151643)),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise BadInputError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})")
    return ModelConfig(**PRESETS[name])
