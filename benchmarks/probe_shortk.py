"""Small weights at small M: all of a program's K steps loaded up front (a probe).

The small-M Gluon kernel prefetches one K step ahead, and the register copy that carries the
prefetched step into the loop waits on its own load (kernels, tenth and thirteenth passes), so each
step costs about one memory round trip. On the small weights (7B/32B q/k/v and o) a split-K program
holds only 2-4 steps, and the kernel's time is that chain: first load, one round trip per step, the
split-K counter and the reduction. Here a program with at most ``STEPS`` steps issues every step's
code, scale and activation loads first, stores all its activation steps to shared memory behind one
barrier, then decodes and multiplies step after step with nothing left to wait for but the tensor
core. Steps past a program's end load clamped addresses with their activations masked to zero.

    python benchmarks/probe_shortk.py --ms 1,16 --layers qkv,o
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import SHAPES, ShapeData, add_probe_args, bench_fwd_point, geomean, time_graph  # noqa: E402
from qerl_kernels import gemm_gluon as gg  # noqa: E402

if gg.HAVE_GLUON:
    gluon, gl = gg.gluon, gg.gl

    @gluon.jit
    def _load(X, PW, S, code_off, scale_off, xm, xk, xrow_ok, j, s_lo, nsteps, stride_xm):
        step = s_lo + gl.minimum(j, nsteps - 1)
        return (gl.load(PW + code_off + step * 128), gl.load(S + scale_off + step * 8),
                gl.load(X + xm * stride_xm + step * 128 + xk, mask=xrow_ok & (j < nsteps), other=0.0))

    @gluon.jit
    def _mma(pw, s, buf, acc, BN: gl.constexpr, DOT: gl.constexpr):
        a = gg._decode_fragment(pw, s, BN, DOT)
        return gg.warpgroup_mma_wait(0, deps=[gg.warpgroup_mma(a, buf.permute((1, 0)), acc, is_async=True)])

    @gluon.jit(do_not_specialize=["M"])
    def _shortk_kernel(
        X, PW, S, G, B, Y, WS, CNT,
        M, N, KG, steps_per_split,
        stride_xm, stride_sn, stride_ym,
        BM: gl.constexpr, BN: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, NW: gl.constexpr,
        STEPS: gl.constexpr,
    ):
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        CODES: gl.constexpr = gg._codes_layout(BN, NW)
        XL: gl.constexpr = gg._x_layout(BM, NW)
        XS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, 128], gl.bfloat16)
        pid, pid_k, pid_m, pid_n, xm, xk, xrow_ok, code_off, scale_off, s_lo, nsteps = gg._program_tile(
            M, N, KG, steps_per_split, stride_sn, BM, BN, CODES, XL)
        xs = gl.allocate_shared_memory(gl.bfloat16, [STEPS, BM, 128], XS)
        acc = gl.zeros([BN, BM], gl.float32, layout=ACC)
        pw0, s0, x0 = _load(X, PW, S, code_off, scale_off, xm, xk, xrow_ok, 0, s_lo, nsteps, stride_xm)
        if STEPS > 1:
            pw1, s1, x1 = _load(X, PW, S, code_off, scale_off, xm, xk, xrow_ok, 1, s_lo, nsteps, stride_xm)
        if STEPS > 2:
            pw2, s2, x2 = _load(X, PW, S, code_off, scale_off, xm, xk, xrow_ok, 2, s_lo, nsteps, stride_xm)
        if STEPS > 3:
            pw3, s3, x3 = _load(X, PW, S, code_off, scale_off, xm, xk, xrow_ok, 3, s_lo, nsteps, stride_xm)
        xs.index(0).store(gg._permute_x(x0, BM))
        if STEPS > 1:
            xs.index(1).store(gg._permute_x(x1, BM))
        if STEPS > 2:
            xs.index(2).store(gg._permute_x(x2, BM))
        if STEPS > 3:
            xs.index(3).store(gg._permute_x(x3, BM))
        gg.fence_async_shared()
        gg._cta_barrier()
        acc = _mma(pw0, s0, xs.index(0), acc, BN, DOT)
        if STEPS > 1:
            acc = _mma(pw1, s1, xs.index(1), acc, BN, DOT)
        if STEPS > 2:
            acc = _mma(pw2, s2, xs.index(2), acc, BN, DOT)
        if STEPS > 3:
            acc = _mma(pw3, s3, xs.index(3), acc, BN, DOT)
        gg._store_tile(acc, G, B, Y, WS, CNT, pid, pid_k, pid_m, pid_n, M, N, stride_ym, BM, BN, SPLIT, HAS_BIAS, ACC)


def run_shortk(x, packed, scale, gs, bm, bn, warps, split):
    from types import SimpleNamespace

    from qerl_kernels.gemm_fwd import as_words

    groups, scale_u8 = as_words(packed).view(torch.int64), scale.view(torch.uint8)
    cfg = SimpleNamespace(bm=bm, bn=bn, split_k=split)
    m, n, kg, y, grid_mn, split, per, ws, cnt = gg.launch_plan(x, groups, cfg)
    _shortk_kernel[(grid_mn, split)](
        x, groups, scale_u8, gs.reshape(1).to(torch.float32), y, y, ws, cnt,
        m, n, kg, per, x.stride(0), scale_u8.stride(0), y.stride(0),
        BM=bm, BN=bn, SPLIT=split, HAS_BIAS=False, NW=warps, STEPS=per, num_warps=warps)
    return y


def main(argv=None) -> int:
    from qerl_kernels.gemm_fwd import nvfp4_matmul
    from qerl_kernels.tile_configs import fwd_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_args(ap, "qkv,o")
    ap.add_argument("--steps", default="2,3,4", help="K steps per program to try")
    args = ap.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}", flush=True)
    ratios = {m: [] for m in map(int, args.ms.split(","))}
    for (model, layer), (n, k) in SHAPES.items():
        if model not in args.models.split(",") or layer not in args.layers.split(","):
            continue
        d = ShapeData(n, k, seed=n + k)
        for m in ratios:
            tab = fwd_config(m, n, k)
            t_tab, _ = bench_fwd_point(d, m, tab)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = nvfp4_matmul(x, d.packed[0], d.scale[0], d.gs, twiddled=True, blocked=True).float()
            line, best = f"{model} {layer} M={m}: table {t_tab:.1f}", None
            bm = 8 if m <= 8 else 16
            for steps in map(int, args.steps.split(",")):
                split = triton.cdiv(k // 128, steps)
                for bn, warps in ((64, 4), (128, 8)):
                    y = run_shortk(x, d.packed[0], d.scale[0], d.gs, bm, bn, warps, split).float()
                    err = ((y - ref).norm() / ref.norm()).item()
                    us = time_graph([lambda p=p, s=s, x=x, g=d.gs, a=(bm, bn, warps, split): run_shortk(x, p, s, g, *a)
                                     for p, s in zip(d.packed, d.scale)])
                    line += f" | {steps} steps BN {bn}: {us:.1f} (err {err:.0e})"
                    if best is None or us < best:
                        best = us
            ratios[m].append(t_tab / best)
            print(line, flush=True)
        del d
        torch.cuda.empty_cache()
    for m, v in ratios.items():
        print(f"M={m}: table / best short-K geomean {geomean(v):.3f} "
              f"(min {min(v):.2f}, max {max(v):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
