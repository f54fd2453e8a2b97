"""Is the small-M Gluon kernel at M = 16 held back by its activation (X) traffic? A probe.

At M = 1-4 the Gluon tile (BM 8) runs the large weights near their M = 1 time; at M = 16 (BM 16)
the same tile is 10-35% slower (docs/benchmarks.md, eighth pass). Per K step a BN 64 program reads
16 x 128 bf16 of X (4 KB, from L2 or L1) beside 4.5 KB of codes and scales from HBM. This probe runs
a copy of the production kernel whose X path can be cut down (results are then wrong; only the
time matters), every shape at each M of ``--ms``, tile = the table's M = 4 tile (widened to BM 16 past M = 8):

- ``normal``: the production K loop (its time should match the production kernel);
- ``row0``: only row 0 of X is loaded (the other rows masked: the M = 1 traffic at the BM 16 MMA);
- ``fixed``: every step loads the K step of the split's first step (same addresses: L1 hits);
- ``once``: X loaded for the first step only, the registers re-stored each step (no X loads);
- ``reorder``: correct; each step decodes and stores its registers before loading the next step's;
- ``cpasync``: correct; X copied by cp.async (no registers) two steps ahead into a natural-order
  ring, each thread permuting its own bytes from there into the MMA's tile.

    python benchmarks/probe_xtraffic.py --ms 16 --modes normal,row0,fixed,once
    python benchmarks/probe_xtraffic.py --ms 16,1 --modes normal,once,cpasync
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import SHAPES, ShapeData, bench_fwd_point, geomean, time_graph  # noqa: E402
from qerl_kernels import gemm_gluon as gg  # noqa: E402

if gg.HAVE_GLUON:
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    gluon, gl = gg.gluon, gg.gl

    @gluon.jit(do_not_specialize=["M"])
    def _probe_kernel(
        X, PW, S, G, B, Y, WS, CNT,
        M, N, KG, steps_per_split,
        stride_xm, stride_sn, stride_ym,
        BM: gl.constexpr, BN: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, NW: gl.constexpr,
        XMODE: gl.constexpr,
    ):
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        CODES: gl.constexpr = gg._codes_layout(BN, NW)
        XL: gl.constexpr = gg._x_layout(BM, NW)
        XS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, 128], gl.bfloat16)
        pid, pid_k, pid_m, pid_n, xm, xk, xrow_ok, code_off, scale_off, s_lo, nsteps = gg._program_tile(
            M, N, KG, steps_per_split, stride_sn, BM, BN, CODES, XL)
        if XMODE == 1:
            xrow_ok = xm < 1
        xs = gl.allocate_shared_memory(gl.bfloat16, [2, BM, 128], XS)
        acc = gl.zeros([BN, BM], gl.float32, layout=ACC)
        pw, s, x = gg._load_step(X, PW, S, code_off, scale_off, xm, xk, xrow_ok, s_lo, stride_xm)
        if XMODE == 6:  # X by cp.async into a 3-deep natural-order ring, two steps ahead; no X registers in flight
            XR: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=1, order=[1, 0])
            xr = gl.allocate_shared_memory(gl.bfloat16, [3, BM, 128], XR)
            for j in gl.static_range(2):
                async_copy.async_copy_global_to_shared(
                    xr.index(j), X + xm * stride_xm + (s_lo + gl.minimum(j, nsteps - 1)) * 128 + xk, mask=xrow_ok)
                async_copy.commit_group()
        for i in range(nsteps):
            if XMODE == 6:
                async_copy.async_copy_global_to_shared(
                    xr.index((i + 2) % 3), X + xm * stride_xm + (s_lo + gl.minimum(i + 2, nsteps - 1)) * 128 + xk,
                    mask=xrow_ok)
                async_copy.commit_group()
                pw_n = gl.load(PW + code_off + (s_lo + gl.minimum(i + 1, nsteps - 1)) * 128)
                s_n = gl.load(S + scale_off + (s_lo + gl.minimum(i + 1, nsteps - 1)) * 8)
                async_copy.wait_group(2)  # this thread's copy of step i has landed (it reads only its own bytes)
                buf = xs.index(i % 2)
                buf.store(gg._permute_x(xr.index(i % 3).load(XL), BM))
                gg.fence_async_shared()
                gg._cta_barrier()
                a = gg._decode_fragment(pw, s, BN, DOT)
                acc = gg.warpgroup_mma_wait(0, deps=[gg.warpgroup_mma(a, buf.permute((1, 0)), acc, is_async=True)])
                pw, s = pw_n, s_n
            elif XMODE == 4:  # consume this step's registers first, then load the next step into them
                buf = xs.index(i % 2)
                buf.store(gg._permute_x(x, BM))
                a = gg._decode_fragment(pw, s, BN, DOT)
                pw, s, x = gg._load_step(X, PW, S, code_off, scale_off, xm, xk, xrow_ok,
                                         s_lo + gl.minimum(i + 1, nsteps - 1), stride_xm)
                gg.fence_async_shared()
                gg._cta_barrier()
                acc = gg.warpgroup_mma_wait(0, deps=[gg.warpgroup_mma(a, buf.permute((1, 0)), acc, is_async=True)])
            else:
                acc, pw, s, x = _step_old(X, PW, S, code_off, scale_off, xm, xk, xrow_ok, xs, acc, pw, s, x, i, s_lo,
                                          nsteps, stride_xm, BM, BN, DOT, XMODE)
        gg._store_tile(acc, G, B, Y, WS, CNT, pid, pid_k, pid_m, pid_n, M, N, stride_ym, BM, BN, SPLIT, HAS_BIAS, ACC)

    @gluon.jit
    def _step_old(X, PW, S, code_off, scale_off, xm, xk, xrow_ok, xs, acc, pw, s, x, i, s_lo, nsteps, stride_xm,
                  BM: gl.constexpr, BN: gl.constexpr, DOT: gl.constexpr, XMODE: gl.constexpr):
        nxt = s_lo + gl.minimum(i + 1, nsteps - 1)
        pw_n = gl.load(PW + code_off + nxt * 128)
        s_n = gl.load(S + scale_off + nxt * 8)
        if XMODE == 2:
            x_n = gl.load(X + xm * stride_xm + s_lo * 128 + xk, mask=xrow_ok, other=0.0)
        elif XMODE == 3:
            x_n = x
        else:
            x_n = gl.load(X + xm * stride_xm + nxt * 128 + xk, mask=xrow_ok, other=0.0)
        buf = xs.index(i % 2)
        buf.store(gg._permute_x(x, BM))
        gg.fence_async_shared()
        gg._cta_barrier()
        a = gg._decode_fragment(pw, s, BN, DOT)
        acc = gg.warpgroup_mma_wait(0, deps=[gg.warpgroup_mma(a, buf.permute((1, 0)), acc, is_async=True)])
        return acc, pw_n, s_n, x_n


MODES = {"normal": 0, "row0": 1, "fixed": 2, "once": 3, "reorder": 4, "cpasync": 6}


def run_probe(x, packed, scale, gs, cfg, mode: int):
    from qerl_kernels.gemm_fwd import as_words

    groups, scale_u8 = as_words(packed).view(torch.int64), scale.view(torch.uint8)
    m, n, kg, y, grid_mn, split, per, ws, cnt = gg.launch_plan(x, groups, cfg)
    _probe_kernel[(grid_mn, split)](
        x, groups, scale_u8, gs.reshape(1).to(torch.float32), y, y, ws, cnt,
        m, n, kg, per, x.stride(0), scale_u8.stride(0), y.stride(0),
        BM=cfg.bm, BN=cfg.bn, SPLIT=split, HAS_BIAS=False, NW=cfg.warps, XMODE=mode, num_warps=cfg.warps)
    return y


def main(argv=None) -> int:
    from qerl_kernels.tile_configs import FwdConfig, fwd_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="16")
    ap.add_argument("--models", default="7B,32B")
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}", flush=True)
    modes = {k: MODES[k] for k in args.modes.split(",")}
    ratios = {(m, k): [] for m in map(int, args.ms.split(",")) for k in modes}
    for (model, layer), (n, k) in SHAPES.items():
        if model not in args.models.split(","):
            continue
        d = ShapeData(n, k, seed=n + k)
        t4 = fwd_config(4, n, k)
        for m in map(int, args.ms.split(",")):
            tile = FwdConfig(8 if m <= 8 else 16, t4.bn, 16, split_k=t4.split_k, warps=t4.warps, swap=True, gluon=True)
            t_table, _ = bench_fwd_point(d, m, fwd_config(m, n, k))
            t_prod, err = bench_fwd_point(d, m, tile)
            line = (f"{model} {layer} M={m} (BM {tile.bm}, BN {tile.bn} x {tile.warps}w, split {tile.split_k}): "
                    f"table {t_table:.1f} | gluon {t_prod:.1f} (err {err:.0e})")
            line += probe_modes(d, m, tile, t_prod, modes, ratios)
            print(line, flush=True)
        del d
        torch.cuda.empty_cache()
    for (m, name), v in ratios.items():
        print(f"M={m} {name}: production / probe geomean {geomean(v):.3f} "
              f"(min {min(v):.2f}, max {max(v):.2f})")
    return 0


def probe_modes(d, m, tile, t_prod, modes, ratios) -> str:
    from qerl_kernels.gemm_fwd import nvfp4_matmul

    x = torch.randn(m, d.k, device="cuda", dtype=torch.bfloat16)
    line = ""
    for name, mode in modes.items():
        if mode in (0, 4, 6):
            ok = torch.equal(run_probe(x, d.packed[0], d.scale[0], d.gs, tile, mode),
                             nvfp4_matmul(x, d.packed[0], d.scale[0], d.gs, config=tile, twiddled=True, blocked=True))
        us = time_graph([lambda p=p, s=s, g=d.gs, t=tile, x=x, mode=mode: run_probe(x, p, s, g, t, mode)
                         for p, s in zip(d.packed, d.scale)])
        ratios[(m, name)].append(t_prod / us)
        line += f" | {name} {us:.1f}" + (f" (same as production: {ok})" if mode in (0, 4, 6) else "")
    return line


if __name__ == "__main__":
    sys.exit(main())
