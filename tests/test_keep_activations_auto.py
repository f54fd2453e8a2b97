"""--keep-activations auto inside the training loop, on CPU: its measurement, its out-of-memory retries and
the checks around it (the first four tests are a review's reproductions, session 47).

`auto` only acts on CUDA, so the loop is driven with a device string that reads "cuda:0" to
``str(device).startswith("cuda")`` while torch itself parses "cpu", and the few torch.cuda memory calls
AutoKeep makes are faked. Nothing here needs a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qerl_cli.errors import BadInputError, OutOfMemoryError
from tests.test_train_memory import TINY


class FakeCudaDevice(str):
    """torch parses the characters ("cpu"); the loop's `str(device).startswith("cuda")` sees cuda."""

    def __str__(self):
        return "cuda:0"


def _fake_cuda_memory(monkeypatch, allocated=lambda: 2**30):
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: allocated())
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (70 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: 4 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # retry_with_fewer's empty_cache


def _loop_inputs(keep, n_seq=6, p_len=5, c_len=6, mbt=33, c_lens=None, p_lens=None):
    from qerl_cli.layers.lora import LoraSpec
    from qerl_cli.models import ModelConfig, build_random_model
    from qerl_cli.train.advantages import group_advantages
    from qerl_cli.train.batching import pack_microbatches
    from qerl_cli.train.losses import sequence_weights
    from qerl_cli.train.optim import make_optimizer
    from qerl_cli.train_step import StepBatch, TrainStepConfig, _trainable, apply_memory_options

    model = build_random_model(ModelConfig(**TINY), device="cpu", dtype=torch.float32, quantized=False,
                               lora=LoraSpec(r=4, alpha=8))
    named = _trainable(model, False)
    cfg = TrainStepConfig(model=Path("-"), shards=[], out=Path("-"), micro_batch_tokens=mbt, progress=False,
                          keep_activations=keep)
    apply_memory_options(cfg, model, "cuda:0")
    model.train()
    g = torch.Generator().manual_seed(0)
    p_lens, c_lens = p_lens or [p_len] * n_seq, c_lens or [c_len] * n_seq
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in p_lens]
    comps = [torch.randint(0, 256, (n,), generator=g).tolist() for n in c_lens]
    groups = pack_microbatches([a + b for a, b in zip(p_lens, c_lens)], mbt)
    assert len(groups) >= 2
    adv = group_advantages([float(i % 2) for i in range(n_seq)], ["g"] * n_seq, scale="group")
    mb_of = [0] * n_seq
    for j, grp in enumerate(groups):
        for i in grp:
            mb_of[i] = j
    weight = sequence_weights("dapo", c_lens, mb_of).float()
    batch = StepBatch(groups=groups, prompts=prompts, completions=comps, sampling_logprobs=[[-1.0] * n for n in c_lens],
                      inv_temp=torch.ones(n_seq), adv=adv.values, weight=weight)
    return cfg, model, [p for _, p in named], make_optimizer(named, lr=1e-3), batch


# ---- 1. an out-of-memory while `auto` is still measuring is blamed on a count auto "chose" -----------
def test_oom_in_the_measuring_micro_batch_is_not_a_count_auto_chose(monkeypatch):
    from qerl_cli.train_step import run_epochs

    _fake_cuda_memory(monkeypatch)
    cfg, model, params, opt, batch = _loop_inputs("auto")
    last = model.model.layers[-1]

    def oom(*a, **k):  # the first micro-batch (one layer kept to measure it) runs out of memory
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(last, "forward_stream", oom)
    with pytest.raises(OutOfMemoryError) as e:
        run_epochs(cfg, model, params, opt, batch, device=FakeCudaDevice("cpu"))
    msg = f"{e.value} {getattr(e.value, 'hint', '')}"
    # auto had chosen nothing yet: the one kept layer was its own measurement
    assert "chosen by --keep-activations auto" not in msg, msg
    assert "1 layers" not in msg, msg


# ---- 2. numpy integers: every other int field takes them, keep_activations refuses them ---------------
def test_keep_activations_takes_a_numpy_integer_like_every_other_int_field():
    np = pytest.importorskip("numpy")
    from qerl_cli.train_step import TrainStepConfig, _check_memory_flags

    c = TrainStepConfig(model=Path("m"), shards=[], out=Path("o"), epochs=np.int64(2), keep_activations=np.int64(2))
    assert c.epochs == 2 and type(c.epochs) is int  # check_field_types converts numpy scalars (runtime.py)
    _check_memory_flags(c)  # BadInputError: "--keep-activations must be a whole number >= 0 or auto, got np.int64(2)"
    assert c.keep_activations == 2 and type(c.keep_activations) is int


# ---- 3. apply_memory_options (public, used alone by bench_train.py) does not validate the count ------
@pytest.mark.parametrize("kw", [dict(gradient_checkpointing=False, keep_activations=2), dict(keep_activations=-1),
                                dict(keep_activations=True)])
def test_apply_memory_options_refuses_what_train_step_refuses(kw):
    from qerl_cli.layers.lora import LoraSpec
    from qerl_cli.models import ModelConfig, build_random_model
    from qerl_cli.train_step import TrainStepConfig, apply_memory_options

    model = build_random_model(ModelConfig(**TINY), device="cpu", dtype=torch.float32, quantized=False,
                               lora=LoraSpec(r=4, alpha=8))
    cfg = TrainStepConfig(model=Path("-"), shards=[], out=Path("-"), **kw)
    # today: no error; with checkpointing off the note says "the last 2 of 3 decoder layers keep their
    # activations ...; the other 1 are recomputed" (none is), and bench_train.py labels such a row
    # "2 layers kept, no checkpointing"; -1 says "the last -1 of 3 ... the other 4 are recomputed"
    with pytest.raises(BadInputError):
        apply_memory_options(cfg, model, "cpu")


# ---- 4. auto sizes the whole step on a first micro-batch that ran no backward ----------------------
def test_auto_measures_on_a_micro_batch_that_ran_a_backward(monkeypatch):
    from qerl_cli.train import activation_budget as ab
    from qerl_cli.train_step import run_epochs

    _fake_cuda_memory(monkeypatch)
    # the longest sequences (packed first) have empty completions: their loss has no graph, no backward runs
    cfg, model, params, opt, batch = _loop_inputs("auto", p_lens=[11] * 3 + [5] * 3, c_lens=[0] * 3 + [4] * 3)
    assert batch.groups[0] == [0, 1, 2]
    last = model.model.layers[-1]
    real, kept_fwd_with_grad = last.forward_stream, []

    def spy(x, pos):
        kept_fwd_with_grad.append(torch.is_grad_enabled())
        return real(x, pos)

    monkeypatch.setattr(last, "forward_stream", spy)
    at_measure, orig = [], ab.AutoKeep.after_first

    def after_first(self, tokens):
        at_measure.append(any(p.grad is not None for p in params))  # has any backward run yet?
        return orig(self, tokens)

    monkeypatch.setattr(ab.AutoKeep, "after_first", after_first)
    run_epochs(cfg, model, params, opt, batch, device=FakeCudaDevice("cpu"))
    # the kept layer's forward ran with grad in that micro-batch (on CUDA kept_bytes_per_layer > 0), so
    # choose()'s "nothing measured" guard does not fire, yet the measured peak holds no backward at all
    assert kept_fwd_with_grad[0] is True
    assert at_measure == [True], "auto chose its count from a forward-only micro-batch"


# ---- out-of-memory retries -------------------------------------------------------------------------
class _BoomInBackward(torch.autograd.Function):
    """Identity forward; its backward runs out of memory, after the layers behind it added their grads."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")


def _arm_boom(monkeypatch, model, when):
    """Wrap the last layer's input in _BoomInBackward whenever ``when(keep)`` says so; returns the keeps seen."""
    last = model.model.layers[-1]
    real, seen = last.forward_stream, []

    def patched(x, pos):
        seen.append(model.keep_activations)
        if when(model.keep_activations, len(seen)):
            x = _BoomInBackward.apply(x)
        return real(x, pos)

    monkeypatch.setattr(last, "forward_stream", patched)
    return seen


def _growing():
    """memory_allocated that grows 10 MiB a call: the kept layer measures as 10 MiB, so auto keeps all 3."""
    n = [2**30]

    def allocated():
        n[0] += 10 * 2**20
        return n[0]
    return allocated


def _reference(monkeypatch):
    from qerl_cli.train_step import run_epochs

    cfg, model, params, opt, batch = _loop_inputs(0)
    res = run_epochs(cfg, model, params, opt, batch, device="cpu")
    return res, [p.detach().clone() for p in params]


def _spy_retries(monkeypatch):
    from qerl_cli.train import activation_budget as ab

    notes, real = [], ab.AutoKeep.retry_with_fewer

    def spy(self, saved):
        notes.append(real(self, saved))
        return notes[-1]

    monkeypatch.setattr(ab.AutoKeep, "retry_with_fewer", spy)
    return notes


def test_auto_runs_a_micro_batch_that_ran_out_of_memory_again_with_half_the_layers_to_the_same_bits(monkeypatch):
    from qerl_cli.train_step import run_epochs

    ref, ref_params = _reference(monkeypatch)
    _fake_cuda_memory(monkeypatch, allocated=_growing())
    cfg, model, params, opt, batch = _loop_inputs("auto")
    # the second micro-batch's first try (all 3 layers kept, as auto chooses with this much memory) fails in
    # its backward, after the last layer's LoRA grads were added
    seen = _arm_boom(monkeypatch, model, lambda keep, n: n == 2)
    notes = _spy_retries(monkeypatch)
    res = run_epochs(cfg, model, params, opt, batch, device=FakeCudaDevice("cpu"))
    assert seen[:3] == [1, 3, 1]  # measured with one kept, chose 3, ran again with 1
    assert notes == ["--keep-activations auto: out of GPU memory with 3 layers kept; running the micro-batch again with 1"]
    assert model.keep_activations == 1
    assert (res.kept_layers, res.keep_retries) == (1, 1)  # what the manifest records
    assert res.losses == ref.losses and res.grad_norms == ref.grad_norms
    for a, b in zip(params, ref_params):
        assert torch.equal(a.detach(), b)  # the partial grads of the failed try were put back


def test_auto_halves_down_to_none_and_a_miss_while_measuring_keeps_none(monkeypatch):
    from qerl_cli.train_step import run_epochs

    ref, ref_params = _reference(monkeypatch)
    _fake_cuda_memory(monkeypatch, allocated=_growing())
    cfg, model, params, opt, batch = _loop_inputs("auto")
    seen = _arm_boom(monkeypatch, model, lambda keep, n: keep > 0)  # every try with a kept layer fails
    notes = _spy_retries(monkeypatch)
    res = run_epochs(cfg, model, params, opt, batch, device=FakeCudaDevice("cpu"))
    assert seen[:2] == [1, 0]  # the measuring try failed: no layer kept from then on, no second measurement
    assert set(seen[1:]) == {0}
    assert len(notes) == 1 and "with 1 layers kept; running the micro-batch again with 0" in notes[0]
    assert res.losses == ref.losses
    for a, b in zip(params, ref_params):
        assert torch.equal(a.detach(), b)


@pytest.mark.parametrize("keep,layers,their", [(2, "2 layers", "their"), (1, "1 layer", "its")])
def test_an_explicit_count_is_not_lowered_and_its_error_names_it(monkeypatch, keep, layers, their):
    from qerl_cli.train_step import run_epochs

    _fake_cuda_memory(monkeypatch)
    cfg, model, params, opt, batch = _loop_inputs(keep)
    _arm_boom(monkeypatch, model, lambda keep, n: True)
    with pytest.raises(OutOfMemoryError) as e:
        run_epochs(cfg, model, params, opt, batch, device=FakeCudaDevice("cpu"))
    assert f"; {layers} kept {their} activations)" in str(e.value), str(e.value)
    assert f"--keep-activations N below the {layers} kept now" in e.value.hint


def test_under_torchrun_each_rank_names_itself_in_auto_notes(monkeypatch, capsys):
    import dataclasses

    from qerl_cli.train.distributed import Dist
    from qerl_cli.train_step import run_epochs

    class LocalRank1(Dist):  # rank 1 of 2 without a process group: the collectives leave its own values
        def all_reduce_(self, t, op="sum"):
            return t

        def all_reduce_grads_(self, params):
            pass

    _fake_cuda_memory(monkeypatch, allocated=_growing())
    cfg, model, params, opt, batch = _loop_inputs("auto", n_seq=18)  # rank 1 owns 3 of 6 micro-batches
    cfg = dataclasses.replace(cfg, progress=True)
    _arm_boom(monkeypatch, model, lambda keep, n: n == 2)
    run_epochs(cfg, model, params, opt, batch, dist=LocalRank1(rank=1, world_size=2), device=FakeCudaDevice("cpu"))
    err = capsys.readouterr().err
    assert "rank 1: --keep-activations auto: 3 of 3 decoder layers keep their activations" in err, err
    assert "rank 1: --keep-activations auto: out of GPU memory with 3 layers kept" in err, err
