"""Decode attention over a paged KV cache: one query token per sequence, K/V scattered in blocks.

On CUDA a Triton split-K ("flash-decoding") kernel reads each sequence's blocks once per KV head and
serves all the query heads of that group from the same tile (GQA), so the step reads exactly the
cached bytes once. Elsewhere (CPU tests), a gather into a padded [B, S, Hk, D] tensor plus a masked
SDPA call gives the same result with plain torch.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

PREFIX_MEMBERS = 8  # most siblings one prefix program of the Triton kernel serves


def prefix_chunk(heads_per_kv: int) -> int:
    """Siblings per prefix program: 64 query rows (8 siblings x 8 padded heads for 5-8 heads per KV head)."""
    padded = 1 << max(0, heads_per_kv - 1).bit_length()
    return max(1, min(PREFIX_MEMBERS, 64 // padded))


def prefix_table(keys: list, shared: list[int], heads_per_kv: int, rows: int | None = None) -> torch.Tensor:
    """The decode batch's shared-prefix table for the Triton kernel: int32 [rows, 2 + PREFIX_MEMBERS].

    ``keys[i]``: batch row i's prompt group (None: shares nothing); ``shared[i]``: how many leading
    tokens it holds in blocks shared with that group (the prompt's full blocks). Siblings present in
    the batch are cut into chunks of ``prefix_chunk`` rows; the first row of each chunk leads it.
    Column 0: row i's prefix length if it is in a chunk of two or more, else 0 (a lone row gains nothing
    from reading its prefix separately); column 1: the prefix length of the chunk row i leads, else 0;
    columns 2..: that chunk's rows, -1 padded."""
    rows = len(keys) if rows is None else rows
    table = torch.full((rows, 2 + PREFIX_MEMBERS), -1, dtype=torch.int32)
    table[:, :2] = 0
    groups: dict = defaultdict(list)
    for i, (key, n) in enumerate(zip(keys, shared)):
        if key is not None and n > 0:
            groups[key].append(i)
    chunk = prefix_chunk(heads_per_kv)
    for members in groups.values():
        n = shared[members[0]]
        if any(shared[i] != n for i in members):
            raise ValueError(f"rows {members} share a prompt but not its length ({[shared[i] for i in members]})")
        for c in range(0, len(members), chunk):
            part = members[c:c + chunk]
            if len(part) < 2:
                continue
            table[part[0], 1] = n
            table[part[0], 2:2 + len(part)] = torch.tensor(part, dtype=torch.int32)
            table[part, 0] = n
    return table


def paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len=0):
    """q [B, Hq, D]; caches [N, block, Hk, D]; block_tables [B, M]; context_lens [B] -> [B, Hq, D]."""
    b, hq, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    nblk = block_tables.shape[1]
    if max_context_len:
        nblk = min(nblk, -(-max_context_len // bs))
    tables = block_tables[:, :nblk].long()
    k = k_cache[tables].reshape(b, nblk * bs, hk, d)
    v = v_cache[tables].reshape(b, nblk * bs, hk, d)
    valid = torch.arange(nblk * bs, device=q.device)[None, :] < context_lens[:, None].long()
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=valid[:, None, None, :], scale=scale,
        enable_gqa=hq != hk,
    )
    return o.squeeze(2)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len=0, prefix=None):
    """``prefix``: the batch's ``prefix_table`` (the Triton kernel then reads shared prompt blocks once per
    chunk of siblings; the torch path reads each row's own table and needs none)."""
    if q.is_cuda:
        from qerl_cli.layers import triton_attention

        if triton_attention.supported(q.shape[-1]):
            return triton_attention.paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                                  prefix=prefix)
    return paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len)
