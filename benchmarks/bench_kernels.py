"""Benchmark the NVFP4 kernels against cuBLAS bf16 on every Linear shape of Qwen2.5-7B and -32B.

Run on a CUDA machine: ``python benchmarks/bench_kernels.py`` (the nox session ``bench``).
It writes a table of microseconds and ratios, with device, date and command, into the
``## kernels`` section of docs/benchmarks.md.

Method (why): each measurement is a CUDA graph that calls the op once on each of R copies of
the weight (R copies together >= 256 MB, five times H100's 50 MB L2, so every call reads its
weight from HBM, as in a model where each layer's weight is read once per step), replayed
several times and timed with CUDA events; the median replay over R is the time per call. The
graph removes Python launch overhead from both sides, as an inference engine's CUDA graphs do.
cuBLAS is ``torch.nn.functional.linear`` with bf16 weights (``x @ W^T``), in the same run.

``--sweep`` also times every candidate tile config (kernels/tile_configs.py) per shape and M,
checks each against cuBLAS on the dequantized weight, and writes the winners as a Python table
(``--table-out``) that kernels/tile_table.py holds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (model, layer) -> (N, K): fused qkv / o / fused gate_up / down.
SHAPES = {
    ("7B", "qkv"): (3584 + 2 * 512, 3584),
    ("7B", "o"): (3584, 3584),
    ("7B", "gate_up"): (2 * 18944, 3584),
    ("7B", "down"): (3584, 18944),
    ("32B", "qkv"): (5120 + 2 * 1024, 5120),
    ("32B", "o"): (5120, 5120),
    ("32B", "gate_up"): (2 * 27648, 5120),
    ("32B", "down"): (5120, 27648),
}
MS = (1, 4, 16, 32, 64, 128, 256, 1024, 4096)
BWD_MS = (4096,)
ROTATE_BYTES = 256 << 20
TARGETS = {1: 3.0, 4: 3.0, 16: 3.0, 64: 2.0, 128: 1.3, 1024: 0.9, 4096: 0.9}
BWD_TARGET = 0.8


def geomean(values) -> float:
    """Geometric mean (of speedups or time ratios over shapes)."""
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def n_copies(nbytes: int, cap_bytes: int = 3 << 30) -> int:
    return max(2, min(math.ceil(ROTATE_BYTES / nbytes), max(2, cap_bytes // max(nbytes, 1))))


def _busy_gpu(us: float = 40.0) -> None:
    """Queue a spin kernel, so the GPU is still busy when the host has queued the start event and the
    replay: the start then fires as the graph begins. On an idle GPU it fired when recorded, and the
    host's replay launch (a few us) was timed too, divided by each side's own number of calls (up to
    38 qerl calls against 11 cuBLAS ones on 7B o: a bias towards qerl on small weights; audit, 2026-11-26)."""
    if os.environ.get("QERL_BENCH_IDLE_START") != "1":  # =1: the old timing, to measure what it changed
        torch.cuda._sleep(int(us * 2000))  # cycles, at <= 2 GHz


def time_graph(fns, target_s: float = 0.12) -> float:
    """Median microseconds per call of ``fns`` (one call per weight copy) replayed in a CUDA graph."""
    for f in fns:  # warm-up: compiles, allocates workspaces and counters outside the capture
        f()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    one = start.elapsed_time(end) / 1e3
    reps = max(5, min(40, int(target_s / max(one, 1e-6))))
    times = []
    for _ in range(reps):
        _busy_gpu()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    del graph
    return statistics.median(times)


class ShapeData:
    """R NVFP4 copies and R bf16 copies of one weight shape, random (never zeros)."""

    def __init__(self, n: int, k: int, seed: int, twiddled: bool = True):
        g = torch.Generator(device="cuda").manual_seed(seed)
        fp4_bytes = n * k // 2 + n * k // 16
        self.r4 = n_copies(fp4_bytes)
        self.r16 = n_copies(n * k * 2)
        self.packed = [torch.randint(0, 256, (n, k // 2), generator=g, device="cuda", dtype=torch.uint8)
                       for _ in range(self.r4)]
        # e4m3 bytes 0x28..0x48 (~0.25..4): moderate scales, as real checkpoints have.
        self.scale = [torch.randint(0x28, 0x48, (n, k // 16), generator=g, device="cuda", dtype=torch.uint8)
                      .view(torch.float8_e4m3fn) for _ in range(self.r4)]
        self.gs = torch.tensor([2688.0 / 3.0], device="cuda")
        self.w16 = [torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(self.r16)]
        from qerl_kernels import reference

        self.w_deq = reference.dequantize(self.packed[0], self.scale[0], self.gs, dtype=torch.bfloat16)
        self.n, self.k = n, k
        # The layout the product runs on sm_90 (qerl_kernels.twiddle, applied at model load).
        self.tw = twiddled
        self.bl = False
        if twiddled:
            from qerl_kernels.twiddle import can_block, to_kernel_layout

            self.bl = can_block(n, k)
            self.packed = [to_kernel_layout(p, self.bl) for p in self.packed]


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def gluon_runs(d: ShapeData) -> bool:
    """Whether a Gluon config runs as itself on these weights (``--layout ondisk`` or ``QERL_GLUON=0``: no; a
    review found a sweep then recorded, and could write to the table, a Gluon "winner" timed on a fallback)."""
    from qerl_kernels.gemm_gluon import gluon_supported

    return gluon_supported(torch.empty(1, d.k, device="cuda", dtype=torch.bfloat16), d.n, d.k, d.tw, d.bl)


def bench_fwd_point(d: ShapeData, m: int, cfg):
    from qerl_kernels.gemm_fwd import nvfp4_matmul

    x = torch.randn(m, d.k, device="cuda", dtype=torch.bfloat16)
    err = rel(nvfp4_matmul(x, d.packed[0], d.scale[0], d.gs, config=cfg, twiddled=d.tw, blocked=d.bl),
              torch.nn.functional.linear(x, d.w_deq))
    fns = [lambda i=i: nvfp4_matmul(x, d.packed[i], d.scale[i], d.gs, config=cfg, twiddled=d.tw, blocked=d.bl)
           for i in range(d.r4)]
    return time_graph(fns), err


def bench_cublas_fwd(d: ShapeData, m: int) -> float:
    x = torch.randn(m, d.k, device="cuda", dtype=torch.bfloat16)
    return time_graph([lambda i=i: torch.nn.functional.linear(x, d.w16[i]) for i in range(d.r16)])


def bench_bwd_point(d: ShapeData, m: int, cfg):
    from qerl_kernels.gemm_bwd import nvfp4_matmul_grad_input

    dy = torch.randn(m, d.n, device="cuda", dtype=torch.bfloat16)
    err = rel(nvfp4_matmul_grad_input(dy, d.packed[0], d.scale[0], d.gs, config=cfg, twiddled=d.tw, blocked=d.bl), dy @ d.w_deq)
    fns = [lambda i=i: nvfp4_matmul_grad_input(dy, d.packed[i], d.scale[i], d.gs, config=cfg, twiddled=d.tw, blocked=d.bl)
           for i in range(d.r4)]
    return time_graph(fns), err


def bench_cublas_bwd(d: ShapeData, m: int) -> float:
    dy = torch.randn(m, d.n, device="cuda", dtype=torch.bfloat16)
    return time_graph([lambda i=i: torch.matmul(dy, d.w16[i]) for i in range(d.r16)])


def add_probe_args(ap: argparse.ArgumentParser, layers: str) -> None:
    """The shape selection flags the small-M probes share (probe_split.py, probe_variants.py)."""
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--models", default="7B,32B")
    ap.add_argument("--layers", default=layers)


def probe_points(args):
    """(model, layer, ShapeData, m, the table's config, cuBLAS us) for every shape and M the probe
    flags select, one ShapeData per shape (the caller's loop variable holds the previous one while
    the next is built: at most two sets of weight copies, a few GB); prints the device first."""
    from qerl_kernels.tile_configs import fwd_config

    print(f"# {torch.cuda.get_device_name()}", flush=True)
    for (model, layer), (n, k) in SHAPES.items():
        if model not in args.models.split(",") or layer not in args.layers.split(","):
            continue
        d = ShapeData(n, k, seed=n + k)
        for m in map(int, args.ms.split(",")):
            yield model, layer, d, m, fwd_config(m, n, k), bench_cublas_fwd(d, m)
        del d
        torch.cuda.empty_cache()


def roofline(n: int, k: int, m: int, us: float) -> tuple[float, float]:
    """(achieved TB/s counting the fewest bytes, achieved TFLOP/s) of an NVFP4 GEMM."""
    nbytes = n * k * 0.5625 + 2 * m * (k + n)
    return nbytes / us / 1e6, 2 * m * n * k / us / 1e6


def interleaved_rounds(us: float, ref_us: float, rounds: int, qerl, cublas) -> tuple[list[float], list[float]]:
    """``rounds`` timings of each side (the first given), taken alternately, so a drift of the clocks
    over the run lands on both sides instead of on whichever was timed later; the caller reports each
    side's median. ``qerl`` returns (us, error) as bench_fwd_point does; ``cublas`` returns us."""
    qs, cs = [us], [ref_us]
    for _ in range(rounds - 1):
        cs.append(cublas())
        qs.append(qerl()[0])
    return qs, cs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="time every candidate config; write the table")
    ap.add_argument("--models", default="7B,32B")
    ap.add_argument("--layers", default="qkv,o,gate_up,down")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--bwd-ms", default=",".join(map(str, BWD_MS)))
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--table-out", default=None, help="with --sweep: write the winners as tile_table.py")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"), help="'' to skip the doc")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new points after this")
    ap.add_argument("--cand-filter", default=None,
                    help="with --sweep: time only the candidates whose repr matches this regex (plus the current table entry)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="time cuBLAS and the chosen qerl tile this many times, interleaved, and report each one's "
                         "median: one window each moves by up to 5-10%% at M = 1024 as the clocks follow power")
    ap.add_argument("--layout", choices=["twiddled", "ondisk"], default="twiddled",
                    help="code layout the kernels read: twiddled (+ 1 KB blocks where the shape tiles; what qerl loads on sm_90) or the on-disk one")
    args = ap.parse_args(argv)

    from qerl_kernels import tile_configs as tc

    t0 = time.time()
    models = args.models.split(",")
    layers = args.layers.split(",")
    ms = [int(v) for v in args.ms.split(",") if v]
    bwd_ms = [int(v) for v in args.bwd_ms.split(",") if v]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    fwd_table, bwd_table = {}, {}

    def log(rec):
        results.append(rec)
        print(json.dumps(rec), flush=True)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(results, indent=1))

    for (model, layer), (n, k) in SHAPES.items():
        if model not in models or layer not in layers:
            continue
        d = ShapeData(n, k, seed=n + k, twiddled=args.layout == "twiddled")
        from qerl_kernels.dequant import nvfp4_dequantize

        us = time_graph([lambda i=i, d=d: nvfp4_dequantize(d.packed[i], d.scale[i], d.gs, twiddled=d.tw, blocked=d.bl)
                         for i in range(d.r4)])
        log({"op": "dequant", "model": model, "layer": layer, "N": n, "K": k, "us": round(us, 2),
             "TBps": round(n * k * (0.5625 + 2) / us / 1e6, 2)})
        for m in ms:
            if time.time() - t0 > args.budget_s:
                break
            ref_us = bench_cublas_fwd(d, m)
            cands = [tc.fwd_config(m, n, k, num_sms)]
            if cands[0].gluon and not gluon_runs(d):  # the Triton tile nvfp4_matmul runs for this table entry
                cands = [tc.heuristic_fwd(m, n, k, gluon=False)]  # (an explicit Gluon tile is refused)
            if args.sweep:
                for c in tc.fwd_candidates(m):
                    if args.cand_filter and not re.search(args.cand_filter, repr(c)):
                        continue
                    # The engine pairs gate/up (SwiGLU epilogue), which a duo tile does for whole tiles only
                    # (gemm_gluon_ws.duo_runs): other duo launches there would run in one partition.
                    paired_duo = c.duo and layer == "gate_up"
                    if paired_duo and c.halves:
                        continue
                    if c.sk:  # stream-K: the program count is the config's, no split-K factor
                        cands.append(c)
                        continue
                    if c.halves:  # halving applies to split-K 1 grids only; elsewhere a duplicate
                        cands.append(tc.FwdConfig(**{**c.as_dict(), "split_k": 1}))
                        continue
                    s = tc.choose_split(m, n, k, c, num_sms)
                    # 3 s / 2 as well: a split-K plan rounds to whole K steps per split, so e.g. 28 steps
                    # split 5 or 10 ways run 6 or 3 steps per program and 7 ways (4 steps) sits between
                    # and the power of two below s (the warp-specialised tiles split whole K-step pairs)
                    for split in sorted({1, s, max(1, s // 2), (3 * s + 1) // 2, s * 2, 1 << (s.bit_length() - 1)}
                                        if s > 1 else {1}):
                        # a persistent tile with split-K > 1 runs one program per tile: a duplicate
                        if not ((paired_duo or c.persist) and split > 1):
                            cands.append(tc.FwdConfig(**{**c.as_dict(), "split_k": split}))
            best = None
            for cfg in dict.fromkeys(cands):
                if d.tw and not tc.layout_safe(cfg):
                    continue  # the wrapper would run it as DEQUANT anyway
                if args.sweep and cfg.gluon and not gluon_runs(d):
                    continue  # nvfp4_matmul refuses it (QERL_GLUON=0: runs a Triton tile in its place, under this config's name)
                try:
                    us, err = bench_fwd_point(d, m, cfg)
                except Exception as e:  # a config that fails to compile is reported, not fatal
                    print(f"# {model} {layer} M={m} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                ok = err < 2e-2
                if ok and (best is None or us < best[0]):
                    best = (us, cfg, err)
                if args.sweep:
                    print(f"#   {model:3} {layer:7} M={m:5} {cfg} {us:9.1f}us err={err:.1e}", flush=True)
            if best is None:
                log({"op": "fwd", "model": model, "layer": layer, "N": n, "K": k, "M": m, "error": "no valid config"})
                continue
            us, cfg, err = best
            qs, cs = interleaved_rounds(us, ref_us, args.rounds, partial(bench_fwd_point, d, m, cfg),
                                        partial(bench_cublas_fwd, d, m))
            us, ref_us = statistics.median(qs), statistics.median(cs)
            tbs, tfl = roofline(n, k, m, us)
            log({"op": "fwd", "model": model, "layer": layer, "N": n, "K": k, "M": m, "us": round(us, 2),
                 "cublas_us": round(ref_us, 2), "speedup": round(ref_us / us, 3), "err": err,
                 "TBps": round(tbs, 2), "TFLOPs": round(tfl, 1), "cfg": cfg.as_dict(),
                 "us_rounds": [round(v, 2) for v in qs], "cublas_us_rounds": [round(v, 2) for v in cs]})
            fwd_table[(tc.m_bucket(m), n, k)] = cfg
        for m in bwd_ms:
            if time.time() - t0 > args.budget_s:
                break
            ref_us = bench_cublas_bwd(d, m)
            cands = [tc.bwd_config(m, n, k)] + (tc.bwd_candidates() if args.sweep else [])
            best = None
            for cfg in dict.fromkeys(cands):
                try:
                    us, err = bench_bwd_point(d, m, cfg)
                except Exception as e:
                    print(f"# bwd {model} {layer} M={m} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                if args.sweep:
                    print(f"#   bwd {model:3} {layer:7} M={m:5} {cfg} {us:9.1f}us err={err:.1e}", flush=True)
                if err < 2e-2 and (best is None or us < best[0]):
                    best = (us, cfg, err)
            if best is None:
                log({"op": "bwd", "model": model, "layer": layer, "N": n, "K": k, "M": m, "error": "no valid config"})
                continue
            us, cfg, err = best
            qs, cs = interleaved_rounds(us, ref_us, args.rounds, partial(bench_bwd_point, d, m, cfg),
                                        partial(bench_cublas_bwd, d, m))
            us, ref_us = statistics.median(qs), statistics.median(cs)
            log({"op": "bwd", "model": model, "layer": layer, "N": n, "K": k, "M": m, "us": round(us, 2),
                 "cublas_us": round(ref_us, 2), "speedup": round(ref_us / us, 3), "err": err,
                 "us_rounds": [round(v, 2) for v in qs], "cublas_us_rounds": [round(v, 2) for v in cs],
                 "TFLOPs": round(2 * m * n * k / us / 1e6, 1), "cfg": cfg.as_dict()})
            bwd_table[(n, k)] = cfg
        del d
        torch.cuda.empty_cache()

    if args.sweep and args.table_out:
        # Points not reached in this run (budget) keep their previously measured entries.
        write_table(Path(args.table_out), {**tc.FWD_TABLE, **fwd_table}, {**tc.BWD_TABLE, **bwd_table})
    text = render(results, " ".join(["python"] + sys.argv))
    print(text)
    if args.doc:
        write_doc_section(Path(args.doc), text)
    return 0


def write_table(path: Path, fwd_table, bwd_table) -> None:
    lines = [
        '"""Tile configs measured by ``benchmarks/bench_kernels.py --sweep`` on an H100 (later sweeps on an H200 where docs/benchmarks.md says so; generated file)."""',
        "",
        "from qerl_kernels.tile_configs import BwdConfig, FwdConfig",
        "",
        "FWD = {",
    ]
    for (mb, n, k), c in sorted(fwd_table.items()):
        lines.append(f"    ({mb}, {n}, {k}): FwdConfig(**{c.as_dict()!r}),")
    lines += ["}", "", "BWD = {"]
    for (n, k), c in sorted(bwd_table.items()):
        lines.append(f"    ({n}, {k}): BwdConfig(**{c.as_dict()!r}),")
    lines += ["}", ""]
    path.write_text("\n".join(lines))


def render(results, command: str) -> str:
    dev = torch.cuda.get_device_name(0)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    fwd = [r for r in results if r["op"] == "fwd" and "us" in r]
    bwd = [r for r in results if r["op"] == "bwd" and "us" in r]
    ms = sorted({r["M"] for r in fwd})
    out = [
        "## kernels",
        "",
        f"Device: {dev}; date: {date}; torch {torch.__version__}; command: `{command}`.",
        "Forward: speedup = cuBLAS bf16 time / qerl NVFP4 time (higher is better), with qerl's time in us.",
        "Each time is the median over CUDA-graph replays of one call per weight copy, copies rotated",
        "through >= 256 MB so the weights come from HBM; cuBLAS and qerl are timed alternately `--rounds`",
        "times per point and each side's median is reported.",
        "",
        "| shape (N x K) | " + " | ".join(f"M={m}" for m in ms) + " |",
        "| --- | " + " | ".join("---" for _ in ms) + " |",
    ]
    keys = list(dict.fromkeys((r["model"], r["layer"], r["N"], r["K"]) for r in fwd))

    def rows(cell, with_shape: bool) -> list[str]:
        # One row per weight shape, one column per M; "-" where that point was not measured.
        lines = []
        for key in keys:
            cells = []
            for m in ms:
                r = next((r for r in fwd if (r["model"], r["layer"], r["N"], r["K"]) == key and r["M"] == m), None)
                cells.append(cell(r) if r else "-")
            name = f"{key[0]} {key[1]} ({key[2]}x{key[3]})" if with_shape else f"{key[0]} {key[1]}"
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        return lines

    header = ["| shape | " + " | ".join(f"M={m}" for m in ms) + " |", "| --- | " + " | ".join("---" for _ in ms) + " |"]
    out += rows(lambda r: f"{r['speedup']:.2f}x ({r['us']:.1f})", True)
    out += ["", "cuBLAS bf16 times (us):", "", *header]
    out += rows(lambda r: f"{r['cublas_us']:.1f}", False)
    out += ["", "Achieved HBM bandwidth (TB/s, fewest bytes: NVFP4 weight + X + Y) and tensor rate (TFLOP/s) of the qerl kernel:", "",
            *header]
    out += rows(lambda r: f"{r['TBps']:.2f} / {r['TFLOPs']:.0f}", False)
    if bwd:
        out += ["", "Backward grad-input dX = dY @ dequant(W) vs cuBLAS `dY @ W` (bf16):", "",
                "| shape | M | qerl us | cuBLAS us | speedup | qerl TFLOP/s |", "| --- | --- | --- | --- | --- | --- |"]
        for r in bwd:
            out.append(f"| {r['model']} {r['layer']} ({r['N']}x{r['K']}) | {r['M']} | {r['us']:.1f} | "
                       f"{r['cublas_us']:.1f} | {r['speedup']:.2f}x | {r['TFLOPs']:.0f} |")
    deq = [r for r in results if r["op"] == "dequant"]
    if deq:
        out += ["", "Dequantize kernel (NVFP4 -> bf16, used by the M >= threshold paths), bytes = 0.5625 read + 2 written per weight:", "",
                "| shape | us | TB/s |", "| --- | --- | --- |"]
        for r in deq:
            out.append(f"| {r['model']} {r['layer']} ({r['N']}x{r['K']}) | {r['us']:.1f} | {r['TBps']:.2f} |")
    # Targets: geometric mean speedup per M over the shapes, against the targets.
    out += ["", "Targets (geometric mean over the shapes measured):", "", "| M | geomean speedup | min | target |",
            "| --- | --- | --- | --- |"]
    for m in ms:
        sp = [r["speedup"] for r in fwd if r["M"] == m]
        gm = geomean(sp)
        tgt = f">= {TARGETS[m]:.1f}x" if m in TARGETS else "-"
        out.append(f"| {m} | {gm:.2f}x | {min(sp):.2f}x | {tgt} |")
    for m in sorted({r["M"] for r in bwd}):  # one row per M (--bwd-ms may list several)
        sp = [r["speedup"] for r in bwd if r["M"] == m]
        out.append(f"| bwd {m} | {geomean(sp):.2f}x | {min(sp):.2f}x | >= {BWD_TARGET}x |")
    return "\n".join(out) + "\n"


def write_doc_section(path: Path, text: str) -> None:
    """Replace (or append) the ``## kernels`` section, leaving other sections alone."""
    old = path.read_text() if path.exists() else "# Benchmarks\n\n"
    lines = old.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.strip() == "## kernels"), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        notes = [ln for ln in lines[start:end] if ln.startswith("<!-- keep -->")]
        new = "".join(lines[:start]) + text + "".join(notes) + ("\n" if end < len(lines) else "") + "".join(lines[end:])
    path.write_text(new)


if __name__ == "__main__":
    if not torch.cuda.is_available() and not {"-h", "--help"} & set(sys.argv):
        print("bench_kernels needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
