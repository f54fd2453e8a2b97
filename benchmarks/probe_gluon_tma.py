"""The TMA-fed Gluon kernel (``qerl_kernels.gemm_gluon_tma``) against the tile table at M = 64-256,
in the kernel benchmark's harness, on the layout qerl loads (twiddled, blocked codes).

Per shape and M: the table tile (what ships) and every candidate of ``--bns`` x ``--stages`` x
``--inflight`` x ``--splits`` (BM = min(M, ``--bm``)); prints the table's time, the best candidate's
time, tile and relative error against cuBLAS on the dequantized weight, then geomeans of table
time / best candidate time (above 1 = faster) and the candidates that won. ``--sweep-out`` writes the
winners as tile-table entries (a JSON list of [M, N, K, config]) where they beat the table.

    python benchmarks/probe_gluon_tma.py --ms 64,128,256
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import add_probe_args, bench_fwd_point, geomean, probe_points, time_graph  # noqa: E402


def candidates(m: int, args):
    from qerl_kernels.tile_configs import FwdConfig

    bm = min(args.bm, max(16, 1 << (m - 1).bit_length()))  # wgmma N >= 8; TMA boxes of 16 rows
    for bn_w in args.bns.split(","):
        bn, warps = map(int, bn_w.split("x"))
        for stages in map(int, args.stages.split(",")):
            if bm * bn > 128 * 256 or stages * bm * 256 > 200 * 1024:
                continue  # accumulator past the register file / X ring past shared memory
            for inflight in map(int, args.inflight.split(",")):
                for split in map(int, args.splits.split(",")):
                    yield FwdConfig(bm, bn, 16, split_k=split, warps=warps, stages=stages, swap=True,
                                    gluon=True, xtma=True, inflight=bool(inflight))


def main(argv=None) -> int:
    from qerl_kernels.gemm_gluon_tma import permute_x

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_args(ap, layers="qkv,o,gate_up,down")
    ap.add_argument("--bm", type=int, default=128, help="largest BM (tokens per tile)")
    ap.add_argument("--bns", default="128x8,256x8,64x4", help="BN x warps")
    ap.add_argument("--stages", default="3,4")
    ap.add_argument("--inflight", default="0,1")
    ap.add_argument("--splits", default="1,2,4")
    ap.add_argument("--sweep-out", default="")
    args = ap.parse_args(argv)
    ratios = collections.defaultdict(list)
    wins = collections.Counter()
    entries = []
    for model, layer, d, m, base, cub in probe_points(args):
        assert d.bl, "the Gluon kernels read blocked codes"
        t_tab, _ = bench_fwd_point(d, m, base)
        best = None
        for cfg in candidates(m, args):
            us, err = bench_fwd_point(d, m, cfg)
            if best is None or us < best[0]:
                best = (us, err, cfg)
        us, err, cfg = best
        x = torch.randn(m, d.k, device="cuda", dtype=torch.bfloat16)
        # The X permutation pass alone (part of every time above), 32 calls per graph: one would time the
        # graph launch.
        t_perm = time_graph([lambda x=x: permute_x(x)] * 32)
        tile = f"BM {cfg.bm} BN {cfg.bn}x{cfg.warps}w stages {cfg.stages} inflight {int(cfg.inflight)} split {cfg.split_k}"
        print(f"{model} {layer} M={m}: cuBLAS {cub:.1f} | table {t_tab:.1f} ({cub / t_tab:.2f}x) | "
              f"gluon-tma {us:.1f} ({cub / us:.2f}x, {tile}, err {err:.0e}) | permute X {t_perm:.1f}", flush=True)
        ratios[m].append(t_tab / us)
        ratios[("cublas", m)].append(cub / min(us, t_tab))
        wins[tile] += 1
        if us < t_tab:
            entries.append([m, d.n, d.k, cfg.as_dict()])
    for key, v in ratios.items():
        gm = geomean(v)
        what = f"M={key[1]} cuBLAS / best of both" if isinstance(key, tuple) else f"M={key} table/gluon-tma"
        print(f"{what}: geomean {gm:.3f} (min {min(v):.2f}, max {max(v):.2f})")
    print("winning tiles:", dict(wins))
    if args.sweep_out:
        Path(args.sweep_out).write_text(json.dumps(entries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
