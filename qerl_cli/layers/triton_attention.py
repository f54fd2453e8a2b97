"""Triton split-K paged decode attention (flash-decoding) with GQA sharing.

Grid (batch, kv_head, split): each program walks a contiguous slice of one sequence's context,
gathering K/V rows through the block table, and serves all ``Hq/Hk`` query heads of its KV head
with one ``tl.dot`` per tile (query rows padded to 16, the minimum MMA height), so each cached byte
is read once per step. Splitting the context keeps the GPU full when the batch is small (16
sequences x 4 KV heads is 64 programs for 132 SMs). The splits merge through their log-sum-exp: the
last program of a (sequence, KV head) to finish does it (an int32 arrival counter per pair from
qerl_kernels' split-K counters, left zero again), so decode attention is one launch per layer; a second merge kernel is the fallback
when no counters exist (a first call during CUDA-graph capture). Loop bounds come from
``context_lens`` on the device, so the launch is CUDA-graph safe.

Measured on an H100 (docs/benchmarks.md, rollout, tenth pass): at 16 sequences and context 768 the
separate merge was 28 launches of ~2.9 us per decode step. Fused, the captured step went from 3.558 to
3.519 ms (about 1%); the split kernel grew from 381 to 446 us, because it now does the merge.

Once the (sequence, KV head) pairs alone fill the SMs (33+ sequences on a 7B model), every program
takes a whole context, 128 keys a step, and writes its output itself: no partials, no counter, no
merge. H100, context 768 (docs/benchmarks.md, rollout, nineteenth pass): 64 sequences 42.7 -> 39.6 us
per layer (one run), 256 sequences 142.8 us (146.6 in an earlier run, when one split still paid the
merge), decode step at 64 sequences 5.732 -> 5.66 ms. The merge is what splitting costs: at 16 sequences a copy of this kernel
that skips it runs 13.7 against 15.6 us (benchmarks/probe_attn_chain.py), while a fixed split size
that lets the block-table load skip the wait for the context length gains nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from qerl_kernels.decode import k_order
from qerl_kernels.gemm_fwd import COUNTER_SLOTS, arrival_counters


@triton.jit
def _split_kernel(Q, K, V, BT, CL, OP, LSE, stride_qb, stride_qh, stride_kn, stride_kt, stride_kh, stride_bt,
                  stride_ob, stride_oh, stride_os, stride_lb, stride_lh, scale,
                  GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, PREC: tl.constexpr, CNT=None, OUT=None, stride_b=0, stride_h=0,
                  FUSED: tl.constexpr = False, KORDER: tl.constexpr = False):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(CL + b)
    per = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = sp * per
    end = tl.minimum(start + per, ctx)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    gmask = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for s in range(start, end, BLOCK_N):
        offs = s + tl.arange(0, BLOCK_N)
        nmask = offs < end
        blk = tl.load(BT + b * stride_bt + offs // BS, mask=nmask, other=0).to(tl.int64)
        row = blk * stride_kn + (offs % BS) * stride_kt + kvh * stride_kh
        k = tl.load(K + row[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + row[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    if NUM_SPLITS == 1:  # the whole context in this program: nothing to merge
        tl.store(OUT + b * stride_b + _out_cols(heads, d, stride_h, KORDER), out.to(OUT.dtype.element_ty),
                 mask=gmask[:, None])
        return
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(OP + b * stride_ob + heads[:, None] * stride_oh + sp * stride_os + d[None, :], out, mask=gmask[:, None])
    tl.store(LSE + b * stride_lb + heads * stride_lh + sp, lse, mask=gmask)
    if FUSED:
        tl.debug_barrier()  # every thread's partial stores precede the counter's release
        slot = CNT + b * tl.num_programs(1) + kvh
        if tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
            lse_base = LSE + b * stride_lb + heads * stride_lh
            m = tl.full([GP], float("-inf"), tl.float32)
            for j in tl.static_range(NUM_SPLITS):
                m = tl.maximum(m, tl.load(lse_base + j, mask=gmask, other=float("-inf"), cache_modifier=".cg"))
            num = tl.zeros([GP, D], tl.float32)
            den = tl.zeros([GP], tl.float32)
            for j in tl.static_range(NUM_SPLITS):
                lj = tl.load(lse_base + j, mask=gmask, other=float("-inf"), cache_modifier=".cg")
                w = tl.where(lj > float("-inf"), tl.exp(lj - m), 0.0)
                oj = tl.load(OP + b * stride_ob + heads[:, None] * stride_oh + j * stride_os + d[None, :],
                             mask=gmask[:, None], other=0.0, cache_modifier=".cg")
                num += w[:, None] * oj
                den += w
            tl.store(OUT + b * stride_b + _out_cols(heads, d, stride_h, KORDER),
                     (num / den[:, None]).to(OUT.dtype.element_ty), mask=gmask[:, None])
            tl.atomic_xchg(slot, 0)


@triton.jit
def _out_cols(heads, d, stride_h, KORDER: tl.constexpr):
    """Offsets of heads' rows in a sequence's output; KORDER (stride_h == D): the row of all heads in
    the MMA's K order, as o_proj's TMA-fed tile reads it (qerl_kernels.decode.k_order)."""
    if KORDER:
        cols = k_order(heads[:, None] * stride_h + d[None, :])
    else:
        cols = heads[:, None] * stride_h + d[None, :]
    return cols


@triton.jit
def _merge_kernel(OP, LSE, OUT, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_b, stride_h,
                  NUM_SPLITS: tl.constexpr, SP2: tl.constexpr, D: tl.constexpr, KORDER: tl.constexpr = False):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SP2)
    d = tl.arange(0, D)
    smask = s < NUM_SPLITS
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(smask & (lse > float("-inf")), tl.exp(lse - m), 0.0)
    o = tl.load(OP + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    cols = h * stride_h + d
    if KORDER:
        cols = k_order(cols)
    tl.store(OUT + b * stride_b + cols, out.to(OUT.dtype.element_ty))


def num_splits_for(batch: int, kv_heads: int, sms: int = 132) -> int:
    """Splits of each (sequence, KV head) context: none once the pairs alone fill the SMs (no merge to
    pay), else about two programs per SM."""
    pairs = max(batch * kv_heads, 1)
    if pairs >= sms:
        return 1
    return min(16, triton.next_power_of_2(-(-2 * sms // pairs)))


def tile_for(num_splits: int) -> tuple[int, int, int]:
    """(keys per step, warps, stages): a whole context per program streams 128 keys a step."""
    return (128, 4, 2) if num_splits == 1 else (64, 4, 2)


def supported(head_dim: int) -> bool:
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=None,
                                  block_n: int | None = None, num_warps: int | None = None,
                                  num_stages: int | None = None, fused: bool = True, korder: bool = False):
    """Decode attention of ``q`` [B, Hq, D] over the paged caches [blocks, BS, Hk, D]; ``fused=False``
    merges the splits in a second kernel (what runs anyway when no arrival counters exist). Tile
    arguments left None follow ``num_splits_for`` and ``tile_for``. ``korder`` (Hq D % 128 == 0): each
    sequence's output row [Hq D] in the MMA's K order, for an o_proj whose TMA-fed tile reads it so."""
    b, hq, d = q.shape
    if korder and (hq * d) % 128:
        raise ValueError(f"korder permutes 128-column steps; the output rows have {hq * d} columns")
    _, bs, hk, _ = k_cache.shape
    group = hq // hk
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132
        num_splits = num_splits_for(b, hk, sms)
    dflt = tile_for(num_splits)
    block_n, num_warps, num_stages = block_n or dflt[0], num_warps or dflt[1], num_stages or dflt[2]
    if q.stride(-1) != 1:
        q = q.contiguous()  # rows and heads may be strided (a slice of the fused qkv output): no copy then
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)  # dense even when q is a strided view
    if num_splits == 1:  # the kernel writes ``out`` itself; the partials' buffers are never touched
        op, lse = out.new_empty(1, 1, 1, dtype=torch.float32), out.new_empty(1, 1, dtype=torch.float32)
    else:
        op = torch.empty(b, hq, num_splits, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, hq, num_splits, dtype=torch.float32, device=q.device)
    cnt = arrival_counters(q.device) if fused and num_splits > 1 and b * hk <= COUNTER_SLOTS else None
    _split_kernel[(b, hk, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, op, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        op.stride(0), op.stride(1), op.stride(2), lse.stride(0), lse.stride(1), scale,
        GROUP=group, GP=max(16, triton.next_power_of_2(group)), D=d, BS=bs, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 (tests) stays exact; bf16 ignores it
        CNT=cnt, OUT=out, stride_b=out.stride(0), stride_h=out.stride(1), FUSED=cnt is not None, KORDER=korder,
        num_warps=num_warps, num_stages=num_stages,
    )
    if cnt is not None or num_splits == 1:
        return out
    _merge_kernel[(b, hq)](
        op, lse, out, op.stride(0), op.stride(1), op.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, SP2=max(2, triton.next_power_of_2(num_splits)), D=d, KORDER=korder, num_warps=4,
    )
    return out
