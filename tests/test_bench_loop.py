"""benchmarks/bench_loop.py drives recipes/grpo.sh through every stage and reads each stage's work time back."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_loop_benchmark_times_every_stage_of_a_tiny_run_on_cpu(tmp_path):
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_loop.py"), "--workdir", str(tmp_path / "w"),
                    "--out", str(out), "--shape", "tiny", "--device", "cpu", "--steps", "2", "--prompts-per-step", "2",
                    "--num-generations", "2", "--max-new-tokens", "8", "--prompt-len", "12", "--eval-problems", "4"],
                   cwd=ROOT, check=True, capture_output=True, timeout=600)
    res = json.loads((out / "bench_loop.json").read_text())
    stages = [s["stage"] for s in res["stages"]]
    assert stages == ["quantize", "eval", "rollout", "train-step", "rollout", "train-step", "merge", "eval", "eval"]
    assert all(s["rc"] == 0 for s in res["stages"])
    for s in res["stages"][:-1]:  # the last eval is --compare: no manifest, no work
        assert s["manifest"] and 0 <= s["work_s"] < s["wall_s"], s
    assert 0 < res["stages"][2]["throughput"]["generated_tokens"] <= 2 * 2 * 8  # G x prompts x max tokens
    assert "| 3 | train-step |" in (out / "bench_loop.md").read_text()
