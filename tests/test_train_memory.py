"""train-step memory machinery on CPU: the one-tensor-per-layer checkpoint gives the gradients of the
plain forward, bit for bit."""

from __future__ import annotations

import pytest
import torch

from qerl_cli.layers.lora import LoraSpec, lora_parameters
from qerl_cli.models import ModelConfig, build_random_model

TINY = dict(arch="qwen2", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
            num_kv_heads=2, head_dim=16, qkv_bias=True)


def tiny_model(quantized=True, dropout=0.0, tie=False, train_norms=False, device="cpu", dtype=torch.float32):
    cfg = ModelConfig(**TINY, tie_word_embeddings=tie)
    m = build_random_model(cfg, device=device, dtype=dtype, quantized=quantized, seed=3, std=0.05,
                           lora=LoraSpec(r=4, alpha=8, dropout=dropout, seed=1))
    g = torch.Generator(device=device).manual_seed(5)
    with torch.no_grad():
        for p in lora_parameters(m):  # B = 0 at init would leave A's gradient at zero
            p.copy_(torch.randn(p.shape, generator=g, device=device) * 0.1)
    for p in m.parameters():
        p.requires_grad_(False)
    params = lora_parameters(m)
    if train_norms:
        for layer in m.model.layers:
            layer.post_attention_layernorm.weight.requires_grad_(True)
            params.append(layer.post_attention_layernorm.weight)
    for p in params:
        p.requires_grad_(True)
    m.train()
    return m, params


def batch(b=3, seq=11, vocab=256, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, seq), generator=g)
    mask = torch.ones(b, seq, dtype=torch.long)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    return ids.to(device), mask.to(device)


def grads_of(model, params, ids, mask, seed=7):
    """Hidden states and the gradients of every trainable tensor for a fixed random loss."""
    for p in params:
        p.grad = None
    torch.manual_seed(seed)  # LoRA dropout masks
    hidden = model.forward_train(ids, mask)
    w = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(11)).to(hidden)
    (model.compute_logits(hidden).logsumexp(-1).sum() + (hidden.float() * w.float()).sum()).backward()
    return hidden.detach().clone(), [p.grad.clone() for p in params]


@pytest.mark.parametrize("quantized,dropout,train_norms", [(True, 0.0, False), (False, 0.2, True)])
def test_checkpointed_gradients_equal_plain_gradients_bit_for_bit(quantized, dropout, train_norms):
    model, params = tiny_model(quantized, dropout, train_norms=train_norms)
    ids, mask = batch()
    model.gradient_checkpointing = False
    h0, g0 = grads_of(model, params, ids, mask)
    model.gradient_checkpointing = True
    h1, g1 = grads_of(model, params, ids, mask)
    assert torch.equal(h0, h1)
    for a, b in zip(g0, g1):
        assert a.abs().sum() > 0
        assert torch.equal(a, b)
    # and the inference forward (no grad: the engine's path) is unchanged too
    torch.manual_seed(7)
    with torch.no_grad():
        assert torch.equal(model.forward_train(ids, mask), h0)


def test_checkpoint_saves_one_residual_stream_tensor_per_layer(monkeypatch):
    import qerl_cli.models.decoder as decoder

    model, params = tiny_model()
    model.gradient_checkpointing = True
    ids, mask = batch()
    calls = []
    real = decoder.checkpoint

    def spy(fn, *args, **kw):
        calls.append([a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()])
        return real(fn, *args, **kw)

    monkeypatch.setattr(decoder, "checkpoint", spy)
    grads_of(model, params, ids, mask)
    assert len(calls) == TINY["num_layers"]
    for floats in calls:
        assert [tuple(t.shape) for t in floats] == [(3, 11, TINY["hidden_size"])]
