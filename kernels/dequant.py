"""NVFP4 -> bf16/fp16/fp32 dequantization on the GPU, and the 32-bit word view of packed codes.

Trade-off: at large M (prefill, training micro-batches of thousands of tokens) the GEMM is
compute-bound and cuBLAS's bf16 GEMM beats a Triton GEMM that also decodes; decoding the weight
once into a transient dense buffer costs one memory-bound pass (0.5625 B read + 2 B written per
weight) and lets cuBLAS do the rest. The transient buffer is the price: one Linear's bf16 weight
at a time, freed to the caching allocator after the GEMM.

How it works: each program decodes a [BLOCK_N, 8 * BLOCK_W] tile from 32-bit words with the same
decode as the GEMMs (``decode.decode_word_tile``), re-interleaves the 8 per-nibble tiles with
``join8`` and writes it contiguously, multiplied by the global factor in fp32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from qerl_kernels.decode import (
    FAST_EPILOGUE,
    PORTABLE_EPILOGUE,
    decode_word_tile,
    fast_decode_supported,
    join8,
    load_word_tile,
)
from qerl_kernels.reference import check_nvfp4_dtypes


def as_words(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> int32 [N, K/8] view of the same bytes (K % 16 == 0 makes rows whole words)."""
    if not packed.is_contiguous() or packed.data_ptr() % 16:
        packed = packed.contiguous().clone()
    return packed.view(torch.int32)


@triton.jit
def _nvfp4_dequant_kernel(
    PW, S, G, W, N, KW, stride_pw, stride_sn, stride_wn,
    BN: tl.constexpr, BKW: tl.constexpr, FAST: tl.constexpr, EPI: tl.constexpr, TWIDDLED: tl.constexpr = False,
    BLOCKED: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rg = pid_k * (BKW // 2) + tl.arange(0, BKW // 2)
    nmask = rn < N
    pw = load_word_tile(PW, rn % N, pid_k * BKW, stride_pw, KW, BKW, TWIDDLED, FAST, BLOCKED)
    s = tl.load(S + rn[:, None] * stride_sn + rg[None, :], mask=nmask[:, None] & (rg < KW // 2)[None, :], other=0)
    dtype = W.dtype.element_ty
    e0, e1, e2, e3, e4, e5, e6, e7 = decode_word_tile(pw, s, BN, BKW, FAST, tl.float32, TWIDDLED)
    w = join8(e0, e1, e2, e3, e4, e5, e6, e7, BN, BKW).to(tl.float32) * (EPI / tl.load(G))
    rk = pid_k * 8 * BKW + tl.arange(0, 8 * BKW)
    tl.store(W + rn[:, None] * stride_wn + rk[None, :], w.to(dtype), mask=nmask[:, None] & (rk < 8 * KW)[None, :])


def nvfp4_dequantize(packed, scale, global_scale, dtype=torch.bfloat16, fast: bool | None = None,
                     twiddled: bool = False, blocked: bool = False) -> torch.Tensor:
    """packed [N, K/2] uint8 (on-disk or ``twiddled`` layout) + scale [N, K/16] e4m3 + global [1] -> dense [N, K]."""
    check_nvfp4_dtypes(packed, scale)
    n, kh = packed.shape
    k = 2 * kh
    if k % 16 or scale.shape != (n, k // 16):
        raise ValueError(f"scale {tuple(scale.shape)} / K={k} do not fit the NVFP4 layout")
    words = as_words(packed)
    scale_u8 = scale.contiguous().view(torch.uint8)
    w = torch.empty((n, k), dtype=dtype, device=packed.device)
    if fast is None:
        fast = fast_decode_supported(packed.device)
    if twiddled and fast:
        words = words.view(torch.int64)  # whole scale groups: see decode.load_word_tile
    bn, bkw = 32, 64
    grid = (triton.cdiv(n, bn), triton.cdiv(k // 8, bkw))
    _nvfp4_dequant_kernel[grid](
        words, scale_u8, global_scale.reshape(1).to(torch.float32), w, n, k // 8,
        words.stride(0), scale_u8.stride(0), w.stride(0),
        BN=bn, BKW=bkw, FAST=fast, EPI=FAST_EPILOGUE if fast else PORTABLE_EPILOGUE, TWIDDLED=twiddled, BLOCKED=blocked, num_warps=4,
    )
    return w
