"""Tests that kill mutants of what session 59 added or changed which survived the suite (manual mutation testing,
round 11: outputs.py's start-time temp names (``_started``, ``_own_id``, ``copy_beside``'s), the no-exchange swap's
recovery (``_recover_interrupted_swap``, ``_swapped_in_by``), ``_clean_stale`` and ``_resume_staged``; the metrics
fsync's ``_fsync_if_it_can``; eval's "already done" GPU-model note; ``no_answer`` and rollout's ``check_answers`` hint;
``_check_fits_model``'s id range). docs/reliability.md has the counts; each docstring names the mutant it kills."""

import errno
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from qerl_cli import outputs
from qerl_cli.errors import BadInputError
from qerl_cli.evaluate import evaluate
from qerl_cli.outputs import StageOutput, WriterLock
from tests.helpers import make_tiny_hf_model
from tests.test_eval_review import ROWS, BySeed, _cfg, _gpus, _jsonl


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("gaps9"), arch="qwen2", hidden=32, layers=1)


# ---- outputs.py: _gone, the start-time temp names, the swap's recovery, _resume_staged ------------------------------


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def _finished(tmp_path: Path, name: str, config: dict, text: str, resumable: bool = False) -> Path:
    """A finished output of the demo stage made elsewhere, to be moved where a killed run would have left it."""
    out = tmp_path / "elsewhere" / name
    so = StageOutput(out, "demo", config=config, inputs={}, resumable=resumable)
    with WriterLock(so), so as work:
        (work / "f").write_text(text)
    return out








def test_a_process_whose_name_holds_a_parenthesis_has_its_own_start(tmp_path):
    """Mutant: ``_started`` splitting /proc/PID/stat at the first ``)`` (not the last): a command name holding ") "
    (a script's, ``comm`` is the file's name) shifted the fields, and the "start" read was its thread count, the same
    for many processes: a dead run's temp dir whose pid such a process took was kept as a live run's."""
    odd = tmp_path / "x) 1 2"
    odd.symlink_to(shutil.which("sleep"))
    live = subprocess.Popen([str(odd), "60"])
    try:
        for _ in range(200):  # until the exec is done (comm is the new name then)
            if Path(f"/proc/{live.pid}/comm").read_text().strip() == odd.name:
                break
            time.sleep(0.01)
        started, mine = outputs._started(live.pid), outputs._started(os.getpid())
        assert int(started.split(".")[0]) >= int(mine.split(".")[0])  # started after this process
    finally:
        live.kill()
        live.wait()


def test_a_process_whose_proc_is_another_namespaces_records_its_pid_alone(monkeypatch):
    """Mutant: ``_own_id`` without its ``/proc/self`` check: in a container that sees the host's /proc (another pid
    namespace) /proc/PID/stat is another process's, whose start was recorded as this run's: its temp dir was then a
    dead run's to the next run, and swept from under it."""
    monkeypatch.setattr(outputs, "_OWN", {})
    monkeypatch.setattr(os, "readlink", lambda path: "1")  # /proc/self: another pid than os.getpid()
    assert outputs._own_id() == str(os.getpid())


def test_a_damaged_new_output_left_between_the_renames_is_not_swapped_in(tmp_path):
    """Mutant: ``_swapped_in_by`` without ``damaged_output``: the next run after a kill between the two renames
    finished the swap with a redo whose file had changed since (truncated: the disk, a user), "already done" with
    a damaged output; the old output is put back instead, and the redo left to be swept."""
    ident = f"{_dead_pid()}-0123abcd-{outputs._HOST}"  # the temp name's, which the old output's takes (_old_name)
    _finished(tmp_path, "old", {"v": 1}, "v1").rename(tmp_path / f".o.old-{ident}")
    new = _finished(tmp_path, "new", {"v": 2}, "v2")
    (new / "f").write_text("v")  # one byte short of what its manifest says
    new.rename(tmp_path / f".o.tmp-{ident}")
    out = tmp_path / "o"
    assert StageOutput(out, "demo", config={"v": 1}, inputs={}).already_done()
    assert (out / "f").read_text() == "v1"
    with StageOutput(out, "demo", config={"v": 1}, inputs={}) as work:  # the dead redo's temp dir: swept
        (work / "f").write_text("v1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "o"]


def test_an_older_qerls_old_output_left_between_the_renames_is_put_back(tmp_path):
    """Mutant: ``_recover_interrupted_swap`` looking for ``.tmp-`` dirs, not ``.old-``: an older qerl's swap killed
    between its renames (``.o.old-RANDOM``, no new output named after it) left --out missing for good."""
    _finished(tmp_path, "old", {"v": 1}, "v1").rename(tmp_path / ".o.old-0123abcd")
    out = tmp_path / "o"
    assert StageOutput(out, "demo", config={"v": 1}, inputs={}).already_done()
    assert (out / "f").read_text() == "v1"


def test_a_leftover_old_name_without_a_manifest_is_no_error(tmp_path):
    """Mutant: ``_recover_interrupted_swap`` without ``if not found: return``: a ``.o.old-*`` directory holding no
    output (emptied by hand, a user's own) beside a missing --out crashed every run into it (max() of nothing)."""
    (tmp_path / ".o.old-0123abcd").mkdir()
    assert not StageOutput(tmp_path / "o", "demo", config={"v": 1}, inputs={}).already_done()


def test_a_metrics_copy_records_its_process_start(tmp_path):
    """Mutant: ``copy_beside`` naming its copy by the pid alone: a killed rewrite's copy whose pid a live process took
    by the next run was kept for good, as the temp dirs' were (its sweep reads the start: ``_gone``)."""
    assert outputs.copy_beside(tmp_path / "metrics.jsonl").name.startswith(f".metrics.jsonl.tmp-{outputs._own_id()}-")


def test_a_dead_runs_temp_dir_is_swept_beside_an_out_whose_name_holds_tmp(tmp_path):
    """Mutant: ``_clean_stale`` reading the temp name after the first ``.tmp-`` of the whole name (as it did): beside
    an --out named ``x.tmp-1`` the pid read was "1.tmp" and the host a piece of the uuid, another host's: a dead run's
    temp dir (a whole checkpoint) was kept for good."""
    out = tmp_path / "x.tmp-1"
    StageOutput(out, "demo", config={"v": 1}, inputs={}).already_done()
    dead = tmp_path / f".x.tmp-1.tmp-{_dead_pid()}-0123abcd-{outputs._HOST}"
    dead.mkdir()
    so = StageOutput(out, "demo", config={"v": 1}, inputs={})
    with so as work:
        (work / "f").write_text("v1")
    assert not dead.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["x.tmp-1"]


def test_a_dead_non_resumable_runs_finished_temp_dir_is_swept_not_kept_as_a_partial_dir(tmp_path):
    """Mutant: ``_resume_staged`` without ``not self.resumable``: a merge or train-step killed after its manifest,
    before its rename, left a temp dir of this very run; the next run renamed it to a partial name no stage of its
    kind ever resumes or removes (a whole checkpoint beside --out for good)."""
    staged = _finished(tmp_path, "o", {"v": 1}, "v1")
    staged.rename(tmp_path / f".o.tmp-{_dead_pid()}-0123abcd-{outputs._HOST}")
    so = StageOutput(tmp_path / "o", "demo", config={"v": 1}, inputs={})
    with so as work:
        (work / "f").write_text("v1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "o"]


def test_a_dead_runs_staged_work_of_other_arguments_is_not_resumed(tmp_path):
    """Mutant: ``_resume_staged`` taking any manifest (not this run's fingerprint): a dead --force redo of other
    arguments (another --max-problems, another adapter) staged its finished work, and this run resumed from it,
    its groups (problems) made from other inputs."""
    staged = _finished(tmp_path, "o", {"v": 2}, "other", resumable=True)
    staged.rename(tmp_path / f".o.tmp-{_dead_pid()}-0123abcd-{outputs._HOST}")
    so = StageOutput(tmp_path / "o", "demo", config={"v": 1}, inputs={}, resumable=True)
    with WriterLock(so), so as work:
        assert not (work / "f").exists()  # started afresh
        (work / "f").write_text("v1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "o"]


# ---- train/metrics.py: _fsync_if_it_can ---------------------------------------------------------------------------


@pytest.mark.parametrize("err", ["ENOSYS", "ENOTSUP"])
def test_a_metrics_file_whose_file_system_has_no_fsync_does_not_fail_the_step(tmp_path, monkeypatch, err):
    """Mutants: ``_fsync_if_it_can`` without ENOSYS, or without ENOTSUP/EOPNOTSUPP (one value on Linux): a file system
    that has no fsync at all (some FUSE mounts say ENOSYS, others ENOTSUP) failed every finished step, exit 7, as
    /dev/null's EINVAL did (review s59r10); only EINVAL was tested."""
    from qerl_cli.train import metrics

    code = getattr(errno, err)

    def fsync(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "metrics.jsonl"
    metrics._append_metrics(path, {"step": 1, "loss": 3})
    metrics._append_metrics(path, {"step": 1, "loss": 2})  # a redone step's rewrite too
    assert path.read_text() == '{"step":1,"loss":2}\n'


# ---- evaluate.py: the "already done" GPU-model note -----------------------------------------------------------------


def test_no_gpu_model_note_where_cuda_cannot_name_this_gpu(model_dir, tmp_path, monkeypatch, capsys):
    """Mutant: ``_say_made_on_another_gpu_model`` without ``here is not None``: where CUDA cannot name this GPU
    (``gpu_model`` None) an H100's finished eval printed "generated on 'H100', not this None", which is no other
    model: nothing is known to differ."""
    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS)), device="auto")
    with monkeypatch.context() as m:
        _gpus(m, ["H100"])
        evaluate(cfg, generate=BySeed())
    capsys.readouterr()
    with monkeypatch.context() as m:
        _gpus(m, [None])
        assert evaluate(cfg, generate=BySeed())["already_done"]
    assert "note:" not in capsys.readouterr().err


def test_no_gpu_model_note_for_an_eval_that_recorded_none(model_dir, tmp_path, monkeypatch, capsys):
    """Mutant: ``_say_made_on_another_gpu_model`` without its ``isinstance(made, str)``: an eval whose metrics.json
    records no GPU model (CUDA could not say, or an older qerl's) printed "generated on None, not this 'H100'"."""
    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS)), device="auto")
    with monkeypatch.context() as m:
        _gpus(m, [None])
        assert evaluate(cfg, generate=BySeed())["metrics"].get("gpu") is None
    capsys.readouterr()
    with monkeypatch.context() as m:
        _gpus(m, ["H100"])
        assert evaluate(cfg, generate=BySeed())["already_done"]
    assert "note:" not in capsys.readouterr().err


# ---- data.py: no_answer ---------------------------------------------------------------------------------------------


def test_the_answer_key_hint_names_the_keys_of_the_row_without_a_reference(model_dir, tmp_path):
    """Mutant: ``no_answer`` taking the first row's keys, not the lacking row's: a file whose first rows have `answer`
    was told of them ("the row's keys: answer, prompt") for a later row that holds its reference under `gold`."""
    rows = [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "gold": "4", "level": 1}]
    with pytest.raises(BadInputError) as e:
        evaluate(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", rows)), generate=BySeed())
    assert "d.jsonl:2: row has no `answer`" in str(e.value)
    assert e.value.hint.endswith("the row's keys: gold, level, prompt")


def test_the_refusal_of_a_blank_answer_key_column_hints_no_none(model_dir, tmp_path):
    """Mutant: rollout's ``check_answers`` joining its hints without ``filter(None, ...)``: with --answer-key, where
    ``no_answer`` gives no hint of its own, the refusal's hint read "None; add answers, or use rewards ..."."""
    from qerl_cli.data import load_prompts
    from qerl_cli.rewards import RewardSet
    from qerl_cli.rollout import RolloutConfig
    from qerl_cli.rollout_checks import check_answers

    prompts = _jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1?", "gold": "2"}, {"prompt": "2+2?", "gold": None}])
    cfg = RolloutConfig(model=model_dir, prompts=prompts, out=tmp_path / "o", answer_key="gold")
    with pytest.raises(BadInputError, match="p.jsonl:2: row has no reference") as e:
        check_answers(cfg, RewardSet.from_specs(["gsm8k"]), load_prompts(prompts, answer_key="gold"), None)
    assert e.value.hint == "add answers, or use rewards that need none (format, module:function)"


# ---- train/checks.py: _check_fits_model's id range ------------------------------------------------------------------


def test_a_negative_token_id_is_named_before_training(tmp_path):
    """Mutant: ``_check_fits_model`` looking at the highest id only (``hi < vocab_size``, not ``0 <= lo``): a shard
    whose record holds a negative id (a writer's -1 for padding; the shards take any integer) passed the check, and the
    forward's embedding failed deep inside on an index error."""
    import json

    from qerl_cli.train.checks import _check_fits_model
    from qerl_cli.train_step import TrainStepConfig, read_step
    from tests.train_fixtures import make_shard, quantized_tiny

    _, q = quantized_tiny(tmp_path)
    sh = make_shard(tmp_path / "sh", "0" * 64, groups=2)
    f = next(sh.glob("*.jsonl"))
    lines = f.read_text().splitlines(keepends=True)
    rec = json.loads(lines[1])
    rec["completion_token_ids"][0] = -1
    f.write_text(lines[0] + json.dumps(rec) + "\n" + "".join(lines[2:]))
    cfg = TrainStepConfig(model=q, shards=[str(sh)], out=tmp_path / "o", progress=False)
    with pytest.raises(BadInputError, match="has token id -1, outside"):
        _check_fits_model(cfg, read_step(cfg))
