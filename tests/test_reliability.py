"""Nothing lost, nothing silent: atomic outputs, idempotent reruns, lineage, no silent no-ops, safety.

Every stage is driven through the CLI (Typer app in-process) on the tiny pipeline of
``tests/reliability_fixtures.py``. Kill-at-any-moment is ``tests/test_kill.py``, bad input
``tests/test_bad_input.py``, fuzzing ``tests/test_fuzz.py``; docs/reliability.md has the table.
"""

from __future__ import annotations

import json
import pickle
import re
import sys
from pathlib import Path

import pytest
import torch

from qerl_cli.hashing import sha256_file
from qerl_cli.outputs import StageOutput, read_manifest
from tests.reliability_fixtures import (
    ANSWERED_ROWS,
    REPO,
    assert_one_line_error,
    copy_tree,
    invoke,
    leftovers,
    output_hashes,
    pipeline,
    write_jsonl,
)

STAGE_MODULES = ("quantize", "rollout", "train_step", "merge", "evaluate")


@pytest.fixture(scope="module")
def p():
    return pipeline()


def stage_args(stage: str, p: dict, out, **over) -> list:
    src, q, a1 = over.get("src", p["src"]), over.get("q", p["q"]), over.get("a1", p["a1"])
    return {
        "quantize": ["quantize", src, "--out", out, "--device", "cpu", "--no-progress"],
        "rollout": ["rollout", "--model", q, "--prompts", over.get("prompts", p["prompts"]), "--out", out, "-G", 2,
                    "--max-new-tokens", 3, "--device", "cpu", "-q"],
        "train-step": ["train-step", "--model", q, "--shards", over.get("shards", p["sh0"]), "--out", out,
                       "--device", "cpu"],
        "merge": ["merge", "--model", q, "--adapter", a1, "--out", out, "-q"],
        "eval": ["eval", "--model", q, "--adapter", a1, "--dataset", over.get("prompts", p["prompts"]), "--out", out,
                 "--max-new-tokens", 3, "--device", "cpu", "-q"],
    }[stage]


# A flag that changes each stage's result (so the fingerprint).
CHANGED_FLAG = {"quantize": ["--format", "modelopt"], "rollout": ["--seed", 7], "train-step": ["--lr", "3e-5"],
                "merge": ["--dtype", "nvfp4"], "eval": ["--max-new-tokens", 2]}
STAGES = list(CHANGED_FLAG)


# ---- atomic outputs ---------------------------------------------------------------------------------
def test_every_stage_module_writes_through_stage_output():
    """Each stage's library module builds a StageOutput and never creates --out itself."""
    for mod in STAGE_MODULES:
        text = (REPO / "qerl_cli" / f"{mod}.py").read_text()
        assert "StageOutput(" in text, f"{mod}.py does not use StageOutput"
        assert not re.search(r"cfg\.out\)?\.mkdir|\bout\.mkdir\(", text), f"{mod}.py creates its --out directly"


@pytest.mark.parametrize("stage", STAGES)
def test_output_manifest_lists_every_file_with_its_hash(p, tmp_path, stage):
    out = tmp_path / "out"
    r = invoke(stage_args(stage, p, out))
    assert r.exit_code == 0, (r.stderr, r.exception)
    m = read_manifest(out)
    assert m["stage"] == stage and m["fingerprint"] and m["inputs"] and "total_s" in m["timings"]
    on_disk = output_hashes(out)
    assert m["outputs"] == on_disk and on_disk, "manifest.json must list every output file with its sha256"
    assert m["output_bytes"] == {k: (out / k).stat().st_size for k in on_disk}
    # manifest.json was the last file written
    assert (out / "manifest.json").stat().st_mtime_ns >= max((out / k).stat().st_mtime_ns for k in on_disk)
    assert leftovers(tmp_path, "out") == ["out"]


# Late failures: an exception after the stage has written most of its files leaves no --out.
LATE_FAILURE = {
    "quantize": "qerl_cli.quantize.copy_side_files",
    "rollout": "qerl_cli.rollout.summarize",
    "train-step": "qerl_cli.train_step.append_jsonl",
    "merge": "qerl_cli.merge.write_plain_config",
    "eval": "qerl_cli.evaluate._metrics",
}


@pytest.mark.parametrize("stage", STAGES)
def test_late_failure_leaves_no_output_and_keeps_the_previous_one(p, tmp_path, monkeypatch, stage):
    import importlib

    out = tmp_path / "out"
    assert invoke(stage_args(stage, p, out)).exit_code == 0
    before = output_hashes(out)
    mod, _, attr = LATE_FAILURE[stage].rpartition(".")

    def boom(*a, **k):
        raise RuntimeError("injected failure after the outputs were written")

    monkeypatch.setattr(importlib.import_module(mod), attr, boom)
    r = invoke(stage_args(stage, p, out) + CHANGED_FLAG[stage] + ["--force"])
    assert r.exit_code != 0 and isinstance(r.exception, RuntimeError)
    assert output_hashes(out) == before and read_manifest(out)["outputs"] == before
    left = [n for n in leftovers(tmp_path, "out") if not n.startswith(".out.partial-")]
    assert left == ["out"], left


def test_dir_without_manifest_is_never_done_nor_replaced(p, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("user data")
    for force in ([], ["--force"]):
        r = invoke(stage_args("merge", p, out) + force)
        assert_one_line_error(r, 4, str(out), "no valid qerl manifest")
    assert (out / "precious.txt").read_text() == "user data"
    # A finished output whose files were damaged later is not "already done" either.
    out2 = tmp_path / "out2"
    assert invoke(stage_args("merge", p, out2)).exit_code == 0
    st = next(out2.glob("*.safetensors"))
    st.write_bytes(st.read_bytes()[:100])
    assert_one_line_error(invoke(stage_args("merge", p, out2)), 4, "damaged", st.name)
    assert invoke(stage_args("merge", p, out2) + ["--force"]).exit_code == 0
    assert read_manifest(out2)["outputs"] == output_hashes(out2)


def test_truncated_manifest_is_not_done(tmp_path):
    def run():
        so = StageOutput(tmp_path / "o", "demo", config={}, inputs={})
        if so.already_done():
            return "done"
        with so as w:
            (w / "f").write_text("x")
        return "ran"

    assert run() == "ran" and run() == "done"
    m = tmp_path / "o" / "manifest.json"
    m.write_text(m.read_text()[:40])
    with pytest.raises(Exception, match="no valid qerl manifest"):
        run()


def test_replace_uses_an_atomic_exchange_here(tmp_path):
    from qerl_cli.outputs import _exchange

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x").write_text("a")
    assert _exchange(tmp_path / "a", tmp_path / "b")  # Linux renameat2(RENAME_EXCHANGE) on this file system
    assert (tmp_path / "b" / "x").read_text() == "a" and not (tmp_path / "a" / "x").exists()


_SWAP_WITHOUT_EXCHANGE = """
import sys
from pathlib import Path

import qerl_cli.outputs as outputs

outputs._exchange = lambda a, b: False  # a file system without RENAME_EXCHANGE (NFS)
out, v, resumable = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
so = outputs.StageOutput(out, "demo", config={"v": v}, inputs={}, force=True, resumable=resumable)
assert not so.already_done()
with so as w:
    (w / "f").write_text(f"v{v}")
"""


@pytest.mark.parametrize("replaced", ["output", "empty dir", "resumable"])
def test_a_kill_between_the_two_renames_of_the_fallback_finishes_the_swap(tmp_path, replaced):
    """Where RENAME_EXCHANGE is unsupported (NFS) a --force replace takes two renames; SIGKILLed between them, the run
    left --out missing, the old output at .o.old-* and its finished redo in its temp dir. The next run put the old
    output back and deleted the redo as a dead run's temp dir (a plain rerun of the redo's command: exit 4); where
    the replaced --out was an empty directory (no manifest to put back) --out stayed missing, the redo deleted all
    the same. Now the next run finishes the swap: the redo is at --out, "already done", nothing left beside it."""
    import os
    import subprocess

    out = tmp_path / "o"
    if replaced == "empty dir":
        out.mkdir()
    else:
        so = StageOutput(out, "demo", config={"v": 1}, inputs={})
        assert not so.already_done()
        with so as w:
            (w / "f").write_text("v1")
    env = {**os.environ, "QERL_TEST_KILL_AT": "mid-swap"}  # its first hit: between the two renames
    r = subprocess.run([sys.executable, "-c", _SWAP_WITHOUT_EXCHANGE, str(out), "2", str(int(replaced == "resumable"))],
                       env=env, capture_output=True, text=True, cwd=REPO)
    assert r.returncode == -9, r.stderr
    assert not out.exists()  # the window: the old output renamed away, the new one not yet in
    assert StageOutput(out, "demo", config={"v": 2}, inputs={}, resumable=replaced == "resumable").already_done()
    assert (out / "f").read_text() == "v2" and sorted(os.listdir(tmp_path)) == ["o"]


def test_a_signal_between_the_two_renames_of_the_fallback_finishes_the_swap(tmp_path, monkeypatch):
    """A SIGTERM or Ctrl-C (an exception raised there) between the two renames of the fallback: the redo was deleted
    with its temp dir and --out left missing until the next run put the old output back, the CLI saying "--out was
    not written". Now the swap is finished first: --out holds the redo, the CLI says it is complete."""
    import os

    import qerl_cli.outputs as outputs

    def make(cfg, force=False):
        return StageOutput(tmp_path / "o", "demo", config=cfg, inputs={}, force=force)

    so = make({"v": 1})
    assert not so.already_done()
    with so as w:
        (w / "f").write_text("old")
    monkeypatch.setattr(outputs, "_exchange", lambda a, b: False)
    hits = []

    def stopped_at(name):
        if name == "mid-swap" and not hits:  # the first: between the renames
            hits.append(name)
            raise KeyboardInterrupt  # what the CLI's SIGTERM handler raises (Terminated), Ctrl-C

    monkeypatch.setattr(outputs, "crash_point", stopped_at)
    outputs.forget_completed()
    so = make({"v": 2}, force=True)
    assert not so.already_done()
    try:
        with pytest.raises(KeyboardInterrupt):
            with so as w:
                (w / "f").write_text("new")
        assert outputs.completed_outputs() == [tmp_path / "o"]
    finally:
        outputs.forget_completed()
    assert (tmp_path / "o" / "f").read_text() == "new"
    assert make({"v": 2}).already_done() and sorted(os.listdir(tmp_path)) == ["o"]  # the old output swept


def test_a_second_ctrl_c_between_the_two_renames_of_the_fallback_does_not_undo_the_swap(tmp_path, monkeypatch):
    """(review s59r10) Ctrl-C pressed twice, or a Ctrl-C on top of Slurm's SIGTERM, between the two renames of the
    fallback (NFS: each rename a round trip): the second KeyboardInterrupt was raised inside the handler that finishes
    the swap, before its rename, and the stage's clean-up deleted the finished redo with its temp dir (--out missing,
    the next run put the old output back). Real signals here: SIGINT and SIGTERM are held over the renames, so the
    swap is whole before either is raised."""
    import os
    import signal

    import qerl_cli.outputs as outputs

    out = tmp_path / "o"

    def make(cfg, force=False):
        return StageOutput(out, "demo", config=cfg, inputs={}, force=force)

    so = make({"v": 1})
    assert not so.already_done()
    with so as w:
        (w / "f").write_text("old")
    monkeypatch.setattr(outputs, "_exchange", lambda a, b: False)
    real = os.replace
    pressed = []

    def replace(src, dst):
        if Path(dst).name.startswith(".o.old-"):  # the first rename, then a Ctrl-C
            real(src, dst)
            pressed.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        elif Path(dst) == out and Path(src).name.startswith(".o.tmp-"):  # another Ctrl-C before the second
            pressed.append(2)
            os.kill(os.getpid(), signal.SIGINT)
            real(src, dst)
        else:
            real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    outputs.forget_completed()
    so = make({"v": 2}, force=True)
    assert not so.already_done()
    try:
        with pytest.raises(KeyboardInterrupt):
            with so as w:
                (w / "f").write_text("new")
        assert pressed == [1, 2] and outputs.completed_outputs() == [out]
    finally:
        outputs.forget_completed()
    monkeypatch.setattr(os, "replace", real)
    assert (out / "f").read_text() == "new"
    assert make({"v": 2}).already_done() and sorted(os.listdir(tmp_path)) == ["o"]


def test_stale_temp_dirs_are_cleaned_only_when_their_process_is_dead_on_this_host(tmp_path):
    import subprocess

    from qerl_cli.outputs import _HOST

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = tmp_path / f".o.tmp-{dead.pid}-deadbeef-{_HOST}"
    legacy = tmp_path / f".o.tmp-{dead.pid}-cafebabe"  # name without a host: this host's
    other_host = tmp_path / f".o.tmp-{dead.pid}-abcdef01-another_node"
    alive = tmp_path / f".o.tmp-{__import__('os').getpid()}-01234567-{_HOST}"
    for d in (mine, legacy, other_host, alive):
        d.mkdir()
    so = StageOutput(tmp_path / "o", "demo", config={}, inputs={})
    assert not so.already_done()
    with so as w:
        (w / "f").write_text("x")
    assert not mine.exists() and not legacy.exists()
    assert other_host.exists() and alive.exists()


def test_a_temp_dir_whose_pid_a_live_process_took_since_is_cleaned(tmp_path):
    """PIDs repeat (a container's next start gives its first processes the same small pids): a killed run's temp dir
    whose pid a live unrelated process held was kept for good (GBs of a checkpoint). A temp name records the process's
    start beside its pid; one of another start is a dead run's. One of this pid's start stays, as one named before
    2026-11-28 by the pid alone (a live process's as far as anyone can tell)."""
    import subprocess

    from qerl_cli.outputs import _HOST, _own_id, _started

    live = subprocess.Popen(["sleep", "60"])
    try:
        assert _started(live.pid) is not None  # Linux's /proc: the process's start in ticks since boot, the boot's id
        ticks, boot = _started(live.pid).split(".")
        reused = tmp_path / f".o.tmp-{live.pid}.{int(ticks) - 1}.{boot}-deadbeef-{_HOST}"  # a killed run's, pid reused
        rebooted = tmp_path / f".o.tmp-{live.pid}.{ticks}.00000000-cafebabe-{_HOST}"  # a run's of another boot
        its_own = tmp_path / f".o.tmp-{live.pid}.{_started(live.pid)}-01234567-{_HOST}"
        legacy = tmp_path / f".o.tmp-{live.pid}-89abcdef-{_HOST}"
        for d in (reused, rebooted, its_own, legacy):
            d.mkdir()
        so = StageOutput(tmp_path / "o", "demo", config={}, inputs={})
        assert not so.already_done()
        with so as w:
            assert w.name.startswith(f".o.tmp-{_own_id()}-") and "." in _own_id()  # this run's start recorded
            (w / "f").write_text("x")
        assert not reused.exists() and not rebooted.exists()
        assert its_own.exists() and legacy.exists()
    finally:
        live.kill()
        live.wait()


def test_an_already_done_rerun_sweeps_what_a_killed_replace_left(tmp_path):
    # Killed between swapping the new output in and deleting the old one: the old output sits in a
    # dead process's temp dir. A rerun that finds the output done removes it as well.
    import subprocess

    from qerl_cli.outputs import _HOST

    so = StageOutput(tmp_path / "o", "demo", config={}, inputs={})
    assert not so.already_done()
    with so as w:
        (w / "f").write_text("x")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = tmp_path / f".o.tmp-{dead.pid}-deadbeef-{_HOST}"
    old.mkdir()
    (old / "big.safetensors").write_bytes(b"0" * 1024)
    assert StageOutput(tmp_path / "o", "demo", config={}, inputs={}).already_done()
    assert not old.exists() and (tmp_path / "o" / "f").read_text() == "x"


@pytest.mark.parametrize("stage", ["quantize", "merge"])
def test_ctrl_c_is_one_line_exit_130_and_no_output(p, tmp_path, monkeypatch, stage):
    import qerl_cli.checkpoint.safetensors_io as sio

    real = sio.ShardedWriter.write
    calls = {"n": 0}

    def interrupt_on_third(self, name, t):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, name, t)

    monkeypatch.setattr(sio.ShardedWriter, "write", interrupt_on_third)
    r = invoke(stage_args(stage, p, tmp_path / "out"))
    assert r.exit_code == 130 and calls["n"] == 3
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted") and "Traceback" not in r.stderr
    assert leftovers(tmp_path, "out") == []


# ---- idempotent reruns ------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", STAGES)
def test_rerun_is_already_done_and_changes_need_force(p, tmp_path, stage):
    out = tmp_path / "out"
    first = invoke(stage_args(stage, p, out))
    assert first.exit_code == 0, (first.stderr, first.exception)
    m1 = read_manifest(out)
    again = invoke(stage_args(stage, p, out))
    assert again.exit_code == 0, again.stderr
    assert "already done" in again.stdout + again.stderr
    assert read_manifest(out) == m1, "an 'already done' rerun must not rewrite the output"

    changed = invoke(stage_args(stage, p, out) + CHANGED_FLAG[stage])
    msg = assert_one_line_error(changed, 4, str(out), "--force")
    assert m1["fingerprint"][:12] in msg and " -> " in msg, msg  # the changed setting, old -> new
    assert read_manifest(out) == m1

    forced = invoke(stage_args(stage, p, out) + CHANGED_FLAG[stage] + ["--force"])
    assert forced.exit_code == 0, (forced.stderr, forced.exception)
    m2 = read_manifest(out)
    assert m2["fingerprint"] != m1["fingerprint"] and m2["outputs"] == output_hashes(out)
    assert leftovers(tmp_path, "out") == ["out"]


# A file this run reads (or the run's metrics file) inside --out: the --force redo read it, then deleted it with
# the old output (a review, 2026-11-27: exit 0, the file gone, so the same command could not be run again).
SIDE_FILES = {"--chat-template-file": ("t.jinja", "{% for m in messages %}{{ m['content'] }}{% endfor %}"),
              "--prompt-template": ("t.txt", "Q: {prompt}\nA:"),
              "--reward": ("r.py", "def f(completion, answer):\n    return 1.0\n"),
              "--metrics-file": ("run-metrics.jsonl", '{"step": 0}\n{"step": 1}\n')}


@pytest.mark.parametrize("stage,flag", [("rollout", "--chat-template-file"), ("rollout", "--prompt-template"),
                                        ("rollout", "--reward"), ("eval", "--chat-template-file"),
                                        ("eval", "--prompt-template"), ("train-step", "--metrics-file")])
def test_force_never_deletes_a_file_of_the_run_that_lies_inside_its_out(p, tmp_path, stage, flag):
    out = tmp_path / "out"
    assert invoke(stage_args(stage, p, out)).exit_code == 0
    name, text = SIDE_FILES[flag]
    (out / name).write_text(text)
    value = f"{out / name}:f" if flag == "--reward" else out / name
    r = invoke(stage_args(stage, p, out) + [flag, value, "--force"])
    assert_one_line_error(r, 2, f"overlaps {flag} ")
    assert (out / name).read_text() == text


def test_changed_input_content_is_a_changed_input(p, tmp_path):
    """Same flags, but the prompt file's bytes changed: not 'already done'."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", ANSWERED_ROWS)
    out = tmp_path / "out"
    assert invoke(stage_args("rollout", p, out, prompts=prompts)).exit_code == 0
    write_jsonl(prompts, ANSWERED_ROWS[:3])
    assert_one_line_error(invoke(stage_args("rollout", p, out, prompts=prompts)), 4, "--force",
                          "input prompts changed")  # the error names what changed


# ---- lineage -----------------------------------------------------------------------------------------
def _hashes_named(msg: str, *hashes: str):
    for h in hashes:
        assert h[:12] in msg, (h[:12], msg)


def test_train_step_refuses_shards_of_another_base(p, tmp_path):
    from tests.train_fixtures import make_shard

    sh = make_shard(tmp_path / "sh", p["q_other_hash"])
    msg = assert_one_line_error(invoke(stage_args("train-step", p, tmp_path / "out", shards=sh)), 3)
    _hashes_named(msg, p["q_other_hash"], p["qhash"])
    assert leftovers(tmp_path, "out") == []


def test_train_step_refuses_shards_of_another_adapter(p, tmp_path):
    from qerl_cli.adapters import adapter_hash
    from tests.train_fixtures import make_shard

    other = "f" * 64
    sh = make_shard(tmp_path / "sh", p["qhash"], adapter_hash=other, step=1)
    args = stage_args("train-step", p, tmp_path / "out", shards=sh) + ["--adapter", p["a1"], "-q"]
    msg = assert_one_line_error(invoke(args), 3)
    _hashes_named(msg, other, adapter_hash(p["a1"]))
    # a rollout's manifest records the --adapter path it was given: the error names it beside the hash
    (sh / "manifest.json").write_text(json.dumps({"stage": "rollout", "fingerprint": "f", "summary": {"adapter_path": "/runs/a7"}}))
    assert "(/runs/a7 when it ran)" in assert_one_line_error(invoke(args), 3)
    (sh / "manifest.json").unlink()
    # ... and shards sampled with an adapter cannot train a fresh one
    msg = assert_one_line_error(invoke(stage_args("train-step", p, tmp_path / "out", shards=sh) + ["-q"]), 3)
    _hashes_named(msg, other)
    assert leftovers(tmp_path, "out") == []


def test_train_step_refuses_an_adapter_of_another_base(p, tmp_path):
    from qerl_cli.adapters import adapter_hash
    from tests.train_fixtures import make_shard

    sh = make_shard(tmp_path / "sh", p["q_other_hash"], adapter_hash=adapter_hash(p["a1"]), step=1)
    args = stage_args("train-step", p, tmp_path / "out", shards=sh, q=p["q_other"]) + ["--adapter", p["a1"], "-q"]
    msg = assert_one_line_error(invoke(args), 3)
    _hashes_named(msg, p["qhash"], p["q_other_hash"])


@pytest.mark.parametrize("stage", ["merge", "rollout", "eval"])
def test_adapter_for_another_base_is_refused(p, tmp_path, stage):
    args = stage_args(stage, p, tmp_path / "out", q=p["q_other"])
    if stage == "rollout":
        args += ["--adapter", p["a1"]]
    msg = assert_one_line_error(invoke(args), 3, str(p["a1"]))
    _hashes_named(msg, p["qhash"], p["q_other_hash"])
    assert leftovers(tmp_path, "out") == []


# ---- no silent no-ops ------------------------------------------------------------------------------
def _logits(model, lora_on=True):
    from qerl_cli.layers.lora import lora_disabled

    ids = torch.arange(1, 9).unsqueeze(0)
    with torch.no_grad():
        if lora_on:
            return model.compute_logits(model.forward_train(ids))
        with lora_disabled(model):
            return model.compute_logits(model.forward_train(ids))


def test_loaded_adapter_changes_the_model(p):
    from qerl_cli.models import load_model

    m = load_model(p["q"], dtype=torch.float32, adapter_dir=p["a1"])
    assert (_logits(m) - _logits(m, False)).abs().max() > 1e-6


def _save_adapter_variant(p, out: Path, mutate) -> Path:
    from safetensors.torch import load_file, save_file

    d = copy_tree(p["a1"], out)
    t = load_file(str(d / "adapter_model.safetensors"))
    save_file(mutate(t), str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
    return d


def test_adapter_that_changes_nothing_is_refused(p, tmp_path):
    """Nonzero B with A = 0: a no-op in disguise. Refused at load (rollout/eval/train-step)."""
    noop = _save_adapter_variant(p, tmp_path / "noop", lambda t: {
        k: (torch.zeros_like(v) if ".lora_A." in k else v) for k, v in t.items()})
    for stage in ("rollout", "eval"):
        args = stage_args(stage, p, tmp_path / "out", a1=noop)
        if stage == "rollout":
            args += ["--adapter", noop]
        assert_one_line_error(invoke(args), 2, "silent no-op")
    assert leftovers(tmp_path, "out") == [] or all(n.startswith(".out.partial-") for n in leftovers(tmp_path, "out"))


def test_fresh_b_zero_adapter_at_step_zero_loads(p, tmp_path):
    """The exception to the probe: a fresh adapter (B = 0) is a no-op on purpose."""
    from qerl_cli.adapters import save_adapter
    from qerl_cli.layers.lora import LoraSpec
    from qerl_cli.models import load_model

    m = load_model(p["q"], dtype=torch.float32, lora=LoraSpec(r=4, alpha=8))
    save_adapter(m, tmp_path / "fresh", base_model_path=str(p["q"]))
    m2 = load_model(p["q"], dtype=torch.float32, adapter_dir=tmp_path / "fresh")
    assert torch.equal(_logits(m2), _logits(m2, False))


def test_eval_reports_the_lora_modules_it_used(p, tmp_path):
    out = tmp_path / "out"
    assert invoke(stage_args("eval", p, out)).exit_code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["lora_modules"] == 14  # 7 targets x 2 layers


def test_aqn_changes_every_norm_and_refuses_a_no_op(p):
    from qerl_cli.aqn import NOISED_NORMS, apply_noise, clear_noise
    from qerl_cli.errors import BadInputError
    from qerl_cli.models import load_model

    m = load_model(p["q"], dtype=torch.float32)
    ids = torch.arange(1, 9).unsqueeze(0)
    with torch.no_grad():
        clean = m.compute_logits(m.forward_train(ids))
    rec = apply_noise(m, 1e-2, 0, 3)
    assert rec["norms"] == list(NOISED_NORMS)
    for layer in m.model.layers:
        for name in NOISED_NORMS:
            norm = getattr(layer, name)
            assert (norm.weight.float() + norm.noise != norm.weight.float()).all()
    with torch.no_grad():
        noisy = m.compute_logits(m.forward_train(ids))
    assert (noisy - clean).abs().max() > 1e-4
    with pytest.raises(BadInputError, match="does not change"):
        apply_noise(m, 1e-30, 0, 3)
    clear_noise(m)
    with torch.no_grad():
        assert torch.equal(m.compute_logits(m.forward_train(ids)), clean)


def test_rollout_aqn_too_small_to_matter_is_an_error(p, tmp_path):
    args = stage_args("rollout", p, tmp_path / "out") + ["--aqn-sigma-start", "1e-30", "--aqn-stages", 1,
                                                        "--total-steps", 2, "--step", 1]
    assert_one_line_error(invoke(args), 2, "AQN", "--aqn-sigma-start")


# ---- safety ------------------------------------------------------------------------------------------
class _Bomb:
    """Unpickling this creates a marker file: proof that a pickle was (not) loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "unpickled!"))


def _pickle_dir(src: Path, dst: Path, marker: Path, name: str = "pytorch_model.bin") -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")) and f.name != "manifest.json":
            (dst / f.name).write_bytes(f.read_bytes())
    with open(dst / name, "wb") as fh:
        pickle.dump({"weight": _Bomb(marker)}, fh)
    return dst


def test_the_pickle_bomb_works(tmp_path):
    marker = tmp_path / "marker"
    d = tmp_path / "d"
    d.mkdir()
    with open(d / "x.bin", "wb") as fh:
        pickle.dump(_Bomb(marker), fh)
    with open(d / "x.bin", "rb") as fh:
        pickle.load(fh)  # noqa: S301 - the test's own file
    assert marker.exists()


@pytest.mark.parametrize("stage", STAGES)
def test_pickle_only_checkpoints_are_refused_unopened(p, tmp_path, stage):
    marker = tmp_path / "marker"
    out = tmp_path / "out"
    if stage == "quantize":
        args = stage_args(stage, p, out, src=_pickle_dir(p["src"], tmp_path / "bin", marker))
    elif stage == "merge":
        args = stage_args(stage, p, out, a1=_pickle_dir(p["a1"], tmp_path / "ad", marker, "adapter_model.bin"))
    else:
        args = stage_args(stage, p, out, q=_pickle_dir(p["q"], tmp_path / "bin", marker))
        if stage == "eval":
            args[args.index("--adapter") : args.index("--adapter") + 2] = []
    r = invoke(args)
    assert r.exit_code in (2, 3), (r.exit_code, r.stderr, r.exception)
    assert_one_line_error(r, r.exit_code)
    assert not marker.exists(), f"{stage} unpickled a checkpoint"
    assert not out.exists()


def test_pickle_next_to_safetensors_is_ignored_and_not_copied(p, tmp_path):
    marker = tmp_path / "marker"
    src = copy_tree(p["src"], tmp_path / "src")
    with open(src / "pytorch_model.bin", "wb") as fh:
        pickle.dump({"w": _Bomb(marker)}, fh)
    out = tmp_path / "out"
    assert invoke(stage_args("quantize", p, out, src=src)).exit_code == 0
    assert not marker.exists() and not list(out.glob("*.bin"))


def test_trust_remote_code_is_never_enabled(p, tmp_path):
    """No code path passes trust_remote_code=True, and a model dir shipping custom tokenizer/model
    code (auto_map) does not get it executed."""
    for f in (REPO / "qerl_cli").rglob("*.py"):
        text = f.read_text()
        assert not re.search(r"trust_remote_code\s*=\s*True", text), f
    marker = tmp_path / "remote_code_ran"
    q = copy_tree(p["q"], tmp_path / "q")
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    (q / "tokenization_evil.py").write_text(code + "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    (q / "configuration_evil.py").write_text(code + "from transformers import Qwen2Config as EvilConfig\n")
    tc = json.loads((q / "tokenizer_config.json").read_text())
    tc["auto_map"] = {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}
    (q / "tokenizer_config.json").write_text(json.dumps(tc))
    cfg = json.loads((q / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
    (q / "config.json").write_text(json.dumps(cfg))
    for stage in ("rollout", "eval"):
        args = stage_args(stage, p, tmp_path / stage, q=q)
        if stage == "eval":
            args[args.index("--adapter") : args.index("--adapter") + 2] = []
        r = invoke(args)
        assert r.exit_code in (0, 2), (r.stderr, r.exception)
        assert not marker.exists(), f"{stage} executed a model's remote code"


def test_reward_code_is_imported_only_when_named(p, tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "evil_reward_mod.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n"
        "def score(completion, answer=None):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # Prompt rows naming the module (as a reward, an id, an answer) do not import it.
    rows = [{"id": "evil_reward_mod:score", "prompt": "evil_reward_mod:score", "answer": "1",
             "reward": "evil_reward_mod:score"}]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    assert invoke(stage_args("rollout", p, tmp_path / "out", prompts=prompts)).exit_code == 0
    assert "evil_reward_mod" not in sys.modules and not marker.exists()
    # A bare module name (no :function) is refused without importing it.
    r = invoke(stage_args("rollout", p, tmp_path / "out2", prompts=prompts) + ["--reward", "evil_reward_mod"])
    assert_one_line_error(r, 2, "evil_reward_mod")
    assert not marker.exists()
    # Named with module:function, it is imported (the check above can fail).
    r = invoke(stage_args("rollout", p, tmp_path / "out3", prompts=prompts) + ["--reward", "evil_reward_mod:score"])
    assert r.exit_code == 0, r.stderr
    assert marker.exists()
    sys.modules.pop("evil_reward_mod", None)


def test_output_paths_never_come_from_prompt_data(p, tmp_path):
    """Ids and prompts that look like paths end up inside the records, never as file names."""
    nasty = ["../../escaped", "/tmp/qerl-escaped-abs", "..", "a/b/c", "shard-00000-of-00001.jsonl", "~"]
    rows = [{"id": n, "prompt": f"{n} What is 1 + 2?", "answer": "3"} for n in nasty]
    (tmp_path / "data").mkdir()
    prompts = write_jsonl(tmp_path / "data" / "p.jsonl", rows)
    work = tmp_path / "runs"
    work.mkdir()
    before = {x for x in Path("/tmp").iterdir() if x.name.startswith("qerl-escaped")}
    assert invoke(stage_args("rollout", p, work / "r", prompts=prompts)).exit_code == 0
    assert invoke(stage_args("eval", p, work / "e", prompts=prompts)).exit_code == 0
    assert sorted(x.name for x in (work / "r").iterdir()) == ["manifest.json", "shard-00000-of-00001.jsonl"]
    assert sorted(x.name for x in (work / "e").iterdir()) == ["manifest.json", "metrics.json", "samples.jsonl"]
    assert sorted(x.name for x in work.iterdir()) == ["e", "r"]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["data", "runs"]
    assert sorted(x.name for x in (tmp_path / "data").iterdir()) == ["p.jsonl"]
    assert {x for x in Path("/tmp").iterdir() if x.name.startswith("qerl-escaped")} == before
    recs = [json.loads(ln) for ln in (work / "r" / "shard-00000-of-00001.jsonl").read_text().splitlines()]
    assert {r["prompt_id"] for r in recs} == set(nasty)
    assert sha256_file(prompts)  # the input is untouched and readable
