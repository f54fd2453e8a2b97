"""The Gluon small-M kernel (``qerl_kernels.gemm_gluon``) against the tile table, on the blocked
layout and on the fragment-ordered one (``to_frag``), in the kernel benchmark's harness.

Per shape and M: the table tile (what ships), the Gluon kernel at the table's BM / BN / split / warps
on blocked codes and on fragment-ordered codes + scales, and the best fragment-ordered point over
tile widths BN 64 / 128 (4 warps) and split-K factors 1-8. Prints each time in us, its speedup over
cuBLAS bf16 (same run) and its relative error against the table's output, then geomeans of
table time / variant time (above 1 = faster than the table).

    python benchmarks/probe_frag.py --ms 1,16,64
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import add_probe_args, bench_fwd_point, probe_points, rel, time_graph  # noqa: E402


def gluon_weights(d):
    """Every weight copy of ``d`` as (blocked int64 codes, e4m3 bytes) and in fragment order."""
    import torch
    from qerl_kernels.dequant import as_words
    from qerl_kernels.gemm_gluon import to_frag

    assert d.bl, "the Gluon kernel reads blocked codes"
    blocked = [(as_words(p).view(torch.int64), s.contiguous().view(torch.uint8)) for p, s in zip(d.packed, d.scale)]
    return blocked, [to_frag(g, s) for g, s in blocked]


def time_gluon(d, x, weights, cfg, ref, frag: bool):
    """(us, relative error vs ``ref``) of the Gluon kernel over all weight copies of ``d``."""
    from qerl_kernels.gemm_gluon import launch_gluon

    def call(i):
        return launch_gluon(x, *weights[i], d.gs, None, cfg, frag=frag)

    err = rel(call(0), ref)
    return time_graph([lambda i=i: call(i) for i in range(d.r4)]), err


def main(argv=None) -> int:
    import torch
    from qerl_kernels.gemm_fwd import nvfp4_matmul

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_args(ap, layers="qkv,o,gate_up,down")
    ap.add_argument("--splits", default="1,2,4,8")
    args = ap.parse_args(argv)
    ratios = collections.defaultdict(list)
    layouts = (None, None, None)  # (ShapeData they belong to, blocked, fragment-ordered)
    for model, layer, d, m, base, cub in probe_points(args):
        if base.dequant:
            continue
        if layouts[0] is not d:
            layouts = (d, *gluon_weights(d))
        _, blocked, frag = layouts
        x = torch.randn(m, d.k, device="cuda", dtype=torch.bfloat16)
        ref = nvfp4_matmul(x, d.packed[0], d.scale[0], d.gs, config=base, twiddled=True, blocked=True)
        t_tab, _ = bench_fwd_point(d, m, base)
        bm = max(8, base.bm)
        line = f"{model} {layer} M={m}: cuBLAS {cub:.1f} | table {t_tab:.1f} ({cub / t_tab:.2f}x)"
        table_tile = SimpleNamespace(bm=bm, bn=base.bn, split_k=base.split_k, warps=base.warps)
        for name, weights in (("blocked", blocked), ("frag", frag)):
            us, err = time_gluon(d, x, weights, table_tile, ref, weights is frag)
            ratios[(m, name)].append(t_tab / us)
            line += f" | {name} {us:.1f} ({cub / us:.2f}x, err {err:.0e})"
        best = None
        for bn in (64, 128):
            for split in map(int, args.splits.split(",")):
                cfg = SimpleNamespace(bm=bm, bn=bn, split_k=split, warps=4)
                us, err = time_gluon(d, x, frag, cfg, ref, True)
                if best is None or us < best[0]:
                    best = (us, err, bn, split)
        ratios[(m, "frag best")].append(t_tab / best[0])
        line += f" | frag best {best[0]:.1f} ({cub / best[0]:.2f}x, BN {best[2]} split {best[3]}, err {best[1]:.0e})"
        print(line, flush=True)
    for key, v in sorted(ratios.items()):
        gm = math.exp(sum(map(math.log, v)) / len(v))
        print(f"M={key[0]} {key[1]}: table/variant geomean {gm:.3f} (min {min(v):.2f}, max {max(v):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
