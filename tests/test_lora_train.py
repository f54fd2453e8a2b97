"""LoRA's training Function (``layers/lora_train.py``) against plain autograd over the same projection:
output and gradients for x, A and B, over dense and NVFP4 bases, with a bias, on 2-D and 3-D inputs,
x with and without gradients, and a double backward."""

from __future__ import annotations

import pytest
import torch

from qerl_cli.layers.linear import QLinear
from qerl_cli.layers.lora import LoRALinear
from qerl_cli.layers.lora_train import _LoRATrainFn


def _lora(quantized: bool, bias: bool, n_in=48, n_out=40, seed=0):
    from qerl_kernels import reference

    gen = torch.Generator().manual_seed(seed)
    base = QLinear(n_in, n_out, bias=bias, quantized=quantized, dtype=torch.float64 if not quantized else None)
    w = torch.randn(n_out, n_in, generator=gen, dtype=torch.float64) * 0.2
    with torch.no_grad():
        if quantized:
            base.weight_packed, base.weight_scale, base.weight_global_scale = reference.quantize(w.float())
        else:
            base.weight.copy_(w)
        if bias:
            base.bias.data = torch.randn(n_out, generator=gen, dtype=torch.float64)
    lora = LoRALinear(base, r=4, alpha=8, generator=gen)
    with torch.no_grad():
        lora.lora_B.normal_(0, 0.3, generator=gen)
    return lora.train()


def _run(lora, x0, fn_on: bool, monkeypatch, x_grad=True):
    monkeypatch.setenv("QERL_LORA_FN", "1" if fn_on else "0")
    lora.lora_A.grad = lora.lora_B.grad = None
    x = x0.clone().requires_grad_(x_grad)
    seen = []
    real = _LoRATrainFn.apply
    monkeypatch.setattr(_LoRATrainFn, "apply", lambda *a: (seen.append(1), real(*a))[1])
    y = lora(x)
    r = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view(y.shape)
    (y * r).sum().backward()
    assert bool(seen) == fn_on  # the path asked for ran
    return y.detach(), (x.grad if x_grad else None), lora.lora_A.grad.clone(), lora.lora_B.grad.clone()


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(7,), (2, 5)])
def test_matches_autograd(quantized, bias, shape, monkeypatch):
    lora = _lora(quantized, bias)
    dtype = torch.float32 if quantized else torch.float64
    x0 = torch.randn(*shape, 48, generator=torch.Generator().manual_seed(5), dtype=dtype)
    for x_grad in (True, False):
        got = _run(lora, x0, True, monkeypatch, x_grad)
        want = _run(lora, x0, False, monkeypatch, x_grad)
        for a, b, name in zip(got, want, ("y", "dx", "dA", "dB")):
            if b is None:
                assert a is None, name
                continue
            assert a.shape == b.shape, name
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_second_order_gradients_match_autograd(monkeypatch):
    lora = _lora(False, True)
    x0 = torch.randn(6, 48, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("QERL_LORA_FN", flag)
        x = x0.clone().requires_grad_(True)
        dx, da, db = torch.autograd.grad((lora(x) ** 2).sum(), (x, lora.lora_A, lora.lora_B), create_graph=True)
        out[flag] = torch.autograd.grad(dx.pow(2).sum() + da.pow(2).sum() + db.pow(2).sum(),
                                        (x, lora.lora_A, lora.lora_B))
    for a, b in zip(out["1"], out["0"]):
        torch.testing.assert_close(a, b)


def test_falls_back_where_it_does_not_apply(monkeypatch):
    # dropout (its mask), a base weight that trains, or no gradients at all: the autograd path
    lora = _lora(False, False)
    x = torch.randn(3, 48, dtype=torch.float64, requires_grad=True)
    seen = []
    real = _LoRATrainFn.apply
    monkeypatch.setattr(_LoRATrainFn, "apply", lambda *a: (seen.append(1), real(*a))[1])
    lora.dropout = torch.nn.Dropout(0.1)
    lora(x)
    lora.dropout = torch.nn.Identity()
    lora.base.weight.requires_grad_(True)
    lora(x)
    lora.base.weight.requires_grad_(False)
    with torch.no_grad():
        lora(x)
    assert seen == []
    lora(x)
    assert seen == [1]
