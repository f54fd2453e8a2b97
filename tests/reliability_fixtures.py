"""A tiny end-to-end pipeline built once per test process, for the reliability tests.

``pipeline()`` returns read-only inputs for every stage: a tiny HF model (``src``), its NVFP4
QDIR (``q``), a prompt/benchmark file with answers, a hand-made shard dir sampled from ``q``, a
trained adapter (``a1``, nonzero B) and a copy of ``q`` whose hash differs (``q_other``: another
base for lineage checks). Built with the library calls in ~15 s and cached for the process:
tests must copy what they modify (``copy_tree``).

``run_cli`` runs ``python -m qerl_cli ...`` in a subprocess (kill tests); ``invoke`` runs the
Typer app in-process (bad-input tests: no interpreter start-up per case).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ANSWERED_ROWS = [
    {"id": "p0", "prompt": "Natalia sold 48 clips. How many?", "answer": "48"},
    {"id": "p1", "prompt": "Weng earns $12 an hour. What is 1 + 2?", "answer": "3"},
    {"id": "p2", "prompt": "What is 3 * 4?", "answer": "12"},
    {"id": "p3", "prompt": "What is 100 / 4?", "answer": "25"},
]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@functools.cache
def pipeline() -> dict:
    sys.path.insert(0, str(REPO))
    from qerl_cli.hashing import model_hash
    from qerl_cli.train_step import TrainStepConfig, train_step
    from tests.train_fixtures import make_shard, quantized_tiny

    root = Path(tempfile.mkdtemp(prefix="qerl-reliability-"))
    atexit.register(shutil.rmtree, root, True)
    src, q = quantized_tiny(root)
    qhash = model_hash(q)
    prompts = write_jsonl(root / "prompts.jsonl", ANSWERED_ROWS)
    sh0 = make_shard(root / "sh0", qhash)
    a1 = root / "a1"
    train_step(TrainStepConfig(model=q, shards=[str(sh0)], out=a1, device="cpu", lr=1e-2, max_grad_norm=0.0,
                               progress=False))
    q_other = copy_tree(q, root / "q_other")
    cfg = json.loads((q_other / "config.json").read_text())
    cfg["qerl_test_note"] = "same weights, different bytes: another base hash"
    (q_other / "config.json").write_text(json.dumps(cfg, indent=2))
    (q_other / "manifest.json").unlink(missing_ok=True)
    return {"root": root, "src": src, "q": q, "qhash": qhash, "prompts": prompts, "sh0": sh0, "a1": a1,
            "q_other": q_other, "q_other_hash": model_hash(q_other)}


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def cli_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QERL_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), CUDA_VISIBLE_DEVICES="")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_cli(args, *, kill_at: str | None = None, signal: str | None = None,
            timeout: float = 300, **env) -> subprocess.CompletedProcess:
    """``python -m qerl_cli *args`` in a fresh interpreter; ``kill_at`` sets QERL_TEST_KILL_AT
    (and ``signal`` QERL_TEST_KILL_SIGNAL, default KILL); ``env``: more environment variables."""
    extra = dict(env, QERL_TEST_KILL_AT=kill_at) if kill_at else dict(env)
    if signal:
        extra["QERL_TEST_KILL_SIGNAL"] = signal
    env = cli_env(**extra)
    return subprocess.run([sys.executable, "-m", "qerl_cli", *map(str, args)], env=env, cwd=str(REPO),
                          capture_output=True, text=True, timeout=timeout)


def invoke(args, *, cli_threads: bool = False):
    """Run the Typer app in-process; returns Click's Result (exit_code, stdout, stderr, exception).
    ``cli_threads``: with torch on one thread, as ``run_cli``'s interpreters run (OMP_NUM_THREADS=1), for
    outputs that must match a subprocess's bytes: CPU matmuls sum in another order on another thread
    count, so a rollout's log-probabilities differ in their last bits (the test suite runs on two)."""
    import torch
    from typer.testing import CliRunner

    from qerl_cli.cli import app

    threads = torch.get_num_threads()
    if cli_threads:
        torch.set_num_threads(1)
    try:
        return CliRunner().invoke(app, [str(a) for a in args])
    finally:
        torch.set_num_threads(threads)


def assert_one_line_error(result, code: int, *needles: str) -> str:
    """Exit ``code``, exactly one non-empty stderr line starting 'error:' (no traceback), naming ``needles``."""
    stderr = result.stderr
    got = result.exit_code if hasattr(result, "exit_code") else result.returncode
    assert got == code, (got, stderr, getattr(result, "exception", None))
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr and "Traceback" not in (result.stdout or "")
    for n in needles:
        assert n in lines[0], (n, lines[0])
    log = os.environ.get("QERL_RELIABILITY_LOG")  # collects observed outcomes for docs/reliability.md
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0], "exit": got,
                                "stderr": lines[0]}) + "\n")
    return lines[0]


def leftovers(parent: Path, name: str) -> list[str]:
    """Entries of ``parent`` that belong to output ``name`` (the output itself and any temp dirs)."""
    return sorted(p.name for p in Path(parent).iterdir() if p.name == name or p.name.startswith(f".{name}."))


def output_hashes(out: Path, names=None) -> dict:
    """{relative file: sha256} of a finished output, from a fresh hash of its files (not the manifest)."""
    from qerl_cli.hashing import sha256_file

    files = sorted(p for p in Path(out).rglob("*") if p.is_file() and p.name != "manifest.json")
    d = {str(p.relative_to(out)): sha256_file(p) for p in files}
    return {k: v for k, v in d.items() if names is None or k in names}
