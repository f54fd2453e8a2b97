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


# ---- every loss, uneven splits, failures on one rank, memory (a review, session 53) -------------------------------
_CASES = [  # 7, 7, 5, 7 and 1 micro-batches over 2 ranks: odd counts, and in the last rank 1 owns none
    dict(loss="grpo", micro_batch_tokens=40, epochs=2),
    dict(loss="dapo", micro_batch_tokens=40, mask_truncated=True, beta=0.04),
    dict(loss="dr_grpo", micro_batch_tokens=60, lora_dropout=0.1, epochs=2),
    dict(loss="bnpo", micro_batch_tokens=40, scale_rewards="batch"),
    dict(loss="dapo", micro_batch_tokens=100000),
]


def _uneven_shards(out, base: str, vocab: int = 384):
    """Groups of 2, 3, 5 and 4 completions with prompts and completions of many lengths, in two files."""
    import random

    from qerl_cli.shards import make_record, shard_name, write_records

    rnd = random.Random(7)
    files: list[list[dict]] = [[], []]
    for g, size in enumerate((2, 3, 5, 4)):
        prompt = [rnd.randrange(3, vocab) for _ in range(rnd.randint(2, 12))]
        for i in range(size):
            comp = [rnd.randrange(3, vocab) for _ in range(rnd.randint(1, 17))]
            reward = float(rnd.choice([0.0, 0.5, 1.0]))
            files[g % 2].append(make_record(
                prompt_id=f"p{g}", group_id=f"g{g}", prompt="x", prompt_token_ids=prompt, completion_token_ids=comp,
                completion="y", logprobs=[-5.9 + rnd.uniform(-1.5, 1.5) for _ in comp],
                finish_reason="length" if i == 0 else "stop", rewards={"r": reward}, reward=reward, answer=None,
                step=0, policy={"base": base, "adapter": None},
                sampling={"temperature": 0.8, "top_p": 1.0, "top_k": 0, "seed": 0, "max_new_tokens": 17},
                noise={"sigma": 0.0, "seed": 0, "step": 0, "norms": []}, engine="test"))
    out.mkdir(parents=True, exist_ok=True)
    for i, recs in enumerate(files):
        write_records(out / shard_name(i, 2), recs)
    return out


@pytest.mark.slow  # ~90 s on 2 shared cores: one torchrun launch runs the five steps in one process group
def test_two_ranks_equal_one_process_for_every_loss_and_uneven_split(tmp_path):
    _, q = quantized_tiny(tmp_path)
    sh = _uneven_shards(tmp_path / "sh", base_hash_of(q))
    common = dict(device="cpu", lr=1e-3, lora_rank=4, progress=False)
    for i, case in enumerate(_CASES):
        train_step(TrainStepConfig(model=q, shards=[str(sh)], out=tmp_path / "one" / f"c{i}", **common, **case))
    prog = tmp_path / "ranks.py"  # train_step joins the process group it finds, so one launch runs every case
    prog.write_text("import sys\nfrom pathlib import Path\nimport torch.distributed as dist\n"
                    "from qerl_cli.train_step import TrainStepConfig, train_step\n"
                    "from tests.test_train_distributed import _CASES\n"
                    "dist.init_process_group('gloo')\n"
                    "for i, case in enumerate(_CASES):\n"
                    f"    train_step(TrainStepConfig(model=Path({str(q)!r}), shards=[{str(sh)!r}], "
                    f"out=Path({str(tmp_path / 'two')!r}) / f'c{{i}}', **{common!r}, **case))\n"
                    "dist.destroy_process_group()\n")
    res = subprocess.run(_torchrun(str(prog)), env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    for i, case in enumerate(_CASES):
        one, two = tmp_path / "one" / f"c{i}", tmp_path / "two" / f"c{i}"
        for f in ("adapter_model.safetensors", "optimizer.safetensors"):  # LoRA tensors, AdamW moments
            a, b = load_file(str(one / f)), load_file(str(two / f))
            assert a.keys() == b.keys()
            for k in a:  # float summation order only; a single micro-batch (rank 1 idle) is bit for bit
                if case["micro_batch_tokens"] == 100000:
                    assert torch.equal(a[k], b[k]), (case, k)
                torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=f"{case} {k}")
        s1, s2 = (json.loads((d / "trainer_state.json").read_text()) for d in (one, two))
        assert s1 == s2, case
        m1, m2 = (json.loads((d / "metrics.jsonl").read_text()) for d in (one, two))
        assert m1.keys() == m2.keys(), case
        for k, v in m1.items():  # over ALL records: rank 0's part would differ in counts, rewards and lengths
            if k.endswith(("time_s", "per_s")):
                continue
            assert m2[k] == (pytest.approx(v, rel=1e-4) if v is not None else None), (case, k)


@pytest.mark.slow  # ~90 s on 2 shared cores: two torchrun launches
def test_a_bad_shard_or_a_nan_on_one_rank_stops_every_rank_with_its_code(tmp_path):
    import shutil

    _, q = quantized_tiny(tmp_path)
    sh = make_shard(tmp_path / "sh", base_hash_of(q), groups=4, seed=5)
    bad = tmp_path / "bad"  # rank 1's node-local copy of the shards, torn at its end
    shutil.copytree(sh, bad)
    f = next(bad.glob("*.jsonl"))
    f.write_text(f.read_text() + "{torn")
    prog = tmp_path / "nan.py"
    prog.write_text("import os, sys\nimport qerl_cli.train_step as ts\nfrom qerl_cli.cli import main\n"
                    "if os.environ['RANK'] == '1':\n    real = ts.policy_loss\n"
                    "    def nan(*a, **k):\n        loss, x, st = real(*a, **k)\n        return loss * float('nan'), x, st\n"
                    "    ts.policy_loss = nan\nsys.argv = ['qerl'] + sys.argv[1:]\nmain()\n")
    flags = f'--model "{q}" --out "{tmp_path / "o"}" --device cpu --quiet --micro-batch-tokens 40'
    for body, code, says in (
            (f'if [ "$RANK" = 1 ]; then s="{bad}"; else s="{sh}"; fi\n'
             f'exec "{sys.executable}" -m qerl_cli train-step --shards "$s" {flags}\n', 2, f"error: {f}:"),
            (f'exec "{sys.executable}" "{prog}" train-step --shards "{sh}" {flags}\n', 5, "error: non-finite loss")):
        res = _ranks_run(tmp_path, body, timeout=300)
        assert res.returncode != 0 and not (tmp_path / "o").exists(), res.stderr[-3000:]
        assert says in res.stderr and "]: Traceback" not in res.stderr, res.stderr[-3000:]
        root = res.stderr.split("Root Cause", 1)[-1]
        assert f"exitcode  : {code}" in root, res.stderr[-3000:]
        codes = {ln.split(":")[1].split()[0] for ln in res.stderr.splitlines() if ln.strip().startswith("exitcode")}
        assert codes <= {str(code), "143", "-15"}, res.stderr[-3000:]  # the other rank: its code, or torchrun's stop


def test_read_step_holds_the_token_arrays_compactly(tmp_path):
    # Every rank parses the whole step: as JSON lists (a Python object per token and per log-prob) 512 x 16
    # completions of 1024 tokens held ~800 MiB per rank; packed as they stream in, ~136 MiB (a review).
    import random
    import tracemalloc

    from qerl_cli.shards import make_record, shard_name, write_records
    from qerl_cli.train_step import read_step

    rnd, recs = random.Random(0), []
    for g in range(8):
        prompt = [rnd.randrange(3, 150000) for _ in range(64)]
        for _ in range(4):
            comp = [rnd.randrange(3, 150000) for _ in range(1024)]
            recs.append(make_record(
                prompt_id=f"p{g}", group_id=f"g{g}", prompt="x", prompt_token_ids=prompt, completion_token_ids=comp,
                completion="y", logprobs=[-rnd.random() for _ in comp], finish_reason="stop", rewards={"r": 1.0},
                reward=float(rnd.random()), answer=None, step=0, policy={"base": "0" * 64, "adapter": None},
                sampling={"temperature": 1.0}, noise={"sigma": 0.0, "seed": 0}, engine="test"))
    (tmp_path / "sh").mkdir()
    write_records(tmp_path / "sh" / shard_name(0, 1), recs)
    tokens = sum(len(r["prompt_token_ids"]) + 2 * len(r["completion_token_ids"]) for r in recs)
    cfg = TrainStepConfig(model=tmp_path, shards=[str(tmp_path / "sh")], out=tmp_path / "o", progress=False)
    tracemalloc.start()
    try:
        data = read_step(cfg)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * tokens and held < 16 * tokens, (held, peak, tokens)  # lists: ~36 bytes an entry, arrays ~8
    assert data.completions[3].tolist() == recs[3]["completion_token_ids"]
    assert list(data.sampling_logprobs[5]) == recs[5]["logprobs"]  # the same float64 values
    assert data.prompt_lengths[0] == 64 and data.completion_lengths == [1024] * len(recs)


def test_a_rank_keeps_only_the_token_arrays_of_its_own_micro_batches(tmp_path):
    from qerl_cli.train.batching import pack_microbatches
    from qerl_cli.train.distributed import Dist
    from qerl_cli.train_step import _keep_owned, read_step

    sh = _uneven_shards(tmp_path / "sh", "0" * 64)
    data = read_step(TrainStepConfig(model=tmp_path, shards=[str(sh)], out=tmp_path / "o", progress=False))
    full = [list(c) for c in data.completions]
    groups = pack_microbatches([p + c for p, c in zip(data.prompt_lengths, data.completion_lengths)], 40)
    assert len(groups) % 2  # uneven
    _keep_owned(data, groups, Dist(rank=1, world_size=2))
    for j, g in enumerate(groups):
        for s in g:
            kept = (data.prompts[s], data.completions[s], data.sampling_logprobs[s])
            assert all(x is None for x in kept) if j % 2 == 0 else list(kept[1]) == full[s]
    assert data.completion_lengths == [len(c) for c in full]  # the metrics' lengths stay whole


def test_notes_and_warnings_the_ranks_share_are_said_once(monkeypatch, capsys):
    # Each rank printed the step's notes and warnings (--embeddings-on-cpu "no effect on cpu", "shards are from
    # rollout step 3 but the adapter is at step 1"): 8 GPUs, each line 8 times (a review, session 55). A rank's own
    # note (--keep-activations auto names the rank) still comes from every rank.
    import warnings

    from qerl_cli.errors import QerlWarning
    from qerl_cli.train_step import _say, _warn

    cfg = TrainStepConfig(model="m", shards=["s"], out="o")
    for rank, says in (("0", True), ("1", False)):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _warn("shared warning")
        _say(cfg, "shared note")
        _say(cfg, f"rank {rank}: own note", every_rank=True)
        err = capsys.readouterr().err
        assert [issubclass(w.category, QerlWarning) for w in caught] == ([True] if says else [])
        assert ("shared note" in err) == says and f"rank {rank}: own note" in err


def test_a_rank_whose_own_shards_read_otherwise_says_why_when_the_ranks_disagree(tmp_path, monkeypatch):
    # Node-local --shards: rank 1's copy had a bad line (--skip-bad-lines skipped it), so its fingerprint was not rank
    # 0's. Once only rank 0 gave the step's warnings, rank 1's "skipped 1 bad shard line(s)" was lost and the ranks
    # said only "torchrun ranks disagree: fingerprint: rank 0 '...', rank 1 '...'" (review s55r12).
    import time
    import warnings

    from qerl_cli.errors import BadInputError, QerlWarning
    from qerl_cli.train_step import _joined_step

    _, q = quantized_tiny(tmp_path)
    shard = make_shard(tmp_path / "sh", base_hash_of(q))
    f = next(shard.glob("shard-*.jsonl"))
    f.write_text(f.read_text() + "garbage line\n")

    class Rank1:  # the step's first comparison of the ranks fails, as it does for two different shard copies
        is_main, enabled = False, True

        def agree(self, settings):
            raise BadInputError("torchrun ranks disagree: fingerprint: rank 0 'a', rank 1 'b'")

        def all_gather_object(self, obj):  # rank 0's copy holds other bytes: this rank reads its own whole
            return [None, obj]

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    cfg = TrainStepConfig(model=str(q), shards=[str(shard)], out=str(tmp_path / "out"), skip_bad_lines=True,
                          device="cpu", progress=False)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(BadInputError, match="ranks disagree"):
        warnings.simplefilter("always")
        _joined_step(cfg, Rank1(), "cpu", torch.float32, time.time())
    said = [str(w.message) for w in caught if issubclass(w.category, QerlWarning)]
    assert len(said) == 1 and said[0].startswith("skipped 1 bad shard line(s) (--skip-bad-lines)"), said


# ---- ranks read a part each (s59r04) ---------------------------------------------------------------------------
class _ThreadRank:
    """Rank ``rank`` of ``world`` simulated by a thread: ``all_gather_object`` meets the other threads' at a barrier."""

    def __init__(self, rank: int, world: int, meet: dict):
        from qerl_cli.train.distributed import Dist

        self.d, self.meet = Dist(rank=rank, world_size=world), meet
        self.rank, self.world_size, self.enabled, self.owns = rank, world, True, self.d.owns

    def all_gather_object(self, obj) -> list:
        self.meet["slots"][self.rank] = obj
        self.meet["barrier"].wait()
        every = list(self.meet["slots"])
        self.meet["barrier"].wait()  # every rank has its copy before one writes the next exchange's
        return every


def _as_ranks(world: int, work) -> list:
    """``work(rank)`` of each simulated rank, run together; what each returned or raised."""
    import threading

    meet = {"slots": [None] * world, "barrier": threading.Barrier(world, timeout=60)}
    got: list = [None] * world

    def run(r):
        try:
            got[r] = work(_ThreadRank(r, world, meet))
        except Exception as e:  # noqa: BLE001 - compared by the test
            got[r] = e

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def _awkward_shards(out, base: str = "0" * 64):
    """Three files of very different sizes: groups of 1 to 7 completions of 0 to 300 tokens, ids past int32 in one
    record, blank lines, a bad line (and a torn last line) for --skip-bad-lines, a file of one line."""
    import random

    from qerl_cli.shards import make_record, shard_name, write_records

    rnd = random.Random(11)
    files: list[list[dict]] = [[], [], []]
    for g, (size, k) in enumerate([(3, 0), (7, 0), (1, 1), (5, 2), (2, 2), (6, 2), (4, 0), (2, 2)]):
        prompt = [rnd.randrange(3, 384) for _ in range(rnd.randint(1, 40))]
        for i in range(size):
            comp = [rnd.randrange(3, 384) for _ in range(rnd.choice([0, 1, 5, 60, 300]))]
            if g == 3 and i == 1:
                comp[:1] = [2**40]  # int64 arrays
            files[k].append(make_record(
                prompt_id=f"p{g}", group_id=f"g{g}", prompt="x" * rnd.randint(0, 500), prompt_token_ids=prompt,
                completion_token_ids=comp, completion="y", logprobs=[-rnd.random() for _ in comp],
                finish_reason=rnd.choice(["stop", "length"]), rewards={"r": 1.0}, reward=float(rnd.random()),
                answer=None, step=0, policy={"base": base, "adapter": None},
                sampling={"temperature": rnd.choice([0.0, 0.7, 1.0]), "top_p": rnd.choice([1.0, 0.9]), "top_k": 0},
                noise={"sigma": 0.0, "seed": 0}, engine="test"))
    out.mkdir(parents=True, exist_ok=True)
    for i, recs in enumerate(files):
        write_records(out / shard_name(i, 3), recs)
    f0 = out / shard_name(0, 3)
    lines = f0.read_text().splitlines(keepends=True)
    f0.write_text("".join(lines[:4]) + "\n  \n" + "not json\n" + "".join(lines[4:]) + '{"torn": ')
    return out


def _read_as_ranks(cfg, world: int, mbt: int, monkeypatch=None):
    """Each simulated rank's (StepData after ``_keep_owned``, micro-batches, lines it parsed) or its error."""
    import threading
    from collections import Counter

    import qerl_cli.shards as shards
    from qerl_cli.train.batching import pack_microbatches
    from qerl_cli.train_step import _keep_owned, read_step

    parsed: Counter = Counter()
    if monkeypatch is not None:
        real = shards.parse_line

        def counted(*a):
            parsed[threading.current_thread().name] += 1
            return real(*a)

        monkeypatch.setattr(shards, "parse_line", counted)

    def work(rank):
        data = read_step(cfg, rank)
        groups = pack_microbatches([p + c for p, c in zip(data.prompt_lengths, data.completion_lengths)], mbt)
        _keep_owned(data, groups, rank)
        return data, groups

    got = _as_ranks(world, work)
    return [g if isinstance(g, Exception) else (*g, parsed[f"rank{r}"]) for r, g in enumerate(got)]


_STEP_FIELDS = ("records", "files", "temperatures", "truncated", "rewards", "group_ids", "base_hash", "adapter_hash",
                "step", "noise", "bad_lines", "cuts", "files_as_named", "origins", "prompt_lengths",
                "completion_lengths", "id_ranges")


@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_ranks_reading_a_part_each_hold_what_a_whole_read_kept_for_them(tmp_path, monkeypatch, world):
    # Every rank parsed every line of the step, N times the parsing for N ranks, to keep its 1/N (s59r04). Now each
    # parses a byte-balanced run of the lines plus its own records; what it holds must be what the whole read
    # kept for it, bit for bit: the same records in the same order (so the same micro-batches and owners), the
    # same bad lines skipped, and the token arrays of its micro-batches, of the same type.
    from qerl_cli.train.batching import pack_microbatches
    from qerl_cli.train.distributed import Dist
    from qerl_cli.train_step import _keep_owned, read_step

    sh = _awkward_shards(tmp_path / "sh")
    cfg = TrainStepConfig(model=tmp_path, shards=[str(sh)], out=tmp_path / "o", progress=False, skip_bad_lines=True)
    whole = read_step(cfg)
    assert len(whole.bad_lines) == 2 and len(whole.records) == 30
    lines = sum(len(f.read_text().splitlines()) for f in sh.glob("*.jsonl"))
    for mbt in (300, 2000):
        groups = pack_microbatches([p + c for p, c in zip(whole.prompt_lengths, whole.completion_lengths)], mbt)
        assert len(groups) > world or mbt == 2000
        for r, got in enumerate(_read_as_ranks(cfg, world, mbt, monkeypatch)):
            assert not isinstance(got, Exception), got
            data, got_groups, parsed = got
            assert got_groups == groups
            old = read_step(cfg)
            _keep_owned(old, groups, Dist(rank=r, world_size=world))
            for k in _STEP_FIELDS:
                assert getattr(data, k) == getattr(old, k), (world, r, k)
            for name in ("prompts", "completions", "sampling_logprobs"):
                for a, b in zip(getattr(data, name), getattr(old, name)):
                    assert (a is None and b is None) or (type(a) is type(b) and a.typecode == b.typecode and a == b)
            owned = sum(len(g) for j, g in enumerate(groups) if j % world == r)
            assert parsed <= lines // world + 3 + owned, (world, r, parsed, owned)  # its part and its own records


def test_a_bad_line_read_by_one_rank_stops_every_rank_with_the_whole_reads_error(tmp_path):
    from qerl_cli.errors import BadInputError
    from qerl_cli.train_step import read_step

    sh = _awkward_shards(tmp_path / "sh")
    cfg = TrainStepConfig(model=tmp_path, shards=[str(sh)], out=tmp_path / "o", progress=False)
    with pytest.raises(BadInputError) as whole:
        read_step(cfg)
    assert "shard-00000-of-00003.jsonl:7: not valid JSON" in str(whole.value)  # after a blank line or two
    for world in (2, 4):
        got = _read_as_ranks(cfg, world, 300)
        assert all(isinstance(e, BadInputError) and str(e) == str(whole.value) for e in got), got


def test_ranks_whose_shards_differ_each_read_their_own_whole(tmp_path):
    # Node-local copies: rank 1's has a line more that --skip-bad-lines skips. The ranks do not share parts of
    # different bytes; each reads its own as before, and their fingerprints tell them apart later.
    import shutil

    from qerl_cli.train.batching import pack_microbatches
    from qerl_cli.train_step import _keep_owned, read_step

    sh = make_shard(tmp_path / "sh", "0" * 64, groups=4)
    other = tmp_path / "other"
    shutil.copytree(sh, other)
    f = next(other.glob("*.jsonl"))
    f.write_text(f.read_text() + "garbage\n")

    def work(rank):
        cfg = TrainStepConfig(model=tmp_path, shards=[str(other if rank.rank else sh)], out=tmp_path / "o",
                              progress=False, skip_bad_lines=True)
        data = read_step(cfg, rank)
        groups = pack_microbatches([p + c for p, c in zip(data.prompt_lengths, data.completion_lengths)], 40)
        _keep_owned(data, groups, rank)
        return data, groups

    (d0, g0), (d1, g1) = _as_ranks(2, work)
    assert not d0.bad_lines and len(d1.bad_lines) == 1 and d0.records == d1.records and g0 == g1
    for j, g in enumerate(g0):
        for s in g:
            assert (d0.completions[s] is None) == (j % 2 == 1) and (d1.completions[s] is None) == (j % 2 == 0)


def test_a_token_outside_the_vocabulary_is_named_by_a_rank_that_does_not_hold_it(tmp_path):
    # Under torchrun a rank holds no token arrays when the step is checked against the model: the lowest and highest
    # id of each record tell it whether to look, and the record's line, read again, names the id as before.
    from qerl_cli.errors import BadInputError
    from qerl_cli.train.checks import _check_fits_model
    from qerl_cli.train_step import read_step

    _, q = quantized_tiny(tmp_path)
    sh = _awkward_shards(tmp_path / "sh")  # one record holds the id 2**40
    cfg = TrainStepConfig(model=q, shards=[str(sh)], out=tmp_path / "o", progress=False, skip_bad_lines=True)
    with pytest.raises(BadInputError) as whole:
        _check_fits_model(cfg, read_step(cfg))
    assert f"has token id {2**40}, outside" in str(whole.value)

    def work(rank):
        data = read_step(cfg, rank)
        assert (data.prompts[16] is None) == (rank.rank == 0)  # the record holding it: rank 1's part
        _check_fits_model(cfg, data)

    got = _as_ranks(2, work)
    assert all(isinstance(e, BadInputError) and str(e) == str(whole.value) for e in got), got


def test_a_line_only_a_later_rank_parses_that_raised_a_traceback_stops_every_rank_alike(tmp_path):
    # A reward of a 1 and 400 zeros (JSON reads an int no float holds) raised OverflowError in the validator: a
    # traceback on the one rank that parsed the line, while the others waited for it in the exchange ("another
    # torchrun rank stopped"). Now it is a bad line like any other: every rank names it, or skips it (review s59r16).
    import json

    from qerl_cli.errors import BadInputError
    from qerl_cli.train_step import read_step

    sh = make_shard(tmp_path / "sh", "0" * 64, groups=4)
    f = next(sh.glob("*.jsonl"))
    lines = f.read_text().splitlines(keepends=True)
    lines[-2] = json.dumps({**json.loads(lines[-2]), "reward": 10**400}) + "\n"  # in the last rank's part
    f.write_text("".join(lines))
    for skip in (False, True):
        cfg = TrainStepConfig(model=tmp_path, shards=[str(sh)], out=tmp_path / "o", progress=False,
                              skip_bad_lines=skip)
        got = _as_ranks(3, lambda rank, cfg=cfg: read_step(cfg, rank))
        if skip:
            assert all(d.bad_lines == read_step(cfg).bad_lines and len(d.bad_lines) == 1 for d in got), got
            continue
        with pytest.raises(BadInputError) as whole:
            read_step(cfg)
        assert f"{f.name}:{len(lines) - 1}: logprobs and reward must be finite" in str(whole.value)
        assert all(isinstance(e, BadInputError) and str(e) == str(whole.value) for e in got), got


@pytest.mark.parametrize("change", ["same-length", "removed"])
def test_a_line_rewritten_to_the_same_token_counts_before_a_rank_reads_its_arrays_is_refused(tmp_path, change):
    # A rank reads the arrays of its own records that another rank parsed once the micro-batches are split, long
    # after the records were checked. Its guard compared only the token counts: ids rewritten digit for digit (same
    # counts, same bytes per line) were trained beside the advantages of the old line, past a vocabulary check that
    # never saw them; a shard removed meanwhile was a FileNotFoundError traceback (review s59r16).
    import re
    import threading

    from qerl_cli.errors import BadInputError
    from qerl_cli.train.batching import pack_microbatches
    from qerl_cli.train_step import _keep_owned, read_step

    sh = make_shard(tmp_path / "sh", "0" * 64, groups=4)
    f = next(sh.glob("*.jsonl"))
    cfg = TrainStepConfig(model=tmp_path, shards=[str(sh)], out=tmp_path / "o", progress=False)
    meet = threading.Barrier(2, timeout=60)

    def work(rank):
        data = read_step(cfg, rank)
        groups = pack_microbatches([p + c for p, c in zip(data.prompt_lengths, data.completion_lengths)], 40)
        if meet.wait() == 0:
            if change == "removed":
                f.unlink()
            else:
                text = f.read_text()
                bumped = re.sub(r'"completion_token_ids":\[[0-9,]*\]',
                                lambda m: re.sub("[1-8]", lambda d: str(int(d.group()) + 1), m.group()), text)
                assert len(bumped) == len(text) and bumped != text
                f.write_text(bumped)
        meet.wait()
        _keep_owned(data, groups, rank)

    got = _as_ranks(2, work)
    want = "the line changed while the step was read" if change == "same-length" else "cannot read shard"
    assert all(isinstance(e, BadInputError) and want in str(e) for e in got), got


# ---- the fingerprint hashes the bytes read (s60r04) -------------------------------------------------------------
def _hashed_again(files) -> str:
    """The fingerprint's shard hash as train-step computed it until 2026-11-28: each file read and hashed again."""
    import hashlib

    from qerl_cli.hashing import sha256_file

    h = hashlib.sha256()
    for f in files:
        h.update(sha256_file(f).encode())
    return h.hexdigest()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_shard_hash_of_the_read_is_the_one_of_the_files_hashed_again(tmp_path, world):
    # The fingerprint's shard hash now comes from the read itself (a single process's, or the torchrun ranks'
    # index pass): for unchanged files it must be the value hashing them again gave, or every finished step of
    # an existing run would be redone (exit 4 over it). Blank, bad and torn lines are hashed too.
    from qerl_cli.train.inputs import _shards_hash
    from qerl_cli.train_step import read_step

    sh = _awkward_shards(tmp_path / "sh")
    named = sorted(sh.glob("*.jsonl"), reverse=True)  # the legacy hash is of --shards' order
    cfg = TrainStepConfig(model=tmp_path, shards=[str(f) for f in named], out=tmp_path / "o", progress=False,
                          skip_bad_lines=True)
    got = [read_step(cfg)] if world == 1 else _as_ranks(world, lambda rank: read_step(cfg, rank))
    for data in got:
        assert not isinstance(data, Exception), data
        assert _shards_hash(data.file_hashes) == _hashed_again(data.files) == _hashed_again(sorted(named))
        hash_of = dict(zip(data.files, data.file_hashes))
        assert _shards_hash([hash_of[f] for f in data.files_as_named]) == _hashed_again(named)


def test_a_shard_rewritten_after_the_read_is_fingerprinted_as_the_bytes_read(tmp_path, monkeypatch):
    # The fingerprint hashed the shards in a second read, after read_step had parsed them: a shard rewritten in
    # between (a rollout --force redo of the step) was trained as the old bytes under a fingerprint of the new
    # ones, and a rerun on the new bytes said "already done".
    import time

    import qerl_cli.train_step as ts
    from qerl_cli.train.distributed import Dist

    _, q = quantized_tiny(tmp_path)
    shard = make_shard(tmp_path / "sh", base_hash_of(q))
    f = next(shard.glob("shard-*.jsonl"))
    read = _hashed_again([f])
    real_model_hash = ts.model_hash

    def rewrite_then_hash(d):  # after read_step, before the fingerprint
        f.write_text(f.read_text().replace('"reward":', '"reward": ', 1))
        return real_model_hash(d)

    class Stop(Exception):
        pass

    seen = {}

    def stage_output(*a, inputs, **kw):
        seen.update(inputs)
        raise Stop

    monkeypatch.setattr(ts, "model_hash", rewrite_then_hash)
    monkeypatch.setattr(ts, "StageOutput", stage_output)
    cfg = TrainStepConfig(model=str(q), shards=[str(shard)], out=str(tmp_path / "out"), device="cpu", progress=False)
    with pytest.raises(Stop):
        ts._joined_step(cfg, Dist(), "cpu", torch.float32, time.time())
    assert _hashed_again([f]) != read and seen["shards"] == read


def test_a_line_rewritten_between_the_ranks_index_and_their_parse_stops_every_rank(tmp_path, monkeypatch):
    # Under torchrun the ranks hash and index the files, then each parses its part: a line rewritten in between
    # (digit for digit, the same offsets) was parsed as the new bytes by one rank while the hash the ranks compared,
    # now the fingerprint's, was of the old ones.
    import re
    import threading

    import qerl_cli.train.inputs as inputs
    from qerl_cli.errors import BadInputError
    from qerl_cli.train_step import read_step

    sh = make_shard(tmp_path / "sh", "0" * 64, groups=4)
    f = next(sh.glob("*.jsonl"))
    cfg = TrainStepConfig(model=tmp_path, shards=[str(sh)], out=tmp_path / "o", progress=False)
    real_parts, once = inputs._parts, threading.Lock()

    def rewrite_then_split(lines, world):  # after every rank's index pass (the hashes were exchanged)
        if once.acquire(blocking=False):
            text = f.read_text()
            bumped = re.sub(r'"completion_token_ids":\[[0-9,]*\]',
                            lambda m: re.sub("[1-8]", lambda d: str(int(d.group()) + 1), m.group()), text)
            assert len(bumped) == len(text) and bumped != text
            (tmp_path / "new").write_text(bumped)
            os.replace(tmp_path / "new", f)  # whole: no rank reads a half-written file
        return real_parts(lines, world)

    monkeypatch.setattr(inputs, "_parts", rewrite_then_split)
    got = _as_ranks(2, lambda rank: read_step(cfg, rank))
    assert all(isinstance(e, BadInputError) and "the line changed while the step was read" in str(e) for e in got), got
