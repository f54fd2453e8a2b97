"""Compile the tile table's kernels in parallel before a benchmark (a device-machine helper).

On a fresh lease Triton compiles each table tile on its first call, one after the other, and the
Gluon tiles take tens of seconds each in ptxas: `bench_kernels.py` then spends most of a 600 s call
compiling. This runs one call of every (shape, M) point the benchmark would time, forward and
grad-input, spread over worker processes, so the compiles run side by side and land in Triton's
cache (keep it between leases with benchmarks/device_env.sh). Values are random: only the launch
matters. Prints the points each worker compiled and the wall time.

    python benchmarks/warm_cache.py --ms 1,4,16,32,64,128,256,1024,4096 --bwd-ms 4096 --workers 12
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _compile(points: list[tuple[str, int, int, int]]) -> list[str]:
    import torch
    from qerl_kernels.gemm_bwd import nvfp4_matmul_grad_input
    from qerl_kernels.gemm_fwd import nvfp4_matmul
    from qerl_kernels.twiddle import can_block, to_kernel_layout

    done, weights = [], {}
    for kind, m, n, k in points:
        if (n, k) not in weights:
            bl = can_block(n, k)
            packed = to_kernel_layout(torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8), bl)
            scale = torch.randint(0x28, 0x48, (n, k // 16), device="cuda", dtype=torch.uint8).view(torch.float8_e4m3fn)
            weights[(n, k)] = (packed, scale, torch.tensor([1.0], device="cuda"), bl)
        packed, scale, gs, bl = weights[(n, k)]
        if kind == "fwd":
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            nvfp4_matmul(x, packed, scale, gs, twiddled=True, blocked=bl)
        else:
            dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            nvfp4_matmul_grad_input(dy, packed, scale, gs, twiddled=True, blocked=bl)
        torch.cuda.synchronize()
        done.append(f"{kind} M={m} {n}x{k}")
    return done


def main(argv=None) -> int:
    from bench_kernels import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,4,16,32,64,128,256,1024,4096")
    ap.add_argument("--bwd-ms", default="4096")
    ap.add_argument("--models", default="7B,32B")
    ap.add_argument("--workers", type=int, default=12)
    args = ap.parse_args(argv)
    points = [("fwd", m, n, k) for (model, _), (n, k) in SHAPES.items() if model in args.models.split(",")
              for m in map(int, args.ms.split(","))]
    points += [("bwd", m, n, k) for (model, _), (n, k) in SHAPES.items() if model in args.models.split(",")
               for m in (int(v) for v in args.bwd_ms.split(",") if v)]
    # Round-robin by point so each worker holds few distinct weights and the slow M buckets spread out.
    chunks = [points[i::args.workers] for i in range(args.workers)]
    t0 = time.time()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        for done in pool.imap_unordered(_compile, [c for c in chunks if c]):
            print(f"[{time.time() - t0:6.1f} s] compiled {len(done)}: {', '.join(done)}", flush=True)
    print(f"warm_cache: {len(points)} points in {time.time() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
