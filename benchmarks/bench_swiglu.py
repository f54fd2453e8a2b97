"""SwiGLU in the gate/up GEMM's epilogue against the GEMM followed by the SwiGLU kernel.

For Qwen2.5-7B and -32B gate/up (the table's tile at each M, weights rotated past L2 as in
bench_kernels.py), one run: microseconds of ``nvfp4_matmul`` + ``layers.fused.silu_mul`` against
``nvfp4_swiglu`` (``gemm_fwd.nvfp4_swiglu``), checking first that both give the same bits (a halved launch: nearly, gemm_fwd.nvfp4_swiglu).

    python benchmarks/bench_swiglu.py --ms 1,4,16,32,64,128,256
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels import SHAPES, ShapeData, time_graph  # noqa: E402


def bench_point(model: str, d: ShapeData, m: int) -> str:
    """One table row: the table's tile at this M, both paths timed in the same run."""
    from qerl_kernels.gemm_fwd import nvfp4_matmul, nvfp4_swiglu
    from qerl_kernels.tile_configs import fwd_config

    from qerl_cli.layers.fused import silu_mul

    x = torch.randn(m, d.k, device="cuda", dtype=torch.bfloat16)

    def unfused(i):
        y = nvfp4_matmul(x, d.packed[i], d.scale[i], d.gs, twiddled=d.tw, blocked=d.bl)
        return silu_mul(*y.chunk(2, -1))

    def paired(i):
        return nvfp4_swiglu(x, d.packed[i], d.scale[i], d.gs, twiddled=d.tw, blocked=d.bl)

    cfg = fwd_config(m, d.n, d.k)
    kind = "ws" if cfg.ws else "tma" if cfg.xtma else "gluon" if cfg.gluon else "triton"
    tile = f"{kind} {cfg.bm}x{cfg.bn} split {cfg.split_k}{' sk' if cfg.sk else ''}{' halves' if cfg.halves else ''}"
    if paired(0) is None:
        return f"| {model} | {m} | {tile} | - | not paired | - |"
    y, y_ref = paired(0), unfused(0)
    # Bit-identical outside halved launches, which halve other rows (gemm_fwd.nvfp4_swiglu).
    near = float((y.float() - y_ref.float()).norm() / y_ref.float().norm()) < 1e-3
    assert torch.equal(y, y_ref) if not cfg.halves else near, (model, m)
    t_u = time_graph([lambda i=i: unfused(i) for i in range(d.r4)])
    t_p = time_graph([lambda i=i: paired(i) for i in range(d.r4)])
    return f"| {model} | {m} | {tile} | {t_u:.1f} | {t_p:.1f} | {t_u / t_p:.3f} |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,4,16,32,64,128,256")
    ap.add_argument("--models", default="7B,32B")
    args = ap.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}")
    print("| model | M | tile | GEMM + SwiGLU (us) | epilogue (us) | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for model in args.models.split(","):
        n, k = SHAPES[(model, "gate_up")]
        d = ShapeData(n, k, seed=n + k)
        for m in map(int, args.ms.split(",")):
            print(bench_point(model, d, m), flush=True)
        del d
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
