"""What a machine's first rollout spends compiling Triton kernels, and what compiling them side by side saves.

Each run is a fresh process with an empty Triton cache (a new ``TRITON_CACHE_DIR``), as on a machine that
never ran qerl: it builds a Qwen2.5-7B-shaped model with random weights (NVFP4, optionally LoRA r=16 on all
seven projections), builds the engine (decode graphs for every batch size up to ``--seqs``, prefill graphs)
and generates ``--new-tokens`` for ``--seqs`` sequences. ``--modes`` picks the engine's ways to compile: ``0``
(``QERL_COMPILE_AHEAD=0``: each kernel compiles when the warm-up first launches it), ``threads`` (compiled
side by side first, ``qerl_kernels.compile_ahead``, on threads only: ``QERL_COMPILE_PROCESSES=0``) and
``1`` (the default: kernels missing from the disk cache compile in worker processes). Every
``triton.compile`` call in the process is timed (its wall time, on whichever thread ran it; a worker's are
not seen). ``--warm-runs N`` then builds the same engine N more times on the cache the cold run filled.
Prints one JSON line per run.

    python benchmarks/probe_compile.py --modes 0,threads,1 --lora 0,1 --warm-runs 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def one_run(lora: bool, seqs: int, new_tokens: int, prompt_len: int) -> dict:
    import threading

    import triton.compiler

    records = []
    real = triton.compiler.compile

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            src = a[0] if a else k.get("src")
            name = getattr(getattr(src, "fn", None), "__name__", "?")
            records.append((name, time.perf_counter() - t0, threading.current_thread().name))

    triton.compiler.compile = timed  # JITFunction binds triton.compiler.compile when it first runs on a device

    import torch
    from qerl_kernels import compile_workers

    from qerl_cli.engine import model_runner

    phases: dict[str, float] = {}
    for phase in ("_compile_ahead", "_capture", "_capture_prefill"):
        real_phase = getattr(model_runner.ModelRunner, phase)

        def timed_phase(self, *a, _real=real_phase, _name=phase, **k):
            t = time.perf_counter()
            try:
                return _real(self, *a, **k)
            finally:
                phases[_name] = round(time.perf_counter() - t, 2)
        setattr(model_runner.ModelRunner, phase, timed_phase)
    jobs = []  # (kernel, submitted, finished) seconds from the first submit: what the workers did
    real_submit = compile_workers.WorkerPool.submit

    def timed_submit(self, job):
        t = time.perf_counter()
        future = real_submit(self, job)
        entry = [job[1], t, None]
        jobs.append(entry)
        future.add_done_callback(lambda f, e=entry: e.__setitem__(2, time.perf_counter()))
        return future
    compile_workers.WorkerPool.submit = timed_submit

    from qerl_cli.engine import LLMEngine, SamplingParams
    from qerl_cli.layers.lora import LoraSpec
    from qerl_cli.models import build_random_model, preset

    model = build_random_model(preset("qwen2.5-7b"), device="cuda", dtype=torch.bfloat16, quantized=True,
                               lora=LoraSpec(r=16, alpha=16) if lora else None, max_positions=4096)
    torch.cuda.synchronize()
    n_before = len(records)
    t0 = time.perf_counter()
    engine = LLMEngine(model, None, max_num_seqs=seqs, max_model_len=prompt_len + new_tokens + 16)
    torch.cuda.synchronize()
    engine_s = time.perf_counter() - t0
    n_engine = len(records)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(seqs // 8)]
    t1 = time.perf_counter()
    engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0), n=8)
    torch.cuda.synchronize()
    generate_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0), n=8)
    torch.cuda.synchronize()
    again_s = time.perf_counter() - t2
    by_name: dict[str, list[float]] = {}
    for name, s, _ in records:
        by_name.setdefault(name, []).append(s)
    top = sorted(((sum(v), len(v), k) for k, v in by_name.items()), reverse=True)[:12]
    return dict(lora=lora, ahead=os.environ.get("QERL_COMPILE_AHEAD", "1"),
                processes=os.environ.get("QERL_COMPILE_PROCESSES", ""), seqs=seqs, engine_s=round(engine_s, 2),
                generate_s=round(generate_s, 2), generate_again_s=round(again_s, 2),
                compiles_before_engine=n_before, compiles_in_engine=n_engine - n_before,
                compiles_in_generate=len(records) - n_engine, compile_sum_s=round(sum(s for _, s, _ in records), 2),
                threads=len({t for _, _, t in records}), phases=phases,
                worker_jobs=[[name, round(a - jobs[0][1], 2), round(b - jobs[0][1], 2) if b else None]
                             for name, a, b in jobs],
                top=[dict(name=k, n=n, s=round(s, 2)) for s, n, k in top])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="0,threads,1", help="0, threads, 1 (see above): one fresh process each")
    ap.add_argument("--warm-runs", type=int, default=0, help="builds after each cold one, on its cache")
    ap.add_argument("--lora", default="0", help="comma list of 0/1")
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(one_run(args.lora == "1", args.seqs, args.new_tokens, args.prompt_len)), flush=True)
        return 0
    rc = 0
    for lora in args.lora.split(","):
        for mode in args.modes.split(","):
            flags = MODES[mode]
            with tempfile.TemporaryDirectory(prefix="triton-cold-") as cache:
                env = dict(os.environ, TRITON_CACHE_DIR=cache, **flags)
                for run in range(1 + args.warm_runs):
                    t0 = time.perf_counter()
                    proc = subprocess.run([sys.executable, __file__, "--child", "--lora", lora, "--seqs",
                                           str(args.seqs), "--new-tokens", str(args.new_tokens), "--prompt-len",
                                           str(args.prompt_len)], env=env, capture_output=True, text=True)
                    wall = time.perf_counter() - t0
                    line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "{}"
                    print(f"# mode={mode} lora={lora} cache={'cold' if run == 0 else 'warm'} rc={proc.returncode} "
                          f"process wall {wall:.1f} s", flush=True)
                    print(line, flush=True)
                    if proc.returncode:
                        print(proc.stderr[-4000:], flush=True)
                        rc = 1
    return rc


MODES = {"0": {"QERL_COMPILE_AHEAD": "0"}, "threads": {"QERL_COMPILE_AHEAD": "1", "QERL_COMPILE_PROCESSES": "0"},
         "1": {"QERL_COMPILE_AHEAD": "1", "QERL_COMPILE_PROCESSES": ""}}

if __name__ == "__main__":
    sys.exit(main())
