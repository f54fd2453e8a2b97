"""The rollout stage's logic with a scripted engine: selection, sharding, resume, idempotence, errors.

The engine is replaced by a deterministic fake whose samples depend on the prompt's seed *and* on
its batch (as a real batched sampler's may, through the logits' rounding), so these tests prove the
stage's resume gives the records of an uninterrupted run without relying on batch-independent sampling.
End-to-end runs on the real engine are in tests/test_rollout_engine.py.
"""

import json
import random
import re
import warnings
from dataclasses import dataclass

import pytest
from typer.testing import CliRunner

import qerl_cli.outputs as outputs
import qerl_cli.rollout as ro
from qerl_cli.cli import app
from qerl_cli.errors import BadInputError, LineageError, OutputBusyError, OutputExistsError
from qerl_cli.outputs import read_manifest
from qerl_cli.rollout import RolloutConfig, rollout, select_prompts
from qerl_cli.shards import read_records
from tests.helpers import make_tiny_hf_model


@dataclass
class FakeCompletion:
    token_ids: list
    logprobs: list
    text: str
    finish_reason: str


class FakeEngine:
    calls: list = []
    seeds: list = []

    def __init__(self, tokenizer, crash_after_groups=None):
        self.tok = tokenizer
        self.crash_after = crash_after_groups

    def generate(self, prompt_ids, sp, n, progress=None, seeds=None):
        FakeEngine.calls.append(len(prompt_ids))
        FakeEngine.seeds.append(list(seeds))
        out = []
        for pos, ids in enumerate(prompt_ids):
            rng = random.Random(f"{seeds[pos]}:{seeds}:{len(ids)}")
            group = []
            for _ in range(n):
                text = f"#### {rng.randint(0, 3)}"
                toks = self.tok(text, add_special_tokens=False)["input_ids"]
                group.append(FakeCompletion(toks, [-rng.random() for _ in toks], text,
                                            rng.choice(["stop", "length"])))
            out.append(group)
        return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("m"), vocab=384)


@pytest.fixture()
def fake_engine(monkeypatch):
    FakeEngine.calls, FakeEngine.seeds = [], []

    def make(cfg, tokenizer, device, torch_dtype, sigma, max_model_len, **_):
        return ro._Generator(FakeEngine(tokenizer), "sp", "fake"), None

    monkeypatch.setattr(ro, "_native_generator", make)
    return FakeEngine


def write_prompts(path, n=10, answer=True):
    with open(path, "w") as f:
        for i in range(n):
            row = {"prompt": f"Q{i}: what is {i} mod 4?", "id": f"p{i}"}
            if answer:
                row["answer"] = str(i % 4)
            f.write(json.dumps(row) + "\n")
    return path


def cfg_for(model_dir, tmp_path, **kw):
    prompts = tmp_path / "prompts.jsonl"
    if not prompts.exists():
        write_prompts(prompts)
    base = dict(model=model_dir, prompts=prompts, out=tmp_path / "out", num_generations=3, max_new_tokens=8,
                batch_prompts=3, progress=False, device="cpu")
    base.update(kw)
    return RolloutConfig(**base)


def test_records_summary_and_manifest(model_dir, tmp_path, fake_engine):
    res = rollout(cfg_for(model_dir, tmp_path, rewards=("gsm8k", "format=0.5")))
    recs = read_records(tmp_path / "out")
    assert len(recs) == 30 and fake_engine.calls == [3, 3, 3, 1]
    assert (tmp_path / "out" / "shard-00000-of-00001.jsonl").exists()
    r = recs[0]
    assert r["group_id"] == "s0:p0" and r["prompt"] == "Q0: what is 0 mod 4?" and r["answer"] == "0"
    assert r["policy"]["adapter"] is None and len(r["policy"]["base"]) == 64
    assert r["noise"] == {"sigma": 0.0, "seed": 0, "step": 0, "norms": []} and r["engine"] == "fake"
    assert set(r["sampling"]) >= {"temperature", "top_p", "top_k", "seed"}
    for rec in recs:  # the rewards really are the gsm8k verdicts
        want = 1.0 if rec["completion"] == f"#### {rec['answer']}" else 0.0
        assert rec["rewards"] == {"gsm8k": want, "format": 0.0} and rec["reward"] == want
    s = res["summary"]
    rewards = [x["reward"] for x in recs]
    assert s["completions"] == 30 and s["groups"] == 10
    assert s["reward"]["mean"] == pytest.approx(sum(rewards) / 30)
    zero_var = sum(len({x["reward"] for x in recs[i:i + 3]}) == 1 for i in range(0, 30, 3)) / 10
    assert s["zero_variance_group_fraction"] == pytest.approx(zero_var)
    assert s["truncated_fraction"] == pytest.approx(sum(x["finish_reason"] == "length" for x in recs) / 30)
    assert s["completion_tokens"]["max"] == max(len(x["completion_token_ids"]) for x in recs)
    m = read_manifest(tmp_path / "out")
    assert m["stage"] == "rollout" and m["summary"]["groups"] == 10
    assert m["config"]["rewards"] == {"gsm8k": 1.0, "format": 0.5}
    assert set(m["inputs"]) == {"model", "prompts", "text"}  # text: tokenizer files and generation_config.json


def test_rerun_is_already_done_and_changes_need_force(model_dir, tmp_path, fake_engine):
    rollout(cfg_for(model_dir, tmp_path))
    n_calls = len(fake_engine.calls)
    res = rollout(cfg_for(model_dir, tmp_path))
    assert res["already_done"] and len(fake_engine.calls) == n_calls
    # --max-num-seqs is a batching knob, not part of the fingerprint
    assert rollout(cfg_for(model_dir, tmp_path, max_num_seqs=7))["already_done"]
    with pytest.raises(OutputExistsError, match="--force"):
        rollout(cfg_for(model_dir, tmp_path, temperature=0.5))
    assert not rollout(cfg_for(model_dir, tmp_path, temperature=0.5, force=True))["already_done"]


def test_shards_are_disjoint_and_cover(model_dir, tmp_path, fake_engine):
    seen = []
    for i in range(3):
        rollout(cfg_for(model_dir, tmp_path, out=tmp_path / f"s{i}", shard_index=i, num_shards=3))
        ids = [r["prompt_id"] for r in read_records(tmp_path / f"s{i}" / f"shard-0000{i}-of-00003.jsonl")]
        seen.append(set(ids))
    assert set().union(*seen) == {f"p{i}" for i in range(10)}
    assert sum(map(len, seen)) == 10
    # a train-step can read all three dirs by glob
    assert len(read_records(str(tmp_path / "s*"))) == 30


def test_more_shards_than_prompts_gives_empty_shard(model_dir, tmp_path, fake_engine):
    from qerl_cli.errors import QerlWarning

    write_prompts(tmp_path / "prompts.jsonl", n=2)
    with pytest.warns(QerlWarning, match="shard 2 of 3 gets no prompts"):  # a Slurm task spent on nothing
        res = rollout(cfg_for(model_dir, tmp_path, shard_index=2, num_shards=3))
    assert res["summary"]["groups"] == 0 and fake_engine.calls == []
    assert (tmp_path / "out" / "shard-00002-of-00003.jsonl").read_text() == ""


def test_a_shard_whose_prompts_are_all_too_long_writes_an_empty_shard(model_dir, tmp_path, fake_engine):
    """--long-prompts skip over a sharded step: the shard that happens to get only long prompts writes an
    empty shard with a warning (as one with no prompts does) instead of failing its Slurm task, which stopped
    the run although the unsharded step, and the other shard, rolled out the prompts that fit."""
    from qerl_cli.errors import QerlWarning

    with open(tmp_path / "prompts.jsonl", "w") as f:
        for i in range(4):  # odd rows long: round robin gives shard 1 only those
            f.write(json.dumps({"prompt": "Q" if i % 2 == 0 else "Q " * 200, "answer": "1"}) + "\n")
    kw = dict(max_model_len=60, num_shards=2)
    assert rollout(cfg_for(model_dir, tmp_path, out=tmp_path / "s0", shard_index=0, **kw))["summary"]["groups"] == 2
    with pytest.warns(QerlWarning, match="shard 1 of 2: all 2 of its prompts are longer"):
        res = rollout(cfg_for(model_dir, tmp_path, out=tmp_path / "s1", shard_index=1, **kw))
    assert res["summary"]["groups"] == 0 and res["summary"]["skipped_long_prompts"] == 2
    assert (tmp_path / "s1" / "shard-00001-of-00002.jsonl").read_text() == ""
    assert rollout(cfg_for(model_dir, tmp_path, out=tmp_path / "s1", shard_index=1, **kw))["already_done"]
    with pytest.raises(BadInputError, match="all 2 selected prompts are longer"):  # unsharded: still refused
        rollout(cfg_for(model_dir, tmp_path, out=tmp_path / "one", max_model_len=60, max_prompts=None,
                        prompts=_long_only(tmp_path)))


def _long_only(tmp_path):
    p = tmp_path / "long.jsonl"
    p.write_text("".join(json.dumps({"prompt": "Q " * 200, "answer": "1"}) + "\n" for _ in range(2)))
    return p


def test_resume_after_crash_equals_uninterrupted(model_dir, tmp_path, fake_engine, monkeypatch):
    full = tmp_path / "full"
    rollout(cfg_for(model_dir, tmp_path, out=full))
    want = read_records(full)

    # crash in the middle of the 3rd batch: its first group is written, then the process dies
    real_write = ro.ShardWriter.write_group
    count = {"n": 0}

    def dying_write(self, records):
        if count["n"] == 7:
            # the 8th group tears mid-line, as a kill during write() would leave it
            self._f.write(json.dumps(records[0])[:50].encode())
            self._f.flush()
            raise KeyboardInterrupt
        count["n"] += 1
        return real_write(self, records)

    monkeypatch.setattr(ro.ShardWriter, "write_group", dying_write)
    with pytest.raises(KeyboardInterrupt):
        rollout(cfg_for(model_dir, tmp_path))
    partials = [p for p in tmp_path.glob(".out.partial-*") if p.is_dir()]  # and its writer lock file
    assert len(partials) == 1 and not (tmp_path / "out").exists()
    assert len((partials[0] / "shard-00000-of-00001.jsonl").read_text().splitlines()) == 7 * 3 + 1

    monkeypatch.setattr(ro.ShardWriter, "write_group", real_write)
    # Rerun with another flag: no resume, and it says why, naming the partial left beside --out.
    from qerl_cli.errors import QerlWarning
    with pytest.warns(QerlWarning, match=rf"{partials[0].name} beside .* made with other arguments"):
        rollout(cfg_for(model_dir, tmp_path, max_new_tokens=6))
    import shutil
    shutil.rmtree(tmp_path / "out")
    fake_engine.calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", QerlWarning)  # resuming its own partial: nothing to say
        res = rollout(cfg_for(model_dir, tmp_path))
    # batches 1-2 complete (6 groups) and p6 of batch 3 kept; batch 3 regenerated whole, then batch 4
    assert fake_engine.calls == [3, 1]
    assert res["summary"]["resumed_groups"] == 7 and res["summary"]["dropped_partial_lines"] == 1
    assert read_records(tmp_path / "out") == want
    assert not list(tmp_path.glob(".out.partial-*"))


def test_a_trl_reward_taking_dataset_columns_scores_a_resumed_rollout_as_an_uninterrupted_one(model_dir, tmp_path,
                                                                                          fake_engine, monkeypatch):
    # the columns are the prompt file's, read again by the resumed run (the shard holds none of them)
    prompts = tmp_path / "cols.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Q{i}?", "id": f"p{i}", "solution": str(i), "meta": {"k": [i]}})
                               + "\n" for i in range(7)))
    r = tmp_path / "acc.py"
    r.write_text("def acc(completions, solution, meta, **kwargs):\n"
                 "    return [float(s) + m['k'][0] / 10 for s, m in zip(solution, meta)]\n")
    kw = dict(prompts=prompts, rewards=(f"{r}:acc",))
    rollout(cfg_for(model_dir, tmp_path, out=tmp_path / "full", **kw))
    want = read_records(tmp_path / "full")
    assert [x["reward"] for x in want] == [i + i / 10 for i in range(7) for _ in range(3)]
    real_write, count = ro.ShardWriter.write_group, {"n": 0}

    def dying_write(self, records):
        if count["n"] == 4:
            raise KeyboardInterrupt
        count["n"] += 1
        return real_write(self, records)

    monkeypatch.setattr(ro.ShardWriter, "write_group", dying_write)
    with pytest.raises(KeyboardInterrupt):
        rollout(cfg_for(model_dir, tmp_path, **kw))
    monkeypatch.setattr(ro.ShardWriter, "write_group", real_write)
    res = rollout(cfg_for(model_dir, tmp_path, **kw))
    assert res["summary"]["resumed_groups"] == 4 and read_records(tmp_path / "out") == want


def test_a_row_without_a_column_a_trl_reward_requires_passes_none_as_its_null_does(model_dir, tmp_path, fake_engine):
    # a JSON row lacking `solution` was refused before generating, where its null passed None (`datasets`, and so TRL,
    # read both as None); and only where this step's --prompts-per-step slice held it, so a long run stopped at that
    # step, or for a row --long-prompts skip drops (row 4). Both pass None now, said by a warning at step 0, of every
    # row the run takes; at every step it was said again, the same line, each step a process of its own in grpo.sh (a
    # 500-step run's log held it 500 times)
    from qerl_cli.errors import QerlWarning

    prompts = tmp_path / "cols.jsonl"
    rows = [{"prompt": "Q0?", "solution": "0"}, {"prompt": "Q1?", "solution": None}, {"prompt": "Q2?", "solution": "2"},
            {"prompt": "Q " * 200}, {"prompt": "Q4?"}, {"prompt": "Q5?", "solution": "5"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = tmp_path / "acc.py"
    r.write_text("def acc(completions, solution, **kwargs):\n    return [-1.0 if s is None else float(s) for s in solution]\n")
    got = []
    for step in range(3):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            res = rollout(cfg_for(model_dir, tmp_path, prompts=prompts, rewards=(f"{r}:acc",), prompts_per_step=2,
                                  step=step, max_model_len=60, out=tmp_path / f"o{step}"))
        said = [str(w.message) for w in seen if issubclass(w.category, QerlWarning) and "hold no value" in str(w.message)]
        assert len(said) == (step == 0), said
        if step == 0:
            assert re.search(r"`solution` \(a parameter without a default\), which 3 of the 6 rows hold no value for "
                             r"\(first: .*cols.jsonl:2\): it is passed None.*said at --step 0 only", said[0]), said
        got += [rec["reward"] for rec in read_records(tmp_path / f"o{step}")]
    assert res["summary"]["groups"] == 2 and got == [x for x in (0.0, -1.0, 2.0, -1.0, 5.0) for _ in range(3)]


def test_rows_past_max_prompts_are_not_counted_as_passing_none_for_a_column(model_dir, tmp_path, fake_engine):
    # the warning counted every row of the file: with --max-prompts 2 it said "2 of the 4 rows hold no value" of rows
    # the run never takes, where none it takes lacked the column
    from qerl_cli.errors import QerlWarning

    prompts = tmp_path / "cols.jsonl"
    rows = [{"prompt": "Q0?", "solution": "0"}, {"prompt": "Q1?", "solution": "1"}, {"prompt": "Q2?"}, {"prompt": "Q3?"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = tmp_path / "acc.py"
    r.write_text("def acc(completions, solution, **kwargs):\n    return [float(s) for s in solution]\n")
    kw = dict(prompts=prompts, rewards=(f"{r}:acc",))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rollout(cfg_for(model_dir, tmp_path, max_prompts=2, **kw))
    assert not [w for w in seen if "hold no value" in str(w.message)]
    with pytest.warns(QerlWarning, match=r"which 1 of the 3 rows hold no value for \(first: .*cols.jsonl:3\)"):
        with pytest.raises(BadInputError, match=r"reward '.*acc' raised TypeError"):  # float(None)
            rollout(cfg_for(model_dir, tmp_path, max_prompts=3, out=tmp_path / "o3", **kw))


def test_a_row_without_the_answer_a_reward_needs_is_refused_before_the_first_step(model_dir, tmp_path, fake_engine):
    # the check covered only this step's --prompts-per-step slice: steps 0 and 1 ran and step 2 stopped on row 5, and
    # step 1 stopped on row 3, which --long-prompts skip drops (never generated). Every row the run takes is checked
    # now, at every step, as the columns are (`check_columns`), but a row skip drops and one past --max-prompts
    prompts = tmp_path / "ans.jsonl"
    rows = [{"prompt": "Q0?", "answer": "0"}, {"prompt": "Q1?", "answer": "1"}, {"prompt": "Q2?", "answer": "2"},
            {"prompt": "Q " * 200}, {"prompt": "Q4?", "answer": "4"}, {"prompt": "Q5?"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kw = dict(prompts=prompts, rewards=("gsm8k",), prompts_per_step=2, max_model_len=60)
    for step in (0, 1):
        with pytest.raises(BadInputError, match=r"ans.jsonl:6: row has no `answer`, but reward 'gsm8k' needs one "
                                                r"\(2 rows of .*ans.jsonl have none\)"):
            rollout(cfg_for(model_dir, tmp_path, step=step, out=tmp_path / f"o{step}", **kw))
    assert not fake_engine.calls  # refused before generating
    for step in (0, 1):  # row 6 past --max-prompts; row 4, too long, is skipped
        res = rollout(cfg_for(model_dir, tmp_path, step=step, out=tmp_path / f"o{step}", max_prompts=5, **kw))
    assert res["summary"]["groups"] == 1 and res["summary"]["skipped_long_prompts"] == 1
    with pytest.raises(BadInputError, match=r"ans.jsonl:4: row has no `answer`"):  # --long-prompts error keeps it
        rollout(cfg_for(model_dir, tmp_path, out=tmp_path / "o9", max_prompts=5, long_prompts="error", **kw))


def test_a_row_whose_reference_is_under_another_name_is_told_of_answer_key(model_dir, tmp_path, fake_engine):
    # a chat set with its reference in `final_answer` was refused "row has no `answer` ... (add answers, or use rewards
    # that need none)", of a file holding the answers; with --answer-key final_answer a null there was named `answer`
    prompts = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Q{i}?"}], "final_answer": str(i), "level": 1} for i in range(3)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    chat = tmp_path / "chat.jinja"
    chat.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(BadInputError) as e:
        rollout(cfg_for(model_dir, tmp_path, prompts=prompts, rewards=("gsm8k",), chat_template_file=chat))
    assert "chat.jsonl:1: row has no `answer`" in str(e.value)
    assert "--answer-key COLUMN; the row's keys: final_answer, level, messages" in e.value.hint
    rows[2]["final_answer"] = None
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(BadInputError, match=r"chat.jsonl:3: row has no reference \(its `final_answer`, named by "
                                            r"--answer-key, is null or blank\), but reward 'gsm8k' needs one"):
        rollout(cfg_for(model_dir, tmp_path, prompts=prompts, rewards=("gsm8k",), chat_template_file=chat,
                        answer_key="final_answer"))
    assert not fake_engine.calls


def test_a_rollout_keeps_the_dataset_columns_only_where_a_reward_takes_them(model_dir, tmp_path, fake_engine,
                                                                            monkeypatch):
    # every row's other columns (a code dataset's test cases: 670 MB of objects for 100k rows of a 150 MB file) were
    # held through the whole run for the built-in rewards too, which read none of them
    prompts = tmp_path / "cols.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Q{i}?", "answer": str(i), "tests": [[i, i + 1]] * 50})
                               + "\n" for i in range(4)))
    loaded = []

    def spy(*args, **kwargs):
        loaded.append(real(*args, **kwargs))
        return loaded[-1]

    real = ro.load_prompts
    monkeypatch.setattr(ro, "load_prompts", spy)
    r = tmp_path / "r.py"
    r.write_text("def one(completions, **kwargs):\n    return [float(len(t)) for t in kwargs['tests']]\n"
                 "def none(completions, answer):\n    return [0.0] * len(completions)\n")
    for rewards, kept in ((("gsm8k", "format"), False), ((f"{r}:none",), False), ((f"{r}:one",), True)):
        rollout(cfg_for(model_dir, tmp_path, prompts=prompts, rewards=rewards, out=tmp_path / f"o{len(loaded)}"))
        assert [bool(row.columns) for row in loaded[-1]] == [kept] * 4, rewards
    assert {x["reward"] for x in read_records(tmp_path / "o2")} == {50.0}


def test_prompts_per_step_walks_the_dataset(model_dir, tmp_path):
    rows = [type("R", (), {"id": str(i)})() for i in range(10)]

    def ids(**kw):
        return [r.id for r in select_prompts(rows, cfg_for(model_dir, tmp_path, **kw))]

    assert ids(prompts_per_step=4, step=0) == ["0", "1", "2", "3"]
    assert ids(prompts_per_step=4, step=2) == ["8", "9", "0", "1"]  # wraps into the next epoch
    assert ids(prompts_per_step=4, step=1, shard_index=1, num_shards=2) == ["5", "7"]
    assert ids(max_prompts=3) == ["0", "1", "2"]
    shuffled = [ids(prompts_per_step=5, step=k, shuffle=True, run_seed=1) for k in range(2)]
    assert sorted(shuffled[0] + shuffled[1], key=int) == [str(i) for i in range(10)]  # one epoch = a permutation
    assert shuffled[0] != ["0", "1", "2", "3", "4"]
    with pytest.raises(BadInputError, match="--prompts-per-step 11 is more than the 10"):
        ids(prompts_per_step=11)
    with pytest.raises(BadInputError, match="more than the 3 prompts --max-prompts 3 keeps of"):  # not "the 3 in" a 10-row file
        ids(prompts_per_step=4, max_prompts=3)


def test_shuffled_steps_that_cross_an_epoch_hold_p_distinct_rows_and_epochs_stay_permutations(model_dir, tmp_path):
    # A step crossing an epoch boundary could meet a row twice; one copy was dropped, so the step came
    # out short and that row went unused for the whole next epoch (GSM8K, P = 512: 94 slots lost).
    # Below 2P rows too (900 rows, P = 512: 25 of 200 steps short), where the last epoch's tail can
    # reach its own moved head.
    import math

    for n in range(2, 13):
        rows = [type("R", (), {"id": str(i)})() for i in range(n)]
        for p in range(1, n + 1):
            span = 3 * math.lcm(n, p)  # positions covering whole epochs and whole steps
            used = []
            for k in range(span // p):
                cfg = cfg_for(model_dir, tmp_path, prompts_per_step=p, step=k, shuffle=True, run_seed=n * 7 + p)
                step = [r.id for r in select_prompts(rows, cfg)]
                assert len(step) == len(set(step)) == p, (n, p, k, step)
                used += step
            assert all(used.count(str(i)) == span // n for i in range(n)), (n, p)
            for e in range(span // n):  # every epoch (positions e*n .. e*n+n-1) is a permutation
                assert sorted(used[e * n:(e + 1) * n], key=int) == [str(i) for i in range(n)], (n, p, e)


def test_step_slice_in_records(model_dir, tmp_path, fake_engine):
    rollout(cfg_for(model_dir, tmp_path, prompts_per_step=4, step=2))
    recs = read_records(tmp_path / "out")
    assert [r["prompt_id"] for r in recs[::3]] == ["p8", "p9", "p0", "p1"]
    assert {r["step"] for r in recs} == {2} and recs[0]["group_id"] == "s2:p8"


def test_aqn_sigma_recorded(model_dir, tmp_path, monkeypatch):
    got = {}

    def make(cfg, tokenizer, device, torch_dtype, sigma, max_model_len, **_):
        got["sigma"] = sigma
        return ro._Generator(FakeEngine(tokenizer), "sp", "fake"), None

    monkeypatch.setattr(ro, "_native_generator", make)
    rollout(cfg_for(model_dir, tmp_path, step=5, total_steps=11, aqn_sigma_start=1e-2, aqn_sigma_end=1e-4,
                    aqn_stages=10, run_seed=9, max_prompts=1))
    # 11 steps in 11 intervals: step 5 is noisy stage 5 -> 1e-2 * (1e-2)**(4/9)
    want = 1e-2 * (1e-4 / 1e-2) ** (4 / 9)
    assert got["sigma"] == pytest.approx(want)
    assert read_records(tmp_path / "out")[0]["noise"] == {"sigma": pytest.approx(want), "seed": 9, "step": 5,
                                                          "norms": ["input_layernorm", "post_attention_layernorm"]}


@pytest.mark.parametrize(
    "kw, err, msg",
    [
        (dict(rewards=("nope",)), BadInputError, r"unknown reward 'nope' \(known: format, gsm8k, math"),
        (dict(num_generations=0), BadInputError, "--num-generations must be >= 1"),
        (dict(top_p=0.0), BadInputError, "--top-p"),
        (dict(shard_index=2, num_shards=2), BadInputError, "--shard-index 2 is outside 0..1"),
        (dict(engine="tgi"), BadInputError, "--engine must be one of native, vllm"),
        (dict(aqn_sigma_start=0.01), BadInputError, "--aqn-sigma-start needs --total-steps"),
        (dict(long_prompts="cut"), BadInputError, "--long-prompts must be one of"),
        (dict(device="gpu"), BadInputError, "--device must be auto, cpu, cuda or cuda:N"),
        (dict(stop=("",)), BadInputError, "--stop strings must be non-empty"),
        # NaN passed "< 0" checks: a traceback, or an error blaming the sampler after generating
        (dict(aqn_sigma_start=float("nan"), total_steps=10), BadInputError, "must be finite numbers >= 0"),
        (dict(aqn_sigma_start=0.01, aqn_sigma_end=float("inf"), total_steps=10), BadInputError, "finite"),
        # it changed no row's order, only the fingerprint (dropping it later was exit 4)
        (dict(shuffle=True), BadInputError, "--shuffle reorders the epochs of --prompts-per-step"),
    ],
)
def test_bad_flags(model_dir, tmp_path, fake_engine, kw, err, msg):
    with pytest.raises(err, match=msg):
        rollout(cfg_for(model_dir, tmp_path, **kw))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_a_bad_flag_value_is_bad_input_also_over_an_existing_output(model_dir, tmp_path, fake_engine):
    # --long-prompts was checked only when prompts were encoded, after --out's check: over a finished
    # output the typo read as "holds a rollout output made from different inputs" (exit 4; audit)
    rollout(cfg_for(model_dir, tmp_path, max_prompts=1))
    with pytest.raises(BadInputError, match="--long-prompts must be one of"):
        rollout(cfg_for(model_dir, tmp_path, max_prompts=1, long_prompts="bogus"))


def test_bad_prompt_files(model_dir, tmp_path, fake_engine):
    with pytest.raises(BadInputError, match="prompt file .*nope.jsonl does not exist"):
        rollout(cfg_for(model_dir, tmp_path, prompts=tmp_path / "nope.jsonl"))
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"\n')
    with pytest.raises(BadInputError, match=r"bad.jsonl:2: not valid JSON"):
        rollout(cfg_for(model_dir, tmp_path, prompts=p))
    p.write_text('{"prompt": "a", "answer": "1"}\n{"text": "b"}\n')
    with pytest.raises(BadInputError, match=r"bad.jsonl:2: row has neither `prompt` nor `messages`"):
        rollout(cfg_for(model_dir, tmp_path, prompts=p))
    res = rollout(cfg_for(model_dir, tmp_path, prompts=p, skip_bad_lines=True))
    assert res["summary"]["skipped_bad_rows"] == 1 and res["summary"]["groups"] == 1
    write_prompts(tmp_path / "noans.jsonl", n=2, answer=False)
    with pytest.raises(BadInputError, match=r"noans.jsonl:1: row has no `answer`, but reward 'gsm8k' needs one"):
        rollout(cfg_for(model_dir, tmp_path, prompts=tmp_path / "noans.jsonl", out=tmp_path / "o2"))
    # a reward that needs no answer is fine without one
    assert rollout(cfg_for(model_dir, tmp_path, prompts=tmp_path / "noans.jsonl", out=tmp_path / "o2",
                           rewards=("format",)))["summary"]["groups"] == 2
    assert fake_engine.calls  # the engine ran only for the valid configurations


def test_long_prompts_skip_or_error(model_dir, tmp_path, fake_engine):
    p = tmp_path / "long.jsonl"
    p.write_text(json.dumps({"prompt": "hi", "answer": "1"}) + "\n"
                 + json.dumps({"prompt": "Natalia sold clips " * 30, "answer": "2"}) + "\n")
    res = rollout(cfg_for(model_dir, tmp_path, prompts=p, max_model_len=32))
    assert res["summary"]["groups"] == 1 and res["summary"]["skipped_long_prompts"] == 1
    assert "long.jsonl:2" in res["summary"]["skipped_long"][0]
    with pytest.raises(BadInputError, match=r"long.jsonl:2: prompt has \d+ tokens, more than the 31"):
        rollout(cfg_for(model_dir, tmp_path, prompts=p, max_model_len=32, long_prompts="error", out=tmp_path / "o3"))


def test_adapter_lineage_refused(model_dir, tmp_path, fake_engine):
    a = tmp_path / "adapter"
    a.mkdir()
    (a / "adapter_config.json").write_text(json.dumps({"r": 4, "peft_type": "LORA"}))
    (a / "trainer_state.json").write_text(json.dumps({"base_model_hash": "f" * 64}))
    with pytest.raises(LineageError, match=r"trained on base ffffffffffff .* --model \S+ has hash [0-9a-f]{12}"):
        rollout(cfg_for(model_dir, tmp_path, adapter=a))
    with pytest.raises(BadInputError, match="no adapter_config.json"):
        rollout(cfg_for(model_dir, tmp_path, adapter=tmp_path))


def test_user_reward_file_is_an_input(model_dir, tmp_path, fake_engine):
    f = tmp_path / "myrew.py"
    f.write_text("def r(completion, answer):\n    return len(completion)\n")
    res = rollout(cfg_for(model_dir, tmp_path, rewards=(f"{f}:r",), max_prompts=2))
    recs = read_records(tmp_path / "out")
    assert all(x["reward"] == len(x["completion"]) for x in recs)
    assert f"reward:{f}:r" in res["manifest"]["inputs"]
    f.write_text("def r(completion, answer):\n    return 0.0\n")
    with pytest.raises(OutputExistsError):  # edited reward code = different inputs
        rollout(cfg_for(model_dir, tmp_path, rewards=(f"{f}:r",), max_prompts=2))


def test_out_over_an_input_and_all_prompts_too_long_are_refused(model_dir, tmp_path, fake_engine):
    import shutil

    mc = tmp_path / "mc"
    shutil.copytree(model_dir, mc)
    for model, out, flag in ((mc, mc, "--model"), (model_dir, tmp_path, "--prompts")):
        with pytest.raises(BadInputError, match=f"overlaps {flag}"):
            rollout(cfg_for(model, tmp_path, out=out, force=True))
    assert (mc / "config.json").is_file()
    with pytest.raises(BadInputError, match="all 2 selected prompts are longer than the 1 tokens"):
        rollout(cfg_for(model_dir, tmp_path, max_prompts=2, max_model_len=2))
    assert not (tmp_path / "out").exists()
    with pytest.raises(BadInputError, match="--num-shards must be >= 1, got 0"):
        rollout(cfg_for(model_dir, tmp_path, num_shards=0))


def test_quiet_cli_still_warns_of_skipped_prompts(model_dir, tmp_path, fake_engine):
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "word " * 300, "answer": "1"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = CliRunner().invoke(app, ["rollout", "--model", str(model_dir), "--prompts", str(tmp_path / "p.jsonl"),
                                 "--out", str(tmp_path / "o"), "-G", "2", "--device", "cpu", "--max-model-len", "64",
                                 "--max-new-tokens", "4", "-q"])
    assert r.exit_code == 0, r.output
    assert "warning: skipped 1 prompts too long for the context" in r.output
    assert "wrote 2 completions for 1 prompts" in r.output


def test_a_path_with_brackets_is_printed_as_it_is(model_dir, tmp_path, fake_engine):
    # Rich read "[x]" in a path as markup and dropped it: "already done: .../run /o", a path that is not there
    prompts = write_prompts(tmp_path / "p.jsonl", n=1)
    out = tmp_path / "run [x]" / "o"
    args = ["rollout", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out), "-G", "2",
            "--device", "cpu", "-q"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and f"to {out / 'shard-00000-of-00001.jsonl'}" in " ".join(r.output.split()), r.output
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and f"already done: {out} holds" in r.output, r.output


def test_a_model_path_with_brackets_does_not_stop_the_rollout(model_dir, tmp_path, fake_engine):
    # The "loading MODEL" status line is Rich markup: a model dir "a[" / "b]" read as a closing tag "[/b]" stopped
    # the rollout with a MarkupError before it began (without -q)
    import shutil

    model = tmp_path / "a[" / "b]"
    shutil.copytree(model_dir, model)
    prompts = write_prompts(tmp_path / "p.jsonl", n=1)
    r = CliRunner().invoke(app, ["rollout", "--model", str(model), "--prompts", str(prompts), "--out", str(tmp_path / "o"),
                                 "-G", "2", "--device", "cpu"])
    assert r.exit_code == 0 and "wrote 2 completions" in r.output, (r.output, r.exception)


def test_cli(model_dir, tmp_path, fake_engine):
    prompts = write_prompts(tmp_path / "p.jsonl", n=4)
    args = ["rollout", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path / "o"),
            "-G", "2", "--reward", "gsm8k", "--reward", "format=0.1", "--device", "cpu"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "wrote 8 completions for 4 prompts" in r.output and "zero-variance groups" in r.output
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and "already done" in r.output
    r = CliRunner().invoke(app, [*args[:-6], "--reward", "bogus"])
    assert r.exit_code == 2 and "unknown reward 'bogus'" in r.output
    r = CliRunner().invoke(app, ["rollout", "--help"])
    assert r.exit_code == 0 and "--prompts-per-step" in r.output


def test_cli_interrupt_says_groups_are_kept(model_dir, tmp_path, monkeypatch):
    prompts = write_prompts(tmp_path / "p.jsonl", n=4)

    def boom(cfg, tokenizer, device, torch_dtype, sigma, max_model_len, **_):
        raise KeyboardInterrupt

    monkeypatch.setattr(ro, "_native_generator", boom)
    r = CliRunner().invoke(app, ["rollout", "--model", str(model_dir), "--prompts", str(prompts),
                                 "--out", str(tmp_path / "o"), "--device", "cpu", "-q"])
    assert r.exit_code == 130 and "no prompt group was saved yet (0 of 4; " in r.output and "rerun the same" in r.output
    # Nothing saved, nothing left: the partial directory with its empty shard stayed for good, and a later run with
    # other flags warned of "an unfinished run ... rerun that run's command to resume it" (a review, session 57).
    assert not list(tmp_path.glob(".o.*")), list(tmp_path.iterdir())


def test_chat_rows_and_gsm8k_rows(model_dir, tmp_path, fake_engine):
    from transformers import AutoTokenizer

    p = tmp_path / "chat.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}) + "\n"
                 + json.dumps({"question": "Natalia sold 48 clips.", "answer": "48/2 = 24\n#### 1,072"}) + "\n")
    rollout(cfg_for(model_dir, tmp_path, prompts=p, system_prompt="Be brief."))
    recs = read_records(tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(model_dir)
    want = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert recs[0]["prompt"] == [{"role": "user", "content": "2+2?"}]
    assert recs[0]["prompt_token_ids"] == tok(want, add_special_tokens=False)["input_ids"]
    assert recs[3]["prompt"] == "Natalia sold 48 clips." and recs[3]["answer"] == "1072"


def test_second_concurrent_writer_is_refused(model_dir, tmp_path, monkeypatch):
    """The same command started while a run is generating stops at once and leaves its partial dir alone."""
    seen = {}

    def second_run_meanwhile(cfg, tokenizer, device, torch_dtype, sigma, max_model_len, **_):
        part = next(p for p in tmp_path.glob(".out.partial-*") if p.is_dir())
        with pytest.raises(OutputBusyError, match="another qerl rollout is writing"):  # exit 8: FORCE=1 redoes 4s
            rollout(cfg_for(model_dir, tmp_path, max_prompts=2))
        seen["partial_kept"] = part.exists() and part.with_name(part.name + ".lock").exists()
        return ro._Generator(FakeEngine(tokenizer), "sp", "fake"), None

    monkeypatch.setattr(ro, "_native_generator", second_run_meanwhile)
    res = rollout(cfg_for(model_dir, tmp_path, max_prompts=2))
    assert seen == {"partial_kept": True} and res["summary"]["groups"] == 2
    assert not list(tmp_path.glob(".out*")) and not any("lock" in f for f in res["manifest"]["outputs"])


def test_second_writer_is_refused_while_the_first_hashes_and_renames(model_dir, tmp_path, monkeypatch, fake_engine):
    """The lock file lived in the partial directory and was deleted before the manifest was hashed:
    from there to the rename, the same command was admitted into the same directory (audit,
    2026-11-26; with a multi-GB shard that window is seconds). Now it is refused until the rename
    (after it, the output is there and done), and a run that checked before the rename but locks
    after the first finished stops too, leaving the output alone."""
    from qerl_cli.outputs import StageOutput

    cfg = cfg_for(model_dir, tmp_path, max_prompts=2)
    seen = []
    real_manifest, real_swap = StageOutput._write_manifest, StageOutput._swap_into_place

    def second_run(where):
        seen.append((where, "admitted"))
        try:
            if rollout(cfg)["already_done"]:
                seen[-1] = (where, "already done")
        except OutputExistsError as e:
            seen[-1] = (where, str(e).split(" right now")[0])

    def manifest_then(self, work):
        if not seen:
            second_run("hashing")
        return real_manifest(self, work)

    def swap_then(self, work):
        real_swap(self, work)
        if len(seen) == 1:
            second_run("renamed")

    monkeypatch.setattr(StageOutput, "_write_manifest", manifest_then)
    monkeypatch.setattr(StageOutput, "_swap_into_place", swap_then)
    res = rollout(cfg)
    out = str(tmp_path / "out")
    assert seen == [("hashing", f"another qerl rollout is writing {out}"), ("renamed", "already done")]
    assert res["summary"]["groups"] == 2 and read_manifest(tmp_path / "out") == res["manifest"]
    # A run that found no output, then took the lock after another run finished it, stops (exit 8).
    monkeypatch.undo()
    cfg2 = cfg_for(model_dir, tmp_path, max_prompts=2, out=tmp_path / "out2")
    real_enter, first = outputs.WriterLock.__enter__, []

    def finish_another_first(self):
        if not first:
            first.append(None)
            first[0] = rollout(cfg2)  # the other run, from plan to rename
        return real_enter(self)

    monkeypatch.setattr(outputs.WriterLock, "__enter__", finish_another_first)
    with pytest.raises(OutputBusyError, match="was finished by another qerl rollout while this one started"):
        rollout(cfg2)
    assert read_manifest(tmp_path / "out2") == first[0]["manifest"] and not list(tmp_path.glob(".out2*"))


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_engine_vllm_without_vllm_is_one_line_error(model_dir, tmp_path):
    with pytest.raises(BadInputError, match=r"--engine vllm needs vLLM, which is not installed \(pip install 'qerl\[vllm\]'\)"):
        rollout(cfg_for(model_dir, tmp_path, engine="vllm", device="auto"))  # cpu with vllm is refused first
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_prompt_and_answer_key_flags(model_dir, tmp_path, fake_engine):
    p = tmp_path / "custom.jsonl"
    p.write_text("".join(json.dumps({"query": f"q{i}", "gold": {"v": i}}) + "\n" for i in range(3)))
    args = ["rollout", "--model", str(model_dir), "--prompts", str(p), "--out", str(tmp_path / "o"), "-G", "2",
            "--device", "cpu", "-q", "--prompt-key", "query", "--answer-key", "gold.v"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    recs = read_records(tmp_path / "o")
    assert [(x["prompt"], x["answer"]) for x in recs[::2]] == [("q0", "0"), ("q1", "1"), ("q2", "2")]



def test_a_prompt_at_the_edge_of_the_context_runs_or_is_skipped(tmp_path):
    # The stages' limit is the engine's own (max positions - 1): a prompt of that many tokens minus one
    # generates, one of that many is skipped and counted. The stages once let the latter through and
    # the engine refused the whole run ("prompt 1 has 255 tokens; the engine's max_model_len is 255").
    import torch

    from qerl_cli.data import encode_prompts, load_prompts
    from qerl_cli.engine import LLMEngine
    from qerl_cli.models import load_model
    from qerl_cli.runtime import context_length, load_tokenizer

    model = make_tiny_hf_model(tmp_path, vocab=384)
    cfg_path = model / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "max_position_embeddings": 40}))
    limit = context_length(model)
    assert limit == LLMEngine(load_model(model, dtype=torch.float32), None, max_num_seqs=2).max_model_len == 39
    tok = load_tokenizer(model)

    def row_of(n_tokens, i):
        for k, tail in ((k, tail) for k in range(1, 100) for tail in ("", "?", "!?")):
            row = {"prompt": "Q:" + " 7" * k + tail, "answer": "1", "id": f"r{i}"}
            (tmp_path / "one.jsonl").write_text(json.dumps(row) + "\n")
            if len(encode_prompts(load_prompts(tmp_path / "one.jsonl"), tok)[0].token_ids) == n_tokens:
                return row
        raise AssertionError(f"no prompt of {n_tokens} tokens")

    p = tmp_path / "edge.jsonl"
    p.write_text("".join(json.dumps(row_of(n, i)) + "\n" for i, n in enumerate((limit - 1, limit))))
    res = rollout(cfg_for(model, tmp_path, prompts=p, num_generations=2, max_new_tokens=4))
    assert res["summary"]["groups"] == 1 and res["summary"]["skipped_long_prompts"] == 1
    assert "edge.jsonl:2" in res["summary"]["skipped_long"][0]
    recs = read_records(tmp_path / "out")
    assert [len(r["completion_token_ids"]) for r in recs] == [1, 1]  # room for exactly one new token
    # eval: the same edge, also when --max-model-len asks for more than the model has
    from qerl_cli.evaluate import EvalConfig, evaluate

    (tmp_path / "fits.jsonl").write_text(p.read_text().splitlines()[0] + "\n")
    for asked in (None, 4096):
        got = evaluate(EvalConfig(model, tmp_path / "fits.jsonl", tmp_path / f"e{asked}", max_new_tokens=1,
                                  max_model_len=asked, device="cpu", progress=False))
        assert got["metrics"]["counts"]["problems"] == 1


def test_nan_logits_stop_the_rollout_with_exit_5_keeping_finished_groups(model_dir, tmp_path, monkeypatch):
    # The shard writer refused the record with a ValueError traceback (exit 1); now it is a NumericalError
    # naming the prompt, and the groups written before it stay for a rerun.
    from qerl_cli.errors import NumericalError

    class NanEngine(FakeEngine):
        def generate(self, prompt_ids, sp, n, progress=None, seeds=None):
            out = super().generate(prompt_ids, sp, n, progress, seeds)
            out[1][0].logprobs[0] = float("nan")
            return out

    monkeypatch.setattr(ro, "_native_generator",
                        lambda cfg, tok, *a, **k: (ro._Generator(NanEngine(tok), "sp", "fake"), None))
    with pytest.raises(NumericalError, match=r"prompts.jsonl:2: a completion was sampled from NaN/Inf logits") as e:
        rollout(cfg_for(model_dir, tmp_path))
    assert e.value.exit_code == 5
    partial = next(tmp_path.glob(".out.*/shard-*.jsonl"), None) or next(tmp_path.glob("**/shard-*.jsonl"))
    assert [r["prompt_id"] for r in read_records(partial)] == ["p0"] * 3


def test_another_shard_into_a_finished_shards_out_is_refused_without_force_advice(model_dir, tmp_path, fake_engine):
    from qerl_cli.errors import OutputExistsError

    rollout(cfg_for(model_dir, tmp_path, shard_index=0, num_shards=2))
    with pytest.raises(OutputExistsError, match="holds shard 0 of 2 of a rollout; this is shard 1 of 2") as e:
        rollout(cfg_for(model_dir, tmp_path, shard_index=1, num_shards=2))
    assert "its own --out" in e.value.hint
    assert rollout(cfg_for(model_dir, tmp_path, shard_index=0, num_shards=2))["already_done"]


def test_a_run_shorter_than_the_aqn_stages_is_warned_of(model_dir, tmp_path, fake_engine):
    write_prompts(tmp_path / "p.jsonl", n=2)
    base = ["rollout", "--model", str(model_dir), "--prompts", str(tmp_path / "p.jsonl"), "-G", "2", "--device", "cpu",
            "--max-new-tokens", "4", "-q", "--aqn-sigma-start", "1e-2", "--aqn-sigma-end", "1e-4", "--aqn-stages", "10"]
    short = CliRunner().invoke(app, base + ["--out", str(tmp_path / "a"), "--total-steps", "5"])
    assert short.exit_code == 0 and "the AQN schedule skips stages" in short.output, short.output
    full = CliRunner().invoke(app, base + ["--out", str(tmp_path / "b"), "--total-steps", "11"])
    assert full.exit_code == 0 and "skips stages" not in full.output
    from qerl_cli.errors import QerlWarning
    with pytest.warns(QerlWarning, match="the AQN schedule skips stages"):  # the library says it, not only the CLI
        rollout(cfg_for(model_dir, tmp_path, aqn_sigma_start=1e-2, aqn_sigma_end=1e-4, aqn_stages=10, total_steps=5,
                        out=tmp_path / "c"))



def test_a_stop_inside_a_tag_the_format_reward_needs_is_refused(model_dir, tmp_path, fake_engine):
    # The stop is cut from the text the rewards judge: with --stop '</answer>' every completion, a well-formed one
    # "<think>a</think><answer>3" (cut there) included, scored format 0, silently.
    from qerl_cli.errors import QerlWarning
    from qerl_cli.rewards import format_reward

    assert format_reward("<think>a</think><answer>3") == 0.0
    for stop in ("</answer>", "<answer>", "think>"):
        with pytest.raises(BadInputError, match=r"format reward scores every completion 0"):
            rollout(cfg_for(model_dir, tmp_path, rewards=("gsm8k", "format=0"), stop=(stop,)))
    assert fake_engine.calls == []
    with pytest.warns(QerlWarning, match=r"gsm8k reads no <answer> tag's answer from a completion it stops"):
        rollout(cfg_for(model_dir, tmp_path, stop=("</answer>",), max_prompts=2, out=tmp_path / "g"))
    # math reads the tag too where no box answers (since math 2): warned of beside gsm8k too
    with pytest.warns(QerlWarning, match=r"gsm8k and math read no <answer> tag's answer .*\(#### lines and \\boxed"):
        rollout(cfg_for(model_dir, tmp_path, rewards=("gsm8k", "math"), stop=("</answer>",), max_prompts=2,
                        out=tmp_path / "gm"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", QerlWarning)  # a stop outside the tags: nothing to say
        rollout(cfg_for(model_dir, tmp_path, rewards=("gsm8k", "format"), stop=("\nQ:",), max_prompts=2))

def test_a_stop_that_takes_a_tag_out_of_the_judged_text_is_refused_or_warned_of(model_dir, tmp_path, fake_engine):
    # A review of the check above: a stop holding a tag ("</answer>\n") cuts it wherever it fires, so format scored
    # every completion it stopped 0; one inside <answer> left gsm8k no tag to read, unwarned; and one inside </think>
    # left a think-opening prompt's completions inside an open <think>, where gsm8k and math read nothing: all 0.
    from qerl_cli.errors import QerlWarning
    from qerl_cli.rewards import REWARDS, format_reward
    from qerl_cli.stops import judged_completion
    from tests.helpers import THINKING_CHAT_TEMPLATE

    assert format_reward("<think>a</think><answer>3") == 0.0  # "<think>a</think><answer>3</answer>\n" cut
    with pytest.raises(BadInputError, match=r"never holds </answer> and the format reward scores every completion "
                                            r"it stops 0"):
        rollout(cfg_for(model_dir, tmp_path, rewards=("format",), stop=("</answer>\n",)))
    with pytest.warns(QerlWarning, match=r"--stop '<answer>' .* a completion that answers inside an <answer> tag is "
                                         r"cut before its answer: gsm8k scores it 0"):
        rollout(cfg_for(model_dir, tmp_path, stop=("<answer>",), max_prompts=2, out=tmp_path / "g"))
    # "<think>\n" + "1 mod 4 is 1, so #### 1\n" cut before "</think>": nothing is read after the open <think>
    for kind in ("gsm8k", "math"):
        assert REWARDS[kind].fn(judged_completion("1 mod 4 is 1, so #### 1 \\boxed{1}\n", True), "1") == 0.0
    tpl = tmp_path / "think.jinja"
    tpl.write_text(THINKING_CHAT_TEMPLATE)
    fake_engine.calls.clear()
    for stop, rewards in (("</think>", ("gsm8k",)), ("think>", ("math",)), ("</think>\n", ("gsm8k", "math"))):
        with pytest.raises(BadInputError, match=r"never holds </think>, .* reads? nothing after a <think> left open: "
                                                r"the prompt opens one \(.*prompts.jsonl:1\), so every completion"):
            rollout(cfg_for(model_dir, tmp_path, chat_template_file=tpl, rewards=rewards, stop=(stop,),
                            out=tmp_path / "t"))
    assert fake_engine.calls == [] and not (tmp_path / "t").exists()
    with pytest.warns(QerlWarning, match=r"a completion it stops that opened its own <think> scores 0"):
        rollout(cfg_for(model_dir, tmp_path, stop=("</think>",), max_prompts=2, out=tmp_path / "w"))


def test_a_stop_that_takes_the_opening_think_is_refused_with_format_unless_the_prompt_opens_it(model_dir, tmp_path,
                                                                                                 monkeypatch):
    # format needs the judged text to open with <think>: where the prompt does not open it, the completion does, and
    # --stop '<think>' cut it there (to "", "<think" to "", "<t" likewise): format scored every completion 0. Where
    # the prompt opens it, the completion holds no opening tag and "<think>" + completion is judged: harmless.
    from qerl_cli.errors import QerlWarning
    from qerl_cli.rewards import format_reward
    from tests.helpers import THINKING_CHAT_TEMPLATE

    texts = ["So it is 1.</think><answer>1</answer>"] * 2
    monkeypatch.setattr(ro, "_native_generator", lambda cfg, tok, *a, **k: (
        ro._Generator(_ScriptedEngine(tok, texts), "sp", "fake"), None))
    assert format_reward("") == format_reward("<") == 0.0  # "<think>a</think><answer>1</answer>" cut at each stop
    p = tmp_path / "one.jsonl"
    p.write_text(json.dumps({"prompt": "What is 1 mod 4?", "answer": "1", "id": "a"}) + "\n")
    for stop, every in (("<think>", "every completion"), ("<think", "every completion"),
                        ("<think>\n", "every completion it stops")):
        with pytest.raises(BadInputError, match=rf"never holds <think>, .*\(.*one.jsonl:1\): the format reward "
                                                rf"scores {every} of such a prompt 0"):
            rollout(cfg_for(model_dir, tmp_path, prompts=p, num_generations=2, rewards=("gsm8k", "format=0.1"),
                            stop=(stop,)))
    assert not (tmp_path / "out").exists()
    with pytest.warns(QerlWarning, match=r"opens its own <think> \(its prompt opens none"):  # gsm8k loses its answer
        rollout(cfg_for(model_dir, tmp_path, prompts=p, num_generations=2, rewards=("gsm8k",), stop=("<think>",),
                        out=tmp_path / "g"))  # no format: only a completion that opens <think> needs the tag
    tpl = tmp_path / "think.jinja"
    tpl.write_text(THINKING_CHAT_TEMPLATE)
    rollout(cfg_for(model_dir, tmp_path, prompts=p, chat_template_file=tpl, num_generations=2, rewards=("format",),
                    stop=("<think>",), out=tmp_path / "t"))
    assert [r["rewards"] for r in read_records(tmp_path / "t")] == [{"format": 1.0}] * 2


def test_a_stop_that_overlaps_a_tag_or_takes_the_opening_think_is_refused_or_warned_of(model_dir, tmp_path,
                                                                                        fake_engine):
    # A review of the checks above: a stop that overlaps a tag's edge with whitespace ("\n<answer", ">\n") cuts
    # every tag a completion spaces so ("</think>\n<answer>"), and --stop '<think>' cuts a completion that opens its
    # own <think> to "" before its answer, where gsm8k and math score 0: all four passed unsaid.
    from qerl_cli.errors import QerlWarning
    from qerl_cli.rewards import REWARDS
    from tests.helpers import THINKING_CHAT_TEMPLATE

    opened = "<think>1 mod 4 is 1.</think>\nSo #### 1 \\boxed{1}"
    assert [REWARDS[k].fn(opened, "1") for k in ("gsm8k", "math")] == [1.0, 1.0]
    assert [REWARDS[k].fn(opened[:opened.find("<think>")], "1") for k in ("gsm8k", "math")] == [0.0, 0.0]
    with pytest.raises(BadInputError, match=r"--stop '\\n<answer' .* never holds <answer> and the format reward "
                                            r"scores every completion it stops 0"):
        rollout(cfg_for(model_dir, tmp_path, rewards=("gsm8k", "format=0.1"), stop=("\n<answer",)))
    with pytest.raises(BadInputError, match=r"--stop '>\\n' .* never holds </think> and the format reward"):
        rollout(cfg_for(model_dir, tmp_path, rewards=("format",), stop=(">\n",)))
    assert fake_engine.calls == []
    with pytest.warns(QerlWarning, match=r"--stop '\\n<answer' .* answers inside an <answer> tag .* gsm8k scores it 0"):
        rollout(cfg_for(model_dir, tmp_path, stop=("\n<answer",), max_prompts=2, out=tmp_path / "a"))
    tpl = tmp_path / "think.jinja"
    tpl.write_text(THINKING_CHAT_TEMPLATE)
    with (pytest.raises(BadInputError, match=r"--stop '>\\n' .* never holds </think>, .* the prompt opens one"),
          pytest.warns(QerlWarning, match=r"answers inside an <answer> tag")):  # (">\n" ends "<answer>\n" too)
        rollout(cfg_for(model_dir, tmp_path, chat_template_file=tpl, rewards=("math",), stop=(">\n",),
                        out=tmp_path / "t"))
    for rewards, scores in ((("gsm8k",), "gsm8k scores"), (("gsm8k", "math"), "gsm8k and math score")):
        with pytest.warns(QerlWarning, match=rf"--stop '<think>' .* a completion that opens its own <think> \(its "
                                             rf"prompt opens none: .*prompts.jsonl:1\) is cut there, before its "
                                             rf"answer: {scores} it 0"):
            rollout(cfg_for(model_dir, tmp_path, rewards=rewards, stop=("<think>",), max_prompts=2, force=True,
                            out=tmp_path / "w"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", QerlWarning)  # every prompt opens <think>: its completions hold none to cut
        rollout(cfg_for(model_dir, tmp_path, chat_template_file=tpl, stop=("<think>",), max_prompts=2,
                        out=tmp_path / "o"))


def test_a_stop_that_takes_the_opening_answer_tag_is_warned_of_with_math_too(model_dir, tmp_path, fake_engine):
    # A review: a stop that takes the opening <answer> ('\n<answer', '<answer>') cuts a completion that answers
    # inside the tag (R1-Zero's layout, its box inside) before its answer: math scored it 0 and nothing was said, and
    # gsm8k's warning said its boxes and #### lines still score, which those inside the tag do not.
    from qerl_cli.engine.llm_engine import _stop_cut
    from qerl_cli.errors import QerlWarning
    from qerl_cli.rewards import REWARDS

    done = "<think>1 mod 4 is 1.</think>\n<answer>#### 1 \\boxed{1}</answer>"
    for stop in ("\n<answer", "<answer>", "</answer>"):
        cut = done[:_stop_cut(done, done, (stop,))]
        assert [REWARDS[k].fn(cut, "1") for k in ("gsm8k", "math")] == ([1.0, 1.0] if stop == "</answer>" else [0, 0])
    for rewards, scores in ((("math",), "math scores"), (("gsm8k", "math"), "gsm8k and math score")):
        with pytest.warns(QerlWarning, match=rf"--stop '\\n<answer' .* a completion that answers inside an <answer> "
                                             rf"tag is cut before its answer: {scores} it 0"):
            rollout(cfg_for(model_dir, tmp_path, rewards=rewards, stop=("\n<answer",), max_prompts=2, force=True))
    # math reads the box the closing tag's stop leaves, but since math 2 also a closed tag without a box, which that
    # stop leaves unclosed ("<answer>1" scores 0, "<answer>1</answer>" 1): warned of (it was not, math reading no tag)
    assert REWARDS["math"].fn("<answer>1</answer>", "1") == 1.0 and REWARDS["math"].fn("<answer>1", "1") == 0.0
    with pytest.warns(QerlWarning, match=r"--stop '</answer>' .* math reads no <answer> tag's answer from a completion "
                                         r"it stops \(\\boxed\{\} still score\)"):
        rollout(cfg_for(model_dir, tmp_path, rewards=("math",), stop=("</answer>",), max_prompts=2, force=True))


def test_a_whitespace_stop_where_the_prompt_opens_think_is_warned_of(model_dir, tmp_path, fake_engine):
    # A base model's few-shot stop ($'\n\n', $'\n') with a template that opens <think> cut every completion at its
    # thought's first blank line or line break, the <think> left open: gsm8k, math and format scored it 0, unsaid.
    from qerl_cli.engine.llm_engine import _stop_cut
    from qerl_cli.errors import QerlWarning
    from qerl_cli.rewards import REWARDS
    from qerl_cli.stops import judged_completion
    from tests.helpers import THINKING_CHAT_TEMPLATE

    done = "1 mod 4.\n\nIt is 1.\n</think>\n<answer>#### 1 \\boxed{1}</answer>"
    assert [REWARDS[k].fn(judged_completion(done, True), "1") for k in ("gsm8k", "math", "format")] == [1.0] * 3
    for stop in ("\n\n", "\n"):
        cut = judged_completion(done[:_stop_cut(done, done, (stop,))], True)
        assert [REWARDS[k].fn(cut, "1") for k in ("gsm8k", "math", "format")] == [0.0] * 3
    tpl = tmp_path / "think.jinja"
    tpl.write_text(THINKING_CHAT_TEMPLATE)
    for stop, rewards, scores in (("\n\n", ("gsm8k", "format=0.1"), "format and gsm8k score"),
                                  ("\n", ("math",), "math scores")):
        x = re.escape(repr(stop))
        with pytest.warns(QerlWarning, match=rf"--stop {x} is only whitespace and the prompt opens a <think> "
                                             rf"\(.*prompts.jsonl:1\): a completion is cut at the first {x} of its "
                                             rf"thought, the <think> left open, where {scores} it 0"):
            rollout(cfg_for(model_dir, tmp_path, chat_template_file=tpl, rewards=rewards, stop=(stop,), max_prompts=2,
                            force=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error", QerlWarning)  # no prompt opens <think>: a completion holds no thought to cut
        rollout(cfg_for(model_dir, tmp_path, rewards=("gsm8k", "format=0.1"), stop=("\n\n",), max_prompts=2,
                        out=tmp_path / "plain"))


def test_a_math_reference_the_rule_cannot_read_is_warned_of(model_dir, tmp_path, fake_engine):
    # The math rule reads a reference over MAX_MATH_ANSWER_CHARS as no answer (its parse took seconds a verdict): every
    # completion of that problem scored 0, however right, unsaid (a whole solution without a box as the `answer`).
    from qerl_cli.errors import QerlWarning
    from qerl_cli.math_rule import MAX_MATH_ANSWER_CHARS
    from qerl_cli.rewards import REWARDS

    long = "x^{2} + " * (MAX_MATH_ANSWER_CHARS // 8) + "1"
    assert REWARDS["math"].fn(f"\\boxed{{{long}}}", long) == 0.0
    rows = [{"prompt": "Q0", "answer": "1"}, {"prompt": "Q1", "answer": long}, {"prompt": "Q2", "answer": long + " "},
            {"prompt": "Q3", "answer": f"So $y = \\boxed{{1}}$. {long}"}]  # its box is the reference: read
    prompts = tmp_path / "long.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(QerlWarning, match=r"long.jsonl:2: the reference is over 1,000 characters \(and 1 more row\), "
                                         r"which the math rule reads as no answer: every completion of its problem "
                                         r"scores 0"):
        rollout(cfg_for(model_dir, tmp_path, prompts=prompts, rewards=("math",), max_prompts=4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", QerlWarning)  # no math reward: not its reference
        rollout(cfg_for(model_dir, tmp_path, prompts=prompts, rewards=("format",), max_prompts=4, out=tmp_path / "f"))


def test_each_prompt_gets_its_own_seed_whatever_the_batch(model_dir, tmp_path, fake_engine):
    rollout(cfg_for(model_dir, tmp_path, out=tmp_path / "a", batch_prompts=3, step=2, seed=5))
    rollout(cfg_for(model_dir, tmp_path, out=tmp_path / "b", batch_prompts=4, step=2, seed=5))
    per_prompt = [ro.derive_seed(5, 2, f"p{i}") for i in range(10)]
    assert fake_engine.calls == [3, 3, 3, 1, 4, 4, 2]
    assert sum(fake_engine.seeds[:4], []) == sum(fake_engine.seeds[4:], []) == per_prompt
    recs = read_records(tmp_path / "a")
    assert [r["sampling"]["seed"] for r in recs[::3]] == per_prompt


def test_an_output_finished_under_the_batch_seeded_fingerprint_stays_done(model_dir, tmp_path, fake_engine, monkeypatch):
    # qerl before 2026-11-26 seeded each batch and so fingerprinted --batch-prompts: its finished
    # outputs must not read as "different inputs" after the upgrade.
    new = ro._fingerprint_config
    monkeypatch.setattr(ro, "_fingerprint_config", lambda cfg, *a: dict(new(cfg, *a), batch_prompts=ro.batch_size(cfg),
                                                                      prompt_template=cfg.prompt_template,
                                                                      max_model_len=cfg.max_model_len))  # as typed then
    rollout(cfg_for(model_dir, tmp_path))
    monkeypatch.setattr(ro, "_fingerprint_config", new)
    assert rollout(cfg_for(model_dir, tmp_path))["already_done"]
    with pytest.raises(OutputExistsError, match="different inputs"):  # the legacy form still counts the flags
        rollout(cfg_for(model_dir, tmp_path, max_new_tokens=9))


def test_flags_the_engine_cannot_run_are_refused_before_loading(model_dir, tmp_path, fake_engine):
    with pytest.raises(BadInputError, match="--num-generations 8 exceeds --max-num-seqs 4") as e:
        rollout(cfg_for(model_dir, tmp_path, num_generations=8, max_num_seqs=4))
    assert "--max-num-seqs 8" in e.value.hint
    with pytest.raises(BadInputError, match="below 1e-05"):
        rollout(cfg_for(model_dir, tmp_path, temperature=1e-40))
    assert fake_engine.calls == []


def test_generation_config_is_an_input_and_old_outputs_stay_done(model_dir, tmp_path, fake_engine, monkeypatch):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    real = ro.StageOutput

    def without_text(*a, inputs, **kw):  # how qerl before 2026-11-26 fingerprinted the run
        kw.pop("legacy_inputs", None)
        return real(*a, inputs={k: v for k, v in inputs.items() if k != "text"}, **kw)

    monkeypatch.setattr(ro, "StageOutput", without_text)
    rollout(cfg_for(model, tmp_path, max_prompts=2))
    monkeypatch.setattr(ro, "StageOutput", real)
    assert rollout(cfg_for(model, tmp_path, max_prompts=2))["already_done"]
    new = dict(max_prompts=2, out=tmp_path / "new")
    rollout(cfg_for(model, tmp_path, **new))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 15]}))
    with pytest.raises(OutputExistsError, match="different inputs"):
        rollout(cfg_for(model, tmp_path, **new))


def test_a_template_file_is_fingerprinted_by_its_text(model_dir, tmp_path, fake_engine):
    # The path was fingerprinted: after editing the file, a rerun was "already done" with the old prompts.
    tpl = tmp_path / "tpl.txt"
    tpl.write_text("Solve: {prompt}")
    rollout(cfg_for(model_dir, tmp_path, prompt_template=str(tpl), max_prompts=2))
    assert rollout(cfg_for(model_dir, tmp_path, prompt_template=str(tpl), max_prompts=2))["already_done"]
    tpl.write_text("Answer in French: {prompt}")
    with pytest.raises(OutputExistsError, match="different inputs"):
        rollout(cfg_for(model_dir, tmp_path, prompt_template=str(tpl), max_prompts=2))


def test_the_result_line_stays_one_line_when_piped(model_dir, tmp_path, fake_engine):
    # Rich wrapped it at 80 columns when stdout was not a terminal: "...; mean reward\n0.750" (audit)
    write_prompts(tmp_path / "p.jsonl", n=2)
    out = tmp_path / ("a-rather-long-directory-name-as-runs-have-" * 2) / "step-000"
    args = ["rollout", "--model", str(model_dir), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out),
            "-G", "2", "--max-new-tokens", "4", "--device", "cpu", "-q"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert any(ln.startswith("wrote ") and "mean reward" in ln for ln in r.stdout.splitlines()), r.stdout
    r = CliRunner().invoke(app, args)
    assert any(ln.startswith("already done: ") and "--force" in ln for ln in r.stdout.splitlines()), r.stdout


def test_a_lock_file_deleted_by_its_holder_is_not_taken(model_dir, tmp_path):
    # Runs delete the lock file when they end; one that opened it just before and locks it after must
    # notice it holds a deleted file (and take the one at the path), or two runs could both "hold" it.
    from qerl_cli.outputs import StageOutput

    out = StageOutput(tmp_path / "o", "rollout", config={}, inputs={}, resumable=True)
    out.already_done()
    with outputs.WriterLock(out) as lock:
        assert lock._still_the_file() and lock.path.exists()
        lock.path.unlink()
        assert not lock._still_the_file()
    assert not lock.path.exists()
    with outputs.WriterLock(out) as again:  # a new file at the path: taken
        assert again._still_the_file()


def test_a_chat_template_file_lets_messages_rows_run_on_a_tokenizer_without_one(model_dir, tmp_path, fake_engine):
    import shutil

    from transformers import AutoTokenizer

    from qerl_cli.errors import OutputExistsError

    base = tmp_path / "base"
    shutil.copytree(model_dir, base)
    (base / "chat_template.jinja").unlink()  # a base model's tokenizer: no chat template
    p = tmp_path / "chat.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}) + "\n")
    with pytest.raises(BadInputError, match="--chat-template-file"):
        rollout(cfg_for(base, tmp_path, prompts=p))
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                   "{% if add_generation_prompt %}<assistant>{% endif %}")
    rollout(cfg_for(base, tmp_path, prompts=p, chat_template_file=tpl))
    tok = AutoTokenizer.from_pretrained(base)
    assert read_records(tmp_path / "out")[0]["prompt_token_ids"] == tok("<user>2+2?\n<assistant>",
                                                                         add_special_tokens=False)["input_ids"]
    assert rollout(cfg_for(base, tmp_path, prompts=p, chat_template_file=tpl))["already_done"]
    tpl.write_text(tpl.read_text().replace("<assistant>", "<bot>"))  # the template's text is an input
    with pytest.raises(OutputExistsError, match="input chat_template changed"):
        rollout(cfg_for(base, tmp_path, prompts=p, chat_template_file=tpl))
    tpl.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(BadInputError, match=r"t.jinja does not render a conversation \(TemplateSyntaxError"):
        rollout(cfg_for(base, tmp_path, prompts=p, chat_template_file=tpl, out=tmp_path / "o2"))
    with pytest.raises(BadInputError, match="with --no-chat-template"):
        rollout(cfg_for(base, tmp_path, prompts=p, chat_template_file=tpl, chat_template=False))
    with pytest.raises(BadInputError, match="does not exist"):
        rollout(cfg_for(base, tmp_path, prompts=p, chat_template_file=tmp_path / "none.jinja", out=tmp_path / "o3"))


def test_a_gpu_engine_build_is_announced_before_its_graphs_and_first_compiles(model_dir, tmp_path, monkeypatch):
    """The spinner said "loading" through the engine build, ~20 s on a machine's first run (its kernels)."""
    import qerl_cli.aqn as aqn_mod
    import qerl_cli.engine as engine_mod
    import qerl_cli.models as models_mod

    said = []
    monkeypatch.setattr(models_mod, "load_model", lambda *a, **k: object())
    monkeypatch.setattr(aqn_mod, "clear_noise", lambda model: None)
    monkeypatch.setattr(engine_mod, "LLMEngine", lambda *a, **k: said.append("built") or object())
    cfg = cfg_for(model_dir, tmp_path)
    for device in ("cuda", "cpu"):
        said.clear()
        ro._native_generator(cfg, None, device, None, 0.0, 64, say=said.append)
        if device == "cuda":
            assert len(said) == 2 and said[0].startswith("building the engine on cuda") and said[1] == "built"
        else:
            assert said == ["built"]


def test_a_named_chat_template_is_not_an_input_of_the_rollout(model_dir, tmp_path, fake_engine):
    # additional_chat_templates/*.jinja are never rendered by a rollout: counting them refused rollouts that
    # qerl before 2026-11-27 had finished on such a model ("input text changed")
    import shutil

    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    rollout(cfg_for(model, tmp_path, max_prompts=2))
    (model / "additional_chat_templates").mkdir()
    (model / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS {{ messages[0]['content'] }}")
    assert rollout(cfg_for(model, tmp_path, max_prompts=2))["already_done"]


def test_a_max_prompts_cap_that_keeps_every_row_is_the_run_without_it(model_dir, tmp_path, fake_engine, monkeypatch):
    """--max-prompts was fingerprinted as typed: 10, 20 or none over the same rows were "made from other inputs"
    (exit 4), and resuming an interrupted run with the cap changed needed --force, which threw its groups away (a
    review). A cap at or above the rows is recorded as none, as eval records --max-problems; outputs recorded as typed
    still read as done."""
    rollout(cfg_for(model_dir, tmp_path, max_prompts=100))
    n = len((tmp_path / "prompts.jsonl").read_text().splitlines())
    for cap in (None, n, 1000):
        assert rollout(cfg_for(model_dir, tmp_path, max_prompts=cap))["already_done"], cap
    with pytest.raises(OutputExistsError, match="max_prompts"):  # a cap that drops rows is another run
        rollout(cfg_for(model_dir, tmp_path, max_prompts=n - 1))
    real = ro._fingerprint_config
    with monkeypatch.context() as m:  # as older qerl recorded it: the cap as typed
        m.setattr(ro, "_fingerprint_config", lambda cfg, *a, **k: dict(real(cfg, *a), max_prompts=cfg.max_prompts))
        rollout(cfg_for(model_dir, tmp_path, out=tmp_path / "old", max_prompts=100))
    assert rollout(cfg_for(model_dir, tmp_path, out=tmp_path / "old", max_prompts=100))["already_done"]


class _ScriptedEngine:
    """Every prompt's completions are ``texts`` (cut at the length cap unless they hold ``</answer>``)."""

    def __init__(self, tokenizer, texts):
        self.tok, self.texts = tokenizer, texts

    def generate(self, prompt_ids, sp, n, progress=None, seeds=None):
        def one(text):
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            return FakeCompletion(ids, [-0.5] * len(ids), text, "stop" if "</answer>" in text else "length")

        return [[one(t) for t in self.texts[:n]] for _ in prompt_ids]


def test_a_template_that_opens_think_has_its_completions_judged_inside_it(model_dir, tmp_path, monkeypatch):
    # QwQ / DeepSeek-R1 templates end the prompt with "<think>\n": a completion cut short mid-thought holds a
    # draft answer and no </think>. The rewards saw no <think> at all, so the draft scored 1 (the gsm8k rule reads
    # nothing after an unclosed <think>), and format read an opening tag the completion never had as optional.
    from tests.helpers import THINKING_CHAT_TEMPLATE

    texts = ["Let me see: #### 1\nhmm, maybe", "So it is 1.</think><answer>1</answer>"]
    monkeypatch.setattr(ro, "_native_generator", lambda cfg, tok, *a, **k: (
        ro._Generator(_ScriptedEngine(tok, texts), "sp", "fake"), None))
    tpl = tmp_path / "think.jinja"
    tpl.write_text(THINKING_CHAT_TEMPLATE)
    p = tmp_path / "one.jsonl"
    p.write_text(json.dumps({"prompt": "What is 1 mod 4?", "answer": "1", "id": "a"}) + "\n")
    kw = dict(prompts=p, chat_template_file=tpl, num_generations=2, rewards=("gsm8k", "format"))
    rollout(cfg_for(model_dir, tmp_path, **kw))
    cut, done = read_records(tmp_path / "out")
    assert cut["rewards"] == {"gsm8k": 0.0, "format": 0.0} and done["rewards"] == {"gsm8k": 1.0, "format": 1.0}
    assert [cut["completion"], done["completion"]] == texts  # stored as generated: no tag added to text or tokens
    assert cut["completion_token_ids"] == ro.load_tokenizer(model_dir)(texts[0], add_special_tokens=False)["input_ids"]
    assert "chat_template_kwargs" not in read_manifest(tmp_path / "out")["config"]  # unset: as older outputs

    # enable_thinking=false: the prompt closes an empty think block, so the direct answer is the answer
    off = cfg_for(model_dir, tmp_path, **kw, out=tmp_path / "off", chat_template_kwargs='{"enable_thinking": false}')
    rollout(off)
    direct = read_records(tmp_path / "off")[0]
    assert direct["rewards"]["gsm8k"] == 1.0 and direct["prompt_token_ids"] != cut["prompt_token_ids"]
    assert read_manifest(tmp_path / "off")["config"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert rollout(off)["already_done"]
    cli = ["rollout", "--model", str(model_dir), "--prompts", str(p), "--out", str(tmp_path / "off"), "-G", "2",
           "--max-new-tokens", "8", "--batch-prompts", "3", "--device", "cpu", "--chat-template-file", str(tpl),
           "--reward", "gsm8k", "--reward", "format", "--chat-template-kwargs"]
    r = CliRunner().invoke(app, [*cli, '{"enable_thinking": false}'])  # the flag's JSON is the library's dict
    assert r.exit_code == 0 and "already done" in r.output, r.output
    r = CliRunner().invoke(app, [*cli, "enable_thinking=false"])
    assert r.exit_code == 2 and "--chat-template-kwargs is not valid JSON" in r.output, r.output
    with pytest.raises(OutputExistsError, match="chat_template_kwargs"):  # fingerprinted: another value is another run
        rollout(cfg_for(model_dir, tmp_path, **kw, out=tmp_path / "off", chat_template_kwargs={"enable_thinking": True}))
    with pytest.raises(BadInputError, match="--chat-template-kwargs with --no-chat-template"):
        rollout(cfg_for(model_dir, tmp_path, prompts=p, chat_template=False, out=tmp_path / "o3",
                        chat_template_kwargs={"enable_thinking": True}))
    with pytest.raises(BadInputError, match="reads no variable `enable_thinkng`"):
        rollout(cfg_for(model_dir, tmp_path, **kw, out=tmp_path / "o4", chat_template_kwargs={"enable_thinkng": False}))


def test_a_trl_reward_is_scored_per_group_and_a_short_list_stops_naming_the_row(model_dir, tmp_path, fake_engine):
    # TRL's fn(completions, **kwargs) -> list was refused when loaded; scored per group now, groups before a bad one kept
    r = tmp_path / "trl_r.py"
    r.write_text("def groups(completions, completion_ids, **kwargs):\n"
                 "    return [float(len(ids)) for ids in completion_ids]\n\n\n"
                 "def short(completions, prompts, **kwargs):\n"
                 "    return [1.0] * (len(completions) - ('Q2' in prompts[0]))\n")
    res = rollout(cfg_for(model_dir, tmp_path, max_prompts=2, rewards=(f"{r}:groups", "gsm8k")))
    recs = read_records(tmp_path / "out")
    assert len(recs) == 6 and all(x["rewards"][f"{r}:groups"] == len(x["completion_token_ids"]) for x in recs)
    assert res["summary"]["rewards"][f"{r}:groups"]["mean"] > 0
    with pytest.raises(BadInputError, match=r"reward '.*:short' returned 2 rewards for the 3 completions for "
                                            r".*prompts.jsonl:3"):
        rollout(cfg_for(model_dir, tmp_path, out=tmp_path / "o2", max_prompts=3, rewards=(f"{r}:short",)))
