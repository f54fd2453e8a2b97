"""The pairing epilogues against the kernels they replace, one run each:

- SwiGLU in the gate/up GEMM (``gemm_fwd.nvfp4_swiglu``) against ``nvfp4_matmul`` + ``layers.fused.silu_mul``;
- rotary + paged-cache write in the q/k/v GEMM (``gemm_fwd.nvfp4_qkv_rope``) against ``nvfp4_matmul`` +
  ``layers.fused.rope_`` (16-token cache blocks, distinct slots, random positions).

Qwen2.5-7B and -32B shapes, the table's tile at each M, weights rotated past L2 as in bench_kernels.py;
both paths' outputs are compared first (bit-identical, or for a halved launch nearly: gemm_fwd).

    python benchmarks/bench_epilogues.py --ms 1,4,16,32,64,128,256
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels import SHAPES, ShapeData, add_probe_args, time_graph  # noqa: E402


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
    tile = _tile(cfg)
    if paired(0) is None:
        return f"| {model} gate_up | {m} | {tile} | - | not paired | - |"
    y, y_ref = paired(0), unfused(0)
    # Bit-identical outside halved launches, which halve other rows (gemm_fwd.nvfp4_swiglu).
    near = float((y.float() - y_ref.float()).norm() / y_ref.float().norm()) < 1e-3
    assert torch.equal(y, y_ref) if not cfg.halves else near, (model, m)
    t_u = time_graph([lambda i=i: unfused(i) for i in range(d.r4)])
    t_p = time_graph([lambda i=i: paired(i) for i in range(d.r4)])
    return f"| {model} gate_up | {m} | {tile} | {t_u:.1f} | {t_p:.1f} | {t_u / t_p:.3f} |"


def bench_rope_point(model: str, d: ShapeData, m: int, nq: int, nk: int, head: int = 128) -> str:
    """One row for the q/k/v GEMM: GEMM + rotary kernel against the rotary epilogue."""
    from qerl_kernels.gemm_fwd import nvfp4_matmul, nvfp4_qkv_rope
    from qerl_kernels.gemm_gluon import RopeEpilogue
    from qerl_kernels.tile_configs import fwd_config

    from qerl_cli.layers import fused
    from qerl_cli.layers.rotary import RotaryEmbedding

    x = torch.randn(m, d.k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(d.n, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 4096, (m,), device="cuda")
    slots = torch.randperm(16 * max(m, 16), device="cuda")[:m]
    cos_sin = RotaryEmbedding(head, 4096, 1e6, device="cuda").cos_sin
    kc, vc = (torch.zeros(max(m, 16), 16, nk // head, head, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rope = RopeEpilogue(positions, cos_sin, slots, kc, vc, nq, nk, head)

    def two_kernels(i):
        y = nvfp4_matmul(x, d.packed[i], d.scale[i], d.gs, bias=bias, twiddled=d.tw, blocked=d.bl)
        q, k, v = (t.view(m, -1, head) for t in y.split([nq, nk, nk], dim=-1))
        fused.rope_(q, k, positions, cos_sin, cache=(v, kc, vc, slots))
        return y

    def epilogue(i):
        return nvfp4_qkv_rope(x, d.packed[i], d.scale[i], d.gs, bias, rope, twiddled=d.tw, blocked=d.bl)

    cfg = fwd_config(m, d.n, d.k)
    tile = _tile(cfg)
    if epilogue(0) is None:
        return f"| {model} qkv | {m} | {tile} | - | not paired | - |"
    y = epilogue(0)
    kc_e = kc.clone()
    y_ref = two_kernels(0)
    same = torch.equal(y, y_ref) and torch.equal(kc_e, kc)
    t_u = time_graph([lambda i=i: two_kernels(i) for i in range(d.r4)])
    t_p = time_graph([lambda i=i: epilogue(i) for i in range(d.r4)])
    return f"| {model} qkv | {m} | {tile} | {t_u:.1f} | {t_p:.1f} | {t_u / t_p:.3f} |" + ("" if same else " (bits differ)")


def _tile(cfg) -> str:
    kind = "ws" if cfg.ws else "tma" if cfg.xtma else "gluon" if cfg.gluon else "triton"
    return f"{kind} {cfg.bm}x{cfg.bn} split {cfg.split_k}{' sk' if cfg.sk else ''}{' halves' if cfg.halves else ''}"


QKV = {"7B": (3584, 512), "32B": (5120, 1024)}  # (q width, k width)


def sweep_point(model: str, layer: str, d: ShapeData, m: int) -> str:
    """Every Gluon candidate tile of this M (``fwd_candidates``, split-K from ``choose_split`` as the
    sweep sets it, and the table's) timed with the epilogue: is the table's tile still the best one
    once the epilogue rides on it?"""
    from dataclasses import replace

    from qerl_kernels.gemm_fwd import nvfp4_qkv_rope, nvfp4_swiglu
    from qerl_kernels.gemm_gluon import RopeEpilogue
    from qerl_kernels.tile_configs import choose_split, fwd_candidates, fwd_config

    from qerl_cli.layers.rotary import RotaryEmbedding

    x = torch.randn(m, d.k, device="cuda", dtype=torch.bfloat16)
    rope = None
    if layer == "qkv":
        nq, nk = QKV[model]
        kc, vc = (torch.zeros(max(m, 16), 16, nk // 128, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        rope = RopeEpilogue(torch.randint(0, 4096, (m,), device="cuda"), RotaryEmbedding(128, 4096, 1e6, device="cuda").cos_sin,
                            torch.randperm(16 * max(m, 16), device="cuda")[:m], kc, vc, nq, nk, 128)

    def run(cfg, i):
        if rope is None:
            return nvfp4_swiglu(x, d.packed[i], d.scale[i], d.gs, config=cfg, twiddled=d.tw, blocked=d.bl)
        return nvfp4_qkv_rope(x, d.packed[i], d.scale[i], d.gs, None, rope, config=cfg, twiddled=d.tw, blocked=d.bl)

    table = fwd_config(m, d.n, d.k)
    cands = [table]
    for c in fwd_candidates(m):
        if c.gluon and not c.sk:
            split = c.split_k if c.halves else choose_split(m, d.n, d.k, c)
            cands += [replace(c, split_k=s) for s in sorted({1, split, 2 * split, max(1, split // 2)})
                      if not (c.halves and s != 1)]
    times = {}
    for c in dict.fromkeys(cands):
        if run(c, 0) is None:
            continue
        times[c] = time_graph([lambda i=i, c=c: run(c, i) for i in range(d.r4)], target_s=0.05)
    best = min(times, key=times.get)
    return (f"| {model} {layer} | {m} | {_tile(table)}: {times.get(table, float('nan')):.1f} | {_tile(best)} "
            f"maxnreg {best.maxnreg} pregs {best.pregs} half {best.half}: {times[best]:.1f} | {len(times)} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_args(ap, "gate_up,qkv")
    ap.set_defaults(ms="1,4,16,32,64,128,256")
    ap.add_argument("--sweep", action="store_true", help="time every Gluon candidate with the epilogue instead")
    args = ap.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}")
    if args.sweep:
        print("| shape | M | table tile: us | best candidate: us | candidates |\n| --- | --- | --- | --- | --- |")
    else:
        print("| shape | M | tile | GEMM + its elementwise kernel (us) | epilogue (us) | ratio |")
        print("| --- | --- | --- | --- | --- | --- |")
    for model in args.models.split(","):
        for layer in args.layers.split(","):
            n, k = SHAPES[(model, layer)]
            d = ShapeData(n, k, seed=n + k)
            for m in map(int, args.ms.split(",")):
                if args.sweep:
                    row = sweep_point(model, layer, d, m)
                elif layer == "gate_up":
                    row = bench_point(model, d, m)
                else:
                    row = bench_rope_point(model, d, m, *QKV[model])
                print(row, flush=True)
            del d
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
