"""The warp-specialised small-M kernel (kernels/gemm_gluon_ws.py) against the tile table (a probe).

For each Qwen2.5 shape and M: the table's time, then every warp-specialised candidate (BN, consumer
warps, ring stages, split-K, register cap at launch), each checked against the table's output first.
Prints the best candidate per point and the geomean of table time / best time per M.

    python benchmarks/probe_ws.py --ms 1,16 --bns 64,128 --warps 4,8 --stages 2 --rp 40:32,40:40,48:32 --half 0,1,2

BN 128 with 8 warps is two consumer warpgroups sharing one producer; M = 17-32 runs BM 32.
"""

from __future__ import annotations

import argparse
import sys
from itertools import product
from pathlib import Path
from types import SimpleNamespace

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import add_probe_args, bench_fwd_point, geomean, probe_points, time_graph  # noqa: E402
from qerl_kernels import gemm_gluon_ws as ws  # noqa: E402
from qerl_kernels.gemm_fwd import as_words  # noqa: E402
from qerl_kernels.gemm_gluon_tma import permute_x  # noqa: E402


def run_ws(x, packed, scale, gs, cfg):
    """With ``cfg.xtma`` x is already in the MMA's K order (the engine's producers write it so)."""
    groups, scale_u8 = as_words(packed).view(torch.int64), scale.view(torch.uint8)
    return ws.launch_gluon_ws(x, groups, scale_u8, gs, None, cfg, x_korder=cfg.xtma)


def run_swiglu(x, packed, scale, gs, cfg):
    """The engine's gate/up step from K-order X to K-order output: SwiGLU in the GEMM's epilogue, or, where
    the tile cannot pair (stream-K), the GEMM and then the SwiGLU kernel, as the engine falls back."""
    from qerl_kernels.gemm_fwd import nvfp4_matmul, nvfp4_swiglu
    from qerl_kernels.tile_configs import FwdConfig

    from qerl_cli.layers.fused import silu_mul

    if not isinstance(cfg, FwdConfig):  # a probe candidate
        cfg = FwdConfig(bkw=16, swap=True, gluon=True, ws=True, **vars(cfg))
    y = nvfp4_swiglu(x, packed, scale, gs, config=cfg, twiddled=True, blocked=True, x_korder=True, y_korder=True)
    if y is None:
        gu = nvfp4_matmul(x, packed, scale, gs, config=cfg, twiddled=True, blocked=True, x_korder=True)
        h = gu.shape[1] // 2
        y = silu_mul(gu[:, :h], gu[:, h:], korder=True)
    return y


AUTO_SPLITS = {"qkv": "4,8", "o": "4,8", "gate_up": "1,2", "down": "4,8"}


def candidates(args, layer, m, n, k):
    bm = args.bm or (8 if m <= 8 else 16 if m <= 16 else 32 if m <= 32 else 64)
    splits = AUTO_SPLITS[layer] if args.splits == "auto" else args.splits
    for bn in map(int, args.bns.split(",")):
        for warps in map(int, args.warps.split(",")):
            if bn != 16 * warps and not args.any_warps:  # one consumer warpgroup per 64 weight rows
                continue
            for stages in map(int, args.stages.split(",")):
                for rp in args.rp.split(","):
                    regs, pregs = map(int, rp.split(":"))
                    if True:
                        for split in map(int, splits.split(",")):
                            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
                            if split > 1 and tiles * split > args.max_waves * 8 * 132 or split > k // 256:
                                continue
                            for half in map(int, args.half.split(",")):
                                for halves in map(int, args.halves.split(",")):
                                    for xtma in map(int, args.xtma.split(",")):
                                        if halves and split > 1 or xtma and not half:
                                            continue
                                        for duo in map(int, args.duo.split(",")):
                                            if duo and (bn != 128 or split > 1 or halves):
                                                continue
                                            for xst in map(int, args.xstages.split(",")):
                                                if xst and not (xtma and half == 2):
                                                    continue
                                                for per, tst, tl in product(map(int, args.persist.split(",")),
                                                                            map(int, args.tstore.split(",")),
                                                                            map(int, args.tail.split(","))):
                                                    if per and not (duo and xst) or (tst or tl) and not per:
                                                        continue
                                                    yield SimpleNamespace(bm=bm, bn=bn, warps=warps, stages=stages,
                                                                          maxnreg=regs, pregs=pregs, split_k=split,
                                                                          half=half, halves=bool(halves),
                                                                          xtma=bool(xtma), duo=bool(duo), xstages=xst,
                                                                          persist=per, tstore=bool(tst),
                                                                          tail=bool(tl))


def main(argv=None) -> int:
    from qerl_kernels.gemm_fwd import nvfp4_matmul

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_args(ap, "qkv,o,gate_up,down")
    ap.add_argument("--bns", default="64,128")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--stages", default="4")
    ap.add_argument("--rp", default="40:40", help="launch register cap : producer registers (setmaxnreg); "
                    "the consumer gets 2 x cap - producer")
    ap.add_argument("--splits", default="auto", help="split-K factors, or auto: a per-layer set")
    ap.add_argument("--half", default="0", help="consumer MMA mode(s): 0 full step, 1 half steps, 2 half steps in flight")
    ap.add_argument("--halves", default="0", help="0, 1 or 0,1: split-K 1 tiles with the wave's last tiles halved")
    ap.add_argument("--max-waves", type=float, default=1.0, help="skip splits with more than this x 8 x 132 programs")
    ap.add_argument("--any-warps", action="store_true", help="also BN != 16 x warps (more rows per consumer warpgroup)")
    ap.add_argument("--xtma", default="0", help="0, 1 or 0,1: X by TMA from activations already in K order "
                    "(timed without a permutation pass: the engine's producers write that order)")
    ap.add_argument("--bm", type=int, default=0, help="X rows per tile (0: 8, 16, 32 or 64 by M)")
    ap.add_argument("--duo", default="0", help="0, 1 or 0,1: BN 128 split-K 1 tiles with the two consumer warpgroups "
                    "as separate partitions (FwdConfig.duo)")
    ap.add_argument("--xstages", default="0", help="X ring depths in [BM, 64] half steps (0: X in the codes' stages; "
                    "FwdConfig.xstages, xtma with half 2 only)")
    ap.add_argument("--persist", default="0", help="0, 1 or 0,1: persistent programs per SM (FwdConfig.persist; "
                    "duo tiles with an X ring only)")
    ap.add_argument("--tstore", default="0", help="0, 1 or 0,1: persistent tiles store by TMA, not waited for "
                    "(FwdConfig.tstore)")
    ap.add_argument("--tail", default="0", help="0, 1 or 0,1: persistent tiles split their last partial wave's "
                    "tiles in K (FwdConfig.tail)")
    ap.add_argument("--swiglu", action="store_true", help="gate/up as the engine launches it: SwiGLU in the "
                    "epilogue from K-order X, the table's tile timed the same way (candidates must take X by TMA)")
    ap.add_argument("-v", action="store_true", help="print every candidate's time")
    args = ap.parse_args(argv)
    ratios = {m: [] for m in map(int, args.ms.split(","))}
    for model, layer, d, m, tab, _ in probe_points(args):
        n, k = d.n, d.k
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        xk = permute_x(x)
        run = run_ws
        if args.swiglu and layer == "gate_up":
            run = run_swiglu
            ref = run_swiglu(xk, d.packed[0], d.scale[0], d.gs, tab).float()
            t_tab = time_graph([lambda p=p, s=s, x=xk, g=d.gs, c=tab: run_swiglu(x, p, s, g, c)
                                for p, s in zip(d.packed, d.scale)])
        else:
            t_tab, _ = bench_fwd_point(d, m, tab)
            ref = nvfp4_matmul(x, d.packed[0], d.scale[0], d.gs, twiddled=True, blocked=True).float()
        best, best_cfg, errs = None, None, []
        for cfg in candidates(args, layer, m, n, k):
            try:
                y = run(xk if cfg.xtma else x, d.packed[0], d.scale[0], d.gs, cfg).float()
            except Exception as e:  # noqa: BLE001 - a split ptxas cannot fit is skipped, not fatal
                print(f"  SKIP {model} {layer} M={m} {vars(cfg)}: {type(e).__name__}", flush=True)
                continue
            err = ((y - ref).norm() / ref.norm()).item()
            errs.append(err)
            if not err < 1e-2:
                print(f"  WRONG {model} {layer} M={m} {vars(cfg)}: rel err {err:.2e}", flush=True)
                continue
            us = time_graph([lambda p=p, s=s, c=cfg, x=xk if cfg.xtma else x, g=d.gs, f=run: f(x, p, s, g, c)
                             for p, s in zip(d.packed, d.scale)])
            if args.v:
                print(f"  {model} {layer} M={m} bn{cfg.bn} w{cfg.warps} st{cfg.stages} r{cfg.maxnreg} "
                      f"p{cfg.pregs} h{cfg.half} sk{cfg.split_k}{' halves' if cfg.halves else ''}"
                      f"{' xtma' if cfg.xtma else ''}{' duo' if cfg.duo else ''}{f' x{cfg.xstages}' if cfg.xstages else ''}"
                      f"{' persist' if cfg.persist else ''}{' tstore' if cfg.tstore else ''}{' tail' if cfg.tail else ''}: "
                      f"{us:.1f}", flush=True)
            if best is None or us < best:
                best, best_cfg = us, cfg
        if best is None:
            continue
        ratios[m].append(t_tab / best)
        print(f"{model} {layer} M={m}: table {t_tab:.1f} | ws best {best:.1f} ({t_tab / best:.2f}x) "
              f"bn{best_cfg.bn} w{best_cfg.warps} st{best_cfg.stages} r{best_cfg.maxnreg} p{best_cfg.pregs} "
              f"h{best_cfg.half} sk{best_cfg.split_k}{' halves' if best_cfg.halves else ''}"
              f"{' xtma' if best_cfg.xtma else ''}{' duo' if best_cfg.duo else ''}"
              f"{f' x{best_cfg.xstages}' if best_cfg.xstages else ''}{' persist' if best_cfg.persist else ''}"
              f"{' tstore' if best_cfg.tstore else ''}"
              f" | max err {max(errs):.1e}", flush=True)
    for m, v in ratios.items():
        if v:
            print(f"M={m}: table / best ws geomean {geomean(v):.3f} "
                  f"(min {min(v):.2f}, max {max(v):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
