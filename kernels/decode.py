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
from qerl_kernels.korder import fast_decode_supported, from_k_order, k_order_index, to_k_order  # noqa: F401 (re-exported)

# Epilogue factor numerators: the fast path leaves 2^-8 in the weights, the portable none.
FAST_EPILOGUE = 256.0
PORTABLE_EPILOGUE = 1.0

def _top_nibble(src: str, out: str, scale: str) -> str:
    # Each 16-bit half of src holds a code in its top nibble: sign already at bit 15, magnitude
    # shifted from bits 14..12 to 8..6; then the bf16x2 block-scale multiply.
    return (f"and.b32 t, {src}, 0x70007000;\nshr.b32 t, t, 6;\nand.b32 u, {src}, 0x80008000;\n"
            f"or.b32 t, t, u;\nmul.rn.bf16x2 {out}, t, {scale};\n")


_DECODE_ASM = tl.constexpr(
    "{\n.reg .b32 a, b, t, u;\nprmt.b32 a, $4, 0, 0x1404;\nprmt.b32 b, $4, 0, 0x3424;\n"
    + _top_nibble("a", "$2", "$5") + _top_nibble("b", "$3", "$6")
    + "shl.b32 a, a, 4;\nshl.b32 b, b, 4;\n"
    + _top_nibble("a", "$0", "$5") + _top_nibble("b", "$1", "$6") + "}")
# Register map (pack=4): $4 holds bytes b0..b3; prmt spreads them to [0,b0,0,b1] and [0,b2,0,b3]
# so each byte sits in the top of a 16-bit half: the high nibble's sign is already at bit 15 and
# its magnitude moves from bits 14..12 to 8..6 with one shift. Shifting left by 4 brings the low
# nibble into the same place (the high nibble falls off or lands in bits the masks clear).
# $5/$6 are the bf16x2 scales of elements (0,1) and (2,3); outputs lo = $0,$1 and hi = $2,$3.


@triton.jit
def grouped_tile(pid, grid_m, grid_n, GROUP_M: tl.constexpr):
    """Program id -> (tile row, tile column) in grouped order: GROUP_M row-blocks walk the same
    weight column-blocks back to back, so each weight tile is reused from L2."""
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    gsz = min(grid_m - first_m, GROUP_M)
    return first_m + (pid % width) % gsz, (pid % width) // gsz


@triton.jit
def decode_e4m3(s):
    """uint8 e4m3 bits -> exact fp32 (sign, normals, subnormals and NaN; no fp8 conversion units)."""
    si = s.to(tl.int32)
    e = (si >> 3) & 0xF
    m = si & 0x7
    sign = (si & 0x80) << 24
    normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # exponent 0: m * 2^-9
    sub = tl.where(sign != 0, -sub, sub)
    # S.1111.111 is e4m3fn's only NaN (it has no infinities): without this it decoded as 480, where
    # the reference and the sm_90 hardware conversion give NaN.
    return tl.where((si & 0x7F) == 0x7F, float("nan"), tl.where(e == 0, sub, normal))


@triton.jit
def broadcast_groups(sc, BN: tl.constexpr, BKH: tl.constexpr):
    """[BN, BKH // 8] per-group scales -> [BN, BKH] per-byte scales (a byte = 2 K elements)."""
    return tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, BKH // 8, 8)), (BN, BKH))


@triton.jit
def fast_scales(s):
    """uint8 e4m3 bits -> bf16 ``scale * 2^118`` (exact; folds the decode's 2^126 minus 2^8).

    sm_90 only (the fast path): the e4m3 -> f16 hardware conversion (one instruction per two
    scales) replaces ``decode_e4m3``'s ~10 integer/float ops, which cost ~0.5 instructions per
    weight in the small-M K loop. Every e4m3 value, subnormals included, is exact in f16 and fp32.
    """
    return (s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 3.32306998946229e35).to(tl.bfloat16)


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


_WORDS_ASM = tl.constexpr(
    "{\n.reg .b32 a, b, t, u;\nprmt.b32 a, $8, $9, 0x5410;\nprmt.b32 b, $8, $9, 0x7632;\n"
    + "shl.b32 a, a, 4;\n".join(_top_nibble("a", f"${i}", "$10") for i in (3, 2, 1, 0))
    + "".join(_top_nibble("b", f"${i}", "$10") + ("shl.b32 b, b, 4;\n" if i > 4 else "") for i in (7, 6, 5, 4))
    + "}")
# Word decode (pack=2): $8/$9 are two 32-bit words (8 nibbles each: nibble i = K element 8w+i),
# $10 the bf16x2 fast scales of the two words. prmt gathers the same 16-bit half of both words
# into one register (a: nibbles 0-3, b: nibbles 4-7), so nibble i of word 0 and word 1 decode
# into one bf16x2 together: 8 outputs $0..$7 = elements 8w+0 .. 8w+7, each for both words.
# About 3 PTX ops per weight, no per-byte unpacking, and each output is already a register pair.


@triton.jit
def decode_words_fast(pw, sc):
    """int32 [R, C] words (8 codes each), bf16 [R, C] per-word fast scales -> 8 bf16 tiles."""
    return tl.inline_asm_elementwise(
        asm=_WORDS_ASM,
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r",
        args=[pw, sc],
        dtype=(tl.bfloat16,) * 8,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _nib(pw, sh: tl.constexpr, sc, dtype: tl.constexpr):
    return (_e2m1_fp32((pw >> sh) & 0xF) * sc).to(dtype)


@triton.jit
def decode_words_portable(pw, sc, dtype: tl.constexpr):
    """int32 words + fp32 per-word scales -> 8 tiles in ``dtype`` (element 8w+i in tile i), exact."""
    return (_nib(pw, 0, sc, dtype), _nib(pw, 4, sc, dtype), _nib(pw, 8, sc, dtype), _nib(pw, 12, sc, dtype),
            _nib(pw, 16, sc, dtype), _nib(pw, 20, sc, dtype), _nib(pw, 24, sc, dtype), _nib(pw, 28, sc, dtype))


def _twiddled_slot(src: str, slot: int) -> str:
    # One slot of a twiddled register -> t (bf16x2 of word 0's and word 1's element), see twiddle.py.
    if slot == 0:
        return f"and.b32 t, {src}, 0x81C081C0;\n"
    if slot < 3:
        return f"shl.b32 t, {src}, {3 * slot};\nand.b32 t, t, 0x81C081C0;\n"
    return (f"shl.b32 t, {src}, 1;\nand.b32 t, t, 0x80008000;\nshr.b32 u, {src}, 3;\nand.b32 u, u, 0x01800180;\n"
            f"or.b32 t, t, u;\nshr.b32 u, {src}, 7;\nand.b32 u, u, 0x00400040;\nor.b32 t, t, u;\n")


def _twiddled_asm() -> str:
    body = "{\n.reg .b32 a, b, s, t, u;\nmov.b64 {a, b}, $16;\nmov.b32 s, {$17, $17};\n"
    for i in range(8):
        body += _twiddled_slot("a" if i < 4 else "b", i % 4)
        body += f"mul.rn.bf16x2 t, t, s;\nmov.b32 {{${2 * i}, ${2 * i + 1}}}, t;\n"
    return body + "}"


_TWIDDLED_ASM = tl.constexpr(_twiddled_asm())
# Twiddled group decode (pack=1): $16 is one scale group as a 64-bit value (the two twiddled words:
# elements 0..3 and 4..7 of both original words), $17 its bf16 fast scale; outputs $2i / $2i+1 are
# element i of word 0 / word 1 (16-bit halves of one bf16x2 product). Loading whole groups as
# int64 is what guarantees each call sees the two words of one group: a pack=2 pairing of int32
# words follows Triton's register order, which pairs rows instead when K's stride is not 16-aligned.
# ~1.9 PTX ops per weight instead of ~3.2: no prmt per word, one shift + one AND for most slots.


@triton.jit
def decode_words_twiddled(pw, sc, BN: tl.constexpr, BKW: tl.constexpr):
    """int64 [BN, BKW // 2] twiddled groups, bf16 [BN, BKW // 2] fast scales -> 8 bf16 tiles [BN, BKW] (sm_90)."""
    o = tl.inline_asm_elementwise(
        asm=_TWIDDLED_ASM,
        constraints="=h," * 16 + "l,h",
        args=[pw, sc],
        dtype=(tl.bfloat16,) * 16,
        is_pure=True,
        pack=1,
    )
    return (tl.reshape(tl.join(o[0], o[1]), (BN, BKW)), tl.reshape(tl.join(o[2], o[3]), (BN, BKW)),
            tl.reshape(tl.join(o[4], o[5]), (BN, BKW)), tl.reshape(tl.join(o[6], o[7]), (BN, BKW)),
            tl.reshape(tl.join(o[8], o[9]), (BN, BKW)), tl.reshape(tl.join(o[10], o[11]), (BN, BKW)),
            tl.reshape(tl.join(o[12], o[13]), (BN, BKW)), tl.reshape(tl.join(o[14], o[15]), (BN, BKW)))


@triton.jit
def _twiddled_code(reg):
    """A decoded register's low-half bf16 pattern (sign bit 15, e1 e0 m at 8..6) -> 4-bit code."""
    return ((reg >> 12) & 8) | ((reg >> 6) & 7)


@triton.jit
def _twiddled_slots(r):
    """The four slot registers of a twiddled word, exactly the shifts and masks of the PTX."""
    # 0x81C081C0 and 0x80008000 as int32 literals (Triton rejects unsigned ones above 2^31).
    s0 = r & -0x7E3F7E40
    s1 = (r << 3) & -0x7E3F7E40
    s2 = (r << 6) & -0x7E3F7E40
    s3 = ((r << 1) & -0x7FFF8000) | ((r >> 3) & 0x01800180) | ((r >> 7) & 0x00400040)
    return s0, s1, s2, s3


@triton.jit
def _twiddled_tile(reg, sc, dtype: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr):
    # Element i of both words: low half -> word 0, high half -> word 1; re-joined along K words.
    lo = (_e2m1_fp32(_twiddled_code(reg)) * sc).to(dtype)
    hi = (_e2m1_fp32(_twiddled_code(reg >> 16)) * sc).to(dtype)
    return tl.reshape(tl.join(lo, hi), (BN, BKW))


@triton.jit
def decode_words_twiddled_portable(pw, sc, dtype: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr):
    """Twiddled words + fp32 per-group scales [BN, BKW // 2] -> 8 tiles, exact, plain integer ops.

    The interpreter / fp16 path for twiddled weights: it runs the same slot shifts and masks as the
    PTX, so CPU tests exercise the layout end to end.
    """
    a, b = tl.split(tl.reshape(pw, (BN, BKW // 2, 2)))
    a0, a1, a2, a3 = _twiddled_slots(a)
    b0, b1, b2, b3 = _twiddled_slots(b)
    return (_twiddled_tile(a0, sc, dtype, BN, BKW), _twiddled_tile(a1, sc, dtype, BN, BKW),
            _twiddled_tile(a2, sc, dtype, BN, BKW), _twiddled_tile(a3, sc, dtype, BN, BKW),
            _twiddled_tile(b0, sc, dtype, BN, BKW), _twiddled_tile(b1, sc, dtype, BN, BKW),
            _twiddled_tile(b2, sc, dtype, BN, BKW), _twiddled_tile(b3, sc, dtype, BN, BKW))


@triton.jit
def decode_word_tile(pw, s, BN: tl.constexpr, BKW: tl.constexpr, FAST: tl.constexpr, dtype: tl.constexpr,
                     TWIDDLED: tl.constexpr = False):
    """Words [BN, BKW] + raw e4m3 group scales [BN, BKW // 2] -> 8 tiles [BN, BKW] (a group = 2 words).

    ``TWIDDLED``: the words are in twiddle.py's load-time layout instead of the on-disk one; with
    ``FAST`` the caller passes them as int64 groups [BN, BKW // 2] (see ``load_word_tile``).
    """
    if FAST:
        sc = fast_scales(s)
    else:
        sc = decode_e4m3(s)
    # One return at the end: Triton compiles the code after an early return inside a constexpr if.
    if TWIDDLED:
        if FAST:
            out = decode_words_twiddled(pw, sc, BN, BKW)  # pw: int64 groups [BN, BKW // 2]
        else:
            out = decode_words_twiddled_portable(pw, sc, dtype, BN, BKW)
    else:
        scw = tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, BKW // 2, 2)), (BN, BKW))
        if FAST:
            out = decode_words_fast(pw, scw)
        else:
            out = decode_words_portable(pw, scw, dtype)
    return out


@triton.jit
def load_word_tile(PW, rows, kw, stride_pw, KW, BKW: tl.constexpr, TWIDDLED: tl.constexpr, FAST: tl.constexpr,
                   BLOCKED: tl.constexpr = False, EVEN_K: tl.constexpr = False):
    """The [rows, BKW] code words at word column ``kw`` (on-disk layout), or, for the twiddled fast
    decode, the same bytes as int64 groups [rows, BKW // 2] so each decode call owns one group
    (then PW points to int64 and stride_pw is in groups).

    ``BLOCKED``: the codes are stored in 1 KB blocks of 16 rows x 64 bytes (twiddle.block), so a
    K step of a 16-row slice is one contiguous 1 KB read instead of 16 strided 64 B ones.
    ``EVEN_K``: every K step is whole, so the load needs no mask and vectorises (16-byte copies).
    """
    if TWIDDLED:
        if FAST:
            # PW is an int64 pointer here and stride_pw counts int64 groups (see gemm_fwd's wrapper):
            # a pointer cast inside the kernel would lose the 16-byte alignment Triton needs to vectorise.
            rg = kw // 2 + tl.arange(0, BKW // 2)
            if BLOCKED:
                kg = KW // 2
                row_off = (rows // 16) * (kg // 8) * 128 + (rows % 16) * 8
                col_off = (rg // 8) * 128 + rg % 8
                ptr = PW + row_off[:, None] + col_off[None, :]
            else:
                ptr = PW + rows[:, None] * stride_pw + rg[None, :]
            if EVEN_K:
                out = tl.load(ptr)
            else:
                out = tl.load(ptr, mask=(rg < KW // 2)[None, :], other=0)
        else:
            rw = kw + tl.arange(0, BKW)
            if BLOCKED:
                ptr = PW + ((rows // 16) * (KW // 16) * 256 + (rows % 16) * 16)[:, None] + ((rw // 16) * 256 + rw % 16)[None, :]
            else:
                ptr = PW + rows[:, None] * stride_pw + rw[None, :]
            out = tl.load(ptr, mask=(rw < KW)[None, :], other=0)
    else:
        rw = kw + tl.arange(0, BKW)
        out = tl.load(PW + rows[:, None] * stride_pw + rw[None, :], mask=(rw < KW)[None, :], other=0)
    return out


@triton.jit
def _halves(w):
    lo = w.to(tl.int16).to(tl.bfloat16, bitcast=True)
    hi = (w >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def probe_tiles(pw, R: tl.constexpr, BKW: tl.constexpr):
    """Benchmark probe (meaningless values): int64 groups [R, BKW // 2] -> 8 bf16 tiles [R, BKW]
    with almost no ALU work, so a timing shows what the pipeline does without the decode."""
    a = pw.to(tl.int32)
    b = (pw >> 32).to(tl.int32)
    a0, a1 = _halves(a)
    b0, b1 = _halves(b)
    t0 = tl.reshape(tl.join(a0, b0), (R, BKW))
    t1 = tl.reshape(tl.join(a1, b1), (R, BKW))
    return t0, t1, t0, t1, t0, t1, t0, t1


@triton.jit
def decode_or_probe(pw, s, BN: tl.constexpr, BKW: tl.constexpr, FAST: tl.constexpr, dtype: tl.constexpr,
                    TWIDDLED: tl.constexpr, PROBE: tl.constexpr):
    """``decode_word_tile``, or with ``PROBE`` the codes reinterpreted as bf16 with ~1 op per pair (a
    benchmark probe of the load/MMA pipeline without the decode's ALU work; wrong values)."""
    if PROBE:
        out = probe_tiles(pw, BN, BKW)
    else:
        out = decode_word_tile(pw, s, BN, BKW, FAST, dtype, TWIDDLED)
    return out


@triton.jit
def _parity_split(e, R: tl.constexpr, G: tl.constexpr):
    return tl.split(tl.reshape(e, (R, G, 2)))


@triton.jit
def perm_weights(e0, e1, e2, e3, e4, e5, e6, e7, R: tl.constexpr, BKW: tl.constexpr):
    """8 decoded tiles [R, BKW] (tile i, column w = element 8w+i) -> one [R, 8 * BKW] tile in the
    MMA-fragment K order of ``perm_x`` (see gemm_fwd ``PERM``).

    Logical k = 16 b + 8 h + 2 c + t (b = 8 g_hi + 4 g_lo + b4) takes physical group g = 8 g_hi + 2 c
    + g_lo, element i = 2 b4 + h of that group's word t: each thread of a quad (c = lane % 4) then
    holds exactly its own groups' decoded registers, pairs (t = 0, 1) already adjacent, so no shuffle
    should be needed; its groups come in adjacent pairs (2c, 2c + 1: one 16-byte load of codes).
    """
    G: tl.constexpr = BKW // 2
    a0, b0 = _parity_split(e0, R, G)
    a1, b1 = _parity_split(e1, R, G)
    a2, b2 = _parity_split(e2, R, G)
    a3, b3 = _parity_split(e3, R, G)
    a4, b4 = _parity_split(e4, R, G)
    a5, b5 = _parity_split(e5, R, G)
    a6, b6 = _parity_split(e6, R, G)
    a7, b7 = _parity_split(e7, R, G)
    # P_i = [R, G, t]; Q = [R, G, t, h]; S = [R, G, t, h, bb0, bb1] with element i = 4 bb1 + 2 bb0 + h.
    q0 = tl.join(tl.join(a0, b0), tl.join(a1, b1))
    q1 = tl.join(tl.join(a2, b2), tl.join(a3, b3))
    q2 = tl.join(tl.join(a4, b4), tl.join(a5, b5))
    q3 = tl.join(tl.join(a6, b6), tl.join(a7, b7))
    s = tl.join(tl.join(q0, q1), tl.join(q2, q3))
    s = tl.reshape(s, (R, G // 8, 4, 2, 2, 2, 2, 2))  # [R, g_hi, c, g_lo, t, h, bb0, bb1]
    s = tl.permute(s, (0, 1, 3, 7, 6, 5, 2, 4))  # [R, g_hi, g_lo, bb1, bb0, h, c, t]
    return tl.reshape(s, (R, 8 * BKW))


@triton.jit
def k_order(c):
    """Natural column c of an activation row -> its column in the MMA's K order (``perm_x`` within each
    128-column step), for kernels that write a GEMM's X already permuted: c = 32 c4 + 16 g_lo + 8 t +
    4 bb1 + 2 bb0 + h goes to 64 g_lo + 32 bb1 + 16 bb0 + 8 h + 2 c4 + t of its step."""
    n = c % 128
    return (c - n + ((n >> 4) & 1) * 64 + ((n >> 2) & 1) * 32 + ((n >> 1) & 1) * 16 + (n & 1) * 8 + (n >> 5) * 2
            + ((n >> 3) & 1))


@triton.jit
def perm_x(x, R: tl.constexpr, BKW: tl.constexpr):
    """Activations [R, 8 * BKW] in natural K order -> the same logical order as ``perm_weights``."""
    G: tl.constexpr = BKW // 2
    x = tl.reshape(x, (R, G // 8, 4, 2, 2, 2, 2, 2))  # [R, g_hi, c, g_lo, t, bb1, bb0, h]: k = 16 g + 8 t + i
    x = tl.permute(x, (0, 1, 3, 5, 6, 7, 2, 4))  # [R, g_hi, g_lo, bb1, bb0, h, c, t]
    return tl.reshape(x, (R, 8 * BKW))


@triton.jit
def split8(x, R: tl.constexpr, C: tl.constexpr):
    """[R, 8C] -> 8 tiles [R, C], tile i holding columns 8c+i (matches ``decode_word_tile``)."""
    a, b = tl.split(tl.reshape(x, (R, C, 4, 2)))  # b: odd columns
    a0, a1 = tl.split(tl.reshape(a, (R, C, 2, 2)))
    b0, b1 = tl.split(tl.reshape(b, (R, C, 2, 2)))
    x0, x4 = tl.split(a0)
    x2, x6 = tl.split(a1)
    x1, x5 = tl.split(b0)
    x3, x7 = tl.split(b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def join8(e0, e1, e2, e3, e4, e5, e6, e7, R: tl.constexpr, C: tl.constexpr):
    """Inverse of ``split8``: 8 tiles [R, C] -> [R, 8C] with column 8c+i from tile i."""
    # tl.join appends the new axis last, so join the slowest bit (4) first and the fastest (1) last.
    p00 = tl.join(e0, e4)
    p01 = tl.join(e1, e5)
    p10 = tl.join(e2, e6)
    p11 = tl.join(e3, e7)
    q0 = tl.join(p00, p10)
    q1 = tl.join(p01, p11)
    return tl.reshape(tl.join(q0, q1), (R, 8 * C))


__all__ = [
    "FAST_EPILOGUE",
    "PORTABLE_EPILOGUE",
    "decode_e4m3",
    "decode_tile",
    "fast_decode_supported",
    "triton",
]
