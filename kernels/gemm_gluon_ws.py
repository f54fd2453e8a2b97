"""Forward GEMM for M <= 1024 in Gluon, warp-specialised: a producer warpgroup fills a ring of shared-memory
stages with the weight's codes and scales (TMA) and the activations (through its registers, permuted
into the MMA's K order); one consumer warpgroup per 64 weight rows (BN 64, or two sharing the producer
at BN 128) decodes the codes into its wgmma register fragment and multiplies (``FwdConfig.ws`` tiles).

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
memory, sets the pace (64 weight rows per consumer warpgroup beat 128). Fifteenth pass: two consumers per
producer won 32B gate_up at M = 1-4 and 7B gate_up at M = 32; a split-K 1 launch whose tiles would
leave some SMs one more than others runs its last tiles as two K halves (``FwdConfig.halves``,
gemm_gluon.halves_split): 7B gate_up at M = 16 36.2 -> 34.9 us.

With ``cfg.xtma`` the producer takes X by TMA too (four [BM, 64] boxes per stage) from activations
already in the MMA's K order, written so by the kernel that produced them (the engine's norm, SwiGLU,
attention: ``decode.k_order``), or from a ``permute_x`` copy of natural X, and holds no X registers.
At M <= 16 the copy costs more than it saves, so there the form only runs from K-order input (7B down
at M = 16, 21.3 against 22.6 us: ``tile_configs.KORDER_FWD``, sixteenth pass). From M = 17 it is what
lets the kernel hold 32-128 activation rows at all (X through the producer's registers spilled at BM
64), and it runs most of the table at M = 32-128 even with the copy (seventeenth pass: M = 64 1.23x ->
1.53x of cuBLAS, geomean; ``tile_configs._gluon_ws_xtma_candidates``).

With ``cfg.duo`` (BN 128) the two consumer warpgroups are two partitions instead of one of 8 warps. In one
partition every stage release is a barrier of both (Gluon's ``mbarrier.arrive`` is one thread's arrival
after a ``bar.sync`` of its partition), so they decode in lock step and the tensor cores idle while both
do; Nsight Compute put 23% of the TMA-fed tile's stalls on such a barrier. Apart, each releases the stage
with its own arrival (``empty`` counts two) and stores its own 64 rows, so one decodes while the other's
MMAs run. Same MMAs in the same order per row: the same bits. H100 (docs/benchmarks.md, kernels, nineteenth
pass): 2-13% faster than the same tile in one partition at M = 128-1024, 7B down at M = 256 79.2 ->
75.5 us. SwiGLU pairs whole duo tiles: the two consumers hold a tile's 64 gate and 64 up rows, exchange
them (bf16, where the epilogue rounds them anyway) through shared memory and each writes 32 outputs; a
rotary, split-K or halved pairing launch runs the tile in one partition (``duo_runs``).

With ``cfg.xstages`` (X by TMA, half steps in flight) X has a ring of its own, one [BM, 64] half step per
stage, released as soon as the MMA that read it has completed, and a codes stage is released once its
codes are in registers. That is what lets BM 256 tiles (128 KB of X per 256-K stage) keep a deep X ring,
and at BM 128 it keeps MMAs in flight across codes stages. The loop still drains the MMAs once per codes
stage: left in flight over the loop's back edge, ptxas serialises every wgmma of the loop (its C7515
warning, from ptxas -v on the sm_90a PTX). H100 (docs/benchmarks.md, kernels, twentieth pass): 32B
gate/up as the engine launches it (SwiGLU, K-order X) at M = 128 145.4 -> 137.8 us, at M = 1024 939 -> 908 us.

With ``cfg.persist`` (duo tiles with an X ring, split-K 1) the launch runs that many programs per SM and each
walks tiles pid, pid + programs, ...: the rings' stages and phases carry over, so the producer fills the next
tile's first stages while the consumers finish the last tile and store it, where one program per tile starts
each tile with an empty ring. Same MMAs per tile: the same bits. H100 (docs/benchmarks.md, kernels,
twenty-first pass): gate/up with SwiGLU 2.9-3.7% faster at M = 128 and 1024, 7B gate/up 5.2% at M = 256; elsewhere within 2%.

With ``cfg.tstore`` a persistent plain tile's consumers do not store their rows themselves (one 2-byte store
per accumulator element, the swapped accumulator's values lying along Y's rows): each writes its rows,
transposed, into a [BM, 64] shared buffer and hands them to one TMA store it does not wait for until it
reuses the buffer a tile later, so the next tile's MMAs start at once. Same arithmetic: the same bits. H100 /
H200 (docs/benchmarks.md, kernels, twenty-second pass): 1-12% on every plain point at M = 128-1024, most
where K is short. Pairing launches (SwiGLU, rotary) store as before.

With ``cfg.tail`` too, a launch whose tiles leave a partial last wave (R = tiles mod programs) runs the whole
waves as before, then splits each of the R tail tiles into programs // R K-parts, part k of every tail tile
the same pairs (so programs sharing an X block or a weight tile walk K in step, as L2 needs: a stream-K split
into arbitrary ranges, tried first, was up to 1.6x slower for losing that). Parts go through an fp32
workspace and the last program to arrive sums them in program order: deterministic, but the tail tiles'
rows round differently from one program's sum. H100 (twenty-second pass): gate/up at M = 128 10% faster,
32B gate/up at M = 1024 8%.

Over natural X of more than 128 rows, the launch after its ``permute_x`` uses programmatic dependent launch
(kernels/pdl.py): each program's producer loads its first ring stages of codes and scales, then waits for
the copy, so the launch and those loads overlap it: about 0.7% at M = 256-1024 (twenty-third pass).
"""

from __future__ import annotations

import torch
import triton
from qerl_kernels.gemm_fwd import COUNTER_SLOTS, arrival_counters, split_k_plan
from qerl_kernels.gemm_gluon import HAVE_GLUON, RopeEpilogue, num_sms, pair_mode, plan_halves

HAVE_GLUON_WS = False
if HAVE_GLUON:
    try:
        from qerl_kernels.gemm_gluon import (
            _codes_layout,
            _cta_barrier,
            _decode_fragment,
            _halves_program,
            _pair_base,
            _pair_distance,
            _permute_x,
            _store_program,
            _write_swiglu_rows,
            _x_layout,
        )
        from qerl_kernels.gemm_gluon_tma import (
            _decode_half,
            _halves,
            permuted_for_pdl,
            x_layout,
        )
        from qerl_kernels.pdl import griddep_wait, launch_kwargs
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
        _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
        HAVE_GLUON_WS = hasattr(gl, "warp_specialize")
    except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
        pass

STEP_PAIR = 256  # K elements per ring stage


if HAVE_GLUON_WS:
    # Triton 3.6 (the H100's) names a shared buffer's reinterpretation _reinterpret; later ones reinterpret.
    _PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

    @gluon.jit
    def _as_groups(buf, BN: gl.constexpr, FLAT: gl.constexpr):
        """A stage's [BN / 16, 128] int64 code box (16 rows x 8 groups per 1 KB) as [BN, 8] groups."""
        if _PUBLIC_REINTERPRET:
            r = buf.reinterpret(gl.int64, [BN, 8], FLAT)
        else:
            r = buf._reinterpret(gl.int64, [BN, 8], FLAT)
        return r

    @gluon.jit
    def _load_weights(c_desc, s_desc, cs, ss, st, bar, band0, n0, step, pd, BN: gl.constexpr,
                      PAIR: gl.constexpr):
        """Stage st's codes (K steps ``step`` and + 1) and scales by TMA. A pairing tile (PAIR,
        gemm_gluon._tile_rows): its first BN / 2 rows from row n0 on, the rest ``pd`` rows further (up
        below gate, a head's second half below its first), into the two halves of each buffer (the
        descriptors' boxes are then half the tile's rows)."""
        if PAIR:
            mbarrier.expect(bar, 4 * c_desc.block_type.nbytes + 2 * s_desc.block_type.nbytes)
            for h in gl.static_range(2):
                for t in gl.static_range(2):
                    _tma_load(c_desc, [band0 + t * (pd // 16), (step + h) * 128], bar,
                              cs.index(2 * st + h).slice(t * (BN // 32), BN // 32))
                _tma_load(s_desc, [n0 + h * pd, step * 8], bar, ss.index(st).slice(h * (BN // 2), BN // 2))
        else:
            mbarrier.expect(bar, 2 * c_desc.block_type.nbytes + s_desc.block_type.nbytes)
            _tma_load(c_desc, [band0, step * 128], bar, cs.index(2 * st))
            _tma_load(c_desc, [band0, step * 128 + 128], bar, cs.index(2 * st + 1))
            _tma_load(s_desc, [n0, step * 8], bar, ss.index(st))

    @gluon.jit
    def _producer(X, c_desc, s_desc, cs, ss, xs, ready, empty, x_ready, x_empty, M, pid_m, band0, n0, s_lo, npairs,
                  stride_xm, pd, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, PW: gl.constexpr,
                  PAIR: gl.constexpr, XTMA: gl.constexpr, XSTAGES: gl.constexpr, j0=0, PDL: gl.constexpr = False):
        """Fill stage j % STAGES, once the consumer has released it, with K steps s_lo + 2 j and + 1: codes
        and scales by TMA, X through this warpgroup's registers, permuted into the MMA's K order; with
        XTMA, X (a descriptor over activations already in K order) by TMA too, four [BM, 64] half steps.
        With XSTAGES the half steps go to a ring of their own, half step u into stage u % XSTAGES; ``j0``
        (persistent programs) counts the pairs of the program's earlier tiles, so rings and phases carry on.
        PDL (XTMA): the program's first stages of codes and scales load before the wait for the kernel that
        wrote X (pdl.py); ``pre`` of this tile's pairs then have their weights already."""
        pre = npairs * 0
        if PDL:
            pre = _early_weights(c_desc, s_desc, cs, ss, ready, band0, n0, s_lo, npairs, pd, j0, BN, STAGES, PAIR)
        if XSTAGES:
            for jt in range(npairs):
                j = j0 + jt
                st = j % STAGES
                mbarrier.wait(empty.index(st), ((j // STAGES) & 1) ^ 1)
                step = s_lo + 2 * jt
                if not PDL:
                    _load_weights(c_desc, s_desc, cs, ss, st, ready.index(st), band0, n0, step, pd, BN, PAIR)
                elif jt >= pre:
                    _load_weights(c_desc, s_desc, cs, ss, st, ready.index(st), band0, n0, step, pd, BN, PAIR)
                for q in gl.static_range(4):
                    u = 4 * j + q
                    xst = u % XSTAGES
                    mbarrier.wait(x_empty.index(xst), ((u // XSTAGES) & 1) ^ 1)
                    bar = x_ready.index(xst)
                    mbarrier.expect(bar, X.block_type.nbytes)
                    _tma_load(X, [pid_m * BM, step * 128 + 64 * q], bar, xs.index(xst))
        elif XTMA:
            for j in range(npairs):
                st = j % STAGES
                mbarrier.wait(empty.index(st), ((j // STAGES) & 1) ^ 1)
                bar = ready.index(st)
                step = s_lo + 2 * j
                mbarrier.expect(bar, 4 * X.block_type.nbytes)  # the stage's second arrival: X's bytes
                if not PDL:
                    _load_weights(c_desc, s_desc, cs, ss, st, bar, band0, n0, step, pd, BN, PAIR)
                elif j >= pre:
                    _load_weights(c_desc, s_desc, cs, ss, st, bar, band0, n0, step, pd, BN, PAIR)
                for q in gl.static_range(4):
                    _tma_load(X, [pid_m * BM, step * 128 + 64 * q], bar, xs.index(4 * st + q))
        else:
            XL: gl.constexpr = _x_layout(BM, PW)
            rm_x = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, XL))
            xm = gl.expand_dims(rm_x, 1)
            xrow = X + xm * stride_xm + gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, XL)), 0)
            xok = xm < M
            for j in range(npairs):
                st = j % STAGES
                mbarrier.wait(empty.index(st), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
                bar = ready.index(st)
                step = s_lo + 2 * j
                _load_weights(c_desc, s_desc, cs, ss, st, bar, band0, n0, step, pd, BN, PAIR)
                x0 = gl.load(xrow + step * 128, mask=xok, other=0.0)
                x1 = gl.load(xrow + step * 128 + 128, mask=xok, other=0.0)
                xs.index(2 * st).store(_permute_x(x0, BM))
                xs.index(2 * st + 1).store(_permute_x(x1, BM))
                fence_async_shared()  # the generic-proxy stores, before the wgmma's async-proxy reads
                mbarrier.arrive(bar)  # the stage's second arrival (the first is the TMA's expect)

    @gluon.jit
    def _early_weights(c_desc, s_desc, cs, ss, ready, band0, n0, s_lo, npairs, pd, j0, BN: gl.constexpr,
                       STAGES: gl.constexpr, PAIR: gl.constexpr):
        """PDL: on the program's first tile (j0 == 0: its ring stages are all free), load the weights of its
        first min(npairs, STAGES) pairs, then wait for the kernel that wrote X (pdl.py). Returns that count
        (0 on later tiles, where the wait has long returned)."""
        pre = npairs * 0
        if j0 == 0:
            pre = gl.minimum(npairs, STAGES)
            for st in range(pre):
                _load_weights(c_desc, s_desc, cs, ss, st, ready.index(st), band0, n0, s_lo + 2 * st, pd, BN, PAIR)
            griddep_wait()
        return pre

    @gluon.constexpr_function
    def _acc_layout(BM, NW):
        """The [BN, BM] accumulator of NW / 4 consumer warpgroups (swap-AB: weight rows are the MMA's M)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])

    @gluon.jit
    def _stage_scales(ss, ready, j, R0: gl.constexpr, BN: gl.constexpr, NW: gl.constexpr, STAGES: gl.constexpr):
        """(stage, its [BN, 16] scales from row R0) of the program's K-step pair j, once the stage is filled."""
        st = j % STAGES
        mbarrier.wait(ready.index(st), (j // STAGES) & 1)
        return st, ss.index(st).slice(R0, BN).load(CODES16(BN, NW))

    @gluon.jit
    def _stage_groups(cs, st, h: gl.constexpr, R0: gl.constexpr, BN: gl.constexpr, NW: gl.constexpr):
        """Rows R0 .. R0 + BN of K step h of stage st's codes, as [BN, 8] groups in the consumer's registers."""
        FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        return _as_groups(cs.index(2 * st + h).slice(R0 // 16, BN // 16), BN, FLAT).load(_codes_layout(BN, NW))

    @gluon.jit
    def _consumer(cs, ss, xs, ready, empty, npairs,
                  BM: gl.constexpr, BN: gl.constexpr, NW: gl.constexpr, STAGES: gl.constexpr, HALF: gl.constexpr,
                  XTMA: gl.constexpr, R0: gl.constexpr = 0):
        """acc [BN, BM] over the program's K steps, everything read from the ring. HALF 0: one MMA per K step;
        1: two half-step MMAs (half the A fragment live); 2: half steps with one MMA left in flight while
        the next half decodes (its A operand handed to the next wait, so ptxas keeps its registers).
        R0: the first of the stage's weight rows this consumer takes (``DUO``: two consumers, BN rows each)."""
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_acc_layout(BM, NW), k_width=2)
        CODES: gl.constexpr = _codes_layout(BN, NW)
        acc = gl.zeros([BN, BM], gl.float32, layout=_acc_layout(BM, NW))
        a_o = gl.zeros([BN, 64], gl.bfloat16, layout=DOT)
        for j in range(npairs):
            st, sc = _stage_scales(ss, ready, j, R0, BN, NW, STAGES)
            for h in gl.static_range(2):
                pw = _stage_groups(cs, st, h, R0, BN, NW)
                s = _half_scales(sc, h, BN, CODES)
                if XTMA:  # [BM, 64] half-step tiles (HALF >= 1)
                    xe = xs.index(4 * st + 2 * h)
                    xo = xs.index(4 * st + 2 * h + 1)
                else:
                    xb = xs.index(2 * st + h)
                    xe = xb.slice(0, 64, dim=1)
                    xo = xb.slice(64, 64, dim=1)
                if HALF == 0:
                    a = _decode_fragment(pw, s, BN, DOT)
                    acc = warpgroup_mma_wait(0, deps=[warpgroup_mma(a, xb.permute((1, 0)), acc, is_async=True)])
                else:
                    pw_e, pw_o = _halves(pw, BN)
                    s_e, s_o = _halves(s, BN)
                    a_e = _decode_half(pw_e, s_e, BN, DOT)
                    acc = _half_mma(a_e, xe, acc, a_o, HALF == 2)
                    a_o = _decode_half(pw_o, s_o, BN, DOT)
                    acc = _half_mma(a_o, xo, acc, a_e, HALF == 2)
            if HALF == 2:
                acc = warpgroup_mma_wait(0, deps=[acc])  # the stage's last MMA reads its X: done before release
            mbarrier.arrive(empty.index(st))
        return (acc,)  # warp_specialize flattens the default partition's results as a tuple

    @gluon.jit
    def _consumer_xring(cs, ss, xs, ready, empty, x_ready, x_empty, npairs, BM: gl.constexpr, BN: gl.constexpr,
                        NW: gl.constexpr, STAGES: gl.constexpr, XSTAGES: gl.constexpr, R0: gl.constexpr = 0, j0=0):
        """``_consumer`` (half steps, one MMA in flight) over a separate X ring of [BM, 64] half steps. The
        codes' stage is released as soon as its codes and scales are in registers (no MMA reads them), and
        each X stage once the MMA that read it has completed. The MMAs drain at the end of each codes
        stage: an MMA in flight across the loop's back edge makes ptxas serialise them all (C7515)."""
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_acc_layout(BM, NW), k_width=2)
        CODES: gl.constexpr = _codes_layout(BN, NW)
        acc = gl.zeros([BN, BM], gl.float32, layout=_acc_layout(BM, NW))
        a_o = gl.zeros([BN, 64], gl.bfloat16, layout=DOT)
        for jt in range(npairs):
            j = j0 + jt
            st, sc = _stage_scales(ss, ready, j, R0, BN, NW, STAGES)
            pw0 = _stage_groups(cs, st, 0, R0, BN, NW)
            pw1 = _stage_groups(cs, st, 1, R0, BN, NW)
            mbarrier.arrive(empty.index(st))
            for h in gl.static_range(2):
                if h == 0:
                    pw = pw0
                else:
                    pw = pw1
                s = _half_scales(sc, h, BN, CODES)
                pw_e, pw_o = _halves(pw, BN)
                s_e, s_o = _halves(s, BN)
                u = 4 * j + 2 * h
                a_e = _decode_half(pw_e, s_e, BN, DOT)
                acc = _xring_mma(a_e, xs, x_ready, x_empty, u, acc, a_o, XSTAGES, (j > 0) | (h > 0))
                a_o = _decode_half(pw_o, s_o, BN, DOT)
                acc = _xring_mma(a_o, xs, x_ready, x_empty, u + 1, acc, a_e, XSTAGES, True)
            acc = warpgroup_mma_wait(0, deps=[acc])
        return (acc,)

    @gluon.jit
    def _xring_mma(a, xs, x_ready, x_empty, u, acc, prev, XSTAGES: gl.constexpr, release_prev):
        """Half step u's MMA on X stage u % XSTAGES, left in flight; once the one before it is done, that
        one's X stage is released (``release_prev``: there was one)."""
        xst = u % XSTAGES
        mbarrier.wait(x_ready.index(xst), (u // XSTAGES) & 1)
        tok = warpgroup_mma(a, xs.index(xst).permute((1, 0)), acc, is_async=True)
        acc, prev = warpgroup_mma_wait(1, deps=[tok, prev])
        mbarrier.arrive(x_empty.index((u + XSTAGES - 1) % XSTAGES), pred=release_prev)
        return acc

    @gluon.jit
    def _duo_consumer(cs, ss, xs, ready, empty, x_ready, x_empty, npairs, G, B, Y, WS, CNT, pid, pid_k, n_full, pid_m,
                      pid_n, M, N, stride_ym, BM: gl.constexpr, STAGES: gl.constexpr, HALF: gl.constexpr,
                      XTMA: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr, HALVES: gl.constexpr,
                      R0: gl.constexpr, XSTAGES: gl.constexpr, PAIR: gl.constexpr, hand, handed, j0=0, phase=0,
                      YD=None, ysm=None, TSTORE: gl.constexpr = False):
        """One of a ``DUO`` program's two consumer warpgroups, each its own partition: weight rows R0 ..
        R0 + 63 of the stage, released with its own arrival and stored by itself, so neither waits for the
        other's decode (in one partition of 8 warps every release is a barrier of both). Its rows store as
        tile 2 pid + R0 / 64 of a BN 64 grid (split-K and halved tiles count arrivals per such tile).
        SwiGLU (PAIR 1 or 3, whole tiles only): the stage's rows are 64 gate rows then their 64 up rows, so
        the two consumers exchange them through shared memory (``hand``, ``handed``) and each writes
        silu(gate) * up for 32 of them. ``j0``, ``phase``: a persistent program's earlier pairs, and the
        exchange barrier's phase for this tile (_duo_tiles). TSTORE (persistent plain tiles): the rows leave
        by a TMA store from ``ysm`` that the consumer does not wait for (_tma_store_rows)."""
        ACC: gl.constexpr = _acc_layout(BM, 4)
        if XSTAGES:
            acc = _consumer_xring(cs, ss, xs, ready, empty, x_ready, x_empty, npairs, BM, 64, 4, STAGES, XSTAGES, R0,
                                  j0)[0]
        else:
            acc = _consumer(cs, ss, xs, ready, empty, npairs, BM, 64, 4, STAGES, HALF, XTMA, R0)[0]
        h = R0 // 64
        if PAIR % 2 == 1:
            # Both store their rows (rounded to bf16 here, where _write_swiglu_rows rounds them) and, once both
            # have, each writes 32 of the tile's 64 outputs. Symmetric on purpose: Triton 3.6 failed to lower
            # every variant where the two partitions ran different epilogues (docs/benchmarks.md, twentieth pass).
            hand.index(h).store((acc * (256.0 / gl.load(G))).to(gl.bfloat16))  # decode.FAST_EPILOGUE
            mbarrier.arrive(handed)
            mbarrier.wait(handed, phase)
            OL: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, 4], [0, 1])  # lanes along Y's columns
            R1: gl.constexpr = R0 // 2  # this consumer's 32 rows
            g = hand.index(0).slice(R1, 32).load(OL).to(gl.float32)
            u = hand.index(1).slice(R1, 32).load(OL).to(gl.float32)
            _write_swiglu_rows(g, u, Y, pid_m, 2 * pid_n + h, M, N, stride_ym, BM, 32, PAIR == 3, OL)
        elif TSTORE:
            _tma_store_rows(acc, G, B, YD, ysm.index(h), pid_m, 128 * pid_n + R0, N, BM, HAS_BIAS, ACC)
        else:
            _store_program(acc, G, B, Y, WS, CNT, 2 * pid + h, pid_k, 2 * n_full, pid_m, 2 * pid_n + h, M, N,
                           stride_ym, BM, 64, SPLIT, HAS_BIAS, ACC, HALVES, 0, 4, (None, None, None, None, None, 0, 0),
                           64)

    @gluon.jit
    def _tma_store_rows(acc, G, B, YD, ysm, pid_m, col0, N, BM: gl.constexpr, HAS_BIAS: gl.constexpr,
                        ACC: gl.constexpr):
        """A duo consumer's finished [64, BM] rows -> Y[pid_m BM .., col0 .. col0 + 63] by one TMA store from
        ``ysm`` (its [BM, 64] bf16 buffer), left in flight: the consumer goes on to its next tile's MMAs and
        waits for the store only before it rewrites the buffer. Same arithmetic as _store_tile / _write_y
        (the 2^8 and global scale, then the bias), so the same bits; TMA clips the rows and columns past Y."""
        _tma_store_out(acc * (256.0 / gl.load(G)), B, YD, ysm, pid_m, col0, N, BM, HAS_BIAS, ACC)  # decode.FAST_EPILOGUE

    @gluon.jit
    def _tma_store_out(out, B, YD, ysm, pid_m, col0, N, BM: gl.constexpr, HAS_BIAS: gl.constexpr, ACC: gl.constexpr):
        """Scaled rows [64, BM] (+ bias, as _write_y adds it) -> Y by a TMA store left in flight (_tma_store_rows)."""
        if HAS_BIAS:
            rb = (col0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))) % N
            out += gl.expand_dims(gl.load(B + rb).to(gl.float32), 1)
        tma.store_wait(0)  # the previous tile's store has read the buffer
        ysm.store(gl.permute(out.to(gl.bfloat16), [1, 0]))
        fence_async_shared()  # the generic-proxy stores, before TMA's async-proxy read
        _tma_store(YD, [pid_m * BM, col0], ysm)

    @gluon.jit
    def _tail_plan(M, N, parts, BM: gl.constexpr, BN: gl.constexpr):
        """A tail-split program's (whole waves of tiles, run first: its tiles p, p + P, ...; its tail tile, -1 if
        it has none, and the part of it). The last, partial wave's R tiles run as ``parts`` K-parts each,
        part k of every tail tile the same pairs, one part per program."""
        p = gl.program_id(0)
        nprog = gl.num_programs(0)
        tiles = gl.cdiv(M, BM) * gl.cdiv(N, BN)
        n_dp = tiles - tiles % nprog
        tail = gl.where(p < (tiles - n_dp) * parts, n_dp + p // parts, -1)
        return n_dp // nprog, tail, p % parts

    @gluon.jit
    def _tail_partial(acc, G, B, YD, ysm, WS, CNT, pid_m, col0, N, q_lo, parts, BM: gl.constexpr,
                      HAS_BIAS: gl.constexpr, ACC: gl.constexpr, h: gl.constexpr):
        """A consumer's rows of one K-part of a tail tile: an fp32 partial in the workspace (slot = program,
        half h, [64, BM] row-major), and the last of the tile's ``parts`` programs (q_lo ..) to arrive sums
        the partials in program order (deterministic) and stores the rows by TMA. Counted per half tile."""
        loc = (gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, ACC)), 1) * BM
               + gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(0, ACC)), 0))
        half = WS + h * (64 * BM)
        gl.store(half + gl.program_id(0) * (128 * BM) + loc, acc * (256.0 / gl.load(G)))  # decode.FAST_EPILOGUE
        _cta_barrier()  # this partition's partial stores precede the counter's release
        ctr = CNT + 2 * (q_lo // parts) + h
        if gl.atomic_add(ctr, 1, sem="acq_rel", scope="gpu") == parts - 1:
            _tail_sum_store(half, B, YD, ysm, pid_m, col0, N, q_lo, parts, BM, HAS_BIAS)
            gl.atomic_xchg(ctr, 0)

    @gluon.jit
    def _tail_sum_store(half, B, YD, ysm, pid_m, col0, N, q_lo, parts, BM: gl.constexpr, HAS_BIAS: gl.constexpr):
        """The partials of a tail tile's half summed 64 columns at a time (16-byte loads, 32 registers a
        thread: summed whole, in the accumulator's layout, the loads queued behind spills and ran ~10x
        slower) into the store buffer, then one TMA store."""
        RL: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, RL))
        tma.store_wait(0)  # the previous tile's store has read the buffer
        for c in gl.static_range(BM // 64):
            off = gl.expand_dims(rows, 1) * BM + gl.expand_dims(c * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, RL)), 0)
            total = gl.zeros([64, 64], gl.float32, layout=RL)
            for q in range(q_lo, q_lo + parts):
                total += gl.load(half + q * (128 * BM) + off, cache_modifier=".cg")
            if HAS_BIAS:
                total += gl.expand_dims(gl.load(B + (col0 + rows) % N).to(gl.float32), 1)
            ysm.slice(c * 64, 64).store(gl.permute(total.to(gl.bfloat16), [1, 0]))
        fence_async_shared()  # the generic-proxy stores, before TMA's async-proxy read
        _tma_store(YD, [pid_m * BM, col0], ysm)

    @gluon.jit
    def _duo_tail_tiles(cs, ss, xs, ready, empty, x_ready, x_empty, npairs, parts, G, B, WS, CNT, M, N,
                        BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr,
                        R0: gl.constexpr, XSTAGES: gl.constexpr, YD, ysm):
        """A tail-split program's consumer (``FwdConfig.tail``): its whole tiles as _duo_tiles (TMA-stored),
        then its K-part of a tail tile, if any, through the workspace (_tail_partial)."""
        ACC: gl.constexpr = _acc_layout(BM, 4)
        grid_n = gl.cdiv(N, BN)
        p = gl.program_id(0)
        waves, tail, k = _tail_plan(M, N, parts, BM, BN)
        for it in range(waves):
            t = p + it * gl.num_programs(0)
            acc = _consumer_xring(cs, ss, xs, ready, empty, x_ready, x_empty, npairs, BM, 64, 4, STAGES, XSTAGES, R0,
                                  it * npairs)[0]
            _tma_store_rows(acc, G, B, YD, ysm.index(R0 // 64), t // grid_n, BN * (t % grid_n) + R0, N, BM, HAS_BIAS,
                            ACC)
        if tail >= 0:
            lo = k * npairs // parts
            acc = _consumer_xring(cs, ss, xs, ready, empty, x_ready, x_empty, (k + 1) * npairs // parts - lo, BM, 64,
                                  4, STAGES, XSTAGES, R0, waves * npairs)[0]
            _tail_partial(acc, G, B, YD, ysm.index(R0 // 64), WS, CNT, tail // grid_n, BN * (tail % grid_n) + R0, N,
                          p - k, parts, BM, HAS_BIAS, ACC, R0 // 64)
        tma.store_wait(0)

    @gluon.jit
    def _producer_tail(X, c_desc, s_desc, cs, ss, xs, ready, empty, x_ready, x_empty, M, N, npairs, parts, stride_xm,
                       BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, XSTAGES: gl.constexpr,
                       PDL: gl.constexpr):
        """A tail-split program's producer: the X-ring producer of _producer over its whole tiles, then its
        K-part of a tail tile."""
        grid_n = gl.cdiv(N, BN)
        p = gl.program_id(0)
        waves, tail, k = _tail_plan(M, N, parts, BM, BN)
        for it in range(waves):
            t = p + it * gl.num_programs(0)
            n0 = (t % grid_n) * BN
            _producer(X, c_desc, s_desc, cs, ss, xs, ready, empty, x_ready, x_empty, M, t // grid_n, n0 // 16, n0,
                      0, npairs, stride_xm, 0, BM, BN, STAGES, 4, 0, True, XSTAGES, it * npairs, PDL)
        if tail >= 0:
            lo = k * npairs // parts
            n0 = (tail % grid_n) * BN
            _producer(X, c_desc, s_desc, cs, ss, xs, ready, empty, x_ready, x_empty, M, tail // grid_n, n0 // 16, n0,
                      2 * lo, (k + 1) * npairs // parts - lo, stride_xm, 0, BM, BN, STAGES, 4, 0, True, XSTAGES,
                      waves * npairs, PDL)

    @gluon.jit
    def _duo_tiles(cs, ss, xs, ready, empty, x_ready, x_empty, npairs, G, B, Y, WS, CNT, M, N, stride_ym,
                   BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr,
                   R0: gl.constexpr, XSTAGES: gl.constexpr, PAIR: gl.constexpr, hand, handed, YD, ysm,
                   TSTORE: gl.constexpr):
        """A persistent ``DUO`` program's consumer: tiles pid, pid + programs, ... one after the other, its
        rings' stages and phases carrying on from tile to tile. The exchange buffer is rewritten one tile
        later only after the other consumer has released most of that tile's stages, so after it has read
        the buffer (the launcher keeps such programs to K of more ring stages than the rings hold). TSTORE:
        each tile's store is left in flight while the next tile runs (_tma_store_rows)."""
        grid_n = gl.cdiv(N, BN)
        ntiles = gl.cdiv(M, BM) * grid_n
        for it in range(gl.cdiv(ntiles - gl.program_id(0), gl.num_programs(0))):
            tile = gl.program_id(0) + it * gl.num_programs(0)
            _duo_consumer(cs, ss, xs, ready, empty, x_ready, x_empty, npairs, G, B, Y, WS, CNT, tile, 0, 0,
                          tile // grid_n, tile % grid_n, M, N, stride_ym, BM, STAGES, 2, True, HAS_BIAS, 1, False, R0,
                          XSTAGES, PAIR, hand, handed, it * npairs, it & 1, YD, ysm, TSTORE)
        if TSTORE:
            tma.store_wait(0)  # the last tile's store has read the buffer before the program exits

    @gluon.jit
    def _producer_tiles(X, c_desc, s_desc, cs, ss, xs, ready, empty, x_ready, x_empty, M, N, npairs, stride_xm,
                        BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, PAIR: gl.constexpr,
                        XSTAGES: gl.constexpr, HD: gl.constexpr, PDL: gl.constexpr):
        """A persistent program's producer: the X-ring producer of _producer over its tiles in turn, so it
        fills the next tile's first stages while the consumers finish the last one and store it."""
        grid_n = gl.cdiv(N, BN)
        ntiles = gl.cdiv(M, BM) * grid_n
        pd = _pair_distance(N, PAIR, HD)
        for it in range(gl.cdiv(ntiles - gl.program_id(0), gl.num_programs(0))):
            tile = gl.program_id(0) + it * gl.num_programs(0)
            pid_n = tile % grid_n
            if PAIR:
                n0 = _pair_base(pid_n, BN, PAIR, HD)
            else:
                n0 = pid_n * BN
            _producer(X, c_desc, s_desc, cs, ss, xs, ready, empty, x_ready, x_empty, M, tile // grid_n, n0 // 16, n0,
                      0, npairs, stride_xm, pd, BM, BN, STAGES, 4, PAIR, True, XSTAGES, it * npairs, PDL)

    @gluon.jit
    def _half_mma(a, xh, acc, prev, INFLIGHT: gl.constexpr):
        """One half-step MMA (A from registers, X's [BM, 64] half from shared memory). With INFLIGHT it is
        left running and only the one before it is waited for; that one's A operand ``prev`` is handed to
        the wait so ptxas keeps its registers until then."""
        tok = warpgroup_mma(a, xh.permute((1, 0)), acc, is_async=True)
        if INFLIGHT:
            acc, prev = warpgroup_mma_wait(1, deps=[tok, prev])
        else:
            acc = warpgroup_mma_wait(0, deps=[tok])
        return acc

    @gluon.constexpr_function
    def _hand_layout(BM):
        """The exchanged rows [2, 64, BM] bf16: 16 bytes per swizzle unit, XORed by row, so the 8 rows of a
        warp's store (the wgmma accumulator layout) land in distinct banks."""
        return gl.SwizzledSharedLayout(8, 1, min(8, BM // 8), [1, 0])

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
    def _invalidate_rings(ready, empty, x_ready, x_empty, STAGES: gl.constexpr, XSTAGES: gl.constexpr):
        """The codes ring's barriers, and the X ring's where it has its own, once every partition is done."""
        for b in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(b))
            mbarrier.invalidate(empty.index(b))
        for b in gl.static_range(XSTAGES):
            mbarrier.invalidate(x_ready.index(b))
            mbarrier.invalidate(x_empty.index(b))

    @gluon.jit(do_not_specialize=["M"])
    def _nvfp4_fwd_gluon_ws_kernel(
        X, c_desc, s_desc, G, B, Y, WS, CNT,
        M, N, KG, pairs_per_split, n_full,
        stride_xm, stride_ym,
        BM: gl.constexpr, BN: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, NW: gl.constexpr,
        STAGES: gl.constexpr, PREGS: gl.constexpr, HALF: gl.constexpr, HALVES: gl.constexpr,
        PAIR: gl.constexpr = 0, P=None, CS=None, SLOT=None, KC=None, VC=None, NQ=0, NK=0, HD: gl.constexpr = 64,
        XTMA: gl.constexpr = False, DUO: gl.constexpr = False, CREGS: gl.constexpr = 0, XSTAGES: gl.constexpr = 0,
        PERSIST: gl.constexpr = False, YD=None, TSTORE: gl.constexpr = False, parts=0, TAIL: gl.constexpr = False,
        PDL: gl.constexpr = False,
    ):
        """XTMA: X is a TMA descriptor over activations already in the MMA's K order (launch_gluon_ws).
        DUO (BN 128, no pairing): the two consumer warpgroups run as two partitions of 4 warps (the launch's
        num_warps is 4), the second with CREGS registers, each storing its own 64 rows. TSTORE (PERSIST,
        no pairing): by TMA from shared memory, YD a descriptor over Y with [BM, 64] boxes. TAIL (PERSIST and
        TSTORE): the last partial wave's tiles in ``parts`` K-parts, WS / CNT the partials' workspace, counters.
        PDL (XTMA): launched as the dependent of the ``permute_x`` that wrote X; only the producer reads X
        and it waits for that kernel (_early_weights), nothing else touches what that kernel writes (pdl.py)."""
        ACC: gl.constexpr = _acc_layout(BM, NW)
        # gemm_gluon._program_k_range inline: through the helper ptxas spills at launch cap 48 (sm_90,
        # Triton 3.6: two LDL/STL in the split-K grid's SASS, none written out like this).
        if HALVES:
            pid, pid_k, p_lo, npairs = _halves_program(n_full, KG // 16)
        else:
            pid = gl.program_id(0)
            pid_k = gl.program_id(1)
            p_lo = pid_k * pairs_per_split
            npairs = gl.minimum(p_lo + pairs_per_split, KG // 16) - p_lo
        grid_n = gl.cdiv(N, BN)
        pid_m = pid // grid_n
        pid_n = pid % grid_n

        cs = gl.allocate_shared_memory(gl.int64, [2 * STAGES, BN // 16, 128], c_desc.layout)
        ss = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, 16], s_desc.layout)
        if XSTAGES:
            xs = gl.allocate_shared_memory(gl.bfloat16, [XSTAGES, BM, 64], X.layout)
        elif XTMA:
            xs = gl.allocate_shared_memory(gl.bfloat16, [4 * STAGES, BM, 64], X.layout)
        else:
            xs = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, BM, 128],
                                           gl.NVMMASharedLayout.get_default_for([BM, 128], gl.bfloat16))
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(STAGES):
            # the weights' expect, and X's (its expect, or the X stores) unless X has a ring of its own
            mbarrier.init(ready.index(b), count=1 if XSTAGES else 2)
            mbarrier.init(empty.index(b), count=1 + DUO)  # each consumer partition's release
        if XSTAGES:
            x_ready = gl.allocate_shared_memory(gl.int64, [XSTAGES, 1], mbarrier.MBarrierLayout())
            x_empty = gl.allocate_shared_memory(gl.int64, [XSTAGES, 1], mbarrier.MBarrierLayout())
            for b in gl.static_range(XSTAGES):
                mbarrier.init(x_ready.index(b), count=1)
                mbarrier.init(x_empty.index(b), count=1 + DUO)
        else:  # unused: X shares the codes' stages
            x_ready = ready
            x_empty = empty

        if PAIR:  # the tile's first half starts here, its second _pair_distance further (_load_weights)
            n0 = _pair_base(pid_n, BN, PAIR, HD)
        else:
            n0 = pid_n * BN
        pd = _pair_distance(N, PAIR, HD)
        if DUO:
            if PAIR % 2 == 1:  # the gate and up rows of a SwiGLU tile, exchanged by the consumers (_duo_consumer)
                hand = gl.allocate_shared_memory(gl.bfloat16, [2, 64, BM], _hand_layout(BM))
                handed = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
                mbarrier.init(handed, count=2)
            else:
                hand = ready
                handed = ready
            if TSTORE:
                ysm = gl.allocate_shared_memory(gl.bfloat16, [2, BM, 64], YD.layout)
            else:
                ysm = ready
            if TAIL:  # persistent programs, the last wave's tiles split in K (launch_gluon_ws)
                gl.warp_specialize([
                    (_duo_tail_tiles, (cs, ss, xs, ready, empty, x_ready, x_empty, npairs, parts, G, B, WS, CNT, M, N,
                                       BM, BN, STAGES, HAS_BIAS, gl.constexpr(0), XSTAGES, YD, ysm)),
                    (_duo_tail_tiles, (cs, ss, xs, ready, empty, x_ready, x_empty, npairs, parts, G, B, WS, CNT, M, N,
                                       BM, BN, STAGES, HAS_BIAS, gl.constexpr(64), XSTAGES, YD, ysm)),
                    (_producer_tail, (X, c_desc, s_desc, cs, ss, xs, ready, empty, x_ready, x_empty, M, N, npairs, parts,
                                      stride_xm, BM, BN, STAGES, XSTAGES, PDL)),
                ], [4, 4], [CREGS, PREGS])
            elif PERSIST:  # one program per SM slot walks tiles (launch_gluon_ws: split-K 1, X ring, duo)
                gl.warp_specialize([
                    (_duo_tiles, (cs, ss, xs, ready, empty, x_ready, x_empty, npairs, G, B, Y, WS, CNT, M, N, stride_ym,
                                  BM, BN, STAGES, HAS_BIAS, gl.constexpr(0), XSTAGES, PAIR, hand, handed, YD, ysm,
                                  TSTORE)),
                    (_duo_tiles, (cs, ss, xs, ready, empty, x_ready, x_empty, npairs, G, B, Y, WS, CNT, M, N, stride_ym,
                                  BM, BN, STAGES, HAS_BIAS, gl.constexpr(64), XSTAGES, PAIR, hand, handed, YD, ysm,
                                  TSTORE)),
                    (_producer_tiles, (X, c_desc, s_desc, cs, ss, xs, ready, empty, x_ready, x_empty, M, N, npairs,
                                       stride_xm, BM, BN, STAGES, PAIR, XSTAGES, HD, PDL)),
                ], [4, 4], [CREGS, PREGS])
            else:
                gl.warp_specialize([
                    (_duo_consumer, (cs, ss, xs, ready, empty, x_ready, x_empty, npairs, G, B, Y, WS, CNT, pid, pid_k, n_full,
                                     pid_m, pid_n, M, N, stride_ym, BM, STAGES, HALF, XTMA, HAS_BIAS, SPLIT, HALVES,
                                     gl.constexpr(0), XSTAGES, PAIR, hand, handed, gl.constexpr(0), gl.constexpr(0))),
                    (_duo_consumer, (cs, ss, xs, ready, empty, x_ready, x_empty, npairs, G, B, Y, WS, CNT, pid, pid_k, n_full,
                                     pid_m, pid_n, M, N, stride_ym, BM, STAGES, HALF, XTMA, HAS_BIAS, SPLIT, HALVES,
                                     gl.constexpr(64), XSTAGES, PAIR, hand, handed, gl.constexpr(0), gl.constexpr(0))),
                    (_producer, (X, c_desc, s_desc, cs, ss, xs, ready, empty, x_ready, x_empty, M, pid_m, n0 // 16, n0,
                                 2 * p_lo, npairs, stride_xm, pd, BM, BN, STAGES, 4, PAIR, XTMA, XSTAGES, gl.constexpr(0),
                                 PDL)),
                ], [4, 4], [CREGS, PREGS])
            _invalidate_rings(ready, empty, x_ready, x_empty, STAGES, XSTAGES)
        else:
            if XSTAGES:
                res = gl.warp_specialize([
                    (_consumer_xring, (cs, ss, xs, ready, empty, x_ready, x_empty, npairs, BM, BN, NW, STAGES, XSTAGES, 0,
                                       gl.constexpr(0))),
                    (_producer, (X, c_desc, s_desc, cs, ss, xs, ready, empty, x_ready, x_empty, M, pid_m, n0 // 16, n0,
                                 2 * p_lo, npairs, stride_xm, pd, BM, BN, STAGES, 4, PAIR, XTMA, XSTAGES, gl.constexpr(0),
                                 PDL)),
                ], [4], [PREGS])
            else:
                res = gl.warp_specialize([
                    (_consumer, (cs, ss, xs, ready, empty, npairs, BM, BN, NW, STAGES, HALF, XTMA)),
                    (_producer, (X, c_desc, s_desc, cs, ss, xs, ready, empty, x_ready, x_empty, M, pid_m, n0 // 16, n0,
                                 2 * p_lo, npairs, stride_xm, pd, BM, BN, STAGES, 4, PAIR, XTMA, XSTAGES, gl.constexpr(0),
                                 PDL)),
                ], [4], [PREGS])
            acc = res[0]
            _invalidate_rings(ready, empty, x_ready, x_empty, STAGES, XSTAGES)
            _store_program(acc, G, B, Y, WS, CNT, pid, pid_k, n_full, pid_m, pid_n, M, N, stride_ym, BM, BN, SPLIT,
                           HAS_BIAS, ACC, HALVES, PAIR, NW, (P, CS, SLOT, KC, VC, NQ, NK), HD)


def duo_runs(cfg, pair: bool, rope, split: int, halved: bool, grid_mn: int) -> bool:
    """Whether a launch runs ``cfg`` with its consumers as two partitions. A duo tile's consumers each
    store their own rows: a rotary tile (both halves of a head in one warpgroup) runs in one partition;
    a SwiGLU tile pairs through shared memory, whole tiles only (split-K and halved tiles reduce through
    the workspace, where pairing needs both halves); a plain one counts its arrivals per 64-row half tile,
    so only where those fit the counters."""
    if not (getattr(cfg, "duo", False) and cfg.bn == 128) or rope is not None:
        return False
    if pair:
        return split == 1 and not halved
    return 2 * grid_mn <= COUNTER_SLOTS


def persist_programs(cfg, duo: bool, split: int, halved: bool, pairs: int, device) -> int:
    """Programs of a persistent launch (``cfg.persist`` per SM), or 0 where it runs one program per tile:
    only duo tiles with an X ring of their own, split-K 1 and no halved tiles, and only where K spans more
    ring stages than both rings hold (what keeps the SwiGLU exchange buffer from being rewritten early)."""
    per_sm = getattr(cfg, "persist", 0)
    if not (per_sm and duo and getattr(cfg, "xstages", 0) and split == 1 and not halved):
        return 0
    if pairs <= cfg.stages + -(-cfg.xstages // 4) + 1:
        return 0
    return per_sm * num_sms(device)


def tma_store_runs(cfg, persist: int, pair: bool, rope, y: torch.Tensor) -> bool:
    """Whether a launch stores its tiles by TMA (``cfg.tstore``): persistent plain tiles only (a pairing tile
    writes through its exchange), and only where Y's rows are 16-byte aligned, as TMA needs."""
    return bool(getattr(cfg, "tstore", False) and persist and not pair and rope is None
                and y.stride(1) == 1 and (y.stride(0) * y.element_size()) % 16 == 0 and y.data_ptr() % 16 == 0)


def tail_plan(cfg, persist: int, tstore: bool, grid_mn: int, pairs: int, y: torch.Tensor):
    """(K-parts per tail tile, grid, fp32 workspace, arrival counters) of a tail-split launch (``cfg.tail``:
    persistent programs run whole waves of tiles, then the R tiles of the last, partial wave as P // R
    K-parts each, one part per program), or None where it runs whole tiles: no persistent TMA-stored launch,
    no partial wave or too full a one to split, no counters yet (a first call under graph capture)."""
    if not (getattr(cfg, "tail", False) and persist and tstore):
        return None
    nprog = min(persist, grid_mn)
    rest = grid_mn % nprog
    parts = min(nprog // rest, pairs) if rest else 0
    cnt = arrival_counters(y.device)
    if parts < 2 or cnt is None or 2 * rest > COUNTER_SLOTS:
        return None
    return parts, (nprog,), torch.empty(nprog * 128 * cfg.bm, dtype=torch.float32, device=y.device), cnt


def y_layout(bm: int):
    """Y's [BM, 64] bf16 boxes: 128-byte rows, the full swizzle."""
    return gl.NVMMASharedLayout.get_default_for([bm, 64], gl.bfloat16)


def duo_consumer_regs(cfg) -> int:
    """Registers of a duo tile's second consumer: an even share of what the launch cap leaves past the
    producer's (three warpgroups at ``maxnreg``), rounded down to setmaxnreg's multiple of 8."""
    return min(256, (3 * cfg.maxnreg - cfg.pregs) // 2 // 8 * 8)


def code_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=64, rank=2)


def scale_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)


def ws_supported(x: torch.Tensor, groups: torch.Tensor, scale_u8: torch.Tensor, cfg) -> bool:
    """Whether this kernel can run the call: K % 256 == 0, whole 16-row bands, TMA alignment."""
    n, kg = groups.shape
    return (HAVE_GLUON_WS and (16 * kg) % STEP_PAIR == 0 and n % 16 == 0 and cfg.bn % 16 == 0 and scale_u8.stride(1) == 1
            and scale_u8.stride(0) % 16 == 0 and scale_u8.data_ptr() % 16 == 0 and groups.data_ptr() % 16 == 0
            and groups.is_contiguous())


def launch_gluon_ws(x, groups, scale_u8, global_scale, bias, cfg, pair: bool = False,
                    rope: RopeEpilogue | None = None, y_korder: bool = False, x_korder: bool = False) -> torch.Tensor:
    """``x [M, K] @ W^T`` (+ bias) by the warp-specialised kernel: ``groups`` int64 [N, K / 16] twiddled,
    blocked codes, ``scale_u8`` [N, K / 16] e4m3 bytes; ``cfg`` needs bm, bn, split_k, warps, stages.
    ``pair``, ``rope``, ``y_korder``: the pairing epilogues, as ``gemm_gluon.launch_gluon``. ``cfg.xtma``
    (half steps only): X comes by TMA from activations in the MMA's K order, ``x`` itself with
    ``x_korder`` (written so by the kernel that produced it), else a ``permute_x`` copy."""
    m, k = x.shape
    xtma = bool(getattr(cfg, "xtma", False))
    if xtma and not getattr(cfg, "half", 0):
        raise ValueError("X by TMA feeds half-step MMAs: the tile needs half >= 1")
    xstages = getattr(cfg, "xstages", 0)
    if xstages and not (xtma and cfg.half == 2):
        raise ValueError("an X ring of its own (xstages) feeds X by TMA to half steps in flight: needs xtma, half 2")
    n, kg = groups.shape
    grid_mn = triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn)
    xarg, pdl = x, False
    if xtma:
        xk, pdl = permuted_for_pdl(x, x_korder)
        xarg = GluonDescriptor.from_tensor(xk, [cfg.bm, 64], x_layout(cfg.bm))
    elif x_korder:
        raise ValueError("this tile reads X in natural order")
    y = torch.empty((m, n // 2 if pair else n), dtype=x.dtype, device=x.device)
    split, per, ws, cnt = split_k_plan(y, cfg.split_k, kg // 16, grid_mn, n_cols=n)
    n_full, grid, ws, cnt = plan_halves(y, cfg, split, kg // 16, grid_mn, n, ws, cnt)
    duo = duo_runs(cfg, pair, rope, split, n_full is not None, grid_mn)
    persist = persist_programs(cfg, duo, split, n_full is not None, kg // 16, x.device)
    if persist:
        grid = (min(grid_mn, persist),)
    tstore = tma_store_runs(cfg, persist, pair, rope, y)
    yd = GluonDescriptor.from_tensor(y, [cfg.bm, 64], y_layout(cfg.bm)) if tstore else None
    tail = tail_plan(cfg, persist, tstore, grid_mn, kg // 16, y)
    if tail is not None:
        parts, grid, ws, cnt = tail
    rows = cfg.bn // 2 if pair or rope is not None else cfg.bn  # a pairing tile loads its two halves apart
    c_desc = GluonDescriptor.from_tensor(groups.view(n // 16, kg * 16), [rows // 16, 128], code_layout())
    s_desc = GluonDescriptor.from_tensor(scale_u8, [rows, 16], scale_layout())
    _nvfp4_fwd_gluon_ws_kernel[grid](
        xarg, c_desc, s_desc, global_scale.reshape(1).to(torch.float32), bias if bias is not None else y,
        y, ws, cnt,
        m, n, kg, per, n_full or 0,
        x.stride(0), y.stride(0),
        BM=cfg.bm, BN=cfg.bn, SPLIT=split, HAS_BIAS=bias is not None, NW=4 if duo else cfg.warps, STAGES=cfg.stages,
        PREGS=getattr(cfg, "pregs", 40), HALF=getattr(cfg, "half", 0), HALVES=n_full is not None,
        PAIR=pair_mode(pair, rope, y_korder), XTMA=xtma, DUO=duo, CREGS=duo_consumer_regs(cfg) if duo else 0,
        XSTAGES=xstages, PERSIST=bool(persist), YD=yd, TSTORE=tstore, parts=tail[0] if tail else 0, TAIL=tail is not None,
        PDL=pdl, num_warps=4 if duo else cfg.warps, maxnreg=getattr(cfg, "maxnreg", None), **launch_kwargs(pdl),
        **(rope.kernel_args() if rope is not None else {}),
    )
    return y
