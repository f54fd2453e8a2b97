"""silu_mul: forward and gradients bit-identical to autograd through ``F.silu(g) * u`` on CPU; the fused
Triton passes against the same torch ops in the interpreter (fp32 / fp16) and on the GPU (bf16)."""

import textwrap

import pytest
import torch
import torch.nn.functional as F

from qerl_cli.layers.activation import _SiluMul, silu_mul
from tests.helpers import run_in_interpreter


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


def test_second_order_gradients_match_autograd():
    # A gradient penalty differentiates the gradient: the in-place silu_backward of the first-order
    # path has no derivative ("not implemented"), so create_graph takes differentiable ops.
    gen = torch.Generator().manual_seed(1)
    g0, u0, r = (torch.randn(9, 31, generator=gen, dtype=torch.float64) * s for s in (3, 1, 1))
    got, want = [], []
    for fn, out in ((silu_mul, got), (lambda g, u: F.silu(g) * u, want)):
        g, u = g0.clone().requires_grad_(True), u0.clone().requires_grad_(True)
        dg, du = torch.autograd.grad((fn(g, u) * r).sum(), (g, u), create_graph=True)
        out.extend(torch.autograd.grad((dg * dg).sum() + (du * dg).sum(), (g, u)) + (dg, du))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


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


SWIGLU_CHECK = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from qerl_cli.layers import fused

    def torch_grads(grad, g, u):
        g, u = g.detach().clone().requires_grad_(True), u.detach().clone().requires_grad_(True)
        (F.silu(g) * u).backward(grad)
        return g.grad, u.grad

    def check(dev, dtype, rows, n, halves, tol):
        gen = torch.Generator().manual_seed(rows * 7 + n)
        gu = (torch.randn(rows, 2 * n, generator=gen) * 4).to(dev, dtype)
        g, u = gu.chunk(2, dim=-1) if halves else (gu[:, :n].contiguous(), gu[:, n:].contiguous())
        grad = torch.randn(rows, n, generator=gen).to(dev, dtype)
        want_dg, want_du = torch_grads(grad, g, u)
        y = fused.silu_mul(g, u)
        assert y.shape == g.shape and y._base is None  # allocated in g's shape: not a view
        torch.testing.assert_close(y.float(), (F.silu(g) * u).float(), rtol=tol, atol=tol)
        for need in ((True, True), (True, False), (False, True)):
            dg, du = fused.silu_mul_backward(grad, g, u, *need)
            for got, want, on, name in ((dg, want_dg, need[0], "dg"), (du, want_du, need[1], "du")):
                if not on:
                    assert got is None, name
                    continue
                assert got.shape == g.shape and got.dtype == dtype, name
                torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(want.float().abs().max()),
                                           msg=name)
""")


def test_fused_swiglu_backward_matches_torch_in_interpreter():
    pytest.importorskip("triton")
    cases = [("float32", 3, 33, True, 1e-5), ("float32", 1, 1030, False, 1e-5), ("float16", 5, 1000, True, 2e-3),
             ("float32", 4, 7, False, 1e-5)]
    script = SWIGLU_CHECK + "".join(f"check('cpu', torch.{d}, {r}, {n}, {h}, {tol})\n" for d, r, n, h, tol in cases)
    run_in_interpreter(script + "print('ok')\n")


@pytest.mark.gpu
def test_training_swiglu_takes_the_fused_kernels_and_matches_torch_on_gpu(monkeypatch):
    ns = {}
    exec(SWIGLU_CHECK, ns)
    for rows, n, halves in ((8192, 18944, True), (37, 1000, False), (1, 4864, True)):
        ns["check"]("cuda", torch.bfloat16, rows, n, halves, 1e-2)
    # Through silu_mul under autograd: the fused forward and backward run, gradients equal the torch
    # path's to one bf16 unit, and a double backward (create_graph) takes the torch ops.
    from qerl_cli.layers import fused

    calls = []
    real_bwd = fused.silu_mul_backward
    monkeypatch.setattr(fused, "silu_mul_backward", lambda *a: (calls.append(1), real_bwd(*a))[1])
    gen = torch.Generator(device="cuda").manual_seed(3)
    g0 = torch.randn(300, 512, device="cuda", generator=gen, dtype=torch.bfloat16) * 3
    u0 = torch.randn(300, 512, device="cuda", generator=gen, dtype=torch.bfloat16)
    r = torch.randn(300, 512, device="cuda", generator=gen, dtype=torch.bfloat16)
    out = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("QERL_FUSED", flag)
        g, u = g0.clone().requires_grad_(True), u0.clone().requires_grad_(True)
        (silu_mul(g, u) * r).sum().backward()
        out[flag] = (g.grad, u.grad)
    assert len(calls) == 1
    for a, b in zip(out["1"], out["0"]):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2 * float(b.float().abs().max()))
    monkeypatch.setenv("QERL_FUSED", "1")
    g, u = g0.float().requires_grad_(True), u0.float().requires_grad_(True)
    (dg,) = torch.autograd.grad((silu_mul(g, u) * r.float()).sum(), g, create_graph=True)
    (ddg,) = torch.autograd.grad(dg.sum(), g)  # second order through the torch path
    g2 = g0.float().requires_grad_(True)
    (dg2,) = torch.autograd.grad((F.silu(g2) * u0.float() * r.float()).sum(), g2, create_graph=True)
    (ddg2,) = torch.autograd.grad(dg2.sum(), g2)
    torch.testing.assert_close(ddg, ddg2, rtol=1e-4, atol=1e-4)
