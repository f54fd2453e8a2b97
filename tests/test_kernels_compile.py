"""Every forward tile the table or the sweep can pick compiles for sm_90 on every code layout.

No GPU needed: Triton compiles ahead of time for a ``GPUTarget`` (benchmarks/sass_kernels.py). A
layout-specific compiler crash (one was found for twiddled codes, see ``tile_configs.layout_safe``)
would otherwise only show on a GPU, at the first call with that shape.
"""

import pytest

pytestmark = pytest.mark.slow  # ~3-5 s per compile on a CPU


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
        consts = dict(BM=bm, BN=bn, SPLIT=split, HAS_BIAS=True, NW=warps)
        src = GluonASTSource(_nvfp4_fwd_gluon_kernel, {**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


def test_gluon_tma_tiles_compile_for_sm90():
    # The TMA-fed Gluon kernel's candidate and table tiles, ahead of time; none may spill registers
    # (a spilled accumulator would make a tile silently slow, not wrong).
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
    tiles = {(c.bm, c.bn, c.warps, c.stages, c.inflight, 0 if c.sk else min(c.split_k, 2),
              c.halves and not c.sk and c.split_k == 1)
             for c in [*(c for m in (16, 64, 256) for c in fwd_candidates(m)), *FWD_TABLE.values()] if c.xtma}
    assert tiles and any(t[-2] == 0 for t in tiles) and any(t[-1] for t in tiles)
    for bm, bn, warps, stages, inflight, split, halves in sorted(tiles):
        sig = {"x_desc": f"tensordesc<bf16[{bm},64],{x_layout(bm)!r}>", "PW": "*i64", "S": "*u8", "G": "*fp32",
               "B": "*bf16", "Y": "*bf16", "WS": "*fp32", "CNT": "*i32", "M": "i32", "N": "i32", "KG": "i32",
               **({"units": "i32", "nprog": "i32"} if split == 0 else {"steps_per_split": "i32", "n_full": "i32"}),
               "stride_sn": "i32", "stride_ym": "i32"}
        consts = dict(BM=bm, BN=bn, HAS_BIAS=True, NW=warps, STAGES=stages, INFLIGHT=inflight,
                      **({} if split == 0 else {"SPLIT": split, "HALVES": halves}))
        kernel = _nvfp4_fwd_gluon_tma_sk_kernel if split == 0 else _nvfp4_fwd_gluon_tma_kernel
        src = GluonASTSource(kernel, {**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
        kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        usage = resource_usage(kern)
        assert usage["LOCAL"] == 0, (bm, bn, warps, stages, split, usage)


def test_gluon_ws_tiles_compile_for_sm90():
    # The warp-specialised Gluon kernel's candidate and table tiles, ahead of time: every register split
    # must be one ptxas can honour (below ~38 registers for the consumer it refuses to compile at all).
    import triton
    from qerl_kernels.gemm_gluon_ws import HAVE_GLUON_WS, code_layout, scale_layout
    from qerl_kernels.tile_configs import FWD_TABLE, fwd_candidates
    from triton.backends.compiler import GPUTarget

    if not HAVE_GLUON_WS:
        pytest.skip("this Triton has no Gluon warp specialisation")
    from qerl_kernels.gemm_gluon_ws import _nvfp4_fwd_gluon_ws_kernel
    from triton.experimental.gluon._runtime import GluonASTSource

    tiles = {(c.bm, c.bn, c.warps, c.stages, c.maxnreg, c.pregs, c.half, min(c.split_k, 2), c.halves and c.split_k == 1)
             for c in [*fwd_candidates(1), *fwd_candidates(16), *fwd_candidates(32), *FWD_TABLE.values()] if c.ws}
    assert tiles
    for bm, bn, warps, stages, maxnreg, pregs, half, split, halves in sorted(tiles):
        sig = {"X": "*bf16", "c_desc": f"tensordesc<i64[{bn // 16},128],{code_layout()!r}>",
               "s_desc": f"tensordesc<u8[{bn},16],{scale_layout()!r}>", "G": "*fp32", "B": "*bf16", "Y": "*bf16",
               "WS": "*fp32", "CNT": "*i32", "M": "i32", "N": "i32", "KG": "i32", "pairs_per_split": "i32",
               "n_full": "i32", "stride_xm": "i32", "stride_ym": "i32"}
        consts = dict(BM=bm, BN=bn, SPLIT=split, HAS_BIAS=True, NW=warps, STAGES=stages, PREGS=pregs, HALF=half,
                      HALVES=halves)
        src = GluonASTSource(_nvfp4_fwd_gluon_ws_kernel, {**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
        kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, maxnreg=maxnreg))
        assert "setmaxnreg" in kern.asm["ptx"], (bm, bn, maxnreg, pregs, half)


def test_gluon_pair_tiles_compile_for_sm90():
    # The gate/up pairing (SwiGLU in the epilogue, gemm_fwd.nvfp4_swiglu) of every Gluon tile the table
    # holds for a gate/up shape (N = 2 x intermediate), in each of the three kernels, ahead of time.
    import triton
    from qerl_kernels.gemm_gluon import HAVE_GLUON, _nvfp4_fwd_gluon_kernel
    from qerl_kernels.tile_configs import FWD_TABLE
    from triton.backends.compiler import GPUTarget

    if not HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    from qerl_kernels.gemm_gluon_tma import _nvfp4_fwd_gluon_tma_kernel, x_layout
    from qerl_kernels.gemm_gluon_ws import _nvfp4_fwd_gluon_ws_kernel, code_layout, scale_layout
    from triton.experimental.gluon._runtime import GluonASTSource

    gate_up = {37888, 55296}
    cfgs = {c for (m, n, k), c in FWD_TABLE.items() if n in gate_up and c.gluon and not c.sk}
    cfgs.add(next(c for c in FWD_TABLE.values() if c.gluon and not c.ws and not c.xtma))  # a per-thread tile too
    assert any(c.ws for c in cfgs) and any(c.xtma for c in cfgs)
    ptrs = {"G": "*fp32", "B": "*bf16", "Y": "*bf16", "WS": "*fp32", "CNT": "*i32", "M": "i32", "N": "i32", "KG": "i32"}
    for c in sorted(cfgs, key=repr):
        consts = dict(BM=c.bm, BN=c.bn, SPLIT=min(c.split_k, 2), HAS_BIAS=False, NW=c.warps, PAIR=True)
        opts = dict(num_warps=c.warps)
        if c.ws:
            kernel = _nvfp4_fwd_gluon_ws_kernel
            sig = {"X": "*bf16", "c_desc": f"tensordesc<i64[{c.bn // 32},128],{code_layout()!r}>",
                   "s_desc": f"tensordesc<u8[{c.bn // 2},16],{scale_layout()!r}>", **ptrs, "pairs_per_split": "i32",
                   "n_full": "i32", "stride_xm": "i32", "stride_ym": "i32"}
            consts.update(STAGES=c.stages, PREGS=c.pregs, HALF=c.half, HALVES=c.halves)
            opts["maxnreg"] = c.maxnreg
        elif c.xtma:
            kernel = _nvfp4_fwd_gluon_tma_kernel
            sig = {"x_desc": f"tensordesc<bf16[{c.bm},64],{x_layout(c.bm)!r}>", "PW": "*i64", "S": "*u8", **ptrs,
                   "steps_per_split": "i32", "n_full": "i32", "stride_sn": "i32", "stride_ym": "i32"}
            consts.update(STAGES=max(2, c.stages), INFLIGHT=c.inflight, HALVES=c.halves)
        else:
            kernel = _nvfp4_fwd_gluon_kernel
            sig = {"X": "*bf16", "PW": "*i64", "S": "*u8", **ptrs, "steps_per_split": "i32", "stride_xm": "i32",
                   "stride_sn": "i32", "stride_ym": "i32"}
        src = GluonASTSource(kernel, {**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
