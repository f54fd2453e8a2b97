"""The small-M Gluon kernel's two K loops, paired register sets (shipped) vs one set rotated through a
copy at the loop's end, in the kernel benchmark's harness (twiddled, blocked codes).

Per shape and M: the table tile, then every Gluon small-M candidate (``tile_configs._gluon_candidates``
at the split factors the sweep tries) in both loops; prints cuBLAS, the table's time and the best tile
of each loop, then geomeans of unpaired / paired (above 1 = paired faster) and of cuBLAS / the best
of the table and the paired candidates. ``--sweep-out`` writes the paired winners that beat the table
as tile-table entries (a JSON list of [M, N, K, config]).

    python benchmarks/probe_paired.py --ms 1,4,16,32
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import add_probe_args, bench_fwd_point, probe_points  # noqa: E402


def candidates(m: int, n: int, k: int):
    from qerl_kernels import tile_configs as tc

    bm = 8 if m <= 8 else max(16, 1 << (m - 1).bit_length())
    for c in tc._gluon_candidates(bm):
        s = tc.choose_split(m, n, k, c)
        for split in sorted({1, s, max(1, s // 2), s * 2}):
            yield tc.FwdConfig(**{**c.as_dict(), "split_k": split})


def main(argv=None) -> int:
    from qerl_kernels import gemm_gluon

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_args(ap, layers="qkv,o,gate_up,down")
    ap.add_argument("--sweep-out", default="")
    args = ap.parse_args(argv)
    launch = gemm_gluon.launch_gluon
    ratios = collections.defaultdict(list)
    entries = []
    for model, layer, d, m, base, cub in probe_points(args):
        t_tab, _ = bench_fwd_point(d, m, base)
        best = {}
        for paired in (False, True):
            gemm_gluon.launch_gluon = functools.partial(launch, paired=paired)  # gemm_fwd looks it up per call
            for cfg in [base] * base.gluon + list(candidates(m, d.n, d.k)):
                us, err = bench_fwd_point(d, m, cfg)
                if paired not in best or us < best[paired][0]:
                    best[paired] = (us, err, cfg)
        gemm_gluon.launch_gluon = launch
        (u0, _, _), (u1, e1, c1) = best[False], best[True]
        tile = f"BN {c1.bn}x{c1.warps}w split {c1.split_k}"
        print(f"{model} {layer} M={m}: cuBLAS {cub:.1f} | table {t_tab:.1f} ({cub / t_tab:.2f}x) | unpaired {u0:.1f} | "
              f"paired {u1:.1f} ({cub / u1:.2f}x, {tile}, err {e1:.0e})", flush=True)
        ratios[("unpaired/paired", m)].append(u0 / u1)
        ratios[("cuBLAS/best", m)].append(cub / min(u1, t_tab))
        if u1 < t_tab:
            entries.append([m, d.n, d.k, c1.as_dict()])
    for (what, m), v in ratios.items():
        gm = math.exp(sum(map(math.log, v)) / len(v))
        print(f"M={m} {what}: geomean {gm:.3f} (min {min(v):.2f}, max {max(v):.2f})")
    if args.sweep_out:
        Path(args.sweep_out).write_text(json.dumps(entries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
