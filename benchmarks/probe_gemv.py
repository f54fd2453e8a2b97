"""The CUDA-core GEMV (``qerl_kernels.gemv``, ``FwdConfig.gemv``) against the tile table at M = 1-4, in the kernel
benchmark's harness, on the layout qerl loads (twiddled, blocked codes).

Per shape and M: cuBLAS bf16, the table tile (what ships) and every GEMV tile of ``--bns`` (rows per
program) x ``--bkws`` (32-bit words of K per step) x ``--warps``; prints the best GEMV tile, its speedup
over cuBLAS and its relative error against cuBLAS on the dequantized weight, then the geomean of table
time / best GEMV time per M (above 1 = the GEMV is faster). ``--json-out`` keeps every point, for the
table.

    python benchmarks/probe_gemv.py --ms 1,4
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import add_probe_args, bench_fwd_point, geomean, probe_points  # noqa: E402


def main(argv=None) -> int:
    from qerl_kernels.tile_configs import FwdConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_args(ap, layers="qkv,o,gate_up,down")
    ap.add_argument("--bns", default="4,8,16,32")
    ap.add_argument("--bkws", default="16,32,64")
    ap.add_argument("--warps", default="1,2,4")
    ap.add_argument("--json-out", default="")
    args = ap.parse_args(argv)
    ratios, rows = collections.defaultdict(list), []
    for model, layer, d, m, base, cub in probe_points(args):
        t_tab, _ = bench_fwd_point(d, m, base)
        points = []
        for bn, bkw, warps in itertools.product(*(map(int, v.split(",")) for v in (args.bns, args.bkws, args.warps))):
            cfg = FwdConfig(bm=m, bn=bn, bkw=bkw, warps=warps, stages=1, gemv=True)
            try:
                us, err = bench_fwd_point(d, m, cfg)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result too
                print(f"  {model} {layer} M={m} bn {bn} bkw {bkw} warps {warps}: {type(e).__name__}: {str(e)[:120]}")
                continue
            points.append((us, err, bn, bkw, warps))
        points.sort()
        best = points[0]
        ratios[m].append(t_tab / best[0])
        rows.append(dict(model=model, layer=layer, m=m, cublas_us=cub, table_us=t_tab,
                         gemv=[dict(us=us, err=err, bn=bn, bkw=bkw, warps=w) for us, err, bn, bkw, w in points]))
        print(f"{model} {layer} M={m}: cuBLAS {cub:.1f} | table {t_tab:.1f} ({cub / t_tab:.2f}x) | gemv best "
              f"{best[0]:.1f} ({cub / best[0]:.2f}x, bn {best[2]} bkw {best[3]} warps {best[4]}, err {best[1]:.0e}) "
              f"| next {', '.join(f'{p[0]:.1f} ({p[2]}/{p[3]}/{p[4]})' for p in points[1:4])}", flush=True)
    for m, v in sorted(ratios.items()):
        print(f"M={m}: table / best gemv geomean {geomean(v):.3f} (min {min(v):.2f}, max {max(v):.2f})")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
