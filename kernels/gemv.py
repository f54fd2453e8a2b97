"""NVFP4 x bf16 for 1-4 activation rows on the CUDA cores: no tensor cores, no split-K (``FwdConfig.gemv``).

Trade-off: the MMA kernels (gemm_gluon*, gemm_fwd) spend a 64-row tensor-core operand on 1-4 rows of X,
which costs nothing at these sizes, but they need split-K to give a small weight enough programs, and
each split pays a partial write, an arrival counter and a last-arriver reduction: two L2 round trips that
Nsight Compute showed to be a third of a small weight's time at M = 16 (docs/benchmarks.md, kernels,
fifteenth pass). Here each program owns ``BN`` whole rows of W and all of K, so nothing is reduced across
programs: the program decodes each K step with the same PTX as the MMA kernels (``decode_word_tile``),
multiplies the decoded tiles by X's matching columns in fp32 (products of bf16 values are exact in fp32)
and sums along K once at the end. The cost moves to the CUDA cores: about 2 decode instructions plus
one FMA per weight and X row (and one conversion), so beyond ~4 rows the FMAs outrun the weight reads
and the MMA kernels win again; the tile table holds a GEMV entry only where it measured faster.
The next step's codes, scales and X are loaded before the current step is decoded, so one step of
loads is always in flight per program besides the one being decoded.

Same layouts as ``gemm_fwd``'s Triton tile: on-disk or twiddled codes (int64 scale groups with the fast
decode), blocked or not; scales row-major e4m3; any N, K % 16 == 0. fp16/fp32 run the portable decode
(CPU tests in Triton's interpreter), bf16 on sm_90 the PTX one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from qerl_kernels.decode import FAST_EPILOGUE, PORTABLE_EPILOGUE, decode_word_tile, load_word_tile, split8

MAX_ROWS = 4  # X rows one launch serves (the accumulators are unrolled per row)


@triton.jit
def _load_step(X, PW, S, rn_ld, rm_ld, rows_ok, kw, stride_xm, stride_pw, stride_sn, KW, BM: tl.constexpr,
               BKW: tl.constexpr, TWIDDLED: tl.constexpr, FAST: tl.constexpr, BLOCKED: tl.constexpr,
               EVEN_K: tl.constexpr):
    """Codes, e4m3 scales and the X columns [BM, 8 BKW] of the K step starting at word ``kw``."""
    pw = load_word_tile(PW, rn_ld, kw, stride_pw, KW, BKW, TWIDDLED, FAST, BLOCKED, EVEN_K)
    gidx = kw // 2 + tl.arange(0, BKW // 2)
    s = tl.load(S + rn_ld[:, None] * stride_sn + gidx[None, :], mask=(gidx < KW // 2)[None, :], other=0)
    xk = 8 * kw + tl.arange(0, 8 * BKW)
    x = tl.load(X + rm_ld[:, None] * stride_xm + xk[None, :], mask=rows_ok[:, None] & (xk < 8 * KW)[None, :],
                other=0.0)
    return pw, s, x


@triton.jit
def _row_dot(acc, e0, e1, e2, e3, e4, e5, e6, e7, x, BKW: tl.constexpr):
    """acc [BN, BKW] += the decoded tiles times one X row's matching columns (x: [1, 8 BKW])."""
    x0, x1, x2, x3, x4, x5, x6, x7 = split8(x, 1, BKW)
    acc += e0.to(tl.float32) * x0.to(tl.float32)
    acc += e1.to(tl.float32) * x1.to(tl.float32)
    acc += e2.to(tl.float32) * x2.to(tl.float32)
    acc += e3.to(tl.float32) * x3.to(tl.float32)
    acc += e4.to(tl.float32) * x4.to(tl.float32)
    acc += e5.to(tl.float32) * x5.to(tl.float32)
    acc += e6.to(tl.float32) * x6.to(tl.float32)
    acc += e7.to(tl.float32) * x7.to(tl.float32)
    return acc


@triton.jit
def _x_row(x, r: tl.constexpr, BM: tl.constexpr, BKW: tl.constexpr):
    """Row r of the [BM, 8 BKW] X tile as [1, 8 BKW] (a masked sum: BM <= 4, and no gather layout)."""
    sel = (tl.arange(0, BM) == r)[:, None]
    return tl.sum(tl.where(sel, x, 0.0), axis=0)[None, :].to(x.dtype)


@triton.jit
def _step(a0, a1, a2, a3, pw, s, x, BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr, FAST: tl.constexpr,
          TWIDDLED: tl.constexpr, dtype: tl.constexpr):
    e0, e1, e2, e3, e4, e5, e6, e7 = decode_word_tile(pw, s, BN, BKW, FAST, dtype, TWIDDLED)
    if BM == 1:
        a0 = _row_dot(a0, e0, e1, e2, e3, e4, e5, e6, e7, x, BKW)
    else:
        a0 = _row_dot(a0, e0, e1, e2, e3, e4, e5, e6, e7, _x_row(x, 0, BM, BKW), BKW)
        a1 = _row_dot(a1, e0, e1, e2, e3, e4, e5, e6, e7, _x_row(x, 1, BM, BKW), BKW)
        if BM > 2:
            a2 = _row_dot(a2, e0, e1, e2, e3, e4, e5, e6, e7, _x_row(x, 2, BM, BKW), BKW)
            a3 = _row_dot(a3, e0, e1, e2, e3, e4, e5, e6, e7, _x_row(x, 3, BM, BKW), BKW)
    return a0, a1, a2, a3


@triton.jit
def _store_row(Y, B, acc, r: tl.constexpr, M, N, rn, rn_ld, factor, stride_ym, HAS_BIAS: tl.constexpr):
    out = tl.sum(acc, axis=1) * factor
    if HAS_BIAS:
        out += tl.load(B + rn_ld).to(tl.float32)
    tl.store(Y + r * stride_ym + rn, out.to(Y.dtype.element_ty), mask=(rn < N) & (rn * 0 + r < M))


@triton.jit(do_not_specialize=["M"])
def _nvfp4_gemv_kernel(X, PW, S, G, B, Y, M, N, KW, stride_xm, stride_pw, stride_sn, stride_ym,
                       BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr, HAS_BIAS: tl.constexpr,
                       FAST: tl.constexpr, EPI: tl.constexpr, TWIDDLED: tl.constexpr, BLOCKED: tl.constexpr,
                       EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    rn_ld = rn % N  # rows past N wrap onto valid ones (unmasked, vectorised code loads); their sums are not stored
    rm = tl.arange(0, BM)
    rows_ok = rm < M
    rm_ld = tl.where(rows_ok, rm, 0)
    dtype = Y.dtype.element_ty
    a0 = tl.zeros((BN, BKW), dtype=tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    nsteps = tl.cdiv(KW, BKW)
    pw, s, x = _load_step(X, PW, S, rn_ld, rm_ld, rows_ok, 0, stride_xm, stride_pw, stride_sn, KW, BM, BKW,
                          TWIDDLED, FAST, BLOCKED, EVEN_K)
    for step in range(1, nsteps):
        # The next step's loads go out before this step decodes (one step always in flight).
        pw_n, s_n, x_n = _load_step(X, PW, S, rn_ld, rm_ld, rows_ok, step * BKW, stride_xm, stride_pw, stride_sn,
                                    KW, BM, BKW, TWIDDLED, FAST, BLOCKED, EVEN_K)
        a0, a1, a2, a3 = _step(a0, a1, a2, a3, pw, s, x, BM, BN, BKW, FAST, TWIDDLED, dtype)
        pw, s, x = pw_n, s_n, x_n
    a0, a1, a2, a3 = _step(a0, a1, a2, a3, pw, s, x, BM, BN, BKW, FAST, TWIDDLED, dtype)
    factor = EPI / tl.load(G)
    _store_row(Y, B, a0, 0, M, N, rn, rn_ld, factor, stride_ym, HAS_BIAS)
    if BM > 1:
        _store_row(Y, B, a1, 1, M, N, rn, rn_ld, factor, stride_ym, HAS_BIAS)
    if BM > 2:
        _store_row(Y, B, a2, 2, M, N, rn, rn_ld, factor, stride_ym, HAS_BIAS)
        _store_row(Y, B, a3, 3, M, N, rn, rn_ld, factor, stride_ym, HAS_BIAS)


def launch_gemv(x: torch.Tensor, words: torch.Tensor, scale_u8: torch.Tensor, global_scale: torch.Tensor,
                bias: torch.Tensor | None, bn: int, bkw: int, warps: int, fast: bool, twiddled: bool,
                blocked: bool) -> torch.Tensor:
    """Y [M, N] for M <= MAX_ROWS: ``words`` as ``gemm_fwd`` hands them to its kernel (int32 words, or int64
    scale groups for the twiddled fast decode), ``scale_u8`` the e4m3 scales' bytes [N, K/16]."""
    m, k = x.shape
    if not 0 < m <= MAX_ROWS:
        raise ValueError(f"the GEMV serves 1-{MAX_ROWS} rows of X, got {m}")
    n = words.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    kw = k // 8
    _nvfp4_gemv_kernel[(triton.cdiv(n, bn),)](
        x, words, scale_u8, global_scale.reshape(1).to(torch.float32), bias if bias is not None else y, y,
        m, n, kw, x.stride(0), words.stride(0), scale_u8.stride(0), y.stride(0),
        BM=triton.next_power_of_2(m), BN=bn, BKW=bkw, HAS_BIAS=bias is not None, FAST=fast,
        EPI=FAST_EPILOGUE if fast else PORTABLE_EPILOGUE, TWIDDLED=twiddled, BLOCKED=blocked,
        EVEN_K=kw % bkw == 0, num_warps=warps, num_stages=1,
    )
    return y
