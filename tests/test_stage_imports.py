"""No stage imports torch._dynamo: qerl compiles nothing, and that import alone took 1.5 s of
every stage process on a CPU machine and 4-6 s on an H100 machine (docs/benchmarks.md, RL loop)."""

import os
import subprocess
import sys

from qerl_cli.assets import TINY_MODEL, TINY_TASK

# Runs the given stages in one fresh process, then says whether dynamo (or torch.fx's symbolic shapes,
# which torch.autograd.backward imports when handed explicit gradients) was ever imported.
RUN = """
import sys
from qerl_cli.cli import main
for argv in STAGES:
    sys.argv = ["qerl", *argv]
    try:
        main()
    except SystemExit as e:
        assert e.code in (0, None), (argv[0], e.code)
print("imported:", sorted(m for m in ("torch._dynamo", "torch.fx.experimental.symbolic_shapes") if m in sys.modules))
"""


def test_no_stage_imports_torch_dynamo(tmp_path):
    # Before: building a model on meta ran an init and the rotary table through torch._refs, and
    # train-step's torch.optim.AdamW and torch.utils.checkpoint are wrapped to import dynamo.
    q, shards, adapter, merged = (tmp_path / n for n in ("q", "shards", "adapter", "merged"))
    stages = [
        ["quantize", str(TINY_MODEL), "--out", str(q), "--device", "cpu", "-q"],
        ["rollout", "--model", str(q), "--prompts", str(TINY_TASK / "train.jsonl"), "--out", str(shards),
         "--max-prompts", "4", "-G", "4", "--max-new-tokens", "6", "--device", "cpu", "-q"],
        ["train-step", "--model", str(q), "--shards", str(shards), "--out", str(adapter),
         "--lora-dropout", "0.1", "--device", "cpu", "-q"],  # checkpointing and dropout are on
        ["merge", "--model", str(q), "--adapter", str(adapter), "--out", str(merged), "-q"],
        ["eval", "--model", str(merged), "--dataset", str(TINY_TASK / "test.jsonl"), "--out", str(tmp_path / "e"),
         "--max-problems", "2", "--max-new-tokens", "6", "--device", "cpu", "-q"],
    ]
    r = subprocess.run([sys.executable, "-c", f"STAGES = {stages!r}\n{RUN}"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (adapter / "optimizer.safetensors").exists() and (tmp_path / "e" / "metrics.json").exists()
    assert "imported: []" in r.stdout, r.stdout + r.stderr[-3000:]


def test_every_stage_runs_on_cpu_without_triton(tmp_path):
    # triton is a Linux-only dependency ("the torch paths cover everything without it"), yet loading an
    # NVFP4 model and attaching LoRA imported qerl_kernels.decode, which imports triton: rollout,
    # train-step and eval died with a ModuleNotFoundError where it is absent. Here it is blocked.
    q, shards, adapter = (tmp_path / n for n in ("q", "shards", "adapter"))
    stages = [
        ["quantize", str(TINY_MODEL), "--out", str(q), "--device", "cpu", "-q"],
        ["rollout", "--model", str(q), "--prompts", str(TINY_TASK / "train.jsonl"), "--out", str(shards),
         "--max-prompts", "2", "-G", "2", "--max-new-tokens", "4", "--device", "cpu", "-q"],
        ["train-step", "--model", str(q), "--shards", str(shards), "--out", str(adapter), "--device", "cpu", "-q"],
        ["eval", "--model", str(q), "--adapter", str(adapter), "--dataset", str(TINY_TASK / "test.jsonl"),
         "--out", str(tmp_path / "e"), "--max-problems", "2", "--max-new-tokens", "4", "--device", "cpu", "-q"],
        ["merge", "--model", str(q), "--adapter", str(adapter), "--out", str(tmp_path / "m"), "-q"],
    ]
    blocked = "import sys\nsys.modules['triton'] = None  # as where triton is not installed\n"
    r = subprocess.run([sys.executable, "-c", f"{blocked}STAGES = {stages!r}\n{RUN}"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "e" / "metrics.json").exists() and (tmp_path / "m" / "manifest.json").exists()


def test_the_cli_grows_cuda_segments_by_pages_unless_the_user_chose(monkeypatch):
    from qerl_cli.cli import use_expandable_segments

    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    use_expandable_segments()
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"  # torch 2.13 here: the new name
    import qerl_cli.cli as cli

    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    monkeypatch.setattr("importlib.metadata.version", lambda name: "2.8.0+cu128")
    cli.use_expandable_segments()  # torch before 2.10 reads only the old name for CUDA
    assert os.environ.pop("PYTORCH_CUDA_ALLOC_CONF") == "expandable_segments:True"
    assert "PYTORCH_ALLOC_CONF" not in os.environ
    monkeypatch.undo()
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
        monkeypatch.setenv(var, "max_split_size_mb:128")
        use_expandable_segments()
        assert os.environ.get("PYTORCH_ALLOC_CONF", "max_split_size_mb:128") == "max_split_size_mb:128"
        monkeypatch.delenv(var)
