"""The memory-lean log-prob function equals plain autograd: values, entropies and gradients."""

import pytest
import torch

from qerl_cli.layers.lora import LoraSpec
from qerl_cli.models import ModelConfig, build_random_model
from qerl_cli.train.logprobs import _autograd_chunk, _dense_head, token_logprobs

CFG = dict(arch="qwen2", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
           num_kv_heads=2, head_dim=16, qkv_bias=True)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_logprobs_equal_autograd(dtype, tol, bias):
    model = build_random_model(ModelConfig(**CFG), device="cpu", dtype=dtype, quantized=True,
                               lora=LoraSpec(r=4, alpha=4), std=0.2)
    if bias:
        model.lm_head.bias = torch.nn.Parameter(torch.randn(320, dtype=dtype) * 0.3, requires_grad=False)
    assert _dense_head(model) is not None
    g = torch.Generator().manual_seed(0)
    n = 300  # > the 128-row block, not a multiple of it nor of the chunk
    h = (torch.randn(n, 64, generator=g) * 2).to(dtype)
    targets = torch.randint(0, 320, (n,), generator=g)
    inv_t = 1.0 / (0.5 + torch.rand(n, generator=g))
    up = torch.randn(n, generator=g)

    h1 = h.clone().requires_grad_(True)
    lp1, ent1 = token_logprobs(model, h1, targets, inv_t, chunk=70)
    (lp1 * up).sum().backward()
    h2 = h.clone().requires_grad_(True)
    lp2, ent2 = _autograd_chunk(model, h2, targets, inv_t)
    (lp2 * up).sum().backward()
    torch.testing.assert_close(lp1, lp2, rtol=tol, atol=tol)
    torch.testing.assert_close(ent1, ent2, rtol=tol, atol=tol)
    torch.testing.assert_close(h1.grad.float(), h2.grad.float(), rtol=tol, atol=tol * float(h2.grad.float().abs().max()))
    assert not ent1.requires_grad
    with torch.no_grad():
        lp3, ent3 = token_logprobs(model, h, targets, inv_t, chunk=1000)
    torch.testing.assert_close(lp3, lp2.detach(), rtol=tol, atol=tol)


def test_checkpointed_chunks_equal_plain_autograd_bit_for_bit(monkeypatch):
    # A head that is not a plain dense Linear runs each chunk through autograd inside qerl's checkpoint
    # (qerl_cli.train.recompute): the same values and input gradients as plain autograd, entropy detached.
    import qerl_cli.train.logprobs as logprobs

    model = build_random_model(ModelConfig(**CFG), device="cpu", dtype=torch.float32, quantized=True,
                               lora=LoraSpec(r=4, alpha=4), std=0.2)
    monkeypatch.setattr(logprobs, "_dense_head", lambda m: None)
    g = torch.Generator().manual_seed(1)
    n = 150
    h = torch.randn(n, 64, generator=g) * 2
    targets = torch.randint(0, 320, (n,), generator=g)
    inv_t = 1.0 / (0.5 + torch.rand(n, generator=g))
    up = torch.randn(n, generator=g)
    h1 = h.clone().requires_grad_(True)
    lp1, ent1 = token_logprobs(model, h1, targets, inv_t, chunk=150)  # one chunk: the same sums as below
    (lp1 * up).sum().backward()
    h2 = h.clone().requires_grad_(True)
    lp2, ent2 = _autograd_chunk(model, h2, targets, inv_t)
    (lp2 * up).sum().backward()
    assert torch.equal(lp1, lp2) and torch.equal(ent1, ent2) and torch.equal(h1.grad, h2.grad)
    assert lp1.requires_grad and not ent1.requires_grad


def test_gradient_matches_finite_differences_fp64_direction():
    model = build_random_model(ModelConfig(**CFG), device="cpu", dtype=torch.float32, quantized=False, std=0.2)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, 64, generator=g)
    t = torch.randint(0, 320, (5,), generator=g)
    it = torch.full((5,), 1 / 0.7)
    hh = h.clone().requires_grad_(True)
    token_logprobs(model, hh, t, it)[0].sum().backward()
    d = torch.randn(5, 64, generator=g)
    eps = 1e-2
    f = lambda x: float(token_logprobs(model, x, t, it)[0].double().sum())  # noqa: E731
    fd = (f(h + eps * d) - f(h - eps * d)) / (2 * eps)
    assert float((hh.grad * d).sum()) == pytest.approx(fd, rel=2e-3)


@pytest.mark.gpu
def test_fused_logprobs_equal_autograd_on_cuda_bf16():
    model = build_random_model(ModelConfig(**CFG), device="cuda", dtype=torch.bfloat16, quantized=True,
                               lora=LoraSpec(r=4, alpha=4), std=0.2)
    g = torch.Generator().manual_seed(0)
    n = 1000
    h = (torch.randn(n, 64, generator=g) * 2).to(torch.bfloat16).cuda()
    targets = torch.randint(0, 320, (n,), generator=g).cuda()
    inv_t = (1.0 / (0.5 + torch.rand(n, generator=g))).cuda()
    up = torch.randn(n, generator=g).cuda()
    h1, h2 = h.clone().requires_grad_(True), h.clone().requires_grad_(True)
    lp1, ent1 = token_logprobs(model, h1, targets, inv_t, chunk=300)
    (lp1 * up).sum().backward()
    lp2, ent2 = _autograd_chunk(model, h2, targets, inv_t)
    (lp2 * up).sum().backward()
    torch.testing.assert_close(lp1, lp2, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ent1, ent2, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h1.grad.float(), h2.grad.float(), rtol=2e-2, atol=2e-2 * float(h2.grad.float().abs().max()))
