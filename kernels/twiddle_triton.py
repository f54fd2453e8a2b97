"""The load-time twiddle of ``qerl_kernels.twiddle`` as one Triton pass, in place.

Trade-off: the torch reference (``twiddle``) runs ~20 integer ops per chunk, each a kernel over int64
copies of the codes: 0.505 s for a 7B model's 3 GiB of codes in 32 MB chunks on an H100 (0.711 s in the
4096-row chunks used before), with a 352 MiB peak of temporaries (benchmarks/probe_twiddle_chunks.py).
This reads each scale group's two 32-bit words once and writes them back at the same address, the same
bits the reference computes (tests compare the two over awkward shapes in Triton's interpreter and on
the GPU), with no temporaries at all. The reference stays the CPU path and the definition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _spread(x, SLOT: tl.constexpr):
    """4-bit codes -> their bits at ``SLOT``'s positions within a 16-bit half (``twiddle._spread``)."""
    if SLOT < 3:
        out = (((x & 8) << 12) | ((x & 7) << 6)) >> (3 * SLOT)
    else:
        out = ((x & 8) << 11) | ((x & 6) << 9) | ((x & 1) << 13)
    return out


@triton.jit
def _half(h):
    return (_spread(h & 0xF, 0) | _spread((h >> 4) & 0xF, 1) | _spread((h >> 8) & 0xF, 2)
            | _spread((h >> 12) & 0xF, 3))


@triton.jit
def _twiddle_kernel(W, PAIRS, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < PAIRS
    w0 = tl.load(W + 2 * i, mask=m, other=0).to(tl.uint32, bitcast=True)
    w1 = tl.load(W + 2 * i + 1, mask=m, other=0).to(tl.uint32, bitcast=True)
    a = (w0 & 0xFFFF) | ((w1 & 0xFFFF) << 16)  # elements 0..3 of both words
    b = (w0 >> 16) | ((w1 >> 16) << 16)  # elements 4..7
    a = _half(a & 0xFFFF) | (_half(a >> 16) << 16)
    b = _half(b & 0xFFFF) | (_half(b >> 16) << 16)
    tl.store(W + 2 * i, a.to(tl.int32, bitcast=True), mask=m)
    tl.store(W + 2 * i + 1, b.to(tl.int32, bitcast=True), mask=m)


def twiddle_(packed: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """On-disk codes uint8 [N, K/2] (contiguous, K % 16 == 0) -> twiddled, in place; returns ``packed``."""
    if packed.dtype != torch.uint8 or packed.ndim != 2 or packed.shape[1] % 8 or not packed.is_contiguous():
        raise ValueError(f"want contiguous packed uint8 [N, K/2] with K % 16 == 0, got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    words = packed.view(torch.int32).view(-1)
    pairs = words.numel() // 2
    if pairs:
        _twiddle_kernel[(triton.cdiv(pairs, block),)](words, pairs, BLOCK=block)
    return packed
