"""GroupedLoRA: the fused q/k/v and gate/up LoRA terms in two kernels, against the per-part path."""

from __future__ import annotations

import pytest
import torch

from qerl_cli.layers.attention import group_lora
from qerl_cli.layers.context import ForwardContext, set_context
from qerl_cli.layers.lora import GroupedLoRA, lora_disabled, lora_modules, lora_parameters
from tests.helpers import random_lora_model

CFG = dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2)


def _model(quantized: bool, targets=("q_proj", "v_proj", "up_proj", "gate_proj", "o_proj")):
    return random_lora_model(CFG, quantized=quantized, targets=targets)


def _logits(model, ids, engine: bool):
    """Logits with the engine's forward context set (inference copies, grouped LoRA) or without (autograd path)."""
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    set_context(ForwardContext(is_prefill=True, slot_mapping=torch.zeros(ids.numel(), dtype=torch.long)) if engine else None)
    try:
        with torch.no_grad():
            return model.compute_logits(model(ids, positions))
    finally:
        set_context(None)


@pytest.fixture
def ids():
    return torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("quantized", [False, True])
def test_grouped_lora_matches_per_part(quantized, ids, monkeypatch):
    model = _model(quantized)
    reference = _logits(model, ids, engine=False)
    assert group_lora(model, torch.float32) == 2 * model.config.num_layers
    calls = []
    add = GroupedLoRA.add
    monkeypatch.setattr(GroupedLoRA, "add", lambda self, x, y, t=None, x_korder=False: calls.append(1)
                        or add(self, x, y, t, x_korder))
    grouped = _logits(model, ids, engine=True)
    assert len(calls) == 2 * model.config.num_layers  # every fused GEMM took the grouped path
    torch.testing.assert_close(grouped, reference, atol=2e-5, rtol=1e-5)
    # the adapter's delta is not negligible here, so a missing part would fail the comparison above
    with lora_disabled(model):
        base = _logits(model, ids, engine=False)
    assert (reference - base).abs().max() > 1e-2


def test_parts_without_lora_get_zero_rows(ids):
    model = _model(False, targets=("v_proj", "up_proj"))  # q, k and gate have no adapter
    reference = _logits(model, ids, engine=False)
    assert group_lora(model, torch.float32) == 2 * model.config.num_layers
    g = model.model.layers[0].self_attn._qkv_lora
    nq = model.config.num_heads * model.config.head_dim
    nk = model.config.num_kv_heads * model.config.head_dim
    assert g.b.shape == (nq + 2 * nk, 4) and g.b[:nq + nk].abs().max() == 0  # q and k rows are zero
    torch.testing.assert_close(_logits(model, ids, engine=True), reference, atol=2e-5, rtol=1e-5)


def _new_adapter_values(model):
    """Redraw every LoRA tensor and refresh the inference copies in place (what train-step + rollout do)."""
    with torch.no_grad():
        for p in lora_parameters(model):
            p.normal_(0, 0.2)
    for _, m in lora_modules(model):
        m.refresh_inference_copies(torch.float32)


def test_in_place_refresh_reaches_the_group(ids):
    """New adapter values refreshed in place reach the same grouped tensors (what a captured graph reads)."""
    model = _model(False)
    group_lora(model, torch.float32)
    g = model.model.layers[1].mlp._gate_up_lora
    a_ptr = g.a.data_ptr()
    _new_adapter_values(model)
    assert group_lora(model, torch.float32) == 2 * model.config.num_layers
    assert model.model.layers[1].mlp._gate_up_lora is g and g.a.data_ptr() == a_ptr
    torch.testing.assert_close(_logits(model, ids, engine=True), _logits(model, ids, engine=False), atol=2e-5, rtol=1e-5)


def test_disabled_parts_fall_back(ids, monkeypatch):
    model = _model(False)
    group_lora(model, torch.float32)
    monkeypatch.setattr(GroupedLoRA, "add", lambda *a: pytest.fail("grouped path used with LoRA disabled"))
    with lora_disabled(model):
        torch.testing.assert_close(_logits(model, ids, engine=True), _logits(model, ids, engine=False))
    # a dtype change of the inference copies unshares them: the group is no longer used, then rebuilt
    m = model.model.layers[0].self_attn.q_proj
    m.refresh_inference_copies(torch.float64)
    assert not model.model.layers[0].self_attn._qkv_lora.valid()


def test_switch_off(monkeypatch):
    model = _model(False)
    assert group_lora(model, torch.float32) == 4
    monkeypatch.setenv("QERL_LORA_GROUPED", "0")
    assert group_lora(model, torch.float32) == 0
    assert model.model.layers[0].self_attn._qkv_lora is None


def _wide_model():
    """Hidden 128, intermediate 256: every projection's input is whole 128-column K steps."""
    model = random_lora_model(dict(CFG, hidden_size=128, intermediate_size=256))
    group_lora(model, torch.float32)
    return model


def test_korder_copies_of_a_follow_in_place_refreshes():
    """Each adapter's A in the GEMMs' K order, stacked per group; a refresh rewrites it where a captured graph reads it."""
    from qerl_kernels.decode import to_k_order

    model = _wide_model()
    layer = model.model.layers[1]
    g, down = layer.mlp._gate_up_lora, layer.mlp.down_proj
    assert torch.equal(g.a_k, to_k_order(g.a)) and torch.equal(down._cast[2], to_k_order(down._cast[0]))
    ptrs = g.a_k.data_ptr(), down._cast[2].data_ptr()
    _new_adapter_values(model)
    assert group_lora(model, torch.float32) == 2 * model.config.num_layers
    assert layer.mlp._gate_up_lora is g and (g.a_k.data_ptr(), down._cast[2].data_ptr()) == ptrs
    assert torch.equal(g.a_k, to_k_order(g.a)) and torch.equal(down._cast[2], to_k_order(down._cast[0]))


def test_grouped_lora_reads_korder_x():
    """The fused GEMM and the grouped shrink given x in K order: the same output as from natural x (up to the
    K sum's order), on the reference kernels; the natural A on K-order x would not be."""
    from qerl_kernels.decode import to_k_order

    model = _wide_model()
    mlp = model.model.layers[0].mlp
    g, fused = mlp._gate_up_lora, mlp._gate_up[0]
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    set_context(ForwardContext(is_prefill=True, slot_mapping=torch.zeros(5, dtype=torch.long)))
    try:
        assert g.takes_korder(x)
        with torch.no_grad():
            want = g.run(fused, x)
            got = g.run(fused, to_k_order(x), x_korder=True)
            wrong = g.add(to_k_order(x), fused(x))
    finally:
        set_context(None)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (wrong - want).abs().max() > 1e-2


def test_no_korder_copy_off_whole_k_steps(ids):
    """hidden 32 is not whole 128-column steps: no K-order A, so the norms keep writing natural order."""
    model = _model(True)
    group_lora(model, torch.float32)
    g, o = model.model.layers[0].self_attn._qkv_lora, model.model.layers[0].self_attn.o_proj
    x = torch.randn(2, 32)
    assert g.a_k is None and o._cast[2] is None and not g.takes_korder(x) and not o.takes_korder(x)
    with pytest.raises(ValueError, match="K-order A"):
        g.shrink_a(True)
