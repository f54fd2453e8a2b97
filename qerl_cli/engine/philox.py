"""Triton's ``tl.rand(seed, offset)`` written in torch integer ops, bit for bit.

The samplers draw their noise from per-sequence seeds so that a sequence's sample does not depend
on which other sequences share its batch. On the GPU the Triton kernels call ``tl.rand`` (Philox
4x32, 10 rounds, keyed by the 64-bit seed, counter = the offset); this module computes the same
numbers where no kernel runs (CPU, or no Triton), so every path draws from one stream.

How: 32-bit words live in int64 tensors. A 32 x 32-bit product can reach 2^64 and would overflow
int64, so it is built from 16-bit halves (every partial product stays below 2^49). About 300 small
element-wise ops: meant for a handful of values per row (one uniform per sequence and step), not
for a whole vocabulary.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_TO_UNIFORM = 4.6566127342e-10  # tl.rand's scale: the largest with (2^31 - 1) * scale < 1 in fp32


def _mul(x: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of x * c for x in [0, 2^32) and a 32-bit constant c."""
    xh, xl = x >> 16, x & 0xFFFF
    ch, cl = c >> 16, c & 0xFFFF
    mid = xh * cl + xl * ch
    low = xl * cl + ((mid & 0xFFFF) << 16)
    return xh * ch + (mid >> 16) + (low >> 32), low & _M32


def philox(seed: torch.Tensor, offset: torch.Tensor, rounds: int = 10) -> torch.Tensor:
    """The first output word of Philox 4x32 for ``tl.randint(seed, offset)`` with int32 offsets:
    key (seed low, seed high), counter (offset, 0, 0, 0). Broadcasts; returns int64 in [0, 2^32)."""
    return philox4(seed, offset, rounds)[0]


def philox4(seed: torch.Tensor, offset: torch.Tensor, rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """All four output words, as ``tl.randint4x(seed, offset)`` returns them."""
    seed, offset = torch.broadcast_tensors(seed.to(torch.int64), offset.to(torch.int64))
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    c0, c1 = offset & _M32, torch.zeros_like(offset)
    c2, c3 = torch.zeros_like(offset), torch.zeros_like(offset)
    for _ in range(rounds):
        hi_b, lo_b = _mul(c2, _ROUND_B)
        hi_a, lo_a = _mul(c0, _ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def uniform(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``tl.rand(seed, offset)``: fp32 in [0, 1), the same bits as the Triton kernels draw."""
    x = philox(seed, offset)
    x = torch.where(x >= 2**31, _M32 - x, x)  # the word read as int32, negatives folded by ~x
    return x.to(torch.float32) * torch.tensor(_TO_UNIFORM, dtype=torch.float32, device=x.device)


def uniform53(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """fp64 in [0, 1) on a 2^-53 grid from the first two Philox words (``row_uniforms``' Triton kernel
    computes the same bits): fine enough that inverse-CDF sampling resolves probabilities far below
    fp32's 6e-8 spacing under 1, which ``tl.rand``'s one word would not."""
    c0, c1, _, _ = philox4(seed, offset)
    return ((c0 << 21) + (c1 >> 11)).to(torch.float64) * 2.0**-53
