"""torchrun with 2 ranks gives the single-process adapter (up to float order): gloo on CPU, NCCL on 2 GPUs."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from qerl_cli.train_step import TrainStepConfig, train_step
from tests.train_fixtures import base_hash_of, make_shard, quantized_tiny


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))


def _torchrun(*args: str) -> list[str]:
    """torchrun's command for 2 ranks of this machine, on a free port, running ``args``."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(_free_port()), *args]


def _ranks_run(tmp_path, body: str, timeout: int = 180) -> subprocess.CompletedProcess:
    """Run the shell ``body`` as each of 2 torchrun ranks (it reads $RANK): ranks given different flags or outputs."""
    script = tmp_path / "rank.sh"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return subprocess.run(_torchrun("--no-python", str(script)), env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _two_ranks(model, shards, out, *flags) -> list[str]:
    """torchrun's command for a train-step on 2 ranks of this machine."""
    return _torchrun("-m", "qerl_cli", "train-step", "--model", str(model), "--shards", str(shards), "--out", str(out),
                     *flags)


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.slow),  # ~60 s on 2 shared cores: two extra interpreters import torch
    pytest.param("cuda", marks=[pytest.mark.gpu, two_gpus]),  # NCCL; fp32 compute so the comparison stays tight
])
def test_two_ranks_equal_one_process(tmp_path, device):
    _, q = quantized_tiny(tmp_path)
    sh = make_shard(tmp_path / "sh", base_hash_of(q), groups=4, seed=5)
    args = dict(lr=1e-3, loss="bnpo", epochs=2, lora_rank=4, micro_batch_tokens=40)
    dev = dict(device="cpu") if device == "cpu" else dict(device="cuda:0", dtype="fp32")
    single = train_step(TrainStepConfig(model=q, shards=[str(sh)], out=tmp_path / "one", progress=False, **args, **dev))
    assert single["metrics"]["micro_batches"] >= 3  # both ranks get work, one gets more

    env = _env()
    cmd = _two_ranks(q, sh, tmp_path / "two", "--lr", "1e-3", "--loss", "bnpo", "--epochs", "2", "--lora-rank", "4",
                     "--micro-batch-tokens", "40", "--quiet")
    cmd += ["--device", "cpu"] if device == "cpu" else ["--device", "cuda", "--dtype", "fp32"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    # a rerun says "already done" once, with progress as with -q (each rank printed it; a review, 2026-11-27)
    again = [a for a in cmd if a != "--quiet"]
    again[again.index("--master-port") + 1] = str(_free_port())
    res = subprocess.run(again, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.count("already done:") == 1, res.stdout + res.stderr[-3000:]
    a, b = load_file(str(tmp_path / "one" / "adapter_model.safetensors")), load_file(str(tmp_path / "two" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    moved = 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)  # Adam moves B by ~1e-3 per step
        moved += "lora_B" in k and bool(a[k].abs().max() > 0)
    assert moved
    m2 = json.loads((tmp_path / "two" / "metrics.jsonl").read_text())
    m1 = single["metrics"]
    for key in ("loss", "loss_last_epoch", "entropy", "is_ratio_mean", "is_ratio_max", "grad_norm", "trained_tokens"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-4), key
    # The saved RNG state was rank 0's after its own last micro-batch, so trainer_state.json (and the next
    # step's fingerprint) depended on the number of ranks (audit, 2026-11-26).
    s1, s2 = (json.loads((tmp_path / d / "trainer_state.json").read_text()) for d in ("one", "two"))
    assert s1["rng"] == s2["rng"]

    # Rank 0 failing to write --out (under a file here): every rank ends with its exit code, and no rank
    # dies in gloo with a traceback (rank 1 did, exit 1, and torchrun could name it as the failure).
    (tmp_path / "afile").write_text("x")
    bad = cmd[: cmd.index("--out") + 1] + [str(tmp_path / "afile" / "o")] + cmd[cmd.index("--out") + 2 :]
    bad[bad.index("--master-port") + 1] = str(_free_port())
    res = subprocess.run(bad, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert "gloo" not in res.stderr.lower() and "connection closed" not in res.stderr.lower(), res.stderr[-3000:]
    assert "is a file, not a directory" in res.stderr and "rank 0 could not finish the step's output (exit 7); see rank 0's error" in res.stderr
    # torchrun's summary: the root cause carries exit 7 (either rank may end first, each with rank 0's code;
    # a rank torchrun SIGTERMs reads -15), and no rank exited 1
    codes = [ln.split(":")[1].split()[0] for ln in res.stderr.splitlines() if ln.strip().startswith("exitcode")]
    root = res.stderr.split("Root Cause", 1)[-1]
    assert "1" not in codes and "exitcode  : 7" in root, res.stderr[-3000:]


@pytest.mark.gpu
@two_gpus
def test_two_ranks_with_deterministic_write_the_same_bytes_twice(tmp_path):
    """torchrun, NCCL, bf16: a rerun of the step with --deterministic writes the same adapter and optimizer."""
    _, q = quantized_tiny(tmp_path)
    sh = make_shard(tmp_path / "sh", base_hash_of(q), groups=4, seed=5)
    outs = []
    for run in ("a", "b"):
        cmd = _two_ranks(q, sh, tmp_path / run, "--lr", "1e-3", "--epochs", "2", "--lora-rank", "4", "--lora-dropout",
                         "0.1", "--micro-batch-tokens", "40", "--keep-activations", "1", "--device", "cuda",
                         "--deterministic", "--quiet")
        res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        outs.append(tmp_path / run)
    assert json.loads((outs[0] / "manifest.json").read_text())["deterministic"] is True
    for f in ("adapter_model.safetensors", "optimizer.safetensors"):
        assert (outs[0] / f).read_bytes() == (outs[1] / f).read_bytes()


def test_disagreeing_ranks_are_named_with_every_value():
    from qerl_cli.train.distributed import disagreement

    same = {"lr": 1e-3, "micro_batch_tokens": 200, "lora_targets": ["q_proj"]}
    assert disagreement([same, dict(same)]) is None
    why = disagreement([same, dict(same, micro_batch_tokens=2000, lr=2e-3), dict(same)])
    assert why == "lr: rank 0 0.001, rank 1 0.002, rank 2 0.001 (and 1 more: micro_batch_tokens)"
    assert disagreement([same, {k: v for k, v in same.items() if k != "lr"}]).startswith("lr: rank 0 0.001, rank 1 None")
    # the flag is named, not the fingerprint it changes
    assert disagreement([dict(same, fingerprint="a"), dict(same, lr=2e-3, fingerprint="b")]).startswith("lr: ")


@pytest.mark.slow  # ~60 s on 2 shared cores: two extra interpreters import torch
def test_ranks_started_with_different_flags_stop_before_training(tmp_path):
    # Rank 0 with --micro-batch-tokens 200 and rank 1 with 2000 wrote a wrong adapter with exit 0, which a rerun with
    # the right flags called "already done" (the flag is not in the fingerprint; a review, 2026-11-27).
    _, q = quantized_tiny(tmp_path)
    sh = make_shard(tmp_path / "sh", base_hash_of(q), groups=4, seed=5)
    res = _ranks_run(tmp_path, f'if [ "$RANK" = 1 ]; then mb=2000; else mb=200; fi\nexec "{sys.executable}" -m qerl_cli '
                     f'train-step --model "{q}" --shards "{sh}" --out "{tmp_path / "o"}" --device cpu --quiet '
                     '--micro-batch-tokens "$mb"\n', timeout=300)
    assert res.returncode != 0 and not (tmp_path / "o").exists(), res.stderr[-3000:]
    assert res.stderr.count("error: torchrun ranks disagree: micro_batch_tokens: rank 0 200, rank 1 2000") == 2, \
        res.stderr[-3000:]


@pytest.mark.slow  # ~30 s on 2 shared cores
def test_a_rank_whose_output_is_done_does_not_leave_the_other_waiting(tmp_path):
    # With --lr differing, rank 0 found its output "already done" and exited before joining, and rank 1 waited at
    # the process group until its timeout (a review, 2026-11-27). Ranks now join first and compare their flags.
    _, q = quantized_tiny(tmp_path)
    sh = make_shard(tmp_path / "sh", base_hash_of(q), groups=4, seed=5)
    out = tmp_path / "o"
    train_step(TrainStepConfig(model=q, shards=[str(sh)], out=out, progress=False, lr=1e-3, device="cpu"))
    res = _ranks_run(tmp_path, f'if [ "$RANK" = 1 ]; then lr=2e-3; else lr=1e-3; fi\nexec "{sys.executable}" -m qerl_cli '
                     f'train-step --model "{q}" --shards "{sh}" --out "{out}" --device cpu --quiet --lr "$lr"\n')
    assert res.returncode != 0, res.stderr[-3000:]
    assert res.stderr.count("error: torchrun ranks disagree: lr: rank 0 0.001, rank 1 0.002") == 2, res.stderr[-3000:]


@pytest.mark.slow  # ~30 s on 2 shared cores
def test_a_rank_that_fails_mid_step_is_torchruns_root_cause(tmp_path):
    # Rank 1 out of memory in its micro-batch (rank 0, which owns the longest one, is the usual case on a GPU):
    # rank 0 died in gloo's all-reduce with "Connection closed by peer", a traceback and exit 1, usually first, so
    # torchrun named it as the root cause and rank 1's exit 6 read -15 (a review, 2026-11-27).
    _, q = quantized_tiny(tmp_path)
    sh = make_shard(tmp_path / "sh", base_hash_of(q), groups=4, seed=5)
    prog = tmp_path / "rank.py"
    prog.write_text("import os, sys, torch\nimport qerl_cli.train_step as ts\nfrom qerl_cli.cli import main\n"
                    "if os.environ['RANK'] == '1':\n"
                    "    def oom(*a, **k):\n        raise torch.OutOfMemoryError('CUDA out of memory (simulated)')\n"
                    "    ts._one_microbatch = oom\n"
                    "sys.argv = ['qerl'] + sys.argv[1:]\nmain()\n")
    out = tmp_path / "o"
    cmd = _torchrun(str(prog), "train-step", "--model", str(q), "--shards", str(sh), "--out", str(out), "--device", "cpu",
                    "--micro-batch-tokens", "40", "--quiet")
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and not out.exists(), res.stderr[-3000:]
    assert "error: out of GPU memory in a training micro-batch" in res.stderr
    assert "gloo" not in res.stderr.lower() and "]: Traceback" not in res.stderr, res.stderr[-3000:]  # no rank's traceback
    root = res.stderr.split("Root Cause", 1)[-1]
    assert "rank      : 1" in root and "exitcode  : 6" in root, res.stderr[-3000:]


def test_world_size_without_torchrun_is_one_line_and_a_waiting_rank_stops_on_sigterm(tmp_path):
    # WORLD_SIZE set by hand: a KeyError/ValueError traceback (exit 1) without RANK or MASTER_ADDR; with them and no
    # other rank, the wait to join ignored SIGTERM and Ctrl-C for 30 minutes (a review, 2026-11-27).
    import signal
    import time

    (tmp_path / "m").mkdir()
    (tmp_path / "s").mkdir()
    cmd = [sys.executable, "-m", "qerl_cli", "train-step", "--model", str(tmp_path / "m"), "--shards", str(tmp_path / "s"),
           "--out", str(tmp_path / "o"), "--device", "cpu", "--quiet"]
    base = {k: v for k, v in _env().items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    for extra, missing in (({"WORLD_SIZE": "2"}, "RANK is not set"), ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR"),
                           ({"WORLD_SIZE": "two"}, "WORLD_SIZE is 'two'")):
        res = subprocess.run(cmd, env=dict(base, **extra), capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and missing in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
    env = dict(base, WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(8)  # imports done, waiting for rank 1
        assert p.poll() is None
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) != 0
    finally:
        p.kill()
        p.wait()
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # ~20 s on 2 shared cores
def test_a_rank_whose_node_local_out_is_done_is_named(tmp_path):
    # --out on node-local disks, done on rank 1's node only: rank 1 returned "already done" (exit 0, silent) and rank 0
    # said "another torchrun rank stopped mid-step (its error is in the log)" with no error in the log (a review).
    _, q = quantized_tiny(tmp_path)
    sh = make_shard(tmp_path / "sh", base_hash_of(q), groups=4, seed=5)
    train_step(TrainStepConfig(model=q, shards=[str(sh)], out=tmp_path / "o1", progress=False, device="cpu"))
    res = _ranks_run(tmp_path, f'exec "{sys.executable}" -m qerl_cli train-step --model "{q}" --shards "{sh}" '
                     f'--out "{tmp_path}/o$RANK" --device cpu --quiet\n')
    assert res.returncode != 0 and not (tmp_path / "o0").exists(), res.stderr[-3000:]
    assert res.stderr.count("error: torchrun ranks disagree: already_done: rank 0 False, rank 1 True") == 2, \
        res.stderr[-3000:]
