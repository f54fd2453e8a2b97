"""SwiGLU in the NVFP4 gate/up GEMM's epilogue (``gemm_fwd.nvfp4_swiglu``): the same bits as the GEMM
followed by the fused SwiGLU kernel, for every Gluon kernel, split and halved launch; the engine's
samples unchanged with it on and off."""

from __future__ import annotations

import pytest
import torch
from qerl_kernels.testing import gluon_pairing_configs

pytestmark = pytest.mark.gpu

ROWS, K = 192, 1280  # N = 384: BN 64 pairs 32 + 32 rows (6 tiles), BN 128 pairs 64 + 64 (3); K = 5 ring pairs


def _case(m: int, seed: int, i: int = ROWS):
    from qerl_kernels.testing import random_nvfp4, reference_fwd
    from qerl_kernels.twiddle import to_kernel_layout

    p, s, g = random_nvfp4(2 * i, K, seed=seed, device="cuda")
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    gate, up = reference_fwd(x, p, s, g, None).float().chunk(2, dim=-1)
    return to_kernel_layout(p, True), s, g, x, torch.nn.functional.silu(gate) * up


def _unfused(x, tp, s, g, cfg):
    from qerl_kernels.gemm_fwd import nvfp4_matmul

    from qerl_cli.layers import fused

    gate, up = nvfp4_matmul(x, tp, s, g, config=cfg, twiddled=True, blocked=True).chunk(2, dim=-1)
    return fused.silu_mul(gate, up)


@pytest.mark.parametrize("m", [3, 16, 40])
def test_swiglu_epilogue_equals_gemm_then_swiglu(m):
    # Every Gluon kernel (per-thread, TMA-fed, warp-specialised with every register split) with and
    # without split-K: bit-identical to the stacked GEMM + silu_mul, and near the fp32 reference.
    from qerl_kernels.gemm_fwd import nvfp4_swiglu
    from qerl_kernels.testing import TOL, rel_err

    tp, s, g, x, ref = _case(m, seed=m + 101)
    for cfg in gluon_pairing_configs(m)[0]:
        y = nvfp4_swiglu(x, tp, s, g, config=cfg, twiddled=True, blocked=True)
        assert y is not None and y.shape == (m, ROWS), cfg
        assert torch.equal(y, _unfused(x, tp, s, g, cfg)), cfg
        assert rel_err(y, ref) < TOL[torch.bfloat16], (cfg, rel_err(y, ref))


@pytest.mark.parametrize("m", [1, 100])
def test_swiglu_epilogue_halved_launches(m, monkeypatch):
    # A wave's last tiles as two K halves (the halves rule forced to 3 whole tiles): the pairing goes
    # through the split-K workspace of the halved tiles. The halved rows differ from the unfused
    # launch's (whole gate/up pairs here), and a row summed in two K halves rounds differently, so a
    # few gate or up values sit one bf16 step away (and their outputs too, more where silu is steep);
    # deterministic, and near the fp32 reference.
    from qerl_kernels import gemm_gluon
    from qerl_kernels.gemm_fwd import nvfp4_swiglu
    from qerl_kernels.testing import TOL, rel_err

    tp, s, g, x, ref = _case(m, seed=m + 103)
    asked = []  # the forced rule was consulted: the launch did halve
    monkeypatch.setattr(gemm_gluon, "halves_split", lambda tiles, sms: asked.append(tiles) or 3)
    cfgs = gluon_pairing_configs(m)[1]
    assert cfgs
    for cfg in cfgs:
        y = nvfp4_swiglu(x, tp, s, g, config=cfg, twiddled=True, blocked=True)
        assert asked, cfg
        asked.clear()
        assert torch.equal(y, nvfp4_swiglu(x, tp, s, g, config=cfg, twiddled=True, blocked=True))
        unfused = _unfused(x, tp, s, g, cfg)
        assert (y != unfused).float().mean() < 0.01 and rel_err(y, unfused) < 1e-3, cfg
        assert rel_err(y, ref) < TOL[torch.bfloat16], (cfg, rel_err(y, ref))


def test_swiglu_epilogue_declines_what_it_cannot_pair():
    # None (the caller runs GEMM + SwiGLU) where a tile would straddle gate and up, for stream-K and
    # Triton tiles, plain codes, and under autograd; a biased QLinear never asks.
    from qerl_kernels.gemm_fwd import nvfp4_swiglu
    from qerl_kernels.ops import NVFP4Weight
    from qerl_kernels.ops import nvfp4_swiglu as op_swiglu
    from qerl_kernels.tile_configs import FwdConfig

    from qerl_cli.layers.linear import QLinear

    tp, s, g, x, _ = _case(16, seed=7, i=208)  # 208 rows: not a multiple of 32
    per_thread = FwdConfig(16, 64, 16, split_k=2, warps=4, swap=True, gluon=True)
    assert nvfp4_swiglu(x, tp, s, g, config=per_thread, twiddled=True, blocked=True) is None
    tp, s, g, x, _ = _case(16, seed=8)
    assert nvfp4_swiglu(x, tp, s, g, config=per_thread, twiddled=True, blocked=True) is not None
    streamk = FwdConfig(16, 64, 16, warps=4, stages=3, swap=True, gluon=True, xtma=True, inflight=True, sk=2)
    assert nvfp4_swiglu(x, tp, s, g, config=streamk, twiddled=True, blocked=True) is None
    assert nvfp4_swiglu(x, tp, s, g, config=FwdConfig(16, 128, 16, swap=True), twiddled=True, blocked=True) is None
    w = NVFP4Weight(tp, s, g, twiddled=True, blocked=True)
    assert op_swiglu(x.requires_grad_(), w) is None
    lin = QLinear(K, 2 * ROWS, bias=True, quantized=True, device="cuda", dtype=torch.bfloat16)
    assert lin.swiglu(x.detach()) is None


def test_engine_samples_equal_with_epilogue_on_and_off(tmp_path, monkeypatch):
    # A tiny NVFP4 model (gate/up 512 x 128: the per-thread Gluon tile pairs 32 + 32 rows) in the
    # graph engine: the decode's gate/up GEMMs take the epilogue, and the samples are bit-identical.
    from qerl_cli.layers.linear import QLinear
    from tests.helpers import assert_engine_switch_keeps_samples

    assert_engine_switch_keeps_samples(tmp_path, monkeypatch, "QERL_SWIGLU_EPILOGUE", QLinear, "swiglu", seed=11,
                                       hidden=128, intermediate=256)
