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
