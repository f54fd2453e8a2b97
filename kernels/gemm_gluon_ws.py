"""Small-M forward GEMM in Gluon, warp-specialised: a producer warpgroup fills a ring of shared-memory
stages with the weight's codes and scales (TMA) and the activations (through its registers, permuted
into the MMA's K order); one consumer warpgroup decodes the codes into its wgmma register fragment and
multiplies (``FwdConfig.ws`` tiles).

Trade-off against gemm_gluon (the per-thread small-M kernel): there every thread loads its own codes
and X one K step ahead into registers, so its decode waits for a memory round trip each step and the
X registers cost programs per SM. Here the consumer's loop holds no loads at all: it waits on an
mbarrier, reads its codes back from shared memory (two conflict-free 16-byte loads per thread and
step) and releases the stage. The price is a second warpgroup per program and ``setmaxnreg`` splits
that ptxas honours unevenly (some spill or serialise the wgmmas), so the sweep picks the launch cap
(programs per SM), the producer's registers and the MMA mode per shape.

A ring stage holds two K steps (256 K elements) because TMA's smallest row is 16 bytes: the scales of
two steps, [BN, 16] bytes. So this kernel needs K % 256 == 0 (all Qwen2.5 shapes; the dispatch falls
back to gemm_gluon otherwise) and split-K splits of whole pairs. Limits otherwise as gemm_gluon
(bf16, sm_90, twiddled + blocked codes).

Measured (H100, 2026-11-22, docs/benchmarks.md, kernels, fourteenth pass): faster than every other
tile at 13 of the 24 points of M = 1-16 (7B gate_up 34.3 -> 33.0 us at M = 1, 3.15x of cuBLAS; 7B
down 25.4 -> 23.2 us at M = 16); two ring stages beat three or four; the consumer's decode, not the
memory, sets the pace (64 weight rows per consumer warpgroup beat 128).
"""

from __future__ import annotations

import torch
import triton
from qerl_kernels.gemm_fwd import COUNTER_SLOTS, arrival_counters, split_k_plan
from qerl_kernels.gemm_gluon import HAVE_GLUON
from qerl_kernels.gemm_gluon_tma import _num_sms, streamk_programs

HAVE_GLUON_WS = False
if HAVE_GLUON:
    try:
        from qerl_kernels.gemm_gluon import (
            _codes_layout,
            _decode_fragment,
            _permute_x,
            _store_tile,
            _x_layout,
        )
        from qerl_kernels.gemm_gluon_tma import _decode_half, _first_unit, _halves, _store_streamk
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (
            fence_async_shared,
            mbarrier,
            tma,
            warpgroup_mma,
            warpgroup_mma_wait,
        )
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

        _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
        HAVE_GLUON_WS = hasattr(gl, "warp_specialize")
    except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
        pass

STEP_PAIR = 256  # K elements per ring stage


if HAVE_GLUON_WS:

    @gluon.jit
    def _produce_tile(X, c_desc, s_desc, cs, ss, xs, ready, empty, M, pid_m, pid_n, p_lo, npairs, g, stride_xm,
                      BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, PW: gl.constexpr):
        """Fill the ring with pairs p_lo .. p_lo + npairs - 1 of one tile's K steps, the ring's pairs numbered
        from g (stages and mbarrier phases carry on across a program's tiles), each stage once the consumer
        has released it: codes and scales by TMA, X through this warpgroup's registers, permuted into the
        MMA's K order."""
        XL: gl.constexpr = _x_layout(BM, PW)
        rm_x = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, XL))
        xm = gl.expand_dims(rm_x, 1)
        xrow = X + xm * stride_xm + gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, XL)), 0)
        xok = xm < M
        for j in range(npairs):
            st = (g + j) % STAGES
            mbarrier.wait(empty.index(st), (((g + j) // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
            bar = ready.index(st)
            mbarrier.expect(bar, 2 * c_desc.block_type.nbytes + s_desc.block_type.nbytes)
            step = 2 * (p_lo + j)
            _tma_load(c_desc, [pid_n * (BN // 16), step * 128], bar, cs.index(2 * st))
            _tma_load(c_desc, [pid_n * (BN // 16), step * 128 + 128], bar, cs.index(2 * st + 1))
            _tma_load(s_desc, [pid_n * BN, step * 8], bar, ss.index(st))
            x0 = gl.load(xrow + step * 128, mask=xok, other=0.0)
            x1 = gl.load(xrow + step * 128 + 128, mask=xok, other=0.0)
            xs.index(2 * st).store(_permute_x(x0, BM))
            xs.index(2 * st + 1).store(_permute_x(x1, BM))
            fence_async_shared()  # the generic-proxy stores, before the wgmma's async-proxy reads
            mbarrier.arrive(bar)  # the stage's second arrival (the first is the TMA's expect)

    @gluon.jit
    def _consume_tile(cs, ss, xs, ready, empty, npairs, g,
                      BM: gl.constexpr, BN: gl.constexpr, NW: gl.constexpr, STAGES: gl.constexpr,
                      HALF: gl.constexpr):
        """acc [BN, BM] over npairs ring stages from pair g on, everything read from the ring. HALF 0: one
        MMA per K step; 1: two half-step MMAs (half the A fragment live); 2: half steps with one MMA left
        in flight while the next half decodes (its A operand handed to the next wait, so ptxas keeps its
        registers)."""
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        CODES: gl.constexpr = _codes_layout(BN, NW)
        FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        acc = gl.zeros([BN, BM], gl.float32, layout=ACC)
        a_o = gl.zeros([BN, 64], gl.bfloat16, layout=DOT)
        for j in range(npairs):
            st = (g + j) % STAGES
            mbarrier.wait(ready.index(st), ((g + j) // STAGES) & 1)
            sc = ss.index(st).load(CODES16(BN, NW))
            for h in gl.static_range(2):
                pw = cs.index(2 * st + h)._reinterpret(gl.int64, [BN, 8], FLAT).load(CODES)
                s = _half_scales(sc, h, BN, CODES)
                xb = xs.index(2 * st + h)
                if HALF == 0:
                    a = _decode_fragment(pw, s, BN, DOT)
                    acc = warpgroup_mma_wait(0, deps=[warpgroup_mma(a, xb.permute((1, 0)), acc, is_async=True)])
                else:
                    pw_e, pw_o = _halves(pw, BN)
                    s_e, s_o = _halves(s, BN)
                    a_e = _decode_half(pw_e, s_e, BN, DOT)
                    tok = warpgroup_mma(a_e, xb.slice(0, 64, dim=1).permute((1, 0)), acc, is_async=True)
                    if HALF == 2:
                        acc, a_o = warpgroup_mma_wait(1, deps=[tok, a_o])
                    else:
                        acc = warpgroup_mma_wait(0, deps=[tok])
                    a_o = _decode_half(pw_o, s_o, BN, DOT)
                    tok = warpgroup_mma(a_o, xb.slice(64, 64, dim=1).permute((1, 0)), acc, is_async=True)
                    if HALF == 2:
                        acc, a_e = warpgroup_mma_wait(1, deps=[tok, a_e])
                    else:
                        acc = warpgroup_mma_wait(0, deps=[tok])
            if HALF == 2:
                acc = warpgroup_mma_wait(0, deps=[acc])  # the stage's last MMA reads its X: done before release
            mbarrier.arrive(empty.index(st))
        return acc

    @gluon.jit
    def _producer(X, c_desc, s_desc, cs, ss, xs, ready, empty, M, pid_m, pid_n, p_lo, npairs, stride_xm,
                  BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
        _produce_tile(X, c_desc, s_desc, cs, ss, xs, ready, empty, M, pid_m, pid_n, p_lo, npairs, 0, stride_xm,
                      BM, BN, STAGES, 4)

    @gluon.jit
    def _consumer(cs, ss, xs, ready, empty, npairs,
                  BM: gl.constexpr, BN: gl.constexpr, NW: gl.constexpr, STAGES: gl.constexpr, HALF: gl.constexpr):
        acc = _consume_tile(cs, ss, xs, ready, empty, npairs, 0, BM, BN, NW, STAGES, HALF)
        return (acc,)  # warp_specialize flattens the default partition's results as a tuple

    @gluon.jit
    def _tile_range(t, u0, u1, kp):
        """Program range [u0, u1) of (tile, pair) units, tile t's share: (first pair, pair count)."""
        lo = gl.maximum(u0, t * kp) - t * kp
        return lo, gl.minimum(u1, t * kp + kp) - t * kp - lo

    @gluon.jit
    def _producer_sk(X, c_desc, s_desc, cs, ss, xs, ready, empty, M, u0, u1, kp, grid_m, stride_xm,
                     BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
        g = u0 * 0
        for t in range(u0 // kp, (u1 - 1) // kp + 1):
            lo, n = _tile_range(t, u0, u1, kp)
            _produce_tile(X, c_desc, s_desc, cs, ss, xs, ready, empty, M, t % grid_m, t // grid_m, lo, n, g,
                          stride_xm, BM, BN, STAGES, 4)
            g += n

    @gluon.jit
    def _consumer_sk(cs, ss, xs, ready, empty, G, B, Y, WS, CNT, p, M, N, u0, u1, kp, grid_m, units, nprog,
                     stride_ym, BM: gl.constexpr, BN: gl.constexpr, NW: gl.constexpr, STAGES: gl.constexpr,
                     HALF: gl.constexpr, HAS_BIAS: gl.constexpr):
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
        g = u0 * 0
        for t in range(u0 // kp, (u1 - 1) // kp + 1):
            lo, n = _tile_range(t, u0, u1, kp)
            acc = _consume_tile(cs, ss, xs, ready, empty, n, g, BM, BN, NW, STAGES, HALF)
            g += n
            _store_streamk(acc, G, B, Y, WS, CNT, p, t, n, kp, units, nprog, t % grid_m, t // grid_m, M, N,
                           stride_ym, BM, BN, HAS_BIAS, ACC)

    @gluon.constexpr_function
    def CODES16(BN, NW):
        """[BN, 16] scale bytes of a ring stage: _codes_layout with the stage's second step as one more
        register dimension (columns 8-15)."""
        base = _codes_layout(BN, NW)
        return gl.DistributedLinearLayout(base.reg_bases + [[0, 8]], base.lane_bases, base.warp_bases, [], [BN, 16])

    @gluon.jit
    def _half_scales(sc, h: gl.constexpr, BN: gl.constexpr, CODES: gl.constexpr):
        """Columns 8 h .. 8 h + 7 of a stage's [BN, 16] scales: a register selection."""
        lo, hi = gl.split(gl.permute(gl.reshape(sc, [BN, 2, 8]), [0, 2, 1]))
        if h == 0:
            r = lo
        else:
            r = hi
        return gl.convert_layout(r, CODES, assert_trivial=True)

    @gluon.jit
    def _alloc_ring(c_desc, s_desc, BM: gl.constexpr, STAGES: gl.constexpr):
        """The ring: per stage two K steps of codes, their scales, two X tiles and the ready/empty mbarriers
        (ready counts the TMA's expect-tx and the producer's X arrival)."""
        BN: gl.constexpr = s_desc.block_type.shape[0]
        cs = gl.allocate_shared_memory(gl.int64, [2 * STAGES, BN // 16, 128], c_desc.layout)
        ss = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, 16], s_desc.layout)
        xs = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, BM, 128],
                                       gl.NVMMASharedLayout.get_default_for([BM, 128], gl.bfloat16))
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(STAGES):
            mbarrier.init(ready.index(b), count=2)
            mbarrier.init(empty.index(b), count=1)
        return cs, ss, xs, ready, empty

    @gluon.jit
    def _free_ring(ready, empty, STAGES: gl.constexpr):
        for b in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(b))
            mbarrier.invalidate(empty.index(b))

    @gluon.jit(do_not_specialize=["M"])
    def _nvfp4_fwd_gluon_ws_sk_kernel(
        X, c_desc, s_desc, G, B, Y, WS, CNT,
        M, N, KG, units, nprog,
        stride_xm, stride_ym,
        BM: gl.constexpr, BN: gl.constexpr, HAS_BIAS: gl.constexpr, NW: gl.constexpr,
        STAGES: gl.constexpr, PREGS: gl.constexpr, HALF: gl.constexpr,
    ):
        """Stream-K: ``nprog`` resident programs share the (tile, K-step pair) units in equal contiguous
        ranges (tile t = weight tile t // grid_m, row tile t % grid_m), as gemm_gluon_tma's stream-K kernel,
        whose partial-tile reduction this reuses."""
        p = gl.program_id(0)
        kp = KG // 16
        grid_m = gl.cdiv(M, BM)
        u0 = _first_unit(p, units, nprog)
        u1 = _first_unit(p + 1, units, nprog)
        cs, ss, xs, ready, empty = _alloc_ring(c_desc, s_desc, BM, STAGES)
        gl.warp_specialize([
            (_consumer_sk, (cs, ss, xs, ready, empty, G, B, Y, WS, CNT, p, M, N, u0, u1, kp, grid_m, units, nprog,
                            stride_ym, BM, BN, NW, STAGES, HALF, HAS_BIAS)),
            (_producer_sk, (X, c_desc, s_desc, cs, ss, xs, ready, empty, M, u0, u1, kp, grid_m, stride_xm,
                            BM, BN, STAGES)),
        ], [4], [PREGS])
        _free_ring(ready, empty, STAGES)

    @gluon.jit(do_not_specialize=["M"])
    def _nvfp4_fwd_gluon_ws_kernel(
        X, c_desc, s_desc, G, B, Y, WS, CNT,
        M, N, KG, pairs_per_split,
        stride_xm, stride_ym,
        BM: gl.constexpr, BN: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, NW: gl.constexpr,
        STAGES: gl.constexpr, PREGS: gl.constexpr, HALF: gl.constexpr,
    ):
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
        pid = gl.program_id(0)
        pid_k = gl.program_id(1)
        grid_n = gl.cdiv(N, BN)
        pid_m = pid // grid_n
        pid_n = pid % grid_n
        p_lo = pid_k * pairs_per_split
        npairs = gl.minimum(p_lo + pairs_per_split, KG // 16) - p_lo

        cs, ss, xs, ready, empty = _alloc_ring(c_desc, s_desc, BM, STAGES)
        res = gl.warp_specialize([
            (_consumer, (cs, ss, xs, ready, empty, npairs, BM, BN, NW, STAGES, HALF)),
            (_producer, (X, c_desc, s_desc, cs, ss, xs, ready, empty, M, pid_m, pid_n, p_lo, npairs, stride_xm,
                         BM, BN, STAGES)),
        ], [4], [PREGS])
        acc = res[0]
        _free_ring(ready, empty, STAGES)
        _store_tile(acc, G, B, Y, WS, CNT, pid, pid_k, pid_m, pid_n, M, N, stride_ym, BM, BN, SPLIT, HAS_BIAS, ACC)


def code_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=64, rank=2)


def scale_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)


def ws_supported(x: torch.Tensor, groups: torch.Tensor, scale_u8: torch.Tensor, cfg) -> bool:
    """Whether this kernel can run the call: K % 256 == 0, whole 16-row bands, TMA alignment."""
    n, kg = groups.shape
    return (HAVE_GLUON_WS and kg % 16 == 0 and n % 16 == 0 and cfg.bn % 16 == 0 and scale_u8.stride(1) == 1
            and scale_u8.stride(0) % 16 == 0 and scale_u8.data_ptr() % 16 == 0 and groups.data_ptr() % 16 == 0
            and groups.is_contiguous())


def launch_gluon_ws(x, groups, scale_u8, global_scale, bias, cfg, programs: int | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T`` (+ bias) by the warp-specialised kernel: ``groups`` int64 [N, K / 16] twiddled,
    blocked codes, ``scale_u8`` [N, K / 16] e4m3 bytes; ``cfg`` needs bm, bn, split_k, warps, stages, and
    may give maxnreg, pregs, half and sk (stream-K with that many programs per SM instead of split-K;
    ``programs`` overrides the stream-K program count: tests)."""
    m, k = x.shape
    n, kg = groups.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid_mn = triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn)
    c_desc = GluonDescriptor.from_tensor(groups.view(n // 16, kg * 16), [cfg.bn // 16, 128], code_layout())
    s_desc = GluonDescriptor.from_tensor(scale_u8, [cfg.bn, 16], scale_layout())
    regs = dict(num_warps=cfg.warps, maxnreg=getattr(cfg, "maxnreg", None))
    consts = dict(BM=cfg.bm, BN=cfg.bn, HAS_BIAS=bias is not None, NW=cfg.warps, STAGES=cfg.stages,
                  PREGS=getattr(cfg, "pregs", 40), HALF=getattr(cfg, "half", 0))
    sk = getattr(cfg, "sk", 0)
    units = grid_mn * (kg // 16)
    cnt = arrival_counters(x.device) if sk or programs else None
    nprog = min(programs, units) if programs else streamk_programs(units, sk, _num_sms(x.device))
    if cnt is not None and grid_mn <= COUNTER_SLOTS and units * (nprog + 1) < 2**31:
        ws = torch.empty(2 * nprog * cfg.bm * cfg.bn, dtype=torch.float32, device=x.device)
        _nvfp4_fwd_gluon_ws_sk_kernel[(nprog,)](
            x, c_desc, s_desc, global_scale.reshape(1).to(torch.float32), bias if bias is not None else y,
            y, ws, cnt, m, n, kg, units, nprog, x.stride(0), y.stride(0), **consts, **regs)
        return y
    # Split-K grid (also where stream-K cannot run: no counters yet during a capture, too many tiles).
    split, per, ws, cnt = split_k_plan(y, cfg.split_k, kg // 16, grid_mn)
    _nvfp4_fwd_gluon_ws_kernel[(grid_mn, split)](
        x, c_desc, s_desc, global_scale.reshape(1).to(torch.float32), bias if bias is not None else y,
        y, ws, cnt, m, n, kg, per, x.stride(0), y.stride(0), SPLIT=split, **consts, **regs)
    return y
