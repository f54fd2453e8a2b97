"""The tensor pipe's ceiling for the MMA shapes the NVFP4 tiles issue: wgmma with A from registers (RS,
as the register-A tiles feed their decoded weights) against A from shared memory (SS, as cuBLAS), a probe.

Every program loops over one resident [64 NW / 4, 64] A tile and one [BM, 64] B tile, issuing one
K = 64 wgmma group per iteration into the same accumulator with one group left in flight (the tiles'
``half 2`` mode), and nothing else: no loads, no decode, no epilogue but a sum that keeps the result
live. "RS + decode" also decodes each iteration's A fragment from NVFP4 codes held in registers, as the
register-A tiles do (gemm_gluon_tma._decode_half), still with no memory traffic: what decode and MMA
reach together when nothing waits on memory. ``--ring-stages`` adds that loop fed as the warp-specialised
tiles feed it: a producer warpgroup fills a ring of X stages (by TMA from an L2-resident X, or by an
mbarrier arrival alone) and the consumer waits for each stage and releases it. TFLOP/s = 2 x rows x BM x 64 x iterations x programs / time; the H100 SXM's dense bf16 peak is
~989 TFLOP/s at its boost clock.

    python benchmarks/probe_wgmma.py --bms 128,256 --warps 4,8 --progs 1,2
"""

from __future__ import annotations

import argparse
import sys

import torch
from qerl_kernels.gemm_gluon import _codes_layout, _cta_barrier
from qerl_kernels.gemm_gluon_tma import _decode_half, _halves
from qerl_kernels.gemm_gluon_ws import (
    GluonDescriptor,
    _tma_load,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def _wgmma_loop(Out, iters, BM: gl.constexpr, NW: gl.constexpr, RS: gl.constexpr, DECODE: gl.constexpr = False):
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    ROWS: gl.constexpr = 16 * NW
    FILL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    a_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, 64], gl.NVMMASharedLayout.get_default_for([ROWS, 64], gl.bfloat16))
    b_s = gl.allocate_shared_memory(gl.bfloat16, [BM, 64], gl.NVMMASharedLayout.get_default_for([BM, 64], gl.bfloat16))
    a_s.store(gl.full([ROWS, 64], 0.0078125, gl.bfloat16, layout=FILL))
    b_s.store(gl.full([BM, 64], 0.0078125, gl.bfloat16, layout=FILL))
    fence_async_shared()
    _cta_barrier()
    acc = gl.zeros([ROWS, BM], gl.float32, layout=ACC)
    if DECODE:
        # The register-A tiles' half step: decode [ROWS, 64] weights from codes in registers (rotated every
        # iteration so nothing is hoisted), issue its MMA, wait for the one before (gemm_gluon_ws._half_mma).
        groups = gl.full([ROWS, 8], 0x3C5A96E1D2B4870F, gl.int64, layout=_codes_layout(ROWS, NW))
        scales = gl.full([ROWS, 8], 0x38, gl.uint8, layout=_codes_layout(ROWS, NW))
        # As there, the MMAs drain once per four half steps (a ring stage): one left in flight across the
        # loop's back edge would have its A registers rewritten by the next decode while it reads them.
        pw, _ = _halves(groups, ROWS)
        sc, _ = _halves(scales, ROWS)
        prev = gl.zeros([ROWS, 64], gl.bfloat16, layout=DOT)
        for _ in range(iters // 4):
            for _h in gl.static_range(4):
                pw = (pw << 1) | ((pw >> 63) & 1)
                a = _decode_half(pw, sc, ROWS, DOT)
                tok = warpgroup_mma(a, b_s.permute((1, 0)), acc, is_async=True)
                acc, prev = warpgroup_mma_wait(1, deps=[tok, prev])
                prev = a
            acc = warpgroup_mma_wait(0, deps=[acc])
    elif RS:
        a = a_s.load(DOT)
        for _ in range(iters):
            acc = warpgroup_mma_wait(1, deps=[warpgroup_mma(a, b_s.permute((1, 0)), acc, is_async=True)])
    else:
        for _ in range(iters):
            acc = warpgroup_mma_wait(1, deps=[warpgroup_mma(a_s, b_s.permute((1, 0)), acc, is_async=True)])
    acc = warpgroup_mma_wait(0, deps=[acc])
    gl.store(Out + gl.program_id(0), gl.sum(gl.sum(acc, axis=1), axis=0))


@gluon.jit
def _ring_producer(x_desc, xs, ready, empty, iters, KSTEPS: gl.constexpr, STAGES: gl.constexpr, TMA: gl.constexpr):
    """Fills X stage u % STAGES for half step u once it is released: by TMA from an L2-resident X, or (TMA
    False) by an arrival alone, the stage keeping the data stored before the loop."""
    for u in range(iters):
        st = u % STAGES
        mbarrier.wait(empty.index(st), ((u // STAGES) & 1) ^ 1)
        if TMA:
            mbarrier.expect(ready.index(st), x_desc.block_type.nbytes)
            _tma_load(x_desc, [0, (u % KSTEPS) * 64], ready.index(st), xs.index(st))
        else:
            mbarrier.arrive(ready.index(st))


@gluon.jit
def _ring_consumer(xs, ready, empty, Y, iters, tile, BM: gl.constexpr, NW: gl.constexpr, STAGES: gl.constexpr,
                   STORE: gl.constexpr):
    """gemm_gluon_ws._consumer_xring with the codes in registers: per half step wait for X, decode, MMA, wait
    for the one before and release its X stage; drain every four half steps. Every ``tile`` half steps the
    accumulator is written to Y (bf16, this program's rows) and restarts, as a tile's epilogue."""
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    ROWS: gl.constexpr = 16 * NW
    pw, _ = _halves(gl.full([ROWS, 8], 0x3C5A96E1D2B4870F, gl.int64, layout=_codes_layout(ROWS, NW)), ROWS)
    sc, _ = _halves(gl.full([ROWS, 8], 0x38, gl.uint8, layout=_codes_layout(ROWS, NW)), ROWS)
    rows = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, ACC)), 1)
    cols = gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(0, ACC)), 0)
    out = Y + gl.program_id(0) * ROWS * BM + rows * BM + cols
    acc = gl.zeros([ROWS, BM], gl.float32, layout=ACC)
    for t in range(iters // tile):
        acc = gl.zeros([ROWS, BM], gl.float32, layout=ACC)
        prev = gl.zeros([ROWS, 64], gl.bfloat16, layout=DOT)
        for j in range(tile // 4):
            for h in gl.static_range(4):
                u = t * tile + 4 * j + h
                st = u % STAGES
                pw = (pw << 1) | ((pw >> 63) & 1)
                a = _decode_half(pw, sc, ROWS, DOT)
                mbarrier.wait(ready.index(st), (u // STAGES) & 1)
                tok = warpgroup_mma(a, xs.index(st).permute((1, 0)), acc, is_async=True)
                acc, prev = warpgroup_mma_wait(1, deps=[tok, prev])
                mbarrier.arrive(empty.index((u + STAGES - 1) % STAGES), pred=u > 0)
                prev = a
            acc = warpgroup_mma_wait(0, deps=[acc])
        if STORE:
            gl.store(out, acc.to(gl.bfloat16))
    return (gl.sum(gl.sum(acc, axis=1), axis=0),)  # the last tile's: the same in every program


@gluon.jit
def _ring_loop(Out, x_desc, Y, iters, tile, BM: gl.constexpr, NW: gl.constexpr, STAGES: gl.constexpr,
               KSTEPS: gl.constexpr, TMA: gl.constexpr, STORE: gl.constexpr = True):
    """The decode loop fed through a ring of X stages by a producer warpgroup, as the warp-specialised tiles."""
    xs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, 64], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    FILL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    for b in gl.static_range(STAGES):
        mbarrier.init(ready.index(b), count=1)
        mbarrier.init(empty.index(b), count=1)
        xs.index(b).store(gl.full([BM, 64], 0.0078125, gl.bfloat16, layout=FILL))
    fence_async_shared()
    _cta_barrier()
    res = gl.warp_specialize([
        (_ring_consumer, (xs, ready, empty, Y, iters, tile, BM, NW, STAGES, STORE)),
        (_ring_producer, (x_desc, xs, ready, empty, iters, KSTEPS, STAGES, TMA)),
    ], [4], [40])
    gl.store(Out + gl.program_id(0), res[0])


def median_launch_s(run, reps: int = 7) -> float:
    """Median seconds of one launch of ``run`` (after a warm-up launch that compiles it)."""
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def ring_tflops(bm: int, nw: int, stages: int, tma: bool, progs_per_sm: int, iters: int, tile: int = 0,
                waves: int = 1, store: bool = True) -> float:
    """TFLOP/s of the ring-fed loop; with ``tile``, ``waves`` tiles per SM slot either as one program each
    (``waves`` x the grid, ``tile`` half steps per program) or, ``waves`` negative, persistent (one program
    per slot walks -``waves`` tiles)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = sms * progs_per_sm * max(waves, 1)
    if tile:
        iters = tile * (-waves if waves < 0 else 1)
    out = torch.empty(grid, device="cuda", dtype=torch.float32)
    y = torch.empty(grid, 16 * nw * bm, device="cuda", dtype=torch.bfloat16)
    ksteps = 64  # an X of [BM, 4096]: L2-resident, as the tiles' X mostly is
    x = torch.full((bm, 64 * ksteps), 0.0078125, device="cuda", dtype=torch.bfloat16)
    desc = GluonDescriptor.from_tensor(x, [bm, 64], gl.NVMMASharedLayout.get_default_for([bm, 64], gl.bfloat16))

    def run():
        _ring_loop[(grid,)](out, desc, y, iters, tile or iters, BM=bm, NW=nw, STAGES=stages, KSTEPS=ksteps, TMA=tma,
                            STORE=store, num_warps=nw)

    t = median_launch_s(run)
    if not (torch.isfinite(out).all() and (out == out[0]).all()):
        print(f"  wrong sums, ring BM {bm}, {nw} warps, {stages} stages, TMA {tma}: {out[:3].tolist()}", flush=True)
    return 2 * 16 * nw * bm * 64 * iters * grid / t / 1e12


def tflops(bm: int, nw: int, rs: bool, progs_per_sm: int, iters: int, decode: bool = False) -> float:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = sms * progs_per_sm
    out = torch.empty(grid, device="cuda", dtype=torch.float32)

    def run():
        _wgmma_loop[(grid,)](out, iters, BM=bm, NW=nw, RS=rs, DECODE=decode, num_warps=nw)

    t = median_launch_s(run)
    expect = 16 * nw * bm * iters * 64 * 0.0078125 ** 2  # every partial sum is exact in fp32
    # With decode every program sums the same decoded weights: finite and equal across programs.
    ok = (torch.isfinite(out).all() and (out == out[0]).all()) if decode else torch.allclose(
        out, torch.full_like(out, expect), rtol=1e-3)
    if not ok:
        print(f"  wrong sums, BM {bm}, {nw} warps, {progs_per_sm} per SM, decode {decode}: {out[:3].tolist()} "
              f"(expected {expect:.4g})", flush=True)
    return 2 * 16 * nw * bm * 64 * iters * grid / t / 1e12


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bms", default="64,128,256", help="B rows per wgmma (the tiles' tokens, the MMA's N)")
    ap.add_argument("--warps", default="4,8", help="consumer warps per program (4: one warpgroup of 64 rows)")
    ap.add_argument("--progs", default="1,2", help="programs per SM")
    ap.add_argument("--ring-stages", default="", help="also the decode loop fed through a ring of this many "
                    "X stages by a producer warpgroup (e.g. 2,4)")
    ap.add_argument("--tile", type=int, default=0, help="with --ring-stages: also tiles of this many half steps "
                    "(a multiple of 4; 56 = K 3584) with an epilogue each, one program per tile against persistent")
    ap.add_argument("--waves", type=int, default=8, help="tiles per SM slot for --tile")
    ap.add_argument("--iters", type=int, default=20000, help="K = 64 MMA groups per program (a multiple of 4)")
    args = ap.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}", flush=True)
    for bm in map(int, args.bms.split(",")):
        for nw in map(int, args.warps.split(",")):
            for p in map(int, args.progs.split(",")):
                try:
                    rs = tflops(bm, nw, True, p, args.iters)
                    ss = tflops(bm, nw, False, p, args.iters)
                    dec = tflops(bm, nw, True, p, args.iters, decode=True)
                except Exception as e:  # noqa: BLE001 - more programs than the register file holds
                    print(f"BM {bm:3d}, {nw} warps, {p} per SM: {type(e).__name__}", flush=True)
                    continue
                print(f"BM {bm:3d}, {nw} warps, {p} per SM: RS {rs:6.1f}  SS {ss:6.1f}  RS + decode {dec:6.1f} "
                      f"TFLOP/s", flush=True)
                for st in map(int, args.ring_stages.split(",") if args.ring_stages else []):
                    try:
                        r0 = ring_tflops(bm, nw, st, False, p, args.iters)
                        r1 = ring_tflops(bm, nw, st, True, p, args.iters)
                    except Exception as e:  # noqa: BLE001
                        print(f"  ring, {st} stages: {type(e).__name__}", flush=True)
                        continue
                    print(f"  decode fed by a ring of {st} X stages: arrivals only {r0:6.1f}, X by TMA {r1:6.1f} "
                          f"TFLOP/s", flush=True)
                    if args.tile:
                        w = args.waves
                        one = ring_tflops(bm, nw, st, True, p, 0, args.tile, w)
                        per = ring_tflops(bm, nw, st, True, p, 0, args.tile, -w)
                        bare = ring_tflops(bm, nw, st, True, p, 0, args.tile, -w, store=False)
                        print(f"    tiles of {args.tile} half steps, {w} per SM slot: a program each {one:6.1f}, "
                              f"persistent {per:6.1f}, persistent without the store {bare:6.1f} TFLOP/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
