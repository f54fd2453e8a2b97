"""What ``permute_x`` (natural X -> the MMA's K order, one pass before every X-by-TMA tile that gets natural
X) costs against a plain copy of X, and how its program shape changes that (a probe).

    python benchmarks/probe_permute.py --ms 128,1024 --ks 3584,5120,18944,27648 --brs 16,32,64 --warps 4,8

X is the same tensor every call, as in bench_kernels.py, so small X stays in L2 as it does there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import time_graph  # noqa: E402
from qerl_kernels.gemm_gluon_tma import _permute_x_kernel, permute_x_reference  # noqa: E402


def run(x, xp, br, warps):
    m, k = x.shape
    _permute_x_kernel[(triton.cdiv(m, br), k // 128)](x, xp, m, k, x.stride(0), xp.stride(0), BR=br, num_warps=warps)
    return xp


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="128,1024")
    ap.add_argument("--ks", default="3584,5120,18944,27648")
    ap.add_argument("--brs", default="16,32,64")
    ap.add_argument("--warps", default="4,8")
    args = ap.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}", flush=True)
    for m in map(int, args.ms.split(",")):
        for k in map(int, args.ks.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xp = torch.empty_like(x)
            ref = permute_x_reference(x)
            copy = time_graph([lambda x=x, xp=xp: xp.copy_(x)])
            row = [f"M={m} K={k} ({2 * m * k / 1e6:.1f} MB): copy {copy:.1f} us"]
            for br in map(int, args.brs.split(",")):
                for w in map(int, args.warps.split(",")):
                    out = run(x, xp, br, w)
                    assert torch.equal(out, ref), (m, k, br, w)
                    us = time_graph([lambda x=x, xp=xp, b=br, ww=w: run(x, xp, b, ww)])
                    row.append(f"br{br} w{w} {us:.1f}")
            print(" | ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
