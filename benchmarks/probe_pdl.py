"""Programmatic dependent launch between ``permute_x`` and the X-by-TMA GEMM after it (kernels/pdl.py),
on and off, on the table's tiles over natural X as bench_kernels.py times them (a probe).

    python benchmarks/probe_pdl.py --ms 32,64,128,256,1024 --rounds 3

Each point: the table's config with ``QERL_PDL=1`` and ``=0``, timed alternately ``--rounds`` times
(medians; PDL on first in even rounds, off first in odd ones), the outputs compared bit for bit, cuBLAS bf16 in the same run; then the geomean speed-up over
cuBLAS per M both ways. Points whose tile takes X in natural order or decodes once run the same launches
either way (listed as such).

Since 2026-11-26 PDL is never used for launches captured into a CUDA graph (it hung there: kernels/pdl.py),
and this probe times graph replays, so both sides now run the same launches; it stays as the record of the
twenty-third pass's measurement (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import add_probe_args, geomean, probe_points, time_graph  # noqa: E402


def timed(d, m, cfg, pdl: bool, x):
    from qerl_kernels.gemm_fwd import nvfp4_matmul

    os.environ["QERL_PDL"] = "1" if pdl else "0"
    y = nvfp4_matmul(x, d.packed[0], d.scale[0], d.gs, config=cfg, twiddled=d.tw, blocked=d.bl)
    us = time_graph([lambda i=i: nvfp4_matmul(x, d.packed[i], d.scale[i], d.gs, config=cfg, twiddled=d.tw,
                                              blocked=d.bl) for i in range(d.r4)])
    return us, y


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_args(ap, "qkv,o,gate_up,down")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    ratios = defaultdict(lambda: ([], []))
    for model, layer, d, m, cfg, cublas in probe_points(args):
        x = torch.randn(m, d.k, device="cuda", dtype=torch.bfloat16)
        on, off = [], []
        for r in range(args.rounds):  # the side timed first alternates, so drift lands on both
            if r % 2:
                us0, y0 = timed(d, m, cfg, False, x)
                us1, y1 = timed(d, m, cfg, True, x)
            else:
                us1, y1 = timed(d, m, cfg, True, x)
                us0, y0 = timed(d, m, cfg, False, x)
            assert torch.equal(y1, y0), (model, layer, m)
            on.append(us1)
            off.append(us0)
        t1, t0 = statistics.median(on), statistics.median(off)
        kind = "x-by-TMA" if cfg.xtma and cfg.gluon else ("decode once" if cfg.dequant else "natural X")
        print(f"{model} {layer} M={m} ({kind}): PDL off {t0:.1f} us, on {t1:.1f} us ({t0 / t1:.3f}x); "
              f"cuBLAS {cublas:.1f} us: {cublas / t0:.2f}x -> {cublas / t1:.2f}x", flush=True)
        ratios[m][0].append(cublas / t0)
        ratios[m][1].append(cublas / t1)
    for m, (off, on) in sorted(ratios.items()):
        print(f"M={m}: geomean over cuBLAS, PDL off {geomean(off):.3f}x, on {geomean(on):.3f}x ({len(off)} shapes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
