"""Atomic stage outputs: rename-into-place, manifest last, idempotent reruns."""

import hashlib
import json
import os
from pathlib import Path

import pytest

from qerl_cli.errors import OutputExistsError
from qerl_cli.hashing import sha256_files
from qerl_cli.outputs import StageOutput, read_manifest


def _run(out, config, fail=False, force=False):
    so = StageOutput(out, "demo", config=config, inputs={"x": "h1"}, force=force)
    if so.already_done():
        return "done"
    with so as work:
        (work / "a.txt").write_text("hello")
        if fail:
            raise RuntimeError("boom")
    return so.manifest


def test_writes_manifest_with_output_hashes(tmp_path):
    m = _run(tmp_path / "o", {"k": 1})
    assert (tmp_path / "o" / "a.txt").read_text() == "hello"
    assert read_manifest(tmp_path / "o")["outputs"].keys() == {"a.txt"}
    assert m["stage"] == "demo"


@pytest.mark.parametrize("workers", [1, 3])
def test_files_hash_in_parallel_to_their_own_digests_in_order(tmp_path, workers):
    sizes = [0, 5, 1 << 20, (4 << 20) + 3, 17, 3 << 20]  # empty, tiny, over and under the read chunk
    paths = []
    for i, n in enumerate(sizes):
        p = tmp_path / f"f{i}"
        p.write_bytes(bytes((i * 7 + j) % 251 for j in range(n % 4096)) * (n // 4096) + b"x" * (n % 4096))
        paths.append(p)
    assert sha256_files(paths, workers=workers) == [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]


def test_manifest_hashes_every_output_file(tmp_path):
    so = StageOutput(tmp_path / "o", "demo", config={}, inputs={})
    with so as work:
        for i in range(4):
            (work / "sub").mkdir(exist_ok=True)
            (work / "sub" / f"s{i}.bin").write_bytes(bytes([i]) * (i << 19))
        (work / "a.txt").write_text("hello")
    outputs = read_manifest(tmp_path / "o")["outputs"]
    assert outputs == {str(p.relative_to(tmp_path / "o")): hashlib.sha256(p.read_bytes()).hexdigest()
                       for p in (tmp_path / "o").rglob("*") if p.is_file() and p.name != "manifest.json"}


def test_rerun_same_inputs_is_already_done(tmp_path):
    _run(tmp_path / "o", {"k": 1})
    assert _run(tmp_path / "o", {"k": 1}) == "done"


def test_changed_inputs_need_force(tmp_path):
    _run(tmp_path / "o", {"k": 1})
    with pytest.raises(OutputExistsError, match="--force"):
        _run(tmp_path / "o", {"k": 2})
    m = _run(tmp_path / "o", {"k": 2}, force=True)
    assert m["config"] == {"k": 2}
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["config"] == {"k": 2}


@pytest.mark.parametrize("stage, said", [("eval", "holds an eval output"), ("merge", "holds a merge output")])
def test_the_refusal_names_the_stage_with_its_article(tmp_path, stage, said):
    # `qerl eval` into an --out of other flags said "holds a eval output" (a review).
    with StageOutput(tmp_path / "o", stage, config={"k": 1}, inputs={}):
        pass
    with pytest.raises(OutputExistsError, match=said):
        StageOutput(tmp_path / "o", stage, config={"k": 2}, inputs={}).already_done()


def test_another_stages_output_is_named_so_without_offering_force(tmp_path):
    # `qerl quantize --out` a rollout's directory said "holds a rollout output made from different inputs or
    # arguments", hint "pass --force to replace it": which deleted the rollout
    with StageOutput(tmp_path / "o", "rollout", config={"k": 1}, inputs={}):
        pass
    with pytest.raises(OutputExistsError, match="holds a rollout output, not a quantize one") as e:
        StageOutput(tmp_path / "o", "quantize", config={"k": 1}, inputs={}).already_done()
    assert "--force would delete that rollout output" in e.value.hint
    assert not StageOutput(tmp_path / "o", "quantize", config={"k": 1}, inputs={}, force=True).already_done()
    with pytest.raises(OutputExistsError, match="holds a rollout output, not an eval one"):  # it said "not a eval one"
        StageOutput(tmp_path / "o", "eval", config={"k": 1}, inputs={}).already_done()


def test_failure_leaves_nothing_and_keeps_old_output(tmp_path):
    _run(tmp_path / "o", {"k": 1})
    with pytest.raises(RuntimeError):
        _run(tmp_path / "o", {"k": 2}, fail=True, force=True)
    assert read_manifest(tmp_path / "o")["config"] == {"k": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["o"]


def test_dir_without_manifest_is_not_done(tmp_path):
    (tmp_path / "o").mkdir()
    with pytest.raises(OutputExistsError, match="no valid qerl manifest"):
        _run(tmp_path / "o", {"k": 1})


def _stage(out, config, **kw):
    return StageOutput(out, "demo", config=config, inputs={"x": "h1"}, **kw)


@pytest.mark.parametrize("resumable", [False, True])
def test_a_run_that_finishes_after_another_into_its_out_does_not_replace_it(tmp_path, resumable):
    # Two runs with different flags into one --out both checked it (empty) and both wrote; the later
    # silently replaced the earlier, without --force (a rollout's shard 0 deleted by shard 1's run:
    # 2026-11-26 audit). Now the later one refuses and leaves the earlier output alone.
    out = tmp_path / "o"
    first, second = _stage(out, {"k": 1}), _stage(out, {"k": 2}, resumable=resumable)
    assert not first.already_done() and not second.already_done()
    work2 = second.__enter__()
    (work2 / "a.txt").write_text("two")
    with first as work1:
        (work1 / "a.txt").write_text("one")
    with pytest.raises(OutputExistsError, match="written by another run while this one ran") as e:
        second.__exit__(None, None, None)
    # the hint said "kept for a rerun": a rerun is refused (--out holds the other run) and another --out starts over
    assert (f"finished groups stay in {work2}, which only a run into {out} resumes" in e.value.hint) == resumable
    # exit 8, not 4: recipes redo an exit-4 stage with --force under FORCE=1, replacing the other run's output
    assert e.value.exit_code == 8
    assert (out / "a.txt").read_text() == "one" and read_manifest(out)["fingerprint"] == first.fingerprint
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != "o")
    assert left == ([f".o.partial-{second.fingerprint[:16]}"] if resumable else [])  # finished groups kept
    # the same run finishing twice (two identical jobs) is fine: same fingerprint, same bytes
    again = _stage(out, {"k": 1}, force=True)
    assert not again.already_done()
    same = _stage(out, {"k": 1})
    with same as work:
        (work / "a.txt").write_text("one")
    assert read_manifest(out)["fingerprint"] == first.fingerprint


def test_file_system_refusals_are_one_line_errors_and_leave_nothing(tmp_path):
    import errno

    from qerl_cli.errors import OutputWriteError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    # --out under a file: was a traceback, then "File exists" with a hint about space and permissions
    with pytest.raises(OutputWriteError, match="cannot write .*file/o: .*file is a file, not a directory"):
        with _stage(blocker / "o", {"k": 1}) as work:
            pass
    from qerl_cli.errors import OutputExistsError
    with pytest.raises(OutputExistsError, match="file is a file, not a qerl output directory"):
        _stage(blocker, {"k": 1}).already_done()
    so = _stage(tmp_path / "o", {"k": 1})
    with pytest.raises(OutputWriteError, match="No space left on device") as e:
        with so as work:
            (work / "a.txt").write_text("partial")
            raise OSError(errno.ENOSPC, "No space left on device", str(work / "b.txt"))
    assert e.value.exit_code == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no --out, no temp dir
    with pytest.raises(RuntimeError):  # other failures stay what they are
        with _stage(tmp_path / "o", {"k": 1}) as work:
            raise RuntimeError("a bug")


def test_total_time_counts_from_the_stages_start(tmp_path):
    # total_s counted from entering the temp dir, so it read less than the stage's own prepare_s
    # (rollout 0.44 s against 3.37 s; audit)
    import time

    so = StageOutput(tmp_path / "o", "test", config={}, inputs={}, started=time.time() - 5.0)
    so.timings["prepare_s"] = 4.9
    with so:
        pass
    assert so.manifest["timings"]["total_s"] >= 5.0


def test_a_manifest_left_half_written_in_a_partial_dir_is_not_an_output(tmp_path):
    # A rollout killed while writing its manifest leaves manifest.json.tmp in the partial directory it
    # resumes from. It was listed as an output, then renamed into manifest.json: the next rerun called the
    # finished output damaged (exit 4) for a file that could not exist.
    out = tmp_path / "o"
    so = StageOutput(out, "demo", config={"k": 1}, inputs={}, resumable=True)
    with so as work:
        (work / "manifest.json.tmp").write_text('{"stage": "de')  # the killed run's leftover
        (work / "a.txt").write_text("hello")
    assert read_manifest(out)["outputs"].keys() == {"a.txt"}
    assert StageOutput(out, "demo", config={"k": 1}, inputs={}, resumable=True).already_done()


def test_every_output_file_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    """A machine crash after the rename must not publish files whose data never reached the disk: each
    output file is fsynced before its manifest is written (only the manifest and the directory were)."""
    import os

    from qerl_cli import outputs

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    def replace(a, b, **kw):
        events.append(("rename", os.path.basename(str(b))))
        return real_replace(a, b, **kw)

    monkeypatch.setattr(outputs.os, "fsync", fsync)
    monkeypatch.setattr(outputs.os, "replace", replace)
    so = StageOutput(tmp_path / "o", "demo", config={}, inputs={})
    with so as work:
        (work / "model.safetensors").write_bytes(b"w" * 1000)
        (work / "sub").mkdir()
        (work / "sub" / "b.json").write_text("{}")
    synced = {name for kind, name in events if kind == "fsync"}
    assert {"model.safetensors", "b.json"} <= synced
    published = events.index(("rename", "o")) if ("rename", "o") in events else len(events)
    assert all(events.index(("fsync", n)) < published for n in ("model.safetensors", "b.json"))


@pytest.mark.parametrize("name", ["run [1]", "q?", "r*"])
def test_an_out_named_with_glob_characters_finds_its_own_leftovers_and_no_others(tmp_path, name, monkeypatch):
    import os
    dead = 2 ** 22 + 12345  # no such pid
    own_tmp = tmp_path / f".{name}.tmp-{dead}-abcd1234-x"
    own_tmp.mkdir()
    (own_tmp / "big.bin").write_text("stale")
    other = {"run [1]": "run 1", "q?": "qa", "r*": "rb"}[name]
    _run(tmp_path / other, {"k": 1})
    os.replace(tmp_path / other, tmp_path / f".{other}.old-deadbeef")  # another output's interrupted swap
    from qerl_cli import outputs
    monkeypatch.setattr(outputs, "_HOST", "x")
    _run(tmp_path / name, {"k": 1})
    assert not own_tmp.exists()  # its own stale temp dir swept
    assert (tmp_path / f".{other}.old-deadbeef" / "manifest.json").is_file()  # the other's backup untouched
    assert read_manifest(tmp_path / name)["stage"] == "demo" and (tmp_path / name / "a.txt").is_file()


@pytest.mark.parametrize("out", [".", "", "..", "a/.."])
def test_an_out_that_names_no_directory_of_its_own_is_refused(tmp_path, monkeypatch, out):
    # --out . put the temp dir inside the output dir: an empty cwd asked for --force, which then ran the whole
    # stage and failed as "written by another run"; over a finished output, --force was an OSError traceback.
    from qerl_cli.errors import BadInputError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    with pytest.raises(BadInputError, match="names no directory of its own"):
        _stage(Path(out), {"k": 1})


def test_an_out_that_goes_up_out_of_a_missing_directory_is_refused(tmp_path, monkeypatch):
    # --out nosuch/../q: the checks failed to see q through nosuch, mkdir then made nosuch, and the final rename
    # found q there: "written by another run while this one ran" (exit 4) with no other run, nosuch left behind,
    # or "wrote" where q already held this output (a review).
    from qerl_cli.errors import BadInputError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInputError, match="goes up \\('..'\\) out of 'nosuch', which does not exist"):
        _stage(Path("nosuch/../q"), {"k": 1})
    assert not (tmp_path / "nosuch").exists()
    (tmp_path / "real").mkdir()
    with _stage(Path("real/../q"), {"k": 1}) as work:
        (work / "a.txt").write_text("x")
    assert (tmp_path / "q" / "a.txt").read_text() == "x"


@pytest.mark.parametrize("where", ["beside", "elsewhere"])
def test_a_symlinked_out_is_written_and_replaced_at_its_target_and_stays_a_link(tmp_path, where):
    # A review (2026-11-27): --force over `--out link` swapped the link itself: the new output landed beside the
    # link (on the link's file system, not the target's), the link was gone and the old output stayed at the
    # target; a link to an empty directory (scratch space made ready for the output) was refused, even with
    # --force, as "not a finished qerl output".
    import os
    root = tmp_path / "elsewhere" if where == "elsewhere" else tmp_path
    root.mkdir(exist_ok=True)
    (tmp_path / "runs").mkdir()
    link, target = tmp_path / "runs" / "o", root / "target"
    target.mkdir()
    os.symlink(target, link)
    with pytest.raises(OutputExistsError, match="it is empty"):  # as an empty directory itself
        _run(link, {"k": 1})
    _run(link, {"k": 1}, force=True)
    assert link.is_symlink() and read_manifest(target)["config"] == {"k": 1}
    assert _run(link, {"k": 1}) == "done"
    _run(link, {"k": 2}, force=True)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert read_manifest(target)["config"] == {"k": 2} and (target / "a.txt").read_text() == "hello"
    assert sorted(os.listdir(tmp_path / "runs")) == ["o"] and sorted(os.listdir(root))[-1] == "target"
    assert not [p for p in os.listdir(root) if p.startswith(".target.")]  # no temp or old dir left


def test_an_out_that_is_a_mount_point_is_refused_before_any_work(tmp_path, monkeypatch):
    # A review (2026-11-27): `--out /out`, a container's bind mount (or a scratch mount), needed --force being
    # empty; the stage then ran, wrote its output on the parent's file system and failed at the final rename with
    # EBUSY: exit 1 and a traceback. The check is made once nothing is done there: an output already at the mount
    # point (made on the host) still reads as done.
    import os

    from qerl_cli.errors import BadInputError, OutputWriteError
    out = tmp_path / "mnt"
    _run(out, {"k": 1})
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == out or real_ismount(p))
    assert _run(out, {"k": 1}) == "done"
    with pytest.raises(BadInputError, match="mnt is a mount point, which qerl cannot replace") as e:
        _stage(out, {"k": 2}, force=True).already_done()
    assert e.value.exit_code == 2
    # a bind mount of the same file system is no mount point to os.path.ismount: the rename's EBUSY is one line
    import errno

    from qerl_cli import outputs
    monkeypatch.setattr(os.path, "ismount", real_ismount)

    def busy(a, b):
        raise OSError(errno.EBUSY, "Device or resource busy", str(b))
    monkeypatch.setattr(outputs, "_exchange", busy)
    with pytest.raises(OutputWriteError, match="cannot replace .*mnt: it is busy, a mount point") as e:
        _run(out, {"k": 2}, force=True)
    assert e.value.exit_code == 7
    assert read_manifest(out)["config"] == {"k": 1} and sorted(os.listdir(tmp_path)) == ["mnt"]


@pytest.mark.parametrize("replacing", [False, True])
def test_a_signal_during_the_fsync_after_the_rename_finds_the_output_complete(tmp_path, monkeypatch, replacing):
    """The rename put the output in place, then its directory's fsync (ms on a network file system) was cut by a
    SIGTERM (raised there as an exception): the CLI said "--out was not written" of a complete output (session 58)."""
    from qerl_cli import outputs

    out = tmp_path / "o"
    if replacing:
        _run(out, {"k": 0})
    real = outputs._fsync_dir

    def fsync_dir(path):
        if (read_manifest(out) or {}).get("config") == {"k": 1}:  # the new output is at --out
            raise KeyboardInterrupt
        real(path)

    monkeypatch.setattr(outputs, "_fsync_dir", fsync_dir)
    outputs.forget_completed()
    try:
        with pytest.raises(KeyboardInterrupt):
            _run(out, {"k": 1}, force=replacing)
        assert read_manifest(out)["config"] == {"k": 1}
        assert outputs.completed_outputs() == [out]
    finally:
        outputs.forget_completed()


@pytest.mark.parametrize("resumable", [False, True])
@pytest.mark.parametrize("replacing", [False, True])
def test_a_signal_during_the_rename_into_out_finds_the_output_complete(tmp_path, monkeypatch, replacing, resumable):
    """A SIGTERM that lands while the rename (or the exchange) into --out runs (ms on a network file system) is raised
    as the call returns, before the swap notes the output in place: the CLI said "--out was not written" (a rollout
    or eval "saved in" its partial directory, gone) of a complete output (kill hunt, session 60)."""
    from qerl_cli import outputs

    out = tmp_path / "o"
    if replacing:
        _run(out, {"k": 0})
    real_replace, real_exchange = os.replace, outputs._exchange

    def then_signal(done):  # the handler's KeyboardInterrupt, raised as the call returns
        if done and (read_manifest(out) or {}).get("config") == {"k": 1}:
            raise KeyboardInterrupt
        return done

    monkeypatch.setattr(os, "replace", lambda a, b: then_signal(real_replace(a, b) or True) and None)
    monkeypatch.setattr(outputs, "_exchange", lambda a, b: then_signal(real_exchange(a, b)))
    outputs.forget_completed()
    try:
        so = StageOutput(out, "demo", config={"k": 1}, inputs={"x": "h1"}, force=replacing, resumable=resumable)
        assert not so.already_done()
        with pytest.raises(KeyboardInterrupt):
            with so as work:
                (work / "a.txt").write_text("hello")
        assert read_manifest(out)["config"] == {"k": 1} and (out / "a.txt").read_text() == "hello"
        assert outputs.completed_outputs() == [out]
        assert sorted(os.listdir(tmp_path)) == ["o"]  # the replaced output deleted, as the swap would have
    finally:
        outputs.forget_completed()


@pytest.mark.parametrize("resumable", [False, True])
def test_the_directories_an_output_creates_are_fsynced_in_their_parents(tmp_path, monkeypatch, resumable):
    """A power cut after the rename could lose a new run/step-000012 from run/ (only step-000012, holding the
    renamed output, was fsynced): each directory made for --out (or for a rollout's writer lock, which makes it
    first) is fsynced in its parent before the output is published (session 58)."""
    import contextlib

    from qerl_cli import outputs

    synced = []
    real = outputs._fsync_dir
    monkeypatch.setattr(outputs, "_fsync_dir", lambda p: (synced.append(Path(p)), real(p)))
    out = tmp_path / "run" / "step-000012" / "adapter"
    so = StageOutput(out, "demo", config={}, inputs={}, resumable=resumable)
    assert not so.already_done()
    with outputs.WriterLock(so) if resumable else contextlib.nullcontext(), so as work:
        (work / "a.txt").write_text("x")
    assert read_manifest(out) is not None
    assert {tmp_path, tmp_path / "run", out.parent} <= set(synced)


def _dead_pid() -> int:
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def _resumable(out, config, force=False):
    return StageOutput(out, "demo", config=config, inputs={"x": "h1"}, force=force, resumable=True)


def test_a_force_redo_killed_between_staging_and_the_swap_resumes_its_finished_work(tmp_path):
    """A resumable --force redo renames its finished partial directory to a temp name, then swaps it with --out; a
    SIGKILL between the two left every finished group (problem) in a dead process's temp dir, which the next run swept
    away: the redo generated them all again (kill hunt, session 59). Now the rerun finds them at the partial name."""
    from qerl_cli.outputs import _HOST, WriterLock

    out = tmp_path / "o"
    so = _resumable(out, {"k": 0})
    with WriterLock(so), so as work:
        (work / "groups.jsonl").write_text("old\n")
    finished = _resumable(tmp_path / "elsewhere" / "o", {"k": 1})  # the same run (fingerprint), finished and staged
    with WriterLock(finished), finished as work:
        (work / "groups.jsonl").write_text("kept\n")
    staged = tmp_path / f".o.tmp-{_dead_pid()}-deadbeef-{_HOST}"
    (tmp_path / "elsewhere" / "o").rename(staged)

    with pytest.raises(OutputExistsError):  # exit 4 (grpo.sh's FORCE=1 then reruns with --force)
        _resumable(out, {"k": 1}).already_done()
    redo = _resumable(out, {"k": 1}, force=True)
    assert not redo.already_done()
    with WriterLock(redo), redo as work:
        assert (work / "groups.jsonl").read_text() == "kept\n"  # resumed, not generated again
    assert (out / "groups.jsonl").read_text() == "kept\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "o"]


def test_an_already_done_rerun_removes_the_writer_lock_a_run_killed_after_its_rename_left(tmp_path):
    """A resumable run killed after renaming its output into place, before removing its writer lock file, left
    ``.o.partial-<fp>.lock`` beside --out for good: every "already done" rerun kept it (kill hunt, session 59)."""
    from qerl_cli.outputs import WriterLock, sweep_leftover_partial

    out = tmp_path / "o"
    so = _resumable(out, {"k": 1})
    with WriterLock(so), so as work:
        (work / "groups.jsonl").write_text("g\n")
    so.writer_lock_path().write_text("")  # as the killed run left it
    again = _resumable(out, {"k": 1})
    assert again.already_done()
    sweep_leftover_partial(again)  # what rollout's and eval's "already done" do
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_a_force_redo_killed_after_its_swap_is_not_undone_by_the_next_force(tmp_path):
    """After the exchange the temp name holds the output the swap replaced, until it is deleted: of this same run where a
    --force redid its own arguments (a corrupted output). A SIGKILL then, and the next --force took it for a staged redo,
    resumed it and put it back over the finished redo (review s59r12: a rollout's corrupted records came back)."""
    from qerl_cli.outputs import _HOST, MANIFEST, WriterLock

    out = tmp_path / "o"
    so = _resumable(out, {"k": 1})
    with WriterLock(so), so as work:
        (work / "groups.jsonl").write_text("corrupted\n")
    replaced = tmp_path / f".o.tmp-{_dead_pid()}-deadbeef-{_HOST}"
    out.rename(replaced)
    redo = _resumable(tmp_path / "elsewhere" / "o", {"k": 1})  # the redo, in place at --out after the exchange
    with WriterLock(redo), redo as work:
        (work / "groups.jsonl").write_text("redone\n")
    (tmp_path / "elsewhere" / "o").rename(out)
    os.utime(replaced / MANIFEST, ns=(1, 1))  # older than the redo's (file times may be a clock tick coarse)

    again = _resumable(out, {"k": 1}, force=True)
    assert not again.already_done()
    with WriterLock(again), again as work:
        assert not (work / "groups.jsonl").exists()  # generated again, not resumed from the replaced output
        (work / "groups.jsonl").write_text("redone\n")
    assert (out / "groups.jsonl").read_text() == "redone\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "o"]


def test_an_already_done_rerun_is_done_where_the_lock_file_left_is_not_its_to_open(tmp_path, monkeypatch):
    """The lock file a killed run left is swept under the lock (session 59): where this user may not open it (another
    user's 0644 file in a shared run directory, a read-only mount) the "already done" rerun failed, exit 7 "cannot write
    o ... nothing was left at --out", of a finished output (review s59r12). A tidy-up, as the stale temp dirs' sweep."""
    import builtins
    import errno

    from qerl_cli import outputs
    from qerl_cli.outputs import WriterLock, sweep_leftover_partial

    out = tmp_path / "o"
    so = _resumable(out, {"k": 1})
    with WriterLock(so), so as work:
        (work / "groups.jsonl").write_text("g\n")
    lock = so.writer_lock_path()
    lock.write_text("")  # as the killed run left it

    def not_ours(path, mode="r", *args, **kw):
        if Path(path) == lock:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return builtins.open(path, mode, *args, **kw)

    monkeypatch.setattr(outputs, "open", not_ours, raising=False)
    again = _resumable(out, {"k": 1})
    assert again.already_done()
    assert not sweep_leftover_partial(again)  # what rollout's and eval's "already done" do: no exit 7
    assert lock.exists()


def test_a_stages_manifest_records_the_command_that_reruns_it(tmp_path):
    """A user rerunning one stage of a recipe's loop to debug it rebuilt its ~20 flags from recipes/lib.sh by hand
    (session 60): the manifest's ``command`` (with ``cwd``), run there with another --out, is the same stage."""
    import shlex
    import subprocess
    import sys

    from tests.reliability_fixtures import REPO, cli_env

    tiny = REPO / "qerl_cli" / "assets" / "tiny_model"
    run = subprocess.run([sys.executable, "-m", "qerl_cli", "quantize", str(tiny), "--out", "q one", "--device", "cpu",
                          "--quiet"], env=cli_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    first = read_manifest(tmp_path / "q one")
    assert first["cwd"] == str(tmp_path) and "world_size" not in first
    argv = shlex.split(first["command"])
    assert argv[:2] == ["qerl", "quantize"] and "q one" in argv
    argv[argv.index("q one")] = "q two"
    again = subprocess.run([sys.executable, "-m", "qerl_cli", *argv[1:]], env=cli_env(), cwd=first["cwd"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    second = read_manifest(tmp_path / "q two")
    assert second["fingerprint"] == first["fingerprint"] and second["outputs"] == first["outputs"]


def test_a_library_callers_manifest_has_no_command_and_a_torchrun_rank_says_the_ranks(tmp_path, monkeypatch):
    from qerl_cli import outputs

    assert outputs._INVOCATION is None  # only the CLI's main() records one
    so = StageOutput(tmp_path / "o", "demo", config={}, inputs={})
    with so as work:
        (work / "x.txt").write_text("x")
    assert "command" not in so.manifest and "cwd" not in so.manifest
    monkeypatch.setattr(outputs, "_INVOCATION", None)
    monkeypatch.setenv("WORLD_SIZE", "4")
    outputs.record_invocation(["train-step", "--out", "a b", "--lr", "1e-5"], cwd="/runs")
    so = StageOutput(tmp_path / "t", "demo", config={}, inputs={})
    with so as work:
        (work / "x.txt").write_text("x")
    assert (so.manifest["command"], so.manifest["cwd"], so.manifest["world_size"]) == (
        "qerl train-step --out 'a b' --lr 1e-5", "/runs", 4)


def test_the_sweep_of_old_outputs_waits_for_a_live_swap_between_its_renames(tmp_path, monkeypatch):
    """(s60r10) Where RENAME_EXCHANGE is unsupported (NFS) a --force replace parks the old output at .o.old-ID between
    its two renames, under the directory lock. Another run's sweep of leftover .o.old-* (its already_done or start)
    took no lock and deleted it there: when the second rename then failed, the old output could not be put back and
    --out was left missing, old and new outputs both gone. The sweep now waits for the swap."""
    import errno
    import threading

    from qerl_cli import outputs

    out = tmp_path / "o"
    _run(out, {"k": 0})
    monkeypatch.setattr(outputs, "_exchange", lambda a, b: False)
    real_replace = os.replace
    between, go, failed = threading.Event(), threading.Event(), []

    def replace(src, dst):
        if Path(dst).name.startswith(".o.old-"):  # the first rename: then wait, and fail the second
            real_replace(src, dst)
            between.set()
            go.wait(10)
        elif Path(dst) == out and Path(src).name.startswith(".o.tmp-"):
            raise OSError(errno.EIO, "Input/output error", str(dst))
        else:
            real_replace(src, dst)

    def redo():
        try:
            _run(out, {"k": 1}, force=True)
        except Exception as e:  # noqa: BLE001 - the second rename's failure, as a write error
            failed.append(e)

    monkeypatch.setattr(os, "replace", replace)
    swap = threading.Thread(target=redo)
    swap.start()
    assert between.wait(10)
    sweep = threading.Thread(target=StageOutput(out, "demo", config={"k": 0}, inputs={"x": "h1"})._clean_stale)
    sweep.start()
    sweep.join(0.5)  # a sweep that does not wait deletes .o.old-* now
    go.set()
    swap.join(10)
    sweep.join(10)
    assert failed and read_manifest(out)["config"] == {"k": 0}  # the old output put back whole
    assert sorted(os.listdir(tmp_path)) == ["o"]


@pytest.mark.parametrize("resumable", [False, True])
@pytest.mark.parametrize("how", ["rename", "exchange", "two renames"])
def test_a_signal_in_the_swap_into_out_still_fsyncs_its_parent_and_deletes_the_old_output(tmp_path, monkeypatch,
                                                                                           how, resumable):
    """(s60r10) A SIGTERM or Ctrl-C raised as the rename (or the exchange) into --out returns, or held over the two
    renames of the NFS replace and raised as they end, skipped the fsync of --out's parent that publishes the rename
    (a machine crash then could lose it), and on the NFS path left the replaced output at .o.old-ID (a checkpoint's
    GBs, until a next run into that --out, which a loop's step never has)."""
    import signal

    from qerl_cli import outputs

    out = tmp_path / "o"
    if how != "rename":
        _run(out, {"k": 0})
    real_replace, real_exchange, real_fsync = os.replace, outputs._exchange, outputs._fsync_dir
    synced = []

    def replace(src, dst):
        real_replace(src, dst)
        if how == "rename" and Path(dst) == out:
            raise KeyboardInterrupt  # the handler's, raised as the call returns
        if how == "two renames" and Path(dst).name.startswith(".o.old-"):
            os.kill(os.getpid(), signal.SIGINT)  # held until both renames are done

    def exchange(a, b):
        if how == "two renames":
            return False
        real_exchange(a, b)
        raise KeyboardInterrupt

    def fsync_dir(path):
        if Path(path) == tmp_path and (read_manifest(out) or {}).get("config") == {"k": 1}:
            synced.append(path)
        real_fsync(path)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(outputs, "_exchange", exchange)
    monkeypatch.setattr(outputs, "_fsync_dir", fsync_dir)
    outputs.forget_completed()
    try:
        so = StageOutput(out, "demo", config={"k": 1}, inputs={"x": "h1"}, force=how != "rename", resumable=resumable)
        assert not so.already_done()
        with pytest.raises(KeyboardInterrupt):
            with so as work:
                (work / "a.txt").write_text("hello")
        assert outputs.completed_outputs()[-1] == out and read_manifest(out)["config"] == {"k": 1}
        assert synced  # the rename made durable
        assert sorted(os.listdir(tmp_path)) == ["o"]  # the replaced output deleted, as the swap would have
    finally:
        outputs.forget_completed()


def test_the_cli_runs_in_a_directory_deleted_under_it(tmp_path):
    """(s60r10) Recording the manifest's ``cwd`` (os.getcwd()) raised FileNotFoundError where the shell's directory
    had been deleted (a scratch dir cleaned up under a running loop's shell): every command, --version included,
    became a traceback before it began. The command is recorded without ``cwd`` there."""
    import subprocess
    import sys

    from tests.reliability_fixtures import cli_env

    gone = tmp_path / "gone"
    gone.mkdir()
    env = cli_env()
    # an empty PYTHONPATH entry (cli_env's where the caller's is unset) is the current directory, which Python itself
    # cannot make absolute there ("Fatal Python error: error evaluating path", before any of qerl runs)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env["PYTHONPATH"].split(os.pathsep) if p)
    run = subprocess.run(["sh", "-c", 'cd "$1" && rmdir "$1" && exec "$2" -m qerl_cli --version', "sh", str(gone),
                          sys.executable], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-2000:]


def test_a_command_recorded_where_the_directory_is_gone_has_no_cwd(monkeypatch):
    from qerl_cli import outputs

    def gone():
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(outputs, "_INVOCATION", None)
    monkeypatch.setattr(os, "getcwd", gone)
    outputs.record_invocation(["eval", "--compare", "a", "b"])
    assert outputs._INVOCATION == {"command": "qerl eval --compare a b"}


def test_a_signal_as_a_resumable_force_redo_is_staged_keeps_it_at_its_partial_name(tmp_path, monkeypatch):
    """(s60r10) A rollout's or eval's --force redo first renames its finished partial directory to a temp name, then
    swaps that in. A SIGTERM raised as that first rename returns came before the clean-up that moves it back: the
    stop line said the groups "are saved in .o.partial-...", a directory then gone (the finished work sat at
    .o.tmp-PID-..., which only a later run put back)."""
    from qerl_cli import outputs

    out = tmp_path / "o"
    _run(out, {"k": 0})
    real_replace = os.replace

    def replace(src, dst):
        real_replace(src, dst)
        if Path(src).name.startswith(".o.partial-") and Path(dst).name.startswith(".o.tmp-"):
            raise KeyboardInterrupt  # the handler's, raised as the call returns

    monkeypatch.setattr(os, "replace", replace)
    outputs.forget_completed()
    so = StageOutput(out, "demo", config={"k": 1}, inputs={"x": "h1"}, force=True, resumable=True)
    assert not so.already_done()
    with pytest.raises(KeyboardInterrupt):
        with so as work:
            (work / "a.txt").write_text("hello")
    assert outputs.completed_outputs() == [] and read_manifest(out)["config"] == {"k": 0}
    assert sorted(os.listdir(tmp_path)) == sorted(["o", so.partial_dir().name])  # where the stop line says it is
    assert read_manifest(so.partial_dir())["config"] == {"k": 1}
