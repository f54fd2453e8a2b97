"""Time one sampling call per decode step: the GPU path (Triton Gumbel kernel; min-p / top-k / top-p
cut by radix select, ``engine/triton_truncation.py``) against the torch reference (stable sort for
top-p, then inverse-CDF sampling), which the GPU path used for truncated sampling before 2026-11-26.

    python benchmarks/bench_sampler.py --rows 16,64,256 --vocab 152064

Prints, per row count and mode, the median over CUDA-event timed repeats in us (wall time of the call,
host launches included) and the kernels' time per call (torch.profiler: what a pipelined decode step
pays on the GPU). Modes: `plain` (temperature only), `top_p` (0.95), `top_k` (50), `trunc` (top-k 50,
top-p 0.95, min-p 0.01), `wide` (top-k 1000, top-p 0.99).
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

MODES = {"plain": {}, "top_p": {"top_p": 0.95}, "top_k": {"top_k": 50},
         "trunc": {"top_k": 50, "top_p": 0.95, "min_p": 0.01}, "wide": {"top_k": 1000, "top_p": 0.99}}


def reference_sample(logits, sp, seeds):
    """The torch path (what CPU runs): sort-based truncation, then inverse CDF."""
    logp = truncated_logprobs(logits.float(), sp)
    tokens = inverse_cdf(logp, row_uniforms(seeds))
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
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args(argv)
    print(f"device: {torch.cuda.get_device_name()}, vocab {args.vocab}")
    print("| rows | mode | GPU path us | torch path us | GPU path, GPU us | torch path, GPU us |")
    print("| --- | --- | --- | --- | --- | --- |")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        x = (torch.randn(rows, args.vocab, device="cuda", generator=gen) * 3).bfloat16()
        seeds = torch.arange(rows, device="cuda", dtype=torch.int64) * 7919 + 1
        for mode in args.modes.split(","):
            sp = SamplingParams(temperature=1.0, max_new_tokens=1, **MODES[mode])
            new_fn = lambda x=x, sp=sp, seeds=seeds: sample(x, sp, seeds)  # noqa: E731
            ref_fn = lambda x=x, sp=sp, seeds=seeds: reference_sample(x, sp, seeds)  # noqa: E731
            print(f"| {rows} | {mode} | {timed(new_fn, args.repeats):.1f} | {timed(ref_fn, args.repeats):.1f} "
                  f"| {gpu_us(new_fn):.1f} | {gpu_us(ref_fn):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
