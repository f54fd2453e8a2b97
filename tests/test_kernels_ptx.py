"""The sm_90 PTX decode sequences, executed on CPU by a tiny interpreter of the opcodes they use.

The GPU tests run the real asm; CI has no GPU, so this checks the asm *text* itself (register
numbering, prmt selectors, masks, shifts) against the E2M1 table for every code and every e4m3
scale, bit-exactly, plus the exactness argument the fast path rests on (``scale * 2^118`` and
``e2m1 * scale * 2^-8`` are exact bf16 numbers).
"""

import re

import numpy as np
import pytest
import torch
from qerl_kernels import decode, reference


def _bf16_bits_to_f64(bits: np.ndarray) -> np.ndarray:
    return torch.from_numpy((bits.astype(np.uint32) << 16).view(np.float32)).double().numpy()


def _f64_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    b = torch.from_numpy(x).to(torch.bfloat16)  # round to nearest even, subnormals kept
    return b.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)


def _prmt(a, b, sel):
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        assert s < 8, "sign-replicate selectors are not used by qerl's asm"
        out |= src[s] << (8 * i)
    return out


def run_ptx(asm: str, inputs: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Execute the straight-line PTX in ``asm`` on uint32 arrays; $n operands come from ``inputs``."""
    regs = {f"${k}": (v if v.dtype == np.uint64 else v.astype(np.uint32)) for k, v in inputs.items()}

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.uint32(int(tok, 0))

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        vec = re.fullmatch(r"\{\s*(\S+),\s*(\S+)\s*\},\s*(\S+)", rest)  # mov {lo, hi}, wide: unpack
        if op in ("mov.b64", "mov.b32") and vec:
            bits = 32 if op == "mov.b64" else 16
            wide = regs[vec.group(3)].astype(np.uint64)
            regs[vec.group(1)] = (wide & ((1 << bits) - 1)).astype(np.uint32)
            regs[vec.group(2)] = (wide >> np.uint64(bits)).astype(np.uint32)
            continue
        pack = re.fullmatch(r"(\S+),\s*\{\s*(\S+),\s*(\S+)\s*\}", rest)  # mov wide, {lo, hi}: pack
        if op == "mov.b32" and pack:
            regs[pack.group(1)] = (val(pack.group(2)) & 0xFFFF) | ((val(pack.group(3)) & 0xFFFF) << 16)
            continue
        args = [a.strip() for a in rest.split(",")]
        d, srcs = args[0], [val(a) for a in args[1:]]
        if op == "prmt.b32":
            r = _prmt(np.broadcast_to(srcs[0], srcs[0].shape).astype(np.uint32),
                      np.broadcast_to(srcs[1], srcs[0].shape).astype(np.uint32), int(srcs[2]))
        elif op == "and.b32":
            r = srcs[0] & srcs[1]
        elif op == "or.b32":
            r = srcs[0] | srcs[1]
        elif op == "shr.b32":
            r = srcs[0] >> srcs[1]
        elif op == "shl.b32":
            r = (srcs[0].astype(np.uint64) << np.uint64(srcs[1])).astype(np.uint64) & 0xFFFFFFFF
        elif op == "mul.rn.bf16x2":
            lo = _bf16_bits_to_f64(srcs[0] & 0xFFFF) * _bf16_bits_to_f64(srcs[1] & 0xFFFF)
            hi = _bf16_bits_to_f64(srcs[0] >> 16) * _bf16_bits_to_f64(srcs[1] >> 16)
            r = _f64_to_bf16_bits(lo) | (_f64_to_bf16_bits(hi) << 16)
        else:
            raise AssertionError(f"opcode {op} not modelled")
        regs[d] = np.asarray(r, dtype=np.uint64).astype(np.uint32)
    return {int(k[1:]): v for k, v in regs.items() if re.fullmatch(r"\$\d+", k)}


E2M1 = reference.e2m1_table(dtype=torch.float64).numpy()
E4M3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()  # all finite >= 0


def _fast_scale_bits(s: np.ndarray) -> np.ndarray:
    return _f64_to_bf16_bits(s * 2.0**118)


def test_fast_scale_and_products_are_exact_bf16():
    sc = E4M3 * 2.0**118
    assert np.array_equal(_bf16_bits_to_f64(_fast_scale_bits(E4M3)), sc)
    prod = E2M1[:, None] * E4M3[None, :] * 2.0**-8
    assert np.array_equal(_bf16_bits_to_f64(_f64_to_bf16_bits(prod)), prod)
    assert (np.abs(prod[prod != 0]) >= 2.0**-126).all()  # normal bf16: no subnormal product


@pytest.mark.parametrize("seed", [0, 1])
def test_word_decode_asm_matches_table(seed):
    rng = np.random.default_rng(seed)
    n = 4096
    w0 = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    w1 = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    w0[:16] = np.uint32(0x88888888)  # all -0
    w1[:16] = np.uint32(0x76543210)  # every positive code once
    si = rng.integers(0, len(E4M3), (n, 2))
    s = E4M3[si]
    scale_pair = _fast_scale_bits(s[:, 0]) | (_fast_scale_bits(s[:, 1]) << 16)
    out = run_ptx(decode._WORDS_ASM.value, {8: w0, 9: w1, 10: scale_pair})
    for i in range(8):
        for half, (w, sv) in enumerate(((w0, s[:, 0]), (w1, s[:, 1]))):
            got = _bf16_bits_to_f64((out[i] >> (16 * half)) & 0xFFFF)
            want = E2M1[(w >> (4 * i)) & 0xF] * sv * 2.0**-8
            assert np.array_equal(got, want), (i, half)


@pytest.mark.parametrize("seed", [0, 1])
def test_twiddled_word_decode_asm_matches_table(seed):
    """The load-time layout's PTX: twiddle on-disk words with twiddle.py, run the asm, compare codes."""
    from qerl_kernels.twiddle import twiddle

    rng = np.random.default_rng(seed + 10)
    n = 4096
    w = rng.integers(0, 2**32, (n, 2), dtype=np.uint64).astype(np.uint32)
    w[:16] = [0x88888888, 0x76543210]  # all -0, then every positive code once
    w[16:32] = [0xFEDCBA98, 0x00000000]  # every negative code, then all +0
    tw = twiddle(torch.from_numpy(w.view(np.int32)).view(torch.uint8)).view(torch.int64).numpy().view(np.uint64)
    s = E4M3[rng.integers(0, len(E4M3), n)]
    out = run_ptx(decode._TWIDDLED_ASM.value, {16: tw[:, 0], 17: _fast_scale_bits(s)})
    for i in range(8):
        for half in range(2):  # $2i: element i of word 0, $2i+1: of word 1
            got = _bf16_bits_to_f64(out[2 * i + half] & 0xFFFF)
            want = E2M1[(w[:, half] >> (4 * i)) & 0xF] * s * 2.0**-8
            assert np.array_equal(got, want), (i, half)


def test_byte_decode_asm_matches_table():
    rng = np.random.default_rng(2)
    n = 4096
    q = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    q[0] = np.uint32(0x88080880)
    s = E4M3[rng.integers(0, len(E4M3), (n, 4))]
    s01 = _fast_scale_bits(s[:, 0]) | (_fast_scale_bits(s[:, 1]) << 16)
    s23 = _fast_scale_bits(s[:, 2]) | (_fast_scale_bits(s[:, 3]) << 16)
    out = run_ptx(decode._DECODE_ASM.value, {4: q, 5: s01, 6: s23})
    for e in range(4):  # byte e: lo = element 2e (low nibble), hi = 2e+1
        byte = (q >> (8 * e)) & 0xFF
        reg, half = e // 2, e % 2
        lo = _bf16_bits_to_f64((out[0 + reg] >> (16 * half)) & 0xFFFF)
        hi = _bf16_bits_to_f64((out[2 + reg] >> (16 * half)) & 0xFFFF)
        assert np.array_equal(lo, E2M1[byte & 0xF] * s[:, e] * 2.0**-8), e
        assert np.array_equal(hi, E2M1[byte >> 4] * s[:, e] * 2.0**-8), e


def test_interpreter_catches_a_wrong_selector():
    bad = decode._WORDS_ASM.value.replace("0x5410", "0x5401", 1)
    w = np.array([0x76543210], dtype=np.uint32)
    good = run_ptx(decode._WORDS_ASM.value, {8: w, 9: w, 10: np.array([0x7E807E80], dtype=np.uint32)})
    wrong = run_ptx(bad, {8: w, 9: w, 10: np.array([0x7E807E80], dtype=np.uint32)})
    assert any(not np.array_equal(good[i], wrong[i]) for i in range(8))
