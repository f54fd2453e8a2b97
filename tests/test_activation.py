"""silu_mul: forward and gradients bit-identical to autograd through ``F.silu(g) * u``."""

import pytest
import torch
import torch.nn.functional as F

from qerl_cli.layers.activation import _SiluMul, silu_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_autograd_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    g0 = (torch.randn(37, 53, generator=gen) * 4).to(dtype)
    u0 = torch.randn(37, 53, generator=gen).to(dtype)
    r = torch.randn(37, 53, generator=gen).to(dtype)
    g, u = g0.clone().requires_grad_(True), u0.clone().requires_grad_(True)
    y = silu_mul(g, u)
    (y * r).sum().backward()
    g2, u2 = g0.clone().requires_grad_(True), u0.clone().requires_grad_(True)
    y2 = F.silu(g2) * u2
    (y2 * r).sum().backward()
    assert torch.equal(y, y2) and torch.equal(g.grad, g2.grad) and torch.equal(u.grad, u2.grad)


def test_saves_only_its_inputs_and_skips_the_function_without_grad():
    g = torch.randn(4, 8, requires_grad=True)
    u = torch.randn(4, 8, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = silu_mul(g, u)
    assert isinstance(y.grad_fn, _SiluMul._backward_cls) and len(saved) == 2
    with torch.no_grad():
        assert silu_mul(g, u).grad_fn is None


def test_swiglu_epilogue_falls_back_off_gpu(monkeypatch):
    # On CPU (the reference path) the NVFP4 gate/up GEMM cannot pair its columns: QLinear.swiglu says
    # so with None, the MLP runs the GEMM and SwiGLU, and QERL_SWIGLU_EPILOGUE=0 never asks.
    from qerl_kernels import reference

    from qerl_cli.layers.activation import swiglu_epilogue
    from qerl_cli.layers.linear import QLinear

    lin = QLinear(64, 2 * 32, quantized=True)
    packed, scale, g = reference.quantize(torch.randn(64, 64))
    lin.weight_packed, lin.weight_scale, lin.weight_global_scale = packed, scale, g
    x = torch.randn(3, 64)
    assert lin.swiglu(x) is None
    asked = []
    monkeypatch.setattr(QLinear, "swiglu", lambda self, x, *korder: asked.append(1))
    monkeypatch.setattr("qerl_cli.layers.fused.enabled", lambda *t: True)  # as on a GPU
    for flag, want in (("0", []), ("1", [1])):
        monkeypatch.setenv("QERL_SWIGLU_EPILOGUE", flag)
        swiglu_epilogue(lin, x)
        assert asked == want
