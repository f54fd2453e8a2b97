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
