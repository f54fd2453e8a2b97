"""train-step checks and records that survived mutation testing (round 5, ``qerl_cli/train_step.py``).

Covers: flags refused before anything is read, shards that mix steps/policies/noise, the warnings a
step prints (missing shard files, shards of another step), the LoRA defaults and resume flags, what
makes a rerun "already done" (every shard file, the adapter's optimizer state), the --metrics-file
line of an already done step, the metrics record's fields, and the loop's capped-ratio count and
non-finite gradient check (on a fake one-parameter policy).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from types import SimpleNamespace

import pytest
import torch

from qerl_cli.adapters import adapter_hash
from qerl_cli.errors import BadInputError, LineageError, NumericalError, OutputExistsError, QerlWarning
from qerl_cli.shards import read_records, shard_name, write_records
from qerl_cli.train_step import TrainStepConfig, read_step
from tests.train_fixtures import make_shard, quick_step


def _state(adapter_dir) -> dict:
    return json.loads((adapter_dir / "trainer_state.json").read_text())


def _edit_record(shard_dir, index: int, **changes):
    """Rewrite record ``index`` of a one-file shard dir: ``changes`` maps a field to a function of its value."""
    path = shard_dir / shard_name(0, 1)
    recs = read_records(path)
    for k, f in changes.items():
        recs[index][k] = f(recs[index][k])
    path.unlink()
    write_records(path, recs)


def _split_shards(shard_dir, out, num_shards: int, keep: int | None = None):
    """``shard_dir``'s records as ``shard-i-of-num_shards`` files in ``out``, one group per file (only the
    first ``keep`` files written)."""
    groups: dict[str, list] = {}
    for r in read_records(shard_dir):
        groups.setdefault(r["group_id"], []).append(r)
    out.mkdir(parents=True)
    files = []
    for i, recs in enumerate(list(groups.values())[: keep if keep is not None else num_shards]):
        files.append(out / shard_name(i, num_shards))
        write_records(files[-1], recs)
    return files


@pytest.fixture(scope="module")
def first(qmodel, tmp_path_factory):
    """A fresh step 0 with the default LoRA layout, TIS off and no KL: its dir, shard and metrics."""
    q, h = qmodel
    root = tmp_path_factory.mktemp("first")
    sh = make_shard(root / "sh", h, seed=1, groups=3)
    m = quick_step(q, sh, root / "a1", lora_rank=None, tis_cap=0.0)
    return SimpleNamespace(q=q, h=h, sh=sh, out=root / "a1", metrics=m["metrics"])


def _step(first, shards, out, **kw):
    """A quick step on ``first``'s model with the default LoRA layout (the one ``first.out`` has)."""
    return quick_step(first.q, shards, out, lora_rank=None, **kw)


def _resume_shard(first, tmp_path, step=1):
    return make_shard(tmp_path / f"sh{step}", first.h, adapter_hash=adapter_hash(first.out), step=step, seed=2, groups=2)


# ---- flags refused up front --------------------------------------------------------------------
@pytest.mark.parametrize("kw,flag", [
    (dict(scale_rewards="everything"), "--scale-rewards"),
    (dict(epochs=0), "--epochs"),
    (dict(lr=math.inf), "--lr"),
    (dict(baseline="fp8"), "--baseline"),
    (dict(lora_dropout=1.0), "--lora-dropout"),
    (dict(max_grad_norm=math.inf), "--max-grad-norm"),
    (dict(adam_beta2=1.0), "--adam-beta1/--adam-beta2"),
    (dict(micro_batch_tokens=0), "--micro-batch-tokens"),
])
def test_an_out_of_range_flag_is_bad_input_naming_it(tmp_path, kw, flag):
    from qerl_cli.train_step import train_step

    cfg = TrainStepConfig(model=tmp_path / "m", shards=[str(tmp_path / "sh")], out=tmp_path / "o", progress=False, **kw)
    with pytest.raises(BadInputError, match=f"^{flag} must"):
        train_step(cfg)


# ---- shards of one step ------------------------------------------------------------------------
_NOISE = {"sigma": 0.05, "seed": 3, "step": 0, "norms": []}


@pytest.mark.parametrize("field,edit,error,match", [
    ("policy", lambda p: dict(p, base="0" * 64), LineageError, "shards mix base models"),
    ("policy", lambda p: dict(p, adapter="f" * 64), LineageError, "shards mix policies"),
    ("policy", lambda p: dict(p, norms="e" * 64), LineageError, "shards mix policies"),
    ("step", lambda s: s + 1, BadInputError, "shards mix rollout steps"),
    ("noise", lambda n: dict(n, seed=4), BadInputError, "shards mix AQN noise records"),
    ("noise", lambda n: dict(n, rounded_to="bfloat16"), BadInputError, "shards mix AQN noise records"),
])
def test_shards_mixing_records_of_two_steps_or_policies_are_refused(tmp_path, field, edit, error, match):
    sh = make_shard(tmp_path / "sh", "b" * 64, groups=2, noise=_NOISE)
    _edit_record(sh, 5, **{field: edit})
    with pytest.raises(error, match=match):
        read_step(TrainStepConfig(model=tmp_path / "m", shards=[str(sh)], out=tmp_path / "o", progress=False))


def test_shards_of_two_steps_are_refused_naming_both_files_and_lines(tmp_path):
    # Two steps' rollouts in one --shards list: the error named "record 12" (an index over every file) and
    # "None" for no adapter; it names each record's file:line and the two rollout steps.
    a = make_shard(tmp_path / "s0", "b" * 64, groups=2)
    b = make_shard(tmp_path / "s1", "b" * 64, adapter_hash="f" * 64, step=1, groups=2, seed=1)
    for r in (recs := read_records(b)):
        r["group_id"] = "x" + r["group_id"]
    (b / shard_name(0, 1)).unlink()
    write_records(b / shard_name(0, 1), recs)
    cfg = TrainStepConfig(model=tmp_path / "m", shards=[str(a), str(b)], out=tmp_path / "o", progress=False)
    with pytest.raises(LineageError) as e:
        read_step(cfg)
    msg = str(e.value)
    assert f"{b / shard_name(0, 1)}:1" in msg and f"{a / shard_name(0, 1)}:1" in msg
    assert "no adapter" in msg and "rollout steps 1 and 0" in msg and "None" not in msg


def test_dr_grpo_length_is_the_longest_completion_when_a_record_has_no_budget():
    from qerl_cli.train_step import dr_grpo_length

    cfg = SimpleNamespace(loss="dr_grpo", max_completion_length=None)
    data = SimpleNamespace(completion_lengths=[3, 5],
                           records=[{"sampling": {"max_new_tokens": 8}}, {"sampling": {}}])
    assert dr_grpo_length(cfg, data) == 5


# ---- warnings ----------------------------------------------------------------------------------
def test_shards_naming_a_shard_file_not_given_are_warned_about(first, tmp_path):
    _split_shards(first.sh, tmp_path / "part", num_shards=3, keep=2)
    with pytest.warns(QerlWarning, match=f"name 1 more shard file.*first: {shard_name(2, 3)}"):
        _step(first, tmp_path / "part", tmp_path / "a")


def test_shards_of_a_later_step_than_the_adapter_are_warned_about(first, tmp_path):
    with pytest.warns(QerlWarning, match="rollout step 2 but the adapter is at step 1"):
        _step(first, _resume_shard(first, tmp_path, step=2), tmp_path / "a", adapter=first.out)


# ---- LoRA layout -------------------------------------------------------------------------------
def test_a_fresh_adapter_defaults_to_rank_16_and_alpha_16(first):
    lora = _state(first.out)["lora"]
    assert (lora["r"], lora["alpha"]) == (16, 16.0)


def test_lora_dropout_given_when_resuming_is_the_one_trained_with(first, tmp_path):
    _step(first, _resume_shard(first, tmp_path), tmp_path / "a", adapter=first.out, lora_dropout=0.3)
    assert _state(tmp_path / "a")["lora"]["dropout"] == 0.3


def test_a_resumed_step_carries_the_adapters_rng_state_on_under_another_seed(first, tmp_path):
    _step(first, _resume_shard(first, tmp_path), tmp_path / "a", adapter=first.out, seed=7)
    assert _state(tmp_path / "a")["rng"]["torch_cpu"] == _state(first.out)["rng"]["torch_cpu"]


# ---- what makes a rerun "already done" ---------------------------------------------------------
def test_editing_the_second_shard_file_makes_a_rerun_a_new_step(first, tmp_path):
    files = _split_shards(first.sh, tmp_path / "sh", num_shards=3)
    _step(first, tmp_path / "sh", tmp_path / "a")
    recs = read_records(files[1])
    files[1].unlink()
    write_records(files[1], [dict(r, reward=1.0 - r["reward"]) for r in recs])
    with pytest.raises(OutputExistsError, match="input shards changed"):
        _step(first, tmp_path / "sh", tmp_path / "a")


def test_a_shard_file_as_metrics_file_is_refused_and_kept(first, tmp_path):
    # its records carry "step": 0 too, and the metrics append dropped all of them (exit 0, the shard left
    # holding one metrics line)
    sh = shutil.copytree(first.sh, tmp_path / "sh")
    shard = sh / shard_name(0, 1)
    before = shard.read_bytes()
    with pytest.raises(BadInputError, match="is one of the --shards files"):
        _step(first, sh, tmp_path / "a", metrics_file=shard)
    assert shard.read_bytes() == before and not (tmp_path / "a").exists()


def test_a_metrics_file_rewrite_drops_only_train_step_lines(tmp_path):
    from qerl_cli.train_step import _drop_step_lines

    path = tmp_path / "m.jsonl"
    path.write_text('{"step":0,"group_id":"g","loss":1}\n{"step":0,"reward":1}\n{"step":0,"loss":2}\n')
    _drop_step_lines(path, 0)
    assert path.read_text() == '{"step":0,"group_id":"g","loss":1}\n{"step":0,"reward":1}\n'


def test_removing_the_adapters_optimizer_state_makes_a_rerun_a_new_step(first, tmp_path):
    adapter = shutil.copytree(first.out, tmp_path / "in")
    sh = _resume_shard(first, tmp_path)
    _step(first, sh, tmp_path / "a", adapter=adapter)
    assert _step(first, sh, tmp_path / "a", adapter=adapter)["already_done"]
    (adapter / "optimizer.safetensors").unlink()
    with pytest.raises(OutputExistsError, match="input adapter changed"):
        _step(first, sh, tmp_path / "a", adapter=adapter)


def test_a_qerl_adapter_that_lost_its_optimizer_state_is_warned_about_under_quiet_too(first, tmp_path):
    # pruned to free space (docs/recipes.md, Disk), then a step rerun from it to debug: only a note said the moments
    # start from zero, none under -q, and the step differed from the run's
    adapter = shutil.copytree(first.out, tmp_path / "in")
    (adapter / "optimizer.safetensors").unlink()
    with pytest.warns(QerlWarning, match=r"in has no optimizer.safetensors, though its trainer_state.json counts 1 "
                                         r"optimizer step\(s\): AdamW's moments start from zero"):
        _step(first, _resume_shard(first, tmp_path), tmp_path / "a", adapter=adapter)


def test_a_qerl_adapter_that_lost_its_trainer_state_is_warned_about_under_quiet_too(first, tmp_path):
    # copied in part: the step trained to the same weights, but its adapter's lineage and optimizer steps started over,
    # said by a note alone, none under -q (session 60's list). qerl's own is known by its manifest; another's keeps
    # the note (it has no such record to lose)
    import warnings

    sh = _resume_shard(first, tmp_path)
    adapter = shutil.copytree(first.out, tmp_path / "in")
    (adapter / "trainer_state.json").unlink()
    with pytest.warns(QerlWarning, match=r"in has no trainer_state.json, though its manifest.json says qerl's "
                                         r"train-step wrote it: .* the lineage of adapters and the count of optimizer "
                                         r"steps start over"):
        _step(first, sh, tmp_path / "a", adapter=adapter)
    assert _state(tmp_path / "a")["optimizer_steps"] == 1  # what the warning is about (the run's would count 2)
    (adapter / "manifest.json").unlink()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*trainer_state.json", category=QerlWarning)
        _step(first, sh, tmp_path / "b", adapter=adapter)


def test_an_adapter_copied_without_its_weights_is_named_not_called_another_adapter(first, tmp_path):
    # the rollout's own adapter, half copied: the lineage check called it another adapter ("pass the --adapter the
    # rollout used", exit 3), which it was given
    adapter = shutil.copytree(first.out, tmp_path / "in")
    sh = _resume_shard(first, tmp_path)
    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(BadInputError, match=r"in/adapter_model.safetensors: not found \(.* holds adapter_config.json but "
                                            r"not its LoRA weights\)") as e:
        _step(first, sh, tmp_path / "a", adapter=adapter)
    assert "rerun the train-step that wrote it" in e.value.hint and not (tmp_path / "a").exists()


def test_an_already_done_step_leaves_its_metrics_file_line_where_it_is(first, tmp_path):
    metrics_file = tmp_path / "metrics.jsonl"
    again = dict(tis_cap=0.0, metrics_file=metrics_file)
    assert _step(first, first.sh, first.out, **again)["already_done"]  # adds the missing line
    with open(metrics_file, "a") as f:
        f.write(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    before = metrics_file.read_text()
    assert _step(first, first.sh, first.out, **again)["already_done"]
    assert metrics_file.read_text() == before


# ---- the metrics record ------------------------------------------------------------------------
def test_metrics_describe_the_step_s_completions(first):
    recs = read_records(first.sh)
    m = first.metrics
    assert m["reward_std"] == pytest.approx(statistics.stdev(r["reward"] for r in recs), rel=1e-5)
    assert m["truncated_fraction"] == pytest.approx(sum(r["finish_reason"] == "length" for r in recs) / len(recs))
    assert 0 < m["truncated_fraction"] < 1
    assert m["completion_length_min"] == min(len(r["completion_token_ids"]) for r in recs)


def test_metrics_leave_out_the_kl_and_capped_fraction_of_terms_that_are_off(first):
    assert first.metrics["kl"] is None  # --beta 0
    assert "is_capped_fraction" not in first.metrics  # --tis-cap 0


# ---- the loop, on a fake policy ----------------------------------------------------------------
def _fake_loop(monkeypatch, logp_of, sampling_logprobs, **kw):
    """``run_epochs`` over one sequence whose completion log-probs are ``logp_of(p, tokens)`` of one
    zero parameter ``p``."""
    from qerl_cli import train_step as ts
    from qerl_cli.train.optim import make_optimizer

    p = torch.nn.Parameter(torch.zeros(()))

    def fake_logprobs(model, mb, *args, **kwargs):
        n = mb.targets.numel()
        return logp_of(p, n), torch.zeros(n)

    monkeypatch.setattr(ts, "microbatch_logprobs", fake_logprobs)
    cfg = TrainStepConfig(model="m", shards=["s"], out="o", progress=False, **kw)
    batch = ts.StepBatch(groups=[[0]], prompts=[[1, 2]], completions=[[3] * len(sampling_logprobs)],
                         sampling_logprobs=[sampling_logprobs], inv_temp=torch.ones(1), adv=torch.ones(1),
                         weight=torch.full((1,), 0.5))
    return ts.run_epochs(cfg, None, [p], make_optimizer([("p.lora_A", p)], lr=1e-3), batch)


def test_a_ratio_exactly_at_the_tis_cap_is_not_counted_as_capped(monkeypatch):
    # ratios exp(0 - 0) = 1 (the cap: its weight is unchanged) and exp(0 - -1) = e (capped)
    res = _fake_loop(monkeypatch, lambda p, n: p * torch.ones(n), [0.0, -1.0], tis_cap=1.0)
    assert res.acc.sums["is_capped"] == 1


def test_a_non_finite_gradient_norm_is_a_numerical_error(monkeypatch):
    # sqrt at 0: a finite loss whose gradient is infinite
    with pytest.raises(NumericalError, match="non-finite gradient norm at step 0"):
        _fake_loop(monkeypatch, lambda p, n: torch.sqrt(p) * torch.ones(n), [0.0, 0.0])


def test_a_negative_top_k_is_no_cut_and_a_non_number_is_named(first, tmp_path):
    # vLLM before 0.10 (and other tools) record top_k -1 for "off": with a top-p cut beside it, the
    # replay called torch.topk(x, -1) and the step ended in a RuntimeError traceback (exit 1).
    def sheet(name, top_k):
        sh = tmp_path / name
        shutil.copytree(first.sh, sh)
        for i in range(len(read_records(sh))):
            _edit_record(sh, i, sampling=lambda s: dict(s, top_p=0.9, top_k=top_k))
        return sh

    off, minus = sheet("off", 0), sheet("minus", -1)
    a = _step(first, off, tmp_path / "a_off", tis_cap=0.0)["metrics"]
    b = _step(first, minus, tmp_path / "a_minus", tis_cap=0.0)["metrics"]
    assert b["loss"] == a["loss"] and b["entropy"] == a["entropy"]
    assert ((tmp_path / "a_off" / "adapter_model.safetensors").read_bytes()
            == (tmp_path / "a_minus" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(BadInputError, match=r"shard-00000-of-00001.jsonl:1: sampling.top_k should be a number"):
        _step(first, sheet("text", "all"), tmp_path / "a_text")
    assert not (tmp_path / "a_text").exists()


def test_a_sampling_cut_past_floats_range_is_named():
    # JSON reads a 1 and 400 zeros as an int no float holds: math.isfinite raised OverflowError, a traceback
    # (review s59r16)
    from qerl_cli.train.inputs import _sampling_cut

    for key in ("top_p", "top_k", "min_p"):
        with pytest.raises(BadInputError, match=f"sampling.{key} should be a number or null"):
            _sampling_cut({"temperature": 1.0, key: 10**400})


def test_a_step_mask_truncated_leaves_nothing_of_is_named_with_its_way_out(first, tmp_path):
    # It said "no completion tokens left to train on" with no hint, and a rerun stopped the same way (a review)
    sh = tmp_path / "sh"
    shutil.copytree(first.sh, sh)
    for i in range(len(read_records(sh))):
        _edit_record(sh, i, finish_reason=lambda _: "length")
    with pytest.raises(BadInputError, match="--mask-truncated masks every completion of this step") as e:
        _step(first, sh, tmp_path / "a", mask_truncated=True)
    assert "without --mask-truncated" in e.value.hint and not (tmp_path / "a").exists()
    assert _step(first, sh, tmp_path / "b")["metrics"]["completions"] == len(read_records(sh))
