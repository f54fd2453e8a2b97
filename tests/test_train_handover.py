"""What one train-step hands the next through trainer_state.json (review s52: train-step across RL steps)."""

from __future__ import annotations

import json

import pytest

from qerl_cli.errors import BadInputError
from qerl_cli.train.state import TrainerState
from qerl_cli.train_step import TrainStepConfig, train_step
from tests.train_fixtures import base_hash_of, make_shard, quantized_tiny


@pytest.mark.parametrize("key", ["global_step", "optimizer_steps"])
def test_negative_step_counts_are_refused(tmp_path, key):
    # global_step -3 under --warmup-steps 2 gave lr_at a position of -3: LR -lr, a step of gradient ascent
    state = {"global_step": 1, "optimizer_steps": 1, key: -3}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(BadInputError, match=f"{key} should be >= 0, got -3"):
        TrainerState.load(tmp_path / "trainer_state.json")


def test_a_boolean_global_step_is_refused(tmp_path):
    # bool is an int to isinstance: "global_step": true was read as step 1 and the metrics line said "step": true
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": True, "optimizer_steps": 1}))
    with pytest.raises(BadInputError, match="no integer global_step"):
        TrainerState.load(tmp_path / "trainer_state.json")


def test_a_base_hash_that_is_no_string_is_named_by_rollout_merge_and_eval(tmp_path):
    # their lineage check sliced it for the message: a TypeError traceback (exit 1) instead of one line (exit 2)
    from qerl_cli.lineage import check_lineage

    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 1, "base_model_hash": 12345}))
    with pytest.raises(BadInputError, match="base_model_hash should be a string or null, got 12345"):
        check_lineage(tmp_path, tmp_path, base_hash="ab" * 32)


def test_trainer_state_does_not_depend_on_how_shards_are_spelled(tmp_path, monkeypatch):
    # The next step's input hash holds trainer_state.json: a redo of a step named --shards another way
    # (relative, from another cwd) made the next step "input adapter changed" (exit 4) over the same weights.
    _, q = quantized_tiny(tmp_path / "m")
    sh = make_shard(tmp_path / "sh0", base_hash_of(q), seed=1)
    kw = dict(lr=1e-3, lora_rank=4, lora_alpha=8, device="cpu", progress=False)
    train_step(TrainStepConfig(model=q, shards=[str(sh)], out=tmp_path / "a", **kw))
    monkeypatch.chdir(tmp_path)
    train_step(TrainStepConfig(model=q, shards=["sh0"], out=tmp_path / "b", **kw))
    a, b = ((tmp_path / d / "trainer_state.json").read_bytes() for d in ("a", "b"))
    assert a == b


def test_a_step_past_total_steps_warns_that_it_trains_at_the_floor(tmp_path):
    # LR 0 (the default --min-lr-ratio) wrote the input adapter back byte for byte, with no word of it
    import warnings

    from qerl_cli.adapters import adapter_hash
    from qerl_cli.errors import QerlWarning

    _, q = quantized_tiny(tmp_path / "m")
    h = base_hash_of(q)
    kw = dict(lr=1e-3, lora_rank=4, lora_alpha=8, device="cpu", progress=False, total_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QerlWarning)  # step 0 of 1: inside the schedule
        train_step(TrainStepConfig(model=q, shards=[str(make_shard(tmp_path / "sh0", h, seed=1))], out=tmp_path / "a1", **kw))
    sh1 = make_shard(tmp_path / "sh1", h, adapter_hash=adapter_hash(tmp_path / "a1"), step=1, seed=2)
    with pytest.warns(QerlWarning, match=r"at step 1, past --total-steps 1: .* = 0 \(the weights will not change\)"):
        train_step(TrainStepConfig(model=q, shards=[str(sh1)], adapter=tmp_path / "a1", out=tmp_path / "a2", **kw))


def test_a_hugging_face_trainer_state_is_not_read_as_the_rl_step(tmp_path, capsys):
    # A checkpoint-500/ of an SFT LoRA run holds the PEFT files and transformers' own trainer_state.json: its
    # global_step (500 optimizer steps of another run) became the RL step, past --total-steps 100: LR 0, every step
    import transformers

    from qerl_cli.adapters import adapter_hash

    _, q = quantized_tiny(tmp_path / "m")
    h = base_hash_of(q)
    kw = dict(lr=1e-3, lora_rank=4, lora_alpha=8, device="cpu", warmup_steps=10, total_steps=100)
    train_step(TrainStepConfig(model=q, shards=[str(make_shard(tmp_path / "sh0", h, seed=1))], out=tmp_path / "a1",
                               progress=False, **kw))
    ck = tmp_path / "checkpoint-500"
    ck.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (ck / name).write_bytes((tmp_path / "a1" / name).read_bytes())
    transformers.TrainerState(global_step=500, max_steps=500, epoch=3.0).save_to_json(str(ck / "trainer_state.json"))
    sh = make_shard(tmp_path / "sh", h, adapter_hash=adapter_hash(ck), step=0, seed=2)
    m = train_step(TrainStepConfig(model=q, shards=[str(sh)], adapter=ck, out=tmp_path / "a2", **kw))
    assert "trainer_state.json is a Hugging Face Trainer's, not qerl's; starting the schedule at step 0" in \
        capsys.readouterr().err
    assert m["metrics"]["step"] == 0 and m["metrics"]["lr"] == pytest.approx(1e-4)  # warmup step 1 of 10, not 0
    assert json.loads((tmp_path / "a2" / "trainer_state.json").read_text())["global_step"] == 1
