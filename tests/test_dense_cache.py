"""On CPU an NVFP4 model keeps its dequantized weights between calls (keep_dense_weights): the same
numbers as decoding on every call, a fresh copy when the codes or scales change, autograd intact."""

from __future__ import annotations

import torch

from qerl_cli.engine import LLMEngine, SamplingParams
from qerl_cli.layers.linear import QLinear, keep_dense_weights
from qerl_cli.models import load_model
from tests.helpers import make_tiny_hf_model
from tests.test_models import nvfp4_checkpoint


def _model(tmp_path, **kw):
    src = make_tiny_hf_model(tmp_path, arch="qwen2", dtype=torch.bfloat16, tokenizer=False)
    qdir, _ = nvfp4_checkpoint(src, tmp_path / "q")
    return qdir


def _decodes(monkeypatch):
    from qerl_kernels import reference

    calls = []
    real = reference.dequantize
    monkeypatch.setattr(reference, "dequantize", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


def test_engine_on_cpu_keeps_dense_weights_same_samples(tmp_path, monkeypatch):
    qdir = _model(tmp_path)
    prompts = [[5, 9, 17, 3], [8, 8, 2]]
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    out = {}
    for keep in (False, True):
        model = load_model(qdir, dtype=torch.float32)
        assert all(m.keep_dense for m in model.modules() if isinstance(m, QLinear) and m.quantized)  # loaded on CPU
        if not keep:
            assert not keep_dense_weights(model, torch.float32, max_bytes=0)  # over budget: decode every call
        calls = _decodes(monkeypatch)
        groups = LLMEngine(model, None, max_num_seqs=4).generate(prompts, sp, n=2)
        out[keep] = [(c.token_ids, c.logprobs) for g in groups for c in g]
        # kept: one decode per Linear (2 layers x 7: separately quantized, q/k/v and gate/up do not fuse);
        # not: one per Linear per forward (a prefill and 12 decode steps)
        assert len(calls) == (7 * 2 if keep else 7 * 2 * 13)
    assert out[True] == out[False]  # bit for bit: the reference path's numbers


def test_kept_weight_follows_in_place_changes_and_serves_autograd(tmp_path):
    model = load_model(_model(tmp_path), dtype=torch.float32)
    lin = model.model.layers[0].self_attn.o_proj
    assert lin.keep_dense
    with torch.inference_mode():  # the engine fills the copy in inference mode
        lin(torch.randn(2, lin.in_features))
    x = torch.randn(3, lin.in_features, requires_grad=True)
    y = lin(x)
    (gx,) = torch.autograd.grad(y.square().sum(), x)
    w = lin.dense_weight(torch.float32)
    x2 = x.detach().clone().requires_grad_()
    y2 = x2 @ w.T
    (gx2,) = torch.autograd.grad(y2.square().sum(), x2)
    assert torch.equal(y, y2) and torch.allclose(gx, gx2, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        lin.weight_global_scale.mul_(0.5)  # in place, as a reload's copy_: every weight doubles
    assert torch.equal(lin(x.detach()), x.detach() @ lin.dense_weight(torch.float32).T)  # not the stale copy
    assert torch.allclose(lin(x.detach()), 2 * y.detach(), rtol=1e-6, atol=1e-6)


def test_weights_made_in_inference_mode_decode_every_call(tmp_path):
    # Inference tensors track no version: reading one raised ("Inference tensors do not track version
    # counter") on the first forward of a model loaded, or an engine built, under torch.inference_mode().
    with torch.inference_mode():
        model = load_model(_model(tmp_path), dtype=torch.float32)
        lin = model.model.layers[0].mlp.down_proj
        x = torch.randn(2, lin.in_features)
        assert lin.keep_dense and torch.equal(lin(x), x @ lin.dense_weight(torch.float32).T)
