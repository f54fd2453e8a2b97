"""The LoRA shrink ``t = x @ A^T`` (A [r, K], r <= 128) in one launch, for decode-sized batches.

Trade-off: cuBLAS runs this skinny product (64 x 3584 x 16 on a 7B decode step) as a split-K kernel and
a reduce kernel, ~4.7 + 1.8 us on an H100, for a read of ~0.6 MB, and on the engine's side stream,
beside a base GEMM that fills every SM, the second launch waits for SMs like the first. Here the K
splits write fp32 partials and the program that arrives last sums them in split order and writes t, as
gemm_fwd's split-K does: one launch, deterministic. In CUDA graphs on the 7B LoRA r=16 shapes
(``benchmarks/bench_lora_shrink.py``, H100, docs/benchmarks.md, rollout, twenty-first pass): 4.2-5.9 us
against cuBLAS's 6.6-7.5 at M = 16, 4.3-6.7 against 7.3-7.8 at M = 64; the 16-sequence decode step
with LoRA 3.817 -> 3.688-3.710 ms. Above ``MAX_ROWS`` rows (prefill) cuBLAS's tiles are the better
choice and ``lora_shrink`` hands the call to it.

The reference is torch's ``x @ a.t()``: what ``lora_shrink`` runs off the kernel's reach, and what the
tests compare against (in fp64). The arrival counters are this module's own (``gemm_fwd.arrival_counters``
with a separate cache): the shrink runs on a side stream while the base GEMM's
split-K uses gemm_fwd's on the main one (two shrinks never run at once: the engine's side work joins
the main stream before the next GEMM).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from qerl_kernels.gemm_fwd import arrival_counters

MAX_ROWS = 128  # the rows measured (bench_lora_shrink.py --ms 16,64,128)
MAX_RANK = 128
BK = 128  # K elements per inner step
_SLOTS = 64
_counters: dict[tuple[str, int | None], torch.Tensor] = {}


def shrink_plan(m: int, k: int, bm: int = 0, per: int = 0) -> tuple[int, int, int]:
    """(BM, K per split, splits): row tiles of 16, splits of >= 256 K elements, at most 32 of them (the
    last arriver reads every partial); ``bm``, ``per`` (K steps per split) override. Row tiles of 16 beat
    32 and 64 at every M of 16-128 on the 7B LoRA shapes (benchmarks/bench_lora_shrink.py, H100)."""
    bm = bm or 16
    steps = triton.cdiv(k, BK)
    per = per or max(2, triton.cdiv(steps, 32))
    return bm, per * BK, triton.cdiv(steps, per)


@triton.jit(do_not_specialize=["M"])
def _lora_shrink_kernel(X, A, T, WS, CNT, M, K, R, k_per_split, stride_xm, stride_am, stride_tm,
                        BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                        IP: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rr = tl.arange(0, BR)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BR), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + rk
        kmask = kk < k_hi
        x = tl.load(X + rm[:, None] * stride_xm + kk[None, :], mask=(rm < M)[:, None] & kmask[None, :], other=0.0)
        a = tl.load(A + rr[:, None] * stride_am + kk[None, :], mask=(rr < R)[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(a), acc, input_precision=IP)
    omask = (rm < M)[:, None] & (rr < R)[None, :]
    if SPLIT == 1:
        tl.store(T + rm[:, None] * stride_tm + rr[None, :], acc.to(T.dtype.element_ty), mask=omask)
    else:
        ws = WS + rm[:, None] * BR + rr[None, :]
        tl.store(ws + pid_k * M * BR, acc, mask=omask)
        tl.debug_barrier()  # every thread's partial before the release of the counter bump
        arrived = tl.atomic_add(CNT + pid_m, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            total = tl.zeros((BM, BR), dtype=tl.float32)
            for s in tl.static_range(SPLIT):  # split order, whoever arrives last: deterministic
                total += tl.load(ws + s * M * BR, mask=omask, other=0.0, cache_modifier=".cg")
            tl.store(T + rm[:, None] * stride_tm + rr[None, :], total.to(T.dtype.element_ty), mask=omask)
            tl.atomic_xchg(CNT + pid_m, 0)


def kernel_applies(x: torch.Tensor, a: torch.Tensor) -> bool:
    """CUDA (or Triton's interpreter), 2-D, at most ``MAX_ROWS`` rows and ``MAX_RANK`` ranks, unit K
    stride, same dtype, no autograd; ``QERL_LORA_SHRINK_KERNEL=0`` turns it off."""
    if os.environ.get("QERL_LORA_SHRINK_KERNEL", "1") == "0":
        return False
    on_device = x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return (on_device and x.dim() == 2 and a.dim() == 2 and x.shape[1] == a.shape[1] and 0 < x.shape[0] <= MAX_ROWS
            and 0 < a.shape[0] <= MAX_RANK and x.dtype == a.dtype and x.stride(1) == 1 and a.stride(1) == 1
            and x.device == a.device and not (torch.is_grad_enabled() and (x.requires_grad or a.requires_grad)))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, bm: int = 0, per: int = 0) -> torch.Tensor:
    """``x @ a^T`` for x [M, K], a [r, K]: this module's one-launch kernel where ``kernel_applies``, else
    torch's matmul (also during a graph capture before any eager call made the counters). ``bm``,
    ``per``: the plan's overrides (``shrink_plan``; benchmarks/bench_lora_shrink.py sweeps them)."""
    if not kernel_applies(x, a):
        return x @ a.t()
    m, k = x.shape
    r = a.shape[0]
    bm, per, split = shrink_plan(m, k, bm, per)
    br = max(16, triton.next_power_of_2(r))
    t = torch.empty((m, r), dtype=x.dtype, device=x.device)
    cnt = ws = t
    if split > 1:
        cnt = arrival_counters(x.device, _counters, _SLOTS)
        if cnt is None:
            return x @ a.t()
        ws = torch.empty((split, m, br), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, bm), split)
    _lora_shrink_kernel[grid](x, a, t, ws, cnt, m, k, r, per, x.stride(0), a.stride(0), t.stride(0),
                              BM=bm, BR=br, BK=BK, SPLIT=split,
                              IP="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4)
    return t
