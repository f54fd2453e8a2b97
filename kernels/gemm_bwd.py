"""Grad-input NVFP4 GEMM for training through the frozen base: dX[M, K] = dY[M, N] @ dequant(W[N, K]).

Trade-off: the backward reads W along its rows (N is the reduction), i.e. the transpose of the
forward's access, at M = 2k-16k tokens where the problem is compute-bound. Rather than keep a
transposed copy of the weights (memory) or dequantize a bf16 W^T per call (a full bf16 weight's
worth of traffic and memory per Linear), each program decodes the [BLOCK_N, BLOCK_K] weight tile
it needs in registers and feeds it to the tensor cores as the B operand, reused across BLOCK_M
rows of dY.

How it works: a packed byte holds K elements 2j (low nibble) and 2j+1 (high nibble). Decoding a
byte tile gives an even-column and an odd-column tile of W, so each program keeps two
accumulators (even and odd output columns of dX) and interleaves them once in the epilogue
(``tl.join``), instead of shuffling every decoded tile.

At M >= a measured threshold (``BwdConfig.dequant``) the weight is instead decoded once into a
transient dense buffer and cuBLAS runs ``dY @ W``: there the GEMM dwarfs the decode pass, and
cuBLAS's bf16 GEMM is faster than this kernel's decode-in-the-loop tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from qerl_kernels.decode import (
    FAST_EPILOGUE,
    PORTABLE_EPILOGUE,
    decode_tile,
    fast_decode_supported,
    grouped_tile,
)
from qerl_kernels.dequant import nvfp4_dequantize
from qerl_kernels.reference import ACTIVATION_DTYPES, check_weight
from qerl_kernels.tile_configs import BwdConfig, bwd_config


@triton.jit(do_not_specialize=["M"])
def _nvfp4_grad_input_kernel(
    DY, P, S, G, DX,
    M, N, KH,
    stride_dym, stride_pn, stride_sn, stride_dxm,
    BM: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr, GROUP_M: tl.constexpr,
    FAST: tl.constexpr, EPI: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_k = tl.cdiv(KH, BKH)
    pid_m, pid_k = grouped_tile(pid, grid_m, grid_k, GROUP_M)

    rm = pid_m * BM + tl.arange(0, BM)
    rm_ld = rm % M
    rk = pid_k * BKH + tl.arange(0, BKH)  # packed byte columns of this tile
    rk_ld = rk % KH
    rg = (pid_k * BKH) // 8 + tl.arange(0, BKH // 8)
    rg_ld = rg % (KH // 8)
    rn = tl.arange(0, BN)
    dtype = DY.dtype.element_ty

    acc_e = tl.zeros((BM, BKH), dtype=tl.float32)
    acc_o = tl.zeros((BM, BKH), dtype=tl.float32)
    for nb in range(0, N, BN):
        nn = nb + rn
        nmask = nn < N
        p = tl.load(P + nn[:, None] * stride_pn + rk_ld[None, :], mask=nmask[:, None], other=0)
        s = tl.load(S + nn[:, None] * stride_sn + rg_ld[None, :], mask=nmask[:, None], other=0)
        dy = tl.load(DY + rm_ld[:, None] * stride_dym + nn[None, :], mask=nmask[None, :], other=0.0)
        lo, hi = decode_tile(p, s, BN, BKH, FAST, dtype)
        if IEEE:
            acc_e = tl.dot(dy, lo, acc_e, input_precision="ieee")
            acc_o = tl.dot(dy, hi, acc_o, input_precision="ieee")
        else:
            acc_e = tl.dot(dy, lo, acc_e)
            acc_o = tl.dot(dy, hi, acc_o)

    factor = EPI / tl.load(G)
    out = tl.reshape(tl.join(acc_e * factor, acc_o * factor), (BM, 2 * BKH))
    rc = 2 * pid_k * BKH + tl.arange(0, 2 * BKH)
    omask = (rm < M)[:, None] & (rc < 2 * KH)[None, :]
    tl.store(DX + rm[:, None] * stride_dxm + rc[None, :], out.to(DX.dtype.element_ty), mask=omask)


def nvfp4_matmul_grad_input(
    dy: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    config: BwdConfig | None = None,
    fast: bool | None = None,
    twiddled: bool = False,
    blocked: bool = False,
) -> torch.Tensor:
    """dy [M, N] @ dequant(packed [N, K/2], scale [N, K/16], global [1]) -> [M, K] in dy's dtype.

    ``twiddled`` codes (twiddle.py) always take the decode-once + cuBLAS path: this kernel's byte-tile
    decode reads the on-disk layout, and training's grad-input runs at M in the thousands, where
    that path is the measured winner anyway.
    """
    n, k = check_weight(packed, scale)
    if dy.ndim != 2 or dy.shape[1] != n:
        raise ValueError(f"dy {tuple(dy.shape)} does not fit weight with N={n}")
    if dy.dtype not in ACTIVATION_DTYPES:  # fp64 was read as fp32 bits
        raise ValueError(f"dy must be one of {', '.join(str(d) for d in ACTIVATION_DTYPES)}, got {dy.dtype}")
    m, kh = dy.shape[0], k // 2
    if dy.stride(1) != 1:
        dy = dy.contiguous()
    cfg = config or bwd_config(m, n, 2 * kh)
    if cfg.dequant or twiddled:
        # Compute-bound regime: decode once to a transient dense weight, cuBLAS for the GEMM.
        return dy @ nvfp4_dequantize(packed, scale, global_scale, dtype=dy.dtype, twiddled=twiddled, blocked=blocked)
    packed = packed.contiguous()
    scale_u8 = scale.contiguous().view(torch.uint8)
    dx = torch.empty((m, 2 * kh), dtype=dy.dtype, device=dy.device)
    if m == 0:
        return dx
    if fast is None:
        fast = dy.dtype == torch.bfloat16 and fast_decode_supported(dy.device)
    grid = (triton.cdiv(m, cfg.bm) * triton.cdiv(kh, cfg.bkh),)
    _nvfp4_grad_input_kernel[grid](
        dy, packed, scale_u8, global_scale.reshape(1).to(torch.float32), dx,
        m, n, kh,
        dy.stride(0), packed.stride(0), scale_u8.stride(0), dx.stride(0),
        BM=cfg.bm, BN=cfg.bn, BKH=cfg.bkh, GROUP_M=cfg.group_m,
        FAST=fast, EPI=FAST_EPILOGUE if fast else PORTABLE_EPILOGUE, IEEE=dy.dtype == torch.float32,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return dx
