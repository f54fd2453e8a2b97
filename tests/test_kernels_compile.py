"""Every forward tile the table or the sweep can pick compiles for sm_90 on every code layout.

No GPU needed: Triton compiles ahead of time for a ``GPUTarget`` (benchmarks/sass_kernels.py). A
layout-specific compiler crash (one was found for twiddled codes, see ``tile_configs.layout_safe``)
would otherwise only show on a GPU, at the first call with that shape.
"""

from dataclasses import replace

import pytest

pytestmark = pytest.mark.slow  # ~3-5 s per compile on a CPU


ROPE_SIG = {"P": "*i64", "CS": "*fp32", "SLOT": "*i64", "KC": "*bf16", "VC": "*bf16", "NQ": "i32", "NK": "i32"}


def _with_epilogue(sig: dict, consts: dict, pair: int = 0) -> tuple[dict, dict]:
    """A Gluon kernel's signature and constexprs plus its pairing epilogue's (gemm_gluon.pair_mode):
    the rotary epilogue's pointers, or the None a plain or SwiGLU launch leaves them."""
    consts = {**consts, "PAIR": pair, "HD": 64}
    if pair == 2:
        return {**sig, **ROPE_SIG}, consts
    return {**sig, "NQ": "i32", "NK": "i32"}, {**consts, **dict.fromkeys(("P", "CS", "SLOT", "KC", "VC"))}


def _configs():
    from qerl_kernels.tile_configs import FWD_TABLE, fwd_candidates

    seen = {}
    for c in [*(c for m in (1, 32, 64, 256, 1024) for c in fwd_candidates(m)), *FWD_TABLE.values()]:
        if not c.dequant and not c.gluon:
            seen.setdefault((c.bm, c.bn, c.bkw, c.swap, c.join, c.warps, c.stages, c.perm, c.tma), c)
    return list(seen.values())


@pytest.mark.parametrize("layout", ["twiddled", "blocked"])
def test_every_tile_compiles_for_sm90(layout):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from qerl_kernels.tile_configs import layout_safe
    from sass_kernels import compile_fwd

    for c in _configs():
        if not layout_safe(c) or (c.tma and layout != "blocked"):
            continue  # TMA tiles read blocked codes only (gemm_fwd._tma_descriptors)
        compile_fwd(c.bm, c.bn, c.bkw, c.swap, c.join, c.warps, c.stages, True, c.perm, layout == "blocked",
                    tma=c.tma)


def test_gluon_tiles_compile_for_sm90():
    # The Gluon kernel's candidate tiles, through Gluon's ahead-of-time path (no GPU needed).
    import triton
    from qerl_kernels.gemm_gluon import HAVE_GLUON, _nvfp4_fwd_gluon_kernel
    from qerl_kernels.tile_configs import FWD_TABLE, fwd_candidates
    from triton.backends.compiler import GPUTarget

    if not HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    from triton.experimental.gluon._runtime import GluonASTSource

    tiles = {(c.bm, c.bn, c.warps, min(c.split_k, 2)) for c in [*fwd_candidates(1), *fwd_candidates(64),
                                                                 *FWD_TABLE.values()] if c.gluon}
    assert tiles
    sig = {"X": "*bf16", "PW": "*i64", "S": "*u8", "G": "*fp32", "B": "*bf16", "Y": "*bf16", "WS": "*fp32",
           "CNT": "*i32", "M": "i32", "N": "i32", "KG": "i32", "steps_per_split": "i32", "stride_xm": "i32",
           "stride_sn": "i32", "stride_ym": "i32"}
    for bm, bn, warps, split in sorted(tiles):
        sig2, consts = _with_epilogue(sig, dict(BM=bm, BN=bn, SPLIT=split, HAS_BIAS=True, NW=warps))
        src = GluonASTSource(_nvfp4_fwd_gluon_kernel, {**sig2, **{k: "constexpr" for k in consts}}, constexprs=consts)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


def test_gluon_tma_tiles_compile_for_sm90():
    # The TMA-fed Gluon kernel's candidate and table tiles, ahead of time. No table tile that stores its
    # tile directly may spill registers (a spilled accumulator would make a tile silently slow, not wrong;
    # a spilling candidate only loses the sweep). Spills are cuobjdump's STACK bytes (LOCAL, which this
    # checked before 2026-11-25, stays 0 for them). Split-K 2+ and halved grids are not held to it: at BM
    # 256 they spill (328-696 bytes of stack per thread with Triton 3.6 / 3.9, where the same tile at
    # split-K 1 does not), and such tiles still won their points (benchmarks/ptxas_table.py;
    # docs/benchmarks.md, kernels, twentieth pass).
    import triton
    from qerl_kernels.gemm_gluon import HAVE_GLUON
    from qerl_kernels.tile_configs import FWD_TABLE, fwd_candidates
    from triton.backends.compiler import GPUTarget

    if not HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from qerl_kernels.gemm_gluon_tma import (
        _nvfp4_fwd_gluon_tma_kernel,
        _nvfp4_fwd_gluon_tma_sk_kernel,
        x_layout,
    )
    from sass_kernels import resource_usage
    from triton.experimental.gluon._runtime import GluonASTSource

    # split 0: the stream-K kernel (FwdConfig.sk), whose program count is a runtime argument.
    def key(c):
        return (c.bm, c.bn, c.warps, c.stages, c.inflight, 0 if c.sk else min(c.split_k, 2),
                c.halves and not c.sk and c.split_k == 1)

    table = {key(c) for c in FWD_TABLE.values() if c.xtma and not c.ws}
    tiles = table | {key(c) for m in (16, 64, 256) for c in fwd_candidates(m) if c.xtma and not c.ws}
    assert tiles and any(t[-2] == 0 for t in tiles) and any(t[-1] for t in tiles)
    for bm, bn, warps, stages, inflight, split, halves in sorted(tiles):
        sig = {"x_desc": f"tensordesc<bf16[{bm},64],{x_layout(bm)!r}>", "PW": "*i64", "S": "*u8", "G": "*fp32",
               "B": "*bf16", "Y": "*bf16", "WS": "*fp32", "CNT": "*i32", "M": "i32", "N": "i32", "KG": "i32",
               **({"units": "i32", "nprog": "i32"} if split == 0 else {"steps_per_split": "i32", "n_full": "i32"}),
               "stride_sn": "i32", "stride_ym": "i32"}
        consts = dict(BM=bm, BN=bn, HAS_BIAS=True, NW=warps, STAGES=stages, INFLIGHT=inflight,
                      **({} if split == 0 else {"SPLIT": split, "HALVES": halves, "PDL": split == 1}))
        kernel = _nvfp4_fwd_gluon_tma_sk_kernel if split == 0 else _nvfp4_fwd_gluon_tma_kernel
        if split:
            sig, consts = _with_epilogue(sig, consts)
        src = GluonASTSource(kernel, {**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
        kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        if split == 2 or halves or (bm, bn, warps, stages, inflight, split, halves) not in table:
            continue  # see above
        usage = resource_usage(kern)
        # At most a scalar or two (Triton 3.9 keeps 8 bytes of stack for the stream-K BM 256 tile, 3.6 none):
        # an accumulator's spill is hundreds of bytes.
        assert usage["STACK"] <= 16, (bm, bn, warps, stages, split, usage)


def test_gluon_ws_tiles_compile_for_sm90():
    # The warp-specialised Gluon kernel's candidate and table tiles, ahead of time: every register split
    # must be one ptxas can honour (below ~38 registers for the consumer it refuses to compile at all),
    # also with X by TMA (XTMA) where tiles take activations in K order.
    from types import SimpleNamespace

    import triton
    from qerl_kernels.gemm_gluon_ws import HAVE_GLUON_WS, code_layout, duo_consumer_regs, scale_layout
    from qerl_kernels.tile_configs import FWD_TABLE, fwd_candidates
    from triton.backends.compiler import GPUTarget

    if not HAVE_GLUON_WS:
        pytest.skip("this Triton has no Gluon warp specialisation")
    from qerl_kernels.gemm_gluon_tma import x_layout
    from qerl_kernels.gemm_gluon_ws import _nvfp4_fwd_gluon_ws_kernel
    from qerl_kernels.tile_configs import KORDER_FWD
    from triton.experimental.gluon._runtime import GluonASTSource

    def key(c, xtma=False):
        return (c.bm, c.bn, c.warps, c.stages, c.maxnreg, c.pregs, c.half, min(c.split_k, 2),
                c.halves and c.split_k == 1, xtma, c.duo, c.xstages)

    tiles = {key(c, c.xtma) for c in [*(c for m in (1, 16, 32, 64, 128) for c in fwd_candidates(m)),
                                      *FWD_TABLE.values()] if c.ws}
    # X by TMA (activations in K order): the K-order table's tiles, and one half-step split per width.
    tiles |= {key(c, True) for c in KORDER_FWD.values() if c.ws}
    tiles |= {key(c, True) for c in fwd_candidates(16) if c.ws and c.half == 2 and c.maxnreg == 40}
    assert tiles and any(t[-3] for t in tiles) and any(t[-2] for t in tiles) and any(t[-1] for t in tiles)
    for bm, bn, warps, stages, maxnreg, pregs, half, split, halves, xtma, duo, xstages in sorted(tiles):
        x_sig = f"tensordesc<bf16[{bm},64],{x_layout(bm)!r}>" if xtma else "*bf16"
        sig = {"X": x_sig, "c_desc": f"tensordesc<i64[{bn // 16},128],{code_layout()!r}>",
               "s_desc": f"tensordesc<u8[{bn},16],{scale_layout()!r}>", "G": "*fp32", "B": "*bf16", "Y": "*bf16",
               "WS": "*fp32", "CNT": "*i32", "M": "i32", "N": "i32", "KG": "i32", "pairs_per_split": "i32",
               "n_full": "i32", "stride_xm": "i32", "stride_ym": "i32"}
        sig, consts = _with_epilogue(sig, dict(BM=bm, BN=bn, SPLIT=split, HAS_BIAS=True, NW=4 if duo else warps,
                                               STAGES=stages, PREGS=pregs, HALF=half, HALVES=halves))
        creg = duo_consumer_regs(SimpleNamespace(maxnreg=maxnreg, pregs=pregs)) if duo else 0
        consts.update(XTMA=xtma, DUO=duo, CREGS=creg, XSTAGES=xstages, PERSIST=False, YD=None, TSTORE=False, TAIL=False,
                      PDL=xtma)  # an X-by-TMA tile over natural X launches after permute_x with PDL (pdl.py)
        sig["parts"] = "i32"
        src = GluonASTSource(_nvfp4_fwd_gluon_ws_kernel, {**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
        kern = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4 if duo else warps, maxnreg=maxnreg))
        assert "setmaxnreg" in kern.asm["ptx"], (bm, bn, maxnreg, pregs, half)


def test_gluon_pair_tiles_compile_for_sm90():
    # The pairing epilogues of every Gluon tile the table holds for their shapes, in each of the three
    # kernels, ahead of time: SwiGLU (gemm_fwd.nvfp4_swiglu) on gate/up, also in K order, rotary + cache
    # write (gemm_fwd.nvfp4_qkv_rope) on q/k/v, with bias. The kernel arguments are built as the launchers
    # pass them by benchmarks/ptxas_table.gluon_source (duo tiles pair SwiGLU in two partitions).
    import triton
    from qerl_kernels.gemm_gluon import HAVE_GLUON
    from qerl_kernels.tile_configs import FWD_TABLE, fwd_candidates
    from triton.backends.compiler import GPUTarget

    if not HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from ptxas_table import gluon_source
    from sass_kernels import resource_usage

    gate_up, qkv = {37888, 55296}, {4608, 7168}  # SwiGLU (pair 1) and rotary (pair 2) shapes
    jobs = {(c, 1 if n in gate_up else 2) for (m, n, k), c in FWD_TABLE.items()
            if n in gate_up | qkv and c.gluon and not c.sk and (n in gate_up or c.bn <= 128)}
    # The TMA-fed kernel pairs too, though the table (twenty-second pass) no longer holds it on these shapes:
    # its first split-K candidate at M = 256 stands in.
    tma = next(c for c in fwd_candidates(256) if c.gluon and c.xtma and not c.ws and not c.sk and c.bn == 128)
    jobs |= {(tma, 1), (tma, 2)}
    assert {(c.ws, c.xtma, p) for c, p in jobs} >= {(a, b, p) for a, b in ((True, False), (False, True), (False, False))
                                                     for p in (1, 2)} - {(False, False, 1)}
    jobs.add((next(c for c in FWD_TABLE.values() if c.gluon and not c.ws and not c.xtma), 1))  # per-thread SwiGLU
    # SwiGLU written in the MMA's K order (pair 3, for a TMA-fed down projection): one tile per kernel.
    jobs |= {(min((c for c, p in jobs if p == 1 and (c.ws, c.xtma) == kind), key=repr), 3)
             for kind in ((True, False), (False, True), (False, False))}
    for c, pair in sorted(jobs, key=repr):
        src, opts = gluon_source(c, pair)
        kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        if not c.ws and c.split_k == 1 and not c.halves:  # (see test_gluon_tma_tiles_compile_for_sm90)
            assert resource_usage(kern)["STACK"] <= 16, (c, pair)


def test_persistent_duo_tiles_compile_for_sm90():
    # FwdConfig.persist (one program per SM slot walking tiles) on the duo X-ring tiles it is for, at BM 128
    # and 256, plain and with SwiGLU in K order: the persistent kernel compiles, holds its registers (no
    # stack) and issues the same wgmmas as one program per tile; with tstore, its rows leave by TMA; with
    # tail too, the last wave's tiles summed in parts count their arrivals.
    import triton
    from qerl_kernels.gemm_gluon_ws import HAVE_GLUON_WS
    from qerl_kernels.tile_configs import FwdConfig
    from triton.backends.compiler import GPUTarget

    if not HAVE_GLUON_WS:
        pytest.skip("this Triton has no Gluon warp specialisation")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from ptxas_table import gluon_source
    from sass_kernels import resource_usage

    base = FwdConfig(128, 128, 16, warps=8, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=168,
                     pregs=40, half=2, duo=True, xstages=6)
    for c in (base, replace(base, bm=256, xstages=3)):
        for pair in (0, 3):
            kerns = []
            for p, tst, sk in ((0, False, False), (1, False, False), (1, True, False), (1, True, True)):
                src, opts = gluon_source(replace(c, persist=p, tstore=tst, tail=sk), pair)
                kerns.append(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts))
            assert all(resource_usage(k)["STACK"] == 0 for k in kerns[1:]), (c, pair)
            wgmmas = [k.asm["ptx"].count("wgmma.mma_async") for k in kerns]
            # tail (plain tiles) runs the K loop at two sites, the whole waves' and the tail part's, and counts
            # the partials' arrivals
            assert wgmmas[0] == wgmmas[1] == wgmmas[2] > 0, (c, pair, wgmmas)
            assert wgmmas[3] == (2 if pair == 0 else 1) * wgmmas[0], (c, pair, wgmmas)
            assert kerns[3].asm["ptx"].count("atom.") == (4 if pair == 0 else 0), (c, pair)
            # tstore: one TMA store per consumer partition on plain tiles (SwiGLU tiles write through the exchange)
            stores = kerns[2].asm["ptx"].count("cp.async.bulk.tensor.2d.global.shared")
            assert stores == (2 if pair == 0 else 0), (c, pair, stores)


def test_wgmma_probe_loops_compile_for_sm90():
    # benchmarks/probe_wgmma.py's loops (wgmma alone RS and SS, with the register-A decode, and fed through
    # a ring with an epilogue) compile for sm_90 without a stack: what it times is the loop, not spills.
    import triton
    from qerl_kernels.gemm_gluon_ws import HAVE_GLUON_WS
    from triton.backends.compiler import GPUTarget

    if not HAVE_GLUON_WS:
        pytest.skip("this Triton has no Gluon warp specialisation")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from probe_wgmma import _ring_loop, _wgmma_loop
    from qerl_kernels.gemm_gluon_tma import x_layout
    from sass_kernels import resource_usage
    from triton.experimental.gluon._runtime import GluonASTSource

    def build(fn, sig, consts, warps):
        src = GluonASTSource(fn, {**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))

    for rs, dec in ((True, False), (False, False), (True, True)):
        k = build(_wgmma_loop, {"Out": "*fp32", "iters": "i32"}, dict(BM=256, NW=8, RS=rs, DECODE=dec), 8)
        assert resource_usage(k)["STACK"] == 0 and "wgmma.mma_async" in k.asm["ptx"], (rs, dec)
    sig = {"Out": "*fp32", "x_desc": f"tensordesc<bf16[128,64],{x_layout(128)!r}>", "Y": "*bf16", "iters": "i32",
           "tile": "i32"}
    k = build(_ring_loop, sig, dict(BM=128, NW=8, STAGES=4, KSTEPS=64, TMA=True, STORE=True), 8)
    assert resource_usage(k)["STACK"] == 0


def test_pdl_launches_compile_for_sm90():
    # kernels/pdl.py: an X-by-TMA launch after its own permute_x waits for it (griddepcontrol.wait) and
    # loads its first weight stages before that (more TMA loads at the program's start); without PDL the
    # kernel has no wait. The MMAs are the same either way, and permute_x releases its successor early.
    import triton
    from qerl_kernels.gemm_gluon_tma import _permute_x_kernel
    from qerl_kernels.gemm_gluon_ws import HAVE_GLUON_WS
    from qerl_kernels.tile_configs import FWD_TABLE, FwdConfig
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not HAVE_GLUON_WS:
        pytest.skip("this Triton has no Gluon warp specialisation")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from ptxas_table import gluon_source

    duo = FwdConfig(128, 128, 16, warps=8, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=168,
                    pregs=40, half=2, duo=True, xstages=6, persist=1, tstore=True, tail=True)
    ws = next(c for c in FWD_TABLE.values() if c.ws and c.xtma and not c.duo)
    tma = next(c for c in FWD_TABLE.values() if c.gluon and c.xtma and not c.ws and not c.sk)
    for c in (duo, ws, tma):
        ptx = {}
        for pdl in (False, True):
            src, opts = gluon_source(c, 0, pdl)
            ptx[pdl] = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
        assert "griddepcontrol.wait" not in ptx[False] and "griddepcontrol.wait" in ptx[True], c
        assert ptx[True].count("wgmma.mma_async") == ptx[False].count("wgmma.mma_async"), c
        if c.ws:  # the early codes and scales: TMA loads of their own
            assert ptx[True].count("cp.async.bulk.tensor") > ptx[False].count("cp.async.bulk.tensor"), c
    sig = {"X": "*bf16", "XP": "*bf16", "M": "i32", "K": "i32", "stride_xm": "i32", "stride_pm": "i32",
           "BR": "constexpr", "RELEASE": "constexpr"}
    for release in (False, True):
        src = ASTSource(_permute_x_kernel, sig, constexprs={"BR": 16, "RELEASE": release})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        assert ("griddepcontrol.launch_dependents" in ptx) == release
