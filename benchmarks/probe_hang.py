"""Where a benchmark point stalls: each step of one point timed and printed, with Python's stack dumped
every 30 s while a step runs (a probe for points that never finish).

For one shape and M: qerl's first eager call, a second one, cuBLAS's time in the harness, then qerl's
time in the harness (CUDA-graph replays of one call per rotated weight copy), each with PDL on and off.

    python benchmarks/probe_hang.py --shape 32B:qkv --m 1024
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import SHAPES, ShapeData, bench_cublas_fwd, time_graph  # noqa: E402


def step(name: str, fn):
    t0 = time.time()
    faulthandler.dump_traceback_later(30, repeat=True)
    try:
        out = fn()
        torch.cuda.synchronize()
    finally:
        faulthandler.cancel_dump_traceback_later()
    print(f"{name}: {time.time() - t0:.2f} s wall{f', {out:.1f} us' if isinstance(out, float) else ''}", flush=True)


def main(argv=None) -> int:
    from qerl_kernels.gemm_fwd import nvfp4_matmul
    from qerl_kernels.tile_configs import fwd_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32B:qkv")
    ap.add_argument("--m", type=int, default=1024)
    ap.add_argument("--pdl", default="1,0")
    ap.add_argument("--copies", type=int, default=0, help="weight copies in the graph (0: the harness's count)")
    ap.add_argument("--set", default="", help="FwdConfig fields over the table's tile, e.g. persist=0,tail=False")
    ap.add_argument("--skip-eager", action="store_true")
    args = ap.parse_args(argv)
    model, layer = args.shape.split(":")
    n, k = SHAPES[(model, layer)]
    print(f"# {torch.cuda.get_device_name()} {model} {layer} M={args.m}", flush=True)
    d = ShapeData(n, k, seed=n + k)
    cfg = fwd_config(args.m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    if args.set:
        from dataclasses import replace

        cfg = replace(cfg, **{kv.split("=")[0]: eval(kv.split("=")[1]) for kv in args.set.split(",")})  # noqa: S307
    copies = args.copies or d.r4
    print(f"config {cfg}", flush=True)
    x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
    step("cuBLAS in the harness", lambda: bench_cublas_fwd(d, args.m))
    for pdl in args.pdl.split(","):
        os.environ["QERL_PDL"] = pdl

        def call(i=0):
            return nvfp4_matmul(x, d.packed[i], d.scale[i], d.gs, config=cfg, twiddled=d.tw, blocked=d.bl)

        if not args.skip_eager:
            step(f"PDL={pdl} first eager call", call)
            step(f"PDL={pdl} eager calls over {copies} copies", lambda: [call(i) for i in range(copies)] and None)
        step(f"PDL={pdl} qerl in the harness, {copies} copies",
             lambda: time_graph([lambda i=i: call(i) for i in range(copies)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
