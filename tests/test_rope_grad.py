"""Training's rotary under autograd (``rotary._RopeFn``: the inference kernel forward, the inverse rotation
back) against the torch path it replaces: rotated q and k and their gradients, in Triton's interpreter
(fp32 / fp16) and on the GPU (bf16, through ``RotaryEmbedding.forward``), plus a double backward."""

import textwrap

import pytest
import torch

from tests.helpers import run_in_interpreter

CHECK = textwrap.dedent("""
    import torch
    from qerl_cli.layers.rotary import RotaryEmbedding, _RopeFn

    def rotate(rope, q0, k0, pos, fused):
        # (q, k leaves with grad, rotated q, rotated k) through _RopeFn or the torch path
        import os
        q, k = q0.clone().requires_grad_(True), k0.clone().requires_grad_(True)
        if fused:
            return q, k, *_RopeFn.apply(q, k, pos, rope.cos_sin, rope._cos_neg_sin())
        os.environ["QERL_TRAIN_ROPE"] = "0"
        try:
            return q, k, *rope(pos, q, k)
        finally:
            del os.environ["QERL_TRAIN_ROPE"]

    def run(rope, q0, k0, pos, fused):
        q, k, qr, kr = rotate(rope, q0, k0, pos, fused)
        g = torch.Generator(device=q.device).manual_seed(3)
        loss = (qr.float() * torch.randn(qr.shape, generator=g, device=q.device)).sum() + \\
               (kr.float() * torch.randn(kr.shape, generator=g, device=q.device)).sum()
        loss.backward()
        return qr.detach(), kr.detach(), q.grad, k.grad

    def check(dev, dtype, b, L, hq, hk, d, tol, scaling=None):
        torch.manual_seed(b * 100 + L)
        rope = RotaryEmbedding(d, 512, 10000.0, scaling, device=dev)
        q0 = torch.randn(b, L, hq, d).to(dev, dtype)
        k0 = torch.randn(b, L, hk, d).to(dev, dtype)
        pos = torch.randint(0, 512, (b, L)).to(dev)
        got, want = run(rope, q0, k0, pos, True), run(rope, q0, k0, pos, False)
        for a, w, name in zip(got, want, ("q", "k", "dq", "dk")):
            assert a.shape == w.shape and a.dtype == w.dtype, name
            torch.testing.assert_close(a.float(), w.float(), rtol=tol, atol=tol, msg=name)

    def second_order(dev):
        # create_graph: the backward's inverse rotation in torch ops, so the second order is autograd's
        rope = RotaryEmbedding(64, 32, 10000.0, device=dev)
        g = torch.Generator().manual_seed(0)
        q0, k0 = torch.randn(2, 3, 2, 64, generator=g).to(dev), torch.randn(2, 3, 1, 64, generator=g).to(dev)
        pos = torch.tensor([[0, 5, 9], [3, 3, 31]]).to(dev)
        out = []
        for fused in (True, False):
            q, k, qr, kr = rotate(rope, q0, k0, pos, fused)
            dq, dk = torch.autograd.grad((qr ** 3).sum() + (kr ** 3).sum(), (q, k), create_graph=True)
            out.append(torch.autograd.grad((dq ** 2).sum() + (dk ** 2).sum(), (q, k)))
        for a, b in zip(*out):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
""")


def test_fused_rope_gradients_match_torch_in_interpreter():
    pytest.importorskip("triton")
    cases = [("float32", 2, 5, 4, 2, 64, 1e-5), ("float16", 1, 7, 2, 2, 32, 2e-3), ("float32", 3, 1, 6, 1, 128, 1e-5)]
    script = CHECK + "".join(f"check('cpu', torch.{d}, {b}, {L}, {hq}, {hk}, {hd}, {tol})\n"
                             for d, b, L, hq, hk, hd, tol in cases) + "second_order('cpu')\nprint('ok')\n"
    run_in_interpreter(script)


@pytest.mark.gpu
def test_training_rope_takes_the_fused_kernel_and_matches_torch_on_gpu():
    from qerl_cli.layers import rotary

    ns = {}
    exec(CHECK, ns)
    for b, L, hq, hk, d in ((4, 1536, 28, 4, 128), (1, 37, 40, 8, 128), (2, 9, 14, 2, 64)):
        ns["check"]("cuda", torch.bfloat16, b, L, hq, hk, d, 2e-2)
    rope = rotary.RotaryEmbedding(128, 64, 10000.0, device="cuda")
    q = torch.randn(1, 4, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 4, 1, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    qr, _ = rope(torch.arange(4, device="cuda")[None], q, k)
    assert isinstance(qr.grad_fn, rotary._RopeFn._backward_cls)  # training takes it
    ns["second_order"]("cuda")  # a double backward takes the torch ops of the inverse rotation


def test_the_kernels_take_one_position_per_row_only():
    # [L] positions against a batched q broadcast in torch, but the kernel read B*L of them (past the end)
    from qerl_cli.layers.rotary import positions_ok

    q, k = torch.zeros(2, 5, 4, 8), torch.zeros(2, 5, 2, 8)
    assert positions_ok(q, k, torch.zeros(2, 5, dtype=torch.long))
    assert not positions_ok(q, k, torch.arange(5))
    assert positions_ok(q[0], k[0], torch.arange(5))
