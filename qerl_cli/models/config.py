"""ModelConfig: the few numbers the decoder needs, parsed from a Hugging Face config.json.

Parsing is explicit per family (Llama, Mistral, Qwen2/2.5, Qwen3) instead of going through
transformers' AutoConfig, so an unsupported model fails here with a one-line error naming the
field rather than deep inside a forward pass, and no remote code is ever consulted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from qerl_cli.errors import BadInputError

# What transformers' config classes assume for a key config.json leaves out (transformers 5.24: LlamaConfig,
# Qwen2Config, Qwen3Config, MistralConfig); None: derived (num_key_value_heads = heads, head_dim = hidden /
# heads). qerl once used 4096 positions and hidden / heads for every architecture: a Qwen3 config without
# head_dim was refused, a llama3-rope config without max_position_embeddings rotated differently (audit).
HF_DEFAULTS = {  # model_type -> (num_key_value_heads, head_dim, max_position_embeddings)
    "llama": (None, None, 2048),
    "mistral": (8, None, 131072),
    "qwen2": (32, None, 32768),
    "qwen3": (32, 128, 32768),
}

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
        if not isinstance(cfg, dict):
            raise BadInputError(f"{source}: not a JSON object")
        arch = cfg.get("model_type")
        arch = arch if isinstance(arch, str) else None
        if arch not in ARCHS:
            archs = cfg.get("architectures")
            archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
            arch = next((_ARCH_CLASSES[a] for a in archs if a in _ARCH_CLASSES), arch)
        if arch not in ARCHS:
            raise BadInputError(
                f"{source}: unsupported architecture model_type={cfg.get('model_type')!r} "
                f"architectures={cfg.get('architectures')} (supported: {', '.join(sorted(ARCHS))})"
            )

        def pos_int(key, default=None):
            v = cfg.get(key)
            if v is None:
                v = default
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise BadInputError(f"{source}: missing or invalid {key!r} (a positive integer, got {v!r})")
            return v

        def pos_float(key, default):
            v = cfg.get(key)
            if v is None:
                return float(default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise BadInputError(f"{source}: invalid {key!r} (a positive number, got {v!r})")
            return float(v)

        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            pos_int(key)
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # transformers' ACT2FN maps both to SiLU
            raise BadInputError(f"{source}: hidden_act {act!r} is not supported (only silu)")
        default_bias, qk_norm = ARCHS[arch]
        heads = cfg["num_attention_heads"]
        kv_default, hd_default, pos_default = HF_DEFAULTS[arch]
        kv = pos_int("num_key_value_heads", kv_default or heads)
        if heads % kv:
            raise BadInputError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
        head_dim = pos_int("head_dim", hd_default or cfg["hidden_size"] // heads)
        max_pos = pos_int("max_position_embeddings", pos_default)
        theta, scaling = _rope(cfg, max_pos, source, pos_float)
        attn_bias = cfg.get("attention_bias")
        qkv_bias = default_bias if attn_bias is None else bool(attn_bias)
        if arch == "qwen2":
            qkv_bias = True  # Qwen2 always has q/k/v biases and never an o_proj bias
        elif arch == "mistral":
            qkv_bias = False  # transformers' Mistral ignores attention_bias (a config with it loads there)
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos):
            raise BadInputError(f"{source}: eos_token_id must be a token id or a list of them, got {cfg.get('eos_token_id')!r}")
        sliding = _sliding_window(cfg, arch)
        if sliding is not None:
            sliding = pos_int("sliding_window", sliding)
        eps = pos_float("rms_norm_eps", 1e-6)
        bos = cfg.get("bos_token_id")
        if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool)):
            bos = None
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            rms_norm_eps=eps,
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=bool(attn_bias) if arch in ("llama", "qwen3") else False,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if arch == "llama" else False,  # only Llama's reads it
            qk_norm=qk_norm,
            sliding_window=sliding,
            bos_token_id=bos,
            eos_token_ids=eos,
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise BadInputError(f"{path}: not found (is {model_dir} a Hugging Face model directory?)",
                                hint=adapter_as_model_hint(model_dir)) from None
        except ValueError as e:
            raise BadInputError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf(cfg, str(path))


def adapter_as_model_hint(model_dir) -> str | None:
    """The hint for a --model without config.json that is a PEFT adapter directory (every stage reads config.json
    first, and said only "not found"), else None."""
    if (Path(model_dir) / "adapter_config.json").is_file():
        return "it holds adapter_config.json: pass it as --adapter, and the model it was trained on as --model"
    return None


# Shapes of public checkpoints, for benchmarks that build random weights on the GPU.
PRESETS = {
    "qwen2.5-3b": dict(arch="qwen2", vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_layers=36,
                       num_heads=16, num_kv_heads=2, head_dim=128, rope_theta=1e6, max_position_embeddings=32768,
                       qkv_bias=True, tie_word_embeddings=True, eos_token_ids=(151645, 151643)),
    "qwen2.5-7b": dict(arch="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                       num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1e6, max_position_embeddings=32768,
                       qkv_bias=True, eos_token_ids=(151645, 151643)),
    "qwen2.5-14b": dict(arch="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_layers=48,
                        num_heads=40, num_kv_heads=8, head_dim=128, rope_theta=1e6, max_position_embeddings=32768,
                        qkv_bias=True, eos_token_ids=(151645, 151643)),
    "qwen2.5-32b": dict(arch="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_layers=64,
                        num_heads=40, num_kv_heads=8, head_dim=128, rope_theta=1e6, max_position_embeddings=32768,
                        qkv_bias=True, eos_token_ids=(151645, 151643)),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise BadInputError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})")
    return ModelConfig(**PRESETS[name])


_HF_SLIDING_DEFAULT = 4096  # MistralConfig's and Qwen2/3Config's default ``sliding_window``
_HF_QWEN_MAX_WINDOW_LAYERS = 28  # Qwen2/3Config's default ``max_window_layers``
_ROPE_KEYS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


def _sliding_window(cfg: dict, arch: str) -> int | None:
    """The attention window as transformers reads the config: Mistral slides in every layer (window
    4096 when the key is absent, none when it is null); Qwen2/3 only with ``use_sliding_window``, and
    then in the layers ``layer_types`` names sliding (by default those from ``max_window_layers`` on).
    qerl computes every layer in full and refuses sequences longer than the window (the engine caps
    its context there), so one window for the model is enough: within it both agree."""
    if arch == "mistral":
        return cfg.get("sliding_window") if "sliding_window" in cfg else _HF_SLIDING_DEFAULT
    if arch not in ("qwen2", "qwen3") or not cfg.get("use_sliding_window"):
        return None
    window = cfg.get("sliding_window") if "sliding_window" in cfg else _HF_SLIDING_DEFAULT
    if window is None:
        return None
    types = cfg.get("layer_types")
    if isinstance(types, list):
        slides = "sliding_attention" in types
    else:
        first = cfg.get("max_window_layers", _HF_QWEN_MAX_WINDOW_LAYERS)
        layers = cfg.get("num_hidden_layers")
        slides = not (isinstance(first, int) and isinstance(layers, int) and first >= layers)
    return window if slides else None


def _rope(cfg: dict, max_pos: int, source: str, pos_float) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) with transformers' precedence: a legacy ``rope_scaling`` replaces
    ``rope_parameters``; the dict's ``rope_theta`` wins over the top-level one (a default only); for
    llama3 a top-level ``original_max_position_embeddings`` wins, else the dict's, else
    ``max_position_embeddings``. What qerl cannot compute is refused here, naming the field."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise BadInputError(f"{source}: rope_parameters / rope_scaling must be an object, got {rope!r}")
    if any(isinstance(v, dict) for v in rope.values()):
        raise BadInputError(f"{source}: rope parameters per layer type are not supported")
    theta = rope.get("rope_theta")
    if theta is None:
        theta = pos_float("rope_theta", 10000.0)
    elif isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise BadInputError(f"{source}: invalid rope_theta in the rope parameters (a positive number, got {theta!r})")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise BadInputError(f"{source}: partial_rotary_factor {partial!r} is not supported (rotary over the whole head only)")
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return float(theta), None
    if kind not in _ROPE_KEYS:
        raise BadInputError(f"{source}: rope_type {kind!r} is not supported (supported: default, linear, llama3)")
    scaling = dict(rope, rope_type=kind)
    for key in _ROPE_KEYS[kind]:
        v = rope.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise BadInputError(f"{source}: rope {kind} needs a positive number {key!r}, got {v!r}")
    if kind == "llama3":
        orig = cfg.get("original_max_position_embeddings", rope.get("original_max_position_embeddings", max_pos))
        if isinstance(orig, bool) or not isinstance(orig, (int, float)) or orig <= 0:
            raise BadInputError(f"{source}: invalid original_max_position_embeddings {orig!r}")
        scaling["original_max_position_embeddings"] = orig
    return float(theta), scaling
