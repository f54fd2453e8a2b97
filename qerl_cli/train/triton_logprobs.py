"""Train-step's per-row log-softmax passes over fp32 logits, fused into one Triton pass each way.

``logprobs._TokenLogprob`` holds one tempered fp32 ``[chunk, vocab]`` logits buffer per chunk (600 KB a
row at a 152k vocabulary). In torch, its forward (the replayed sampling cut, then log-sum-exp, the
target's log-prob and the entropy) and its backward (the cut again, then ``(onehot - softmax) * g / T``)
are each a chain of elementwise kernels that read and write the whole buffer ~10 times, plus a
row-wide ``cumsum`` for the cut's tie ranks. Here each direction is one program per row walking the
vocabulary in order:

- forward: applies the cut on the fly (``Kept``: logits below ``last`` are cut, and ties at ``last``
  past the row's first ``ties`` by index; the row's target always stays), and keeps an online
  log-sum-exp with the entropy's sum beside it (``s = sum e^(x-m)``, ``w = sum e^(x-m)(x-m)`` rescaled
  as the running max ``m`` moves; entropy = ``log s - w / s``, which does not cancel when the row is
  peaked). Reads the buffer once, writes three numbers per row.
- backward: the same cut, then writes the gradient of the logits in place (read once, written once).

The tie rank is a running count carried from block to block, so the cut is exactly the one the
torch path applies (``logprobs.apply_kept_``). A NaN logit is never cut and makes the row's
log-sum-exp NaN, as in torch, for the step's NaN check. Trade-off: ``tl.exp``/``tl.log`` and the
online order of the sums round differently from ``torch.logsumexp`` (float32, ~1e-7 relative), so
the two paths agree to rounding, not bit for bit; each is deterministic (one program per row, blocks in
a fixed order). CPU runs the torch path; the interpreter (``TRITON_INTERPRET=1``) runs these kernels
in the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary per iteration: 16 KB of fp32 logits per program step
WARPS = 8


@triton.jit
def _cut(x, offs, target, last, ties, seen, HAS_CUT: tl.constexpr):
    """x with what the cut drops set to -inf, and the running count of ties at ``last`` after this block."""
    if HAS_CUT:
        at = x == last
        rank = seen + tl.cumsum(at.to(tl.int32), 0)
        drop = ((x < last) | (at & (rank > ties))) & (offs != target)
        x = tl.where(drop, float("-inf"), x)
        seen += tl.sum(at.to(tl.int32), 0)
    return x, seen


@triton.jit
def _row(z_ptr, stride, t_ptr, last_ptr, ties_ptr, HAS_CUT: tl.constexpr):
    """This program's row: its index, logits pointer, target, and the cut's last logit and tie count."""
    row = tl.program_id(0).to(tl.int64)
    last = float("-inf")
    ties = 0
    if HAS_CUT:
        last = tl.load(last_ptr + row)
        ties = tl.load(ties_ptr + row)
    return row, z_ptr + row * stride, tl.load(t_ptr + row), last, ties


@triton.jit
def _fwd_kernel(z_ptr, stride, V, t_ptr, last_ptr, ties_ptr, lse_ptr, logp_ptr, ent_ptr,
                HAS_CUT: tl.constexpr, BLOCK: tl.constexpr):
    row, base, target, last, ties = _row(z_ptr, stride, t_ptr, last_ptr, ties_ptr, HAS_CUT)
    seen = tl.zeros((), dtype=tl.int32)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), dtype=tl.float32)
    w = tl.zeros((), dtype=tl.float32)
    nan = tl.zeros((), dtype=tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf"))
        x, seen = _cut(x, offs, target, last, ties, seen, HAS_CUT)
        nan += tl.sum((x != x).to(tl.int32), 0)
        x = tl.where(x != x, float("-inf"), x)
        m_new = tl.maximum(m, tl.max(x, 0))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf while the row is all cut so far
        d = tl.where(x == float("-inf"), 0.0, x - ref)
        p = tl.where(x == float("-inf"), 0.0, tl.exp(d))
        shift = tl.where(s == 0.0, 0.0, m - ref)  # rescale the sums to the new max
        a = tl.exp(shift)
        w = a * (w + s * shift) + tl.sum(p * d, 0)
        s = a * s + tl.sum(p, 0)
        m = m_new
    lse = m + tl.log(s)
    ent = tl.log(s) - w / s
    if nan > 0:
        lse = float("nan")
        ent = float("nan")
    tl.store(lse_ptr + row, lse)
    tl.store(ent_ptr + row, ent)
    tl.store(logp_ptr + row, tl.load(base + target) - lse)


@triton.jit
def _bwd_kernel(z_ptr, stride, V, t_ptr, last_ptr, ties_ptr, lse_ptr, scale_ptr,
                HAS_CUT: tl.constexpr, BLOCK: tl.constexpr):
    row, base, target, last, ties = _row(z_ptr, stride, t_ptr, last_ptr, ties_ptr, HAS_CUT)
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row)
    seen = tl.zeros((), dtype=tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf"))
        x, seen = _cut(x, offs, target, last, ties, seen, HAS_CUT)
        g = tl.exp(x - lse) * -scale
        g = tl.where(offs == target, g + scale, g)
        tl.store(base + offs, g, mask=offs < V)


def _check(z: torch.Tensor, targets: torch.Tensor) -> None:
    if z.dtype != torch.float32 or z.dim() != 2 or z.stride(1) != 1:
        raise ValueError(f"fp32 logits [n, V] with unit column stride expected, got {tuple(z.shape)} {z.dtype} "
                         f"strides {z.stride()}")
    if targets.shape != (z.shape[0],):
        raise ValueError(f"{targets.shape[0] if targets.dim() else 0} targets for {z.shape[0]} rows")


def _cut_args(z: torch.Tensor, kept):
    if kept is None:
        return z, z, False  # unread placeholders
    return kept.last.contiguous(), kept.ties.to(torch.int32).contiguous(), True


def lse_logp_entropy(z: torch.Tensor, targets: torch.Tensor, kept=None):
    """Per row of tempered fp32 logits ``z`` [n, V], cut by ``kept`` (a ``logprobs.Kept``, or None):
    (log-sum-exp, the target's log-prob, the entropy), each fp32 [n]; ``z`` is left as it is."""
    _check(z, targets)
    n, v = z.shape
    lse, logp, ent = (torch.empty(n, dtype=torch.float32, device=z.device) for _ in range(3))
    if n:
        last, ties, has_cut = _cut_args(z, kept)
        _fwd_kernel[(n,)](z, z.stride(0), v, targets.contiguous(), last, ties, lse, logp, ent,
                          HAS_CUT=has_cut, BLOCK=min(BLOCK, triton.next_power_of_2(v)), num_warps=WARPS)
    return lse, logp, ent


def logits_grad_(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, kept=None):
    """``z`` [n, V] (the forward's tempered fp32 logits) overwritten with d(scale * log p(target)) / dz =
    scale * (onehot(target) - softmax of the cut row), for ``lse`` from the forward."""
    _check(z, targets)
    n, v = z.shape
    if n:
        last, ties, has_cut = _cut_args(z, kept)
        _bwd_kernel[(n,)](z, z.stride(0), v, targets.contiguous(), last, ties, lse.contiguous(),
                          scale.float().contiguous(), HAS_CUT=has_cut,
                          BLOCK=min(BLOCK, triton.next_power_of_2(v)), num_warps=WARPS)
    return z
