"""What the benchmark's natural-order X costs the X-by-TMA tiles: each table point timed over natural X (as
bench_kernels.py times it: a ``permute_x`` copy, then the GEMM) and over X already in the MMA's K order (as
the engine's norm, SwiGLU and attention kernels write it), with ``permute_x`` alone and cuBLAS bf16 in the
same run (a probe).

    python benchmarks/probe_korder_tax.py --ms 64,128,256,1024 --rounds 3

Points whose tile reads natural X (the per-thread Gluon kernel, decode once + cuBLAS) are marked ``natural``
and count their natural time on both sides: the engine hands them natural X. Both sides must give the same bits (the K-order path is the natural
path minus its copy). Prints per point the three times and, per M, the geomean speed-up over cuBLAS both
ways.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import add_probe_args, geomean, probe_points, time_graph  # noqa: E402


def measure(d, m: int, cfg, rounds: int) -> tuple[bool, float, float, float]:
    """(whether the tile reads X by TMA, natural-X us, K-order-X us, ``permute_x`` us) of one point."""
    from qerl_kernels.gemm_fwd import nvfp4_matmul, takes_korder_x
    from qerl_kernels.gemm_gluon_tma import permute_x

    x = torch.randn(m, d.k, device="cuda", dtype=torch.bfloat16)
    korder = takes_korder_x(m, d.n, d.k, x.device, d.tw, d.bl)
    xk = permute_x(x) if korder else x

    def call(i, xx, kk):
        return nvfp4_matmul(xx, d.packed[i], d.scale[i], d.gs, config=cfg, twiddled=d.tw, blocked=d.bl, x_korder=kk)

    def timed(xx, kk):
        return time_graph([lambda i=i: call(i, xx, kk) for i in range(d.r4)])

    assert torch.equal(call(0, x, False), call(0, xk, korder))
    nat, kor, perm = [], [], []
    for r in range(rounds):  # the side timed first alternates, so drift lands on both
        if r % 2:
            kor.append(timed(xk, korder))
            nat.append(timed(x, False))
        else:
            nat.append(timed(x, False))
            kor.append(timed(xk, korder))
        if korder:
            perm.append(time_graph([lambda: permute_x(x)]))
    tp = statistics.median(perm) if perm else float("nan")
    # A tile that reads natural X gets natural X from the engine too (its producers write K order only for
    # X-by-TMA tiles): its K-order time is its natural one (given K order it would permute back).
    tn = statistics.median(nat)
    return korder, tn, statistics.median(kor) if korder else tn, tp


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_args(ap, "qkv,o,gate_up,down")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    speed = defaultdict(lambda: ([], []))
    print("| point | tile | cuBLAS us | natural X us | K-order X us | permute_x us | natural | K order |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for model, layer, d, m, cfg, cublas in probe_points(args):
        korder, tn, tk, tp = measure(d, m, cfg, args.rounds)
        speed[m][0].append(cublas / tn)
        speed[m][1].append(cublas / tk)
        print(f"| {model} {layer} M={m} | {'X by TMA' if korder else 'natural'} | {cublas:.1f} | {tn:.1f} | {tk:.1f} "
              f"| {tp:.1f} | {cublas / tn:.2f}x | {cublas / tk:.2f}x |", flush=True)
    print("\n| M | geomean natural X | geomean K-order X |\n| --- | --- | --- |")
    for m, (a, b) in speed.items():
        print(f"| {m} | {geomean(a):.3f}x | {geomean(b):.3f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
