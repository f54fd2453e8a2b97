"""Small-M forward GEMM in Gluon with the activations resident in shared memory: each program keeps
its K slice of X and walks several weight tiles (``FwdConfig.gluon`` + ``FwdConfig.persist`` tiles,
M <= BM <= 16: decode batches).

Trade-off: the small-M Gluon kernel (gemm_gluon.py) reloads X for every weight tile it computes. At
M = 16 with 64 weight rows per tile that is as many bytes per K step as the codes (from L2, not HBM,
but through the same load path), and each step then waits at a CTA barrier until every warp has
stored its share of X. Here a program owns ``persist``-per-SM's share of the weight tiles (tile
``p``, ``p + P``, ... for program ``p`` of ``P``): its first tile brings X in (loaded, permuted into
the MMA's K order in registers and stored, one step ahead, as before) and keeps every step of its
K slice in shared memory, so the later tiles stream only codes and scales, decode and MMA, with no
barrier. The cost is shared memory: ``steps x BM x 256`` bytes (K = 3584 at BM = 16: 112 KB), so a
long K needs split-K (``resident_fits``) and at most one or two programs fit on an SM. Codes are
loaded two steps ahead across tile boundaries (the walk over tiles and steps is one flat loop), and
the decode and MMA run in half steps with one MMA in flight, as in gemm_gluon_tma.py.
Limits as gemm_gluon (bf16, sm_90, twiddled + blocked, K % 128 == 0, N % 16 == 0) and M <= BM.
Split-K reduces through ``gemm_fwd``'s last-arriver workspace, one counter per weight tile.
"""

from __future__ import annotations

import functools

import torch
from qerl_kernels.gemm_gluon import HAVE_GLUON, K_STEP, launch_plan

SMEM_BUDGET = 220 * 1024  # of sm_90's 227 KB per block: leaves room for the compiler's own scratch

if HAVE_GLUON:
    from qerl_kernels.gemm_gluon import (
        _codes_layout,
        _cta_barrier,
        _decode_half,
        _halves,
        _store_tile,
    )
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    @gluon.jit
    def _x_half_offsets(BM: gl.constexpr, NW: gl.constexpr):
        """Row and column offsets of the two [BM, 64] halves of a K step in the MMA's K order: logical
        column 64 g_lo + 32 bb1 + 16 bb0 + 8 h + 2 c + t is X's column 16 (2 c + g_lo) + 8 t + 4 bb1 +
        2 bb0 + h (gemm_gluon's permutation, read by a gather: only the first tile loads X)."""
        XH: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [NW, 1], [1, 0])
        k = gl.arange(0, 64, layout=gl.SliceLayout(0, XH))
        bb1 = k // 32
        bb0 = (k // 16) % 2
        h = (k // 8) % 2
        c = (k // 2) % 4
        t = k % 2
        col = gl.expand_dims(32 * c + 8 * t + 4 * bb1 + 2 * bb0 + h, 0)
        row = gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(1, XH)), 1)
        return row, col

    @gluon.jit
    def _tile_codes(PW, S, code_off, scale_off, rows, j, nsteps, s_lo, p, P, N, KG, stride_sn, BN: gl.constexpr):
        """Codes and scales of flat step ``j`` (tile ``j // nsteps`` of this program, its step
        ``j % nsteps``); rows past N load zeros (dropped at the store)."""
        n0 = (p + (j // nsteps) * P) * BN
        step = s_lo + j % nsteps
        ok = rows < N - n0
        pw = gl.load(PW + code_off + n0 * KG + step * 128, mask=ok, other=0)
        s = gl.load(S + scale_off + n0 * stride_sn + step * 8, mask=ok, other=0)
        return pw, s

    @gluon.jit(do_not_specialize=["M"])
    def _nvfp4_fwd_gluon_resident_kernel(
        X, PW, S, G, B, Y, WS, CNT,
        M, N, KG, tiles,
        stride_xm, stride_sn, stride_ym,
        BM: gl.constexpr, BN: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, NW: gl.constexpr,
        STEPS: gl.constexpr,
    ):
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        CODES: gl.constexpr = _codes_layout(BN, NW)
        XS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, 64], gl.bfloat16)

        p = gl.program_id(0)
        P = gl.num_programs(0)
        pid_k = gl.program_id(1)
        s_lo = pid_k * STEPS
        nsteps = gl.minimum(s_lo + STEPS, KG // 8) - s_lo
        total = gl.cdiv(tiles - p, P) * nsteps

        # Offsets within a tile (row band 0); _tile_codes adds the tile's row offset.
        rn = gl.arange(0, BN, layout=gl.SliceLayout(1, CODES))
        rg = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, CODES)), 0)
        rows = gl.expand_dims(rn, 1) + rg * 0
        code_off = (rows // 16) * KG * 16 + (rows % 16) * 8 + rg
        scale_off = rows * stride_sn + rg

        xm, xc = _x_half_offsets(BM, NW)
        x_ptr = X + xm * stride_xm + s_lo * 128 + xc  # the even half; the odd one is 16 columns on
        xrow_ok = (xm < M) & (xc >= 0)
        xs = gl.allocate_shared_memory(gl.bfloat16, [2 * STEPS, BM, 64], XS)

        x_e = gl.load(x_ptr, mask=xrow_ok, other=0.0)
        x_o = gl.load(x_ptr + 16, mask=xrow_ok, other=0.0)
        pw, s = _tile_codes(PW, S, code_off, scale_off, rows, 0, nsteps, s_lo, p, P, N, KG, stride_sn, BN)
        pw1, s1 = _tile_codes(PW, S, code_off, scale_off, rows, gl.minimum(1, total - 1), nsteps, s_lo, p, P,
                              N, KG, stride_sn, BN)
        acc = gl.zeros([BN, BM], gl.float32, layout=ACC)
        a_odd = gl.zeros([BN, 64], gl.bfloat16, layout=DOT)  # the previous half step's operand (in flight)
        for j in range(total):
            # Codes two steps ahead go out first (clamped at the end: a harmless re-read).
            pw_n, s_n = _tile_codes(PW, S, code_off, scale_off, rows, gl.minimum(j + 2, total - 1), nsteps, s_lo,
                                    p, P, N, KG, stride_sn, BN)
            i = j % nsteps
            if j < nsteps:
                # First tile: X step i goes to its resident slot (next step's load in flight meanwhile).
                nxt = gl.minimum(j + 1, nsteps - 1) * 128
                x_en = gl.load(x_ptr + nxt, mask=xrow_ok, other=0.0)
                x_on = gl.load(x_ptr + nxt + 16, mask=xrow_ok, other=0.0)
                xs.index(2 * i).store(x_e)
                xs.index(2 * i + 1).store(x_o)
                fence_async_shared()
                _cta_barrier()  # every warp's X rows are in shared memory before the wgmma reads them
                x_e, x_o = x_en, x_on
            pw_e, pw_o = _halves(pw, BN)
            s_e, s_o = _halves(s, BN)
            a_even = _decode_half(pw_e, s_e, BN, DOT)
            tok = warpgroup_mma(a_even, xs.index(2 * i).permute((1, 0)), acc, is_async=True)
            acc, a_odd = warpgroup_mma_wait(1, deps=[tok, a_odd])
            a_odd = _decode_half(pw_o, s_o, BN, DOT)
            tok = warpgroup_mma(a_odd, xs.index(2 * i + 1).permute((1, 0)), acc, is_async=True)
            acc, a_even = warpgroup_mma_wait(1, deps=[tok, a_even])
            if i == nsteps - 1:
                acc = warpgroup_mma_wait(0, deps=[acc])
                tile = p + (j // nsteps) * P
                _store_tile(acc, G, B, Y, WS, CNT, tile, pid_k, 0, tile, M, N, stride_ym, BM, BN, SPLIT, HAS_BIAS, ACC)
                acc = gl.zeros([BN, BM], gl.float32, layout=ACC)
            pw, s = pw1, s1
            pw1, s1 = pw_n, s_n


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def resident_smem(steps: int, bm: int) -> int:
    """Shared memory of the resident X slice: ``steps`` K steps of [BM, 128] bf16."""
    return steps * bm * K_STEP * 2


def resident_fits(m: int, steps_per_split: int, cfg) -> bool:
    """Whether a resident tile can run this call: every row in one tile, the X slice in shared memory."""
    return m <= cfg.bm and resident_smem(steps_per_split, cfg.bm) <= SMEM_BUDGET


def launch_gluon_resident(x, groups, scale_u8, global_scale, bias, cfg, max_programs: int | None = None):
    """``x [M, K] @ W^T`` (+ bias) by the resident-X kernel, arguments as ``gemm_gluon.launch_gluon``;
    ``cfg`` needs bm (>= M), bn, split_k, warps and persist (programs per SM); ``max_programs`` caps
    the programs per K split (tests: several tiles per program on a small weight). None where the X
    slice does not fit in shared memory (the caller runs another kernel)."""
    m, n, kg, y, tiles, split, per, ws, cnt = launch_plan(x, groups, cfg)
    if not resident_fits(m, per, cfg):
        return None
    programs = min(tiles, max(1, _num_sms(x.device.index or 0) * cfg.persist // split), max_programs or tiles)
    _nvfp4_fwd_gluon_resident_kernel[(programs, split)](
        x, groups, scale_u8, global_scale.reshape(1).to(torch.float32), bias if bias is not None else y,
        y, ws, cnt,
        m, n, kg, tiles,
        x.stride(0), scale_u8.stride(0), y.stride(0),
        BM=cfg.bm, BN=cfg.bn, SPLIT=split, HAS_BIAS=bias is not None, NW=cfg.warps, STEPS=per,
        num_warps=cfg.warps,
    )
    return y
