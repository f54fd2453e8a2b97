"""Time one sampling call per decode step: the per-sequence-seeded samplers against the
shared-generator torch sampler they replaced (its code is kept here as the baseline).

    python benchmarks/bench_sampler.py --rows 16,64,256 --vocab 152064

Prints, per row count and mode, the median over CUDA-event timed repeats in us (wall time of the call,
host launches included: at 16 rows the torch path is bound by them) and the kernels' time per call
(torch.profiler: what a pipelined decode step pays on the GPU). Modes: `plain`
(temperature only: the Triton Gumbel kernel, unchanged), `top_p` (0.95) and `trunc` (top-k 50,
top-p 0.95, min-p 0.01): the torch path, now inverse-CDF sampling on one Philox uniform per row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qerl_cli.engine.sampler import inverse_cdf, row_uniforms, sample, truncated_logprobs  # noqa: E402
from qerl_cli.engine.sampling_params import SamplingParams  # noqa: E402

MODES = {"plain": {}, "top_p": {"top_p": 0.95}, "trunc": {"top_k": 50, "top_p": 0.95, "min_p": 0.01}}


def old_sample(logits, sp, generator):
    """The torch path before 2026-11-26: exponential race with one generator for the whole batch."""
    logp = truncated_logprobs(logits.float(), sp)
    e = torch.empty_like(logp).exponential_(generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
    tokens = (logp - e.log()).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def gpu_us(fn, repeats: int = 10) -> float:
    """Kernel time per call (torch.profiler): what the pipelined decode loop pays on the GPU, where the
    host's launches overlap the previous step."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / repeats


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,64,256")
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--profile", type=int, default=0, help="rows: print the inverse CDF's kernels (torch.profiler) and stop")
    args = ap.parse_args(argv)
    if args.profile:
        x = torch.randn(args.profile, args.vocab, device="cuda").bfloat16()
        seeds = torch.arange(args.profile, device="cuda", dtype=torch.int64) * 7919 + 1
        logp = truncated_logprobs(x.float(), SamplingParams(temperature=1.0, top_p=0.95))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                inverse_cdf(logp, row_uniforms(seeds))
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
        return 0
    print(f"device: {torch.cuda.get_device_name()}, vocab {args.vocab}")
    print("| rows | mode | new us | old us | new GPU us | old GPU us | truncation alone GPU us | inverse CDF alone GPU us |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        x = (torch.randn(rows, args.vocab, device="cuda", generator=gen) * 3).bfloat16()
        seeds = torch.arange(rows, device="cuda", dtype=torch.int64) * 7919 + 1
        for mode, kw in MODES.items():
            sp = SamplingParams(temperature=1.0, max_new_tokens=1, **kw)
            new_fn = lambda x=x, sp=sp, seeds=seeds: sample(x, sp, seeds)  # noqa: E731
            new, new_gpu = timed(new_fn, args.repeats), gpu_us(new_fn)
            if mode == "plain":
                print(f"| {rows} | {mode} | {new:.1f} | - | {new_gpu:.1f} | - | - | - |")
                continue
            old_fn = lambda x=x, sp=sp: old_sample(x, sp, gen)  # noqa: E731
            logp = truncated_logprobs(x.float(), sp)
            trunc = gpu_us(lambda x=x, sp=sp: truncated_logprobs(x.float(), sp))
            cdf = gpu_us(lambda logp=logp, seeds=seeds: inverse_cdf(logp, row_uniforms(seeds)))
            print(f"| {rows} | {mode} | {new:.1f} | {timed(old_fn, args.repeats):.1f} | {new_gpu:.1f} | {gpu_us(old_fn):.1f} "
                  f"| {trunc:.1f} | {cdf:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
