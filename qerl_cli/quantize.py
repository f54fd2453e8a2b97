"""Stage ``quantize``: a Hugging Face safetensors checkpoint -> an NVFP4 (W4A16) checkpoint.

How it works. The source is validated and its tensors listed from the safetensors headers
alone (``checkpoint.source``). Tensors are then processed in *units*, in file order so
reads are sequential: a unit is one tensor, except that q/k/v of a layer form one unit and
gate/up another, because those siblings must share one global scale (vLLM fuses them) and
the shared scale needs every sibling's amax. Grouping by layer costs at most
``gate + up`` in memory, while a separate amax pass would read every Linear twice. Each
quantized Linear goes through ``qerl_kernels.reference.quantize`` (bit-identical to
compressed-tensors) on ``--device``; everything else (embeddings, lm_head, norms, biases,
Linears whose in-features is not a multiple of 16) is copied byte for byte.

Memory and speed trade-off. Three units are in flight: the next one being read (a thread),
the current one on the device, the previous one being written (a thread), so disk reads,
device compute and disk writes overlap while host memory stays below three times the
largest unit, independent of model size (the largest units are the embedding and lm_head:
1.1 GB each for Qwen2.5-7B, 1.6 GB for 32B). Linears are quantized in row blocks and NaN
checks run in slices, so temporaries stay small next to that. Output
shards are laid out from the source headers before any weight is read
(``checkpoint.safetensors_io.ShardedWriter``) and written as tensors arrive.

The output directory goes through ``StageOutput``: temp dir, manifest, rename, so an
interrupted run leaves nothing; a rerun with the same source and arguments is "already done".
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from qerl_kernels import reference as nvfp4

from qerl_cli.checkpoint import (
    FORMATS,
    SUPPORTED_MODEL_TYPES,
    NVFP4Format,
    PlannedTensor,
    ShardedWriter,
    SourceModel,
    TensorReader,
    open_source,
    parse_linear,
)
from qerl_cli.checkpoint.source import PICKLE_SUFFIXES, check_tied_head
from qerl_cli.errors import BadInputError, NumericalError, OutOfMemoryError
from qerl_cli.hashing import CHAT_TEMPLATE_DIR, model_hash, sha256_file, text_files_hash
from qerl_cli.outputs import MANIFEST, StageOutput
from qerl_cli.runtime import check_field_types

STAGE = "quantize"
_QUANT_SUFFIXES = (
    "weight_packed",
    "weight_scale",
    "weight_global_scale",
    "weight_scale_2",
    "qweight",
    "scales",
)
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_FP4 = nvfp4.FP8_MAX * nvfp4.FP4_MAX


@dataclass
class QuantizeConfig:
    """Arguments of one quantize run (what the CLI flags parse into)."""

    src: Path
    out: Path
    format: str = "compressed-tensors"
    device: str = "auto"
    max_shard_size: str = "5GB"
    force: bool = False
    progress: bool = True

    def __post_init__(self):
        check_field_types(self)


@dataclass
class QuantizeResult:
    out: Path
    already_done: bool
    summary: dict = field(default_factory=dict)
    manifest: dict | None = None


# ---- planning ------------------------------------------------------------------------------
@dataclass
class Unit:
    """Tensors processed together. ``quant``: (tensor name, module) pairs sharing one global scale."""

    key: str
    quant: list[tuple[str, str]] = field(default_factory=list)
    copy: list[str] = field(default_factory=list)

    def names(self) -> list[str]:
        return [n for n, _ in self.quant] + self.copy


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '64KiB' or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise BadInputError(f"--max-shard-size {text!r} is not a size (examples: 5GB, 500MB)")
    base = 1024 if m[3] else 1000
    return int(float(m[1]) * base ** " KMGT".index(m[2].upper() or " "))


def _check_source(source: SourceModel) -> None:
    cfg = source.config
    for key in ("quantization_config", "compression_config"):
        if cfg.get(key) is not None:  # `null` is a plain model to transformers and to qerl's loader
            method = (cfg[key] or {}).get("quant_method", "?") if isinstance(cfg[key], dict) else "?"
            raise BadInputError(
                f"source {source.path} is already quantized (config.json has {key}, quant_method={method})",
                hint="pass the original bf16/fp16 checkpoint",
            )
    if (source.path / "hf_quant_config.json").exists():
        raise BadInputError(f"source {source.path} is already quantized (it has hf_quant_config.json)")
    for name, info in source.tensors.items():
        if name.rsplit(".", 1)[-1] in _QUANT_SUFFIXES or info.dtype in (
            torch.float8_e4m3fn,
            torch.float8_e5m2,
        ):
            raise BadInputError(
                f"source {source.path} is already quantized (tensor {name} in {info.file.name})"
            )
    _check_shapes_and_dtypes(source, check_supported_config(cfg, source.path / "config.json"))


def check_supported_config(cfg: dict, config_path: Path):
    """A model_type quantize supports, with a config qerl's decoder parses (rope, heads, ...): also what
    `merge --dtype nvfp4` checks before it merges, since it quantizes the merged checkpoint last. Returns the
    parsed ``ModelConfig``."""
    from qerl_cli.models.config import ModelConfig

    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise BadInputError(
            f"{config_path}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return ModelConfig.from_hf(cfg, str(config_path))


def _check_shapes_and_dtypes(source: SourceModel, c) -> None:
    """Weights must be float tensors, and decoder Linears must have the shapes config.json implies:
    otherwise quantize would write a checkpoint that no loader accepts. ``c``: its parsed config."""
    from qerl_cli.models.loader import source_tensor_check

    where = {n: t.file for n, t in source.tensors.items()}
    check_tied_head(c.tie_word_embeddings, where, source.path / "config.json")
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    H, inter = c.hidden_size, c.intermediate_size
    want = {
        "q_proj": (q_out, H),
        "k_proj": (kv_out, H),
        "v_proj": (kv_out, H),
        "o_proj": (H, q_out),
        "gate_proj": (inter, H),
        "up_proj": (inter, H),
        "down_proj": (H, inter),
    }
    for name, info in source.tensors.items():
        if name.endswith((".weight", ".bias")) and info.dtype not in _FLOAT_DTYPES:
            raise BadInputError(
                f"{info.file}: tensor {name} has dtype {info.dtype}, expected bf16/fp16/fp32 weights"
            )
        lin = parse_linear(name)
        if lin is not None and name.endswith(".weight") and lin.proj in want and info.shape != want[lin.proj]:
            raise BadInputError(
                f"{info.file}: tensor {name} has shape {list(info.shape)} but config.json implies "
                f"{list(want[lin.proj])}"
            )
    source_tensor_check(c, where, source.path)  # after the shapes: their message is the more precise one


def plan_units(source: SourceModel) -> tuple[list[Unit], list[str]]:
    """Group tensors into units in file order; returns (units, Linears kept unquantized)."""
    units: dict[str, Unit] = {}
    kept_linears: list[str] = []
    for name, info in source.tensors.items():
        lin = parse_linear(name)
        quantizable = (
            lin is not None
            and len(info.shape) == 2
            and info.shape[1] % nvfp4.GROUP == 0
            and info.dtype in _FLOAT_DTYPES
        )
        if lin is not None and not quantizable:
            kept_linears.append(lin.module)
        if quantizable:
            unit = units.setdefault(lin.fusion_key, Unit(lin.fusion_key))
            unit.quant.append((name, lin.module))
        else:
            units.setdefault(name, Unit(name)).copy.append(name)
    for unit in units.values():
        unit.quant.sort(key=lambda nm: parse_linear(nm[0]).order)
    return list(units.values()), kept_linears


def plan_outputs(source: SourceModel, units: list[Unit], fmt: NVFP4Format) -> list[PlannedTensor]:
    plan = []
    for unit in units:
        for name, module in unit.quant:
            n, k = source.tensors[name].shape
            plan += fmt.planned(module, n, k)
        for name in unit.copy:
            info = source.tensors[name]
            plan.append(PlannedTensor(name, info.dtype, info.shape))
    return plan


def resolve_device(device: str) -> torch.device:
    """``runtime.resolve_device`` as a torch.device: the same auto/cpu/cuda[:N] every stage takes (quantize and
    merge refused cuda:N, which a recipe's one DEVICE passes to every stage: a review)."""
    from qerl_cli.runtime import resolve_device as resolve

    return torch.device(resolve(device))


# ---- the work --------------------------------------------------------------------------------
def _check_finite(name: str, t: torch.Tensor, source: SourceModel) -> None:
    """NumericalError naming the tensor if it holds NaN/Inf.

    Checked in 4 Mi-element slices: ``isfinite`` on a whole bf16 embedding upcasts it on CPU,
    a transient 2.5x the tensor's size, which was the peak of the whole run.
    """
    if not t.is_floating_point():
        return
    flat = t.reshape(-1)
    step = max(flat.numel(), 1) if t.is_cuda else 1 << 22  # on the GPU one pass: no host memory, one sync
    if all(bool(torch.isfinite(flat[i : i + step]).all()) for i in range(0, flat.numel(), step)):
        return
    bad = sum(int((~torch.isfinite(flat[i : i + step])).sum()) for i in range(0, flat.numel(), step))
    raise NumericalError(
        f"tensor {name} in {source.tensors[name].file.name} has {bad} NaN/Inf values; nothing was written"
    )


def _global_scale(w: torch.Tensor, module: str, stats: dict) -> torch.Tensor:
    """compressed-tensors' global (448*6/amax in the weight's dtype), except where that overflows.

    In fp16, 2688/amax overflows for amax < 2688/65504 ~ 0.041; compressed-tensors then falls
    back to a global of 1.0, which underflows the fp8 block scales and wrecks the layer (~90%
    relative error). qerl computes such a global in fp32 instead and lists the module in the
    summary: those tensors are the only ones not bit-identical to llm-compressor's output.
    """
    amax = w.abs().amax()
    g = nvfp4.global_scale_for(amax)
    if float(amax) > 0 and float(g) == 1.0 and FP8_FP4 / float(amax) > 1.0:
        g32 = nvfp4.global_scale_for(amax.to(torch.float32))
        if float(g32) != 1.0:  # fp32 overflows too below amax ~ 8e-36: then the global stays 1.0, unreported
            stats["fp32_global_fallback"].append(module)
            g = g32
    return g


def _quantize_in_row_blocks(w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Quantize ``w`` with the fixed global ``g`` a block of rows at a time; also its relative error.

    With the global fixed, NVFP4 is row-independent, so blocks give the same bytes as one call,
    while the fp32/int temporaries (~10x the bf16 size) stay bounded: 64 MiB-element blocks on
    CUDA, 4 Mi elements on CPU, where they would otherwise dominate peak host memory.
    """
    n, k = w.shape
    rows = max(1, (1 << (26 if w.is_cuda else 22)) // k)
    packed, scales = [], []
    err2 = ref2 = 0.0
    # Norms of w / 2^e with 2^e ~ amax (a power of two: exact, the same sums as unscaled): fp32 norms
    # of tiny weights underflowed to 0, which reported a layer quantized to all zeros as 0% error. One
    # below frexp's exponent (ratios < 2): for amax > 2^127 the scale 2^128 is inf in fp32 and reported 0%.
    amax = 2.0 ** (math.frexp(float(w.abs().amax()) or 1.0)[1] - 1)
    for i in range(0, n, rows):
        blk = w[i : i + rows]
        p, s, _ = nvfp4.quantize(blk, g)
        wf = blk.to(torch.float32)
        deq = nvfp4.dequantize(p, s, g, dtype=torch.float32)
        err2 += float(torch.linalg.vector_norm((deq - wf) / amax)) ** 2
        ref2 += float(torch.linalg.vector_norm(wf / amax)) ** 2
        packed.append(p)
        scales.append(s)
        del wf, deq
    packed_t = packed[0] if len(packed) == 1 else torch.cat(packed)
    scale_t = scales[0] if len(scales) == 1 else torch.cat(scales)
    return packed_t, scale_t, (err2 / ref2) ** 0.5 if ref2 > 0 else 0.0


def _process_unit(unit: Unit, tensors: dict[str, torch.Tensor], source, fmt, device, stats) -> list:
    """Quantize/copy one unit; returns the output (name, cpu tensor) list in plan order."""
    out: list[tuple[str, torch.Tensor]] = []
    if unit.quant:
        ws = []
        for name, _ in unit.quant:
            w = tensors[name].to(device)
            _check_finite(name, w, source)
            ws.append(w)
        # Shared global = min of the siblings' globals, each computed as compressed-tensors does, over
        # the siblings that have a nonzero weight: an all-zero one's global is the 1.0 fallback (2688/0
        # is inf), which as the minimum would push the others' block scales into fp8's subnormals
        # (rel. error 0.1-0.6 instead of ~0.09). All-zero weights quantize to zero codes under any global.
        live = [(module, w) for (_, module), w in zip(unit.quant, ws) if bool(w.abs().amax() > 0)]
        globals_ = [_global_scale(w, module, stats) for module, w in live] or [_global_scale(ws[0], "", stats)]
        g = torch.min(torch.cat(globals_)).reshape(1)
        for (_, module), w in zip(unit.quant, ws):
            packed, scale, err = _quantize_in_row_blocks(w, g)
            stats["rel_errors"][module] = err
            stats["quantized_params"] += w.numel()
            for oname, t in fmt.tensors(module, packed, scale, g):
                out.append((oname, t.to("cpu")))
    for name in unit.copy:
        t = tensors[name]
        if t.is_floating_point():
            _check_finite(name, t.to(device) if device.type != "cpu" else t, source)
        out.append((name, t))
    return out


# The dense weights in other frameworks' files (TF, Flax, GGUF, ONNX): copying them put the full-precision
# model into the NVFP4 directory, unreported in its "size after" (audit 2026-11-27).
OTHER_WEIGHT_SUFFIXES = (".h5", ".msgpack", ".gguf", ".onnx", ".onnx_data")


def copy_side_files(source: SourceModel, work: Path) -> list[str]:
    """Tokenizer, generation config, chat template, custom code...: every top-level file that is not a weight,
    and the named chat templates (``additional_chat_templates/*.jinja``)."""
    skip = {"config.json", MANIFEST, "hf_quant_config.json", *source.weight_files}
    copied = []
    for p in sorted(source.path.iterdir()):
        if not p.is_file() or p.name.startswith(".") or p.name in skip:
            continue
        if (
            p.suffix in PICKLE_SUFFIXES
            or p.suffix in OTHER_WEIGHT_SUFFIXES
            or p.suffix == ".safetensors"
            or p.name.endswith(".index.json")  # any framework's shard index: the source's weights, not ours
        ):
            continue
        shutil.copy2(p, work / p.name)
        copied.append(p.name)
    named = source.path / CHAT_TEMPLATE_DIR  # the tokenizer's named chat templates ("tool_use", ...)
    if named.is_dir():
        (work / CHAT_TEMPLATE_DIR).mkdir(exist_ok=True)
        for p in sorted(named.glob("*.jinja")):
            shutil.copy2(p, work / CHAT_TEMPLATE_DIR / p.name)
            copied.append(f"{CHAT_TEMPLATE_DIR}/{p.name}")
    return copied


def _source_inputs(source: SourceModel) -> dict[str, str]:
    inputs = {
        "src_model_hash": model_hash(source.path),
        "src_config_sha256": sha256_file(source.path / "config.json"),
    }
    if source.index_file is not None:
        inputs["src_index_sha256"] = sha256_file(source.index_file)
    return inputs


def _text_input(source: SourceModel) -> dict[str, str]:
    """The tokenizer, chat template and generation config that quantize copies into QDIR: a source whose
    eos or chat template was fixed after a first run must not be 'already done' with the stale copies."""
    return {"src_text": text_files_hash(source.path)}


def return_freed_memory_to_os() -> None:
    """Make glibc serve allocations >= 1 MiB with mmap, so a freed tensor goes back to the OS at once.

    By default glibc raises its mmap threshold up to 32 MiB as blocks are freed, and then keeps
    freed tensor buffers in per-thread heaps: streaming a 15 GB model then left the process at
    15 GB RSS although at most three layers were alive. A fixed threshold keeps RSS at what is live.

    For the whole process, and for good: glibc has no way back to its dynamic threshold, and every
    later allocation of 1 MiB or more is then mapped and unmapped (2000 temporaries of 4 MiB: 0.11 ->
    3.8-4.6 s; a train step after it in the same process 1.6x slower, audit 2026-11-26). So
    ``qerl quantize`` calls it (its process ends with the stage) and ``quantize()`` does not; a
    script that streams a large model and does nothing heavy after may call it first.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD; setting it also turns off the dynamic adjustment
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def quantize(cfg: QuantizeConfig, console=None) -> QuantizeResult:
    """Run the stage; see the module docstring. Raises QerlError subclasses on bad input."""
    t_start = time.time()
    if cfg.format not in FORMATS:
        raise BadInputError(f"--format {cfg.format!r} is not one of {', '.join(FORMATS)}")
    max_shard = parse_size(cfg.max_shard_size)
    if max_shard <= 0:
        raise BadInputError("--max-shard-size must be positive")
    device = resolve_device(cfg.device)
    src, out = Path(cfg.src), Path(cfg.out)
    source = open_source(src)
    _check_source(source)
    o, s = out.resolve(), src.resolve()
    if o == s or s in o.parents or o in s.parents:  # --force would replace (or sweep) the source being read
        raise BadInputError(f"--out {out} must not be the source directory, inside it, or hold it",
                            hint="write the output to a separate directory")

    fmt = NVFP4Format(cfg.format)
    # device is not part of the fingerprint: CPU and CUDA produce the same bytes.
    # Nor is the source path: its content hashes are the inputs, so a moved source is still "done".
    stage_cfg = {"format": cfg.format, "max_shard_size": max_shard}
    legacy_inputs = _source_inputs(source)  # qerl before 2026-11-27 did not count the copied text files
    inputs = {**legacy_inputs, **_text_input(source)}
    # Such an output is done only while its copies still match the source's (they are verbatim copies):
    # a source whose tokenizer or generation config changed since is not done with the stale ones.
    current = text_files_hash(out) == inputs["src_text"] if out.is_dir() else False
    so = StageOutput(out, STAGE, config=stage_cfg, inputs=inputs, force=cfg.force, started=t_start,
                     legacy_inputs=(legacy_inputs,) if current else ())
    if so.already_done():
        return QuantizeResult(out, True, (so.manifest or {}).get("summary", {}), so.manifest)

    units, kept_linears = plan_units(source)
    if not any(u.quant for u in units):  # it wrote a "quantized" copy with every Linear ignored, silently
        raise BadInputError(f"{cfg.src}: no decoder Linear can be quantized (NVFP4 needs in-features that are a "
                            f"multiple of 16; {len(kept_linears)} Linears would stay dense)",
                            hint="this model has nothing for NVFP4 to compress; use it as it is")
    plan = plan_outputs(source, units, fmt)
    ignore = ["lm_head", *kept_linears]
    stats = {"rel_errors": {}, "quantized_params": 0, "fp32_global_fallback": []}
    t0 = time.time()
    with so as work:
        writer = ShardedWriter(work, plan, max_shard)
        try:
            _run_pipeline(units, source, fmt, device, writer, stats, cfg.progress, console)
            writer.close()
        finally:
            writer.abort()
        config = fmt.update_config(source.config, ignore)
        (work / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for fname, data in fmt.extra_files(ignore).items():
            (work / fname).write_text(json.dumps(data, indent=2) + "\n")
        copied = copy_side_files(source, work)
        elapsed = time.time() - t0
        summary = _summary(source, units, plan, kept_linears, stats, elapsed, device, cfg.format, copied)
        so.extra["source"] = str(src.resolve())
        so.extra["summary"] = summary
        so.timings["quantize_s"] = round(elapsed, 3)
    return QuantizeResult(out, False, summary, so.manifest)


def _run_pipeline(units, source, fmt, device, writer, stats, show_progress, console) -> None:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    total = sum(source.tensors[n].nbytes for u in units for n in u.names())
    n_tensors = sum(len(u.names()) for u in units)
    progress = Progress(
        TextColumn("[bold]quantize[/]"),
        BarColumn(),
        TextColumn("{task.fields[done]}/{task.fields[n]} tensors"),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not show_progress,
        transient=False,
    )
    reader = TensorReader(source.tensors)

    def load(unit: Unit) -> dict[str, torch.Tensor]:
        return {n: reader.get(n) for n in unit.names()}

    def write(outs: list) -> None:
        for name, t in outs:
            writer.write(name, t)

    read_ex = ThreadPoolExecutor(1, thread_name_prefix="qerl-read")
    write_ex = ThreadPoolExecutor(1, thread_name_prefix="qerl-write")
    pending = None
    done = 0
    try:
        with progress:
            task = progress.add_task("quantize", total=total, done=0, n=n_tensors)
            nxt = read_ex.submit(load, units[0]) if units else None
            for i, unit in enumerate(units):
                tensors = nxt.result()
                nxt = read_ex.submit(load, units[i + 1]) if i + 1 < len(units) else None
                try:
                    outs = _process_unit(unit, tensors, source, fmt, device, stats)
                except torch.cuda.OutOfMemoryError:
                    raise OutOfMemoryError(
                        f"out of GPU memory quantizing {unit.key}", hint="free the GPU or use --device cpu"
                    ) from None
                del tensors
                if pending is not None:
                    pending.result()
                pending = write_ex.submit(write, outs)
                done += len(unit.names())
                progress.update(task, advance=sum(source.tensors[n].nbytes for n in unit.names()), done=done)
            if pending is not None:
                pending.result()
    finally:
        read_ex.shutdown(wait=True, cancel_futures=True)
        write_ex.shutdown(wait=True, cancel_futures=True)
        reader.close()


def _summary(source, units, plan, kept_linears, stats, elapsed, device, fmt_name, copied) -> dict:
    before = source.total_bytes
    after = sum(t.nbytes for t in plan)
    quant_bytes = sum(
        t.nbytes
        for t in plan
        if t.name.rsplit(".", 1)[-1]
        in ("weight_packed", "weight_scale", "weight_global_scale", "weight_scale_2")
        or (fmt_name == "modelopt" and t.dtype == torch.uint8 and t.name.endswith(".weight"))
    )
    qparams = stats["quantized_params"]
    total_params = sum(t.numel for t in source.tensors.values())
    errs = stats["rel_errors"]
    worst = max(errs.items(), key=lambda kv: kv[1]) if errs else (None, 0.0)
    n_quant = len(errs)
    return {
        "format": fmt_name,
        "device": str(device),
        "quantized_linears": n_quant,
        "kept_tensors": len(source.tensors) - n_quant,
        "kept_linears": kept_linears,
        "quantized_params": qparams,
        "total_params": total_params,
        "size_before_bytes": before,
        "size_after_bytes": after,
        "bits_per_weight_quantized": round(8 * quant_bytes / qparams, 4) if qparams else None,
        "bits_per_param_overall": round(8 * after / total_params, 4) if total_params else None,
        "max_rel_error": {"module": worst[0], "value": round(worst[1], 6)},
        "mean_rel_error": round(sum(errs.values()) / n_quant, 6) if n_quant else 0.0,
        "per_layer_max_rel_error": _per_layer_max(errs),
        "fp32_global_fallback": stats["fp32_global_fallback"],
        "copied_files": copied,
        "seconds": round(elapsed, 3),
        "source_mb_per_s": round(before / 1e6 / elapsed, 1) if elapsed > 0 else None,
    }


def _per_layer_max(errs: dict[str, float]) -> dict[str, float]:
    layers: dict[str, float] = {}
    for module, e in errs.items():
        m = re.search(r"layers\.(\d+)\.", module)
        key = m[1] if m else module
        layers[key] = max(layers.get(key, 0.0), round(e, 6))
    return layers


def render_summary(result: QuantizeResult, console) -> None:
    """The end-of-run table: sizes, bits per weight, worst relative error, kept Linears."""
    from rich.table import Table

    s = result.summary
    if not s:
        return
    t = Table(title=f"qerl quantize -> {result.out}", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row("format", s["format"])
    ratio = s["size_before_bytes"] / max(s["size_after_bytes"], 1)
    t.add_row("size before", _human(s["size_before_bytes"]))
    t.add_row("size after", f"{_human(s['size_after_bytes'])} ({ratio:.2f}x smaller)")
    t.add_row("quantized Linears / kept tensors", f"{s['quantized_linears']} / {s['kept_tensors']}")
    if s["bits_per_weight_quantized"] is not None:
        t.add_row("bits per quantized weight", f"{s['bits_per_weight_quantized']:.3f}")
    if s["bits_per_param_overall"] is not None:
        t.add_row("bits per parameter (whole model)", f"{s['bits_per_param_overall']:.3f}")
    worst = s["max_rel_error"]
    t.add_row("largest per-layer relative error", f"{worst['value']:.4f} ({worst['module']})")
    t.add_row("mean relative error", f"{s['mean_rel_error']:.4f}")
    t.add_row("time", f"{s['seconds']:.1f} s on {s['device']} ({s['source_mb_per_s']} MB/s)")
    if s.get("fp32_global_fallback"):
        t.add_row("fp16 global overflow (fp32 global used)", f"{len(s['fp32_global_fallback'])} Linears")
    kept = s["kept_linears"]
    if kept:
        shown = ", ".join(kept[:6]) + (f" (+{len(kept) - 6} more)" if len(kept) > 6 else "")
        t.add_row("Linears kept unquantized (in-features % 16 != 0)", shown)
    console.print(t)


def _human(n: int) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"
