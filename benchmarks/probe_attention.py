"""Decode attention tile sweep: splits, keys per step, warps and stages of the Triton paged kernel.

Qwen2.5-7B attention shape (28 query heads, 4 KV heads, head dim 128, 16-token blocks), every
sequence at the same context, caches rotated over 8 layers' worth of buffers so the K/V come from
HBM; one call per layer in a CUDA graph, median of replays. Prints us per call and achieved TB/s
(K + V bytes read) for each variant, best first per batch size.

    python benchmarks/probe_attention.py --batches 16,64,256 --ctx 768
    python benchmarks/probe_attention.py --batches 16,64,256 --ctx 768 --group 8 --prompt 256
        # siblings of 8 share a 256-token prompt: the kernel without and with the shared-prefix table,
        # over prefix split counts; TB/s there counts the K/V bytes every sequence attends over
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import time_graph  # noqa: E402

from qerl_cli.layers.paged_attention import prefix_table  # noqa: E402
from qerl_cli.layers.triton_attention import num_splits_for, paged_decode_attention_triton  # noqa: E402


def shared_prefix(args, hq, hk, d, bs) -> None:
    """Groups of ``--group`` rows sharing ``--prompt`` tokens of blocks: plain kernel vs prefix table."""
    for b in map(int, args.batches.split(",")):
        nb, pb = -(-args.ctx // bs), args.prompt // bs
        groups = -(-b // args.group)
        blocks = groups * pb + b * (nb - pb) + 1
        caches = [(torch.randn(blocks, bs, hk, d, device="cuda", dtype=torch.bfloat16),
                   torch.randn(blocks, bs, hk, d, device="cuda", dtype=torch.bfloat16)) for _ in range(args.layers)]
        ids = (torch.randperm(blocks - 1) + 1).tolist()
        prompt = [[ids.pop() for _ in range(pb)] for _ in range(groups)]
        tables = torch.tensor([prompt[i // args.group] + [ids.pop() for _ in range(nb - pb)] for i in range(b)],
                              dtype=torch.int32, device="cuda")
        lens = torch.full((b,), args.ctx, dtype=torch.int32, device="cuda")
        table = prefix_table([i // args.group for i in range(b)], [pb * bs] * b, hq // hk).cuda()
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        ref = paged_decode_attention_triton(q, *caches[0], tables, lens, d**-0.5)
        kv_bytes = 2 * b * args.ctx * hk * d * 2
        auto = num_splits_for(b, hk)
        rows = []
        for label, kw in [("plain", {})] + [(f"prefix, {p} prefix splits", dict(prefix=table, num_prefix=p))
                                            for p in sorted({auto, 1, 2, 4, 8, 16})]:
            out = paged_decode_attention_triton(q, *caches[0], tables, lens, d**-0.5, **kw)
            err = (out.float() - ref.float()).abs().max().item()
            us = time_graph([lambda c=c, kw=kw, q=q, t=tables, n=lens: paged_decode_attention_triton(q, *c, t, n, d**-0.5, **kw)
                             for c in caches], target_s=0.05)
            rows.append((label, us, err))
        base = rows[0][1]
        print(f"## b={b} group {args.group} prompt {pb * bs} ctx {args.ctx} (own splits {auto})", flush=True)
        for label, us, err in rows:
            print(f"{us:7.1f} us {kv_bytes / us / 1e6:5.2f} TB/s-equiv {base / us:5.2f}x err {err:.1e}  {label}", flush=True)
        del caches
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--ctx", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--group", type=int, default=1, help="> 1: rows in sibling groups sharing --prompt tokens")
    ap.add_argument("--prompt", type=int, default=256)
    args = ap.parse_args(argv)
    hq, hk, d, bs = 28, 4, 128, 16
    print(f"# {torch.cuda.get_device_name()} ctx {args.ctx}", flush=True)
    if args.group > 1:
        shared_prefix(args, hq, hk, d, bs)
        return 0
    for b in map(int, args.batches.split(",")):
        nb = -(-args.ctx // bs)
        blocks = b * nb + 1
        caches = [(torch.randn(blocks, bs, hk, d, device="cuda", dtype=torch.bfloat16),
                   torch.randn(blocks, bs, hk, d, device="cuda", dtype=torch.bfloat16)) for _ in range(args.layers)]
        tables = (torch.randperm(blocks - 1, device="cuda")[: b * nb] + 1).view(b, nb).int()
        lens = torch.full((b,), args.ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        ref = paged_decode_attention_triton(q, *caches[0], tables, lens, d**-0.5)
        kv_bytes = 2 * b * args.ctx * hk * d * 2
        res = []
        auto = num_splits_for(b, hk)
        for splits, bn, w, st in itertools.product(sorted({auto, 2, 4, 8, 16, 32}), (32, 64, 128), (4, 8), (1, 2, 3)):
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
        cur = next(r for r in res if r[1] == dict(num_splits=auto, block_n=64, num_warps=4, num_stages=2))
        print(f"## b={b}: current (splits {auto}, 64, 4 warps, 2 stages) {cur[0]:.1f} us "
              f"{kv_bytes / cur[0] / 1e6:.2f} TB/s", flush=True)
        for us, kw, err in res[:8]:
            print(f"{us:7.1f} us {kv_bytes / us / 1e6:5.2f} TB/s err {err:.1e} {kw}", flush=True)
        del caches
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
