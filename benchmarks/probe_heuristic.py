"""The tile heuristic for shapes the table does not hold, measured (a probe).

Users run models whose Linear shapes are not in kernels/tile_table.py (Llama-3-8B, Qwen2.5-14B, ...);
they get ``tile_configs.heuristic_fwd``. This times, per shape and M: cuBLAS bf16, the plain Triton
heuristic tile (``gluon=False``: what such shapes ran before the Gluon rules), the heuristic as shipped
(Gluon tiles by the table's rules), and for the table's own shapes the table entry, so the rules can
be checked against the sweep that produced them.

    python benchmarks/probe_heuristic.py --ms 1,4,16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import SHAPES, ShapeData, bench_cublas_fwd, bench_fwd_point, geomean  # noqa: E402

OTHER_SHAPES = {  # (model, layer) -> (N, K), fused q/k/v and gate/up as qerl loads them
    ("Llama-3-8B", "qkv"): (4096 + 2 * 1024, 4096),
    ("Llama-3-8B", "o"): (4096, 4096),
    ("Llama-3-8B", "gate_up"): (2 * 14336, 4096),
    ("Llama-3-8B", "down"): (4096, 14336),
    ("Qwen2.5-14B", "gate_up"): (2 * 13824, 5120),
    ("Qwen2.5-14B", "down"): (5120, 13824),
    ("Qwen2.5-1.5B", "qkv"): (1536 + 2 * 256, 1536),
    ("Qwen2.5-1.5B", "gate_up"): (2 * 8960, 1536),
    ("Qwen2.5-1.5B", "down"): (1536, 8960),
}


def main(argv=None) -> int:
    from qerl_kernels import tile_configs as tc

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--sets", default="table,other", help="table: the Qwen2.5 7B/32B shapes; other: OTHER_SHAPES")
    args = ap.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}", flush=True)
    shapes = {**(SHAPES if "table" in args.sets else {}), **(OTHER_SHAPES if "other" in args.sets else {})}
    gains, vs_table = {}, {}
    for (model, layer), (n, k) in shapes.items():
        d = ShapeData(n, k, seed=n + k)
        for m in map(int, args.ms.split(",")):
            cub = bench_cublas_fwd(d, m)
            old, _ = bench_fwd_point(d, m, tc.heuristic_fwd(m, n, k, gluon=False))
            new_cfg = tc.heuristic_fwd(m, n, k)
            new, err = bench_fwd_point(d, m, new_cfg)
            assert err < 2e-2, (model, layer, m, err)
            kind = "ws" if new_cfg.ws else "gluon" if new_cfg.gluon else "triton"
            line = (f"{model} {layer} M={m}: cuBLAS {cub:.1f} | Triton heuristic {old:.1f} ({cub / old:.2f}x) | "
                    f"heuristic {new:.1f} ({cub / new:.2f}x, {kind} split {new_cfg.split_k})")
            hit = tc.FWD_TABLE.get((tc.m_bucket(m), n, k))
            if hit is not None:
                tab, _ = bench_fwd_point(d, m, hit)
                line += f" | table {tab:.1f} ({cub / tab:.2f}x)"
                vs_table.setdefault(m, []).append(tab / new)
            else:
                gains.setdefault(m, []).append(old / new)
            print(line, flush=True)
        del d
        torch.cuda.empty_cache()
    for m, v in gains.items():
        print(f"M={m}: shapes outside the table, Triton heuristic time / heuristic time, geomean {geomean(v):.3f} "
              f"(min {min(v):.2f}, max {max(v):.2f})")
    for m, v in vs_table.items():
        print(f"M={m}: table shapes, table time / heuristic time, geomean {geomean(v):.3f} "
              f"(min {min(v):.2f}, max {max(v):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
