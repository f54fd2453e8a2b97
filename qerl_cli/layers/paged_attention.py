"""Decode attention over a paged KV cache: one query token per sequence, K/V scattered in blocks.

On CUDA a Triton split-K ("flash-decoding") kernel reads each sequence's blocks once per KV head and
serves all the query heads of that group from the same tile (GQA), so the step reads exactly the
cached bytes once. Elsewhere (CPU tests), a gather into a padded [B, S, Hk, D] tensor plus a masked
SDPA call gives the same result with plain torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len=0,
                           korder: bool = False):
    """``korder``: each sequence's [Hq D] output row in the MMA's K order (qerl_kernels.decode.k_order),
    for an o_proj whose tile reads it so (the Triton kernel writes it there; the torch path permutes)."""
    if q.is_cuda:
        from qerl_cli.layers import triton_attention

        if triton_attention.supported(q.shape[-1]):
            return triton_attention.paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                                  korder=korder)
    o = paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len)
    if korder:
        from qerl_kernels.korder import to_k_order

        o = to_k_order(o.reshape(o.shape[0], -1)).view(o.shape)
    return o
