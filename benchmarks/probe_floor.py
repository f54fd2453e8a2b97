"""What a weight-read-bound GEMM of each shape could take at best, in the bench's own harness.

The small-M target (3x of cuBLAS bf16) asks 7B o (7.2 MB of NVFP4 weight + scales) to run in
~4 us. This probe measures, per shape and in one run: an empty Triton kernel (the harness's
per-call floor: a CUDA-graph kernel node, no memory traffic), the best of a few plain streaming
reads of exactly the NVFP4 bytes (no decode, no MMA: what any kernel reading that weight once
cannot beat), cuBLAS bf16 and qerl's NVFP4 GEMM at M = 1 (table config). Same method as
bench_kernels.py: one call per weight copy, copies rotated through >= 256 MB, medians of
CUDA-graph replays.

Usage (GPU): ``python benchmarks/probe_floor.py [--json-out F]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import SHAPES, ShapeData, bench_cublas_fwd, bench_fwd_point, time_graph  # noqa: E402


@triton.jit
def _empty(OUT):
    pass


@triton.jit
def _stream(P, OUT, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    base = pid * BLOCK * ITERS
    for i in tl.range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(P + offs, mask=offs < n_words, other=0)
    tl.store(OUT + pid, tl.sum(acc, axis=0))


STREAM_CONFIGS = [(2048, 1, 4, 2), (2048, 4, 4, 3), (4096, 2, 8, 3), (1024, 8, 4, 4), (4096, 4, 8, 4)]


def stream_us(bufs: list[torch.Tensor]) -> tuple[float, tuple]:
    n = bufs[0].numel()
    best = None
    for block, iters, warps, stages in STREAM_CONFIGS:
        grid = triton.cdiv(n, block * iters)
        out = torch.empty(grid, dtype=torch.int32, device="cuda")
        kw = dict(BLOCK=block, ITERS=iters, num_warps=warps, num_stages=stages)
        fns = [lambda b=b, g=grid, o=out, kw=kw: _stream[(g,)](b, o, n, **kw) for b in bufs]
        us = time_graph(fns)
        if best is None or us < best[0]:
            best = (us, (block, iters, warps, stages))
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    out = torch.empty(1, device="cuda")
    empty = time_graph([lambda: _empty[(1,)](out) for _ in range(64)])
    rows = []
    print(f"empty kernel: {empty:.2f} us per call")
    for (model, layer), (n, k) in SHAPES.items():
        d = ShapeData(n, k, seed=n + k)
        nbytes = n * k // 2 + n * k // 16
        bufs = [torch.cat([p.reshape(-1), s.view(torch.uint8).reshape(-1)]).view(torch.int32) for p, s in zip(d.packed, d.scale)]
        s_us, s_cfg = stream_us(bufs)
        del bufs
        q_us, _ = bench_fwd_point(d, 1, None)
        c_us = bench_cublas_fwd(d, 1)
        row = {"model": model, "layer": layer, "N": n, "K": k, "MB": round(nbytes / 1e6, 2), "empty_us": round(empty, 2),
               "stream_us": round(s_us, 2), "stream_TBps": round(nbytes / s_us / 1e6, 2), "stream_cfg": s_cfg,
               "qerl_m1_us": round(q_us, 2), "cublas_m1_us": round(c_us, 2),
               "cublas_over_stream": round(c_us / s_us, 2), "cublas_over_qerl": round(c_us / q_us, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del d
        torch.cuda.empty_cache()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "empty_us": empty, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
