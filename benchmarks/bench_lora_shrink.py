"""The LoRA shrink t = x @ A^T at decode sizes: qerl's one-launch kernel (kernels/lora_shrink.py) over
its plans (row tile, K steps per split) against torch's matmul (cuBLAS), on the 7B LoRA r=16 shapes.

    python benchmarks/bench_lora_shrink.py --ms 16,32,64,128

Times are medians of CUDA-graph replays, one call per copy of x and A, copies rotated through >= 64 MB.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import time_graph  # noqa: E402
from qerl_kernels import lora_shrink as ls  # noqa: E402

# (name, K, r): the grouped q/k/v (3 x 16) and gate/up (2 x 16) shrinks, o and down.
SHAPES = [("qkv", 3584, 48), ("gate_up", 3584, 32), ("o", 3584, 16), ("down", 18944, 16)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="16,32,64,128")
    ap.add_argument("--bms", default="16,32,64")
    ap.add_argument("--pers", default="1,2,4,8,0", help="K steps per split (0: the default plan)")
    args = ap.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}", flush=True)
    for m in map(int, args.ms.split(",")):
        for name, k, r in SHAPES:
            copies = max(1, (64 << 20) // ((m + r) * k * 2))
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            as_ = [torch.randn(r, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
            ref = xs[0].float() @ as_[0].float().t()
            t_cublas = time_graph([lambda x=x, a=a: x @ a.t() for x, a in zip(xs, as_)])
            best = None
            for bm, per in itertools.product(map(int, args.bms.split(",")), map(int, args.pers.split(","))):
                if bm > max(16, m) * 2:
                    continue
                out = ls.lora_shrink(xs[0], as_[0], bm, per).float()
                assert (out - ref).abs().max() <= 2e-2 * ref.abs().max(), (name, m, bm, per)
                us = time_graph([lambda x=x, a=a, b=bm, p=per: ls.lora_shrink(x, a, b, p) for x, a in zip(xs, as_)])
                split = ls.shrink_plan(m, k, bm, per)[2]
                if best is None or us < best[0]:
                    best = (us, bm, per, split)
                print(f"  {name} M={m} bm{bm} per{per} split{split}: {us:.2f} us", flush=True)
            default = ls.shrink_plan(m, k)
            print(f"{name} (K {k}, r {r}) M={m}: cuBLAS {t_cublas:.2f} us | best {best[0]:.2f} us (bm{best[1]} "
                  f"per{best[2]} split{best[3]}) | default plan bm{default[0]} split{default[2]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
