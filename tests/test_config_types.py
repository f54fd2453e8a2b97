"""Stage configs called from Python take what the CLI gives them (a library trial, session 44).

An int where a field is a float made another fingerprint and other record bytes than the CLI's float (so the
CLI refused the library's output, naming no change); numpy scalars and wrong types passed every check and
failed after the work, or silently did something else.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qerl_cli.errors import BadInputError
from qerl_cli.evaluate import EvalConfig
from qerl_cli.merge import MergeConfig
from qerl_cli.quantize import QuantizeConfig
from qerl_cli.rollout import RolloutConfig
from qerl_cli.train_step import TrainStepConfig


def _rollout(**kw):
    return RolloutConfig(model="m", prompts="p", out="o", **kw)


def _train(**kw):
    return TrainStepConfig(model="m", shards=["s"], out="o", **kw)


def test_an_int_for_a_float_field_is_the_clis_float():
    a, b = _train(lora_alpha=32, beta=0, lr=1), _train(lora_alpha=32.0, beta=0.0, lr=1.0)
    assert a.fingerprint_config() == b.fingerprint_config()
    assert type(a.lora_alpha) is float and type(a.beta) is float
    r = _rollout(temperature=1, top_p=1, aqn_sigma_start=0)
    assert (type(r.temperature), type(r.top_p), type(r.aqn_sigma_start)) == (float, float, float)
    assert type(EvalConfig(model="m", dataset="d", out="o", top_p=1).top_p) is float


def test_numpy_scalars_become_python_numbers():
    r = _rollout(step=np.int64(1), temperature=np.float32(0.5), shuffle=np.bool_(True))
    assert (type(r.step), type(r.temperature), type(r.shuffle)) == (int, float, bool)
    assert (r.step, r.temperature, r.shuffle) == (1, 0.5, True)


@pytest.mark.parametrize("make,kw,needle", [
    (_rollout, {"step": 1.0}, "step must be a whole number, got 1.0"),
    (_rollout, {"top_k": 2.7}, "top_k must be a whole number"),
    (_rollout, {"num_generations": "2"}, "num_generations must be a whole number, got '2'"),
    (_rollout, {"shuffle": "no"}, "shuffle must be True or False, got 'no'"),
    (_rollout, {"seed": None}, "seed must not be None"),
    (_rollout, {"temperature": "0.7"}, "temperature must be a number"),
    (_rollout, {"max_num_seqs": True}, "max_num_seqs must be a whole number, got True"),
    (_train, {"lora_rank": 8.0}, "lora_rank must be a whole number"),
    (_train, {"epochs": 1.5}, "epochs must be a whole number"),
    (_train, {"lr": "1e-3"}, "lr must be a number"),
    (_train, {"max_grad_norm": None}, "max_grad_norm must not be None"),
    (lambda **kw: EvalConfig(model="m", dataset="d", out="o", **kw), {"k": "2"}, "k must be a whole number"),
    (lambda **kw: QuantizeConfig(src="s", out="o", **kw), {"force": 1}, "force must be True or False"),
])
def test_a_wrong_type_is_bad_input_naming_the_field(make, kw, needle):
    with pytest.raises(BadInputError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        make(**kw)


def test_optional_fields_still_take_none_and_merge_its_size_string():
    assert _rollout(max_model_len=None, total_steps=None).max_model_len is None
    assert _train(lora_rank=None, lora_dropout=None).lora_rank is None
    assert MergeConfig("m", "a", "o", max_shard_size="2GB").max_shard_size == 2_000_000_000


def test_reward_weights_in_a_dict_are_kept():
    # {"gsm8k": 1.0, "format": 0.1} recorded {'gsm8k': 1.0, 'format': 1.0}: the weights were dropped
    from qerl_cli.rewards import RewardSet

    r = _rollout(rewards={"gsm8k": 1.0, "format": 0.1})
    assert RewardSet.from_specs(r.rewards).weights == {"gsm8k": 1.0, "format": 0.1}


def test_a_template_given_as_a_path_names_the_file(tmp_path):
    # Path("tmpl.txt") failed with "argument of type 'PosixPath' is not iterable"; a str path worked
    from qerl_cli.data import load_template

    f = tmp_path / "tmpl.txt"
    f.write_text("Solve: {prompt}")
    for cfg in (_rollout(prompt_template=f), EvalConfig(model="m", dataset="d", out="o", prompt_template=f)):
        assert cfg.prompt_template == str(f) and load_template(cfg.prompt_template) == "Solve: {prompt}"


def test_lora_targets_in_one_string_split_at_commas_as_the_cli_splits_them():
    assert _train(lora_targets="q_proj,v_proj").lora_targets == ("q_proj", "v_proj")
    assert _train(lora_targets=["q_proj", "k_proj, v_proj"]).lora_targets == ("q_proj", "k_proj", "v_proj")


def test_an_output_recorded_with_ints_for_float_fields_is_the_same_run(tmp_path):
    # a library output made before 2026-11-26 with lora_alpha=32 recorded 32, where the CLI (and now the
    # library) record 32.0: it read as changed, and the refusal named "lora_alpha: 32 -> 32.0"
    import json

    from qerl_cli.errors import OutputExistsError
    from qerl_cli.outputs import StageOutput

    out = tmp_path / "o"
    with StageOutput(out, "train-step", config={"lora_alpha": 32, "beta": 0, "dropout": True},
                     inputs={"model": "h"}) as work:
        (Path(work) / "x").write_text("x")
    assert json.loads((out / "manifest.json").read_text())["config"]["lora_alpha"] == 32
    assert StageOutput(out, "train-step", config={"lora_alpha": 32.0, "beta": 0.0, "dropout": True},
                       inputs={"model": "h"}).already_done()
    # a real change is still one, named alone (not the type-only one beside it); True is not 1
    with pytest.raises(OutputExistsError, match=r"\(lr: null -> 1e-05; fingerprint") as e:
        StageOutput(out, "train-step", config={"lora_alpha": 32.0, "beta": 0.0, "dropout": True, "lr": 1e-5},
                    inputs={"model": "h"}).already_done()
    assert "lora_alpha" not in str(e.value)
    with pytest.raises(OutputExistsError, match=r"dropout: true -> 1"):
        StageOutput(out, "train-step", config={"lora_alpha": 32.0, "beta": 0.0, "dropout": 1},
                    inputs={"model": "h"}).already_done()
    with pytest.raises(OutputExistsError):  # another stage's output is never this run's
        StageOutput(out, "rollout", config={"lora_alpha": 32.0, "beta": 0.0, "dropout": True},
                    inputs={"model": "h"}).already_done()


def test_merge_says_already_done_either_way(tmp_path):
    # merge()'s first run had no "already_done" key (documented then as "+ already_done on a rerun")
    from qerl_cli.merge import merge
    from tests.helpers import make_tiny_hf_model
    from tests.test_merge import make_peft_adapter

    base = make_tiny_hf_model(tmp_path, arch="llama", hidden=32, layers=1, tokenizer=False)
    adapter = make_peft_adapter(base, tmp_path / "ad", r=2, alpha=4, targets=["v_proj"], trainer_state=False)
    assert merge(MergeConfig(base, adapter, tmp_path / "out"), progress=False)["already_done"] is False
    assert merge(MergeConfig(base, adapter, tmp_path / "out"), progress=False)["already_done"] is True


def test_evals_recorded_stop_reads_the_same_on_a_first_run_and_a_rerun():
    # the returned manifest held () on a first run and [] (from the JSON) on a rerun; same fingerprint either way
    from qerl_cli.evaluate import _fingerprint_config
    from qerl_cli.hashing import sha256_json

    cfg = EvalConfig(model="m", dataset="d", out="o", stop=("####",))
    d = _fingerprint_config(cfg, "cpu", "fp32", None)
    assert d["stop"] == ["####"] and sha256_json(dict(d, stop=("####",))) == sha256_json(d)
