"""Time one sampling call per decode step: the per-sequence-seeded samplers against the
shared-generator torch sampler they replaced (its code is kept here as the baseline).

    python benchmarks/bench_sampler.py --rows 16,64,256 --vocab 152064

Prints, per row count and mode, the median over CUDA-event timed repeats in us. Modes: `plain`
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

from qerl_cli.engine.sampler import sample, truncated_logprobs  # noqa: E402
from qerl_cli.engine.sampling_params import SamplingParams  # noqa: E402

MODES = {"plain": {}, "top_p": {"top_p": 0.95}, "trunc": {"top_k": 50, "top_p": 0.95, "min_p": 0.01}}


def old_sample(logits, sp, generator):
    """The torch path before 2026-11-26: exponential race with one generator for the whole batch."""
    logp = truncated_logprobs(logits.float(), sp)
    e = torch.empty_like(logp).exponential_(generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
    tokens = (logp - e.log()).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


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
    args = ap.parse_args(argv)
    print(f"device: {torch.cuda.get_device_name()}, vocab {args.vocab}")
    print("| rows | mode | new us | old us |")
    print("| --- | --- | --- | --- |")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        x = (torch.randn(rows, args.vocab, device="cuda", generator=gen) * 3).bfloat16()
        seeds = torch.arange(rows, device="cuda", dtype=torch.int64) * 7919 + 1
        for mode, kw in MODES.items():
            sp = SamplingParams(temperature=1.0, max_new_tokens=1, **kw)
            new = timed(lambda x=x, sp=sp, seeds=seeds: sample(x, sp, seeds), args.repeats)
            old = "-" if mode == "plain" else f"{timed(lambda x=x, sp=sp: old_sample(x, sp, gen), args.repeats):.1f}"
            print(f"| {rows} | {mode} | {new:.1f} | {old} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
