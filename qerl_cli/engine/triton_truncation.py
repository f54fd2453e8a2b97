"""Top-k / top-p / min-p on the GPU without sorting the vocabulary: radix select on the logits' bits.

The torch path (``sampler.truncated_logprobs``) sorts every row to find the nucleus: 5.2 ms of a
256-sequence decode step at a 152k vocabulary (H100), as much as the step's GEMMs. But the nucleus is
only ever a prefix of the ranking (logit descending, index ascending for ties), so it is fixed by two
numbers per row: the logit of its last token and, within that logit's tie group, how many tokens stay.
This module finds them with a radix select, and the Gumbel kernel then draws from the truncated
distribution in its one pass, masking on the fly.

How: each logit gets an integer key in the logit order (its bf16/fp16 bits; for fp32 logits, the bits
of ``x / T``), so ties are equal keys. A pass histograms the keys' next 4 bits over the candidates left
(counts by ``tl.histogram``; for top-p also the mass ``exp(x - max)``, by a one-hot sum), and a
one-program-per-row combine picks the digit where the running total crosses the target (k tokens, or
``top_p`` x the survivors' mass): top-k takes 4 such passes (8 for fp32), top-p 2 (6) and then one
that takes the last 8 bits by counts alone, since with every other bit fixed each bin is one key,
whose mass is its count times exp(x(key) - max), exactly. Rows are split into programs of a fixed
4096 tokens whatever the batch, and their partial sums are added in one order, so a row's cut is the
same in any batch. Ties at the cut keep their lowest indices, as the stable sort does; the Gumbel
kernel ranks them per chunk.

Trade-off: masses are fp32 partial sums added in fp64, where the torch path takes an fp32 cumulative
sum in rank order, so the two can disagree on a token whose preceding mass lies within ~1e-6 of
``top_p``; either is a valid nucleus, and the log-probability recorded is always that of the
distribution drawn from.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from qerl_cli.engine.sampling_params import SamplingParams

# Vocabulary per radix program, fixed (not by batch size) so that a row's fp32 partial sums, and the cut,
# are the same in any batch: 38 programs per row at a 152k vocabulary.
CHUNK = 4096
# A radix pass's tile: tokens per iteration, warps, pipelining; key bits a counting pass takes (top-k: a
# 512-bin tl.histogram made two 8-bit passes slower than four 4-bit ones), and the last top-p pass, whose
# masses come from per-key counts. The fastest of 16 such settings at 16 rows, within 8% of the fastest
# at 256 (benchmarks/probe_truncation.py, H100, 2026-11-26).
PASS_BLOCK, PASS_WARPS, PASS_STAGES = 1024, 4, 1
COUNT_BITS, KEY_MASS_BITS = 4, 8


@triton.jit
def _radix_key(raw, x, KEY16: tl.constexpr):
    """Unsigned keys in logit order: int32 in [0, 2^16) from 16-bit logits' bits, int64 in [0, 2^32)
    from x's (fp32 logits). -0 is keyed as +0 (they tie, as in the sort)."""
    if KEY16:
        b = raw.to(tl.int16, bitcast=True).to(tl.int32)
        b = tl.where(b == -32768, 0, b)
        return tl.where(b < 0, b ^ 0x7FFF, b) + 32768
    else:
        b = x.to(tl.int32, bitcast=True)
        b = tl.where(b == -2147483648, 0, b)
        return tl.where(b < 0, b ^ 0x7FFFFFFF, b).to(tl.int64) + 2147483648


@triton.jit
def _as_key(k, KEY16: tl.constexpr):
    """A key (or -1) stored as int64, in the width ``_radix_key`` gives."""
    if KEY16:
        return k.to(tl.int32)
    else:
        return k


@triton.jit
def _row_max(PMAX, row, num_chunks, CP: tl.constexpr):
    c = tl.arange(0, CP)
    return tl.max(tl.load(PMAX + row * num_chunks + c, mask=c < num_chunks, other=float("-inf")), 0)


@triton.jit
def _max_kernel(L, PMAX, stride_l, V, num_chunks, inv_t, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(L + row * stride_l + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
    tl.store(PMAX + row * num_chunks + c, tl.max(x, 0))


@triton.jit
def _key_value(key, inv_t, KEY16: tl.constexpr, BF16: tl.constexpr):
    """x = logit / T of a key (``_radix_key``'s inverse), computed as the passes compute it."""
    if KEY16:
        t = key.to(tl.int32) - 32768
        b = tl.where(t < 0, t ^ 0x7FFF, t).to(tl.int16)
        if BF16:
            return b.to(tl.bfloat16, bitcast=True).to(tl.float32) * inv_t
        else:
            return b.to(tl.float16, bitcast=True).to(tl.float32) * inv_t
    else:
        t = key - 2147483648
        return tl.where(t < 0, t ^ 0x7FFFFFFF, t).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _radix_pass_kernel(L, PMAX, PREFIX, KLOW, HCNT, HMASS, stride_l, V, num_chunks, inv_t, log_min_p, shift,
                       KEY16: tl.constexpr, CUT_TOP_K: tl.constexpr, MASS: tl.constexpr, DBITS: tl.constexpr,
                       CP: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Histogram of the next DBITS key bits over one (row, chunk)'s candidates: tokens above the min-p
    floor (and for top-p at or above the top-k key) whose key matches the prefix found so far. Counts
    by ``tl.histogram``; with MASS also the masses exp(x - max), by a one-hot sum.

    The one-hot tile is [bins, BLOCK], tokens along its last axis: with the bins last, Triton spread
    each token's row over 16 threads and ran every per-token operation (load, key, exp) 16 times over
    (an H100 took ~0.9 ms per pass at 256 x 152k)."""
    NB: tl.constexpr = 1 << DBITS
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    xmax = _row_max(PMAX, row, num_chunks, CP)
    floor = xmax + log_min_p
    prefix = _as_key(tl.load(PREFIX + row), KEY16)
    klow = _as_key(tl.load(KLOW + row), KEY16)
    bins = tl.arange(0, NB)
    cnt = tl.zeros([2 * NB], tl.int32)
    if MASS:
        mass = tl.zeros([NB, BLOCK], tl.float32)
    for start in tl.range(c * CHUNK, c * CHUNK + CHUNK, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        raw = tl.load(L + row * stride_l + offs, mask=offs < V, other=float("-inf"))
        x = raw.to(tl.float32) * inv_t
        key = _radix_key(raw, x, KEY16)
        ok = (offs < V) & (x >= floor) & ((key >> (shift + DBITS)) == (prefix >> (shift + DBITS)))
        if CUT_TOP_K:
            ok = ok & (key >= klow)
        digit = tl.where(ok, ((key >> shift) & (NB - 1)).to(tl.int32), NB)  # NB: not a candidate
        cnt += tl.histogram(digit, 2 * NB)
        if MASS:
            if tl.min(digit, 0) < NB:  # after the first digits, most chunks of a peaked row hold no candidate
                mass += tl.where(digit[None, :] == bins[:, None], tl.exp(x - xmax)[None, :], 0.0)
    o = (row * num_chunks + c) * NB
    b2 = tl.arange(0, 2 * NB)
    tl.store(HCNT + o + b2, cnt, mask=b2 < NB)
    if MASS:
        tl.store(HMASS + o + bins, tl.sum(mass, 1))


@triton.jit
def _radix_combine_kernel(HCNT, HMASS, PMAX, PREFIX, ABOVE, TARGET, KLOW, KCUT, KEEP, num_chunks, shift, top_k, top_p,
                          inv_t, PHASE_MASS: tl.constexpr, KEY_MASS: tl.constexpr, DBITS: tl.constexpr,
                          FIRST: tl.constexpr, LAST: tl.constexpr, KEY16: tl.constexpr, BF16: tl.constexpr,
                          CP: tl.constexpr):
    """One row: sum the chunks' histograms (in one fixed order), take the lowest non-empty digit whose
    mass (count) above stays under the target, extend the prefix; after the last digit, write the cut.
    With KEY_MASS the digits are whole keys, and their masses are count x exp(x(key) - max): exact,
    without a one-hot pass."""
    NB: tl.constexpr = 1 << DBITS
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CP)
    bins = tl.arange(0, NB)
    o = (row * num_chunks + c[:, None]) * NB + bins[None, :]
    ok = (c < num_chunks)[:, None]
    h_cnt = tl.sum(tl.load(HCNT + o, mask=ok, other=0), 0).to(tl.float64)
    if FIRST:
        above = tl.zeros([], tl.float64)
        prefix = tl.zeros([], tl.int64)
    else:
        above = tl.load(ABOVE + row)
        prefix = tl.load(PREFIX + row)
    if KEY_MASS:
        q = tl.exp(_key_value(prefix | bins, inv_t, KEY16, BF16) - _row_max(PMAX, row, num_chunks, CP))
        h = h_cnt * q.to(tl.float64)
    elif PHASE_MASS:
        h = tl.sum(tl.load(HMASS + o, mask=ok, other=0.0).to(tl.float64), 0)
    else:
        h = h_cnt
    if FIRST:
        if PHASE_MASS:  # the nucleus keeps a token while the mass ranked above it is < top_p x the survivors'
            target = top_p * tl.sum(h, 0)
        else:
            target = tl.zeros([], tl.float64) + top_k
        tl.store(TARGET + row, target)
    else:
        target = tl.load(TARGET + row)
    above_d = above + tl.sum(h, 0) - tl.cumsum(h, 0)  # mass in the prefix's range above each digit's keys
    d = tl.min(tl.where((h_cnt > 0) & (above_d < target), bins, NB), 0)
    above = tl.sum(tl.where(bins == d, above_d, 0.0), 0)
    prefix = prefix | (d.to(tl.int64) << shift)
    tl.store(ABOVE + row, above)
    tl.store(PREFIX + row, prefix)
    if LAST:
        if PHASE_MASS:
            n = tl.sum(tl.where(bins == d, h_cnt, 0.0), 0)
            q_d = tl.sum(tl.where(bins == d, h, 0.0), 0) / tl.maximum(n, 1.0)  # the ties' (equal) mass
            keep = tl.where(q_d > 0, tl.ceil((target - above) / q_d), n)
            tl.store(KCUT + row, prefix)
            tl.store(KEEP + row, tl.minimum(tl.maximum(keep, 1.0), n).to(tl.int64))
        else:
            tl.store(KLOW + row, prefix)


@triton.jit
def _tie_count_kernel(L, KCUT, TIES, stride_l, V, chunk, num_chunks, inv_t, KEY16: tl.constexpr,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    kcut = _as_key(tl.load(KCUT + row), KEY16)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, V)
    n = tl.zeros([BLOCK], tl.int32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        raw = tl.load(L + row * stride_l + offs, mask=offs < hi, other=float("-inf"))
        key = _radix_key(raw, raw.to(tl.float32) * inv_t, KEY16)
        n += ((offs < hi) & (key == kcut)).to(tl.int32)
    tl.store(TIES + row * num_chunks + c, tl.sum(n, 0))


class Cut:
    """Per-row truncation on the device, for ``triton_sampler.gumbel_sample``: a token stays if
    ``x >= max + log(min_p)`` and its key is above ``kcut``, or equal to it and among the first ``keep``
    such tokens (``ties``: the count per Gumbel chunk, for the rank; None when every tie stays)."""

    def __init__(self, pmax, num_chunks, cp, log_min_p, kcut, keep, ties, key16):
        self.pmax, self.num_chunks, self.cp, self.log_min_p = pmax, num_chunks, cp, log_min_p
        self.kcut, self.keep, self.ties, self.key16 = kcut, keep, ties, key16


def find_cut(logits: torch.Tensor, sp: SamplingParams, gumbel_chunk: int, gumbel_chunks: int) -> Cut:
    """The truncation of ``sp`` (min-p, top-k, top-p: vLLM's order) for each row of ``logits`` [B, V]."""
    b, v = logits.shape
    dev = logits.device
    key16 = logits.element_size() == 2
    nc = triton.cdiv(v, CHUNK)
    cp = max(2, triton.next_power_of_2(nc))
    block = min(PASS_BLOCK, CHUNK)  # a pass's loop covers its chunk exactly
    inv_t = 1.0 / sp.temperature
    log_min_p = math.log(sp.min_p) if sp.min_p > 0 else float("-inf")
    pmax = torch.empty(b, nc, dtype=torch.float32, device=dev)
    _max_kernel[(b, nc)](logits, pmax, logits.stride(0), v, nc, inv_t, CHUNK=CHUNK, BLOCK=CHUNK, num_warps=8)
    i64 = dict(dtype=torch.int64, device=dev)
    # One fill for what a first pass reads (the prefix, whose bits above the digit must be 0); every
    # other per-row value is written by a combine before it is read (fills were 6 launches a call).
    prefix, klow = torch.zeros(2, b, **i64)
    above, target = torch.empty(2, b, dtype=torch.float64, device=dev)
    kcut, keep = torch.empty(2, b, **i64)
    hcnt = torch.empty(b, nc, 256, dtype=torch.int32, device=dev)
    hmass = torch.empty(b, nc, 16, dtype=torch.float32, device=dev)
    bits = 16 if key16 else 32
    # (phase is top-p, one-hot masses, digit bits, shift): top-k by counts; top-p by one-hot masses, 4 bits
    # a pass, down to the last KEY_MASS_BITS, whose keys' masses are count x exp(x - max)
    cb, kb = COUNT_BITS, KEY_MASS_BITS
    plan = [(False, False, cb, sh) for sh in range(bits - cb, -1, -cb)] if sp.top_k and sp.top_k < v else []
    if sp.top_p < 1.0:
        plan += [(True, True, 4, sh) for sh in range(bits - 4, kb - 1, -4)] + [(True, False, kb, 0)]
    for i, (phase_mass, onehot, dbits, shift) in enumerate(plan):
        first = i == 0 or plan[i - 1][0] != phase_mass
        last = shift == 0
        _radix_pass_kernel[(b, nc)](logits, pmax, prefix, klow, hcnt, hmass, logits.stride(0), v, nc, inv_t,
                                    log_min_p, shift, KEY16=key16, CUT_TOP_K=phase_mass and bool(sp.top_k),
                                    MASS=onehot, DBITS=dbits, CP=cp, CHUNK=CHUNK, BLOCK=block, STAGES=PASS_STAGES,
                                    num_warps=PASS_WARPS)
        _radix_combine_kernel[(b,)](hcnt, hmass, pmax, prefix, above, target, klow, kcut, keep, nc, shift, sp.top_k,
                                    sp.top_p, inv_t, PHASE_MASS=phase_mass, KEY_MASS=phase_mass and not onehot,
                                    DBITS=dbits, FIRST=first, LAST=last, KEY16=key16,
                                    BF16=logits.dtype == torch.bfloat16, CP=cp, num_warps=4)
    phases = {p for p, *_ in plan}
    ties = None
    if sp.top_p < 1.0:
        ties = torch.empty(b, gumbel_chunks, dtype=torch.int32, device=dev)
        _tie_count_kernel[(b, gumbel_chunks)](logits, kcut, ties, logits.stride(0), v, gumbel_chunk, gumbel_chunks,
                                              inv_t, KEY16=key16, BLOCK=1024, num_warps=4)
    elif phases:  # top-k alone: every token at or above the k-th key stays, ties included
        kcut = klow - 1
    else:  # min-p alone: below every key, nothing cut but the floor
        kcut = prefix - 1
    return Cut(pmax, nc, cp, log_min_p, kcut, keep, ties, key16)
