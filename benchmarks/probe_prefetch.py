"""What programmatic dependent launch and the L2 weight prefetch buy the small-M GEMM, per shape.

For each Qwen2.5-7B/32B Linear shape and M, the table config (kernels/tile_table.py) is timed with
PDL off, PDL on without prefetch, and PDL on with several per-program prefetch budgets
(``FwdConfig.prefetch_kb``), against cuBLAS bf16, in the kernel benchmark's harness (one call per
weight copy, copies rotated through >= 256 MB, CUDA graph, median of replays). Consecutive calls are
independent but launched back to back, as a decode step's GEMMs are: with PDL each call's prologue
and prefetch overlap the previous call's tail.

    python benchmarks/probe_prefetch.py --ms 1,16,64 --kbs 0,16,64,256,100000 --json-out $OUT/pf.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import SHAPES, ShapeData, bench_cublas_fwd, bench_fwd_point  # noqa: E402


def main(argv=None) -> int:
    from qerl_kernels.tile_configs import fwd_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--kbs", default="0,16,64,256,100000", help="prefetch budgets (KB of codes per program)")
    ap.add_argument("--models", default="7B,32B")
    ap.add_argument("--json-out", default="")
    args = ap.parse_args(argv)
    ms = [int(v) for v in args.ms.split(",")]
    kbs = [int(v) for v in args.kbs.split(",")]
    rows = []
    print(f"# {torch.cuda.get_device_name()}", flush=True)
    for (model, layer), (n, k) in SHAPES.items():
        if model not in args.models.split(","):
            continue
        d = ShapeData(n, k, seed=n + k)
        for m in ms:
            base = fwd_config(m, n, k)
            if base.dequant:
                continue
            rec = dict(shape=f"{model} {layer}", n=n, k=k, m=m, cublas_us=bench_cublas_fwd(d, m))
            os.environ["QERL_PDL"] = "0"
            rec["nopdl_us"], err = bench_fwd_point(d, m, replace(base, prefetch_kb=0))
            os.environ["QERL_PDL"] = "1"
            for kb in kbs:
                rec[f"pdl_pf{kb}_us"], e2 = bench_fwd_point(d, m, replace(base, prefetch_kb=kb))
                err = max(err, e2)
            rec["err"] = err
            rows.append(rec)
            cells = " ".join(f"{key}={v:.1f}" for key, v in rec.items() if key.endswith("_us"))
            print(f"{model} {layer} M={m}: {cells} err={err:.2e}", flush=True)
        del d
        torch.cuda.empty_cache()
    keys = ["nopdl_us"] + [f"pdl_pf{kb}_us" for kb in kbs]
    print("\n| shape | M | cuBLAS us | " + " | ".join(keys) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in keys) + " |")
    for r in rows:
        cells = " | ".join(f"{r['cublas_us'] / r[key]:.2f}x ({r[key]:.1f})" for key in keys)
        print(f"| {r['shape']} | {r['m']} | {r['cublas_us']:.1f} | {cells} |")
    for m in ms:
        sel = [r for r in rows if r["m"] == m]
        if sel:
            gm = {key: torch.tensor([r["cublas_us"] / r[key] for r in sel]).log().mean().exp().item() for key in keys}
            print(f"geomean M={m}: " + " ".join(f"{key}={v:.2f}x" for key, v in gm.items()))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
