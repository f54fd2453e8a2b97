"""Load-time bit layout of NVFP4 codes for the sm_90 decode ("twiddled"), and its inverse.

Trade-off: the on-disk compressed-tensors layout (element 2j in the low nibble of byte j) costs
the Hopper decode ~3 integer instructions per weight (gather halves, then per nibble a mask, a
shift, a second mask and an OR before the bf16 multiply); at small M the GEMM is bound by those
instructions, not by HBM. Rewriting the bits once at load time, in place and at the same size,
lets three of every four weight pairs decode with one shift and one AND (the first with the AND
alone), so the PTX decode falls from ~3.2 to ~1.9 instructions per weight. The file on disk never
changes: ``untwiddle`` restores it exactly (tests round-trip every byte value).

Layout, per scale group (two 32-bit words w0, w1 = 16 consecutive K elements of one row):
1. gather halves: a = (w0 low 16 bits) | (w1 low 16 bits) << 16 holds elements 0..3 of both words;
   b likewise holds elements 4..7 (what the old decode did with ``prmt`` on every load);
2. in each 16-bit half, the four 4-bit codes x_0..x_3 (``s e1 e0 m``) are spread so that
   ``r & 0x81C081C0`` (slot 0), ``(r << 3) & M`` (slot 1) and ``(r << 6) & M`` (slot 2) put a code's
   sign at bf16 bit 15 and ``e1 e0 m`` at bits 8..6 (the exact E2M1 -> bf16 bit trick of
   decode.py), and the fourth code sits in the leftover bits {14, 13, 11, 10} (sign, m, e1, e0),
   gathered back with three masked shifts. The same arrangement is triton_kernels' Hopper MXFP4
   bit layout; here it is applied to NVFP4 groups of 16 so one bf16x2 block scale covers both
   halves of every decoded register.
The twiddled words then replace (w0, w1) at the same addresses, so tiles, strides and scale
indexing are unchanged: only the decode differs.
"""

from __future__ import annotations

import torch

MASK = 0x81C081C0


def _spread(x: torch.Tensor, slot: int) -> torch.Tensor:
    """4-bit codes (int64) -> their bits at ``slot``'s positions within a 16-bit half."""
    if slot < 3:
        return (((x & 8) << 12) | ((x & 7) << 6)) >> (3 * slot)
    return ((x & 8) << 11) | ((x & 6) << 9) | ((x & 1) << 13)


def _gather(r: torch.Tensor, slot: int) -> torch.Tensor:
    """Inverse of ``_spread`` for one 16-bit half (int64) -> the 4-bit code."""
    if slot < 3:
        h = (r << (3 * slot)) & 0x81C0
        return ((h >> 12) & 8) | ((h >> 6) & 7)
    return ((r >> 11) & 8) | ((r >> 9) & 6) | ((r >> 13) & 1)


def _half_twiddle(h: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(h)
    for slot in range(4):
        out |= _spread((h >> (4 * slot)) & 0xF, slot)
    return out


def _half_untwiddle(h: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(h)
    for slot in range(4):
        out |= _gather(h, slot) << (4 * slot)
    return out


def _pairs(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if packed.dtype != torch.uint8 or packed.ndim != 2 or packed.shape[1] % 8:
        raise ValueError(f"want packed uint8 [N, K/2] with K % 16 == 0, got {packed.dtype} {tuple(packed.shape)}")
    w = packed.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    w = w.view(packed.shape[0], -1, 2)
    return w[..., 0], w[..., 1]


def _store(packed: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    w = torch.stack([a, b], dim=-1).reshape(packed.shape[0], -1)
    # int64 -> int32 keeps the low 32 bits (two's complement), which is the bit pattern we want.
    w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
    return w.view(torch.uint8).view(packed.shape)


def twiddle(packed: torch.Tensor) -> torch.Tensor:
    """On-disk packed codes uint8 [N, K/2] -> twiddled codes, same shape, new tensor."""
    w0, w1 = _pairs(packed)
    a = (w0 & 0xFFFF) | ((w1 & 0xFFFF) << 16)
    b = (w0 >> 16) | (w1 & 0xFFFF0000)
    a = _half_twiddle(a & 0xFFFF) | (_half_twiddle(a >> 16) << 16)
    b = _half_twiddle(b & 0xFFFF) | (_half_twiddle(b >> 16) << 16)
    return _store(packed, a, b)


def untwiddle(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``twiddle``: twiddled codes -> the on-disk layout, bit for bit."""
    a, b = _pairs(packed)
    a = _half_untwiddle(a & 0xFFFF) | (_half_untwiddle(a >> 16) << 16)
    b = _half_untwiddle(b & 0xFFFF) | (_half_untwiddle(b >> 16) << 16)
    w0 = (a & 0xFFFF) | ((b & 0xFFFF) << 16)
    w1 = (a >> 16) | (b & 0xFFFF0000)
    return _store(packed, w0, w1)


def decode_registers(packed: torch.Tensor) -> torch.Tensor:
    """Emulate the sm_90 twiddled decode in torch: twiddled codes -> codes [N, K] (uint8 0..15).

    Runs exactly the shifts and masks of ``decode._TWIDDLED_ASM`` on int64, so CPU tests check the
    PTX's bit logic, then reads each bf16 half's sign (bit 15) and ``e1 e0 m`` (bits 8..6) back
    into a code.
    """
    a, b = _pairs(packed)
    outs = []
    for r in (a, b):
        regs = [r & MASK, (r << 3) & MASK, (r << 6) & MASK,
                ((r << 1) & 0x80008000) | ((r >> 3) & 0x01800180) | ((r >> 7) & 0x00400040)]
        outs += [reg & 0xFFFFFFFF for reg in regs]
    codes = []
    for reg in outs:  # element i of word 0 (low half) and of word 1 (high half)
        lo, hi = reg & 0xFFFF, reg >> 16
        codes.append(torch.stack([((lo >> 12) & 8) | ((lo >> 6) & 7), ((hi >> 12) & 8) | ((hi >> 6) & 7)], -1))
    # codes[i][..., w]: element i of word w -> [N, groups, word, element]
    c = torch.stack(codes, dim=-1)
    return c.reshape(packed.shape[0], -1).to(torch.uint8)


# ---- blocking ---------------------------------------------------------------------------
# A small-M GEMM step reads 64 bytes (8 scale groups = 128 K elements) from each of BN rows; rows are K/2 bytes apart, so in the file's row-major order each
# step is BN separate 64-byte reads. Blocking stores each 16-row x 64-byte tile contiguously
# (1 KB), row blocks outermost, so every step reads whole kilobytes: measured on an H100 at M = 16,
# 7B gate_up 48.4 -> 39.8 us and 32B gate_up 90.2 -> 72.1 us (benchmarks/probe_small_m.py).
BLOCK_ROWS = 16
BLOCK_BYTES = 64


def can_block(n: int, k: int) -> bool:
    """Whether an [n, k] weight tiles exactly into 16-row x 64-byte (128-element) blocks."""
    return n % BLOCK_ROWS == 0 and (k // 2) % BLOCK_BYTES == 0


def block(packed: torch.Tensor) -> torch.Tensor:
    """Row-major codes uint8 [N, K/2] -> the same bytes in 1 KB blocks (same shape, new tensor)."""
    n, kh = packed.shape
    if not can_block(n, 2 * kh):
        raise ValueError(f"[{n}, {2 * kh}] does not tile into 16 x 128 blocks")
    t = packed.reshape(n // BLOCK_ROWS, BLOCK_ROWS, kh // BLOCK_BYTES, BLOCK_BYTES).transpose(1, 2)
    return t.contiguous().view(n, kh)


def unblock(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``block``."""
    n, kh = packed.shape
    t = packed.reshape(n // BLOCK_ROWS, kh // BLOCK_BYTES, BLOCK_ROWS, BLOCK_BYTES).transpose(1, 2)
    return t.contiguous().view(n, kh)


def to_kernel_layout(packed: torch.Tensor, blocked: bool) -> torch.Tensor:
    """On-disk codes -> what the sm_90 kernels read: twiddled, and blocked if asked."""
    t = twiddle(packed)
    return block(t) if blocked else t


def from_kernel_layout(packed: torch.Tensor, blocked: bool) -> torch.Tensor:
    """Inverse of ``to_kernel_layout``: back to the file's layout, bit for bit."""
    return untwiddle(unblock(packed) if blocked else packed)
