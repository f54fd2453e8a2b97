"""train-step --keep-activations: under gradient checkpointing the last N decoder layers keep their
activations instead of being recomputed. Same forward, same gradients bit for bit, fewer recomputes."""

from __future__ import annotations

import pytest
import torch

from tests.test_train_memory import (  # noqa: F401
    CUDA_TINY,
    TINY,
    _step,
    batch,
    cuda_model,
    grads_of,
    step_inputs,
    tiny_model,
)


def _count_recomputes(model, monkeypatch):
    from qerl_cli.models import decoder

    calls = []
    real = decoder.checkpoint

    def counting(fn, *args):
        calls.append(fn)
        return real(fn, *args)

    monkeypatch.setattr(decoder, "checkpoint", counting)
    return calls


@pytest.mark.parametrize("quantized,dropout,train_norms", [(True, 0.0, False), (False, 0.2, True)])
def test_kept_layers_give_the_checkpointed_gradients_bit_for_bit(quantized, dropout, train_norms, monkeypatch):
    model, params = tiny_model(quantized, dropout, train_norms=train_norms)
    ids, mask = batch()
    model.gradient_checkpointing = True
    calls = _count_recomputes(model, monkeypatch)
    h0, g0 = grads_of(model, params, ids, mask)
    n = TINY["num_layers"]
    assert len(calls) == n
    for keep in (1, n):
        calls.clear()
        model.keep_activations = keep
        h1, g1 = grads_of(model, params, ids, mask)
        assert len(calls) == n - keep  # only the first n - keep layers went through a checkpoint
        assert torch.equal(h0, h1)
        for a, b in zip(g0, g1):
            assert a.abs().sum() > 0
            assert torch.equal(a, b)
    model.keep_activations = 0


def test_kept_layers_park_nothing_in_the_offloader():
    from qerl_cli.train.offload import ActivationOffloader

    model, params = tiny_model()
    ids, mask = batch()
    model.gradient_checkpointing = True
    h0, g0 = grads_of(model, params, ids, mask)
    off = model.activation_offload = ActivationOffloader("cpu", min_bytes=1)
    model.keep_activations = 2
    h1, g1 = grads_of(model, params, ids, mask)
    # the one recomputed layer's input is the only tensor parked (the kept layers' activations stay put)
    assert off.stats["packed"] == TINY["num_layers"] - 2
    assert torch.equal(h0, h1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    model.activation_offload, model.keep_activations = None, 0


def test_keep_activations_flag(step_inputs, tmp_path, capsys):  # noqa: F811
    from typer.testing import CliRunner

    from qerl_cli.cli import app

    q, sh = step_inputs
    a = _step(q, sh, tmp_path / "a", device="cpu")
    capsys.readouterr()
    b = _step(q, sh, tmp_path / "b", device="cpu", keep_activations=1)
    assert "--keep-activations: the last 1 of 2 decoder layers keep their activations" in capsys.readouterr().err
    assert a["fingerprint"] == b["fingerprint"]  # the same result: toggling it is not a new step
    assert a["keep_activations"] == {"asked": 0, "kept": 0, "retries": 0}  # how it ran, in the manifest
    assert b["keep_activations"] == {"asked": 1, "kept": 1, "retries": 0}
    for f in ("adapter_model.safetensors", "optimizer.safetensors"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    # a rerun into the same --out with another N finds the step done
    again = _step(q, sh, tmp_path / "b", device="cpu", keep_activations=2)
    assert again.get("already_done") is True

    run = CliRunner().invoke
    base = ["train-step", "--model", str(q), "--shards", str(sh), "--device", "cpu"]
    res = run(app, base + ["--out", str(tmp_path / "c"), "--keep-activations", "3"])
    assert res.exit_code == 2 and "--keep-activations 3" in res.output and "has 2 decoder layers" in res.output
    res = run(app, base + ["--out", str(tmp_path / "d"), "--keep-activations", "1", "--no-checkpointing"])
    assert res.exit_code == 2 and "--no-checkpointing" in res.output
    res = run(app, base + ["--out", str(tmp_path / "e"), "--keep-activations", "-1"])
    assert res.exit_code == 2 and ">= 0" in res.output
    for d in "cde":
        assert not (tmp_path / d).exists()
    res = run(app, ["train-step", "--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})
    assert "--keep-activations" in res.output


@pytest.mark.gpu
@pytest.mark.parametrize("quantized", [True, False])
def test_kept_layers_are_bit_identical_on_cuda_and_hold_more_memory(quantized):
    """bf16 on the GPU, the math SDPA backend (flash's backward is not deterministic): every N from 0 to
    all layers gives the same hidden states and gradients, and keeping layers raises the peak."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, params = cuda_model(quantized)
    ids, mask = batch(b=4, seq=512, vocab=CUDA_TINY["vocab_size"], device="cuda")
    n = CUDA_TINY["num_layers"]
    peaks = {}
    with sdpa_kernel([SDPBackend.MATH]):
        ref = None
        for keep in (0, 2, n, 0):
            model.keep_activations = keep
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            h, g = grads_of(model, params, ids, mask)
            torch.cuda.synchronize()
            peaks[keep] = torch.cuda.max_memory_allocated()
            if ref is None:
                ref = (h, g)
                continue
            assert torch.equal(ref[0], h)
            for a, b in zip(ref[1], g):
                assert torch.equal(a, b)
    model.keep_activations = 0
    assert peaks[n] > peaks[2] > peaks[0]


# ---- --keep-activations auto -----------------------------------------------------------------------
def test_auto_keeps_what_fits_scaled_to_the_largest_micro_batch():
    from qerl_cli.train.activation_budget import GIB, choose

    kw = dict(n_layers=28, resident=6 * GIB, peak_with_one=10 * GIB, per_layer=1 * GIB, tokens=8192,
              largest_tokens=8192)
    # 80 GiB usable, margin 8% (6.4 GiB): (73.6 - 10) // 1 = 63 more layers -> all 28
    assert choose(**kw, usable=80 * GIB) == 28
    # 30 GiB: budget 28 GiB (the 1 GiB minimum is smaller than 8%), 1 + (27.6 - 10) // 1 = 18
    assert choose(**kw, usable=30 * GIB) == 1 + int((30 * 0.92 - 10) // 1)
    # the largest micro-batch has twice the tokens: the activations double, the resident part does not
    big = dict(kw, largest_tokens=16384)
    assert choose(**big, usable=30 * GIB) == 1 + int((30 * 0.92 - (6 + 4 * 2)) // 2)
    # the peak alone is over the budget: recompute everything
    assert choose(**kw, usable=10 * GIB) == 0
    # the margin is at least 1 GiB: 11.5 GiB usable leaves 10.5, one layer at most
    assert choose(**kw, usable=int(11.5 * GIB)) == 1
    # nothing measured (a micro-batch run without grad): no layer kept
    assert choose(**dict(kw, per_layer=0), usable=80 * GIB) == 0
    # a first micro-batch larger than the largest never scales down
    assert choose(**dict(kw, tokens=16384, largest_tokens=8192), usable=30 * GIB) == choose(**kw, usable=30 * GIB)


def test_auto_is_a_logged_no_op_on_cpu(step_inputs, tmp_path, capsys):  # noqa: F811
    q, sh = step_inputs
    a = _step(q, sh, tmp_path / "a", device="cpu")
    capsys.readouterr()
    b = _step(q, sh, tmp_path / "b", device="cpu", keep_activations="auto")
    assert "--keep-activations auto: no effect on cpu (every layer is recomputed)" in capsys.readouterr().err
    assert b["keep_activations"] == {"asked": "auto", "kept": 0, "retries": 0}
    assert a["fingerprint"] == b["fingerprint"]
    assert (tmp_path / "a" / "adapter_model.safetensors").read_bytes() == \
        (tmp_path / "b" / "adapter_model.safetensors").read_bytes()


@pytest.mark.parametrize("bad", ["Auto ", "some", -1, 1.5, True, None])
def test_keep_activations_values_refused_from_python(step_inputs, tmp_path, bad):  # noqa: F811
    from qerl_cli.errors import BadInputError

    q, sh = step_inputs
    if bad == "Auto ":  # the CLI lower-cases and strips; the Python API takes the one spelling
        with pytest.raises(BadInputError, match="whole number >= 0 or auto"):
            _step(q, sh, tmp_path / "o", device="cpu", keep_activations=bad)
        return
    with pytest.raises(BadInputError, match="keep.activations"):
        _step(q, sh, tmp_path / "o", device="cpu", keep_activations=bad)
    assert not (tmp_path / "o").exists()


def test_keep_activations_cli_values_reach_the_config(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import qerl_cli.train_step as ts
    from qerl_cli.cli import app

    seen = []
    monkeypatch.setattr(ts, "train_step", lambda cfg: seen.append(cfg.keep_activations) or {"stage": "train-step"})
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = ["train-step", "--model", str(tmp_path), "--shards", str(tmp_path), "--out", str(tmp_path / "o")]
    for flag, want in (("auto", "auto"), (" AUTO", "auto"), ("5", 5), ("0", 0)):
        r = CliRunner().invoke(app, base + ["--keep-activations", flag])
        assert r.exit_code == 0, r.output
        assert seen[-1] == want
    r = CliRunner().invoke(app, base + ["--keep-activations", "most"])
    assert r.exit_code == 2 and "whole number >= 0 or auto, got 'most'" in r.output
    assert len(seen) == 4


@pytest.mark.gpu
def test_auto_on_cuda_keeps_every_layer_of_a_small_model_and_changes_no_result(step_inputs, tmp_path, capsys):  # noqa: F811
    q, sh = step_inputs
    a = _step(q, sh, tmp_path / "a", device="cuda")["metrics"]
    capsys.readouterr()
    b = _step(q, sh, tmp_path / "b", device="cuda", keep_activations="auto")["metrics"]
    err = capsys.readouterr().err
    assert "--keep-activations auto: 2 of 2 decoder layers keep their activations" in err, err
    assert a["loss"] == b["loss"] and a["entropy"] == b["entropy"]
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)  # flash attention's backward may not be exact


@pytest.mark.gpu
def test_kept_bytes_per_layer_grow_with_the_tokens():
    model, params = cuda_model()
    model.keep_activations, model.measure_kept = 2, True
    sizes = {}
    for seq in (256, 512):
        ids, mask = batch(b=4, seq=seq, vocab=CUDA_TINY["vocab_size"], device="cuda")
        grads_of(model, params, ids, mask)
        sizes[seq] = model.kept_bytes_per_layer
    model.keep_activations, model.measure_kept = 0, False
    assert sizes[256] > 0
    assert 1.8 < sizes[512] / sizes[256] < 2.2  # activations are linear in the tokens (no [L, L] attention matrix)


def test_the_micro_batch_at_which_every_layer_fits_is_what_choose_would_keep_all_at():
    from qerl_cli.train.activation_budget import GIB, choose, tokens_for_all

    kw = dict(n_layers=28, resident=6 * GIB, peak_with_one=16 * GIB, per_layer=3 * GIB, tokens=24576, usable=79 * GIB)
    fits = tokens_for_all(**kw)
    assert fits % 1024 == 0 and 0 < fits < 24576
    # measured at 24576 tokens, then scaled down to `fits`: choose() keeps all 28; 1024 tokens more would not
    def at(t):
        s = t / 24576
        return choose(n_layers=28, resident=kw["resident"], peak_with_one=int(kw["resident"] + 10 * GIB * s),
                      per_layer=int(3 * GIB * s), tokens=t, largest_tokens=t, usable=kw["usable"])
    assert at(fits) == 28 and at(fits + 1024) < 28
    assert tokens_for_all(**dict(kw, usable=6 * GIB)) is None  # the resident part alone is over the budget
    assert tokens_for_all(**dict(kw, per_layer=0)) is None
