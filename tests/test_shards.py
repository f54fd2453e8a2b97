"""Rollout shard records: round trip, validation with file:line, resume repair."""

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qerl_cli.errors import BadInputError
from qerl_cli.shards import (
    SCHEMA_VERSION,
    ReadReport,
    ShardWriter,
    load_complete_groups,
    make_record,
    read_records,
    shard_name,
    write_records,
)


def rec(pid="p0", k=0, reward=1.0, **over):
    r = make_record(
        prompt_id=pid,
        group_id=f"g-{pid}",
        prompt="What is 2+2?",
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5 + k],
        completion=f"#### {4 + k}",
        logprobs=[-0.5, -1.25],
        finish_reason="stop",
        rewards={"gsm8k": reward},
        reward=reward,
        answer="4",
        step=3,
        policy={"base": "abc", "adapter": None},
        sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 7},
        noise={"sigma": 0.01, "seed": 1},
        engine="native",
    )
    r.update(over)
    return r


def group(pid, g=2):
    return [rec(pid, k) for k in range(g)]


def test_shard_name():
    assert shard_name(0, 1) == "shard-00000-of-00001.jsonl"
    assert shard_name(3, 8) == "shard-00003-of-00008.jsonl"
    with pytest.raises(BadInputError, match="outside"):
        shard_name(2, 2)


def test_round_trip_dir_file_glob(tmp_path):
    recs = group("a") + group("b")
    write_records(tmp_path / shard_name(0, 2), recs[:2])
    write_records(tmp_path / shard_name(1, 2), recs[2:])
    assert read_records(tmp_path) == recs
    assert read_records(tmp_path / shard_name(1, 2)) == recs[2:]
    assert read_records(str(tmp_path / "shard-*.jsonl")) == recs
    # a dir and a glob inside it name the same files: no duplicates
    assert read_records([tmp_path, str(tmp_path / "shard-*.jsonl")]) == recs
    assert recs[0]["schema_version"] == SCHEMA_VERSION
    assert list(recs[0])[:3] == ["schema_version", "prompt_id", "group_id"]


def test_writer_flushes_per_group_and_fsyncs_by_time(tmp_path, monkeypatch):
    p = tmp_path / shard_name(0, 1)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    with ShardWriter(p) as w:
        w.write_group(group("a"))
        # visible to other processes before close: a killed process keeps group a
        assert len(p.read_text().splitlines()) == 2
        w.write_group(group("b"))
        assert synced == []  # within the first second: flushed, not fsynced
        w._synced_at -= 1.0  # a second later, the next group is fsynced
        w.write_group(group("c"))
        assert len(synced) == 1
    assert len(synced) == 2  # and close fsyncs what is left
    assert w.groups_written == 3 and w.records_written == 6 and w.fsyncs == 2
    with ShardWriter(tmp_path / "every.jsonl", fsync_every_s=0) as w:
        w.write_group(group("a"))
        w.write_group(group("b"))
        assert w.fsyncs == 2


def test_writer_refuses_invalid_and_nan(tmp_path):
    with ShardWriter(tmp_path / "s.jsonl") as w:
        with pytest.raises(ValueError, match="logprobs"):
            w.write_group([rec(logprobs=[0.0])])
        with pytest.raises(ValueError, match="finite"):
            w.write_group([{**rec(), "reward": float("nan")}])


def _write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))


@pytest.mark.parametrize(
    "bad, why",
    [
        ("not json at all", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({k: v for k, v in rec().items() if k != "logprobs"}), "missing field.*logprobs"),
        (json.dumps({**rec(), "reward": "high"}), "'reward' should be"),
        (json.dumps(rec(step=True)), "'step' should be int"),
        (json.dumps(rec(finish_reason="eos")), "finish_reason"),
        (json.dumps(rec(logprobs=[0.1])), "1 logprobs for 2 completion tokens"),
        (json.dumps(rec(completion_token_ids=[1, "x"], logprobs=[0.0, 0.0])), "integers"),
        (json.dumps(rec(policy={"base": "x"})), "policy lacks 'adapter'"),
        (json.dumps(rec(schema_version=SCHEMA_VERSION + 1)), "newer than this qerl"),
        (json.dumps(rec(logprobs=[-0.5, float("nan")])), "must be finite"),  # Python's json writes NaN
        # the audit's (2026-11-26): read as AQN off, a KeyError in train-step, a temperature assumed, a version
        (json.dumps(rec(noise={})), "noise.sigma should be a number"),
        (json.dumps(rec(noise={"sigma": 0.01})), "noise.seed should be an integer"),
        (json.dumps(rec(noise={"sigma": 0.01, "seed": 1, "step": "3"})), "noise.step should be an integer"),
        (json.dumps(rec(sampling={})), "sampling.temperature should be a number"),
        (json.dumps(rec(schema_version=0)), "not a version"),
        (json.dumps(rec(logprobs=[-0.1, 0.5])), "logprob 0.5 is above 0"),  # trained on with exit 0 (a review)
        (json.dumps(rec(reward=-1e20)), "reward -1e\\+20 is beyond"),  # group statistics square rewards
        (json.dumps(rec(step=-1)), "step -1 is not a rollout step"),  # trained on as "step -1" with exit 0 (s54)
        # ints no float holds (JSON's 1 and 400 zeros), and arrays nested past the recursion limit: an OverflowError
        # or RecursionError traceback that --skip-bad-lines could not skip, and under torchrun only the rank that
        # parsed the line raised it (review s59r16)
        (json.dumps({**rec(), "reward": 10**400}), "must be finite .*past float's range"),
        (json.dumps({**rec(), "logprobs": [-0.5, -10**400]}), "must be finite"),
        (json.dumps({**rec(), "logprobs": [-1, -10**400]}), "must be finite"),
        (json.dumps(rec(noise={"sigma": 10**400, "seed": 1})), "noise.sigma should be a number"),
        (json.dumps(rec(sampling={"temperature": 10**400})), "sampling.temperature should be a number"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON \\(RecursionError"),
    ],
    ids=["not-json", "not-object", "missing", "wrong-type", "bool-step", "finish", "ragged", "token-type", "policy", "future", "nan",
         "noise-empty", "noise-seed", "noise-step", "sampling-empty", "version-0", "logprob-above-0", "huge-reward",
         "negative-step", "int-past-float-reward", "int-past-float-logprob", "int-past-float-logprobs",
         "int-past-float-sigma", "int-past-float-temperature", "nested-too-deep"],
)
def test_bad_line_names_file_and_line(tmp_path, bad, why):
    p = tmp_path / shard_name(0, 1)
    _write_lines(p, [json.dumps(rec("a")), bad, json.dumps(rec("b"))])
    with pytest.raises(BadInputError, match=rf"{p.name}:2: .*{why}") as e:
        read_records(p)
    assert "--skip-bad-lines" in str(e.value)
    report = ReadReport()
    got = read_records(p, skip_bad_lines=True, report=report)
    assert [r["prompt_id"] for r in got] == ["a", "b"]
    assert len(report.bad_lines) == 1 and f"{p}:2:" in report.bad_lines[0]
    assert report.records == 2


def test_blank_lines_are_ignored(tmp_path):
    p = tmp_path / "s.jsonl"
    _write_lines(p, [json.dumps(rec("a")), "", "  ", json.dumps(rec("b"))])
    assert len(read_records(p)) == 2


def test_mixed_schema_versions_rejected(tmp_path, monkeypatch):
    import qerl_cli.shards

    monkeypatch.setattr(qerl_cli.shards, "SCHEMA_VERSION", SCHEMA_VERSION + 1)  # a reader of two versions
    write_records(tmp_path / shard_name(0, 2), [rec("a", schema_version=SCHEMA_VERSION + 1)])
    write_records(tmp_path / shard_name(1, 2), [rec("b", schema_version=SCHEMA_VERSION)])
    with pytest.raises(BadInputError, match=f"schema_version {SCHEMA_VERSION} mixed with schema_version {SCHEMA_VERSION + 1}"):
        read_records(tmp_path)


def test_truncated_last_line_is_reported(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text(json.dumps(rec("a")) + "\n" + json.dumps(rec("b"))[:40])
    with pytest.raises(BadInputError, match=r"s.jsonl:2: truncated last line"):
        read_records(p)
    assert len(read_records(p, skip_bad_lines=True)) == 1


def test_missing_sources(tmp_path):
    with pytest.raises(BadInputError, match="does not exist"):
        read_records(tmp_path / "nope")
    with pytest.raises(BadInputError, match="no files match"):
        read_records(str(tmp_path / "x-*.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInputError, match="holds no shard files"):
        read_records(tmp_path / "empty")
    # --adapter and --shards swapped: the adapter's metrics.jsonl was read as a bad shard (audit)
    (tmp_path / "a1").mkdir()
    (tmp_path / "a1" / "adapter_config.json").write_text("{}")
    (tmp_path / "a1" / "metrics.jsonl").write_text('{"loss": 0.1}\n')
    with pytest.raises(BadInputError, match="is a LoRA adapter directory, not rollout shards"):
        read_records(tmp_path / "a1")


def test_resume_keeps_complete_groups_and_repairs_file(tmp_path):
    p = tmp_path / shard_name(0, 1)
    a, b, c = group("a", 3), group("b", 3), group("c", 3)
    # a and b complete, c torn: two lines written, the third cut mid-line by the crash
    text = "".join(json.dumps(r) + "\n" for r in a + b + c[:2]) + json.dumps(c[2])[:25]
    p.write_text(text)
    groups, dropped = load_complete_groups(p, group_size=3)
    assert list(groups) == ["g-a", "g-b"] and dropped == 3
    assert read_records(p) == a + b  # file now clean: appending continues from here
    write_records(p, c)
    assert read_records(p) == a + b + c
    # nothing to repair: the file is left alone
    before = p.stat().st_mtime_ns
    groups, dropped = load_complete_groups(p, group_size=3)
    assert dropped == 0 and len(groups) == 3 and p.stat().st_mtime_ns == before
    assert load_complete_groups(tmp_path / "absent.jsonl", 3) == ({}, 0)
    # a run killed mid-repair left its half-written copy: the next resume, needing no repair, must not leave it in
    # the partial directory, whose every file the manifest lists and --out publishes
    p.with_name(p.name + ".repair").write_text(json.dumps(a[0])[:10])
    assert load_complete_groups(p, group_size=3)[1] == 0 and sorted(x.name for x in tmp_path.iterdir()) == [p.name]


def test_resume_after_a_crash_that_tore_off_only_the_last_newline(tmp_path):
    # The last line still parses, so nothing is dropped; but appending to it would glue the next
    # group's first record onto it (a shard train-step then refuses, and rollout said done).
    p = tmp_path / shard_name(0, 1)
    a, b, c = group("a", 2), group("b", 2), group("c", 2)
    p.write_text("".join(json.dumps(r) + "\n" for r in a + b).rstrip("\n"))
    groups, dropped = load_complete_groups(p, group_size=2)
    assert list(groups) == ["g-a", "g-b"] and dropped == 0
    write_records(p, c)
    assert read_records(p) == a + b + c


def test_an_existing_path_with_glob_characters_is_read_as_itself(tmp_path):
    d = tmp_path / "run [v1]" / "step *0"
    d.mkdir(parents=True)
    write_records(d / shard_name(0, 1), group("a"))
    assert read_records(d) == group("a")
    assert read_records(d / shard_name(0, 1)) == group("a")
    assert read_records(str(tmp_path / "run [[]v1]" / "step [*]0" / "*.jsonl")) == group("a")  # a real glob still globs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(max_size=40),  # any unicode, incl. newlines and quotes
    lps=st.lists(st.floats(max_value=0.0, allow_nan=False, allow_infinity=False, width=64), min_size=1, max_size=5),
    answer=st.one_of(st.none(), st.text(max_size=5)),
)
def test_round_trip_any_text_and_floats(tmp_path, text, lps, answer):
    r = rec("p", completion=text, prompt=text, logprobs=lps, completion_token_ids=list(range(len(lps))), answer=answer)
    p = tmp_path / "rt.jsonl"
    p.unlink(missing_ok=True)
    write_records(p, [r])
    assert read_records(p) == [r]
    assert len(p.read_bytes().splitlines()) == 1  # a newline inside the text never splits a record


def test_lone_surrogate_round_trips(tmp_path):
    r = rec("p", completion="a\ud800b \u00e9")
    write_records(tmp_path / "s.jsonl", [r])
    assert read_records(tmp_path / "s.jsonl") == [r]
    ok = rec("q", completion="caf\u00e9")
    write_records(tmp_path / "t.jsonl", [ok])
    assert "café".encode() in (tmp_path / "t.jsonl").read_bytes()  # readable UTF-8, not \u escapes


def test_a_glob_takes_only_rollout_shards_and_names_what_else_it_swept_in(tmp_path):
    # `--shards 'r*'` also matched a run directory whose metrics.jsonl was then read as a shard, with
    # advice to --skip-bad-lines; and an eval output's samples.jsonl would have been read the same way.
    from qerl_cli.shards import resolve_shard_files

    (tmp_path / "r0").mkdir()
    write_records(tmp_path / "r0" / shard_name(0, 1), [rec("a")])
    (tmp_path / "r0" / "manifest.json").write_text(json.dumps({"stage": "rollout", "fingerprint": "f"}))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(BadInputError, match=r"run \(matched by .*\) holds no rollout shards"):
        resolve_shard_files(str(tmp_path / "r*"))
    (tmp_path / "run" / "metrics.jsonl").unlink()
    (tmp_path / "run" / "samples.jsonl").write_text('{"id": 0}\n')
    (tmp_path / "run" / "manifest.json").write_text(json.dumps({"stage": "eval", "fingerprint": "f"}))
    with pytest.raises(BadInputError, match="run is the output of `qerl eval`, not rollout shards"):
        resolve_shard_files(str(tmp_path / "run"))
    assert resolve_shard_files(str(tmp_path / "r0*")) == [tmp_path / "r0" / shard_name(0, 1)]
    (tmp_path / "mine").mkdir()  # a directory of shards named plainly, by a user's own tool: still read
    write_records(tmp_path / "mine" / "batch.jsonl", [rec("b")])
    assert resolve_shard_files(str(tmp_path / "mine")) == [tmp_path / "mine" / "batch.jsonl"]


def test_a_logprob_a_rounding_above_0_is_still_a_record():
    from qerl_cli.shards import validate_record

    assert validate_record(rec("a", logprobs=[-0.1, 1e-4])) is None and validate_record(rec("a", logprobs=[0.0, 0])) is None


def test_a_glob_over_a_rollout_directory_leaves_its_manifest_out(tmp_path):
    # `--shards 'step-3/*'` read the rollout's manifest.json as a shard (exit 2 advising --skip-bad-lines,
    # which then skipped ~100 "bad lines" and trained)
    from qerl_cli.shards import resolve_shard_files

    write_records(tmp_path / "r0" / shard_name(0, 1), [rec("a")])
    (tmp_path / "r0" / "manifest.json").write_text(json.dumps({"stage": "rollout", "fingerprint": "f"}, indent=2))
    assert resolve_shard_files(str(tmp_path / "r0" / "*")) == [tmp_path / "r0" / shard_name(0, 1)]
    with pytest.raises(BadInputError, match="no files match"):
        resolve_shard_files(str(tmp_path / "r0" / "man*"))


def test_a_finished_rollout_whose_shard_was_deleted_or_cut_since_is_named_damaged(tmp_path):
    # One task's shard deleted was "holds no rollout shards (narrow the glob ...)", which then trained on the other
    # task's half of the step; a shard cut at a group's end trained on what was left without a word.
    from qerl_cli.shards import resolve_shard_files

    for i in range(2):
        d = tmp_path / f"shards-{i}"
        write_records(d / shard_name(i, 2), group(f"p{i}") + group(f"q{i}"))
        size = (d / shard_name(i, 2)).stat().st_size
        (d / "manifest.json").write_text(json.dumps({"stage": "rollout", "fingerprint": "f", "outputs": {
            shard_name(i, 2): "h"}, "output_bytes": {shard_name(i, 2): size}}))
    assert len(resolve_shard_files(str(tmp_path / "shards-*"))) == 2
    cut = tmp_path / "shards-0" / shard_name(0, 2)
    cut.write_text("".join(cut.read_text().splitlines(keepends=True)[:2]))  # one whole group left
    with pytest.raises(BadInputError, match=rf"shards-0 holds a rollout output damaged after it was written "
                                            rf"\({shard_name(0, 2)} has \d+ bytes, the manifest says \d+\)") as e:
        resolve_shard_files(str(tmp_path / "shards-*"))
    assert "rerun that rollout with --force" in e.value.hint
    (tmp_path / "shards-1" / shard_name(1, 2)).unlink()
    with pytest.raises(BadInputError, match=rf"shards-1 holds a rollout output damaged .*\({shard_name(1, 2)} is missing\)"):
        resolve_shard_files(str(tmp_path / "shards-1"))
