"""In-register NVFP4 decode helpers shared by the forward and grad-input GEMM kernels.

Trade-off: Hopper has no FP4 tensor cores, so every weight is decoded to bf16 in registers
before ``tl.dot``. At small M the GEMM is bound by reading weights, and at 3 TB/s an SM must
decode ~23 weights per clock: a per-weight ``where``/``exp2`` chain is ALU-bound there (a
first naive kernel ran at 0.66x of cuBLAS bf16). So on sm_90 the decode is a short PTX
sequence working on 32-bit registers (8 weights per ~16 integer instructions, ~2 per weight)
and the block scale is applied with packed ``mul.rn.bf16x2``.

How the bit trick works (exact, no lookup): an E2M1 nibble ``s e1 e0 m`` placed with its sign
at bf16 bit 15 and ``e1 e0 m`` at bits 8..6 is a bf16 number whose value is the E2M1 value
times 2^-126 (code 1, +0.5, lands on the bf16 subnormal 2^-127: bf16 arithmetic on sm_90 keeps
subnormals, the same property triton_kernels' mxfp4 upcast relies on). The missing 2^126 is
folded into the block scale: ``scale * 2^118`` is a normal bf16 for every e4m3 value, so
``raw * (scale * 2^118) = e2m1 * scale * 2^-8`` exactly (at most 6 significant bits, range
2^-18..10.5), and the GEMM epilogue multiplies by ``2^8 / global``.

Byte layout (on-disk, no repack): byte j of a row holds element 2j in its low nibble and 2j+1
in its high nibble. ``decode_*`` return two tiles ``lo`` (even K elements) and ``hi`` (odd K
elements) of the byte tile's shape; callers split X into even/odd columns to match, so the
decoded tile never needs an interleaving shuffle.

The portable path (``decode_portable``: the CPU interpreter, fp16/fp32 activations, GPUs
before sm_90) decodes with integer ops into fp32 and avoids subnormal inputs entirely
(it rebiases exponents and handles exponent 0 by a multiply), so it is exact under any
flush-to-zero mode; it returns ``e2m1 * scale`` and the epilogue multiplies by ``1 / global``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Epilogue factor numerators: the fast path leaves 2^-8 in the weights, the portable none.
FAST_EPILOGUE = 256.0
PORTABLE_EPILOGUE = 1.0

_DECODE_ASM = r"""
{
.reg .b32 a, b, t, u;
prmt.b32 a, $4, 0, 0x1404;
prmt.b32 b, $4, 0, 0x3424;
and.b32 t, a, 0x70007000;
shr.b32 t, t, 6;
and.b32 u, a, 0x80008000;
or.b32 t, t, u;
mul.rn.bf16x2 $2, t, $5;
and.b32 t, b, 0x70007000;
shr.b32 t, t, 6;
and.b32 u, b, 0x80008000;
or.b32 t, t, u;
mul.rn.bf16x2 $3, t, $6;
shl.b32 a, a, 4;
shl.b32 b, b, 4;
and.b32 t, a, 0x70007000;
shr.b32 t, t, 6;
and.b32 u, a, 0x80008000;
or.b32 t, t, u;
mul.rn.bf16x2 $0, t, $5;
and.b32 t, b, 0x70007000;
shr.b32 t, t, 6;
and.b32 u, b, 0x80008000;
or.b32 t, t, u;
mul.rn.bf16x2 $1, t, $6;
}
"""
# Register map (pack=4): $4 holds bytes b0..b3; prmt spreads them to [0,b0,0,b1] and [0,b2,0,b3]
# so each byte sits in the top of a 16-bit half: the high nibble's sign is already at bit 15 and
# its magnitude moves from bits 14..12 to 8..6 with one shift. Shifting left by 4 brings the low
# nibble into the same place (the high nibble falls off or lands in bits the masks clear).
# $5/$6 are the bf16x2 scales of elements (0,1) and (2,3); outputs lo = $0,$1 and hi = $2,$3.


@triton.jit
def decode_e4m3(s):
    """uint8 e4m3 bits -> exact fp32 (sign, normals and subnormals; no fp8 conversion units)."""
    si = s.to(tl.int32)
    e = (si >> 3) & 0xF
    m = si & 0x7
    sign = (si & 0x80) << 24
    normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # exponent 0: m * 2^-9
    sub = tl.where(sign != 0, -sub, sub)
    return tl.where(e == 0, sub, normal)


@triton.jit
def broadcast_groups(sc, BN: tl.constexpr, BKH: tl.constexpr):
    """[BN, BKH // 8] per-group scales -> [BN, BKH] per-byte scales (a byte = 2 K elements)."""
    return tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, BKH // 8, 8)), (BN, BKH))


@triton.jit
def fast_scales(s):
    """uint8 e4m3 bits -> bf16 ``scale * 2^118`` (exact; folds the decode's 2^126 minus 2^8)."""
    return (decode_e4m3(s) * 3.32306998946229e35).to(tl.bfloat16)


@triton.jit
def decode_fast(p, sc):
    """uint8 [R, C] packed bytes, bf16 [R, C] per-byte fast scales -> (lo, hi) bf16 tiles (sm_90)."""
    lo, hi = tl.inline_asm_elementwise(
        asm=_DECODE_ASM,
        constraints="=r,=r,=r,=r,r,r,r",
        args=[p, sc],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )
    return lo, hi


@triton.jit
def _e2m1_fp32(n):
    # Rebias the 2-bit exponent into fp32 instead of relying on subnormal arithmetic.
    e = (n >> 1) & 3
    m = n & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((n & 8) != 0, -mag, mag)


@triton.jit
def decode_portable(p, sc, dtype: tl.constexpr):
    """uint8 [R, C] packed bytes, fp32 [R, C] per-byte scales -> (lo, hi) in ``dtype``, exact."""
    pi = p.to(tl.int32)
    lo = _e2m1_fp32(pi & 0xF) * sc
    hi = _e2m1_fp32((pi >> 4) & 0xF) * sc
    return lo.to(dtype), hi.to(dtype)


@triton.jit
def decode_tile(p, s, BN: tl.constexpr, BKH: tl.constexpr, FAST: tl.constexpr, dtype: tl.constexpr):
    """Packed bytes [BN, BKH] + raw e4m3 group scales [BN, BKH // 8] -> (lo, hi) [BN, BKH]."""
    if FAST:
        sc = broadcast_groups(fast_scales(s), BN, BKH)
        lo, hi = decode_fast(p, sc)
    else:
        sc = broadcast_groups(decode_e4m3(s), BN, BKH)
        lo, hi = decode_portable(p, sc, dtype)
    return lo, hi


def fast_decode_supported(device) -> bool:
    """The PTX path needs sm_90 (``mul.rn.bf16x2``) and a real GPU (the interpreter has no asm)."""
    import os

    import torch

    if os.environ.get("TRITON_INTERPRET") == "1" or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


__all__ = [
    "FAST_EPILOGUE",
    "PORTABLE_EPILOGUE",
    "decode_e4m3",
    "decode_tile",
    "fast_decode_supported",
    "triton",
]
