"""Launch one table GEMM a few times per M, for Nsight Compute to profile (a probe, no timing of its own).

    ncu --set full -k regex:gluon_ws --launch-skip 2 --launch-count 1 -o rep \
        python benchmarks/ncu_small_m.py --shape 7B:gate_up --m 16

Prints the table config it ran, so a report can be matched to its tile.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import SHAPES, ShapeData  # noqa: E402


def main(argv=None) -> int:
    from qerl_kernels.gemm_fwd import nvfp4_matmul
    from qerl_kernels.tile_configs import fwd_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="7B:gate_up", help="model:layer from bench_kernels.SHAPES")
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args(argv)
    n, k = SHAPES[tuple(args.shape.split(":"))]
    d = ShapeData(n, k, seed=n + k)
    cfg = fwd_config(args.m, n, k)
    print(f"{args.shape} M={args.m}: {cfg}", flush=True)
    x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
    for i in range(args.calls):
        nvfp4_matmul(x, d.packed[i % len(d.packed)], d.scale[i % len(d.scale)], d.gs, config=cfg, twiddled=d.tw,
                     blocked=d.bl)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
