"""Rollout (native engine, NVFP4, AQN noise) -> train-step: recomputed log-probs match the shard's.

The training forward and the engine's paged decode are different code paths over one model; with
the same AQN noise rebuilt from the shard's ``noise`` record, the log-prob of every sampled token
must agree within 1e-3 on CPU in fp32. Dropping the noise in training must break that agreement
(the control proves the check can fail).
"""

import json

import pytest

from qerl_cli.rollout import RolloutConfig, rollout
from qerl_cli.shards import read_records
from qerl_cli.train_step import TrainStepConfig, train_step
from tests.train_fixtures import quantized_tiny


@pytest.fixture(scope="module")
def rolled(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_engine")
    _, qdir = quantized_tiny(root)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Q{i}: 12 + {i} = ?", "answer": str(12 + i)}) + "\n"
                               for i in range(3)))
    rollout(RolloutConfig(model=qdir, prompts=prompts, out=root / "sh", num_generations=2, max_new_tokens=6,
                          temperature=0.8, step=3, aqn_sigma_start=0.05, aqn_sigma_end=0.01, aqn_stages=2,
                          total_steps=6, run_seed=7, device="cpu", dtype="fp32", chat_template=False,
                          progress=False))
    return root, qdir


def _step(root, qdir, out):
    return train_step(TrainStepConfig(model=qdir, shards=[str(root / "sh")], out=out, device="cpu",
                                      micro_batch_tokens=32, progress=False))["metrics"]


def test_recomputed_logprobs_match_engine_with_same_noise(rolled, tmp_path):
    root, qdir = rolled
    recs = read_records(root / "sh")
    assert recs[0]["noise"]["sigma"] > 0 and recs[0]["engine"] == "native"
    assert recs[0]["policy"]["norms"] is None  # no adapter, so no trained norms: train-step checks it
    assert sum(len(r["completion_token_ids"]) for r in recs) >= 6
    m = _step(root, qdir, tmp_path / "a")
    assert m["aqn_sigma"] == recs[0]["noise"]["sigma"]
    assert m["logprob_abs_diff_max"] < 1e-3, m
    assert m["is_ratio_min"] > 0.999 and m["is_ratio_max"] < 1.001


def test_without_the_noise_logprobs_disagree(rolled, tmp_path, monkeypatch):
    root, qdir = rolled
    from qerl_cli.aqn import NOISED_NORMS

    monkeypatch.setattr("qerl_cli.aqn.apply_noise", lambda model, *a, **k: {"norms": list(NOISED_NORMS)})
    m = _step(root, qdir, tmp_path / "b")
    assert m["logprob_abs_diff_max"] > 1e-3


def test_records_sampled_with_a_cut_give_importance_ratios_of_one(tmp_path):
    # top-p / top-k / min-p: the shard's log-probs are over the kept tokens; train-step replays the cut,
    # so at step 0 the ratio is 1, not the kept mass (before the replay: 0.26-0.41 on a Qwen3-shaped model).
    _, qdir = quantized_tiny(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Q{i}: 3 + {i} = ?", "answer": str(3 + i)}) + "\n" for i in range(3)))
    rollout(RolloutConfig(model=qdir, prompts=prompts, out=tmp_path / "sh", num_generations=2, max_new_tokens=8,
                          temperature=1.3, top_p=0.7, top_k=12, min_p=0.02, device="cpu", dtype="fp32",
                          chat_template=False, progress=False))
    m = _step(tmp_path, qdir, tmp_path / "a")
    assert m["logprob_abs_diff_max"] < 1e-3, m
    assert m["is_ratio_min"] > 0.999 and m["is_ratio_max"] < 1.001, m
