"""Bulk L2 prefetch of a weight while an unrelated kernel runs (sm_90 ``cp.async.bulk.prefetch.L2``).

Trade-off: the small decode GEMMs (q/k/v, o at a few rows) are latency floors, a few MB read at a
third of HBM bandwidth; the kernels before them (decode attention, SwiGLU) leave bandwidth unused.
Asking the memory system to pull the next weight into L2 first costs one tiny launch whose threads
each issue one bulk prefetch and exit (no data comes back to the SM), and makes the GEMM's loads L2
hits, if the lines survive until then. It is a hint: results never depend on it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 16384  # bytes per prefetch instruction
PER_PROGRAM = 128  # instructions (threads) per program


@triton.jit
def _prefetch_kernel(P0, n0, P1, n1, progs0, CHUNK: tl.constexpr, PER: tl.constexpr):
    pid = tl.program_id(0)
    first = pid < progs0
    base = tl.where(first, pid, pid - progs0)
    offs = (base * PER + tl.arange(0, PER)).to(tl.int64) * CHUNK
    nbytes = tl.where(first, n0, n1).to(tl.int64)
    ptr = tl.where(first, P0 + offs, P1 + offs)
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [ptr, size], dtype=tl.int32, is_pure=False, pack=1)


def supported(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9


def l2_prefetch(a: torch.Tensor, b: torch.Tensor | None = None) -> None:
    """Prefetch the bytes of ``a`` (and ``b``) into L2; contiguous, 16-byte aligned and sized tensors."""
    ts = [t for t in (a, b) if t is not None]
    for t in ts:
        nb = t.numel() * t.element_size()
        if not t.is_contiguous() or t.data_ptr() % 16 or nb % 16:
            raise ValueError("l2_prefetch needs contiguous tensors of 16-byte aligned, 16-byte multiple size")
    nbytes = [t.numel() * t.element_size() for t in ts] + [0]
    progs = [triton.cdiv(n, CHUNK * PER_PROGRAM) for n in nbytes]
    u8 = [t.view(-1).view(torch.uint8) for t in ts]
    u8.append(u8[0])
    _prefetch_kernel[(progs[0] + progs[1],)](u8[0], nbytes[0], u8[1], nbytes[1], progs[0],
                                             CHUNK=CHUNK, PER=PER_PROGRAM, num_warps=4)
