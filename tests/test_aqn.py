"""AQN: the schedule, seeded reproducible noise vectors, w_clean + Z without accumulation, and it reaches the logits."""

from __future__ import annotations

import pytest
import torch

from qerl_cli.aqn import apply_noise, clear_noise, noise_vector, seed_for, sigma_at
from qerl_cli.models import ModelConfig, build_random_model


def _model(quantized=True):
    cfg = ModelConfig.from_hf(dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    return build_random_model(cfg, device="cpu", dtype=torch.float32, quantized=quantized, seed=0)


IDS = torch.arange(1, 13).view(2, 6)


def _logits(m):
    with torch.no_grad():
        return m.compute_logits(m.forward_train(IDS))


def test_schedule_values():
    # 100 steps, 10 stages -> 11 intervals of ~9.09 steps; interval 0 is noise-free.
    assert sigma_at(0, 100, 1e-2, 1e-4, 10) == 0.0
    assert sigma_at(9, 100, 1e-2, 1e-4, 10) == 0.0
    assert sigma_at(10, 100, 1e-2, 1e-4, 10) == pytest.approx(1e-2)
    assert sigma_at(99, 100, 1e-2, 1e-4, 10) == pytest.approx(1e-4)
    assert sigma_at(19, 100, 1e-2, 1e-4, 10) == pytest.approx(1e-2 * (1e-2) ** (1 / 9))
    vals = [sigma_at(s, 110, 1e-2, 1e-4, 10) for s in range(10, 110, 10)]
    assert all(a > b for a, b in zip(vals, vals[1:]))  # strictly annealed
    assert sigma_at(500, 100, 1e-2, 1e-4, 10) == pytest.approx(1e-4)  # past the end: last stage
    assert sigma_at(5, 10, 3e-3, 1e-4, 1) == 3e-3
    with pytest.raises(ValueError):
        sigma_at(-1, 100, 1e-2, 1e-4, 10)


def test_sigma_zero_changes_nothing():
    m = _model()
    clean = _logits(m)
    rec = apply_noise(m, 0.0, run_seed=1, step=3)
    assert rec == {"sigma": 0.0, "seed": 1, "step": 3, "norms": ["input_layernorm", "post_attention_layernorm"]}
    assert torch.equal(_logits(m), clean)


def test_noise_reaches_logits_and_clears():
    m = _model()
    clean = _logits(m)
    w = m.model.layers[0].input_layernorm.weight.clone()
    apply_noise(m, 1e-2, run_seed=1, step=3)
    noisy = _logits(m)
    assert (noisy - clean).abs().max() > 1e-4
    assert torch.equal(m.model.layers[0].input_layernorm.weight, w)  # the clean weight is untouched
    clear_noise(m)
    assert torch.equal(_logits(m), clean)


def test_same_seed_step_rebuilds_identical_vectors_and_no_accumulation():
    a, b = _model(), _model()
    apply_noise(a, 1e-2, run_seed=5, step=7)
    apply_noise(b, 1e-2, run_seed=5, step=7)
    apply_noise(b, 1e-2, run_seed=5, step=7)  # applying twice must not double the noise
    for la, lb in zip(a.model.layers, b.model.layers):
        assert torch.equal(la.input_layernorm.noise, lb.input_layernorm.noise)
        assert torch.equal(la.post_attention_layernorm.noise, lb.post_attention_layernorm.noise)
    assert torch.equal(_logits(a), _logits(b))
    z = a.model.layers[1].post_attention_layernorm.noise
    assert torch.equal(z, noise_vector(32, 1e-2, 5, 7, 1, "post_attention_layernorm"))
    assert z.std().item() == pytest.approx(1e-2, rel=0.5)


def test_vectors_differ_per_step_layer_and_norm():
    seeds = {seed_for(5, s, i, n) for s in (0, 1) for i in (0, 1) for n in ("input_layernorm", "post_attention_layernorm")}
    assert len(seeds) == 8
    a, b = _model(), _model()
    apply_noise(a, 1e-2, run_seed=5, step=7)
    apply_noise(b, 1e-2, run_seed=5, step=8)
    assert not torch.equal(a.model.layers[0].input_layernorm.noise, b.model.layers[0].input_layernorm.noise)
    assert not torch.equal(a.model.layers[0].input_layernorm.noise, a.model.layers[0].post_attention_layernorm.noise)


def test_small_noise_survives_bf16():
    """sigma 1e-4 on a ~1.0 weight would round away in bf16 arithmetic; the fp32 slot keeps it."""
    cfg = ModelConfig.from_hf(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    m = build_random_model(cfg, device="cpu", dtype=torch.bfloat16, quantized=False, seed=0)
    clean = _logits(m)
    apply_noise(m, 1e-3, run_seed=1, step=1)
    assert not torch.equal(_logits(m), clean)


def test_rollout_summary_shows_a_small_sigma_that_is_on():
    # A fixed 6 decimals printed "AQN sigma 0.000000" for sigma 4e-7, which the records carry and train-step
    # applies (review, session 52); sigmas under 1e-5 showed one significant digit at most.
    from rich.console import Console

    from qerl_cli.rollout import summary_table

    def shown(sigma):
        s = {"groups": 1, "completions": 2, "reward": {"mean": 0.5, "std": 0.5}, "rewards": {},
             "completion_tokens": {"mean": 4.0, "p50": 4, "min": 4, "max": 4}, "truncated_fraction": 0.0,
             "zero_variance_group_fraction": 0.0, "sigma": sigma}
        console = Console(record=True, width=200)
        console.print(summary_table(s))
        return next(line for line in console.export_text().splitlines() if "AQN sigma" in line)

    assert "4e-07" in shown(4e-7) and "0.00215" in shown(2.154434690031884e-3) and " 0 " in shown(0.0)
