"""Variants of the table's forward tiles, timed against the table tile and cuBLAS in one run.

Each ``--variant`` is a comma list of ``FwdConfig`` fields applied over the table config of every
shape and M (``;`` separates variants), e.g. ``tma=1,stages=4`` (codes and X by TMA bulk copies:
one [BN/16, 1 KB] box and one [BM, 128] box per step, through Triton's descriptor-load pipeline)
or ``maxnreg=96`` (a register cap, so more programs share an SM). The harness is the kernel
benchmark's (weight copies rotated through >= 256 MB, CUDA graph, median of replays); every point
also reports its relative error against the bf16 reference, and the table tile's programs per launch in
waves over 132 SMs. ``--where`` keeps the points whose table tile matches, e.g. ``xtma=1,ws=0`` (the
TMA-fed kernel) for ``--variant 'halves=1;sk=1'``.

    python benchmarks/probe_variants.py --ms 1,16,64 --variant 'tma=1,stages=3;tma=1,stages=6'
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import add_probe_args, bench_cublas_fwd, bench_fwd_point, probe_points  # noqa: E402

FLAGS = {"swap", "join", "perm", "stagger", "tma", "dequant", "gluon", "xtma", "inflight", "ws", "halves"}


def parse_variant(spec: str) -> dict:
    """'tma=1,stages=4' -> {'tma': True, 'stages': 4} (booleans for the flag fields)."""
    out = {}
    for item in filter(None, spec.split(",")):
        key, val = item.split("=")
        out[key] = val.lower() in ("1", "true") if key in FLAGS else int(val)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_args(ap, layers="qkv,o,gate_up,down")
    ap.add_argument("--variant", default="tma=1,stages=3;tma=1,stages=4;tma=1,stages=6")
    ap.add_argument("--where", default="", help="only the points whose table tile has these fields, e.g. xtma=1,ws=0")
    ap.add_argument("--cublas-again", action="store_true",
                    help="time cuBLAS again after the variants (an order check: a no-op variant such as group_m=8, "
                         "unused by the Gluon tiles, then shows what the measurement order alone moves)")
    args = ap.parse_args(argv)
    where = parse_variant(args.where)
    for model, layer, d, m, base, cub in probe_points(args):
        if base.dequant or any(getattr(base, k) != v for k, v in where.items()):
            continue
        table_us, table_err = bench_fwd_point(d, m, base)
        programs = math.ceil(m / base.bm) * math.ceil(d.n / base.bn) * base.split_k
        line = (f"{model} {layer} M={m}: cuBLAS {cub:.1f} us | {programs} programs ({programs / 132:.2f} waves) | "
                f"table {table_us:.1f} us {cub / table_us:.2f}x")
        for spec in args.variant.split(";"):
            cfg = replace(base, **parse_variant(spec))
            try:
                us, err = bench_fwd_point(d, m, cfg)
            except Exception as e:  # a tile that does not build: report and go on
                line += f" | {spec} {type(e).__name__}: {str(e)[:80]}"
                continue
            line += f" | {spec} {us:.1f} us {cub / us:.2f}x (err {err:.1e})"
        if args.cublas_again:
            line += f" | cuBLAS again {bench_cublas_fwd(d, m):.1f} us"
        print(line + f" [table err {table_err:.1e}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
