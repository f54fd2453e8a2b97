"""Stage `qerl merge`: fold a LoRA adapter into its base -> a servable bf16 or NVFP4 checkpoint.

How it works: the adapter (a few MB) is read whole; the base is streamed one tensor at a time.
Each LoRA-targeted Linear is dequantized to fp32 (NVFP4 base) or upcast (bf16/fp32 base), gets
``B @ A * scaling`` added in fp32, and is rounded once to bf16; tensors the adapter trained in
full (PEFT ``modules_to_save``, e.g. RMSNorm weights) replace the base's; everything else is
copied (dequantized for NVFP4 Linears). Peak memory is one tensor plus the adapter, so a 32B
model merges on a laptop. Everything the adapter names is checked against the base's headers
(present, shapes, rank) before any byte is written, so a bad pair fails in seconds.

``--dtype nvfp4`` then quantizes the merged bf16 weights with the same code `qerl quantize`
uses (shared global scales for q/k/v and gate/up), because the merged weight is a new tensor:
its NVFP4 grid is not the base's grid plus something. The trap: an RL update is a few % of a
weight, below the FP4 step, and the dequantized base sits exactly on the grid, so round-to-
nearest snaps most elements straight back to the base (measured: 14% of a real update kept).
``--requantize-from SRC`` adds the update to the bf16 checkpoint the base was quantized from
instead: its weights lie anywhere inside their FP4 bins, so the update moves each across a
boundary with probability proportional to its size and the quantized model keeps the update in
expectation (measured: 101%). The summary reports both the re-quantization error against the
merged bf16 weights and ``update_retained`` (<W1 - W0, D> / <D, D> against the trained-on base),
so a lossy FP4 merge is visible instead of silently serving the base model.

Lineage: an adapter trained by `qerl train-step` records its base's ``model_hash`` in
``trainer_state.json``; merging it into any other base is refused (both hashes named). A plain
PEFT adapter without that file merges with "lineage unverified" in the summary.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from qerl_cli.adapters import (
    PEFT_DEFAULT_ALPHA,
    WEIGHTS,
    check_config_types,
    check_peft_wraps,
    check_untied_head_pair,
    model_not_adapter_hint,
    unsupported_lora_variant,
)
from qerl_cli.errors import BadInputError, LineageError, NumericalError, QerlWarning
from qerl_cli.hashing import CHAT_TEMPLATE_DIR, model_hash, text_files_hash
from qerl_cli.lineage import TRAINER_STATE, check_lineage, recorded_base_hash  # noqa: F401 (re-exported)
from qerl_cli.outputs import StageOutput, check_out_apart
from qerl_cli.runtime import check_field_types

DTYPES = ("bf16", "nvfp4")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass
class MergeConfig:
    model: Path
    adapter: Path
    out: Path
    dtype: str = "bf16"
    max_shard_size: int = 4_000_000_000  # "4GB", the CLI default: the same merge from either is "already done"
    device: str = "auto"  # where dequantize + add run; not in the fingerprint (same math, as in quantize)
    allow_base_mismatch: bool = False
    # --dtype nvfp4: the bf16 checkpoint --model was quantized from; the update is added to it and
    # the sum quantized (keeps the update, see requantize_nvfp4), instead of to the dequantized base
    requantize_from: Path | None = None
    # a Jinja chat template written into the output (chat_template.jinja): the one the rollouts rendered with
    # (their --chat-template-file), which the base's copied tokenizer files lack
    chat_template_file: Path | None = None
    force: bool = False

    def __post_init__(self):
        self.model, self.adapter, self.out = Path(self.model), Path(self.adapter), Path(self.out)
        if self.chat_template_file is not None:
            self.chat_template_file = Path(self.chat_template_file)
        if self.requantize_from is not None:
            self.requantize_from = Path(self.requantize_from)
            if self.dtype != "nvfp4":
                raise BadInputError("--requantize-from only applies to --dtype nvfp4")
        if self.dtype not in DTYPES:
            raise BadInputError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if isinstance(self.max_shard_size, str):  # "2GB", as QuantizeConfig takes it
            from qerl_cli.quantize import parse_size

            self.max_shard_size = parse_size(self.max_shard_size)
        check_field_types(self)  # after "2GB" became its int
        if self.max_shard_size <= 0:
            raise BadInputError(f"--max-shard-size must be positive, got {self.max_shard_size}")
        check_out_apart(self.out, model=self.model, adapter=self.adapter, requantize_from=self.requantize_from,
                        chat_template_file=self.chat_template_file)


# ---- the adapter -----------------------------------------------------------------------------
@dataclass
class LoraDelta:
    """One Linear's low-rank update: W += B @ A * scaling (embedding: W += (B @ A)^T * scaling)."""

    A: torch.Tensor  # [r, in] fp32
    B: torch.Tensor  # [out, r] fp32
    scaling: float
    embedding: bool = False

    def dense(self, device=None) -> torch.Tensor:
        d = (self.B.to(device, torch.float32) @ self.A.to(device, torch.float32)) * self.scaling
        return d.t() if self.embedding else d


@dataclass
class Adapter:
    path: Path
    config: dict
    deltas: dict[str, LoraDelta]  # base module name -> delta
    replacements: dict[str, torch.Tensor]  # base tensor name -> trained tensor (modules_to_save)
    base_hash: str | None  # from trainer_state.json
    hash: str = ""


# (no `.bias`: a lora_bias adapter's lora_B.bias once matched as lora_B, and the weight then overwrote it)
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B)(?:\.(?!bias$)[^.]+)?(?:\.weight)?$")


def _pattern_value(patterns: dict, module: str, default):
    """PEFT rank_pattern/alpha_pattern lookup: a key matches a module name suffix (regex)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter(adapter_dir: Path) -> Adapter:
    """Parse a PEFT LoRA adapter directory into per-module deltas and full-tensor replacements."""
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise BadInputError(f"--adapter {adapter_dir}: not a directory")
    cfg_path, w_path = adapter_dir / ADAPTER_CONFIG, adapter_dir / ADAPTER_WEIGHTS
    for p in (cfg_path, w_path):
        if not p.exists():
            raise BadInputError(f"--adapter {adapter_dir}: {p.name} not found (expected a PEFT adapter directory)",
                                hint=model_not_adapter_hint(adapter_dir))
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise BadInputError(f"{cfg_path}: invalid JSON ({e})") from None
    check_config_types(cfg, cfg_path)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise BadInputError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for flag in ("use_dora", "fan_in_fan_out"):
        if cfg.get(flag):
            raise BadInputError(f"{cfg_path}: {flag}=true is not supported by qerl merge")
    if cfg.get("bias", "none") != "none":
        raise BadInputError(f"{cfg_path}: bias={cfg['bias']!r} adapters are not supported (only bias='none')")
    why = unsupported_lora_variant(cfg)
    if why:
        raise BadInputError(f"{cfg_path}: {why}")
    try:
        tensors = load_file(str(w_path))
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise BadInputError(f"{w_path}: unreadable safetensors file ({e})") from None

    halves: dict[str, dict[str, torch.Tensor]] = {}
    replacements: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        m = _LORA_KEY.match(key)
        if m:
            halves.setdefault(m.group(1), {})[m.group(2)] = t
            continue
        name = key.removeprefix("base_model.model.")
        # PEFT may keep the wrapper path of a modules_to_save copy; the base tensor is the same name without it
        name = re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)
        # PEFT also saves the (base) weight of targeted embeddings/lm_head under the LoRA wrapper's
        # `base_layer` (save_embedding_layers): it is the full tensor that the delta is added to
        name = name.replace(".base_layer.", ".")
        replacements[name] = t

    # only the pairs PEFT's merge_and_unload merges: PEFT wraps only what target_modules, layers_to_transform,
    # exclude_modules and modules_to_save leave it and drops other tensors; merge merged whatever the file held
    check_peft_wraps(cfg, halves, w_path)
    use_rslora = bool(cfg.get("use_rslora", False))
    deltas: dict[str, LoraDelta] = {}
    for module, parts in sorted(halves.items()):
        emb = "lora_embedding_A" in parts or "lora_embedding_B" in parts
        a = parts.get("lora_embedding_A" if emb else "lora_A")
        b = parts.get("lora_embedding_B" if emb else "lora_B")
        if a is None or b is None:
            missing = "A" if a is None else "B"
            raise BadInputError(f"{w_path}: module {module} has no lora_{missing} tensor")
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or a.shape[0] == 0:
            raise BadInputError(
                f"{w_path}: {module} lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not form a rank-r pair"
            )
        r = a.shape[0]
        want_r = _pattern_value(cfg.get("rank_pattern"), module, cfg.get("r", r))
        if want_r != r:
            raise BadInputError(f"{w_path}: {module} has rank {r} but {ADAPTER_CONFIG} says r={want_r}")
        alpha = float(_pattern_value(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA)))
        scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        deltas[module] = LoraDelta(a.float(), b.float(), scaling, embedding=emb)
    if not deltas and not replacements:
        raise BadInputError(f"{w_path}: the adapter holds no LoRA tensors")
    from qerl_cli.adapters import trained_norms

    if norms := trained_norms(adapter_dir):  # train-step --train-norms: they replace the base's norms too
        try:
            replacements.update(load_file(str(norms)))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise BadInputError(f"{norms}: unreadable safetensors file ({e})") from None

    base_hash = recorded_base_hash(adapter_dir)
    from qerl_cli.adapters import adapter_hash

    return Adapter(adapter_dir, cfg, deltas, replacements, base_hash, hash=adapter_hash(adapter_dir))


# ---- the base checkpoint ---------------------------------------------------------------------
def open_base(model_dir: Path, flag: str = "--model"):
    """The base as a streaming ``SourceModel`` (headers only); errors name ``flag``."""
    from qerl_cli.checkpoint import open_source
    from qerl_cli.checkpoint.source import check_tied_head

    try:
        src = open_source(model_dir)
        # An ambiguous head (tied config, a stored lm_head that differs) is refused as the loader and
        # quantize refuse it: merging it picked the embedding without a word (mutation round 4).
        check_tied_head(bool(src.config.get("tie_word_embeddings", False)),
                        {n: t.file for n, t in src.tensors.items()}, Path(model_dir) / "config.json")
        check_base_format(src)
        return src
    except BadInputError as e:
        raise BadInputError(f"{flag}: {e}") from None


# Tensors that only quantized checkpoints hold: GPTQ/AWQ (qweight, qzeros, scales, g_idx), bitsandbytes (absmax,
# quant_map), FP8 (weight_scale_inv), compressed-tensors' int/fp8 formats (weight_zero_point, weight_shape, ...),
# ModelOpt's AWQ smoothing (pre_quant_scale: NVFP4_AWQ, W4A8_AWQ multiply the input by it, so the weight merge reads
# is not the one the model computes with; they have a weight_scale_2 and were merged as plain ModelOpt NVFP4).
_QUANTIZED_LEAVES = ("qweight", "qzeros", "scales", "g_idx", "weight_zero_point", "weight_shape", "weight_scale_inv",
                     "absmax", "quant_map", "weight_packed", "weight_scale", "weight_global_scale", "weight_scale_2",
                     "input_scale", "pre_quant_scale")
# An FP8 KV cache's scales (ModelOpt's k_proj.k_scale/v_proj.v_scale, llm-compressor's self_attn.k_scale/v_scale),
# which NVFP4 checkpoints calibrated for one hold: dropped, as the activation scales are (merge's outputs quantize no
# cache, and qerl's loader refused the merge that kept them).
_KV_CACHE_SCALES = ("k_scale", "v_scale")
_NVFP4_CONFIGS = (("compressed-tensors", "nvfp4-pack-quantized"), ("compressed-tensors", "mixed-precision"),
                  ("compressed-tensors", None), ("modelopt", None))


def check_base_format(src) -> None:
    """Refuse a base quantized in a format merge cannot dequantize (only NVFP4 in either layout, or plain
    weights): an FP8 base's weights were cast to bf16 without their scales and written as a plain checkpoint,
    silently; GPTQ/AWQ/bitsandbytes/int4 bases failed as "module ... is not in --model" or a wrong shape (audit)."""
    hint = "merge into the bf16/fp16/fp32 checkpoint that one was quantized from"
    for key in ("quantization_config", "compression_config"):
        q = src.config.get(key)
        if q is None:
            continue
        method, fmt = (q.get("quant_method"), q.get("format")) if isinstance(q, dict) else (None, None)
        if (method, fmt) not in _NVFP4_CONFIGS:
            raise BadInputError(f"{src.path / 'config.json'}: {key} quant_method={method!r} format={fmt!r}: merge reads "
                                "NVFP4 (compressed-tensors nvfp4-pack-quantized or ModelOpt) or unquantized checkpoints",
                                hint=hint)
    packed = packed_weights(src)
    parts = {n for pw in packed.values() for n in (pw.packed, *pw.side_tensors())}
    for name, info in src.tensors.items():
        leaf = name.rsplit(".", 1)[-1]
        if name not in parts and (leaf in _QUANTIZED_LEAVES or info.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
                                  or (leaf == "weight" and not info.dtype.is_floating_point)):
            raise BadInputError(f"{info.file}: tensor {name} ({str(info.dtype).removeprefix('torch.')}) is not part of an "
                                "NVFP4 weight: the checkpoint is quantized in a format merge cannot dequantize (it reads "
                                "NVFP4 or unquantized checkpoints)", hint=hint)


@dataclass(frozen=True)
class PackedWeight:
    """Where an NVFP4 Linear's parts live, in either on-disk format (see checkpoint.formats)."""

    module: str
    packed: str
    scale: str
    global_scale: str
    multiplier: bool  # ModelOpt's weight_scale_2 multiplies; compressed-tensors' global divides

    def side_tensors(self) -> tuple[str, ...]:
        # then the activation scales of a W4A4 checkpoint (ModelOpt's, llm-compressor's NVFP4 preset): merge's
        # outputs are unquantized or weight-only, and a bf16 merge that kept them was refused by qerl's loader
        return (self.scale, self.global_scale, f"{self.module}.input_scale", f"{self.module}.input_global_scale")


def packed_weights(base) -> dict[str, PackedWeight]:
    """Every NVFP4 Linear of the base, keyed by its packed tensor's name."""
    out = {}
    for name, info in base.tensors.items():
        if name.endswith(".weight_packed") and info.dtype == torch.uint8:  # compressed-tensors (int4 formats: int32)
            m = name.removesuffix(".weight_packed")
            out[name] = PackedWeight(m, name, f"{m}.weight_scale", f"{m}.weight_global_scale", False)
        elif name.endswith(".weight") and info.dtype == torch.uint8 and \
                name.removesuffix(".weight") + ".weight_scale_2" in base.tensors:  # ModelOpt
            m = name.removesuffix(".weight")
            out[name] = PackedWeight(m, name, f"{m}.weight_scale", f"{m}.weight_scale_2", True)
    for pw in out.values():
        for side in pw.side_tensors()[:2]:
            if side not in base.tensors:
                raise BadInputError(f"--model {base.path}: NVFP4 weight {pw.packed} has no {side}")
    return out


def dequantize_packed(reader, pw: PackedWeight, device="cpu") -> torch.Tensor:
    """One NVFP4 Linear's weight in fp32, in either format."""
    from qerl_kernels.reference import dequantize

    g = reader.get(pw.global_scale).to(device, torch.float32).reshape(1)
    codes, scale = reader.get(pw.packed).to(device), reader.get(pw.scale).to(device)
    if pw.multiplier:  # ModelOpt: w = e2m1 * s * weight_scale_2, as its loaders compute it
        return dequantize(codes, scale, torch.ones_like(g), dtype=torch.float32) * g
    return dequantize(codes, scale, g, dtype=torch.float32)


def _side_names(packed: dict[str, PackedWeight]) -> set[str]:
    return {n for pw in packed.values() for n in pw.side_tensors()}


def _dropped_names(base, packed: dict[str, PackedWeight]) -> set[str]:
    """The base's tensors the merged checkpoint leaves out: the NVFP4 weights' scales and the KV cache's."""
    return _side_names(packed) | {n for n in base.tensors if n.rsplit(".", 1)[-1] in _KV_CACHE_SCALES}


def module_shapes(base) -> dict[str, tuple[int, int]]:
    """(out, in) of every 2-D weight the checkpoint holds, dense or NVFP4-packed."""
    packed = packed_weights(base)
    out = {}
    for name, info in base.tensors.items():
        if name in packed and len(info.shape) == 2:
            out[packed[name].module] = (info.shape[0], info.shape[1] * 2)
        elif name.endswith(".weight") and len(info.shape) == 2:
            out[name.removesuffix(".weight")] = info.shape
    return out


def validate_pair(adapter: Adapter, base) -> None:
    """Every LoRA module and replaced tensor exists in the base with fitting shapes."""
    # the base's head, which read_adapter did not know (the readers' one check: adapters.check_peft_wraps)
    check_untied_head_pair(adapter.config, adapter.deltas, adapter.path / WEIGHTS, _tied(base), base.path)
    shapes = module_shapes(base)
    for module, d in adapter.deltas.items():
        if module == "lm_head" and module not in shapes and _tied(base):
            shapes["lm_head"] = shapes[EMBED_WEIGHT.removesuffix(".weight")]  # the head is the tied embedding
        if module not in shapes:
            raise BadInputError(f"--adapter {adapter.path}: module {module} is not in --model {base.path}")
        out_f, in_f = shapes[module]
        want = (in_f, out_f) if d.embedding else (out_f, in_f)
        got = (d.B.shape[0], d.A.shape[1])
        if got != want:
            raise BadInputError(
                f"--adapter {adapter.path}: {module} LoRA maps {got[1]} -> {got[0]} features but the base "
                f"weight is [{out_f}, {in_f}] in --model {base.path}"
            )
    for name, t in adapter.replacements.items():
        if name == LM_HEAD_WEIGHT and name not in base.tensors and _tied(base):  # a copy of the tied head
            if tuple(t.shape) != base.tensors[EMBED_WEIGHT].shape:
                raise BadInputError(f"--adapter {adapter.path}: trained tensor {name} has shape {tuple(t.shape)}, the "
                                    f"base's tied embedding has {base.tensors[EMBED_WEIGHT].shape}")
            continue
        if name not in base.tensors:
            if name.removesuffix(".weight") + ".weight_packed" in base.tensors:
                raise BadInputError(f"--adapter {adapter.path}: {name} is a full-trained copy (modules_to_save) of an "
                                    f"NVFP4-quantized Linear of --model {base.path}, which merge does not support")
            raise BadInputError(f"--adapter {adapter.path}: trained tensor {name} is not in --model {base.path}")
        if tuple(t.shape) != base.tensors[name].shape:
            raise BadInputError(
                f"--adapter {adapter.path}: trained tensor {name} has shape {tuple(t.shape)}, "
                f"the base has {base.tensors[name].shape}"
            )


EMBED_WEIGHT, LM_HEAD_WEIGHT = "model.embed_tokens.weight", "lm_head.weight"
LM_HEAD = LM_HEAD_WEIGHT.removesuffix(".weight")


def unties_lm_head(base, adapter: Adapter) -> bool:
    """A base with tied embeddings whose input embedding the adapter changes (LoRA on embed_tokens or
    a trained copy of it), or whose output head it changes (LoRA on lm_head). The adapter's policy reads
    tokens through its embedding and scores them with its head, each as the adapter made it (PEFT's unmerged
    model; its merge_and_unload unties too), so the merged checkpoint must untie: lm_head is written as the
    original embedding plus the head's own LoRA, if any."""
    return _tied(base) and (EMBED_WEIGHT.removesuffix(".weight") in adapter.deltas or EMBED_WEIGHT in adapter.replacements
                            or LM_HEAD in adapter.deltas or LM_HEAD_WEIGHT in adapter.replacements)


def _tied(base) -> bool:
    return bool(base.config.get("tie_word_embeddings", False))


def _untied_head(base, reader, adapter: Adapter, stats: MergeStats, dtype: torch.dtype, device) -> torch.Tensor:
    """lm_head of an untied merge: the base's own embedding (or the head the adapter saved), plus the adapter's
    LoRA on lm_head where it has one (PEFT applies that to the output head only, not to the input embedding)."""
    w = reader.get(EMBED_WEIGHT)
    if LM_HEAD_WEIGHT in adapter.replacements:  # PEFT saves the head it wraps (a copy, or a trained one)
        rep = adapter.replacements[LM_HEAD_WEIGHT]
        stats.replaced_tensors += not torch.equal(rep.to(w.dtype), w)
        w = rep
    if LM_HEAD not in adapter.deltas:
        return w.to(dtype)
    return _plus_delta(w.to(device, torch.float32), LM_HEAD, LM_HEAD_WEIGHT, base, adapter, stats, device).to(dtype)


def _plus_delta(w: torch.Tensor, module: str, out_name: str, base, adapter: Adapter, stats: MergeStats,
                device) -> torch.Tensor:
    """fp32 ``w`` plus the adapter's LoRA update of ``module`` (if any), refused with NaN/Inf naming the input."""
    base_w = w
    if module in adapter.deltas:
        d = adapter.deltas[module].dense(device)
        stats.add_delta(w, d)
        w = w + d
    # amax propagates NaN and Inf: one reduction instead of a full boolean mask
    if not torch.isfinite(w.abs().amax()):
        # name the input that holds it (a NaN in the base was blamed on the adapter)
        src = f"in --model {base.path}" if not torch.isfinite(base_w.abs().amax()) else f"check --adapter {adapter.path}"
        raise NumericalError(f"merged weight {out_name} has NaN/Inf ({src})")
    return w


def merged_plan(base, dtype: torch.dtype = torch.bfloat16, untie: bool = False) -> list:
    """Names, dtypes and shapes of the merged checkpoint, in the base's file order (``untie``: plus
    ``lm_head.weight`` last, where the base stores none)."""
    from qerl_cli.checkpoint import PlannedTensor

    packed = packed_weights(base)
    side = _dropped_names(base, packed)
    plan = []
    for name, info in base.tensors.items():
        if name in side:
            continue
        if name in packed:
            plan.append(PlannedTensor(f"{packed[name].module}.weight", dtype, (info.shape[0], info.shape[1] * 2)))
        else:
            plan.append(PlannedTensor(name, dtype if info.dtype.is_floating_point else info.dtype, info.shape))
    if untie and LM_HEAD_WEIGHT not in base.tensors:
        plan.append(PlannedTensor(LM_HEAD_WEIGHT, dtype, base.tensors[EMBED_WEIGHT].shape))
    return plan


@dataclass
class MergeStats:
    merged_modules: int = 0
    replaced_tensors: int = 0
    dequantized_modules: int = 0
    tensors_written: int = 0
    delta_rel_norm_mean: float = 0.0  # ||B A s|| / ||W|| averaged over merged modules
    delta_rel_norm_max: float = 0.0
    _sum: float = field(default=0.0, repr=False)

    def add_delta(self, w: torch.Tensor, d: torch.Tensor) -> None:
        rel = float(d.norm() / w.norm().clamp_min(1e-30))
        self.merged_modules += 1
        self._sum += rel
        self.delta_rel_norm_mean = self._sum / self.merged_modules
        self.delta_rel_norm_max = max(self.delta_rel_norm_max, rel)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("_sum")
        return {k: (round(v, 8) if isinstance(v, float) else v) for k, v in d.items()}


def merged_tensors(base, reader, adapter: Adapter, stats: MergeStats, dtype: torch.dtype = torch.bfloat16,
                   device: torch.device | str = "cpu", untie: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the merged checkpoint in ``merged_plan`` order, one at a time; ``untie``
    (``unties_lm_head``): lm_head is the base's own embedding, whatever the adapter did to it, plus the
    adapter's lm_head LoRA where it has one.

    LoRA-targeted and NVFP4 weights are formed in fp32 on ``device`` and rounded to ``dtype`` once;
    the result is identical on CPU and CUDA up to the fp32 matmul's summation order.
    """

    packed = packed_weights(base)
    side = _dropped_names(base, packed)
    for name in base.tensors:
        if name in side:
            continue  # consumed with its packed weight
        if name in packed:
            pw = packed[name]
            module = pw.module
            w = dequantize_packed(reader, pw, device)
            stats.dequantized_modules += 1
            out_name = f"{module}.weight"
        else:
            if untie and name == LM_HEAD_WEIGHT:  # a stored lm_head is the base's embedding (unties_lm_head)
                yield name, _untied_head(base, reader, adapter, stats, dtype, device)
                continue
            t = reader.get(name)
            where = f"in --model {base.path}"
            if name in adapter.replacements:
                rep = adapter.replacements[name]
                # PEFT's saved base_layer copies equal the base; only really trained tensors count
                stats.replaced_tensors += not torch.equal(rep.to(t.dtype), t)
                t, where = rep, f"trained, in --adapter {adapter.path}"
            module = name.removesuffix(".weight") if name.endswith(".weight") else None
            if module is None or module not in adapter.deltas:
                if t.is_floating_point() and not torch.isfinite(t.float()).all():
                    raise NumericalError(f"tensor {name} has NaN/Inf ({where})")
                yield name, t.to(dtype) if t.is_floating_point() else t
                continue
            w, out_name = t.to(device, torch.float32), name
        yield out_name, _plus_delta(w, module, out_name, base, adapter, stats, device).to(dtype)
    if untie and LM_HEAD_WEIGHT not in base.tensors:
        yield LM_HEAD_WEIGHT, _untied_head(base, reader, adapter, stats, dtype, device)


# ---- output ----------------------------------------------------------------------------------
def write_checkpoint(plan, tensors: Iterator[tuple[str, torch.Tensor]], out_dir: Path, max_shard_size: int,
                     on_tensor=None) -> None:
    """Stream tensors into planned HF shards (+ index): one tensor in memory at a time."""
    from qerl_cli.checkpoint import ShardedWriter

    writer = ShardedWriter(out_dir, plan, max_shard_size)
    try:
        for name, t in tensors:
            writer.write(name, t)
            if on_tensor:
                on_tensor(name)
        writer.close()
    except BaseException:
        writer.abort()
        raise


def write_plain_config(base, out_dir: Path, torch_dtype: str = "bfloat16", untie: bool = False) -> None:
    """config.json without quantization_config; tokenizer, chat template, generation config and other
    side files copied as `qerl quantize` copies them (never weights, pickles or quantization files)."""
    from qerl_cli.quantize import copy_side_files

    cfg = dict(base.config)
    cfg.pop("quantization_config", None)
    cfg.pop("compression_config", None)
    if untie:
        cfg["tie_word_embeddings"] = False
    cfg["torch_dtype"] = torch_dtype
    if "dtype" in cfg:
        cfg["dtype"] = torch_dtype
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    copy_side_files(base, out_dir)


# ---- the stage -------------------------------------------------------------------------------
def merge(cfg: MergeConfig, *, progress: bool = True) -> dict:
    """Run `qerl merge`; returns the output manifest (with ``summary``)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from qerl_cli.quantize import resolve_device

    t0 = time.time()
    device = resolve_device(cfg.device)
    adapter = read_adapter(cfg.adapter)
    base = open_base(cfg.model)
    base_hash = model_hash(cfg.model)
    modelopt = any(n.endswith(".weight_scale_2") for n in base.tensors)
    # qerl trains on compressed-tensors only, so an adapter's recorded base is never a ModelOpt directory:
    # say how to merge into a ModelOpt copy of the same source (the hint said only "the model it was trained on").
    hint = ("its recorded base is the compressed-tensors checkpoint it was trained on; if --model is a ModelOpt "
            "quantization of the same source (qerl quantize --format modelopt), that is expected"
            if modelopt else "merge it into the model it was trained on")
    lineage = check_lineage(adapter.path, cfg.model, base_hash, recorded=adapter.base_hash, hint=hint,
                            allow_mismatch=cfg.allow_base_mismatch)
    validate_pair(adapter, base)
    if cfg.dtype == "nvfp4":  # refused by the final quantize only after the whole bf16 merge, naming a temp dir
        from qerl_cli.quantize import check_supported_config

        try:
            check_supported_config(base.config, cfg.model / "config.json")
        except BadInputError as e:
            raise BadInputError(f"--model {e}", hint="--dtype nvfp4 re-quantizes with `qerl quantize`, which supports "
                                "only these; --dtype bf16 merges any architecture") from None
    from qerl_cli.adapters import norms_input

    inputs = {"model": base_hash, "adapter": adapter.hash, **norms_input(adapter.path)}
    # The tensors the update is added to: the base itself, or (--requantize-from) its bf16 source.
    target = base
    if cfg.requantize_from is not None:
        target = open_base(cfg.requantize_from, "--requantize-from")
        inputs["requantize_from"] = check_source_of(cfg.model, cfg.requantize_from, cfg.allow_base_mismatch)
        if packed_weights(target):
            raise BadInputError(f"--requantize-from {cfg.requantize_from} is quantized; name the bf16 checkpoint "
                                f"that --model was quantized from")
        validate_pair(adapter, target)

    chat_text, chat_sha = _chat_template(cfg, adapter)
    if chat_sha is not None:  # in the legacy inputs too: an older merge made without the template is not this one
        inputs["chat_template"] = chat_sha
    legacy_inputs = dict(inputs)  # qerl before 2026-11-28 did not count the text files merge copies
    inputs["base_text"] = text_files_hash(cfg.model)
    # The tokenizer, chat template and generation config are copied verbatim: a base whose copies were fixed
    # since (an eos, a template) made the rerun "already done" with the stale ones, and eval of the merge then
    # stopped or prompted otherwise than eval of base + adapter. An older output is done while its copies match.
    current = text_files_hash(cfg.out) == inputs["base_text"] if cfg.out.is_dir() else False
    so = StageOutput(
        cfg.out, "merge",
        config={"dtype": cfg.dtype, "max_shard_size": cfg.max_shard_size},
        inputs=inputs,
        force=cfg.force,
        started=t0,
        legacy_inputs=(legacy_inputs,) if current else (),
    )
    if so.already_done():
        so.manifest["already_done"] = True
        return so.manifest

    from qerl_cli.checkpoint import TensorReader

    stats = MergeStats()
    untie = unties_lm_head(base, adapter)
    plan = merged_plan(target, untie=untie)
    with so as work, TensorReader(target.tensors) as reader, Progress(
        TextColumn("[bold]merge[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
        TimeElapsedColumn(), disable=not progress, transient=True, console=Console(stderr=True),
    ) as bar:
        task = bar.add_task("", total=len(plan))

        def tick(name):
            stats.tensors_written += 1
            bar.update(task, advance=1, description=name)

        bf16_dir = work if cfg.dtype == "bf16" else work / ".merged-bf16"
        bf16_dir.mkdir(exist_ok=True)
        write_checkpoint(plan, merged_tensors(target, reader, adapter, stats, device=device, untie=untie), bf16_dir,
                         cfg.max_shard_size, on_tensor=tick)
        write_plain_config(base, bf16_dir, untie=untie)
        if chat_text is not None:
            write_chat_template(bf16_dir, chat_text)  # before the nvfp4 re-quantization, which copies it on
        summary = {
            "dtype": cfg.dtype,
            "device": str(device),
            "base_quantized": bool(packed_weights(base)),
            "lineage": lineage,
            "adapter_base_hash": adapter.base_hash,
            "base_hash": base_hash,
            "untied_lm_head": untie,
            **stats.as_dict(),
        }
        if cfg.dtype == "nvfp4":
            rq = requantize_nvfp4(bf16_dir, work, cfg, progress=progress)
            rq["from"] = "source" if cfg.requantize_from is not None else "dequantized base"
            rq.update(update_retention(base, work, adapter))
            summary["requantization"] = rq
            _warn_of_low_retention(rq, cfg)
            shutil.rmtree(bf16_dir)
        so.timings["merge_s"] = round(time.time() - t0, 3)
        so.extra["summary"] = summary
    return dict(so.manifest, already_done=False)  # the key a rerun's has too


def _chat_template(cfg: MergeConfig, adapter: Adapter) -> tuple[str | None, str | None]:
    """(``--chat-template-file``'s text, its sha256), checked by rendering a conversation with --model's
    tokenizer, or (None, None); and a warning when the adapter's last rollouts rendered their prompts with another
    template than the output carries: the merged checkpoint then prompts (apply_chat_template, vLLM's chat API,
    `qerl eval` without the flag) otherwise than the policy was trained on, or fails for want of one (a review)."""
    from qerl_cli.data import read_chat_template, set_chat_template
    from qerl_cli.runtime import load_tokenizer

    text = sha = None
    if cfg.chat_template_file is not None:
        text, sha = read_chat_template(cfg.chat_template_file)
        set_chat_template(load_tokenizer(cfg.model), text, cfg.chat_template_file)
        kept_named_templates(cfg.model)  # a name write_chat_template cannot save: refused before the merge, not after
    trained = trained_chat_template(adapter.path)
    if trained is not None and trained != (sha or own_chat_template(cfg.model)):
        given = (f"--chat-template-file {cfg.chat_template_file} is another" if sha else
                 "the merged checkpoint gets --model's template (or none)")
        warnings.warn(QerlWarning(
            f"--adapter {adapter.path} was trained on prompts its rollouts rendered with a --chat-template-file "
            f"(sha256 {trained[:12]}), but {given}: apply_chat_template on the merged model prompts otherwise or "
            "fails; pass the rollouts' template file as --chat-template-file"),
            stacklevel=3)
    return text, sha


def trained_chat_template(adapter_dir: Path) -> str | None:
    """The sha256 of the ``--chat-template-file`` the rollouts of the adapter's last train-step used, from their
    manifests (trainer_state.json's ``last_shards``); None when they used none or are gone (a hint only)."""
    from qerl_cli.outputs import read_manifest

    try:
        shards = json.loads((Path(adapter_dir) / TRAINER_STATE).read_text()).get("last_shards") or []
    except (OSError, ValueError, AttributeError):
        return None
    for shard in shards if isinstance(shards, list) else ():
        m = read_manifest(Path(str(shard)).parent) or {}
        sha = (m.get("inputs") or {}).get("chat_template") if m.get("stage") == "rollout" else None
        if isinstance(sha, str):
            return sha
    return None


def own_chat_template(model_dir: Path) -> str | None:
    """The sha256 of the default chat template a model directory's tokenizer files hold (chat_template.jinja, else
    tokenizer_config.json's ``chat_template``: a string, or the "default" of a list of named ones), as
    read_chat_template hashes a file's; None without one."""
    from qerl_cli.hashing import sha256_bytes

    jinja, config = Path(model_dir) / "chat_template.jinja", Path(model_dir) / "tokenizer_config.json"
    try:
        text = (jinja.read_text(encoding="utf-8") if jinja.is_file() else
                named_chat_templates(json.loads(config.read_text()).get("chat_template")).get("default"))
    except (OSError, ValueError, AttributeError):
        return None
    return sha256_bytes(text.encode()) if isinstance(text, str) and text.strip() else None


def named_chat_templates(value) -> dict[str, str]:
    """tokenizer_config.json's ``chat_template`` by name, as transformers reads it: a string is the "default"; a
    list of {"name", "template"} is its older form for several ("default", "tool_use", ...); anything else, none."""
    if isinstance(value, str):
        return {"default": value}
    return {t["name"]: t["template"] for t in value if isinstance(t, dict) and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str)} if isinstance(value, list) else {}


def kept_named_templates(model_dir: Path) -> dict[str, str]:
    """The named chat templates other than "default" of a model directory's tokenizer_config.json (a list), which a
    merge with --chat-template-file saves as files (``write_chat_template``); none where the directory has .jinja
    files, which transformers reads instead of that key. A name that is no file name ("../x") is refused, as
    transformers refuses to save it: merge checks --model's before the merge (found in the copy after it, the error
    came after the whole merge and named the temporary directory's copy)."""
    model_dir = Path(model_dir)
    config = model_dir / "tokenizer_config.json"
    if ((model_dir / "chat_template.jinja").is_file() or any((model_dir / CHAT_TEMPLATE_DIR).glob("*.jinja"))
            or not config.is_file()):
        return {}
    data = json.loads(config.read_text())
    others = {k: v for k, v in named_chat_templates(data.get("chat_template") if isinstance(data, dict) else None).items()
              if k != "default"}
    for name in others:
        if Path(name).name != name or name in ("", ".", ".."):
            raise BadInputError(f"{config}: chat template name {name!r} is no file name",
                                hint="rename it there (a file name: transformers saves each as NAME.jinja), or merge "
                                "without --chat-template-file")
    return others


def write_chat_template(out_dir: Path, text: str) -> None:
    """``text`` as the checkpoint's chat template, as transformers 5 saves one: chat_template.jinja, which its
    tokenizers read before tokenizer_config.json's ``chat_template`` key; that key (the base's) is dropped, as
    transformers' save_pretrained drops it, so no reader finds the base's template instead. The base's other named
    templates in that key (a list) go to ``CHAT_TEMPLATE_DIR`` as transformers saves them: dropped with the key,
    the merged tokenizer lost "tool_use" and the like, which a base in the .jinja form kept."""
    others = kept_named_templates(out_dir)  # before chat_template.jinja is written: with the base's, the key was ignored
    (out_dir / "chat_template.jinja").write_text(text, encoding="utf-8")
    config = out_dir / "tokenizer_config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        if isinstance(data, dict) and data.pop("chat_template", None) is not None:
            config.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    for name, template in others.items():
        (out_dir / CHAT_TEMPLATE_DIR).mkdir(exist_ok=True)
        (out_dir / CHAT_TEMPLATE_DIR / f"{name}.jinja").write_text(template, encoding="utf-8")


LOW_RETENTION = 0.5  # below this the FP4 merge is closer to the base than to the trained policy


def retained_percent(kept: float) -> int:
    """``update_retained`` as the warning and the result line both print it (they said 17% and 18% for 0.1779):
    toward zero, so never "50%" under the 50% threshold, nor "-0%"."""
    return int(round(100 * kept, 6))  # 100 * 0.57 is 56.99999999999999: the rounding error is not a percent


def _warn_of_low_retention(rq: dict, cfg: MergeConfig) -> None:
    kept = rq.get("update_retained")
    if kept is None or kept >= LOW_RETENTION:
        return
    from qerl_cli.outputs import read_manifest

    pct = retained_percent(kept)
    said = f"re-quantizing kept only {pct}% of the LoRA update (small updates round back onto the base's FP4 grid)"
    if cfg.requantize_from is not None:  # added to the bf16 source already: FP4 cannot hold this update
        advice = "the update is below what FP4 resolves even from the bf16 source; serve the bf16 merge (--dtype bf16)"
    else:
        src = (read_manifest(Path(cfg.model)) or {}).get("source")
        advice = (f"pass --requantize-from {src or 'BF16_SOURCE_DIR'} to add it to the bf16 source instead, or "
                  "serve the bf16 merge")
    warnings.warn(QerlWarning(f"{said}; {advice}"), stacklevel=3)


def check_source_of(model_dir: Path, source: Path, allow_mismatch: bool = False) -> str:
    """The hash of ``source`` after checking that `qerl quantize` made ``model_dir`` from it (its manifest)."""
    from qerl_cli.outputs import read_manifest

    source_hash = model_hash(source)
    m = read_manifest(model_dir)
    recorded = (m or {}).get("inputs", {}).get("src_model_hash") if (m or {}).get("stage") == "quantize" else None
    if recorded == source_hash or allow_mismatch:
        return source_hash
    if recorded is None:
        raise LineageError(f"--model {model_dir} has no `qerl quantize` manifest naming its source, so "
                           f"--requantize-from {source} cannot be checked",
                           hint="pass --allow-base-mismatch if you are sure it is the source")
    raise LineageError(f"--model {model_dir} was quantized from a model with hash {recorded[:12]}, but "
                       f"--requantize-from {source} has hash {source_hash[:12]}",
                       hint=f"name the source recorded in {model_dir}/manifest.json ({(m or {}).get('source', '?')})")


def update_retention(base, out_dir: Path, adapter: Adapter) -> dict:
    """How much of the LoRA update the NVFP4 output keeps, relative to the NVFP4 base it was trained on.

    For each merged Linear, with D = B@A*s, W0 = dequant(base) and W1 = dequant(output):
    ``retained = <W1 - W0, D> / <D, D>`` summed over modules (1: the update is there on average;
    0: re-quantization snapped the weights back onto the base's grid) and
    ``error = ||W1 - W0 - D|| / ||D||``. Only for NVFP4 bases (otherwise there is no trained-on grid).
    """

    from qerl_cli.checkpoint import TensorReader, open_source

    packed = {pw.module: pw for pw in packed_weights(base).values()}
    mods = [m for m in adapter.deltas if m in packed]
    if not mods:
        return {"update_retained": None, "update_rel_error": None}
    out = open_source(out_dir)
    dot = dd = err = 0.0
    with TensorReader(base.tensors) as rb, TensorReader(out.tensors) as ro:
        for m in mods:
            d = adapter.deltas[m].dense()
            w0 = dequantize_packed(rb, packed[m])
            w1 = dequantize_packed(ro, PackedWeight(m, f"{m}.weight_packed", f"{m}.weight_scale",
                                                    f"{m}.weight_global_scale", False))
            dw = w1 - w0
            dot += float((dw * d).sum())
            dd += float((d * d).sum())
            err += float(((dw - d) ** 2).sum())
    if dd == 0:
        return {"update_retained": None, "update_rel_error": None}
    return {"update_retained": round(dot / dd, 4), "update_rel_error": round(math.sqrt(err / dd), 4)}


def requantize_nvfp4(bf16_dir: Path, out_dir: Path, cfg: MergeConfig, *, progress: bool = True) -> dict:
    """Quantize the merged bf16 checkpoint into ``out_dir`` with `qerl quantize`'s own code (same
    format, same shared q/k/v and gate/up global scales, same error measure) and return the
    re-quantization error summary: relative Frobenius error of each re-quantized Linear against the
    merged bf16 weight."""
    from qerl_cli.outputs import forget_completed
    from qerl_cli.quantize import QuantizeConfig, quantize

    tmp = out_dir / ".nvfp4"
    try:
        res = quantize(QuantizeConfig(src=bf16_dir, out=tmp, format="compressed-tensors", device=cfg.device,
                                      max_shard_size=str(cfg.max_shard_size), progress=progress))
    finally:  # the inner output in merge's temp dir is not --out: a signal now must not call it complete
        forget_completed(tmp)
    for p in tmp.iterdir():
        if p.name != "manifest.json":  # the merge manifest replaces quantize's
            p.rename(out_dir / p.name)
    shutil.rmtree(tmp)
    s = res.summary
    return {
        "format": s["format"],
        "quantized_linears": s["quantized_linears"],
        "kept_linears": s["kept_linears"],
        "rel_err_mean": s["mean_rel_error"],
        "rel_err_max": s["max_rel_error"]["value"],
        "rel_err_max_module": s["max_rel_error"]["module"],
        "per_layer_max_rel_error": s["per_layer_max_rel_error"],
        "size_bytes": s["size_after_bytes"],
    }
