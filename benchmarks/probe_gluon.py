"""The Gluon small-M kernel (``qerl_kernels.gemm_gluon``) against the tile table, in the kernel
benchmark's harness, on the layout qerl loads (twiddled, blocked codes).

Per shape and M: the table tile (what ships), the Gluon kernel at the table's BM / BN / split /
warps, and the best Gluon point over the tile widths x warps of ``--bns`` and split-K factors
``--splits``. Prints each time in us, its speedup over cuBLAS bf16 (same run) and its relative error
against cuBLAS on the dequantized weight, then geomeans of table time / variant time (above 1 =
faster). Table points that already run the Gluon kernel are skipped unless ``--all``.

    python benchmarks/probe_gluon.py --ms 1,16,64
    python benchmarks/probe_gluon.py --ms 16 --bns 256x16 --all   # four warpgroups share one X tile
"""

from __future__ import annotations

import argparse
import collections
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import add_probe_args, bench_fwd_point, geomean, probe_points  # noqa: E402


def main(argv=None) -> int:
    from qerl_kernels.tile_configs import FwdConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_args(ap, layers="qkv,o,gate_up,down")
    ap.add_argument("--splits", default="1,2,4,8")
    ap.add_argument("--bns", default="64x4,128x4", help="BN x warps (64 weight rows per warpgroup or more)")
    ap.add_argument("--all", action="store_true", help="also the points the table already runs on Gluon")
    args = ap.parse_args(argv)
    ratios = collections.defaultdict(list)
    for model, layer, d, m, base, cub in probe_points(args):
        if base.dequant or (base.gluon and not args.all):
            continue
        assert d.bl, "the Gluon kernel reads blocked codes"
        t_tab, _ = bench_fwd_point(d, m, base)
        bm = max(8, base.bm)
        line = f"{model} {layer} M={m}: cuBLAS {cub:.1f} | table {t_tab:.1f} ({cub / t_tab:.2f}x)"
        table_tile = FwdConfig(bm, base.bn, 16, split_k=base.split_k, warps=base.warps, swap=True, gluon=True)
        us, err = bench_fwd_point(d, m, table_tile)
        ratios[(m, "gluon, table tile")].append(t_tab / us)
        line += f" | gluon {us:.1f} ({cub / us:.2f}x, err {err:.0e})"
        best = None
        for bn, warps in (map(int, v.split("x")) for v in args.bns.split(",")):
            for split in map(int, args.splits.split(",")):
                cfg = replace(table_tile, bn=bn, warps=warps, split_k=split)
                us, err = bench_fwd_point(d, m, cfg)
                if best is None or us < best[0]:
                    best = (us, err, f"{bn}x{warps}", split)
        ratios[(m, "gluon best")].append(t_tab / best[0])
        line += f" | best {best[0]:.1f} ({cub / best[0]:.2f}x, BN {best[2]} split {best[3]}, err {best[1]:.0e})"
        print(line, flush=True)
    for key, v in sorted(ratios.items()):
        gm = geomean(v)
        print(f"M={key[0]} {key[1]}: table/variant geomean {gm:.3f} (min {min(v):.2f}, max {max(v):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
