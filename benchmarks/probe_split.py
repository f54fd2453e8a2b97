"""Split-K and tile width around the table's small-M configs: is the large-weight loss load imbalance?

At M <= 16 the table runs e.g. 7B gate_up as 296 programs of BN 128 on 132 SMs (2.24 per SM: some
SMs do 3, most 2). This times the table config of each large weight with every split factor in
``--splits`` and tile widths BN 64/128/256, in the kernel benchmark's harness (one call per weight
copy rotated through >= 256 MB, CUDA graph, median of replays), against cuBLAS bf16.

    python benchmarks/probe_split.py --ms 1,16 --layers gate_up,down --splits 1,2,3,4,6,8
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import add_probe_args, bench_fwd_point, probe_points  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_args(ap, layers="gate_up,down")
    ap.add_argument("--splits", default="1,2,3,4,6,8")
    args = ap.parse_args(argv)
    for model, layer, d, m, base, cub in probe_points(args):
        table_us, _ = bench_fwd_point(d, m, base)
        res = []
        for bn, warps in ((64, 4), (128, 4), (256, 8)):
            for split in map(int, args.splits.split(",")):
                cfg = replace(base, bn=bn, warps=warps, split_k=split)
                try:
                    us, err = bench_fwd_point(d, m, cfg)
                except Exception as e:  # a tile that does not build: skip
                    print(f"  {bn} {split}: {type(e).__name__}", flush=True)
                    continue
                programs = -(-d.n // bn) * split
                res.append((us, bn, split, programs, err))
        res.sort()
        print(f"## {model} {layer} M={m}: cuBLAS {cub:.1f} us, table (bn {base.bn}, split {base.split_k}) "
              f"{table_us:.1f} us = {cub / table_us:.2f}x", flush=True)
        for us, bn, split, programs, err in res[:6]:
            print(f"  {us:7.1f} us {cub / us:.2f}x  bn {bn} split {split} programs {programs} "
                  f"({programs / 132:.2f}/SM) err {err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
