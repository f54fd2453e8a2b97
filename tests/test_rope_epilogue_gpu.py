"""The rotary embedding and the paged-cache write in the NVFP4 q/k/v GEMM's epilogue
(``gemm_fwd.nvfp4_qkv_rope``) against the GEMM followed by ``layers.fused.rope_``, for every Gluon
kernel, split and halved launch; the engine's samples with it on and off."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from qerl_kernels.testing import gluon_pairing_configs

pytestmark = pytest.mark.gpu

HEAD, HQ, HK, K = 128, 4, 2, 1280  # q 512 + k 256 + v 256 rows; K = 5 ring pairs of the warp-specialised kernel
BLOCKS, BLOCK, MAX_POS = 16, 16, 4096


def _case(m: int, seed: int):
    """x, the weights, bias, positions, distinct cache slots and the rotary table of one q/k/v GEMM."""
    from qerl_kernels.testing import random_nvfp4
    from qerl_kernels.twiddle import to_kernel_layout

    from qerl_cli.layers.rotary import RotaryEmbedding

    n = (HQ + 2 * HK) * HEAD
    p, s, g = random_nvfp4(n, K, seed=seed, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    positions = torch.randint(0, MAX_POS, (m,), device="cuda", generator=gen)
    slots = torch.randperm(BLOCKS * BLOCK, device="cuda", generator=gen)[:m]
    cos_sin = RotaryEmbedding(HEAD, MAX_POS, 1e6, device="cuda").cos_sin
    return x, to_kernel_layout(p, True), s, g, bias, positions, slots, cos_sin


def _caches():
    return [torch.zeros(BLOCKS, BLOCK, HK, HEAD, device="cuda", dtype=torch.bfloat16) for _ in range(2)]


def _two_kernels(x, tp, s, g, bias, positions, slots, cos_sin, cfg):
    """The path the epilogue replaces: the GEMM, then the rotary + cache write kernel."""
    from qerl_kernels.gemm_fwd import nvfp4_matmul

    from qerl_cli.layers import fused

    kc, vc = _caches()
    y = nvfp4_matmul(x, tp, s, g, bias=bias, config=cfg, twiddled=True, blocked=True)
    q, k, v = (t.view(x.shape[0], -1, HEAD) for t in y.split([HQ * HEAD, HK * HEAD, HK * HEAD], dim=-1))
    fused.rope_(q, k, positions, cos_sin, cache=(v, kc, vc, slots))
    return y, kc, vc


def _epilogue(x, tp, s, g, bias, positions, slots, cos_sin, cfg):
    from qerl_kernels.gemm_fwd import nvfp4_qkv_rope
    from qerl_kernels.gemm_gluon import RopeEpilogue

    kc, vc = _caches()
    rope = RopeEpilogue(positions, cos_sin, slots, kc, vc, HQ * HEAD, HK * HEAD, HEAD)
    y = nvfp4_qkv_rope(x, tp, s, g, bias, rope, config=cfg, twiddled=True, blocked=True)
    return y, kc, vc


def assert_same(got, want, exact: bool, what):
    """Bit-identical (exact), or at most one bf16 step apart on under 1% of the elements (a halved
    launch's other K split, gemm_fwd.nvfp4_qkv_rope)."""
    for a, b in zip(got, want):
        if exact:
            assert torch.equal(a, b), what
        else:
            diff = (a.float() - b.float()).abs()
            assert (diff > 0).float().mean() < 0.01, what
            assert (diff <= b.float().abs() * 2.0 ** -7 + 1e-6).all(), what


@pytest.mark.parametrize("m", [3, 16, 40])
def test_rope_epilogue_equals_gemm_then_rope(m):
    # q and k rotated at each token's position, k and v in the caches at its slot, with the q/k/v bias;
    # every Gluon kernel, with and without split-K: the same bits as the GEMM + rotary kernel.
    case = _case(m, seed=m + 201)
    for cfg in gluon_pairing_configs(m)[0]:
        got = _epilogue(*case, cfg)
        assert got[0] is not None, cfg
        assert_same(got, _two_kernels(*case, cfg), True, cfg)


@pytest.mark.parametrize("m", [1, 100])
def test_rope_epilogue_halved_launches(m, monkeypatch):
    from qerl_kernels import gemm_gluon

    case = _case(m, seed=m + 203)
    asked = []  # the forced rule was consulted: the launch did halve
    monkeypatch.setattr(gemm_gluon, "halves_split", lambda tiles, sms: asked.append(tiles) or 3)
    cfgs = gluon_pairing_configs(m)[1]
    for cfg in cfgs:
        got = _epilogue(*case, cfg)
        assert asked, cfg
        asked.clear()
        assert_same(got, _two_kernels(*case, cfg), False, cfg)


def test_rope_epilogue_declines_what_it_cannot_pair():
    # BN 256 tiles straddle a head's halves; BM 256 (slower than two kernels); mismatched layouts; a Triton
    # tile: None (the two kernels run).
    from qerl_kernels.gemm_fwd import nvfp4_qkv_rope
    from qerl_kernels.gemm_gluon import RopeEpilogue
    from qerl_kernels.tile_configs import FwdConfig

    x, tp, s, g, bias, positions, slots, cos_sin = _case(16, seed=9)
    kc, vc = _caches()
    ok = FwdConfig(16, 64, 16, split_k=2, warps=4, swap=True, gluon=True)
    rope = RopeEpilogue(positions, cos_sin, slots, kc, vc, HQ * HEAD, HK * HEAD, HEAD)
    assert nvfp4_qkv_rope(x, tp, s, g, bias, rope, config=ok, twiddled=True, blocked=True) is not None
    for cfg, r in ((replace(ok, bn=256, warps=8), rope), (FwdConfig(16, 128, 16, swap=True), rope), (replace(ok, bm=256), rope),
                   (ok, replace(rope, nq=HQ * HEAD - 64)), (ok, replace(rope, slots=slots[:-1])),
                   (ok, replace(rope, cos_sin=cos_sin.to(torch.bfloat16)))):
        assert nvfp4_qkv_rope(x, tp, s, g, bias, r, config=cfg, twiddled=True, blocked=True) is None, (cfg, r.nq)


def test_engine_samples_with_rope_epilogue_on_and_off(tmp_path, monkeypatch):
    # A tiny NVFP4 model with 64-dim heads (q/k/v 256 x 128: the per-thread Gluon tile, 32 dims of a
    # head's halves per tile) in the graph engine: decode takes the epilogue; same samples.
    from qerl_cli.layers.linear import QLinear
    from tests.helpers import assert_engine_switch_keeps_samples

    assert_engine_switch_keeps_samples(tmp_path, monkeypatch, "QERL_ROPE_EPILOGUE", QLinear, "qkv_rope", seed=13,
                                       hidden=128, heads=2, kv_heads=1, intermediate=256)
