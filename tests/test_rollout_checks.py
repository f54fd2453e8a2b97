"""Rollout behaviour the rest of the suite left unpinned (mutation testing, 2026-11-27): flag values refused
with the flag named, edge values that must run, prompt selection (shuffle, small datasets), the summary's
numbers, resume over a foreign partial shard, sharding with --force, the fingerprint, trained-norm
lineage in records, and the CLI (table, quiet mode, defaults, flags passed through).

The engine is tests/test_rollout.py's scripted fake, so each test takes well under a second."""

import json
import statistics

import pytest
from typer.testing import CliRunner

import qerl_cli.rollout as ro
from qerl_cli.cli import app
from qerl_cli.errors import BadInputError, QerlWarning
from qerl_cli.outputs import read_manifest
from qerl_cli.rollout import rollout, select_prompts
from qerl_cli.shards import read_records
from tests.helpers import make_tiny_hf_model
from tests.test_rollout import FakeEngine, cfg_for, write_prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("m"), vocab=384)


def _use_engine(monkeypatch, cls):
    cls.calls, cls.seeds = [], []
    monkeypatch.setattr(ro, "_native_generator",
                        lambda cfg, tokenizer, *a, **k: (ro._Generator(cls(tokenizer), "sp", "fake"), None))
    return cls


@pytest.fixture()
def fake_engine(monkeypatch):
    return _use_engine(monkeypatch, FakeEngine)


def _rows(n):
    return [type("R", (), {"id": str(i)})() for i in range(n)]


def _step_ids(model_dir, tmp_path, rows, **kw):
    return [r.id for r in select_prompts(rows, cfg_for(model_dir, tmp_path, **kw))]


def _cli(*args):
    r = CliRunner().invoke(app, ["rollout", "--device", "cpu", "--max-new-tokens", "4", *map(str, args)])
    assert r.exit_code == 0, r.output
    return r


# ---- flags ----------------------------------------------------------------------------------------
AQN = dict(aqn_sigma_start=1e-2, aqn_sigma_end=1e-4, total_steps=10)


@pytest.mark.parametrize("kw, msg", [
    (dict(max_new_tokens=0), "--max-new-tokens must be >= 1, got 0"),
    (dict(temperature=float("inf")), "--temperature must be >= 0"),
    (dict(temperature=float("nan")), "--temperature must be >= 0"),
    (dict(min_p=1.0), r"--min-p must be in \[0, 1\), got 1.0"),
    (dict(max_prompts=0), "--max-prompts must be >= 1, got 0"),
    (dict(prompts_per_step=0), "--prompts-per-step must be >= 1, got 0"),
    (dict(batch_prompts=0), "--batch-prompts must be >= 1, got 0"),
    (dict(step=-1), "--step must be >= 0, got -1"),
    (dict(engine="vllm", device="auto", max_num_seqs=0), "--max-num-seqs must be >= 1, got 0"),  # native names -G first
    (dict(AQN, aqn_sigma_end=0.0, aqn_stages=2), "--aqn-sigma-end must be > 0"),  # step 0 is noise-free
    (dict(AQN, aqn_stages=0), "--aqn-stages must be >= 1"),
])
def test_a_bad_flag_value_is_refused_naming_the_flag(model_dir, tmp_path, fake_engine, kw, msg):
    with pytest.raises(BadInputError, match=msg):
        rollout(cfg_for(model_dir, tmp_path, **kw))
    assert fake_engine.calls == [] and not (tmp_path / "out").exists()


def test_a_bad_long_prompts_policy_is_named_before_the_prompt_file_is_read(model_dir, tmp_path):
    with pytest.raises(BadInputError, match="--long-prompts must be one of skip, error, got 'cut'"):
        rollout(cfg_for(model_dir, tmp_path, prompts=tmp_path / "missing.jsonl", long_prompts="cut"))


@pytest.mark.parametrize("kw", [dict(num_generations=2), dict(prompts_per_step=10)])
def test_edge_values_that_are_valid_run(model_dir, tmp_path, fake_engine, kw):
    s = rollout(cfg_for(model_dir, tmp_path, **kw))["summary"]
    assert s["groups"] == 10 and s["completions"] == 10 * kw.get("num_generations", 3)


def test_one_completion_per_prompt_is_refused_up_front(model_dir, tmp_path, fake_engine):
    # -G 1 ran the whole rollout (exit 0), then train-step refused the shard: "group 's0:0' has only one completion;
    # group advantages need >= 2 per prompt"
    r = _cli_fails("--model", model_dir, "--prompts", write_prompts(tmp_path / "p.jsonl", n=2), "--out", tmp_path / "o",
                   "-G", 1, "-q")
    assert r.exit_code == 2, r.output
    assert r.output.strip() == ("error: --num-generations 1: a GRPO group needs >= 2 completions per prompt (one has no "
                                "baseline to compare with, so train-step refuses the shard) (pass -G 2 or more; to "
                                "sample once per prompt, use qerl eval)")
    assert fake_engine.calls == [] and not (tmp_path / "o").exists()


def test_as_many_steps_as_aqn_stages_is_warned_of_as_skipping_the_last_stage(model_dir, tmp_path, fake_engine):
    # K stages + a noise-free interval need K + 1 steps: with K steps, stage K is never reached.
    with pytest.warns(QerlWarning, match="--total-steps 10 < --aqn-stages 10 \\+ 1: the AQN schedule skips stages"):
        rollout(cfg_for(model_dir, tmp_path, **AQN, aqn_stages=10, max_prompts=1))


def test_an_empty_shard_of_two_is_warned_of(model_dir, tmp_path, fake_engine):
    write_prompts(tmp_path / "prompts.jsonl", n=1)
    with pytest.warns(QerlWarning, match="shard 1 of 2 gets no prompts"):
        assert rollout(cfg_for(model_dir, tmp_path, shard_index=1, num_shards=2))["summary"]["groups"] == 0


# ---- prompt selection -----------------------------------------------------------------------------
def test_the_shuffled_step_selection_is_pinned(model_dir, tmp_path):
    # Steps, shards and resumes of one run (and runs across qerl versions) must agree on it: a change
    # reads as "holds group ..., which this run does not select" on resume. 7 rows, 3 per step, 3 epochs;
    # every epoch is reshuffled, and steps 2 and 4 cross into the next one.
    steps = [_step_ids(model_dir, tmp_path, _rows(7), prompts_per_step=3, step=k, shuffle=True, run_seed=1)
             for k in range(7)]
    assert steps == [["2", "0", "4"], ["6", "3", "1"], ["5", "1", "6"], ["5", "4", "3"],
                     ["2", "0", "3"], ["2", "1", "0"], ["4", "6", "5"]]


def test_steps_of_a_dataset_under_two_steps_long_never_hold_a_row_twice(model_dir, tmp_path):
    for n in range(2, 9):
        for p in range(n // 2 + 1, n + 1):
            for seed in range(3):
                for k in range(2 * n):
                    ids = _step_ids(model_dir, tmp_path, _rows(n), prompts_per_step=p, step=k, shuffle=True,
                                    run_seed=seed)
                    assert len(ids) == len(set(ids)), (n, p, seed, k, ids)


# ---- summary --------------------------------------------------------------------------------------
def _rec(reward, n_tokens, **rewards):
    return {"reward": reward, "rewards": rewards, "completion_token_ids": [7] * n_tokens, "finish_reason": "stop"}


def test_summary_has_population_std_midpoint_p50_and_each_functions_own_stats():
    s = ro.summarize([[_rec(0.0, 1, gsm8k=0.0, format=0.0), _rec(1.5, 4, gsm8k=1.0, format=1.0)]],
                     ["gsm8k", "format"])
    assert s["reward"]["std"] == 0.75  # the population std of (0, 1.5); the sample std is 1.06
    assert s["completion_tokens"]["p50"] == 2.5  # the median of (1, 4)
    assert s["rewards"]["format"] == {"mean": 0.5, "std": 0.5, "min": 0.0, "max": 1.0}  # not the weighted total's


def test_summary_of_a_rollout_matches_its_records(model_dir, tmp_path, fake_engine):
    s = rollout(cfg_for(model_dir, tmp_path, rewards=("gsm8k", "format=0.5")))["summary"]
    recs = read_records(tmp_path / "out")
    assert s["reward"]["std"] == pytest.approx(statistics.pstdev(r["reward"] for r in recs))
    for name in ("gsm8k", "format"):
        assert s["rewards"][name]["mean"] == pytest.approx(statistics.fmean(r["rewards"][name] for r in recs))


# ---- resume, shards, fingerprint, records ---------------------------------------------------------
def test_a_partial_shard_holding_a_group_this_run_does_not_select_is_refused(model_dir, tmp_path, fake_engine,
                                                                          monkeypatch):
    real_write, written = ro.ShardWriter.write_group, []

    def crash_after_two(self, records):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(records)
        return real_write(self, records)

    monkeypatch.setattr(ro.ShardWriter, "write_group", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        rollout(cfg_for(model_dir, tmp_path))
    monkeypatch.setattr(ro.ShardWriter, "write_group", real_write)
    shard = next(tmp_path.glob(".out.partial-*/shard-*.jsonl"))
    with open(shard, "a") as f:  # a complete group of another run, copied in
        f.writelines(json.dumps(dict(r, group_id="s0:elsewhere")) + "\n" for r in written[0])
    with pytest.raises(BadInputError, match="holds group 's0:elsewhere', which this run does not select"):
        rollout(cfg_for(model_dir, tmp_path))


def test_force_replaces_another_shards_output(model_dir, tmp_path, fake_engine):
    rollout(cfg_for(model_dir, tmp_path, shard_index=0, num_shards=2))
    res = rollout(cfg_for(model_dir, tmp_path, shard_index=1, num_shards=2, force=True))
    assert not res["already_done"] and res["summary"]["shard"] == "shard-00001-of-00002.jsonl"
    assert [p.name for p in (tmp_path / "out").glob("shard-*")] == ["shard-00001-of-00002.jsonl"]


def test_which_gpu_of_a_node_ran_it_is_not_part_of_the_fingerprint(model_dir, tmp_path, fake_engine, monkeypatch):
    monkeypatch.setattr(ro, "resolve_device", lambda device: device)  # no GPU here: take cuda:N as given
    rollout(cfg_for(model_dir, tmp_path, device="cuda:0", max_prompts=1))
    assert rollout(cfg_for(model_dir, tmp_path, device="cuda:1", max_prompts=1))["already_done"]
    assert read_manifest(tmp_path / "out")["config"]["device"] == "cuda"


class _ShortGroupEngine(FakeEngine):
    def generate(self, prompt_ids, sp, n, progress=None, seeds=None):
        return [group[:-1] for group in super().generate(prompt_ids, sp, n, progress, seeds)]


def test_an_engine_returning_a_short_group_stops_the_rollout(model_dir, tmp_path, monkeypatch):
    _use_engine(monkeypatch, _ShortGroupEngine)
    with pytest.raises(RuntimeError, match=r"engine returned 2 completions for \S+prompts.jsonl:1, expected 3"):
        rollout(cfg_for(model_dir, tmp_path))


def test_records_name_the_adapters_trained_norms(model_dir, tmp_path, fake_engine):
    a = tmp_path / "adapter"
    a.mkdir()
    (a / "adapter_config.json").write_text(json.dumps({"r": 4, "peft_type": "LORA"}))
    (a / "adapter_model.safetensors").write_bytes(b"lora")
    (a / "norms.safetensors").write_bytes(b"norms")  # train-step --train-norms; not in the adapter's hash
    res = rollout(cfg_for(model_dir, tmp_path, adapter=a, max_prompts=1))
    norms = res["manifest"]["inputs"]["adapter_norms"]
    assert len(norms) == 64 and {r["policy"]["norms"] for r in read_records(tmp_path / "out")} == {norms}


# ---- CLI --------------------------------------------------------------------------------------------
def test_cli_table_counts_resumed_and_skipped_prompts_and_g_defaults_to_8(model_dir, tmp_path, fake_engine):
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "word " * 300, "answer": "1"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = _cli("--model", model_dir, "--prompts", tmp_path / "p.jsonl", "--out", tmp_path / "o", "--max-model-len", 64)
    assert "1 (0 resumed)" in r.output and "skipped: prompt too long" in r.output
    assert "wrote 8 completions for 1 prompts" in r.output


def test_quiet_cli_prints_only_the_result_line(model_dir, tmp_path, fake_engine):
    write_prompts(tmp_path / "p.jsonl", n=2)
    # --max-model-len beyond the model's limit: a note, which -q leaves out with the progress bar
    r = _cli("--model", model_dir, "--prompts", tmp_path / "p.jsonl", "--out", tmp_path / "o", "-G", 2, "-q",
             "--max-model-len", 100000)
    assert [ln for ln in r.output.splitlines() if ln.strip()] == [
        f"wrote 4 completions for 2 prompts to {tmp_path / 'o' / 'shard-00000-of-00001.jsonl'}; mean reward "
        f"{read_manifest(tmp_path / 'o')['summary']['reward']['mean']:.3f}"]


def test_cli_passes_shuffle_run_seed_and_seed_through(model_dir, tmp_path, fake_engine):
    prompts = write_prompts(tmp_path / "p.jsonl", n=10)
    _cli("--model", model_dir, "--prompts", prompts, "--out", tmp_path / "o", "-G", 2, "-q",
         "--prompts-per-step", 4, "--shuffle", "--run-seed", 7, "--seed", 3)
    recs = read_records(tmp_path / "o")[::2]
    want = _step_ids(model_dir, tmp_path, _rows(10), prompts_per_step=4, shuffle=True, run_seed=7)
    assert want != ["0", "1", "2", "3"] and [r["prompt_id"] for r in recs] == [f"p{i}" for i in want]
    assert {r["noise"]["seed"] for r in recs} == {7}
    assert [r["sampling"]["seed"] for r in recs] == [ro.derive_seed(3, 0, r["prompt_id"]) for r in recs]


def test_the_progress_line_counts_resumed_completions_in_its_mean_and_names_unsaved_groups():
    # A resumed run's bar showed the mean of the new groups only while the summary's covers the whole shard
    # (a review, 2026-11-27); groups generated but not yet saved now show as such, the bar counting saved ones.
    done = {"g0": [{"reward": 0.0}, {"reward": 1.0}], "g1": [{"reward": 0.0}, {"reward": 0.0}]}
    live = ro._Live.resuming(done)
    assert "mean reward 0.250" in live.line()
    live.reward_sum, live.completions = live.reward_sum + 2.0, live.completions + 2
    assert "mean reward 0.500" in live.line()
    assert live.line(in_batch=3).startswith("+3 generated, saved at the batch's end") and "+" not in live.line()
    assert "mean reward nan" in ro._Live().line()


def _cli_fails(*args):
    return CliRunner().invoke(app, ["rollout", "--device", "cpu", "--max-new-tokens", "4", *map(str, args)])


def test_odd_paths_are_one_line_errors_before_any_work(model_dir, tmp_path, fake_engine):
    # A review (2026-11-27): a dangling symlink as --out was found after all the work (exit 4, "written by another
    # run", a partial dir left); a symlink loop or a name over 255 bytes was a traceback (exit 1); a pipe as
    # --prompts was read once and then fingerprinted as empty, so other prompts later read as "already done".
    import os

    prompts = write_prompts(tmp_path / "p.jsonl", n=2)
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    os.symlink(tmp_path / "loopB", tmp_path / "loopA")
    os.symlink(tmp_path / "loopA", tmp_path / "loopB")
    os.mkfifo(tmp_path / "fifo")
    cases = [(("--prompts", prompts, "--out", tmp_path / "dangling"), "is a symlink to"),
             (("--prompts", prompts, "--out", tmp_path / "loopA"), "loop"),
             (("--prompts", tmp_path / "loopA", "--out", tmp_path / "o1"), "loop"),
             (("--prompts", prompts, "--out", tmp_path / ("a" * 300)), "File name too long"),
             (("--prompts", tmp_path / "fifo", "--out", tmp_path / "o2"), "is not a regular file")]
    for args, needle in cases:
        r = _cli_fails("--model", model_dir, *args, "-G", 2, "-q")
        err = r.stderr.strip()
        assert r.exit_code == 2 and err.startswith("error: ") and "\n" not in err and needle in err, (args, r.output)
    assert fake_engine.calls == [] and sorted(p.name for p in tmp_path.iterdir()) == [
        "dangling", "fifo", "loopA", "loopB", "p.jsonl"]


def test_rewards_beyond_the_limit_are_refused_naming_the_row(model_dir, tmp_path, fake_engine):
    # 1e308 was a traceback from the summary's mean (exit 1, every rerun resuming into it); a weight pushing a
    # finite value to inf failed writing the record.
    prompts = write_prompts(tmp_path / "p.jsonl", n=2)
    (tmp_path / "myr.py").write_text("def huge(c, a, prompt=None):\n    return 1e308\n"
                                     "def big(c, a, prompt=None):\n    return 1e14\n")
    for reward, needle in ((f"{tmp_path / 'myr.py'}:huge", "returned 1e+308"),
                           (f"{tmp_path / 'myr.py'}:big=100", "weighted reward total is 1e+16")):
        r = _cli_fails("--model", model_dir, "--prompts", prompts, "--out", tmp_path / "o", "-G", 2, "-q",
                       "--reward", reward)
        err = r.stderr.strip()
        assert r.exit_code == 2 and needle in err and "1e15" in err and "\n" not in err, r.output
    _cli("--model", model_dir, "--prompts", prompts, "--out", tmp_path / "ok", "-G", 2, "-q",
         "--reward", f"{tmp_path / 'myr.py'}:big")


def test_a_reward_file_under_a_dir_with_a_comma_is_named_by_one_flag(model_dir, tmp_path, fake_engine, monkeypatch):
    # A Hydra multirun dir (lr=1e-5,seed=1/): --reward split its path at the comma, "unknown reward 'outputs/lr'".
    monkeypatch.chdir(tmp_path)
    prompts = write_prompts(tmp_path / "p.jsonl", n=2)
    (tmp_path / "outputs" / "lr=1e-5,seed=1").mkdir(parents=True)
    (tmp_path / "outputs" / "lr=1e-5,seed=1" / "r.py").write_text("def fn(completion, answer):\n    return 2.0\n")
    _cli("--model", model_dir, "--prompts", prompts, "--out", tmp_path / "o", "-G", 2, "-q",
         "--reward", "outputs/lr=1e-5,seed=1/r.py:fn=0.5", "--reward", "gsm8k,format=0")
    rec = read_records(tmp_path / "o" / "shard-00000-of-00001.jsonl")[0]
    assert rec["rewards"]["outputs/lr=1e-5,seed=1/r.py:fn"] == 2.0 and set(rec["rewards"]) == {
        "outputs/lr=1e-5,seed=1/r.py:fn", "gsm8k", "format"}
    assert rec["reward"] == 1.0 + rec["rewards"]["gsm8k"]


def test_an_already_done_rerun_removes_the_partial_dir_an_interrupted_force_redo_left(model_dir, tmp_path, fake_engine):
    # A --force redo stopped by SIGTERM left .o.partial-<fp> beside the finished --out for good: every later run
    # answered "already done" and none resumed or removed it (a review, 2026-11-27). A writer still running keeps it.
    import fcntl

    prompts = write_prompts(tmp_path / "p.jsonl", n=2)
    args = ("--model", model_dir, "--prompts", prompts, "--out", tmp_path / "o", "-G", 2, "-q")
    _cli(*args)
    fp = read_manifest(tmp_path / "o")["fingerprint"]
    part = tmp_path / f".o.partial-{fp[:16]}"
    part.mkdir()
    (part / "shard-00000-of-00001.jsonl").write_text("{}\n")
    lock = part.with_name(part.name + ".lock")
    with open(lock, "a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert "already" in _cli(*args).output and part.exists()  # a redo holding the lock keeps its directory
    assert "already" in _cli(*args).output and not part.exists() and not lock.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o", "p.jsonl"]


def test_without_flock_an_already_done_rerun_leaves_a_partial_dir_alone(model_dir, tmp_path, fake_engine, monkeypatch):
    # On a file system without flock (NFS without lockd) a live --force redo's directory cannot be told from a
    # leftover one: the sweep must not delete it (a review of the sweep, 2026-11-27).
    import errno
    import fcntl

    prompts = write_prompts(tmp_path / "p.jsonl", n=2)
    args = ("--model", model_dir, "--prompts", prompts, "--out", tmp_path / "o", "-G", 2, "-q")
    _cli(*args)
    part = tmp_path / f".o.partial-{read_manifest(tmp_path / 'o')['fingerprint'][:16]}"
    part.mkdir()

    def no_flock(*a):
        raise OSError(errno.ENOLCK, "no locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    assert "already" in _cli(*args).output and part.exists()


def test_max_model_len_counts_as_the_context_the_run_has(model_dir, tmp_path, fake_engine, monkeypatch):
    # Unset, the model's limit and anything above it give the same records: they read as "changed" (exit 4), and
    # an interrupted run resumed with the flag added started over (a review, 2026-11-27). A smaller context is
    # another run; an output fingerprinted with the flag as typed (older qerl) still reads as done.
    from qerl_cli.runtime import context_limit

    prompts = write_prompts(tmp_path / "p.jsonl", n=2)
    limit = context_limit(model_dir, None)[0]
    base = ("--model", model_dir, "--prompts", prompts, "-G", 2, "-q")
    _cli(*base, "--out", tmp_path / "o")
    for v in (limit, 100000):
        assert "already" in _cli(*base, "--out", tmp_path / "o", "--max-model-len", v).output
    r = _cli_fails(*base, "--out", tmp_path / "o", "--max-model-len", limit - 1)
    assert r.exit_code == 4 and f"max_model_len: {limit} -> {limit - 1}" in r.stderr, r.output
    new = ro._fingerprint_config
    monkeypatch.setattr(ro, "_fingerprint_config", lambda cfg, *a: dict(new(cfg, *a), max_model_len=cfg.max_model_len))
    _cli(*base, "--out", tmp_path / "old", "--max-model-len", 100000)
    monkeypatch.setattr(ro, "_fingerprint_config", new)
    assert "already" in _cli(*base, "--out", tmp_path / "old", "--max-model-len", 100000).output


def test_a_prompt_token_past_the_models_vocabulary_is_named_before_generation(tmp_path):
    """A tokenizer with tokens the model has no embedding for (added without resizing): the row is named
    up front, where the engine had refused it mid-run as 'prompt 0' (its index in the batch) after
    generating the batches before it."""
    from transformers import AutoTokenizer

    src = make_tiny_hf_model(tmp_path, vocab=384)
    tok = AutoTokenizer.from_pretrained(src)
    tok.add_tokens([f"<x{i}>" for i in range(384 - len(tok) + 2)])
    tok.save_pretrained(src)
    assert len(tok) > 384
    rows = [{"prompt": "Q: 1 + 1?", "answer": "2"}, {"prompt": "Q: 2 + 2?", "answer": "4"},
            {"prompt": f"Q: {tok.convert_ids_to_tokens(len(tok) - 1)} 3?", "answer": "3"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(BadInputError, match=r"p\.jsonl:3: prompt holds token \d+ .*outside the model's vocabulary of 384"):
        rollout(cfg_for(src, tmp_path, prompts=tmp_path / "p.jsonl", batch_prompts=1, num_generations=2))
    assert not any(p.name.startswith(".out.partial") for p in tmp_path.iterdir())  # nothing was generated
