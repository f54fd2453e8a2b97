"""What the 16-sequence decode attention pays for besides bytes: its chain of dependent round trips.

At 16 sequences and context 768 the engine's kernel (qerl_cli/layers/triton_attention.py) takes
~15 us per layer where a streaming read of the same 25 MB takes ~10 us, and its time falls only
~3.6 us when the context halves: most of it is a fixed chain (context length -> block table -> K/V
-> partial store -> arrival counter -> merge loads). This probe runs a copy of the split kernel with
switches that cut one link each, so the cost of every link is measured in one run:

- ``ctx_arg``: the context length arrives as a kernel argument (no load before the split bounds);
- ``no_bt``: block ids computed from a contiguous table (no block-table load before the K/V loads);
- ``no_merge``: the splits' partials are written and nothing merges them (wrong output, timing only);
- ``chunk``: a split covers a fixed CHUNK of keys (start = split x CHUNK), so the block-table load
  does not wait for the context length; the grid covers the table's width and splits past the
  context exit. This one is a correct variant, the candidate for the engine.

Qwen2.5-7B attention shape, caches rotated over 8 layers (HBM), CUDA-graph medians (bench_kernels.time_graph).

    python benchmarks/probe_attn_chain.py --batches 16 --ctxs 384,768,1280
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import time_graph  # noqa: E402
from qerl_kernels.gemm_fwd import arrival_counters  # noqa: E402

from qerl_cli.layers.paged_attention import paged_decode_attention_torch  # noqa: E402
from qerl_cli.layers.triton_attention import paged_decode_attention_triton  # noqa: E402


@triton.jit
def _probe_kernel(Q, K, V, BT, CL, OP, LSE, CNT, OUT, ctx_val, bt_width, nb_contig,
                  stride_qb, stride_qh, stride_kn, stride_kt, stride_kh, stride_bt,
                  stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_b, stride_h, scale,
                  GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, CTX_ARG: tl.constexpr, NO_BT: tl.constexpr, MERGE: tl.constexpr,
                  CHUNK: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    if CTX_ARG:
        ctx = ctx_val
    else:
        ctx = tl.load(CL + b)
    if CHUNK > 0:
        start = sp * CHUNK
        end = tl.minimum(start + CHUNK, ctx)
        alive = tl.cdiv(ctx, CHUNK)
    else:
        per = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = sp * per
        end = tl.minimum(start + per, ctx)
        alive = ctx * 0 + NUM_SPLITS
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    gmask = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    if CHUNK > 0:
        lo = start
        hi = start + CHUNK
    else:
        lo = start
        hi = end
    for s in range(lo, hi, BLOCK_N):
        offs = s + tl.arange(0, BLOCK_N)
        nmask = offs < end
        if NO_BT:
            blk = (b * nb_contig + offs // BS).to(tl.int64)
        elif CHUNK > 0:
            blk = tl.load(BT + b * stride_bt + offs // BS, mask=offs < bt_width * BS, other=0).to(tl.int64)
        else:
            blk = tl.load(BT + b * stride_bt + offs // BS, mask=nmask, other=0).to(tl.int64)
        row = blk * stride_kn + (offs % BS) * stride_kt + kvh * stride_kh
        k = tl.load(K + row[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k)) * scale
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.where(m_new > float("-inf"), tl.exp(m_i - m_new), 1.0)
        p = tl.exp(qk - tl.where(m_new > float("-inf"), m_new, 0.0)[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + row[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    if (start < ctx) | (CHUNK == 0):  # the ctx-derived splits all arrive, empty ones too
        tl.store(OP + b * stride_ob + heads[:, None] * stride_oh + sp * stride_os + d[None, :], out, mask=gmask[:, None])
        tl.store(LSE + b * stride_lb + heads * stride_lh + sp, lse, mask=gmask)
        if MERGE:
            tl.debug_barrier()
            slot = CNT + b * tl.num_programs(1) + kvh
            if tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu") == alive - 1:
                lse_base = LSE + b * stride_lb + heads * stride_lh
                m = tl.full([GP], float("-inf"), tl.float32)
                for j in tl.static_range(NUM_SPLITS):
                    m = tl.maximum(m, tl.load(lse_base + j, mask=gmask & (g * 0 + j < alive), other=float("-inf"),
                                              cache_modifier=".cg"))
                num = tl.zeros([GP, D], tl.float32)
                den = tl.zeros([GP], tl.float32)
                for j in tl.static_range(NUM_SPLITS):
                    lj = tl.load(lse_base + j, mask=gmask & (g * 0 + j < alive), other=float("-inf"), cache_modifier=".cg")
                    w = tl.where(lj > float("-inf"), tl.exp(lj - m), 0.0)
                    oj = tl.load(OP + b * stride_ob + heads[:, None] * stride_oh + j * stride_os + d[None, :],
                                 mask=(gmask & (g * 0 + j < alive))[:, None], other=0.0, cache_modifier=".cg")
                    num += w[:, None] * oj
                    den += w
                tl.store(OUT + b * stride_b + heads[:, None] * stride_h + d[None, :],
                         (num / den[:, None]).to(OUT.dtype.element_ty), mask=gmask[:, None])
                tl.atomic_xchg(slot, 0)


def launch(q, kc, vc, tables, lens, ctx, splits, *, ctx_arg=False, no_bt=False, merge=True, chunk=0, block_n=64,
           num_warps=8, num_stages=2):
    b, hq, d = q.shape
    _, bs, hk, _ = kc.shape
    group = hq // hk
    if chunk:
        splits = triton.cdiv(tables.shape[1] * bs, chunk)
    op = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    _probe_kernel[(b, hk, splits)](
        q, kc, vc, tables, lens, op, lse, arrival_counters(q.device), out, ctx, tables.shape[1], tables.shape[1],
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), tables.stride(0),
        op.stride(0), op.stride(1), op.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), d**-0.5,
        GROUP=group, GP=max(16, triton.next_power_of_2(group)), D=d, BS=bs, BLOCK_N=block_n, NUM_SPLITS=splits,
        CTX_ARG=ctx_arg, NO_BT=no_bt, MERGE=merge, CHUNK=chunk, num_warps=num_warps, num_stages=num_stages)
    return out


VARIANTS = {
    "base": {},
    "ctx_arg": dict(ctx_arg=True),
    "no_bt": dict(no_bt=True),
    "no_merge": dict(merge=False),
    "all_three": dict(ctx_arg=True, no_bt=True, merge=False),
    "chunk128": dict(chunk=128),
    "chunk128_w4": dict(chunk=128, num_warps=4),
    "chunk192": dict(chunk=192),
    "chunk64": dict(chunk=64),
    "chunk128_bn128": dict(chunk=128, block_n=128),
    "chunk256": dict(chunk=256),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16")
    ap.add_argument("--ctxs", default="384,768,1280")
    ap.add_argument("--max-ctx", type=int, default=1280, help="table width in tokens (the engine's longest sequence)")
    ap.add_argument("--splits", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)
    hq, hk, d, bs = 28, 4, 128, 16
    print(f"# {torch.cuda.get_device_name()}", flush=True)
    for b in [int(x) for x in args.batches.split(",")]:
        nb = -(-args.max_ctx // bs)
        blocks = b * nb
        caches = [(torch.randn(blocks, bs, hk, d, device="cuda", dtype=torch.bfloat16),
                   torch.randn(blocks, bs, hk, d, device="cuda", dtype=torch.bfloat16)) for _ in range(args.layers)]
        shuffled = torch.randperm(blocks, device="cuda").view(b, nb).int()
        contig = torch.arange(blocks, device="cuda").view(b, nb).int()
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        for ctx in [int(x) for x in args.ctxs.split(",")]:
            lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
            engine = time_graph([lambda c=c, q=q, t=shuffled, n=lens: paged_decode_attention_triton(q, *c, t, n, d**-0.5) for c in caches],
                                target_s=0.05)
            kv = 2 * b * ctx * hk * d * 2
            print(f"## b={b} ctx={ctx}: engine kernel {engine:.1f} us ({kv / engine / 1e6:.2f} TB/s)", flush=True)
            for name in args.variants.split(","):
                kw = VARIANTS[name]
                tables = contig if kw.get("no_bt") else shuffled
                out = launch(q, *caches[0], tables, lens, ctx, args.splits, **kw)
                ref = paged_decode_attention_torch(q.float(), caches[0][0].float(), caches[0][1].float(), tables, lens,
                                                   d**-0.5)
                err = (out.float() - ref).abs().max().item() if kw.get("merge", True) else float("nan")
                us = time_graph([lambda c=c, q=q, t=tables, n=lens, x=ctx, kw=kw: launch(q, *c, t, n, x, args.splits, **kw) for c in caches],
                                target_s=0.05)
                print(f"{name:>16} {us:6.1f} us {kv / us / 1e6:5.2f} TB/s err {err:.1e}", flush=True)
        del caches
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
