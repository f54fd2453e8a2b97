"""One-pass Gumbel-max sampling over the vocabulary on the GPU (untruncated temperature sampling).

The torch path (``sampler.sample`` with truncation) makes ~8 passes over the [B, V] logits (divide,
log-softmax, fp64 exp and cumulative sum, search, gather): at 256 sequences x 152k vocabulary that
is >1 GB of traffic and a dozen launches per step. This kernel reads each logit once: per row (split
into vocabulary chunks that run in parallel, then merged) it draws Philox noise from a per-row seed
(``_exponential``: exact far into the tail), keeps the running
argmax of ``x/T + Gumbel`` and an online log-sum-exp of ``x/T``, and writes the token and its exact
log-probability ``x_tok/T - logsumexp(x/T)``. Per-row seeds (derived from the run seed, the sequence
and its position) make each sequence's sample independent of which other sequences share the batch.
``row_uniforms`` draws the torch path's one uniform per sequence from the same generator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl_cli.engine.triton_truncation import _as_key, _radix_key, _row_max, find_cut


@triton.jit
def _exponential(seed, offs):
    """Exp(1) noise keyed by (seed, token index), so the same however the row is chunked; the Gumbel
    noise is -log of it.

    A rare token wins only with a large Gumbel value, i.e. a tiny exponential. -log(u) from one fp32
    uniform cannot get below ~6e-8 (u's spacing under 1), which capped the Gumbel at ~16 (the clamp
    of u at 1 - 1e-7 that was here: ~16): a token 14 nats under the top was drawn 6% too rarely,
    one 18 under almost never (H200, 2026-11-26 audit). Here w = 1 - u is built from two Philox
    words, keeping relative precision down to 2^-64, and -log(1 - w) is a series for small w, so
    the exponential reaches ~1e-19 (Gumbel ~44): what it still cuts off is below any fp32 logit's
    resolution."""
    r0, r1, _, _ = tl.randint4x(seed, offs)
    w = (r0.to(tl.float32) + r1.to(tl.float32) * 2.3283064365386963e-10) * 2.3283064365386963e-10
    w = tl.minimum(w, 0.99999994)  # the largest fp32 below 1 (r0 near 2^32 rounds up to it)
    series = w * (1.0 + w * (0.5 + w * (0.33333334 + w * (0.25 + w * 0.2))))  # error < w^6 / 6
    e = tl.where(w < 0.01, series, -tl.log(1.0 - w))  # 1 - w exact enough once w >= 0.01
    return tl.maximum(e, 1e-30)


@triton.jit
def _gumbel_partial_kernel(L, SEEDS, PS, PI, PX, PM, PSUM, stride_l, V, chunk, num_chunks, inv_t,
                           PMAX, KCUT, KEEP, TIES, max_chunks, log_min_p,
                           BLOCK: tl.constexpr, TRUNC: tl.constexpr, TIES_ON: tl.constexpr, KEY16: tl.constexpr,
                           CP: tl.constexpr):
    """One (row, vocabulary chunk): best Gumbel score, its index and tempered logit, and the chunk's
    log-sum-exp state (max, sum of exp) of x/T. With ``TRUNC``, over the tokens that
    ``triton_truncation.find_cut`` keeps (the rest count as -inf)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    seed = tl.load(SEEDS + row)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, V)
    if TRUNC:
        floor = _row_max(PMAX, row, max_chunks, CP) + log_min_p
        kcut = _as_key(tl.load(KCUT + row), KEY16)
        keep = tl.load(KEEP + row)
        if TIES_ON:  # ties at the cut before this chunk: the rank of the chunk's first one
            cc = tl.arange(0, CP)
            ties = tl.sum(tl.load(TIES + row * num_chunks + cc, mask=cc < c, other=0), 0)
    m = float("-inf")
    s = 0.0
    best = float("-inf")
    best_i = lo
    best_x = 0.0
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        raw = tl.load(L + row * stride_l + offs, mask=mask, other=float("-inf"))
        x = raw.to(tl.float32) * inv_t
        if TRUNC:
            key = _radix_key(raw, x, KEY16)
            stay = mask & (x >= floor) & (key >= kcut)
            if TIES_ON:
                tie = (stay & (key == kcut)).to(tl.int32)
                n_tie = tl.sum(tie, 0)
                if n_tie > 0:  # ranks only where the cut's tie group has tokens (rarely)
                    stay = stay & ((key > kcut) | (ties + tl.cumsum(tie, 0) - 1 < keep))
                ties += n_tie
            else:
                stay = stay & (key > kcut)
            x = tl.where(stay, x, float("-inf"))
        score = tl.where(mask, x - tl.log(_exponential(seed, offs)), float("-inf"))
        cmax = tl.max(score, 0)
        carg = tl.argmax(score, 0)
        cx = tl.sum(tl.where(offs == start + carg, x, 0.0), 0)
        upd = cmax > best  # strict: the earliest index wins ties, as in one pass over the row
        best_i = tl.where(upd, start + carg, best_i)
        best_x = tl.where(upd, cx, best_x)
        best = tl.maximum(best, cmax)
        new_m = tl.maximum(m, tl.max(x, 0))
        # Rescale against a finite reference: while every logit so far is -inf (a masked block),
        # exp(-inf - -inf) would be NaN and poison the chunk's sum.
        ref = tl.where(new_m == float("-inf"), 0.0, new_m)
        s = s * tl.exp(m - ref) + tl.sum(tl.where(mask, tl.exp(x - ref), 0.0), 0)
        m = new_m
    o = row * num_chunks + c
    tl.store(PS + o, best)
    tl.store(PI + o, best_i)
    tl.store(PX + o, best_x)
    tl.store(PM + o, m)
    tl.store(PSUM + o, s)


@triton.jit
def _gumbel_combine_kernel(PS, PI, PX, PM, PSUM, TOK, LP, num_chunks, CP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CP)
    ok = c < num_chunks
    o = row * num_chunks + c
    score = tl.load(PS + o, mask=ok, other=float("-inf"))
    best = tl.max(score, 0)
    # The lowest-numbered chunk holding the best score (its index is the earliest): ties as one pass.
    win = tl.min(tl.where(ok & (score == best), c, CP), 0)
    tok = tl.sum(tl.where(c == win, tl.load(PI + o, mask=ok, other=0), 0), 0)
    x = tl.sum(tl.where(c == win, tl.load(PX + o, mask=ok, other=0.0), 0.0), 0)
    m_c = tl.load(PM + o, mask=ok, other=float("-inf"))
    m = tl.max(m_c, 0)
    s = tl.sum(tl.where(ok & (m_c > float("-inf")), tl.load(PSUM + o, mask=ok, other=0.0) * tl.exp(m_c - m), 0.0), 0)
    tl.store(TOK + row, tok.to(tl.int64))
    tl.store(LP + row, x - (m + tl.log(s)))


def num_chunks_for(rows: int, vocab: int, block: int = 4096, sms: int = 132) -> int:
    """Vocabulary chunks per row: about two programs per SM in all, each chunk at least one block."""
    return max(1, min(-(-2 * sms // max(rows, 1)), -(-vocab // block)))


def chunking(rows: int, vocab: int, num_chunks: int | None = None, block: int = 4096) -> tuple[int, int]:
    """(chunk length, chunks per row) of the Gumbel kernel: whole blocks, ``num_chunks`` or the default."""
    nc = num_chunks or num_chunks_for(rows, vocab, block)
    chunk = triton.cdiv(triton.cdiv(vocab, nc), block) * block
    return chunk, triton.cdiv(vocab, chunk)


def gumbel_sample(logits: torch.Tensor, temperature: float, seeds: torch.Tensor, num_chunks: int | None = None,
                  sp=None):
    """logits [B, V] (any float dtype), seeds [B] int64 -> (tokens [B] int64, logprobs [B] fp32).

    Each row is split into vocabulary chunks sampled in parallel, then merged (a second, tiny
    kernel): with one program per row, 16 sequences used 16 of 132 SMs and the sampler took ~0.2 ms
    per decode step on an H100 (5% of a 7B NVFP4 step). The noise is keyed by token index, so the
    chunking does not change which token is drawn. ``sp`` (SamplingParams) with min-p / top-k / top-p:
    draw from the truncated distribution (``triton_truncation``), log-probabilities under it.
    """
    b, v = logits.shape
    block = 4096
    chunk, nc = chunking(b, v, num_chunks, block)
    dev = logits.device
    cut = None
    if sp is not None and (sp.min_p > 0 or (sp.top_k and sp.top_k < v) or sp.top_p < 1.0):
        cut = find_cut(logits, sp, chunk, nc)
    part = torch.empty(4, b, nc, dtype=torch.float32, device=dev)
    part_i = torch.empty(b, nc, dtype=torch.int32, device=dev)
    tok = torch.empty(b, dtype=torch.int64, device=dev)
    lp = torch.empty(b, dtype=torch.float32, device=dev)
    # CP from the vocabulary alone, not the chunk count: a batch size must not trigger a recompile
    # (the first 16-sequence step of a run once paid ~0.25 s of Triton JIT for a new CP).
    cp = max(2, triton.next_power_of_2(triton.cdiv(v, block)))
    if cut is None:  # plain temperature sampling: the kernel reads none of the cut's arguments
        trunc, flags = (None, None, None, None, 1, 0.0), dict(TRUNC=False, TIES_ON=False, KEY16=False, CP=2)
    else:
        trunc = (cut.pmax, cut.kcut, cut.keep, cut.ties, cut.num_chunks, cut.log_min_p)
        flags = dict(TRUNC=True, TIES_ON=cut.ties is not None, KEY16=cut.key16, CP=max(cp, cut.cp))
    _gumbel_partial_kernel[(b, nc)](logits, seeds, part[0], part_i, part[1], part[2], part[3], logits.stride(0), v,
                                    chunk, nc, 1.0 / temperature, *trunc, BLOCK=block, num_warps=8, **flags)
    _gumbel_combine_kernel[(b,)](part[0], part_i, part[1], part[2], part[3], tok, lp, nc, CP=cp, num_warps=1)
    return tok, lp


@triton.jit
def _row_uniform_kernel(SEEDS, U, rows, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < rows
    seed = tl.load(SEEDS + r, mask=ok, other=0)
    c0, c1, _, _ = tl.randint4x(seed, tl.zeros([BLOCK], tl.int32))
    u = ((c0.to(tl.uint64) << 21) + (c1 >> 11).to(tl.uint64)).to(tl.float64) * 1.1102230246251565e-16  # 2^-53
    tl.store(U + r, u, mask=ok)


def row_uniforms(seeds: torch.Tensor) -> torch.Tensor:
    """seeds [B] int64 -> [B] fp64 uniforms on a 2^-53 grid from Philox(seed, 0)'s first two words, in
    one launch (the torch form, ``qerl_cli.engine.philox.uniform53``, is ~300 small ops: a launch each
    on the GPU)."""
    b = seeds.numel()
    u = torch.empty(b, dtype=torch.float64, device=seeds.device)
    if b:
        _row_uniform_kernel[(triton.cdiv(b, 256),)](seeds.contiguous(), u, b, BLOCK=256, num_warps=4)
    return u
