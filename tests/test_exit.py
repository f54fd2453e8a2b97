"""How a stage's process ends (``qerl_cli.__main__.exit_now``): once its output is flushed and the atexit handlers
have run, without the interpreter's teardown of torch and transformers (0.5-2 s of garbage collections and C++
destructors after the result line on a busy 2-core node, every stage of a RL loop; a SIGTERM then killed the
finished stage, exit 143, without a word). Where that could skip work, Python's own exit is kept.

No timing is asserted: whether the teardown ran is seen by an object whose ``__del__`` only the teardown calls."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from qerl_cli.outputs import read_manifest
from tests.reliability_fixtures import REPO, cli_env, output_hashes, pipeline

# Runs the CLI as ``python -m qerl_cli`` does, with an object that only the interpreter's teardown deletes and an
# atexit handler; argv[1] names a stand-in for cli.main (or "real"), the rest are the CLI's arguments.
RUN = r"""
import atexit, os, runpy, signal, sys, threading, time

class Teardown:
    def __del__(self, write=os.write):
        write(2, b"<teardown ran>\n")

kept = Teardown()
atexit.register(lambda: os.write(2, b"<atexit ran>\n"))

def thread_still_running():
    path = sys.argv[1]

    def late():
        time.sleep(1.0)
        with open(path, "w") as f:
            f.write("written by a thread at the end")
    threading.Thread(target=late).start()
    sys.exit(3)

def signal_while_exiting():
    def term_then_wait():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
    atexit.register(term_then_wait)
    sys.exit(0)

def unflushable_stdout():
    print("a result line that cannot be written")  # stdout is /dev/full: block-buffered until the exit

def ignored_signal_while_exiting():
    atexit.register(os.kill, os.getpid(), signal.SIGINT)  # the first handler to run: a Ctrl-C meanwhile
    sys.exit(0)

def c_stdio_line():
    import ctypes
    ctypes.CDLL(None).puts(b"a line a C library wrote")  # C's stdout on a pipe: block-buffered until exit()
    sys.exit(0)

def monitoring_profiler():
    class Monitoring:  # Python 3.12+'s cProfile is a sys.monitoring tool, which sys.getprofile() does not show
        @staticmethod
        def get_tool(tool_id):
            return "cProfile" if tool_id == 2 else None
    sys.monitoring = Monitoring
    sys.exit(0)

how = sys.argv.pop(1)
if how != "real":
    import qerl_cli.cli
    qerl_cli.cli.main = globals()[how]
sys.argv = ["qerl", *sys.argv[1:]]
try:
    runpy.run_module("qerl_cli", run_name="__main__", alter_sys=True)
finally:
    os.write(2, b"<returned>\n")  # what a profiler or tracer running the CLI does next (cProfile writes its file)
"""


def _run(how: str, *args, stdout=subprocess.PIPE, timeout=300, buffered=False, preexec_fn=None,
         **env) -> subprocess.CompletedProcess:
    env = cli_env(**env)
    if buffered:  # stdout block-buffered, as Python has it on a file or pipe unless PYTHONUNBUFFERED is set
        env.pop("PYTHONUNBUFFERED", None)
    return subprocess.run([sys.executable, "-c", RUN, how, *map(str, args)], env=env, cwd=str(REPO),
                          stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=timeout, preexec_fn=preexec_fn)


def _stage_args(stage: str, p: dict, out) -> list:
    return {
        "quantize": ["quantize", p["src"], "--out", out, "--device", "cpu", "--no-progress"],
        "merge": ["merge", "--model", p["q"], "--adapter", p["a1"], "--out", out, "-q"],
        "eval": ["eval", "--model", p["q"], "--adapter", p["a1"], "--dataset", p["prompts"], "--out", out,
                 "--max-new-tokens", 4, "--device", "cpu", "-q"],
        "train-step": ["train-step", "--model", p["q"], "--shards", p["sh0"], "--out", out, "--device", "cpu", "-q"],
    }[stage]


@pytest.mark.parametrize("stage", ["quantize", "merge",
                                   pytest.param("eval", marks=pytest.mark.slow),
                                   pytest.param("train-step", marks=pytest.mark.slow)])
def test_a_finished_stage_exits_without_the_interpreters_teardown(stage, tmp_path):
    """The stage's result and output are whole, its atexit handlers ran, its exit status is kept; the teardown
    (which a Python thread or pool left running would have forced: Python joins it) did not run."""
    p = pipeline()
    out = tmp_path / "out"
    r = _run("real", *_stage_args(stage, p, out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "<atexit ran>" in r.stderr and "<teardown ran>" not in r.stderr, r.stderr[-2000:]
    m = read_manifest(out)
    assert m is not None and m["outputs"] == output_hashes(out)


def test_a_refused_stage_keeps_its_exit_code_without_the_teardown(tmp_path):
    r = _run("real", "quantize", tmp_path / "no-such-dir", "--out", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.startswith("error: "), r.stderr[-2000:]
    assert "<atexit ran>" in r.stderr and "<teardown ran>" not in r.stderr


def test_a_thread_still_running_at_the_end_is_waited_for(tmp_path):
    """A non-daemon thread (a library's writer) finishes first, as Python's own exit waits for it."""
    late = tmp_path / "late.txt"
    r = _run("thread_still_running", late, timeout=120)
    assert r.returncode == 3, r.stderr[-2000:]
    assert late.read_text() == "written by a thread at the end"
    assert "<teardown ran>" in r.stderr


def test_a_signal_while_exiting_ends_the_process_with_the_stages_status():
    """A SIGTERM after the result (an atexit handler running) exits with the stage's status: it killed the
    finished stage (-15) before."""
    r = _run("signal_while_exiting", timeout=50)
    assert r.returncode == 0, r.stderr[-2000:]


def test_an_output_that_cannot_be_flushed_still_exits_120():
    """stdout on a full disk: Python says so and exits 120; a fast exit must not turn that into 0."""
    with open("/dev/full", "w") as full:
        r = _run("unflushable_stdout", stdout=full, timeout=120, buffered=True)
    assert r.returncode == 120 and "No space left on device" in r.stderr, r.stderr[-2000:]


def test_qerl_full_exit_keeps_pythons_own_exit(tmp_path):
    r = _run("real", "quantize", tmp_path / "no-such-dir", "--out", tmp_path / "out", QERL_FULL_EXIT=1)
    assert r.returncode == 2 and "<atexit ran>" in r.stderr and "<teardown ran>" in r.stderr, r.stderr[-2000:]


def test_a_signal_its_starter_ignores_stays_ignored_while_exiting():
    """Started with SIGINT ignored (a shell script's `qerl ... &`), a Ctrl-C during the atexit handlers ended the
    process there (the rest of them, temporary directories' removal among them, never ran)."""
    r = _run("ignored_signal_while_exiting", timeout=120,
             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert r.returncode == 0 and "<atexit ran>" in r.stderr, r.stderr[-2000:]


def test_what_a_c_library_wrote_to_stdout_is_kept():
    """C's stdio buffers are flushed by exit(), not by os._exit: the last block of what a C library printed
    (NCCL_DEBUG's lines go to C's stdout) was lost from a piped log."""
    r = _run("c_stdio_line", timeout=120, buffered=True)  # PYTHONUNBUFFERED=1 unbuffers C's stdio too
    assert r.returncode == 0 and "a line a C library wrote" in r.stdout, (r.stdout[-2000:], r.stderr[-2000:])
    assert "<teardown ran>" not in r.stderr


def test_a_profiler_on_sys_monitoring_keeps_pythons_own_exit():
    """From Python 3.12 cProfile (and coverage's sysmon core) is a sys.monitoring tool, not sys.getprofile():
    the fast exit ended `python -m cProfile -o x.prof -m qerl_cli ...` before cProfile wrote its file."""
    r = _run("monitoring_profiler", timeout=120)
    assert r.returncode == 0 and "<returned>" in r.stderr and "<teardown ran>" in r.stderr, r.stderr[-2000:]


def test_cprofile_writes_its_profile(tmp_path):
    """The real case of the test above (it fails without the check on Python 3.12+ only): cProfile swallows the
    SystemExit, so its file, not the exit code, is what tells."""
    prof = tmp_path / "stage.prof"
    r = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "qerl_cli", "quantize",
                        str(tmp_path / "no-such-dir"), "--out", str(tmp_path / "out")], env=cli_env(), cwd=str(REPO),
                       capture_output=True, text=True, timeout=300)
    assert "error: " in r.stderr and prof.is_file() and prof.stat().st_size > 0, r.stderr[-2000:]
