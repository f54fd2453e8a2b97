"""load_model: config.json + safetensors -> CausalLM (NVFP4 or dense base), optional LoRA/adapter.

How it works: the safetensors headers are read first (no data) to learn which Linears are stored
as NVFP4 (``<m>.weight_packed``), the model is built on the meta device (no memory), then each
tensor is read with ``safe_open`` (memory-mapped) one at a time, checked against the expected
shape and moved to the target device/dtype, so peak host memory stays about one tensor. NVFP4
tensors keep their packed on-disk layout; dense Linears (ignored by quantization, or a plain bf16
checkpoint: the 16-bit LoRA baseline) are cast to ``dtype``. ``build_random_model`` builds the same
module directly on a device with random weights for benchmarks that should not need 15-60 GB files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from qerl_cli.checkpoint.safetensors_io import lfs_pointer_hint
from qerl_cli.checkpoint.source import check_tied_head, unindexed_shards
from qerl_cli.errors import BadInputError, NumericalError
from qerl_cli.layers.linear import keep_dense_weights, twiddle_codes_
from qerl_cli.layers.lora import LoraSpec, apply_lora
from qerl_cli.models.config import ModelConfig
from qerl_cli.models.decoder import CausalLM

_QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")
_IGNORED = ("rotary_emb.inv_freq",)
# On CPU an NVFP4 model keeps its dequantized Linear weights up to this size (keep_dense_weights): the
# tiny and test models (a few MB); a 1.5B model in fp32 (~6 GB) decodes per call instead.
CPU_DENSE_WEIGHT_BYTES = 4 << 30


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise BadInputError(f"{index}: malformed index ({e})") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise BadInputError(f"{index}: lists {f.name}, which does not exist")
        return files
    files = unindexed_shards(model_dir)
    if not files:
        raise BadInputError(f"{model_dir}: no *.safetensors weights found")
    return files


def check_quant_config(model_dir: Path) -> dict | None:
    if (model_dir / "hf_quant_config.json").exists():
        raise BadInputError(f"{model_dir}: a ModelOpt checkpoint (hf_quant_config.json); qerl loads compressed-tensors "
                            "NVFP4 or unquantized checkpoints", hint="re-quantize the bf16 model with `qerl quantize` and its default --format compressed-tensors")
    cfg = json.loads((model_dir / "config.json").read_text())
    q = cfg.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method")
    fmt = q.get("format")
    if method != "compressed-tensors" or fmt not in ("nvfp4-pack-quantized", "mixed-precision", None):
        raise BadInputError(
            f"{model_dir / 'config.json'}: quantization_config quant_method={method!r} format={fmt!r} is not supported "
            "(qerl reads compressed-tensors nvfp4-pack-quantized or unquantized checkpoints)"
        )
    return q


def _index_tensors(files: list[Path]) -> dict[str, Path]:
    where = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    where[k] = f
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
            raise BadInputError(f"{f}: cannot read safetensors header ({e})", hint=lfs_pointer_hint(f)) from None
    return where


def _quantized_linears(names) -> set[str]:
    return {n[: -len(".weight_packed")] for n in names if n.endswith(".weight_packed")}


def _expected(model: CausalLM) -> dict[str, torch.Tensor]:
    exp = dict(model.named_parameters(remove_duplicate=False))
    exp.update(dict(model.named_buffers()))
    # Non-persistent buffers (rotary table, AQN noise) are built, never loaded.
    for name, mod in model.named_modules():
        for b in getattr(mod, "_non_persistent_buffers_set", ()):
            exp.pop(f"{name}.{b}" if name else b, None)
    return exp


def check_tensor_names(cfg: ModelConfig, expected, where: dict[str, Path], model_dir: Path) -> None:
    """Refuse a checkpoint whose tensor names are not exactly the decoder's ``expected`` ones: one missing
    (a tied ``lm_head`` may be left out) or one no module holds (``rotary_emb.inv_freq`` is ignored)."""
    tied = cfg.tie_word_embeddings
    missing = [n for n in expected if n not in where and not (tied and n == "lm_head.weight")]
    if missing:
        raise BadInputError(f"{model_dir}: checkpoint lacks tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name, f in where.items():
        if name not in expected and not (tied and name == "lm_head.weight") and not name.endswith(_IGNORED):
            raise BadInputError(f"{f}: unexpected tensor {name!r} (not part of a {cfg.arch} decoder qerl can load)")


def source_tensor_check(cfg: ModelConfig, where: dict[str, Path], model_dir: Path) -> None:
    """``check_tensor_names`` for an unquantized source checkpoint (quantize's input): what quantize would
    write from it must be loadable, so a tensor missing or foreign there is refused before any work."""
    with torch.device("meta"):
        model = CausalLM(cfg, set(), dtype=torch.bfloat16)
    check_tensor_names(cfg, _expected(model), where, model_dir)


def _check_finite(f: Path, name: str, t: torch.Tensor) -> None:
    """NaN/Inf weights would generate garbage (or NaN log-probs) without any error: refuse them."""
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise NumericalError(f"{f}: tensor {name!r} has {bad} NaN/Inf values")


def _set_tensor(model: CausalLM, name: str, value: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    if attr in mod._parameters:
        mod._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
    else:
        mod._buffers[attr] = value


def _init_runtime_buffers(model: CausalLM, device) -> None:
    model.model.rotary.reset(device)
    for mod in model.modules():
        if getattr(mod, "noise_slot", False):
            mod.noise = torch.zeros(mod.weight.shape[0], dtype=torch.float32, device=device)


def load_model(model_dir, device="cpu", dtype: torch.dtype = torch.bfloat16, lora: LoraSpec | None = None,
               adapter_dir=None, max_positions: int | None = None) -> CausalLM:
    """Build the decoder from ``model_dir`` (see module docstring); LoRA wraps after the base loads."""
    from qerl_cli.hashing import model_hash

    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    check_quant_config(model_dir)
    files = _shard_files(model_dir)
    where = _index_tensors(files)
    quantized = _quantized_linears(where)
    if "lm_head" in quantized:  # llm-compressor can write one; the decoder's head is a dense Linear
        raise BadInputError(f"{model_dir}: lm_head is NVFP4-quantized; qerl keeps lm_head in 16 bits",
                            hint="quantize with lm_head in the ignore list (`qerl quantize` does)")
    device = torch.device(device)
    if quantized:  # before the weights load: the layers' first call raised it as a traceback (exit 1)
        from qerl_kernels.ops import kernels_mode_error

        if (why := kernels_mode_error(device)) is not None:
            raise BadInputError(why, hint="unset QERL_KERNELS for the default (auto)")
    with torch.device("meta"):
        model = CausalLM(cfg, quantized, dtype=dtype, max_positions=max_positions)
    expected = _expected(model)
    tied = cfg.tie_word_embeddings
    check_tied_head(tied, where, model_dir / "config.json")
    check_tensor_names(cfg, expected, where, model_dir)
    by_file: dict[Path, list[str]] = {}
    for name, f in where.items():
        if name in expected:
            by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in names:
                t = fh.get_tensor(name)
                want = expected[name]
                if tuple(t.shape) != tuple(want.shape):
                    raise BadInputError(f"{f}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(want.shape)}")
                if name.endswith(_QUANT_SUFFIXES):
                    if t.dtype != want.dtype:
                        raise BadInputError(f"{f}: tensor {name!r} has dtype {t.dtype}, expected {want.dtype}")
                    # Checked where it lands: on a GPU the scan is free, on the host it took ~1 s for a 7B.
                    t = t.to(device)
                    if t.is_floating_point():  # block and global scales (packed codes cannot be NaN)
                        _check_finite(f, name, t.float())
                else:
                    if not (t.is_floating_point()):
                        raise BadInputError(f"{f}: tensor {name!r} has dtype {t.dtype}, expected a float tensor")
                    t = t.to(device)
                    _check_finite(f, name, t)  # in the stored dtype, before any cast
                    t = t.to(dtype=dtype)
                _set_tensor(model, name, t)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    _init_runtime_buffers(model, device)
    maybe_twiddle(model, device, dtype)
    if device.type == "cpu":  # the reference path, which would decode every weight on every call
        keep_dense_weights(model, dtype, CPU_DENSE_WEIGHT_BYTES)
    model.base_hash = model_hash(model_dir)
    model.model_dir = model_dir
    _attach_lora(model, lora, adapter_dir)
    # After the LoRA modules exist: an adapter trained with lora_dropout > 0 samples without dropout.
    return model.eval()


def _attach_lora(model: CausalLM, lora: LoraSpec | None, adapter_dir) -> None:
    from qerl_cli.adapters import load_adapter, load_norms, read_adapter_spec, trained_norms

    if adapter_dir is not None and lora is None:
        lora = read_adapter_spec(adapter_dir, base_dir=model.model_dir)
    if lora is not None:
        try:
            apply_lora(model, lora)
        except ValueError as e:  # named by where the targets came from: the adapter's config, or train-step's flag
            where = f"{Path(adapter_dir) / 'adapter_config.json'} target_modules" if adapter_dir is not None else "--lora-targets"
            raise BadInputError(f"{where}: {e}") from None
    if adapter_dir is not None:
        load_adapter(model, adapter_dir)
        if norms := trained_norms(adapter_dir):  # --train-norms: the policy is the adapter and these norms
            model.base_norms = load_norms(model, norms)


def lora_module_names(model_dir, targets) -> list[str]:
    """The Linears ``load_model(model_dir, lora=...)`` wraps for ``targets``, named from the decoder built on the meta
    device (no weights read): a stage checks an adapter's layout against them before loading anything."""
    from qerl_cli.layers.lora import lora_target_names

    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_dir(Path(model_dir)), set(), dtype=torch.bfloat16)
    return lora_target_names(model, targets)


def build_random_model(config: ModelConfig, device="cuda", dtype: torch.dtype = torch.bfloat16, quantized: bool = True,
                       lora: LoraSpec | None = None, seed: int = 0, std: float = 0.02,
                       max_positions: int | None = None) -> CausalLM:
    """The decoder with random weights made directly on ``device`` (speed does not depend on values).

    Quantized Linears get random E2M1 codes with block scales and a global scale chosen so the
    dequantized weights have about ``std`` spread, so activations stay finite at any depth.
    """
    from qerl_cli.models.decoder import LINEAR_NAMES

    device = torch.device(device)
    names = set()
    if quantized:
        names = {f"model.layers.{i}.{'self_attn' if n.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{n}"
                 for i in range(config.num_layers) for n in LINEAR_NAMES}
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        model = CausalLM(config, names, dtype=dtype, max_positions=max_positions)
    for name, t in _expected(model).items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith("weight_packed"):
            v = torch.randint(0, 256, t.shape, dtype=torch.uint8, device=device, generator=g)
        elif name.endswith("weight_scale"):
            v = (0.75 + 0.5 * torch.rand(t.shape, device=device, generator=g)).to(torch.float8_e4m3fn)
        elif name.endswith("weight_global_scale"):
            # |e2m1| averages ~2.3 with scale ~1, so 2.3 / global ~= std.
            v = torch.full(t.shape, 2.3 / std, dtype=torch.float32, device=device)
        elif name.endswith("norm.weight"):
            v = torch.ones(t.shape, dtype=dtype, device=device)
        else:
            v = (torch.randn(t.shape, device=device, generator=g, dtype=torch.float32) * std).to(dtype)
        _set_tensor(model, name, v)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _init_runtime_buffers(model, device)
    maybe_twiddle(model, device, dtype)
    if device.type == "cpu":  # the reference path, which would decode every weight on every call
        keep_dense_weights(model, dtype, CPU_DENSE_WEIGHT_BYTES)
    model.base_hash = f"random-{seed}"
    model.eval()
    if lora is not None:
        apply_lora(model, lora)
    return model


def maybe_twiddle(model: CausalLM, device, dtype: torch.dtype) -> bool:
    """Put NVFP4 codes in the sm_90 decode's load-time layout where the fast kernels will read them.

    Only for bf16 models on an sm_90+ GPU (the PTX decode's home); ``QERL_TWIDDLE=0`` keeps the
    on-disk layout (for A/B benchmarks and debugging). See ``qerl_kernels.twiddle``.
    """
    import os

    from qerl_kernels.korder import fast_decode_supported

    device = torch.device(device)
    if os.environ.get("QERL_TWIDDLE", "1") == "0" or dtype != torch.bfloat16 or not fast_decode_supported(device):
        return False
    if os.environ.get("QERL_KERNELS") == "reference":
        return False
    twiddle_codes_(model)
    return True

