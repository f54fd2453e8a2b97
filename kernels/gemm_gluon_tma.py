"""Mid-M forward GEMM in Gluon (M = 64-256 tokens): the activations come by TMA into a shared-memory
ring, the weights' codes straight into the registers whose wgmma A fragment they decode into
(``FwdConfig.gluon`` + ``FwdConfig.xtma`` tiles).

Trade-off: the small-M Gluon kernel (gemm_gluon.py) stages X through registers, permuting it into the
MMA's K order on the way; from M = 64 up, X is as many bytes per K step as the codes or more, and its
register staging (one step ahead, a full MMA wait per step) is what the tile waits on. Here X is
permuted once per call instead (``permute_x``, one read and one write of X: a few us at M <= 256)
and then streamed by TMA, ``STAGES`` steps ahead, while each thread loads its codes two steps ahead.
The decode and the MMA go in half steps (64 K elements: the even or odd scale groups of each lane,
see gemm_gluon's permutation), so with ``INFLIGHT`` one half step's MMA runs while the next one
decodes; the in-flight MMA's register operand is handed to the next wait as a dependency, which keeps
ptxas from reusing its registers under it (the small-M kernel's first attempt at this was wrong for
lack of exactly that). Two half steps in flight (three A fragments live) measured no faster on the
H100 and returned NaNs on some shapes: not kept.
Limits as gemm_gluon (bf16, sm_90, twiddled + blocked, K % 128 == 0, N % 16 == 0); any X row stride
(the permutation pass writes the contiguous copy TMA reads). Split-K reduces through ``gemm_fwd``'s last-arriver workspace.

Stream-K (``FwdConfig.sk``): ``sk`` programs per SM share every (tile, K step) pair in equal contiguous
ranges instead of a split-K grid; a tile cut between programs is summed from fp32 partials by the last
of them to arrive, in program order (deterministic, and no program ever waits for another). Measured
on an H100 (docs/benchmarks.md, kernels, eleventh pass): it wins the long-K ``down`` weights at
M = 32-128 (up to 10%) and the large weights at M = 1024, and loses on every small weight: there a
program's fixed cost, not the tile count, is what finer splits multiply. Halves (``FwdConfig.halves``,
gemm_gluon.halves_split) is the cheap form: only a wave's last tiles split in two, 2-3% on 7B gate_up at
M = 64-128 (fifteenth pass).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from qerl_kernels import pdl as pdl_module
from qerl_kernels.decode import perm_x
from qerl_kernels.gemm_fwd import COUNTER_SLOTS, arrival_counters
from qerl_kernels.gemm_gluon import (
    HAVE_GLUON,
    K_STEP,
    RopeEpilogue,
    launch_plan,
    num_sms,
    pair_mode,
    plan_halves,
)
from qerl_kernels.pdl import gdc_launch_dependents, launch_kwargs, pdl_enabled

HAVE_GLUON_TMA = False
if HAVE_GLUON:  # the TMA and mbarrier pieces of Gluon's experimental API: missing ones disable the path
    try:
        from qerl_kernels.gemm_gluon import (
            _codes_layout,
            _cta_barrier,
            _decode_groups,
            _group_offsets,
            _program_k_range,
            _store_program,
            _tile_coords,
            _write_y,
        )
        from qerl_kernels.pdl import griddep_wait
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (
            mbarrier,
            tma,
            warpgroup_mma,
            warpgroup_mma_wait,
        )
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

        # Triton 3.6 (the H100's) names the TMA load async_copy_global_to_shared; later ones async_load.
        _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
        HAVE_GLUON_TMA = True
    except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
        pass


@triton.jit
def _permute_x_kernel(X, XP, M, K, stride_xm, stride_pm, BR: tl.constexpr, RELEASE: tl.constexpr = False):
    """X [M, K] -> XP [M, K] with every 128-column step in the MMA's K order (decode.perm_x). RELEASE: the
    GEMM after it (launched with PDL) may start once every program of this one runs (pdl.py)."""
    if RELEASE:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)[None, :]
    x = tl.load(X + rows * stride_xm + cols, mask=rows < M, other=0.0)
    tl.store(XP + rows * stride_pm + cols, perm_x(x, BR, 16), mask=rows < M)


def permute_x(x: torch.Tensor, release: bool = False) -> torch.Tensor:
    """Activations [M, K] (K % 128 == 0) in the K order the Gluon kernels' decoded weights use.
    ``release``: the next kernel on the stream is launched with PDL and may start early (pdl.py)."""
    m, k = x.shape
    xp = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m:
        _permute_x_kernel[(triton.cdiv(m, 16), k // K_STEP)](x, xp, m, k, x.stride(0), xp.stride(0), BR=16,
                                                             RELEASE=release)
    return xp


def permuted_for_pdl(x: torch.Tensor, x_korder: bool) -> tuple[torch.Tensor, bool]:
    """(X in the MMA's K order, whether the GEMM reading it launches with PDL): ``x`` itself where it is
    already in K order (its producer is some other kernel: no PDL), else a ``permute_x`` copy that lets
    the GEMM start early where PDL runs and X has at least ``pdl.PDL_MIN_ROWS`` rows (pdl.py)."""
    if x_korder:
        return x, False
    pdl = x.shape[0] >= pdl_module.PDL_MIN_ROWS and pdl_enabled(x.device)
    return permute_x(x, release=pdl), pdl


def permute_x_reference(x: torch.Tensor) -> torch.Tensor:
    """``permute_x`` in torch: column 128 s + k of the result is X's column 128 s + (the physical
    element of logical MMA column k; gemm_gluon's module docstring)."""
    m, k = x.shape
    return x.reshape(m, k // 128, 4, 2, 2, 2, 2, 2).permute(0, 1, 3, 5, 6, 7, 2, 4).reshape(m, k)


if HAVE_GLUON_TMA:

    @gluon.jit
    def _decode_half(pw, s, BN: gl.constexpr, DOT: gl.constexpr):
        """int64 groups [BN, 4] (lane c's group 2 c + g_lo of one K step) + e4m3 scales -> the wgmma
        A fragment [BN, 64] of that half step (logical k = 16 (2 bb1 + bb0) + 8 h + 2 c + t)."""
        w = _decode_groups(pw, s)  # [BN, c, t, h, bb0, bb1]
        w = gl.permute(w, [0, 5, 4, 3, 1, 2])  # [BN, bb1, bb0, h, c, t]
        w = gl.reshape(w, [BN, 64])
        return gl.convert_layout(w, DOT, assert_trivial=True)

    @gluon.jit
    def _load_codes(PW, S, code_off, scale_off, step):
        return gl.load(PW + code_off + step * 128), gl.load(S + scale_off + step * 8)

    @gluon.jit
    def _halves(t, BN: gl.constexpr):
        """[BN, 8] groups of a step -> (even groups, odd groups), each [BN, 4]: a register split."""
        return gl.split(gl.reshape(t, [BN, 4, 2]))

    @gluon.jit
    def _issue_x(x_desc, xs, bars, stage, row, step, pred):
        bar = bars.index(stage)
        mbarrier.expect(bar, 2 * x_desc.block_type.nbytes, pred=pred)
        _tma_load(x_desc, [row, step * 128], bar, xs.index(2 * stage), pred=pred)
        _tma_load(x_desc, [row, step * 128 + 64], bar, xs.index(2 * stage + 1), pred=pred)

    @gluon.jit
    def _tile_mma(x_desc, PW, S, xs, bars, g0, pid_m, pid_n, s_lo, nsteps, N, KG, stride_sn,
                  BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, INFLIGHT: gl.constexpr,
                  ACC: gl.constexpr, DOT: gl.constexpr, CODES: gl.constexpr, PAIR: gl.constexpr = 0,
                  HD: gl.constexpr = 64, PDL: gl.constexpr = False):
        """acc [BN, BM] of one tile over its K steps s_lo .. s_lo + nsteps - 1. The X ring's steps are
        numbered from g0, so its stages and mbarrier phases carry on across the tiles of a program. PDL:
        the first two steps' codes load before the wait for the kernel that wrote X (pdl.py)."""
        code_off, scale_off = _group_offsets(pid_n, N, KG, stride_sn, BN, CODES, PAIR, HD)
        if PDL:
            pw, s = _load_codes(PW, S, code_off, scale_off, s_lo)
            pw1, s1 = _load_codes(PW, S, code_off, scale_off, s_lo + gl.minimum(1, nsteps - 1))
            griddep_wait()
        for j in gl.static_range(STAGES - 1):
            _issue_x(x_desc, xs, bars, (g0 + j) % STAGES, pid_m * BM, s_lo + j, j < nsteps)
        if not PDL:
            pw, s = _load_codes(PW, S, code_off, scale_off, s_lo)
            pw1, s1 = _load_codes(PW, S, code_off, scale_off, s_lo + gl.minimum(1, nsteps - 1))
        acc = gl.zeros([BN, BM], gl.float32, layout=ACC)
        a_odd = gl.zeros([BN, 64], gl.bfloat16, layout=DOT)  # the previous step's second half (in flight)
        for i in range(nsteps):
            # Codes two steps ahead go out first (clamped at the end: a harmless re-read).
            pw_n, s_n = _load_codes(PW, S, code_off, scale_off, s_lo + gl.minimum(i + 2, nsteps - 1))
            st = (g0 + i) % STAGES
            pw_e, pw_o = _halves(pw, BN)
            s_e, s_o = _halves(s, BN)
            a_even = _decode_half(pw_e, s_e, BN, DOT)
            mbarrier.wait(bars.index(st), ((g0 + i) // STAGES) & 1)
            tok = warpgroup_mma(a_even, xs.index(2 * st).permute((1, 0)), acc, is_async=True)
            if INFLIGHT:
                acc, a_odd = warpgroup_mma_wait(1, deps=[tok, a_odd])
            else:
                acc = warpgroup_mma_wait(0, deps=[tok])
            a_odd = _decode_half(pw_o, s_o, BN, DOT)
            tok = warpgroup_mma(a_odd, xs.index(2 * st + 1).permute((1, 0)), acc, is_async=True)
            if INFLIGHT:
                acc, a_even = warpgroup_mma_wait(1, deps=[tok, a_even])
            else:
                acc = warpgroup_mma_wait(0, deps=[tok])
            # Step i - 1's MMAs are complete in both warpgroups past this barrier: refill its stage.
            _cta_barrier()
            nxt = i + STAGES - 1
            _issue_x(x_desc, xs, bars, (g0 + nxt) % STAGES, pid_m * BM, s_lo + nxt, nxt < nsteps)
            pw, s = pw1, s1
            pw1, s1 = pw_n, s_n
        return warpgroup_mma_wait(0, deps=[acc])

    @gluon.jit
    def _alloc_ring(x_desc, BM: gl.constexpr, STAGES: gl.constexpr):
        xs = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, BM, 64], x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(STAGES):
            mbarrier.init(bars.index(b), count=1)
        return xs, bars

    @gluon.jit(do_not_specialize=["M"])
    def _nvfp4_fwd_gluon_tma_kernel(
        x_desc, PW, S, G, B, Y, WS, CNT,
        M, N, KG, steps_per_split, n_full,
        stride_sn, stride_ym,
        BM: gl.constexpr, BN: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, NW: gl.constexpr,
        STAGES: gl.constexpr, INFLIGHT: gl.constexpr, HALVES: gl.constexpr, PAIR: gl.constexpr = 0,
        P=None, CS=None, SLOT=None, KC=None, VC=None, NQ=0, NK=0, HD: gl.constexpr = 64, PDL: gl.constexpr = False,
    ):
        """PDL: launched as the dependent of the ``permute_x`` that wrote X (pdl.py)."""
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        CODES: gl.constexpr = _codes_layout(BN, NW)

        pid, pid_k, s_lo, nsteps = _program_k_range(n_full, steps_per_split, KG // 8, HALVES)
        grid_m = gl.cdiv(M, BM)
        pid_m = pid % grid_m  # the row tiles of one weight tile run together: its codes hit L2 again
        pid_n = pid // grid_m

        xs, bars = _alloc_ring(x_desc, BM, STAGES)
        acc = _tile_mma(x_desc, PW, S, xs, bars, 0, pid_m, pid_n, s_lo, nsteps, N, KG, stride_sn,
                        BM, BN, STAGES, INFLIGHT, ACC, DOT, CODES, PAIR, HD, PDL)
        for b in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(b))
        _store_program(acc, G, B, Y, WS, CNT, pid, pid_k, n_full, pid_m, pid_n, M, N, stride_ym, BM, BN, SPLIT,
                       HAS_BIAS, ACC, HALVES, PAIR, NW, (P, CS, SLOT, KC, VC, NQ, NK), HD)

    @gluon.jit
    def _first_unit(p, units, nprog):
        return p * units // nprog

    @gluon.jit
    def _owner(u, units, nprog):
        """The program whose unit range [_first_unit(p), _first_unit(p + 1)) holds unit u."""
        return ((u + 1) * nprog - 1) // units

    @gluon.jit
    def _partial_slot(q, t, ks, units, nprog):
        """Workspace slot of program q's partial of tile t: 2 q for its first tile, 2 q + 1 for its
        last (a program's middle tiles are whole, so it has at most these two partials)."""
        return 2 * q + (t != _first_unit(q, units, nprog) // ks).to(gl.int32)

    @gluon.jit
    def _store_streamk(acc, G, B, Y, WS, CNT, p, t, nsteps, ks, units, nprog, pid_m, pid_n, M, N, stride_ym,
                       BM: gl.constexpr, BN: gl.constexpr, HAS_BIAS: gl.constexpr, ACC: gl.constexpr):
        """Tile t's share of program p -> Y: directly when p ran all its K steps; otherwise as an fp32
        partial, the last of the tile's programs to arrive summing them in program order (so the sum is
        deterministic) and storing Y."""
        out = acc * (256.0 / gl.load(G))  # decode.FAST_EPILOGUE
        rn, n2, m2, omask = _tile_coords(pid_m, pid_n, M, N, BM, BN, ACC)
        if nsteps == ks:
            _write_y(out, B, Y, rn % N, n2, m2, omask, stride_ym, HAS_BIAS)
        else:
            loc = (gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(1, ACC)), 1) * BM
                   + gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(0, ACC)), 0))
            gl.store(WS + _partial_slot(p, t, ks, units, nprog) * (BN * BM) + loc, out)
            _cta_barrier()  # all partial stores precede the counter's release
            q_lo = _owner(t * ks, units, nprog)
            q_hi = _owner(t * ks + ks - 1, units, nprog)
            arrived = gl.atomic_add(CNT + t, 1, sem="acq_rel", scope="gpu")
            if arrived == q_hi - q_lo:
                total = gl.zeros([BN, BM], gl.float32, layout=ACC)
                for q in range(q_lo, q_hi + 1):
                    slot = _partial_slot(q, t, ks, units, nprog)
                    total += gl.load(WS + slot * (BN * BM) + loc, cache_modifier=".cg")
                _write_y(total, B, Y, rn % N, n2, m2, omask, stride_ym, HAS_BIAS)
                gl.atomic_xchg(CNT + t, 0)

    @gluon.jit(do_not_specialize=["M"])
    def _nvfp4_fwd_gluon_tma_sk_kernel(
        x_desc, PW, S, G, B, Y, WS, CNT,
        M, N, KG, units, nprog,
        stride_sn, stride_ym,
        BM: gl.constexpr, BN: gl.constexpr, HAS_BIAS: gl.constexpr, NW: gl.constexpr,
        STAGES: gl.constexpr, INFLIGHT: gl.constexpr,
    ):
        """Stream-K: ``nprog`` resident programs share the tiles' K steps (``units`` = tiles x K
        steps, tile-major, tile t = weight tile t // grid_m, row tile t % grid_m) in equal contiguous
        ranges; each walks the tiles its range touches."""
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        CODES: gl.constexpr = _codes_layout(BN, NW)

        p = gl.program_id(0)
        ks = KG // 8
        grid_m = gl.cdiv(M, BM)
        u0 = _first_unit(p, units, nprog)
        u1 = _first_unit(p + 1, units, nprog)
        xs, bars = _alloc_ring(x_desc, BM, STAGES)
        g = u0 * 0
        for t in range(u0 // ks, (u1 - 1) // ks + 1):
            lo = gl.maximum(u0, t * ks) - t * ks
            nsteps = gl.minimum(u1, t * ks + ks) - t * ks - lo
            pid_m = t % grid_m
            pid_n = t // grid_m
            _cta_barrier()  # every warp is done with the previous tile's stages before they refill
            acc = _tile_mma(x_desc, PW, S, xs, bars, g, pid_m, pid_n, lo, nsteps, N, KG, stride_sn,
                            BM, BN, STAGES, INFLIGHT, ACC, DOT, CODES)
            g += nsteps
            _store_streamk(acc, G, B, Y, WS, CNT, p, t, nsteps, ks, units, nprog, pid_m, pid_n, M, N, stride_ym,
                           BM, BN, HAS_BIAS, ACC)
        for b in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(b))


def x_layout(bm: int):
    """The shared layout of one [BM, 64] half step of X (128-byte swizzle: what TMA and wgmma share)."""
    return gl.NVMMASharedLayout.get_default_for([bm, 64], gl.bfloat16)


def launch_gluon_tma(x, groups, scale_u8, global_scale, bias, cfg, programs: int | None = None,
                     pair: bool = False, rope: RopeEpilogue | None = None, y_korder: bool = False,
                     x_korder: bool = False) -> torch.Tensor:
    """``x [M, K] @ W^T`` (+ bias) by the TMA-fed Gluon kernel; arguments as ``gemm_gluon.launch_gluon``;
    ``cfg`` needs bm, bn, split_k, warps, stages (X ring depth, >= 2) and inflight; with ``cfg.sk``
    (> 0) the stream-K kernel runs ``sk`` programs per SM instead of the split-K grid (``programs``
    overrides the count: tests). ``pair``, ``rope`` (the pairing epilogues, ``gemm_gluon.launch_gluon``)
    always run the split-K grid: the stream-K kernel does not pair. ``x_korder``: x's columns are already
    in the MMA's K order (``decode.k_order``; written so by the kernel that produced x), no ``permute_x``."""
    sk = getattr(cfg, "sk", 0)
    xp = x if x_korder else None
    if (sk or programs) and not pair and rope is None:
        y = _launch_streamk(x, groups, scale_u8, global_scale, bias, cfg, programs, xp)
        if y is not None:
            return y
    m, n, kg, y, grid_mn, split, per, ws, cnt = launch_plan(x, groups, cfg, pair)
    n_full, grid, ws, cnt = plan_halves(y, cfg, split, kg // 8, grid_mn, n, ws, cnt)
    xk, pdl = permuted_for_pdl(x, x_korder)
    x_desc = GluonDescriptor.from_tensor(xk, [cfg.bm, 64], x_layout(cfg.bm))
    _nvfp4_fwd_gluon_tma_kernel[grid](
        x_desc, groups, scale_u8, global_scale.reshape(1).to(torch.float32), bias if bias is not None else y,
        y, ws, cnt,
        m, n, kg, per, n_full or 0,
        scale_u8.stride(0), y.stride(0),
        BM=cfg.bm, BN=cfg.bn, SPLIT=split, HAS_BIAS=bias is not None, NW=cfg.warps,
        STAGES=max(2, cfg.stages), INFLIGHT=bool(cfg.inflight), HALVES=n_full is not None,
        PAIR=pair_mode(pair, rope, y_korder), PDL=pdl, num_warps=cfg.warps, **launch_kwargs(pdl),
        **(rope.kernel_args() if rope is not None else {}),
    )
    return y


def streamk_programs(units: int, sk: int, sms: int) -> int:
    """Stream-K programs for ``units`` (tile, K step) pairs at ``sk`` per SM: never more than units."""
    return max(1, min(sk * sms, units))


def _launch_streamk(x, groups, scale_u8, global_scale, bias, cfg, programs, xp=None):
    """The stream-K launch, or None where it cannot run (no arrival counters yet during a CUDA-graph
    capture, more tiles than counters, index overflow): the caller then runs the split-K grid."""
    m, k = x.shape
    n, kg = groups.shape[0], k // 16
    tiles = triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn)
    units = tiles * (kg // 8)
    sms = num_sms(x.device)
    nprog = min(programs, units) if programs else streamk_programs(units, cfg.sk, sms)
    cnt = arrival_counters(x.device)
    if cnt is None or tiles > COUNTER_SLOTS or units * (nprog + 1) >= 2**31:
        return None
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = torch.empty(2 * nprog * cfg.bm * cfg.bn, dtype=torch.float32, device=x.device)
    x_desc = GluonDescriptor.from_tensor(permute_x(x) if xp is None else xp, [cfg.bm, 64], x_layout(cfg.bm))
    _nvfp4_fwd_gluon_tma_sk_kernel[(nprog,)](
        x_desc, groups, scale_u8, global_scale.reshape(1).to(torch.float32), bias if bias is not None else y,
        y, ws, cnt,
        m, n, kg, units, nprog,
        scale_u8.stride(0), y.stride(0),
        BM=cfg.bm, BN=cfg.bn, HAS_BIAS=bias is not None, NW=cfg.warps,
        STAGES=max(2, cfg.stages), INFLIGHT=bool(cfg.inflight),
        num_warps=cfg.warps,
    )
    return y
