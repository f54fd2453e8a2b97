"""--keep-activations N|auto: checks added after mutation-testing the feature (no GPU).

`auto`'s arithmetic (``choose``), its measurement on the first micro-batch (``AutoKeep.after_first`` and
``CausalLM.forward``'s kept-bytes count) and the training loop's notes, retries and out-of-memory error,
driven on CPU with faked torch.cuda memory counters as in tests/test_keep_activations_auto.py.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from qerl_cli.errors import OutOfMemoryError
from qerl_cli.train.activation_budget import GIB, AutoKeep, choose
from tests.test_keep_activations_auto import (
    FakeCudaDevice,
    _arm_boom,
    _fake_cuda_memory,
    _growing,
    _loop_inputs,
)
from tests.test_train_memory import step_inputs  # noqa: F401

MIB = 2**20


# ---- choose and tokens_for_all: the margin, the boundary----------------------------------------------
def test_choose_keeps_as_many_layers_as_fit_under_the_margin():
    kw = dict(n_layers=1000, resident=0, tokens=1000, largest_tokens=1000)
    # 100 GiB usable: margin 8% = 8 GiB -> budget 92; 10 GiB peak with one layer, 1/4 GiB per extra layer
    assert choose(**kw, peak_with_one=10 * GIB, per_layer=GIB // 4, usable=100 * GIB) == 1 + 82 * 4
    # 10 GiB usable: 8% is 0.8 GiB, the 1 GiB minimum applies -> budget 9; (9 - 5) / (1/8) = 32 more layers
    assert choose(**kw, peak_with_one=5 * GIB, per_layer=GIB // 8, usable=10 * GIB) == 33
    # a measured peak exactly at the budget still fits the one layer it was measured with
    assert choose(**kw, peak_with_one=10 * GIB, per_layer=GIB, usable=11 * GIB) == 1
    # and one byte over it keeps none
    assert choose(**kw, peak_with_one=10 * GIB + 1, per_layer=GIB, usable=11 * GIB) == 0


# ---- AutoKeep.after_first: what it reads from the allocator -----------------------------------------
def _fake_allocator(monkeypatch, allocated, peak, free, total, reserved):
    # the peak since the last reset: loading the model (or an earlier step) peaked at 70 GiB, before the
    # first micro-batch, which peaks at `peak`
    since_reset = [70 * GIB]
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: since_reset[0])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: since_reset.__setitem__(0, peak))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: reserved)


def _auto_on(n_layers, grad_bytes):
    model = SimpleNamespace(model=SimpleNamespace(layers=[None] * n_layers), keep_activations=0,
                            measure_kept=False, kept_bytes_per_layer=None)
    # a trained tensor whose gradient takes grad_bytes (an expanded view: no memory behind it)
    param = SimpleNamespace(grad=torch.zeros(1).expand(grad_bytes // 4))
    return model, AutoKeep(model, torch.device("cpu"), largest_tokens=8192, params=[param])


@pytest.mark.parametrize("n_layers,per_layer,want,fits", [(100, GIB // 2, 55, 4096), (20, GIB // 2, 20, None),
                                                          (4, 10 * GIB, 3, 7168)])
def test_after_first_sizes_by_the_device_memory_the_peak_and_a_copy_of_the_gradients(monkeypatch, n_layers, per_layer,
                                                                                       want, fits):
    # 10 GiB resident, 14 GiB peak with one layer kept at 4096 tokens; the device can give PyTorch
    # 50 GiB free + 30 GiB it already holds = 80 GiB, less 6.4 GiB margin; the gradients' copy takes 1 GiB.
    # At the largest micro-batch (8192 tokens): peak 11 + 4 * 2 = 19 GiB and twice per_layer a layer;
    # 1/2 GiB a layer: 1 + (73.6 - 19) // 1 = 55 layers.
    _fake_allocator(monkeypatch, allocated=10 * GIB, peak=14 * GIB, free=50 * GIB, total=80 * GIB,
                    reserved=30 * GIB)
    model, auto = _auto_on(n_layers, grad_bytes=1 * GIB)
    auto.before_first()
    assert (model.keep_activations, model.measure_kept, model.kept_bytes_per_layer) == (1, True, None)
    model.kept_bytes_per_layer = per_layer  # what the measured forward reports
    assert auto.after_first(4096) == want
    assert model.keep_activations == want and auto.chosen == want
    assert model.measure_kept is False  # later micro-batches do not measure again
    assert auto.note.startswith(
        f"--keep-activations auto: {want} of {n_layers} decoder layers keep their activations "
        f"({2 * per_layer / GIB:.2f} GiB each at 8192 tokens; first micro-batch's peak 14.0 GiB of 80.0 GiB "
        "usable)"), auto.note
    if fits:  # the micro-batch size at which every layer would fit: 73.6 - 10 GiB over (4 + (n - 1) per_layer) / 4096
        assert auto.note.endswith(f"; all {n_layers} would fit with --micro-batch-tokens {fits}"), auto.note
    else:  # every layer is kept: no hint to make the micro-batches smaller
        assert "would fit" not in auto.note, auto.note


def test_the_micro_batch_size_named_for_all_layers_is_the_largest_that_fits():
    from qerl_cli.train.activation_budget import tokens_for_all

    for n, act, per in [(2, GIB, GIB), (4, 2 * GIB, 3 * GIB), (8, GIB // 2, 2 * GIB)]:
        kw = dict(n_layers=n, resident=4 * GIB, peak_with_one=4 * GIB + act, per_layer=per, tokens=4096,
                  usable=40 * GIB)
        fits = tokens_for_all(**kw)

        def keeps(t, n=n, act=act, per=per):  # what choose() keeps, the measurement scaled to t tokens
            s = t / 4096
            return choose(n_layers=n, resident=4 * GIB, peak_with_one=int(4 * GIB + act * s), per_layer=int(per * s),
                          tokens=t, largest_tokens=t, usable=40 * GIB)
        assert fits and fits % 1024 == 0
        assert keeps(fits) == n and keeps(fits + 1024) < n, (n, fits)


# ---- CausalLM.forward: the kept layers' bytes -------------------------------------------------------
def test_the_forward_reports_the_mean_bytes_of_its_kept_layers(monkeypatch):
    from tests.test_train_memory import batch, grads_of, tiny_model

    model, params = tiny_model()
    ids, mask = batch()
    model.gradient_checkpointing = True
    n = len(model.model.layers)
    held = [GIB]  # a fake allocator: each layer's forward adds 8 MiB, kept or recomputed
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: held[0])
    for layer in model.model.layers:
        def grow(x, pos, real=layer.forward_stream):
            held[0] += 8 * MIB
            return real(x, pos)
        monkeypatch.setattr(layer, "forward_stream", grow)
    h0, g0 = grads_of(model, params, ids, mask)
    assert model.kept_bytes_per_layer is None  # not measuring: nothing recorded
    model.keep_activations, model.measure_kept = n, True
    h1, g1 = grads_of(model, params, ids, mask)
    assert model.kept_bytes_per_layer == 8 * MIB  # n kept layers took 8n MiB
    assert torch.equal(h0, h1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    model.keep_activations, model.measure_kept = 0, False


def test_the_forward_does_not_read_the_allocator_unless_measuring(monkeypatch):
    from tests.test_train_memory import batch, grads_of, tiny_model

    model, params = tiny_model()
    ids, mask = batch()
    model.gradient_checkpointing, model.keep_activations = True, 2

    def no(*a, **k):
        raise AssertionError("torch.cuda.memory_allocated read outside --keep-activations auto's measurement")

    monkeypatch.setattr(torch.cuda, "memory_allocated", no)
    grads_of(model, params, ids, mask)
    assert model.kept_bytes_per_layer is None
    model.keep_activations = 0


# ---- the training loop: notes, retries, the out-of-memory error -------------------------------------
def test_auto_says_its_choice_once_and_each_retry(monkeypatch, capsys):
    from qerl_cli.train_step import run_epochs

    _fake_cuda_memory(monkeypatch, allocated=_growing())
    cfg, model, params, opt, batch = _loop_inputs("auto")
    cfg = dataclasses.replace(cfg, progress=True, epochs=2)
    _arm_boom(monkeypatch, model, lambda keep, n: n == 2)
    capsys.readouterr()
    run_epochs(cfg, model, params, opt, batch, device=FakeCudaDevice("cpu"))
    err = capsys.readouterr().err
    assert err.count("--keep-activations auto: 3 of 3 decoder layers keep their activations") == 1, err
    assert err.count("out of GPU memory with 3 layers kept; running the micro-batch again with 1") == 1, err


def test_auto_sizes_by_the_largest_micro_batch_and_the_error_names_it(monkeypatch, capsys):
    from qerl_cli.train_step import run_epochs

    _fake_cuda_memory(monkeypatch, allocated=_growing())
    # one long sequence packed alone, the short ones together: micro-batches of different padded sizes
    cfg, model, params, opt, batch = _loop_inputs("auto", p_lens=[20] + [4] * 5, c_lens=[10] + [4] * 5, mbt=45)
    cfg = dataclasses.replace(cfg, progress=True)
    seen_tokens = []
    real = AutoKeep.after_first
    monkeypatch.setattr(AutoKeep, "after_first", lambda self, t: seen_tokens.append((t, self.largest_tokens))
                        or real(self, t))
    run_epochs(cfg, model, params, opt, batch, device=FakeCudaDevice("cpu"))
    # measured on the first micro-batch (the long sequence alone: 30 padded tokens), sized for the largest
    # (five short ones: 40 padded tokens)
    assert seen_tokens == [(30, 40)]
    assert "GiB each at 40 tokens" in capsys.readouterr().err

    # every try fails, even with no layer kept: auto gives up with the same error as without it
    cfg, model, params, opt, batch = _loop_inputs("auto", p_lens=[20] + [4] * 5, c_lens=[10] + [4] * 5, mbt=45)
    for layer in model.model.layers:
        monkeypatch.setattr(layer, "forward_stream", _raise_oom)
    with pytest.raises(OutOfMemoryError) as e:
        run_epochs(cfg, model, params, opt, batch, device=FakeCudaDevice("cpu"))
    assert "largest has 40 padded tokens" in str(e.value) and "--micro-batch-tokens (now 45)" in e.value.hint
    assert "kept" not in str(e.value) and "--keep-activations" not in e.value.hint  # none was kept at the end


def _raise_oom(*a, **k):
    raise torch.OutOfMemoryError("CUDA out of memory (test)")


def test_auto_on_a_rank_that_owns_no_micro_batch(monkeypatch):
    from qerl_cli.train.distributed import Dist
    from qerl_cli.train_step import run_epochs

    class LocalRank(Dist):  # no process group: the collectives leave this rank's own values
        def all_reduce_(self, t, op="sum"):
            return t

        def all_reduce_grads_(self, params):
            pass

    _fake_cuda_memory(monkeypatch)
    cfg, model, params, opt, batch = _loop_inputs("auto")
    n_mb = len(batch.groups)
    dist = LocalRank(rank=n_mb, world_size=n_mb + 1)
    assert not any(dist.owns(j) for j in range(n_mb))
    res = run_epochs(cfg, model, params, opt, batch, dist=dist, device=FakeCudaDevice("cpu"))
    assert res.losses == [0.0] and model.keep_activations == 0


# ---- the CLI value --------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["all", "1.5", "2e1"])
def test_cli_refuses_what_is_not_a_whole_number_or_auto(monkeypatch, tmp_path, bad):
    from typer.testing import CliRunner

    import qerl_cli.train_step as ts
    from qerl_cli.cli import app

    seen = []
    monkeypatch.setattr(ts, "train_step", lambda cfg: seen.append(cfg.keep_activations) or {"stage": "train-step"})
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = ["train-step", "--model", str(tmp_path), "--shards", str(tmp_path), "--out", str(tmp_path / "o")]
    r = CliRunner().invoke(app, base + ["--keep-activations", bad])
    assert r.exit_code == 2 and "whole number >= 0 or auto" in r.output, r.output
    assert seen == []


# ---- apply_memory_options on a model used before (bench_train.py runs several settings on one) --------
def _model_and_cfg(keep):
    from pathlib import Path

    from qerl_cli.layers.lora import LoraSpec
    from qerl_cli.models import ModelConfig, build_random_model
    from qerl_cli.train_step import TrainStepConfig
    from tests.test_train_memory import TINY

    model = build_random_model(ModelConfig(**TINY), device="cpu", dtype=torch.float32, quantized=False,
                               lora=LoraSpec(r=4, alpha=8))
    return model, TrainStepConfig(model=Path("-"), shards=[], out=Path("-"), keep_activations=keep)


def test_apply_memory_options_sets_the_count_each_time():
    from qerl_cli.errors import BadInputError
    from qerl_cli.train_step import apply_memory_options

    model, cfg = _model_and_cfg(2)
    n = len(model.model.layers)
    notes = apply_memory_options(cfg, model, "cpu")
    assert model.keep_activations == 2
    assert f"--keep-activations: the last 2 of {n} decoder layers keep their activations for the backward; " \
           f"the other {n - 2} are recomputed" in notes
    for keep in (0, "auto"):  # a later setting on the same model starts from no kept layer
        apply_memory_options(dataclasses.replace(cfg, keep_activations=keep), model, "cpu")
        assert model.keep_activations == 0
    apply_memory_options(dataclasses.replace(cfg, keep_activations=n), model, "cpu")  # every layer: allowed
    assert model.keep_activations == n
    with pytest.raises(BadInputError, match=f"the model has {n} decoder layers"):
        apply_memory_options(dataclasses.replace(cfg, keep_activations=n + 1), model, "cpu")


def test_auto_also_needs_gradient_checkpointing():
    from qerl_cli.errors import BadInputError
    from qerl_cli.train_step import _check_memory_flags

    _, cfg = _model_and_cfg("auto")
    with pytest.raises(BadInputError, match="--no-checkpointing"):
        _check_memory_flags(dataclasses.replace(cfg, gradient_checkpointing=False))


def test_too_many_kept_layers_is_refused_before_the_model_loads(step_inputs, monkeypatch, tmp_path):  # noqa: F811
    import qerl_cli.train_step as ts
    from qerl_cli.errors import BadInputError
    from tests.test_train_memory import _step

    def no_load(*a, **k):
        raise AssertionError("loaded the model before refusing --keep-activations")

    monkeypatch.setattr(ts, "_load", no_load)
    q, sh = step_inputs
    with pytest.raises(BadInputError, match=rf"--keep-activations 3: --model {q} has 2 decoder layers"):
        _step(q, sh, tmp_path / "o", device="cpu", keep_activations=3)
    assert not (tmp_path / "o").exists()


def _with_lora_dropout(model, p):
    n = 0
    for m in model.modules():
        if hasattr(m, "lora_A") and hasattr(m, "dropout"):
            m.dropout, n = torch.nn.Dropout(p), n + 1
    assert n


def test_a_retried_micro_batch_draws_the_same_dropout_masks(monkeypatch):
    from qerl_cli.train_step import run_epochs

    cfg, model, params, opt, batch = _loop_inputs(0)
    _with_lora_dropout(model, 0.3)
    ref = run_epochs(cfg, model, params, opt, batch, device="cpu")
    ref_params = [p.detach().clone() for p in params]
    _fake_cuda_memory(monkeypatch, allocated=_growing())
    cfg, model, params, opt, batch = _loop_inputs("auto")
    _with_lora_dropout(model, 0.3)
    seen = _arm_boom(monkeypatch, model, lambda keep, n: n == 2)
    res = run_epochs(cfg, model, params, opt, batch, device=FakeCudaDevice("cpu"))
    assert seen[:3] == [1, 3, 1]  # the second micro-batch ran twice
    assert res.losses == ref.losses and res.grad_norms == ref.grad_norms
    assert all(torch.equal(a.detach(), b) for a, b in zip(params, ref_params))


def test_auto_in_the_loop_leaves_room_for_the_gradients_copy(monkeypatch):
    from qerl_cli.train_step import run_epochs

    cfg, model, params, opt, batch = _loop_inputs("auto")
    grad_bytes = sum(p.numel() * p.element_size() for p in params)  # every trained tensor gets a gradient
    per = 10 * MIB  # _growing: the one kept layer measures as 10 MiB
    # micro-batches of equal size (no scaling); peak 3 GiB with one kept layer. The budget (usable less the
    # 1 GiB margin) leaves room for a second layer only if the gradients' copy is forgotten.
    usable = 4 * GIB + per + grad_bytes // 2
    _fake_cuda_memory(monkeypatch, allocated=_growing())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (usable, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: 0)
    seen = _arm_boom(monkeypatch, model, lambda keep, n: False)
    run_epochs(cfg, model, params, opt, batch, device=FakeCudaDevice("cpu"))
    assert seen[:2] == [1, 1]


def test_first_epoch_statistics_of_a_retried_micro_batch(monkeypatch):
    """The first epoch's per-token statistics (what metrics.json reports as entropy, is_ratio_*, is_capped,
    logprob_abs_diff_*) are added once per micro-batch, after the try that succeeded."""
    import math

    from qerl_cli.train_step import run_epochs

    _fake_cuda_memory(monkeypatch, allocated=_growing())
    cfg, model, params, opt, batch = _loop_inputs("auto")
    # the tiny model's log-probs are near log(1/256) = -5.5: sampled at -8 the IS ratio is ~12 (over the
    # cap of 2), at -1 it is ~0.01
    batch.sampling_logprobs = [[-8.0 if i % 2 == 0 else -1.0] * len(c) for i, c in enumerate(batch.completions)]
    n_tok = sum(len(c) for c in batch.completions)
    _arm_boom(monkeypatch, model, lambda keep, n: n == 2)
    acc = run_epochs(cfg, model, params, opt, batch, device=FakeCudaDevice("cpu")).acc
    s, lo, hi = acc.sums, acc.mins, acc.maxs
    assert s["tokens"] == n_tok == 36
    assert s["is_capped"] == n_tok / 2
    assert 5.0 < s["entropy"] / n_tok < math.log(256) + 1e-4
    assert 5 < hi["is_ratio"] < 20 and 0.005 < lo["is_ratio"] < 0.02
    assert 0.4 < s["is_ratio"] / n_tok / hi["is_ratio"] < 0.6  # half the tokens near the max, half near 0
    # |old - sampling| is |log ratio|: largest for the ratio furthest below 1; the mean between 2.5 and 4.5
    assert hi["lp_abs_diff"] == pytest.approx(-math.log(lo["is_ratio"]), rel=1e-5)
    assert 2.4 < s["lp_abs_diff"] / n_tok < 4.6


def test_auto_says_its_choice_when_the_first_micro_batch_had_nothing_to_measure(monkeypatch, capsys):
    from qerl_cli.train_step import run_epochs

    _fake_cuda_memory(monkeypatch)
    # the longest sequences (packed first) have empty completions: no backward, auto measures the second
    cfg, model, params, opt, batch = _loop_inputs("auto", p_lens=[11] * 3 + [5] * 3, c_lens=[0] * 3 + [4] * 3)
    cfg = dataclasses.replace(cfg, progress=True)
    run_epochs(cfg, model, params, opt, batch, device=FakeCudaDevice("cpu"))
    err = capsys.readouterr().err
    assert err.count("--keep-activations auto: ") == 1 and "decoder layers keep their activations" in err, err
    assert "\n\n" not in err  # no empty note


def test_the_micro_batch_hint_counts_the_gradient_copy_as_the_choice_does(monkeypatch):
    """A mutation round's finding: the hint left out the gradient copy that choose() counts, so with large
    gradients it promised every layer at a size where auto would keep one fewer."""
    from types import SimpleNamespace

    from qerl_cli.train import activation_budget as ab

    gib = 2**30
    layers = [object()] * 20
    model = SimpleNamespace(model=SimpleNamespace(layers=layers), keep_activations=1, kept_bytes_per_layer=4 * gib,
                            measure_kept=True)
    params = [SimpleNamespace(grad=SimpleNamespace(numel=lambda: 5 * gib // 4, element_size=lambda: 4))]
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 14 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: 10 * gib)
    auto = ab.AutoKeep(model, torch.device("cpu"), largest_tokens=32768, params=params)
    auto.resident = 10 * gib
    chosen = auto.after_first(32768)
    assert chosen < 20 and "all 20 would fit with --micro-batch-tokens" in auto.note, auto.note
    fits = int(auto.note.rsplit(" ", 1)[-1])
    # measured again at the suggested size (activations scale with the tokens), auto keeps every layer
    s = fits / 32768
    again = ab.choose(n_layers=20, resident=15 * gib, peak_with_one=int(15 * gib + 4 * gib * s),
                      per_layer=int(4 * gib * s), tokens=fits, largest_tokens=fits, usable=80 * gib)
    assert again == 20
