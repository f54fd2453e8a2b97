"""How long the load-time twiddle of a 7B-shaped NVFP4 model takes, by chunk size (a device-machine probe).

The torch reference rewrites a weight's codes with ~20 integer ops per chunk. Until 2026-11-27 a chunk was
4096 rows (392 calls for a 7B model); the CPU path now takes 32 MB of codes, and on a GPU `twiddle_codes_`
runs one Triton pass in place (qerl_kernels.twiddle_triton). This times each way over the model's fused
code tensors, median of --repeats (the codes are twiddled over and over on copies: values do not matter).

    python benchmarks/probe_twiddle_chunks.py --model qwen2.5-7b
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def run(tensors, rows_of) -> float:
    """The torch reference in chunks of ``rows_of(t)`` rows, or (None) the Triton pass."""
    from qerl_kernels.twiddle import twiddle
    from qerl_kernels.twiddle_triton import twiddle_

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for t in tensors:
        if rows_of is None:
            twiddle_(t)
            continue
        rows = rows_of(t)
        for a in range(0, t.shape[0], rows):
            t[a:a + rows].copy_(twiddle(t[a:a + rows]))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    os.environ["QERL_TWIDDLE"] = "0"  # build in the on-disk layout; the probe twiddles
    from qerl_cli.layers.attention import fuse_projections
    from qerl_cli.layers.linear import _all_qlinears
    from qerl_cli.models import build_random_model, preset

    model = build_random_model(preset(args.model), device="cuda", dtype=torch.bfloat16, quantized=True)
    fuse_projections(model)
    # each byte once, as twiddle_codes_ does: the fused tensors, not the per-projection views into them
    tensors = [m.weight_packed.clone() for m in _all_qlinears(model) if m.quantized and m.weight_packed._base is None]
    ways = {"4096 rows (before)": lambda t: 4096, **{f"{mb} MB": (lambda t, mb=mb: max(1, (mb << 20) // t.shape[1]))
                                                    for mb in (32, 64, 128)}, "triton (now)": None}
    calls = {k: sum(-(-t.shape[0] // f(t)) for t in tensors) if f else len(tensors) for k, f in ways.items()}
    run(tensors, ways["128 MB"])  # warm-up
    times, peaks = {k: [] for k in ways}, {}
    for _ in range(args.repeats):
        for k, f in ways.items():
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            times[k].append(run(tensors, f))
            peaks[k] = (torch.cuda.max_memory_allocated() - base) / 2**20
    print(f"{torch.cuda.get_device_name()}; {args.model}, {len(tensors)} code tensors, "
          f"{sum(t.numel() for t in tensors) / 2**30:.2f} GiB of codes")
    for k in ways:
        print(f"{k}: {calls[k]} calls, median {statistics.median(times[k]):.3f} s over {args.repeats}, "
              f"temporaries' peak {peaks[k]:.0f} MiB")


if __name__ == "__main__":
    main()
