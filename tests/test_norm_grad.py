"""The fused RMSNorm under autograd (``norm._RMSNormFn``: the inference kernel forward, one Triton pass
back) against the torch path it replaces in training: outputs, the residual stream and the gradients of
x, the residual and a trained fp32 master weight; in Triton's interpreter (fp32 / fp16) and on the GPU
(bf16, through ``RMSNorm.forward``)."""

import textwrap

import pytest
import torch

from tests.helpers import run_in_interpreter

CHECK = textwrap.dedent("""
    import torch
    from qerl_cli.layers.norm import RMSNorm, _RMSNormFn

    def run(norm, x, res, fused):
        x = x.clone().requires_grad_(True)
        r = None if res is None else res.clone().requires_grad_(True)
        if fused:
            out = _RMSNormFn.apply(x, r, norm.weight, norm._as_used(x.dtype), norm.noise, norm.eps)
        else:
            out = norm._torch(x, r)
        y, s = (out, None) if r is None else out
        g = torch.Generator(device=x.device).manual_seed(7)
        loss = (y.float() * torch.randn(y.shape, generator=g, device=x.device)).sum()
        if s is not None:
            loss = loss + (s.float() * torch.randn(s.shape, generator=g, device=x.device)).sum()
        if norm.weight.grad is not None:
            norm.weight.grad = None
        loss.backward()
        wg = None if norm.weight.grad is None else norm.weight.grad.clone()
        return y.detach(), None if s is None else s.detach(), x.grad, None if r is None else r.grad, wg

    def check(dev, dtype, rows, n, train_w, noise, residual, tol):
        torch.manual_seed(rows + n)
        norm = RMSNorm(n, eps=1e-6, noise_slot=noise, device=dev, dtype=torch.float32 if train_w else dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(n))
            if noise:
                norm.noise.copy_(1e-2 * torch.randn(n))
        norm.weight.requires_grad_(train_w)
        x = (torch.randn(rows, n) * 3).to(dev, dtype)
        res = (torch.randn(rows, n)).to(dev, dtype) if residual else None
        a, b = run(norm, x, res, True), run(norm, x, res, False)
        for got, want, name in zip(a, b, ("y", "residual", "dx", "dres", "dw")):
            if want is None:
                assert got is None, name
                continue
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(want.float().abs().max()),
                                       msg=name)
""")


def test_fused_norm_gradients_match_torch_in_interpreter():
    pytest.importorskip("triton")
    cases = [("float32", 5, 96, True, True, True, 1e-5), ("float32", 3, 100, False, False, False, 1e-5),
             ("float16", 9, 64, True, False, True, 2e-3), ("float32", 7, 33, True, True, False, 1e-5)]
    script = CHECK + "import qerl_cli.layers.fused as f\nf.BWD_ROWS = 2\n" + "".join(
        f"check('cpu', torch.{d}, {r}, {n}, {t}, {z}, {res}, {tol})\n" for d, r, n, t, z, res, tol in cases) + "print('ok')\n"
    run_in_interpreter(script)


@pytest.mark.gpu
def test_training_norm_takes_the_fused_kernels_and_matches_torch_on_gpu():
    from qerl_cli.layers import fused

    ns = {}
    exec(CHECK, ns)
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert fused.trainable(x)
    for rows, n, train_w, noise, residual in ((8192, 3584, False, True, True), (37, 5120, True, True, True),
                                              (100, 3584, True, False, False), (1, 896, False, False, True)):
        ns["check"]("cuda", torch.bfloat16, rows, n, train_w, noise, residual, 2e-2)


def test_fused_norm_edge_cases_in_interpreter():
    # A second-order gradient (a gradient penalty) equals the torch path's, where the kernel's graphless
    # gradient had dropped the norm's part of it silently; the
    # outputs take in-place ops (they are no views of tensors made inside the function); an input of
    # non-unit column stride is read right; only the residual used: no weight gradient.
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import torch
        from qerl_cli.layers.norm import RMSNorm, _RMSNormFn
        norm = RMSNorm(48, eps=1e-6, noise_slot=True)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(48))
        norm.weight.requires_grad_(True)
        fn = lambda x, r: _RMSNormFn.apply(x, r, norm.weight, norm._as_used(x.dtype), norm.noise, norm.eps)
        c = torch.randn(6, 48)
        second = []
        for fused in (True, False):
            x = torch.randn(6, 48, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
            y = fn(x, None) if fused else norm._torch(x, None)
            (g,) = torch.autograd.grad((y * c).sum() + (x ** 3).sum(), x, create_graph=True)
            (g ** 2).sum().backward()
            second.append(x.grad)
        torch.testing.assert_close(second[0], second[1], rtol=1e-4, atol=1e-4)
        x = torch.randn(6, 48, requires_grad=True)
        y, s = fn(x, torch.randn(6, 48))
        y.mul_(2)
        s.add_(1)
        xt = torch.randn(48, 6).t()
        want = norm._torch(xt.contiguous(), None)
        torch.testing.assert_close(fn(xt, None), want, rtol=1e-5, atol=1e-5)
        norm.weight.grad = None
        _, s = fn(x, torch.randn(6, 48))
        s.sum().backward()
        assert norm.weight.grad is None and x.grad is not None
        print("ok")
    """)
    run_in_interpreter(script)
