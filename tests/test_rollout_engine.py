"""`qerl rollout` end to end on the native engine and a tiny random model (CPU).

Beyond "it runs": the recorded logprobs are recomputed by the training forward (so train-step's
importance ratios start at exactly 1), the AQN noise provably changes the rollout and is rebuilt
from the record alone, an adapter is applied and hashed, and resume after a crash reproduces the
uninterrupted shard.
"""

import json

import pytest
import torch
from typer.testing import CliRunner

import qerl_cli.rollout as ro
from qerl_cli.adapters import adapter_hash, save_adapter
from qerl_cli.aqn import apply_noise
from qerl_cli.cli import app
from qerl_cli.errors import BadInputError
from qerl_cli.hashing import model_hash
from qerl_cli.layers.lora import LoraSpec, lora_modules
from qerl_cli.models import load_model
from qerl_cli.rollout import RolloutConfig, rollout
from qerl_cli.shards import read_records
from tests.helpers import make_tiny_hf_model

G = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("m"), vocab=384, init_std=0.1)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    p = tmp_path_factory.mktemp("d") / "prompts.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"Tom has {i} pens. How many pens? ####", "answer": str(i), "id": f"q{i}"}) + "\n"
                         for i in range(8)))
    return p


def cfg(model_dir, prompts, out, **kw):
    base = dict(model=model_dir, prompts=prompts, out=out, num_generations=G, max_new_tokens=12, device="cpu",
                progress=False, batch_prompts=3, seed=1)
    base.update(kw)
    return RolloutConfig(**base)


def recompute_logprobs(model, rec):
    ids = rec["prompt_token_ids"] + rec["completion_token_ids"]
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model.compute_logits(model.forward_train(x, torch.ones_like(x)))[0]
    logp = torch.log_softmax(logits.float(), -1)
    n = len(rec["prompt_token_ids"])
    return [logp[n - 1 + t, tok].item() for t, tok in enumerate(rec["completion_token_ids"])]


@pytest.fixture(scope="module")
def full_run(model_dir, prompts, tmp_path_factory):
    """One uninterrupted run, shared by the tests that compare against it."""
    out = tmp_path_factory.mktemp("full") / "o"
    return rollout(cfg(model_dir, prompts, out)), read_records(out)


def test_records_match_the_training_forward(model_dir, prompts, tmp_path, full_run):
    res, recs = full_run
    assert len(recs) == 8 * G and res["summary"]["groups"] == 8
    assert [r["prompt_id"] for r in recs[::G]] == [f"q{i}" for i in range(8)]
    assert {r["policy"]["base"] for r in recs} == {model_hash(model_dir)} and recs[0]["engine"] == "native"
    assert res["summary"]["throughput"]["generated_tokens"] == sum(len(r["completion_token_ids"]) for r in recs)
    model = load_model(model_dir, device="cpu", dtype=torch.float32)
    for r in recs[:: G + 1]:
        assert r["finish_reason"] in ("stop", "length") and len(r["completion_token_ids"]) <= 12
        assert recompute_logprobs(model, r) == pytest.approx(r["logprobs"], abs=2e-4)
    # same seed, fresh dir -> identical samples
    rollout(cfg(model_dir, prompts, tmp_path / "again"))
    assert read_records(tmp_path / "again") == recs


def test_two_shards_cover_all_prompts_disjointly(model_dir, prompts, tmp_path):
    ids = []
    for i in range(2):
        rollout(cfg(model_dir, prompts, tmp_path / f"s{i}", shard_index=i, num_shards=2))
        ids.append([r["prompt_id"] for r in read_records(tmp_path / f"s{i}")][::G])
    assert set(ids[0]).isdisjoint(ids[1]) and sorted(ids[0] + ids[1]) == sorted(f"q{i}" for i in range(8))


def crash_after_four_groups(model_dir, prompts, out, monkeypatch):
    """A rollout (batches of 3) killed after writing four groups: batch 2 half written."""
    real = ro.ShardWriter.write_group
    n = {"groups": 0}

    def crash_after_four(self, records):
        if n["groups"] == 4:
            raise KeyboardInterrupt
        n["groups"] += 1
        return real(self, records)

    monkeypatch.setattr(ro.ShardWriter, "write_group", crash_after_four)
    with pytest.raises(KeyboardInterrupt):
        rollout(cfg(model_dir, prompts, out))
    monkeypatch.setattr(ro.ShardWriter, "write_group", real)


def test_resume_after_crash_gives_the_uninterrupted_records(model_dir, prompts, tmp_path, monkeypatch, full_run):
    want = full_run[1]
    crash_after_four_groups(model_dir, prompts, tmp_path / "out", monkeypatch)
    assert not (tmp_path / "out").exists()
    res = rollout(cfg(model_dir, prompts, tmp_path / "out"))
    assert res["summary"]["resumed_groups"] == 4
    assert read_records(tmp_path / "out") == want


def _completions(recs):
    return {(r["group_id"], i % G): r for i, r in enumerate(recs)}


def _same_completions(recs, want):
    got, ref = _completions(recs), _completions(want)
    assert got.keys() == ref.keys()
    for k, r in got.items():
        assert r["completion_token_ids"] == ref[k]["completion_token_ids"], k
        assert r["logprobs"] == pytest.approx(ref[k]["logprobs"], abs=1e-5), k
        assert r["sampling"]["seed"] == ref[k]["sampling"]["seed"] == ro.derive_seed(1, 0, r["prompt_id"])


def test_batching_and_sharding_do_not_change_a_prompts_completions(model_dir, prompts, tmp_path, full_run):
    # Every prompt is seeded by (--seed, step, its id): batches of 1 or 8 prompts, 4 engine slots or
    # two shards draw the same completions as the reference run (batches of 3, default slots).
    want = full_run[1]
    rollout(cfg(model_dir, prompts, tmp_path / "b1", batch_prompts=1, max_num_seqs=4))
    _same_completions(read_records(tmp_path / "b1"), want)
    rollout(cfg(model_dir, prompts, tmp_path / "b8", batch_prompts=8))
    _same_completions(read_records(tmp_path / "b8"), want)
    for i in range(2):
        rollout(cfg(model_dir, prompts, tmp_path / f"s{i}", shard_index=i, num_shards=2))
    _same_completions(read_records(tmp_path / "s0") + read_records(tmp_path / "s1"), want)


def test_resume_with_smaller_batches_continues_the_same_partial(model_dir, prompts, tmp_path, monkeypatch, full_run):
    # The advice after running out of memory is to lower --max-num-seqs (and --batch-prompts); the
    # rerun keeps the groups already written instead of starting over (the batch size was fingerprinted).
    crash_after_four_groups(model_dir, prompts, tmp_path / "out", monkeypatch)
    res = rollout(cfg(model_dir, prompts, tmp_path / "out", batch_prompts=2, max_num_seqs=4))
    assert res["summary"]["resumed_groups"] == 4
    _same_completions(read_records(tmp_path / "out"), full_run[1])
    again = rollout(cfg(model_dir, prompts, tmp_path / "out", batch_prompts=5))
    assert again["already_done"]


def test_aqn_noise_reaches_the_rollout_and_is_rebuilt_from_the_record(model_dir, prompts, tmp_path):
    aqn = dict(aqn_sigma_start=0.5, aqn_sigma_end=0.05, aqn_stages=2, total_steps=3, step=1, run_seed=4, max_prompts=2)
    rollout(cfg(model_dir, prompts, tmp_path / "clean", **{**aqn, "aqn_sigma_start": 0.0}))
    rollout(cfg(model_dir, prompts, tmp_path / "noisy", **aqn))
    clean, noisy = read_records(tmp_path / "clean"), read_records(tmp_path / "noisy")
    assert noisy[0]["noise"] == {"sigma": 0.5, "seed": 4, "step": 1, "norms": ["input_layernorm", "post_attention_layernorm"]} and clean[0]["noise"]["sigma"] == 0.0
    assert [r["logprobs"] for r in clean] != [r["logprobs"] for r in noisy]
    model = load_model(model_dir, device="cpu", dtype=torch.float32)
    r = noisy[0]
    without = recompute_logprobs(model, r)
    apply_noise(model, r["noise"]["sigma"], r["noise"]["seed"], r["noise"]["step"])
    assert recompute_logprobs(model, r) == pytest.approx(r["logprobs"], abs=2e-4)
    assert without != pytest.approx(r["logprobs"], abs=2e-4)


def make_adapter(model_dir, out, r=4, seed=0):
    model = load_model(model_dir, device="cpu", dtype=torch.float32, lora=LoraSpec(r=r, alpha=8, targets=("q_proj", "v_proj")))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.5)
    return save_adapter(model, out, base_model_path=model_dir)


def test_adapter_is_applied_and_hashed(model_dir, prompts, tmp_path):
    a = make_adapter(model_dir, tmp_path / "adapter")
    (a / "trainer_state.json").write_text(json.dumps({"base_model_hash": model_hash(model_dir)}))
    res = rollout(cfg(model_dir, prompts, tmp_path / "o", adapter=a, max_prompts=2))
    recs = read_records(tmp_path / "o")
    assert recs[0]["policy"]["adapter"] == adapter_hash(a) and res["summary"]["adapter_lineage"] == "verified"
    assert res["manifest"]["summary"]["adapter_path"] == str(a.resolve())  # named by train-step's lineage error
    model = load_model(model_dir, device="cpu", dtype=torch.float32, adapter_dir=a)
    assert recompute_logprobs(model, recs[0]) == pytest.approx(recs[0]["logprobs"], abs=2e-4)


def test_adapter_that_does_not_fit_leaves_nothing(model_dir, prompts, tmp_path):
    a = make_adapter(model_dir, tmp_path / "adapter", r=4)
    cfg_json = json.loads((a / "adapter_config.json").read_text())
    cfg_json["r"] = 8  # config says r=8, tensors are r=4
    (a / "adapter_config.json").write_text(json.dumps(cfg_json))
    with pytest.raises(BadInputError, match=r"lora_A.weight' has shape \(4, 64\), the model expects \(8, 64\)"):
        rollout(cfg(model_dir, prompts, tmp_path / "o", adapter=a))
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))


def test_cli_end_to_end_and_idempotent(model_dir, prompts, tmp_path):
    args = ["rollout", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path / "o"),
            "-G", "2", "--max-new-tokens", "8", "--reward", "gsm8k", "--reward", "format=0.1", "--device", "cpu",
            "--max-prompts", "4", "--stop", "\n"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "wrote 8 completions for 4 prompts" in r.output and "reward (weighted)" in r.output
    assert all("\n" not in x["completion"] for x in read_records(tmp_path / "o"))
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and "already done" in r.output


def test_nvfp4_qdir_rollout_matches_its_training_forward(model_dir, prompts, tmp_path):
    from qerl_cli.quantize import QuantizeConfig, quantize

    q = tmp_path / "q"
    quantize(QuantizeConfig(src=model_dir, out=q, device="cpu", progress=False))
    rollout(cfg(q, prompts, tmp_path / "o", max_prompts=2))
    recs = read_records(tmp_path / "o")
    model = load_model(q, device="cpu", dtype=torch.float32)
    assert model.is_quantized and recs[0]["policy"]["base"] == model_hash(q) != model_hash(model_dir)
    assert recompute_logprobs(model, recs[1]) == pytest.approx(recs[1]["logprobs"], abs=2e-4)


def test_rollout_train_step_rollout_loop(model_dir, prompts, tmp_path):
    """The RL loop through files: rollout step 0 -> train-step -> rollout step 1 with the new adapter."""
    from qerl_cli.train_step import TrainStepConfig, train_step

    common = dict(prompts_per_step=4, aqn_sigma_start=0.05, aqn_sigma_end=0.01, aqn_stages=2, total_steps=3)
    rollout(cfg(model_dir, prompts, tmp_path / "r0", step=1, **common))
    train_step(TrainStepConfig(model=model_dir, shards=[str(tmp_path / "r0")], out=tmp_path / "a1", lora_rank=4,
                               lora_alpha=8, lr=1e-3, device="cpu", progress=False))
    res = rollout(cfg(model_dir, prompts, tmp_path / "r1", adapter=tmp_path / "a1", step=2, **common))
    recs = read_records(tmp_path / "r1")
    assert res["summary"]["adapter_lineage"] == "verified"
    assert recs[0]["policy"]["adapter"] == adapter_hash(tmp_path / "a1")
    assert [r["prompt_id"] for r in recs[::G]] == ["q0", "q1", "q2", "q3"]  # step 2 of 4-prompt steps wraps
    assert {r["noise"]["step"] for r in recs} == {2} and recs[0]["noise"]["sigma"] == pytest.approx(0.01)
