"""Kill at any moment: every stage is started as ``python -m qerl_cli <stage>`` and SIGKILLed at
named points (``QERL_TEST_KILL_AT``, see ``qerl_cli.outputs.crash_point``); then nothing half-made
is visible at ``--out``, the inputs are untouched, and a plain rerun finishes with the same files
as an uninterrupted run.

The default suite kills quantize and merge mid-write and a --force replace before its rename
(each case starts one interpreter: ~10 s on 2 busy cores); the full stage x point matrix,
rollout, train-step and eval included, is ``pytest -m slow tests/test_kill.py`` (~6 min). The rerun and the uninterrupted reference
run in-process.
"""

from __future__ import annotations

import shutil

import pytest

from qerl_cli.outputs import read_manifest
from tests.reliability_fixtures import invoke, leftovers, output_hashes, pipeline, run_cli


def _args(stage: str, p: dict, out) -> list:
    return {
        "quantize": ["quantize", p["src"], "--out", out, "--device", "cpu", "--no-progress"],
        "rollout": ["rollout", "--model", p["q"], "--prompts", p["prompts"], "--out", out, "-G", 2,
                    "--max-new-tokens", 4, "--batch-prompts", 1, "--device", "cpu", "--seed", 3, "-q"],
        "train-step": ["train-step", "--model", p["q"], "--shards", p["sh0"], "--out", out, "--device", "cpu",
                       "--lr", "1e-2", "-q"],
        "merge": ["merge", "--model", p["q"], "--adapter", p["a1"], "--out", out, "-q"],
        "eval": ["eval", "--model", p["q"], "--adapter", p["a1"], "--dataset", p["prompts"], "--out", out,
                 "--max-new-tokens", 4, "--device", "cpu", "-q"],
    }[stage]


def _inputs(stage: str, p: dict) -> list:
    return {"quantize": [p["src"]], "rollout": [p["q"], p["prompts"].parent / "prompts.jsonl"],
            "train-step": [p["q"], p["sh0"]], "merge": [p["q"], p["a1"]], "eval": [p["q"], p["a1"]]}[stage]


# Files whose bytes must not depend on the run (metrics.json/metrics.jsonl hold timings).
_COMPARED = {
    "train-step": {"adapter_model.safetensors", "adapter_config.json", "optimizer.safetensors", "trainer_state.json"},
    "eval": {"samples.jsonl"},
}

# (stage, kill point): early, mid-write, just before the rename. The first listed per stage is the
# default-suite case.
POINTS = {
    "quantize": ["tensor:3", "stage-start", "before-manifest", "before-rename"],
    "rollout": ["shard-group:2", "stage-start", "before-manifest", "before-rename"],
    "train-step": ["before-manifest", "stage-start", "before-rename"],
    "merge": ["tensor:5", "stage-start", "before-rename"],
    "eval": ["eval-problem:2", "stage-start", "before-manifest", "before-rename"],
}
# Resumable stages: a kill keeps their partial directory, and the rerun continues it.
RESUMABLE = {"rollout", "eval"}
# Default suite: the stages whose case stays ~10 s (rollout, train-step and eval import and run a
# model in the subprocess: 25-35 s on 2 busy cores, so they are -m slow with the rest).
DEFAULT = {"quantize", "merge"}
CASES = [pytest.param(stage, point, id=f"{stage}-{point}",
                      marks=() if i == 0 and stage in DEFAULT else pytest.mark.slow)
         for stage, points in POINTS.items() for i, point in enumerate(points)]

_reference: dict[str, dict] = {}
_reference_metrics: dict[str, dict] = {}


def reference(stage: str, tmp_root) -> dict:
    """File hashes of an uninterrupted run (in-process, once per stage)."""
    if stage not in _reference:
        out = tmp_root / f"ref-{stage}"
        r = invoke(_args(stage, pipeline(), out), cli_threads=True)
        assert r.exit_code == 0, (r.stderr, r.exception)
        _reference[stage] = output_hashes(out, _COMPARED.get(stage))
        if stage == "eval":
            _reference_metrics[stage] = _eval_metrics(out)
        shutil.rmtree(out)
    return _reference[stage]


def _eval_metrics(out) -> dict:
    """An eval's metrics.json without its timings, which alone may differ from an uninterrupted run's."""
    import json

    m = json.loads((out / "metrics.json").read_text())
    m.pop("time")
    return m


@pytest.mark.parametrize("stage,point", CASES)
def test_kill_then_rerun_equals_uninterrupted(stage, point, tmp_path):
    p = pipeline()
    inputs_before = {str(d): output_hashes(d) if d.is_dir() else d.read_bytes() for d in _inputs(stage, p)}
    ref = reference(stage, tmp_path)
    out = tmp_path / "out"

    killed = run_cli(_args(stage, p, out), kill_at=point)
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-2000:])
    assert not out.exists(), f"{point}: a killed {stage} left {out} in place"
    left = leftovers(tmp_path, "out")
    if stage in RESUMABLE and point != "stage-start":
        assert any(n.startswith(".out.partial-") for n in left), left  # resumable work is kept
    assert read_manifest(out) is None

    # The rerun runs in-process (what matters is that it is a different process from the killed one).
    rerun = invoke(_args(stage, p, out), cli_threads=True)  # on the killed interpreter's thread count
    assert rerun.exit_code == 0, (rerun.stderr[-3000:], rerun.exception)
    assert "already done" not in rerun.stdout
    m = read_manifest(out)
    assert m is not None and m["stage"] == stage
    assert output_hashes(out, _COMPARED.get(stage)) == ref
    if stage == "eval":  # the kept problems resumed, not generated again; metrics as an uninterrupted run's
        assert m["resumed"]["problems"] == {"eval-problem:2": 2, "stage-start": 0}.get(point, 4), m["resumed"]
        assert _eval_metrics(out) == _reference_metrics["eval"]
    # The manifest's hashes are those of the files on disk.
    assert {k: v for k, v in m["outputs"].items()} == output_hashes(out)
    assert leftovers(tmp_path, "out") == ["out"], "temp/partial dirs of the killed run were not cleaned up"
    assert {str(d): output_hashes(d) if d.is_dir() else d.read_bytes() for d in _inputs(stage, p)} == inputs_before

    if stage != "train-step":  # train-step -q prints nothing, also not "already done"
        again = invoke(_args(stage, p, out))
        assert again.exit_code == 0 and "already done" in again.stdout, again.stdout


@pytest.mark.parametrize("point", ["before-rename", pytest.param("mid-swap", marks=pytest.mark.slow)])
def test_kill_while_replacing_keeps_a_complete_output(point, tmp_path):
    """--force over an existing output, killed before/during the swap: --out holds one complete
    output (the old one, or after the atomic exchange the new one), never a mix or nothing."""
    p = pipeline()
    out = tmp_path / "out"
    old = invoke(["quantize", p["src"], "--out", out, "--device", "cpu", "--no-progress", "--max-shard-size", "20KB"])
    assert old.exit_code == 0, old.stderr
    old_files = output_hashes(out)
    new_args = ["quantize", p["src"], "--out", out, "--device", "cpu", "--no-progress", "--force"]

    killed = run_cli(new_args, kill_at=point)
    assert killed.returncode == -9, killed.stderr[-2000:]
    m = read_manifest(out)
    assert m is not None, f"{point}: the old output vanished"
    assert m["outputs"] == output_hashes(out), "files at --out do not match its manifest"
    if point == "before-rename":
        assert output_hashes(out) == old_files

    rerun = invoke(new_args)
    assert rerun.exit_code == 0, rerun.stderr[-3000:]
    assert read_manifest(out)["config"]["max_shard_size"] == 5 * 10**9
    assert read_manifest(out)["outputs"] == output_hashes(out)
    assert leftovers(tmp_path, "out") == ["out"]


@pytest.mark.parametrize("sig", ["TERM", pytest.param("INT", marks=pytest.mark.slow)])
def test_sigterm_and_sigint_mid_write_leave_nothing(sig, tmp_path):
    """SIGTERM (Slurm pre-emption, time limit) and SIGINT (Ctrl-C) mid-write: one line, exit 143 / 130, the
    temp dir removed on the way out (SIGTERM ended the process like SIGKILL until 2026-11-26, leaving it,
    and a requeue on another node never removed it), no --out, and the rerun equals an uninterrupted run."""
    p = pipeline()
    ref = reference("quantize", tmp_path)
    out = tmp_path / "out"
    r = run_cli(_args("quantize", p, out), kill_at="tensor:3", signal=sig)
    code, word = (143, "terminated (SIGTERM)") if sig == "TERM" else (130, "interrupted")
    assert r.returncode == code and r.stderr.strip().startswith(word), r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert leftovers(tmp_path, "out") == []
    assert not out.exists()
    rerun = invoke(_args("quantize", p, out))
    assert rerun.exit_code == 0, rerun.stderr
    assert output_hashes(out) == ref and leftovers(tmp_path, "out") == ["out"]


def test_a_signal_after_the_output_is_in_place_says_it_is_complete(tmp_path):
    """A SIGTERM after the rename (a Slurm time limit while the summary prints) said "--out was not
    written", though the output was whole and a rerun says already done (a review)."""
    p = pipeline()
    out = tmp_path / "out"
    r = run_cli(_args("quantize", p, out), kill_at="after-rename", signal="TERM")
    assert r.returncode == 143, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (f"terminated (SIGTERM) after --out was written: {out} is complete "
                                                 "(a rerun says already done)")
    assert read_manifest(out)["outputs"] == output_hashes(out)
    rerun = invoke(_args("quantize", p, out))
    assert rerun.exit_code == 0 and "already done" in rerun.output + rerun.stderr


IMPORT_INT = """
import importlib.abc, os, signal, sys, time

class TorchImport(importlib.abc.MetaPathFinder):
    # Ctrl-C while torch imports, and what torch's C setup does with it (it imports NumPy and drops
    # any exception raised meanwhile): the interrupt is swallowed unless the signal is held.
    def find_spec(self, name, path, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.3)
            except KeyboardInterrupt:
                print("swallowed", file=sys.stderr)
        return None

sys.meta_path.insert(0, TorchImport())
from qerl_cli.cli import guarded
assert "torch" not in sys.modules
def stage():
    import torch  # noqa: F401  (a stage imports it lazily, as qerl's do)
    print("the stage ran to its end")
try:
    guarded(stage, "eval")()
except Exception as e:  # typer.Exit
    sys.exit(getattr(e, "exit_code", 1))
"""


def test_ctrl_c_while_torch_imports_still_stops_the_stage():
    # Lost there, the stage ran on and exited 0, and a bash loop (recipes/grpo.sh) went on with it.
    import subprocess
    import sys

    from tests.reliability_fixtures import REPO, cli_env

    r = subprocess.run([sys.executable, "-c", IMPORT_INT], env=cli_env(), cwd=str(REPO), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 130 and "the stage ran" not in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "swallowed" not in r.stderr and r.stderr.strip().endswith("interrupted: --out was not written (a rerun resumes its saved problems)")


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["TERM", "INT"])
def test_a_rollout_stopped_by_a_signal_keeps_its_groups_and_resumes(sig, tmp_path):
    # SIGTERM now runs the same clean-up as Ctrl-C: finished groups kept in the partial directory, exit 143.
    p = pipeline()
    ref = reference("rollout", tmp_path)
    out = tmp_path / "out"
    r = run_cli(_args("rollout", p, out), kill_at="shard-group:2", signal=sig)
    code, word = (143, "terminated (SIGTERM)") if sig == "TERM" else (130, "interrupted")
    assert r.returncode == code and word in r.stderr and "prompt groups are saved in" in r.stderr, r.stderr[-2000:]
    assert not out.exists() and [x for x in leftovers(tmp_path, "out") if ".partial-" in x]
    rerun = invoke(_args("rollout", p, out), cli_threads=True)
    assert rerun.exit_code == 0, rerun.stderr
    assert output_hashes(out) == ref and leftovers(tmp_path, "out") == ["out"]


@pytest.mark.parametrize("sig", ["TERM", "INT"])
def test_an_eval_stopped_by_a_signal_keeps_its_problems_and_resumes(sig, tmp_path, monkeypatch):
    """Ctrl-C and SIGTERM (a Slurm pre-emption) mid-eval: exit 130 / 143, one line naming the problems kept and
    where; the rerun resumes them and equals an uninterrupted run. An eval kept nothing, and its rerun generated
    every problem again (until 2026-11-27). In-process: the signal reaches this interpreter's main thread."""
    import qerl_cli.outputs as outputs

    p = pipeline()
    ref = reference("eval", tmp_path)
    out = tmp_path / "out"
    monkeypatch.setattr(outputs, "_kill_hits", {})
    monkeypatch.setenv("QERL_TEST_KILL_AT", "eval-problem:3")
    monkeypatch.setenv("QERL_TEST_KILL_SIGNAL", sig)
    r = invoke(_args("eval", p, out), cli_threads=True)
    code, word = (143, "terminated (SIGTERM)") if sig == "TERM" else (130, "interrupted")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.exit_code == code and len(lines) == 1, (r.exit_code, r.stderr)
    assert lines[0].startswith(f"{word}: 3 of 4 problems are saved in {tmp_path}/.out.partial-") and \
        lines[0].endswith("; rerun the same command to resume"), lines
    assert not out.exists() and [x for x in leftovers(tmp_path, "out") if ".partial-" in x]
    monkeypatch.delenv("QERL_TEST_KILL_AT")
    rerun = invoke(_args("eval", p, out), cli_threads=True)
    assert rerun.exit_code == 0, rerun.stderr
    assert read_manifest(out)["resumed"]["problems"] == 3
    assert output_hashes(out, _COMPARED["eval"]) == ref and _eval_metrics(out) == _reference_metrics["eval"]
    assert leftovers(tmp_path, "out") == ["out"]


@pytest.mark.parametrize("stage, kept", [("eval", "4 of 4 problems are saved in "),
                                         ("rollout", "4 of 4 prompt groups are saved in ")])
@pytest.mark.parametrize("point", ["before-rename", "after-rename", "mid-swap"])
def test_a_stop_after_the_last_problem_says_what_is_saved_or_that_out_is_whole(stage, kept, point, tmp_path,
                                                                              monkeypatch):
    # Ctrl-C while the manifest was hashed or the output renamed: the resumable stages' own stop line said
    # "stopped before generating" with every problem (group) saved, and also once --out was whole; while a --force
    # replace deleted the old output (mid-swap), the new one in place, every stage said "--out was not written".
    import qerl_cli.outputs as outputs

    p, out = pipeline(), tmp_path / "out"  # (made before the kill point is set: it runs a train-step)
    args = _args(stage, p, out)
    if point == "mid-swap":  # another output of the stage there, which --force replaces
        assert invoke(args + ["--max-new-tokens", 3], cli_threads=True).exit_code == 0
        args.append("--force")
    monkeypatch.setattr(outputs, "_kill_hits", {})
    monkeypatch.setenv("QERL_TEST_KILL_AT", point)
    monkeypatch.setenv("QERL_TEST_KILL_SIGNAL", "INT")
    r = invoke(args, cli_threads=True)
    assert r.exit_code == 130 and "before generating" not in r.stderr, r.stderr
    if point != "before-rename":
        assert r.stderr == f"interrupted after --out was written: {out} is complete (a rerun says already done)\n"
        monkeypatch.delenv("QERL_TEST_KILL_AT")
        again = invoke(_args(stage, p, out), cli_threads=True)
        assert again.exit_code == 0 and "already done" in again.stdout + again.stderr, again.stderr
    else:
        assert r.stderr.startswith(f"interrupted: {kept}{tmp_path}/.out.partial-"), r.stderr
        assert not out.exists()


@pytest.mark.parametrize("at, said", [(1, "no prompt group was saved yet (0 of 3;"), (2, "1 of 3 prompt groups are saved in ")])
def test_a_stopped_rollouts_message_is_one_line_in_a_piped_log(at, said, tmp_path):
    # Rich wrapped the rollout's stop line at 80 columns when stderr was a file (a Slurm log), against the one-line
    # errors every stage prints (a review, 2026-11-27). It names how many groups a rerun resumes, and where: it
    # pointed at the progress bar's count, which that log did not show (a review, session 52).
    from qerl_cli.assets import tiny_model_dir, tiny_task_file

    out = tmp_path / "out"
    r = run_cli(["rollout", "--model", tiny_model_dir(), "--prompts", tiny_task_file("test"), "--out", out,
                 "--max-prompts", 3, "-G", 2, "--max-new-tokens", 4, "--batch-prompts", 1, "--device", "cpu", "-q"],
                kill_at=f"shard-group:{at}", signal="INT")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 130 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"interrupted: {said}") and (at == 1 or ".partial-" in lines[0]), lines


def test_a_stopped_rollouts_progress_in_an_80_column_log_keeps_its_count(tmp_path):
    """At 80 columns Rich shrank every progress column alike, and mid-batch a Slurm log read `rol… pro… +5
    generated, saved at the batch's end · …`: no count of saved groups, no time (a review, session 52)."""
    import re

    from qerl_cli.assets import tiny_model_dir, tiny_task_file

    r = run_cli(["rollout", "--model", tiny_model_dir(), "--prompts", tiny_task_file("test"), "--out", tmp_path / "o",
                 "--max-prompts", 3, "-G", 2, "--max-new-tokens", 4, "--batch-prompts", 1, "--device", "cpu"],
                kill_at="shard-group:2", signal="INT", COLUMNS=80)
    bar = [x for x in r.stderr.splitlines() if x.startswith("rollout")]
    assert r.returncode == 130 and bar, r.stderr
    assert re.search(r"rollout .* 1/3 prompts \d+:\d\d:\d\d \+\d+ generated", bar[-1]) and len(bar[-1]) <= 80, bar


def test_a_signal_after_merge_nvfp4s_inner_quantize_does_not_call_a_temp_dir_complete(tmp_path):
    """merge --dtype nvfp4 quantizes into its own temp dir first: a SIGTERM after that inner rename said
    "after --out was written: .OUT.tmp-.../.nvfp4 is complete (a rerun says already done)", with no --out."""
    p = pipeline()
    out = tmp_path / "out"
    r = run_cli(_args("merge", p, out) + ["--dtype", "nvfp4"], kill_at="after-rename", signal="TERM")
    assert r.returncode == 143, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == "terminated (SIGTERM): --out was not written", r.stderr[-500:]
    assert not out.exists()


START_INT = """
import importlib.abc, os, runpy, signal, sys, time

def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)  # the KeyboardInterrupt is raised here, in the frame that was running

class At(importlib.abc.MetaPathFinder):  # Ctrl-C while the CLI module imports (typer is among its imports)
    def find_spec(self, name, path, target=None):
        if name == "typer":
            sys.meta_path.remove(self)
            ctrl_c()
        return None

where = sys.argv[1]
if where == "import":
    sys.meta_path.insert(0, At())
else:
    import typer.main
    import qerl_cli.cli as cli
    if where == "commands":  # Typer building the command table
        build = typer.main.get_command
        typer.main.get_command = lambda app: (ctrl_c(), build(app))[1]
    else:  # "flags": Typer parsing the flags
        parse = cli._Group.make_context
        cli._Group.make_context = lambda *a, **k: (ctrl_c(), parse(*a, **k))[1]
sys.argv = ["qerl", "quantize", "no-such-dir", "--out", "never-written"]
runpy.run_module("qerl_cli", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("where", ["import", "commands", "flags"])
def test_ctrl_c_while_the_cli_starts_is_one_line_and_exit_130(where, tmp_path):
    """Ctrl-C in the first second of a run, before the stage begins: a KeyboardInterrupt traceback of importlib or
    Typer frames (the process killed by SIGINT), or while Typer parsed the flags an exit 130 that said nothing."""
    import subprocess
    import sys

    from qerl_cli.__main__ import STARTING_STOP
    from tests.reliability_fixtures import REPO, cli_env

    r = subprocess.run([sys.executable, "-c", START_INT, where], env=cli_env(), cwd=str(tmp_path), capture_output=True,
                       text=True, timeout=120)
    assert (r.returncode, r.stderr) == (130, STARTING_STOP + "\n"), (r.returncode, r.stderr[-2000:])
    assert not (tmp_path / "never-written").exists() and REPO.is_dir()


EXEC_INT = """
import importlib.abc, os, signal, sys

class At(importlib.abc.MetaPathFinder):  # a Ctrl-C while a class body built by exec runs, as dataclasses' do
    def find_spec(self, name, path, target=None):
        if name == "typer":
            sys.meta_path.remove(self)
            exec("import time; os.kill(os.getpid(), signal.SIGINT); time.sleep(1)")
        return None

sys.meta_path.insert(0, At())
"""


def test_ctrl_c_through_exec_code_while_the_cli_starts_under_python_m_exits_130(tmp_path):
    """Under ``python -m qerl_cli`` a Ctrl-C that passed through exec'd code (the random SIGINTs that land in a
    dataclass or namedtuple being built at import) printed the stop line, then the process killed itself by SIGINT
    (returncode -2, not 130): CPython's flag for an unhandled KeyboardInterrupt stayed set after it was caught."""
    import os
    import subprocess
    import sys

    from qerl_cli.__main__ import STARTING_STOP
    from tests.reliability_fixtures import cli_env

    (tmp_path / "sitecustomize.py").write_text(EXEC_INT)  # runs before `-m`: the signal comes where a real one would
    env = cli_env()
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
    r = subprocess.run([sys.executable, "-m", "qerl_cli", "quantize", "no-such-dir", "--out", "never-written"], env=env,
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr) == (130, STARTING_STOP + "\n"), (r.returncode, r.stderr[-2000:])
    assert not (tmp_path / "never-written").exists()
