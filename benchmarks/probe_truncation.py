"""Time the radix-select cut (engine/triton_truncation.find_cut) over its tile parameters on the GPU.

    python benchmarks/probe_truncation.py --rows 16,256 --chunks 2048,4096,8192 --blocks 512,1024,2048 \\
        --warps 4,8,16 --stages 1,2

Prints GPU time per call (torch.profiler, kernels only) for top-p 0.95 and top-k 50 on bf16 random
logits [rows, 152064], one line per tile; the module's defaults are what `find_cut` ships with.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sampler import gpu_us  # noqa: E402
from qerl_cli.engine import triton_truncation as tt  # noqa: E402
from qerl_cli.engine.sampler import sample  # noqa: E402
from qerl_cli.engine.sampling_params import SamplingParams  # noqa: E402
from qerl_cli.engine.triton_sampler import chunking  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,256")
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--chunks", default=str(tt.CHUNK))  # defaults: the shipped tile
    ap.add_argument("--blocks", default=str(tt.PASS_BLOCK))
    ap.add_argument("--warps", default=str(tt.PASS_WARPS))
    ap.add_argument("--stages", default=str(tt.PASS_STAGES))
    ap.add_argument("--count-bits", default=str(tt.COUNT_BITS), help="key bits per top-k pass (4 or 8)")
    ap.add_argument("--key-mass-bits", default=str(tt.KEY_MASS_BITS), help="bits of the last top-p pass (4 or 8)")
    ap.add_argument("--peaked", action="store_true", help="rows with 8 tokens 20 nats up (a small nucleus)")
    ap.add_argument("--profile", action="store_true", help="print sample()'s kernels for top-p per row count, then stop")
    args = ap.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = {}
    for r in ints(args.rows):
        x = torch.randn(r, args.vocab, device="cuda", generator=gen) * 3
        if args.peaked:  # an LLM-like row: a few tokens far above the rest, a small nucleus
            x[:, :: args.vocab // 8] += 20
        xs[r] = x.bfloat16()
    modes = {"top_p": SamplingParams(top_p=0.95), "top_k": SamplingParams(top_k=50)}
    if args.profile:
        for r, x in xs.items():
            seeds = torch.arange(r, device="cuda", dtype=torch.int64) * 7919 + 1
            sample(x, modes["top_p"], seeds)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    sample(x, modes["top_p"], seeds)
                torch.cuda.synchronize()
            print(f"rows {r}, top-p 0.95, 10 calls:")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=40))
        return 0
    print(f"device: {torch.cuda.get_device_name()}; GPU us per find_cut, and per sample() (cut + Gumbel draw)")
    print("| chunk | block | warps | stages | count bits | key-mass bits | " + " | ".join(f"{m} {r}" for r in xs for m in modes) + " | "
          + " | ".join(f"sample {m} {r}" for r in xs for m in modes) + " |")
    for chunk, block, warps, stages, cb, kb in itertools.product(ints(args.chunks), ints(args.blocks), ints(args.warps),
                                                                 ints(args.stages), ints(args.count_bits),
                                                                 ints(args.key_mass_bits)):
        if block > chunk:
            continue
        tt.CHUNK, tt.PASS_BLOCK, tt.PASS_WARPS, tt.PASS_STAGES = chunk, block, warps, stages
        tt.COUNT_BITS, tt.KEY_MASS_BITS = cb, kb
        cells, full = [], []
        for r, x in xs.items():
            gc, gn = chunking(r, args.vocab)
            seeds = torch.arange(r, device="cuda", dtype=torch.int64) * 7919 + 1
            for sp in modes.values():
                try:
                    cells.append(f"{gpu_us(lambda x=x, sp=sp, gc=gc, gn=gn: tt.find_cut(x, sp, gc, gn)):.1f}")
                    full.append(f"{gpu_us(lambda x=x, sp=sp, seeds=seeds: sample(x, sp, seeds)):.1f}")
                except Exception as e:  # noqa: BLE001 - a tile that does not compile (registers) is reported
                    cells.append(type(e).__name__)
                    full.append("-")
        cells += full
        print(f"| {chunk} | {block} | {warps} | {stages} | {cb} | {kb} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
