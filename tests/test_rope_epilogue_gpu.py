"""The rotary embedding and the paged-cache write in the NVFP4 q/k/v GEMM's epilogue
(``gemm_fwd.nvfp4_qkv_rope``) against the GEMM followed by ``layers.fused.rope_``, for every Gluon
kernel, split and halved launch; the engine's samples with it on and off."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

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


def _configs(m: int):
    from qerl_kernels.tile_configs import FwdConfig, _gluon_ws_candidates

    bm = max(8, min(1 << (m - 1).bit_length(), 64))
    per_thread = [FwdConfig(bm, 64, 16, split_k=1, warps=4, swap=True, gluon=True),
                  FwdConfig(bm, 128, 16, split_k=4, warps=8, swap=True, gluon=True)]
    tma = [FwdConfig(max(bm, 16), bn, 16, split_k=sp, warps=w, stages=3, swap=True, gluon=True, xtma=True,
                     inflight=True) for bn, w, sp in ((64, 4, 3), (128, 8, 1))]
    ws = {(c.bn, c.half): c for c in _gluon_ws_candidates(bm) if not c.halves} if bm <= 32 else {}
    return per_thread + tma + [replace(c, split_k=sp) for c in ws.values() for sp in (1, 2)]


@pytest.mark.parametrize("m", [3, 16, 40])
def test_rope_epilogue_equals_gemm_then_rope(m):
    # q and k rotated at each token's position, k and v in the caches at its slot, with the q/k/v bias;
    # every Gluon kernel, with and without split-K: the same bits as the GEMM + rotary kernel.
    case = _case(m, seed=m + 201)
    for cfg in _configs(m):
        got = _epilogue(*case, cfg)
        assert got[0] is not None, cfg
        assert_same(got, _two_kernels(*case, cfg), True, cfg)


@pytest.mark.parametrize("m", [1, 100])
def test_rope_epilogue_halved_launches(m, monkeypatch):
    from qerl_kernels import gemm_gluon
    from qerl_kernels.tile_configs import FwdConfig, _gluon_ws_candidates

    case = _case(m, seed=m + 203)
    asked = []  # the forced rule was consulted: the launch did halve
    monkeypatch.setattr(gemm_gluon, "halves_split", lambda tiles, sms: asked.append(tiles) or 3)
    bm = 64 if m > 32 else 16
    cfgs = [FwdConfig(bm, bn, 16, warps=w, stages=3, swap=True, gluon=True, xtma=True, inflight=True, halves=True)
            for bn, w in ((64, 4), (128, 8))]
    if m <= 16:
        cfgs += [c for c in _gluon_ws_candidates(16) if c.halves]
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
    from qerl_cli.engine import LLMEngine, SamplingParams
    from qerl_cli.layers.linear import QLinear
    from qerl_cli.models import load_model
    from qerl_cli.quantize import QuantizeConfig, quantize
    from tests.helpers import make_tiny_hf_model
    from tests.test_engine_gpu import PROMPTS

    src = make_tiny_hf_model(tmp_path, arch="qwen2", hidden=128, heads=2, kv_heads=1, intermediate=256, init_std=0.05)
    quantize(QuantizeConfig(src=src, out=tmp_path / "q", device="cpu", progress=False))
    model = load_model(tmp_path / "q", device="cuda", dtype=torch.bfloat16)
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=13)
    real, paired = QLinear.qkv_rope, []

    def spy(self, x, rope):
        y = real(self, x, rope)
        paired.append(y is not None)
        return y

    monkeypatch.setattr(QLinear, "qkv_rope", spy)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("QERL_ROPE_EPILOGUE", flag)
        paired.clear()
        runs[flag] = LLMEngine(model, None, max_num_seqs=8).generate(PROMPTS, sp, n=2)
        assert any(paired) == (flag == "1")
    for a, b in zip(runs["1"], runs["0"]):
        for c1, c2 in zip(a, b):
            assert c1.token_ids == c2.token_ids and c1.logprobs == c2.logprobs
