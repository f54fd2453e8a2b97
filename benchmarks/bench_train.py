"""Train-step speed and memory: NVFP4 + LoRA vs bf16 + LoRA on Qwen2.5-shaped random weights (GPU).

What it times is ``qerl_cli.train_step.run_epochs``, the loop of the ``train-step`` stage: micro-
batches packed by token budget, gradient-checkpointed forward, chunked log-probs, PPO/TIS DAPO loss,
backward through the frozen base (NVFP4: the Triton forward and grad-input kernels; bf16: cuBLAS),
grad clipping and AdamW on fp32 LoRA masters. Weights are random and built directly on the GPU
(``qerl_cli.models.build_random_model``; speed does not depend on weight values), so no checkpoint
is needed. Each configuration runs in its own subprocess, so one out-of-memory or crash leaves the
others' rows intact and every peak-memory figure starts from an empty GPU.

    python benchmarks/bench_train.py --out results/                 # all configs
    python benchmarks/bench_train.py --configs 7b-nvfp4,7b-bf16 --steps 1 --out results/

Per config: build the model, run one warm-up step on the first micro-batches (Triton compile and
autotune), then ``--steps`` timed full steps (median reported). Peak memory is
``torch.cuda.max_memory_allocated`` over a timed step (weights + activations + LoRA/AdamW state).
Writes ``bench_train.json`` and ``bench_train.md`` (the table for docs/benchmarks.md) to ``--out``.

The train-step memory options pass through: ``--offload-activations`` (checkpointed layer inputs in
pinned CPU memory) and ``--embeddings-on-cpu`` (the input embedding table in CPU memory); both
apply to every config of the run, so give each combination its own ``--out``.

``--memory-breakdown``: after the timed steps, one more step on the first two micro-batches runs
under ``torch.cuda.memory._record_memory_history`` (so its allocator trace does not slow the timed
steps; with identical micro-batch shapes its peak is the full step's, both are reported). The trace
is replayed to the peak, and ``bench_train_<config>_memory.json`` lists what was live there: the
bytes that existed before the step (weights, LoRA weights, grads, AdamW moments) and the
allocations made during it, grouped by a short Python stack hint, largest first. A summary goes to
stdout. On CPU only the before-the-step part is written (the allocator trace is CUDA's).

    python benchmarks/bench_train.py --configs 7b-bf16,7b-nvfp4 --offload-activations --embeddings-on-cpu \
        --memory-breakdown --out results/offload-emb
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

# name -> (preset, quantized, sequences, prompt tokens, completion tokens)
CONFIGS = {
    "7b-bf16": ("qwen2.5-7b", False, 64, 256, 1280),
    "7b-nvfp4": ("qwen2.5-7b", True, 64, 256, 1280),
    "3b-nvfp4": ("qwen2.5-3b", True, 32, 256, 2048),  # the recipes' completion length
    "14b-nvfp4": ("qwen2.5-14b", True, 32, 256, 2048),
    "32b-nvfp4": ("qwen2.5-32b", True, 8, 256, 2304),
    "32b-bf16": ("qwen2.5-32b", False, 8, 256, 2304),
    "tiny-nvfp4": ("tiny", True, 8, 16, 48),  # smoke test of this script (runs on CPU too)
}
TINY = dict(arch="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, qkv_bias=True)


def _nbytes(tensors, device) -> int:
    seen, n = set(), 0
    for t in tensors:
        if t is None or t.device != device or id(t) in seen:
            continue
        seen.add(id(t))
        n += t.numel() * t.element_size()
    return n


def state_bytes(model, params, opt) -> dict:
    """GiB on the model's device of what exists between steps: frozen weights/buffers, LoRA, grads, AdamW."""
    import torch

    dev = model.device
    trainable = {id(p) for p in params}
    frozen = [t for t in list(model.parameters()) + list(model.buffers()) if id(t) not in trainable]
    moments = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    gib = 2**30
    return {"weights_gib": _nbytes(frozen, dev) / gib, "lora_params_gib": _nbytes(params, dev) / gib,
            "lora_grads_gib": _nbytes([p.grad for p in params], dev) / gib,
            "optimizer_state_gib": _nbytes(moments, dev) / gib}


_OWN = ("qerl_cli/", "benchmarks/", "kernels/", "qerl_kernels/")


def stack_hint(frames: list[dict], n: int = 3) -> str:
    """The innermost ``n`` frames from this project (else the innermost frame) as 'file:line name < ...'."""
    def short(f):
        name = f.get("filename", "?")
        for k in _OWN:
            if k in name:
                name = k + name.split(k, 1)[1]
                break
        else:
            name = name.rsplit("/", 1)[-1]
        return f"{name}:{f.get('line', '?')} {f.get('name', '?')}"

    own = [f for f in frames if any(k in f.get("filename", "") for k in _OWN)]
    pick = own[:n] or frames[:1]
    return " < ".join(short(f) for f in pick) if pick else "(no Python frame: autograd backward / C++)"


def peak_breakdown(trace: list[dict], baseline: int, top: int = 15) -> dict:
    """Replay a CUDA caching-allocator trace (``torch.cuda.memory._snapshot()['device_traces'][i]``).

    ``baseline`` is ``memory_allocated()`` when recording began. Allocated bytes rise on 'alloc' and
    fall on 'free_requested' (when ``max_memory_allocated`` counts them freed); a free of a block
    allocated before recording lowers the baseline part. Returns the peak and what was live at it.
    """
    cur = peak = baseline
    peak_i = -1
    live: dict = {}
    for i, e in enumerate(trace):
        act, size = e.get("action"), int(e.get("size", 0))
        if act == "alloc":
            live[e.get("addr")] = size
            cur += size
            if cur > peak:
                peak, peak_i = cur, i
        elif act in ("free_requested", "free"):
            live.pop(e.get("addr"), None)
            cur -= size
    live_e: dict = {}
    pre_freed = 0
    for e in trace[: peak_i + 1]:
        act = e.get("action")
        if act == "alloc":
            live_e[e.get("addr")] = e
        elif act in ("free_requested", "free"):
            if live_e.pop(e.get("addr"), None) is None:
                pre_freed += int(e.get("size", 0))
    allocs = sorted(live_e.values(), key=lambda e: -int(e.get("size", 0)))
    groups: dict = {}
    for e in allocs:
        g = groups.setdefault(stack_hint(e.get("frames") or []), {"count": 0, "bytes": 0, "sizes": set()})
        g["count"] += 1
        g["bytes"] += int(e["size"])
        g["sizes"].add(int(e["size"]))
    mib, gib = 2**20, 2**30
    top_groups = sorted(groups.items(), key=lambda kv: -kv[1]["bytes"])[:top]
    return {
        "peak_gib": peak / gib,
        "before_step_gib": baseline / gib,
        "before_step_live_at_peak_gib": (baseline - pre_freed) / gib,
        "step_allocations_live_at_peak_gib": sum(int(e["size"]) for e in allocs) / gib,
        "events": len(trace),
        "top_groups": [{"count": g["count"], "gib": round(g["bytes"] / gib, 4),
                        "each_mib": sorted({round(x / mib, 2) for x in g["sizes"]}, reverse=True)[:4], "where": w}
                       for w, g in top_groups],
        "top_allocations": [{"mib": round(int(e["size"]) / mib, 2), "where": stack_hint(e.get("frames") or [])}
                            for e in allocs[:top]],
    }


def format_breakdown(b: dict) -> str:
    lines = [f"memory breakdown ({b['config']}, recorded step on {b['micro_batches']} micro-batches): "]
    if "peak_gib" not in b:
        lines[0] += b.get("note", "")
    else:
        lines[0] += (f"peak {b['peak_gib']:.2f} GiB (max_memory_allocated {b['max_memory_allocated_gib']:.2f}, "
                     f"timed steps {b['timed_peak_gib']:.2f})")
    st = b["before_step"]
    lines.append(f"  before the step: weights {st['weights_gib']:.2f} + LoRA {st['lora_params_gib']:.3f} + grads "
                 f"{st['lora_grads_gib']:.3f} + AdamW {st['optimizer_state_gib']:.3f} GiB")
    if "peak_gib" in b:
        lines.append(f"  at the peak: {b['before_step_live_at_peak_gib']:.2f} GiB from before the step + "
                     f"{b['step_allocations_live_at_peak_gib']:.2f} GiB allocated in it, largest groups:")
        for g in b["top_groups"]:
            lines.append(f"    {g['count']:4d} x {'/'.join(str(x) for x in g['each_mib'])} MiB = {g['gib']:.3f} GiB  "
                         f"{g['where']}")
    return "\n".join(lines)


def record_breakdown(name, run_step, model, params, opt, cuda: bool, timed_peak: float, micro_batches: int) -> dict:
    """Run ``run_step()`` once under the CUDA allocator trace; see the module docstring."""
    import torch

    out = {"config": name, "micro_batches": micro_batches, "before_step": state_bytes(model, params, opt)}
    if not cuda:
        run_step()
        out["note"] = "no allocator trace on CPU (CUDA only); before-the-step tensors only"
        return out
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    rec = torch.cuda.memory._record_memory_history
    try:
        rec(enabled="all", context="alloc", stacks="python", max_entries=2_000_000, clear_history=True)
    except TypeError:  # older torch: no clear_history
        rec(enabled="all", context="alloc", stacks="python", max_entries=2_000_000)
    try:
        run_step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        rec(enabled=None)
    traces = snap.get("device_traces") or [[]]
    trace = traces[torch.cuda.current_device()] if len(traces) > torch.cuda.current_device() else traces[0]
    out.update(peak_breakdown(trace, baseline))
    out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    out["timed_peak_gib"] = timed_peak
    return out


def run_one(name: str, steps: int, micro_batch_tokens: int, logits_chunk: int, rank: int, dev: str = "cuda",
            offload_activations: bool = False, embeddings_on_cpu: bool = False,
            memory_breakdown: Path | None = None, cut: tuple[float, int, float] | None = None,
            kernel_profile: int = 0, keep_activations: int | str = 0, checkpointing: bool = True,
            deterministic: bool = False) -> dict:
    import hashlib

    import torch

    from qerl_cli.layers.lora import LoraSpec
    from qerl_cli.models import ModelConfig, build_random_model, preset
    from qerl_cli.train.advantages import group_advantages
    from qerl_cli.train.batching import pack_microbatches
    from qerl_cli.train.determinism import deterministic_algorithms, prepare_environment
    from qerl_cli.train.losses import sequence_weights
    from qerl_cli.train.optim import make_optimizer
    from qerl_cli.train_step import StepBatch, TrainStepConfig, _trainable, apply_memory_options, run_epochs

    preset_name, quantized, n_seq, p_len, c_len = CONFIGS[name]
    mcfg = ModelConfig(**TINY) if preset_name == "tiny" else preset(preset_name)
    cuda = dev == "cuda"
    if deterministic:
        prepare_environment()  # as train-step does: before CUDA starts
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    model = build_random_model(mcfg, device=dev, dtype=torch.bfloat16 if cuda else torch.float32, quantized=quantized,
                               lora=LoraSpec(r=rank, alpha=rank), max_positions=p_len + c_len + 16)
    build_s = time.time() - t0
    named = _trainable(model, False)
    params = [p for _, p in named]
    cfg = TrainStepConfig(model=Path("-"), shards=[], out=Path("-"), micro_batch_tokens=micro_batch_tokens,
                          logits_chunk_tokens=logits_chunk, progress=False, offload_activations=offload_activations,
                          embeddings_on_cpu=embeddings_on_cpu, keep_activations=keep_activations,
                          gradient_checkpointing=checkpointing, deterministic=deterministic)
    for note in apply_memory_options(cfg, model, dev):  # gradient checkpointing (+ the memory options)
        print(note, flush=True)
    model.train()
    opt = make_optimizer(named, lr=1e-5)
    sync()
    weights_gib = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0

    g = torch.Generator().manual_seed(0)
    vocab = mcfg.vocab_size
    prompts = [torch.randint(0, vocab, (p_len,), generator=g).tolist() for _ in range(n_seq)]
    comps = [torch.randint(0, vocab, (c_len,), generator=g).tolist() for _ in range(n_seq)]
    samp = [[-1.0] * c_len for _ in range(n_seq)]
    rewards = torch.randint(0, 2, (n_seq,), generator=g).float().tolist()
    group_ids = [f"g{i // 4}" for i in range(n_seq)]
    adv = group_advantages(rewards, group_ids, scale="group")
    lengths = [p_len + c_len] * n_seq
    groups = pack_microbatches(lengths, micro_batch_tokens)
    mb_of = [j for j, grp in enumerate(groups) for _ in grp]
    weight = sequence_weights("dapo", [c_len] * n_seq, mb_of).float()

    def batch_of(gs):
        return StepBatch(groups=gs, prompts=prompts, completions=comps, sampling_logprobs=samp,
                         inv_temp=torch.ones(n_seq), adv=adv.values, weight=weight,
                         cuts=None if cut is None else torch.tensor([cut] * n_seq, dtype=torch.float64))

    def step(gs):  # the loop as train-step runs it (--deterministic: under PyTorch's deterministic mode)
        with deterministic_algorithms(deterministic):
            return run_epochs(cfg, model, params, opt, batch_of(gs), device=dev)

    # warm-up: compile/autotune on real micro-batch shapes: the first two and the last (the packing's
    # odd one out, whose first-use cost otherwise landed in the first timed step)
    t0 = time.time()
    step(groups[:2] + groups[2:][-1:])
    sync()
    warm_s = time.time() - t0
    times, peaks = [], []
    for _ in range(steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.time()
        res = step(groups)
        sync()
        times.append(time.time() - t0)
        peaks.append(torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
    step_s = statistics.median(times)  # times[len // 2] of the sorted list took the slower of two steps
    digest = hashlib.sha256()  # the LoRA weights after every step: equal across runs iff the steps were
    for p in params:
        digest.update(p.detach().float().cpu().numpy().tobytes())
    tokens = n_seq * (p_len + c_len)
    if memory_breakdown is not None:
        mbs = groups[:2]
        try:  # a failure here must not lose the timed row
            b = record_breakdown(name, lambda: step(mbs), model,
                                 params, opt, cuda, round(max(peaks), 2), len(mbs))
            print(format_breakdown(b), flush=True)
        except Exception as e:  # noqa: BLE001
            b = {"config": name, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            print(f"memory breakdown failed: {b['error']}", flush=True)
        memory_breakdown.write_text(json.dumps(b, indent=2))
    if kernel_profile and cuda:
        print_kernel_profile(lambda: step(groups[:2]), kernel_profile)
    return {
        "config": name, "preset": preset_name, "quantized": quantized, "lora_rank": rank,
        "sequences": n_seq, "tokens_per_sequence": p_len + c_len, "micro_batch_tokens": micro_batch_tokens,
        "micro_batches": len(groups), "logits_chunk_tokens": logits_chunk,
        "offload_activations": offload_activations, "embeddings_on_cpu": embeddings_on_cpu,
        "keep_activations": keep_activations, "kept_layers": model.keep_activations, "checkpointing": checkpointing,
        "sampling_cut": list(cut) if cut else None, "step_s": round(step_s, 3), "step_s_all": [round(t, 3) for t in times],
        "tokens_per_s": round(tokens / step_s, 1), "peak_gib": round(max(peaks), 2),
        "weights_gib": round(weights_gib, 2), "build_s": round(build_s, 1), "warmup_s": round(warm_s, 1),
        "loss": res.losses[0], "grad_norm": res.grad_norms[-1], "deterministic": deterministic,
        "lora_sha256": digest.hexdigest()[:16],
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
    }


def print_kernel_profile(fn, top: int) -> None:
    """Where the GPU time of ``fn`` (two micro-batches of the step) goes: torch.profiler's device kernels
    by total time, the top ``top`` and the share of the whole."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) or 1.0
    events.sort(key=lambda e: -e.self_device_time_total)
    print(f"# GPU kernel time over two micro-batches: {total / 1e3:.1f} ms", flush=True)
    for e in events[:top]:
        print(f"{e.self_device_time_total / 1e3:9.2f} ms {100 * e.self_device_time_total / total:5.1f}% "
              f"x{e.count:<6} {e.key[:110]}", flush=True)


def table(rows: list[dict]) -> str:
    by = {r["config"]: r for r in rows if "step_s" in r}
    lines = ["| config | tokens | micro-batch tokens | step time (s) | tokens/s | peak memory (GiB) | weights (GiB) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "step_s" in r:
            opts = "".join(f", {o}" for k, o in (("offload_activations", "offload"), ("embeddings_on_cpu", "embeddings on CPU"))
                           if r.get(k))
            if r.get("keep_activations") == "auto":
                opts += f", auto: {r.get('kept_layers')} layers kept"
            elif r.get("keep_activations"):
                opts += f", {r['keep_activations']} layers kept"
            if r.get("checkpointing") is False:
                opts += ", no checkpointing"
            if r.get("deterministic"):
                opts += ", deterministic"
            if r.get("sampling_cut"):
                opts += ", top_p/top_k/min_p {} replayed".format("/".join(map(str, r["sampling_cut"])))
            lines.append(f"| {r['config']} (LoRA r={r['lora_rank']}{opts}) | {r['sequences']} x {r['tokens_per_sequence']} | "
                         f"{r['micro_batch_tokens']} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.1f} | "
                         f"{r['weights_gib']:.1f} |")
        else:
            lines.append(f"| {r['config']} | failed: {r.get('error', '?')[:120]} | | | | | |")
    for size in ("7b", "32b"):
        q, b = by.get(f"{size}-nvfp4"), by.get(f"{size}-bf16")
        if q and b:
            lines.append("")
            lines.append(f"{size}: NVFP4/bf16 step time {q['step_s'] / b['step_s']:.2f}x, "
                         f"peak memory {100 * q['peak_gib'] / b['peak_gib']:.1f}%")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="7b-bf16,7b-nvfp4,32b-nvfp4", help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per config (median reported)")
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--logits-chunk-tokens", type=int, default=1024)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--offload-activations", action="store_true",
                    help="train-step --offload-activations: checkpointed layer inputs wait in pinned CPU memory")
    ap.add_argument("--embeddings-on-cpu", action="store_true",
                    help="train-step --embeddings-on-cpu: the input embedding table stays in CPU memory")
    ap.add_argument("--keep-activations", default="0", metavar="N|auto",
                    help="train-step --keep-activations: the last N layers keep their activations (no recompute); auto")
    ap.add_argument("--no-checkpointing", action="store_true", help="train-step --no-checkpointing")
    ap.add_argument("--deterministic", action="store_true",
                    help="train-step --deterministic (each row's lora_sha256, the LoRA weights after its steps, "
                         "then matches a rerun's)")
    ap.add_argument("--no-fill", action="store_true",
                    help="A/B with --deterministic: torch.utils.deterministic.fill_uninitialized_memory off (PyTorch "
                         "fills every new tensor with NaN in the deterministic mode; what does that cost?)")
    ap.add_argument("--auto-start-all", action="store_true",
                    help="with --keep-activations auto: its first choice is every layer, whatever fits (to time its "
                         "out-of-memory retry, which then halves the count)")
    ap.add_argument("--memory-breakdown", action="store_true",
                    help="one extra recorded step: what is live at the peak, to bench_train_<config>_memory.json")
    ap.add_argument("--sampling-cut", default="",
                    help="TOP_P,TOP_K,MIN_P: records sampled with that cut, which train-step replays on its logits "
                         "(e.g. 0.95,0,0; default: none)")
    ap.add_argument("--torch-logprobs", action="store_true",
                    help="A/B: the log-prob passes in torch, as before the one-pass Triton kernels "
                         "(qerl_cli.train.triton_logprobs) took them over on CUDA")
    ap.add_argument("--kernel-profile", type=int, default=0, metavar="N",
                    help="after the timed steps, print the N GPU kernels that take the most time over two micro-batches")
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (smoke test with tiny-nvfp4)")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per config subprocess")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.one:  # child: one config, result as JSON
        retries = []
        if a.auto_start_all:
            from qerl_cli.train import activation_budget as ab

            ab.choose = lambda **kw: kw["n_layers"]
            real_retry = ab.AutoKeep.retry_with_fewer

            def retry(self, saved):
                retries.append(real_retry(self, saved))
                print(retries[-1], flush=True)
                return retries[-1]
            ab.AutoKeep.retry_with_fewer = retry
        if a.no_fill:
            import torch.utils.deterministic

            torch.utils.deterministic.fill_uninitialized_memory = False
        if a.torch_logprobs:
            from qerl_cli.train import logprobs

            logprobs._fused = lambda z: False
        try:
            mem = a.json.with_name(a.json.stem + "_memory.json") if a.memory_breakdown else None
            cut = None
            if a.sampling_cut:
                tp, tk, mp = a.sampling_cut.split(",")
                cut = (float(tp), int(tk), float(mp))
            row = run_one(a.one, a.steps, a.micro_batch_tokens, a.logits_chunk_tokens, a.lora_rank, a.device,
                          a.offload_activations, a.embeddings_on_cpu, mem, cut, a.kernel_profile,
                          a.keep_activations if a.keep_activations == "auto" else int(a.keep_activations),
                          not a.no_checkpointing, a.deterministic)
            row["logprobs"] = "torch" if a.torch_logprobs else "default"
            if a.auto_start_all:
                row["auto_retries"] = retries
        except Exception as e:  # noqa: BLE001 - report any failure as a table row
            row = {"config": a.one, "error": f"{type(e).__name__}: {e}".splitlines()[0], "trace": traceback.format_exc()}
        a.json.write_text(json.dumps(row))
        return

    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.configs.split(","):
        name = name.strip()
        if name not in CONFIGS:
            rows.append({"config": name, "error": "unknown config"})
            continue
        res_path = a.out / f"bench_train_{name}.json"
        cmd = [sys.executable, __file__, "--one", name, "--json", str(res_path), "--steps", str(a.steps),
               "--micro-batch-tokens", str(a.micro_batch_tokens), "--logits-chunk-tokens", str(a.logits_chunk_tokens),
               "--lora-rank", str(a.lora_rank), "--device", a.device, "--sampling-cut", a.sampling_cut,
               "--kernel-profile", str(a.kernel_profile), "--keep-activations", str(a.keep_activations)]
        cmd += [f for f, on in (("--offload-activations", a.offload_activations), ("--embeddings-on-cpu", a.embeddings_on_cpu),
                                ("--memory-breakdown", a.memory_breakdown), ("--torch-logprobs", a.torch_logprobs),
                                ("--no-checkpointing", a.no_checkpointing), ("--auto-start-all", a.auto_start_all),
                                ("--deterministic", a.deterministic), ("--no-fill", a.no_fill)) if on]
        t0 = time.time()
        with open(a.out / f"bench_train_{name}.log", "w") as log:
            try:
                subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout, check=False)
            except subprocess.TimeoutExpired:
                rows.append({"config": name, "error": f"timed out after {a.timeout}s"})
                print(f"{name}: timed out", flush=True)
                continue
        row = json.loads(res_path.read_text()) if res_path.exists() else {"config": name, "error": "no result (see log)"}
        rows.append(row)
        print(f"{name} ({time.time() - t0:.0f}s): " + json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
        mem_path = a.out / f"bench_train_{name}_memory.json"
        if a.memory_breakdown and mem_path.exists():
            b = json.loads(mem_path.read_text())
            print(format_breakdown(b) if "error" not in b else f"memory breakdown failed: {b['error']}", flush=True)
        # partial results survive a later crash or the device time limit
        (a.out / "bench_train.json").write_text(json.dumps(rows, indent=2))
        (a.out / "bench_train.md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
