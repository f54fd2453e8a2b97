"""LoRA shrink at decode sizes: ``t = x @ A^T`` in one launch.

Why hand-written: at decode, ``x`` is a few rows (M = 1-256 sequences) and ``A`` is a LoRA down
projection (N = the rank, or the summed ranks of a fused q/k/v or gate/up group: 16-64) over the
hidden or intermediate width (K = 3584-27648). cuBLAS runs that skinny product as a split-K GEMM
plus a separate reduce kernel: on an H100 at M = 16, K = 3584, N = 48 it issued two launches,
4.8 + 1.8 us, four times per decoder layer (docs/benchmarks.md, rollout twelfth pass). The work
itself is ~0.5 MB of reads; the launches and the reduce's round trip are the cost.

How: one Triton launch with split-K across programs, reduced by the last program to arrive (the
same last-arriver scheme as ``gemm_fwd``: fp32 partials in a workspace, an acq_rel counter per row
block, partials summed in split order so results are deterministic, counter reset for the next
call). Each program owns ``STEPS`` K steps of ``BK`` elements and all N columns (N <= 256), so the
whole output is a handful of row blocks. Outside those sizes (long prefills, ranks above 256, CPU
without the interpreter) ``shrink`` is ``x @ a.t()``.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: shrink() is the torch matmul
    triton = None

MAX_M = 256  # above this a prefill-sized product: cuBLAS is the right tool
MAX_N = 256


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@_jit
def _shrink_kernel(X, A, T, WS, CNT, M, N, K, stride_xm, stride_an, stride_tm,
                   SPLIT: tl.constexpr, STEPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   IP: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for i in range(STEPS):
        rk = (pid_k * STEPS + i) * BK + tl.arange(0, BK)
        x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=(rm < M)[:, None] & (rk < K)[None, :],
                    other=0.0)
        a = tl.load(A + rn[:, None].to(tl.int64) * stride_an + rk[None, :], mask=(rn < N)[:, None] & (rk < K)[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(a), acc, input_precision=IP)
    omask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT > 1:
        ws = WS + rm[:, None] * N + rn[None, :]
        tl.store(ws + pid_k * M * N, acc, mask=omask)
        tl.debug_barrier()  # every thread's partial precedes the counter's release
        arrived = tl.atomic_add(CNT + pid_m, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            total = tl.zeros((BM, BN), dtype=tl.float32)
            for s in tl.static_range(SPLIT):  # unrolled: every partial's load in flight at once
                total += tl.load(ws + s * M * N, mask=omask, other=0.0, cache_modifier=".cg")
            tl.store(T + rm[:, None] * stride_tm + rn[None, :], total.to(T.dtype.element_ty), mask=omask)
            tl.atomic_xchg(CNT + pid_m, 0)
    else:
        tl.store(T + rm[:, None] * stride_tm + rn[None, :], acc.to(T.dtype.element_ty), mask=omask)


def plan(m: int, n: int, k: int, steps: int = 4, bk: int = 128, max_split: int = 64) -> dict:
    """The launch shape: row block, padded N, K step and how many K steps each split owns."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bn = max(16, triton.next_power_of_2(n))
    ksteps = triton.cdiv(k, bk)
    steps = max(steps, triton.cdiv(ksteps, max_split))
    return dict(bm=bm, bn=bn, bk=bk, steps=steps, split=triton.cdiv(ksteps, steps))


def usable(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether ``shrink`` launches the kernel (else it is ``x @ a.t()``)."""
    if triton is None or os.environ.get("QERL_LORA_SHRINK", "1") == "0":
        return False
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    return (x.dim() == 2 and a.dim() == 2 and x.shape[1] == a.shape[1] and x.dtype == a.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and 0 < x.shape[0] <= MAX_M
            and 0 < a.shape[0] <= MAX_N and x.stride(1) == 1 and a.stride(1) == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or a.requires_grad)))


def shrink(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``x @ a.t()`` for x [M, K], a [N, K] (same dtype), one launch at decode sizes."""
    if not usable(x, a):
        return x @ a.t()
    from qerl_kernels.gemm_fwd import COUNTER_SLOTS, arrival_counters

    m, k = x.shape
    n = a.shape[0]
    p = plan(m, n, k)
    t = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid_m = triton.cdiv(m, p["bm"])
    split = p["split"]
    cnt = arrival_counters(x.device) if split > 1 else None
    if split > 1 and (cnt is None or grid_m > COUNTER_SLOTS):
        return x @ a.t()  # first call inside a graph capture: no counters yet (see arrival_counters)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else t
    _shrink_kernel[(grid_m, split)](
        x, a, t, ws, cnt if cnt is not None else t, m, n, k, x.stride(0), a.stride(0), t.stride(0),
        SPLIT=split, STEPS=p["steps"], BM=p["bm"], BN=p["bn"], BK=p["bk"],
        IP="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4,
    )
    return t
