"""Probe where the small-M NVFP4 GEMM's time goes (H100): the table's tile with the decode replaced by
a near-free bit reinterpretation, and with 1 KB-blocked code addressing (timing only), plus tile variants.

Why: the second kernel pass cut decode instructions by 30% and tensor-core waits 8-fold for an ~8%
gain (docs/benchmarks.md, kernels analysis). If the no-decode probe is much faster than the real
kernel, ALU latency still matters; if not, the load pipeline (bytes in flight, waves) is the limit.
Usage: ``python benchmarks/probe_small_m.py [--ms 1,16] [--json-out F]``; prints one JSON per point.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"7B gate_up": (37888, 3584), "7B down": (3584, 18944), "7B o": (3584, 3584), "32B gate_up": (55296, 5120)}


def main(argv=None) -> int:
    from bench_kernels import ShapeData, bench_cublas_fwd, time_graph
    from qerl_kernels.gemm_fwd import nvfp4_matmul
    from qerl_kernels.tile_configs import FwdConfig, fwd_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    out = []
    for name, (n, k) in SHAPES.items():
        d = ShapeData(n, k, seed=n + k, twiddled=True)
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = fwd_config(m, n, k)
            # (label, config, probe no-decode, blocked addressing): blocked timings read unblocked
            # bytes (wrong values), which is fine for a timing of the access pattern.
            variants = [("table", base, False, False), ("table-nodecode", base, True, False),
                        ("table-blocked", base, False, True), ("table-blocked-nodecode", base, True, True)]
            for bn, warps in ((64, 4), (128, 4), (256, 8)):
                for stages in (3, 4):
                    c = FwdConfig(16, bn, 16, split_k=base.split_k, warps=warps, stages=stages, swap=True, perm=True)
                    variants.append((f"bn{bn}-s{stages}-blocked", c, False, True))
            ref = bench_cublas_fwd(d, m)
            for label, cfg, probe, blocked in variants:
                try:
                    fns = [lambda i=i, cfg=cfg, probe=probe, blocked=blocked, x=x, d=d: nvfp4_matmul(
                        x, d.packed[i], d.scale[i], d.gs, config=cfg, twiddled=True, _probe_nodecode=probe, blocked=blocked)
                           for i in range(d.r4)]
                    us = time_graph(fns, target_s=0.05)
                except Exception as e:  # out of resources etc.: report and go on
                    print(f"# {name} M={m} {label}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                rec = {"shape": name, "M": m, "variant": label, "us": round(us, 2), "cublas_us": round(ref, 2),
                       "speedup": round(ref / us, 3), "TBps": round(n * k * 0.5625 / us / 1e6, 2)}
                out.append(rec)
                print(json.dumps(rec), flush=True)
        d = None  # free the weight copies before the next shape
        torch.cuda.empty_cache()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    best = {}
    for r in out:
        key = (r["shape"], r["M"])
        if "nodecode" not in r["variant"] and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    for r in out:
        if r["variant"] == "table":
            same = {x["variant"]: x["us"] for x in out if x["shape"] == r["shape"] and x["M"] == r["M"]}
            b = best[(r["shape"], r["M"])]
            print(f"{r['shape']:12} M={r['M']:3}  table {r['us']:7.1f}us  no-decode {same.get('table-nodecode', 0):7.1f}  "
                  f"blocked {same.get('table-blocked', 0):7.1f}  blocked no-decode {same.get('table-blocked-nodecode', 0):7.1f}  "
                  f"best {b['variant']} {b['us']:7.1f}us ({b['speedup']:.2f}x cuBLAS, {b['TBps']:.2f} TB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
