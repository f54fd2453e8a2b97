"""One RL run through the CLI on a GPU, stage by stage: what a user's `recipes/grpo.sh` loop costs.

The kernel and engine benchmarks time the work inside one process. A real run is a chain of shell
stages, each a fresh process that imports torch, loads the base, compiles or loads kernels and
captures graphs before it works, then hashes and writes its outputs. This script measures that
chain as users run it: `recipes/grpo.sh` with a model config (default the Qwen2.5-7B recipe)
on a random-weight checkpoint of that shape, every `qerl` invocation timed by a wrapper.

Per stage it reports the process wall time and the work inside it, from the stage's manifest
(quantize: ``quantize_s``; rollout and eval: ``generate_s``; train-step: ``step_s``, the
optimisation loop; merge: ``merge_s``). Wall - work is the stage's fixed cost: process start-up,
checking and hashing inputs, loading the base, building the engine (Triton kernels from the on-disk
cache, CUDA graphs), writing and hashing outputs. A separate probe times the start-up alone: a
process that imports torch and qerl's CLI and makes a CUDA context (median of three).

Inputs (made once per workdir, no download): the checkpoint of `bench_quantize.make_checkpoint`
(random bf16 weights, generated on the GPU), the tests' 384-token byte-level BPE tokenizer (ids past
it decode to nothing, as a real tokenizer's unused rows do; the engine samples the model's whole
vocab) and prompts of ``--prompt-len`` random token ids. The reward is ``parity_reward`` below (a
hash of the completion, so groups have reward variance and the train step has gradients); eval
scores with the ``gsm8k`` rule, which finds no number here (score 0).

    python benchmarks/bench_loop.py --workdir /tmp/qerl-loop --out $OUT
    python benchmarks/bench_loop.py --workdir /tmp/qerl-loop --out $OUT --steps 3 --max-new-tokens 1024

Writes ``bench_loop.json`` (every stage, with its manifest's timings) and ``bench_loop.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK_KEYS = {"quantize": "quantize_s", "rollout": "generate_s", "eval": "generate_s", "train-step": "step_s",
             "merge": "merge_s"}

# The wrapper grpo.sh calls as $QERL: runs the stage, appends one line per invocation to timings.tsv.
WRAPPER = """#!/usr/bin/env bash
t0=$(date +%s.%N)
"{python}" -m qerl_cli "$@"
rc=$?
printf '%s\\t%s\\t%s\\t%s\\n' "$1" "$t0" "$(date +%s.%N)" "$rc" >> "{log}"
exit $rc
"""


def parity_reward(completion: str, answer: str | None, *, prompt=None) -> float:
    """1 or 0 from a hash of the completion: random text still gives each group reward variance."""
    return float(zlib.crc32(completion.encode()) & 1)


def make_prompts(path: Path, tok, rows: int, length: int, seed: int = 0) -> float:
    """Rows of ``length`` random non-special token ids, decoded; returns their mean length re-encoded."""
    import random

    rng = random.Random(seed)
    special = set(tok.all_special_ids)
    ids = [i for i in range(len(tok)) if i not in special]
    lens = []
    with open(path, "w") as f:
        for i in range(rows):
            text = tok.decode([rng.choice(ids) for _ in range(length)])
            text = tok.decode(tok(text)["input_ids"][:length])  # decoded pieces re-encode longer: cut to length
            lens.append(len(tok(text)["input_ids"]))
            f.write(json.dumps({"prompt": text, "answer": str(i)}) + "\n")
    return sum(lens) / len(lens)


def make_inputs(work: Path, shape: str, rows: int, prompt_len: int, device: str) -> tuple[Path, float]:
    src = work / f"{shape}-random"
    if not (src / ".complete").exists():  # weights in a child, so this process holds no GPU memory
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_quantize.py"), "make", "--out", str(src),
                        "--shape", shape, "--device", device], check=True)
    from tests.helpers import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    tok.save_pretrained(src)
    return src, make_prompts(work / "prompts.jsonl", tok, rows, prompt_len)


def read_manifest(run_dir: Path, stage: str, t0: float, t1: float) -> dict:
    """The manifest this invocation committed: written between t0 and t1 under run_dir."""
    for m in sorted(run_dir.rglob("manifest.json")):
        if t0 <= m.stat().st_mtime <= t1 + 1:
            man = json.loads(m.read_text())
            if man.get("stage", stage) == stage or stage in str(m):
                return {"path": str(m.relative_to(run_dir)), **man}
    return {}


def work_seconds(stage: str, man: dict) -> float | None:
    key = WORK_KEYS.get(stage)
    return (man.get("timings") or {}).get(key) if key else None


def run_loop(args, src: Path) -> list[dict]:
    work = Path(args.workdir)
    run_dir, log = work / "run", work / "timings.tsv"
    log.unlink(missing_ok=True)
    wrapper = work / "qerl"
    wrapper.write_text(WRAPPER.format(python=sys.executable, log=log))
    wrapper.chmod(0o755)
    evals = str(work / "prompts.jsonl") if args.eval_problems > 0 else ""  # empty: grpo.sh skips every eval
    env = dict(os.environ, MODEL=str(src), DATASET=str(work / "prompts.jsonl"), EVAL_DATASET=evals,
               QERL=str(wrapper), STEPS=str(args.steps), PROMPTS_PER_STEP=str(args.prompts_per_step),
               NUM_GENERATIONS=str(args.num_generations), MAX_NEW_TOKENS=str(args.max_new_tokens),
               EVAL_MAX_PROBLEMS=str(args.eval_problems), REWARDS="benchmarks/bench_loop.py:parity_reward",
               PROMPT_TEMPLATE="", WARMUP_STEPS=str(int(args.steps > 1)), DEVICE=args.device, FORCE="1")
    # Every config key takes the environment's value first (docs/recipes.md), so the config runs as it is.
    # (A filtered copy of it broke when the configs learned that: its template lost its closing quote.)
    t_run = time.time()
    config = str(Path(args.config).resolve())  # read where this was run; grpo.sh runs in the repository
    proc = subprocess.run(["bash", str(ROOT / "recipes" / "grpo.sh"), config, str(run_dir)], cwd=ROOT, env=env)
    rows = []
    for line in log.read_text().splitlines() if log.exists() else []:
        argv0, t0, t1, rc = line.split("\t")
        rows.append({"stage": argv0, "start": float(t0) - t_run, "wall_s": round(float(t1) - float(t0), 2), "rc": int(rc)})
    for r in rows:
        man = read_manifest(run_dir, r["stage"], t_run + r["start"], t_run + r["start"] + r["wall_s"])
        r["manifest"] = man.get("path")
        r["work_s"] = work_seconds(r["stage"], man)
        r["timings"] = man.get("timings")
        if r["stage"] == "train-step":
            r["metrics"] = {k: man.get("metrics", {}).get(k) for k in
                            ("load_time_s", "step_time_s", "tokens_per_s", "peak_gpu_memory_gib", "trained_tokens")}
        if r["stage"] == "rollout":
            r["throughput"] = ((man.get("summary") or {}).get("throughput"))
    if proc.returncode:
        rows.append({"stage": "grpo.sh", "rc": proc.returncode})
    return rows


def startup_seconds(device: str) -> float:
    code = ("import time; t = time.time(); import torch, qerl_cli.cli; "
            f"torch.zeros(1, device={device!r}).sum().item(); print(time.time() - t)")
    times = []
    for _ in range(3):
        t0 = time.time()
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
        times.append(time.time() - t0)
    return sorted(times)[1]


def render(rows: list[dict], head: str, startup: float) -> str:
    """Per stage: wall, then what its manifest says the stage spent (prepare: checks, input hashes,
    tokenizer, shards; load: the base (+ adapter) onto the device; engine: KV cache, CUDA graphs,
    kernels; work), and the rest (process start-up, output hashing, writing)."""
    f = lambda v: "" if v is None else f"{v:.1f}"  # noqa: E731
    out = [head, "", "| # | stage | wall (s) | prepare (s) | load (s) | engine (s) | work (s) | rest (s) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, r in enumerate(rows):
        if "wall_s" not in r:
            out.append(f"| | {r['stage']} failed (rc {r['rc']}) | | | | | | |")
            continue
        t = r.get("timings") or {}
        parts = [t.get("prepare_s"), t.get("load_s"), t.get("engine_s"), r.get("work_s")]
        rest = r["wall_s"] - sum(v or 0 for v in parts)
        name = "eval --compare" if r["stage"] == "eval" and r["manifest"] is None else r["stage"]
        out.append(f"| {i} | {name} | {r['wall_s']:.1f} | " + " | ".join(f(v) for v in parts) + f" | {rest:.1f} |")
    total = sum(r.get("wall_s", 0) for r in rows)
    work = sum(r.get("work_s") or 0 for r in rows)
    out.append(f"\nAll stages: {total:.1f} s of process wall time, {work:.1f} s of it work. Start-up probe "
               f"(python, torch, qerl_cli, a CUDA context): {startup:.1f} s a process.")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/qerl-loop", help="checkpoint, prompts and the run (~40 GB for 7B)")
    ap.add_argument("--out", default=".", help="where bench_loop.json and bench_loop.md go")
    ap.add_argument("--config", default=str(ROOT / "recipes" / "configs" / "qwen2.5-7b-instruct.env"))
    ap.add_argument("--shape", default="qwen2.5-7b", help="a bench_quantize.py shape (qwen2.5-7b, qwen2.5-0.5b, tiny)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts-per-step", type=int, default=32)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--eval-problems", type=int, default=64, help="0: no eval stages")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test with --shape tiny")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    src, mean_len = make_inputs(work, args.shape, max(args.prompts_per_step * args.steps, args.eval_problems), args.prompt_len, args.device)
    made = time.time() - t0
    rows = run_loop(args, src)
    import torch

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    head = (f"{dev}; {args.shape} shape, random weights; `recipes/grpo.sh {Path(args.config).name}` with STEPS={args.steps}, "
            f"{args.prompts_per_step} prompts x G={args.num_generations}, prompts of {mean_len:.0f} tokens, "
            f"max {args.max_new_tokens} new tokens, eval on {args.eval_problems or 'no'} problems; inputs made in {made:.0f} s")
    startup = startup_seconds(args.device)
    text = render(rows, head, startup)
    print(text, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_loop.json").write_text(json.dumps({"head": head, "startup_s": startup, "stages": rows}, indent=1, default=str))
    (out / "bench_loop.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
