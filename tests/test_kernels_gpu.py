"""The Triton kernels on a CUDA GPU in bf16 (the fast sm_90 decode) and fp16, against fp64."""

import pytest
import torch
from qerl_kernels.testing import TOL, grad_check, run_case
from qerl_kernels.tile_configs import bwd_candidates, fwd_candidates

pytestmark = pytest.mark.gpu

SHAPES = [(1, 72, 96), (3, 200, 272), (17, 1000, 528), (100, 384, 1040), (1000, 520, 336)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_forward_default_config(m, n, k, dtype):
    for bias in (False, True):
        err = run_case("fwd", m, n, k, dtype, None, bias, device="cuda", seed=m + n)
        assert err < TOL[getattr(torch, dtype)], (m, n, k, dtype, bias, err)


@pytest.mark.parametrize("m", [1, 64, 128, 1024])
def test_forward_every_sweep_candidate(m):
    # Every config the benchmark may put in the table must be right, split-K variants included.
    for cfg in fwd_candidates(m):
        if cfg.gluon:  # refused on these on-disk codes (not what Gluon reads); test_gluon_* run them on theirs
            continue
        for split in (1, 3):
            d = {**cfg.as_dict(), "split_k": split}
            err = run_case("fwd", m, 264, 784, "bfloat16", d, True, device="cuda", seed=split)
            assert err < TOL[torch.bfloat16], (d, err)


@pytest.mark.parametrize("m,n,k", [(3, 200, 272), (100, 384, 1040), (1000, 520, 336), (2048, 256, 512)])
def test_grad_input(m, n, k):
    for dtype in ("bfloat16", "float16"):
        err = run_case("bwd", m, n, k, dtype, None, False, device="cuda", seed=k)
        assert err < TOL[getattr(torch, dtype)], (m, n, k, dtype, err)
    for cfg in bwd_candidates():
        err = run_case("bwd", m, n, k, "bfloat16", cfg.as_dict(), False, device="cuda", seed=1)
        assert err < TOL[torch.bfloat16], (cfg, err)


def test_portable_decode_on_gpu_in_bf16():
    err = run_case("fwd", 17, 200, 272, "bfloat16", None, True, device="cuda", fast=False)
    assert err < TOL[torch.bfloat16], err


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dequantize_kernel(dtype):
    err = run_case("deq", 0, 1000, 784, dtype, None, False, device="cuda")
    assert err < {"bfloat16": 4e-3, "float16": 5e-4, "float32": 1e-7}[dtype], err


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_autograd_through_kernels(dtype):
    res = grad_check(37, 200, 272, dtype, device="cuda")
    tol = TOL[getattr(torch, dtype)]
    assert res["y"] < tol and res["dx"] < tol and res["db"] < tol, res


def test_split_k_is_deterministic_and_reusable():
    from qerl_kernels.gemm_fwd import nvfp4_matmul
    from qerl_kernels.testing import random_nvfp4
    from qerl_kernels.tile_configs import FwdConfig

    p, s, g = random_nvfp4(3584, 3584, seed=9, device="cuda")
    x = torch.randn(4, 3584, device="cuda", dtype=torch.bfloat16)
    cfg = FwdConfig(16, 64, 16, split_k=8, warps=2, swap=True)
    ys = [nvfp4_matmul(x, p, s, g, config=cfg) for _ in range(5)]
    assert all(torch.equal(ys[0], y) for y in ys[1:])


@pytest.mark.parametrize("m", [1, 64, 128])
@pytest.mark.parametrize("n,k,blocked", [(264, 784, False), (256, 768, True)])
def test_twiddled_layout_every_candidate(m, n, k, blocked):
    # The load-time layout (twiddle.py) through every table candidate: bit-identical to the on-disk
    # layout's result (same products, same accumulation order), which test_forward_every_sweep_candidate
    # checks against fp64. K = 784 (98 words, not 16-aligned) once broke a pack=2 word pairing.
    from qerl_kernels.gemm_fwd import nvfp4_matmul
    from qerl_kernels.testing import random_nvfp4
    from qerl_kernels.tile_configs import FwdConfig
    from qerl_kernels.twiddle import to_kernel_layout

    p, s, g = random_nvfp4(n, k, seed=m, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    tp = to_kernel_layout(p, blocked)
    from qerl_kernels.tile_configs import layout_safe

    for cfg in fwd_candidates(m):
        if not layout_safe(cfg) or cfg.gluon:
            continue  # runs as decode-once + cuBLAS / Gluon reads blocked codes only: not bit-comparable
        for split in (1, 3):
            d = {**cfg.as_dict(), "split_k": split}
            a = nvfp4_matmul(x, p, s, g, config=FwdConfig(**d))
            b = nvfp4_matmul(x, tp, s, g, config=FwdConfig(**d), twiddled=True, blocked=blocked)
            assert torch.equal(a, b), d


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_twiddled_default_configs_dequant_grad_input_and_autograd(dtype):
    tol = TOL[getattr(torch, dtype)]
    for m, n, k in SHAPES:
        err = run_case("fwd", m, n, k, dtype, {"twiddled": True}, True, device="cuda", seed=m)
        assert err < tol, (m, n, k, err)
    assert run_case("deq", 0, 1000, 784, dtype, {"twiddled": True}, False, device="cuda") < 4e-3
    assert run_case("bwd", 100, 384, 1040, dtype, {"twiddled": True}, False, device="cuda") < tol
    res = grad_check(37, 200, 272, dtype, device="cuda", twiddled=True)
    assert res["y"] < tol and res["dx"] < tol and res["db"] < tol, res
    for m, n, k in [(1, 256, 768), (16, 1024, 512), (300, 128, 1024)]:
        assert run_case("fwd", m, n, k, dtype, {"twiddled": True, "blocked": True}, True, device="cuda") < tol
    assert run_case("deq", 0, 1024, 768, dtype, {"twiddled": True, "blocked": True}, False, device="cuda") < 4e-3
    res = grad_check(37, 256, 256, dtype, device="cuda", twiddled=True, blocked=True)
    assert res["y"] < tol and res["dx"] < tol and res["db"] < tol, res


@pytest.mark.parametrize("m", [1, 3, 17, 100])
def test_tma_tiles_match_pointer_loads(m):
    # TMA boxes zero-fill past M, N and K where the pointer path masks or wraps: bit-identical
    # results on a shape with partial tiles in both M and N (N = 272 is 2 x 128 + 16).
    from dataclasses import replace

    from qerl_kernels.gemm_fwd import nvfp4_matmul
    from qerl_kernels.testing import random_nvfp4, reference_fwd, rel_err
    from qerl_kernels.tile_configs import FwdConfig
    from qerl_kernels.twiddle import to_kernel_layout

    n, k = 272, 896
    p, s, g = random_nvfp4(n, k, seed=m + 5, device="cuda")
    tp = to_kernel_layout(p, True)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = reference_fwd(x, p, s, g)
    tiles = [c for mm in (1, 64, 256) for c in fwd_candidates(mm) if c.tma]
    tiles.append(FwdConfig(16, 128, 16, warps=4, stages=3, swap=True, perm=True, tma=True))
    assert tiles
    for cfg in tiles:
        for split in (1, 3):
            c = replace(cfg, split_k=split)
            y = nvfp4_matmul(x, tp, s, g, config=c, twiddled=True, blocked=True)
            y0 = nvfp4_matmul(x, tp, s, g, config=replace(c, tma=False), twiddled=True, blocked=True)
            assert torch.equal(y, y0), c
            assert rel_err(y, ref) < TOL[torch.bfloat16], c


def _gluon_case(m: int, seed: int, k: int = 1152):
    """A blocked, twiddled NVFP4 weight [400, k] (partial 128-row tiles), bf16 X [m, k], bias,
    and the reference output: what the Gluon kernel tests share."""
    from qerl_kernels.testing import random_nvfp4, reference_fwd
    from qerl_kernels.twiddle import to_kernel_layout

    n = 400
    p, s, g = random_nvfp4(n, k, seed=seed, device="cuda")
    tp = to_kernel_layout(p, True)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    return p, s, g, tp, x, bias, reference_fwd(x, p, s, g, bias)


@pytest.mark.parametrize("m", [1, 3, 16, 17, 40, 64])
def test_gluon_kernel_matches_reference(m):
    # The Gluon small-M kernel on blocked twiddled codes, partial M and N tiles
    # (N = 400 = 3 x 128 + 16), with and without split-K, with bias; directly and through the
    # GEMM's dispatch (a ``gluon`` config), which must give the same bits.
    from types import SimpleNamespace

    from qerl_kernels.gemm_fwd import nvfp4_matmul
    from qerl_kernels.gemm_gluon import HAVE_GLUON, launch_gluon
    from qerl_kernels.testing import rel_err
    from qerl_kernels.tile_configs import FwdConfig

    assert HAVE_GLUON
    p, s, g, tp, x, bias, ref = _gluon_case(m, seed=m + 11)
    groups, scale_u8 = tp.view(torch.int64), s.view(torch.uint8)
    bm = max(8, 1 << (m - 1).bit_length())
    for bn, warps in ((64, 4), (128, 4), (128, 8), (256, 8)):
        for split in (1, 4):
            cfg = SimpleNamespace(bm=bm, bn=bn, split_k=split, warps=warps)
            y = launch_gluon(x, groups, scale_u8, g, bias, cfg)
            assert rel_err(y, ref) < TOL[torch.bfloat16], (cfg, rel_err(y, ref))
            fc = FwdConfig(bm, bn, 16, split_k=split, warps=warps, swap=True, gluon=True)
            assert torch.equal(nvfp4_matmul(x, tp, s, g, bias=bias, config=fc, twiddled=True, blocked=True), y)
    # Not blocked (QERL_TWIDDLE=0, or a shape that does not tile): the table's gluon entries fall back to
    # Triton; a caller's explicit Gluon tile is refused rather than run as another tile under its name.
    assert rel_err(nvfp4_matmul(x, p, s, g, bias=bias), ref) < TOL[torch.bfloat16]
    fc = FwdConfig(bm, 64, 16, split_k=2, warps=4, swap=True, gluon=True)
    with pytest.raises(ValueError, match="not in the twiddled"):
        nvfp4_matmul(x, p, s, g, bias=bias, config=fc)


@pytest.mark.parametrize("m,bm", [(1, 8), (3, 8), (16, 16), (17, 16), (32, 32), (40, 32)])
def test_gluon_ws_kernel_matches_reference(m, bm):
    # The warp-specialised kernel: K = 1280 is 5 ring stages of two K steps (an odd count, so split-K 2
    # cuts 3 + 2 and split 3 cuts 2 + 2 + 1), N = 400 leaves a partial 64-row tile whose missing rows
    # TMA zero-fills, M past one row tile, bias; every register split and MMA mode of the candidates;
    # through the GEMM's dispatch, bit-identical to the direct launch. K = 1152 (not whole pairs) falls
    # back to the per-thread kernel.
    from types import SimpleNamespace

    from qerl_kernels.gemm_fwd import nvfp4_matmul
    from qerl_kernels.gemm_gluon import launch_gluon
    from qerl_kernels.gemm_gluon_ws import HAVE_GLUON_WS, launch_gluon_ws
    from qerl_kernels.testing import rel_err
    from qerl_kernels.tile_configs import FwdConfig, _gluon_ws_candidates

    assert HAVE_GLUON_WS
    p, s, g, tp, x, bias, ref = _gluon_case(m, seed=m + 31, k=1280)
    groups, scale_u8 = tp.view(torch.int64), s.view(torch.uint8)
    for split in (1, 2, 3):
        for c in _gluon_ws_candidates(bm):  # BN 64 (one consumer warpgroup) and 128 (two)
            cfg = SimpleNamespace(**{**vars(c), "split_k": split})
            y = launch_gluon_ws(x, groups, scale_u8, g, bias, cfg)
            assert rel_err(y, ref) < TOL[torch.bfloat16], (vars(cfg), rel_err(y, ref))
    fc = FwdConfig(bm, 64, 16, split_k=2, warps=4, stages=3, swap=True, gluon=True, ws=True, maxnreg=48, pregs=32,
                   half=2)
    y = nvfp4_matmul(x, tp, s, g, bias=bias, config=fc, twiddled=True, blocked=True)
    assert torch.equal(y, launch_gluon_ws(x, groups, scale_u8, g, bias, fc))
    p, s, g, tp, x, bias, ref = _gluon_case(m, seed=m + 37)
    y = nvfp4_matmul(x, tp, s, g, bias=bias, config=fc, twiddled=True, blocked=True)
    assert torch.equal(y, launch_gluon(x, tp.view(torch.int64), s.view(torch.uint8), g, bias, fc))


@pytest.mark.parametrize("m", [1, 16, 17])
def test_gluon_ws_halves_match_reference(m, monkeypatch):
    # A wave's last tiles as two K halves (FwdConfig.halves): 3 of N = 400's 7 tiles whole, 4 halved; K =
    # 1280 is 5 pairs, so the halves run 3 + 2. halves_split is forced (the real rule needs hundreds of
    # tiles); every candidate's register split and MMA mode; the halved launch agrees with the plain one.
    from types import SimpleNamespace

    from qerl_kernels import gemm_gluon, gemm_gluon_ws
    from qerl_kernels.testing import rel_err
    from qerl_kernels.tile_configs import _gluon_ws_candidates

    p, s, g, tp, x, bias, ref = _gluon_case(m, seed=m + 41, k=1280)
    groups, scale_u8 = tp.view(torch.int64), s.view(torch.uint8)
    asked = []  # the forced rule was consulted: the launch did halve
    monkeypatch.setattr(gemm_gluon, "halves_split", lambda tiles, sms: asked.append(tiles) or 3)
    for c in _gluon_ws_candidates(8 if m <= 8 else 16):
        cfg = SimpleNamespace(**{**vars(c), "split_k": 1, "halves": True})
        y = gemm_gluon_ws.launch_gluon_ws(x, groups, scale_u8, g, bias, cfg)
        assert asked, vars(cfg)
        asked.clear()
        assert rel_err(y, ref) < TOL[torch.bfloat16], (vars(cfg), rel_err(y, ref))
        plain = gemm_gluon_ws.launch_gluon_ws(x, groups, scale_u8, g, bias, SimpleNamespace(**{**vars(cfg), "halves": False}))
        assert rel_err(y, plain) < 1e-2


@pytest.mark.parametrize("m", [17, 64, 100])
def test_gluon_tma_halves_match_reference(m, monkeypatch):
    # The TMA-fed kernel with a wave's last tiles halved (FwdConfig.halves): halves_split forced to 3
    # whole tiles (of 7 per row tile at N = 400; M = 100 at BM 64 has two row tiles, so 11 of 14 halved),
    # K = 1280 is 10 steps, so 5 + 5; BN 64 and 128; agrees with the plain split-K grid.
    from types import SimpleNamespace

    from qerl_kernels import gemm_gluon, gemm_gluon_tma
    from qerl_kernels.testing import rel_err

    p, s, g, tp, x, bias, ref = _gluon_case(m, seed=m + 43, k=1280)
    groups, scale_u8 = tp.view(torch.int64), s.view(torch.uint8)
    bm = 64 if m > 32 else 32
    asked = []  # the forced rule was consulted: the launch did halve
    for bn, warps in ((64, 4), (128, 8)):
        cfg = SimpleNamespace(bm=bm, bn=bn, split_k=1, warps=warps, stages=3, inflight=True, sk=0, halves=True)
        plain = gemm_gluon_tma.launch_gluon_tma(x, groups, scale_u8, g, bias, cfg)  # the real rule: no halving here
        monkeypatch.setattr(gemm_gluon, "halves_split", lambda tiles, sms: asked.append(tiles) or 3)
        y = gemm_gluon_tma.launch_gluon_tma(x, groups, scale_u8, g, bias, cfg)
        monkeypatch.undo()
        assert asked, bn
        asked.clear()
        assert rel_err(y, ref) < TOL[torch.bfloat16], (bn, rel_err(y, ref))
        assert rel_err(y, plain) < 1e-2


@pytest.mark.parametrize("m", [1, 17, 64, 100, 256])
def test_gluon_tma_kernel_matches_reference(m):
    # The TMA-fed Gluon kernel (X permuted once, streamed by TMA; half-step MMAs, with and without one
    # in flight): partial M tiles (TMA zero-fills rows past M) and N tiles (N = 400), split-K, bias,
    # ring depths 2-4; through the GEMM's dispatch, bit-identical to the direct launch.
    from types import SimpleNamespace

    from qerl_kernels.gemm_fwd import nvfp4_matmul
    from qerl_kernels.gemm_gluon_tma import HAVE_GLUON_TMA, launch_gluon_tma
    from qerl_kernels.testing import reference_fwd, rel_err
    from qerl_kernels.tile_configs import FwdConfig

    assert HAVE_GLUON_TMA
    p, s, g, tp, x, bias, ref = _gluon_case(m, seed=m + 23)
    groups, scale_u8 = tp.view(torch.int64), s.view(torch.uint8)
    for bm in {min(128, max(16, 1 << (m - 1).bit_length())), 64, 256}:  # 256: the M >= 256 table tiles
        for bn, warps in ((64, 4), (128, 8), (256, 8)):
            if bm * bn > 128 * 256:
                continue  # accumulator past the register file (not a candidate)
            for split, stages, inflight in ((1, 2, True), (1, 4, False), (3, 3, True)):
                stages = min(stages, 3) if bm == 256 else stages  # the X ring within shared memory
                cfg = SimpleNamespace(bm=bm, bn=bn, split_k=split, warps=warps, stages=stages, inflight=inflight)
                y = launch_gluon_tma(x, groups, scale_u8, g, bias, cfg)
                assert rel_err(y, ref) < TOL[torch.bfloat16], (cfg, rel_err(y, ref))
        fc = FwdConfig(bm, 128, 16, split_k=2, warps=8, stages=3, swap=True, gluon=True, xtma=True, inflight=True)
        y = nvfp4_matmul(x, tp, s, g, bias=bias, config=fc, twiddled=True, blocked=True)
        assert torch.equal(y, launch_gluon_tma(x, groups, scale_u8, g, bias, fc))
    # X with a row stride TMA could not use: the permutation pass writes a contiguous copy anyway.
    k = x.shape[1]
    xs = torch.randn(m, k + 1, device="cuda", dtype=torch.bfloat16)[:, :k]
    y = nvfp4_matmul(xs, tp, s, g, bias=bias, config=fc, twiddled=True, blocked=True)
    assert rel_err(y, reference_fwd(xs, p, s, g, bias)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("m", [1, 17, 64, 100, 256])
def test_gluon_tma_streamk_matches_reference(m):
    # Stream-K: programs share the (tile, K step) pairs in equal ranges, so tiles are cut at arbitrary
    # K steps, some by three or more programs (here K = 1152 is 9 steps per tile and the program
    # counts are odd), and one program walks several tiles (the X ring's phases carry over). Every
    # count must give the reference; the arrival counters must be left zero; the GEMM's dispatch of an
    # ``sk`` config must give the same bits as the direct launch.
    from types import SimpleNamespace

    from qerl_kernels.gemm_fwd import arrival_counters, nvfp4_matmul
    from qerl_kernels.gemm_gluon_tma import HAVE_GLUON_TMA, launch_gluon_tma
    from qerl_kernels.testing import rel_err
    from qerl_kernels.tile_configs import FwdConfig

    assert HAVE_GLUON_TMA
    p, s, g, tp, x, bias, ref = _gluon_case(m, seed=m + 31)
    groups, scale_u8 = tp.view(torch.int64), s.view(torch.uint8)
    bm = min(128, max(16, 1 << (m - 1).bit_length()))
    for bn, warps in ((64, 4), (128, 8)):
        tiles = -(-m // bm) * -(-400 // bn)
        for programs in sorted({1, 2, 5, 7, 13, tiles * 9 - 1, tiles * 9, tiles * 9 + 5}):
            for stages, inflight in ((2, True), (3, False)):
                cfg = SimpleNamespace(bm=bm, bn=bn, split_k=1, warps=warps, stages=stages, inflight=inflight, sk=1)
                y = launch_gluon_tma(x, groups, scale_u8, g, bias, cfg, programs=programs)
                assert rel_err(y, ref) < TOL[torch.bfloat16], (cfg, programs, rel_err(y, ref))
                again = launch_gluon_tma(x, groups, scale_u8, g, bias, cfg, programs=programs)
                assert torch.equal(y, again)  # partials summed in program order: deterministic
    assert int(arrival_counters(x.device).abs().sum()) == 0
    fc = FwdConfig(bm, 64, 16, warps=4, stages=3, swap=True, gluon=True, xtma=True, inflight=True, sk=2)
    y = nvfp4_matmul(x, tp, s, g, bias=bias, config=fc, twiddled=True, blocked=True)
    assert torch.equal(y, launch_gluon_tma(x, groups, scale_u8, g, bias, fc))
    assert rel_err(y, ref) < TOL[torch.bfloat16]


def test_qerl_gluon_0_swaps_gluon_tiles_for_triton(monkeypatch):
    # QERL_GLUON=0: a Gluon table entry (either kernel) runs the heuristic Triton tile instead.
    from qerl_kernels.gemm_fwd import nvfp4_matmul
    from qerl_kernels.testing import rel_err
    from qerl_kernels.tile_configs import FwdConfig, heuristic_fwd

    p, s, g, tp, x, bias, ref = _gluon_case(64, seed=5)
    triton_y = nvfp4_matmul(x, tp, s, g, bias=bias, config=heuristic_fwd(64, 400, 1152), twiddled=True, blocked=True)
    for fc in (FwdConfig(64, 64, 16, warps=4, swap=True, gluon=True),
               FwdConfig(64, 64, 16, warps=4, stages=3, swap=True, gluon=True, xtma=True, inflight=True)):
        y_on = nvfp4_matmul(x, tp, s, g, bias=bias, config=fc, twiddled=True, blocked=True)
        monkeypatch.setenv("QERL_GLUON", "0")
        y_off = nvfp4_matmul(x, tp, s, g, bias=bias, config=fc, twiddled=True, blocked=True)
        monkeypatch.delenv("QERL_GLUON")
        assert torch.equal(y_off, triton_y)
        assert not torch.equal(y_on, triton_y)  # the Gluon kernel's own rounding: it did run before
        assert rel_err(y_on, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_double_backward_and_nan_scales_on_gpu(dtype):
    # The kernels' grad-input had no autograd history: a gradient penalty silently lost the term; the
    # portable e4m3 decode (fp16 here) read the NaN scale byte as 480 (2026-11-26 audit).
    from qerl_kernels import ops
    from qerl_kernels import reference as R

    g = torch.Generator().manual_seed(5)
    w = torch.randn(200, 272, generator=g) * 0.05  # the second derivative scales as w^4: keep it in fp16's range
    gs = R.global_scale_for(w.abs().amax())
    p, sc = (t.cuda() for t in R.quantize(w, gs)[:2])
    gs = gs.cuda()
    wt = ops.NVFP4Weight(p, sc, gs)
    wd = R.dequantize(p, sc, gs, torch.float64)
    x0 = torch.randn(37, 272, generator=g, dtype=torch.float64).cuda()
    x = x0.to(dtype).requires_grad_()
    gx = torch.autograd.grad((ops.nvfp4_linear(x, wt).float() ** 2).sum(), x, create_graph=True)[0]
    (gx.float() ** 2).sum().backward()
    xr = x.detach().double().requires_grad_()
    gr = torch.autograd.grad(((xr @ wd.t()) ** 2).sum(), xr, create_graph=True)[0]
    (gr ** 2).sum().backward()
    assert (x.grad.double() - xr.grad).norm() / xr.grad.norm() < 3e-2
    bad = sc.clone()
    bad.view(torch.uint8)[7, 2] = 0x7F
    y = ops.nvfp4_linear(x0.to(dtype), ops.NVFP4Weight(p, bad, gs))
    assert y[:, 7].isnan().all() and y[:, torch.arange(200, device=y.device) != 7].isfinite().all()
