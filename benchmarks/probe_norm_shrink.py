"""The norm kernel's LoRA shrink against a plain norm + cuBLAS shrink, over rows of A per program and warps.

Qwen2.5-7B hidden size (3584), q/k/v (r = 3 x 16) and gate/up (2 x 16) stacked A, residual add and
AQN noise on; one call per copy of the inputs (rotated over 8 copies) in a CUDA graph, median of
replays. Prints us per call: plain fused norm, norm + ``y @ A^T`` (cuBLAS), and the fused launch
for each (rows of A per program, warps).

    python benchmarks/probe_norm_shrink.py --rows 1,16,64,128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import time_graph  # noqa: E402

from qerl_cli.layers import fused  # noqa: E402


def fused_call(x, r, w, z, a, rc, warps):
    n = x.shape[-1]
    y, ro = torch.empty_like(x), torch.empty_like(x)
    t = torch.empty(x.shape[0], a.shape[0], dtype=x.dtype, device=x.device)
    fused._rmsnorm_kernel[(x.shape[0], triton.cdiv(a.shape[0], rc))](
        x, r, w, z, y, ro, a, t, x.stride(0), r.stride(0), y.stride(0), ro.stride(0), a.stride(0), t.stride(0),
        n, a.shape[0], 1e-6, HAS_RES=True, HAS_NOISE=True, BLOCK=triton.next_power_of_2(n), SHRINK=True, RC=rc,
        num_warps=warps)
    return y, ro, t


def probe(rows: int, rank: int, n: int = 3584, copies: int = 8) -> dict:
    xs = [torch.randn(rows, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    rs = [torch.randn(rows, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    w = torch.rand(n, device="cuda").to(torch.bfloat16) + 0.5
    z = torch.randn(n, device="cuda") * 1e-2
    a = torch.randn(rank, n, device="cuda").to(torch.bfloat16) * 0.02
    res = {"norm only": time_graph([lambda x=x, r=r: fused.rmsnorm(x, w, z, 1e-6, r) for x, r in zip(xs, rs)]),
           "norm + cuBLAS shrink": time_graph([lambda x=x, r=r: fused.rmsnorm(x, w, z, 1e-6, r)[0] @ a.t()
                                               for x, r in zip(xs, rs)])}
    ref = fused.rmsnorm(xs[0], w, z, 1e-6, rs[0])[0] @ a.t()
    for rc in (2, 4, 8):
        for warps in (4, 8):
            err = (fused_call(xs[0], rs[0], w, z, a, rc, warps)[2].float() - ref.float()).abs().max().item()
            us = time_graph([lambda x=x, r=r, rc=rc, wp=warps: fused_call(x, r, w, z, a, rc, wp) for x, r in zip(xs, rs)])
            res[f"fused, {rc} rows of A, {warps} warps (err {err:.1e})"] = us
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64,128")
    ap.add_argument("--ranks", default="48,32")
    args = ap.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()} hidden 3584", flush=True)
    for rank in map(int, args.ranks.split(",")):
        for rows in map(int, args.rows.split(",")):
            print(f"## r {rank}, {rows} rows", flush=True)
            for k, us in probe(rows, rank).items():
                print(f"{us:7.2f} us  {k}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
