"""Launch one table GEMM a few times per M, for Nsight Compute to profile (a probe, no timing of its own).

    ncu --set full -k regex:gluon_ws --launch-skip 2 --launch-count 1 -o rep \
        python benchmarks/ncu_small_m.py --shape 7B:gate_up --m 16

``--cublas`` launches torch.matmul on the bf16 weights instead, for the same report of the baseline.

Prints the table config it ran, so a report can be matched to its tile.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import SHAPES, ShapeData  # noqa: E402
from probe_variants import parse_variant  # noqa: E402


def main(argv=None) -> int:
    from qerl_kernels.gemm_fwd import nvfp4_matmul
    from qerl_kernels.tile_configs import fwd_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="7B:gate_up", help="model:layer from bench_kernels.SHAPES")
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--cublas", action="store_true", help="run torch.matmul on bf16 weights instead (the baseline)")
    ap.add_argument("--variant", default="", help="FwdConfig fields over the table's tile, e.g. halves=1 (probe_variants)")
    args = ap.parse_args(argv)
    n, k = SHAPES[tuple(args.shape.split(":"))]
    d = ShapeData(n, k, seed=n + k)
    if args.cublas:
        x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
        print(f"{args.shape} M={args.m}: cuBLAS bf16", flush=True)
        for i in range(args.calls):
            torch.matmul(x, d.w16[i % len(d.w16)].t())
        torch.cuda.synchronize()
        return 0
    cfg = replace(fwd_config(args.m, n, k), **parse_variant(args.variant))
    print(f"{args.shape} M={args.m}: {cfg}", flush=True)
    x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
    for i in range(args.calls):
        nvfp4_matmul(x, d.packed[i % len(d.packed)], d.scale[i % len(d.scale)], d.gs, config=cfg, twiddled=d.tw,
                     blocked=d.bl)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
