"""Decode attention tile sweep: splits, keys per step, warps and stages of the Triton paged kernel.

Qwen2.5-7B attention shape (28 query heads, 4 KV heads, head dim 128, 16-token blocks), every
sequence at the same context, caches rotated over 8 layers' worth of buffers so the K/V come from
HBM; one call per layer in a CUDA graph, median of replays. Prints us per call and achieved TB/s
(K + V bytes read) for each variant, best first per batch size.

    python benchmarks/probe_attention.py --batches 16,64,256 --ctx 768
    python benchmarks/probe_attention.py --layouts token,head --floor   # cache layouts, streaming floor

``--layouts``: ``token`` is the engine's cache, [blocks, block_size, kv_heads, head_dim] (one head's
keys of a block are 256-byte pieces 1 KB apart); ``head`` stores [blocks, kv_heads, block_size,
head_dim] (a head's 16 keys of a block in one 4 KB run) and hands the kernel the same logical view
through strides. ``--floor`` also times a plain streaming read of the same number of K/V bytes.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import time_graph  # noqa: E402
from probe_floor import stream_us  # noqa: E402

from qerl_cli.layers.triton_attention import num_splits_for, paged_decode_attention_triton, tile_for  # noqa: E402


def cache(blocks: int, bs: int, hk: int, d: int, layout: str) -> torch.Tensor:
    """A [blocks, bs, hk, d] cache view; ``head`` keeps each head's block keys contiguous."""
    if layout == "token":
        return torch.randn(blocks, bs, hk, d, device="cuda", dtype=torch.bfloat16)
    return torch.randn(blocks, hk, bs, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--ctx", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--layouts", default="token")
    ap.add_argument("--floor", action="store_true")
    ap.add_argument("--splits", default="2,4,8,16,32")
    ap.add_argument("--block-ns", default="32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="1,2,3")
    args = ap.parse_args(argv)
    hq, hk, d, bs = 28, 4, 128, 16
    print(f"# {torch.cuda.get_device_name()} ctx {args.ctx}", flush=True)
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    for b, layout in itertools.product(ints(args.batches), args.layouts.split(",")):
        nb = -(-args.ctx // bs)
        blocks = b * nb + 1
        caches = [(cache(blocks, bs, hk, d, layout), cache(blocks, bs, hk, d, layout)) for _ in range(args.layers)]
        tables = (torch.randperm(blocks - 1, device="cuda")[: b * nb] + 1).view(b, nb).int()
        lens = torch.full((b,), args.ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        ref = paged_decode_attention_triton(q, *caches[0], tables, lens, d**-0.5)
        kv_bytes = 2 * b * args.ctx * hk * d * 2
        res = []
        auto = num_splits_for(b, hk)
        if args.floor:
            flat = [torch.cat([k.reshape(-1)[: kv_bytes // 4], v.reshape(-1)[: kv_bytes // 4]]).view(torch.int32)
                    for k, v in caches]
            f_us, f_cfg = stream_us(flat)
            del flat
            print(f"## b={b}: streaming read of the same {kv_bytes / 1e6:.1f} MB: {f_us:.1f} us "
                  f"{kv_bytes / f_us / 1e6:.2f} TB/s {f_cfg}", flush=True)
        grid = itertools.product(sorted({auto, *ints(args.splits)}), ints(args.block_ns), ints(args.warps), ints(args.stages))
        for splits, bn, w, st in grid:
            kw = dict(num_splits=splits, block_n=bn, num_warps=w, num_stages=st)
            try:
                out = paged_decode_attention_triton(q, *caches[0], tables, lens, d**-0.5, **kw)
                err = (out.float() - ref.float()).abs().max().item()
                us = time_graph([lambda c=c, q=q, t=tables, n=lens, kw=kw: paged_decode_attention_triton(q, *c, t, n, d**-0.5, **kw)
                                 for c in caches], target_s=0.05)
            except Exception as e:  # a tile Triton cannot build (shared memory): skip it
                print(f"b={b} {kw}: {type(e).__name__}", flush=True)
                continue
            res.append((us, kw, err))
        res.sort(key=lambda r: r[0])
        bn0, w0, st0 = tile_for(auto)
        cur = next((r for r in res if r[1] == dict(num_splits=auto, block_n=bn0, num_warps=w0, num_stages=st0)), None)
        if cur is None:  # the rule's tile was not in this grid: time it on its own
            cur = (time_graph([lambda c=c, q=q, t=tables, n=lens: paged_decode_attention_triton(q, *c, t, n, d**-0.5)
                               for c in caches], target_s=0.05), None, 0.0)
        print(f"## b={b} {layout}: current (splits {auto}, {bn0}, {w0} warps, {st0} stages) {cur[0]:.1f} us "
              f"{kv_bytes / cur[0] / 1e6:.2f} TB/s", flush=True)
        for us, kw, err in res[:8]:
            print(f"{us:7.1f} us {kv_bytes / us / 1e6:5.2f} TB/s err {err:.1e} {kw}", flush=True)
        del caches
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
