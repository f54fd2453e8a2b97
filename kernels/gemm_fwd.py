"""Forward NVFP4 x bf16 GEMM: Y[M, N] = X[M, K] @ dequant(W[N, K])^T (+ bias), one Triton kernel.

Trade-off: one kernel covers every M by its tile config rather than two specialised kernels.
- Small M (decode) is bound by reading W (0.5625 B/weight vs 2 B for bf16, so up to 3.56x over
  an ideal bf16 GEMV). ``SWAP`` computes the tile transposed (acc[BN, BM] = Wdec @ X^T) so the
  decoded weights are the wgmma's 64-row operand and the handful of X rows its narrow N; split-K
  spreads K over programs so N / BLOCK_N tiles still fill all SMs.
- Large M is compute-bound: BLOCK_M multiples of 64 (wgmma), each weight tile decoded once and
  reused across BLOCK_M rows; a grouped (GROUP_M) launch order keeps W tiles in L2.
The on-disk byte layout is used as is (no repack, no second copy of the weights in memory): the
decode yields even-K (``lo``) and odd-K (``hi``) tiles, so X is loaded contiguously and split
into its even and odd columns in registers, and the tile is two dots of half depth.

Split-K without extra launches: every split writes its fp32 partial to a workspace, then bumps a
per-tile counter (acq_rel atomic); the program that arrives last sums the partials in split order
(deterministic), adds the bias, writes Y and resets the counter for the next call. One launch
matters at decode sizes, where a GEMM takes a few microseconds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl_kernels.decode import FAST_EPILOGUE, PORTABLE_EPILOGUE, decode_tile, fast_decode_supported
from qerl_kernels.tile_configs import FwdConfig, fwd_config

_COUNTER_SLOTS = 1 << 16
_counters: dict[tuple[str, int | None], torch.Tensor] = {}


def _tile_counters(device: torch.device) -> torch.Tensor:
    """Per-device zeroed int32 counters; each split-K call leaves them zero again."""
    key = (device.type, device.index)
    buf = _counters.get(key)
    if buf is None:
        buf = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
        _counters[key] = buf
    return buf


@triton.jit(do_not_specialize=["M", "k_per_split"])
def _nvfp4_fwd_kernel(
    X, P, S, G, B, Y, WS, CNT,
    M, N, KH, k_per_split,
    stride_xm, stride_pn, stride_sn, stride_ym,
    BM: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr,
    EPI: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    # Grouped order: GROUP_M row-blocks walk the same W column-blocks back to back (L2 reuse).
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    gsz = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsz
    pid_n = (pid % width) // gsz

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    # Out-of-range rows/features are wrapped onto valid ones for the loads (no masks on the
    # hot loads, so they vectorise); their results are dropped by the masked store.
    rm_ld = rm % M
    rn_ld = rn % N
    rj = tl.arange(0, BKH)
    rg = tl.arange(0, BKH // 8)
    rx = tl.arange(0, 2 * BKH)
    dtype = X.dtype.element_ty

    k_lo = pid_k * k_per_split
    k_hi = min(k_lo + k_per_split, KH)
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(k_lo, k_hi, BKH):
        kmask = (kb + rj) < KH
        p = tl.load(P + rn_ld[:, None] * stride_pn + (kb + rj)[None, :], mask=kmask[None, :], other=0)
        gidx = kb // 8 + rg
        s = tl.load(S + rn_ld[:, None] * stride_sn + gidx[None, :], mask=(gidx < KH // 8)[None, :], other=0)
        xk = 2 * kb + rx
        x = tl.load(X + rm_ld[:, None] * stride_xm + xk[None, :], mask=(xk < 2 * KH)[None, :], other=0.0)
        lo, hi = decode_tile(p, s, BN, BKH, FAST, dtype)
        xe, xo = tl.split(tl.reshape(x, (BM, BKH, 2)))
        if SWAP:
            if IEEE:
                acc = tl.dot(lo, tl.trans(xe), acc, input_precision="ieee")
                acc = tl.dot(hi, tl.trans(xo), acc, input_precision="ieee")
            else:
                acc = tl.dot(lo, tl.trans(xe), acc)
                acc = tl.dot(hi, tl.trans(xo), acc)
        else:
            if IEEE:
                acc = tl.dot(xe, tl.trans(lo), acc, input_precision="ieee")
                acc = tl.dot(xo, tl.trans(hi), acc, input_precision="ieee")
            else:
                acc = tl.dot(xe, tl.trans(lo), acc)
                acc = tl.dot(xo, tl.trans(hi), acc)

    factor = EPI / tl.load(G)
    if SWAP:
        out = tl.trans(acc) * factor
    else:
        out = acc * factor
    omask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT:
        ws_tile = WS + rm[:, None] * N + rn[None, :]
        tl.store(ws_tile + pid_k * M * N, out, mask=omask)
        # All threads' partial stores must precede the release of the counter bump.
        tl.debug_barrier()
        tile = pid_m * grid_n + pid_n
        nsplit = tl.num_programs(1)
        arrived = tl.atomic_add(CNT + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == nsplit - 1:
            total = tl.zeros((BM, BN), dtype=tl.float32)
            for sk in range(0, nsplit):
                # .cg: read from L2, never a stale L1 line of another SM's partial.
                total += tl.load(ws_tile + sk * M * N, mask=omask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(B + rn_ld).to(tl.float32)[None, :]
            tl.store(Y + rm[:, None] * stride_ym + rn[None, :], total.to(Y.dtype.element_ty), mask=omask)
            tl.atomic_xchg(CNT + tile, 0)
    else:
        if HAS_BIAS:
            out += tl.load(B + rn_ld).to(tl.float32)[None, :]
        tl.store(Y + rm[:, None] * stride_ym + rn[None, :], out.to(Y.dtype.element_ty), mask=omask)


def _check(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> tuple[int, int, int]:
    if x.ndim != 2 or packed.ndim != 2:
        raise ValueError(f"want x [M, K] and packed [N, K/2], got {tuple(x.shape)} and {tuple(packed.shape)}")
    m, k = x.shape
    n, kh = packed.shape
    if k != 2 * kh or k % 16:
        raise ValueError(f"x has K={k} but the weight holds K={2 * kh} (K must be a multiple of 16)")
    if scale.shape != (n, k // 16):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not fit weight [{n}, {k}]")
    return m, n, k


def nvfp4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: FwdConfig | None = None,
    fast: bool | None = None,
) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) @ dequant(packed [N, K/2], scale [N, K/16] e4m3, global [1])^T.

    ``config`` overrides the table/heuristic (benchmarks, tests); ``fast`` forces the decode path
    (default: the PTX decode for bf16 on sm_90, the portable decode otherwise).
    """
    m, n, k = _check(x, packed, scale)
    if x.stride(1) != 1:
        x = x.contiguous()
    packed = packed.contiguous()
    scale_u8 = scale.contiguous().view(torch.uint8)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or fwd_config(m, n, k)
    if fast is None:
        fast = x.dtype == torch.bfloat16 and fast_decode_supported(x.device)
    kh = k // 2
    ksteps = triton.cdiv(kh, cfg.bkh)
    split = max(1, min(cfg.split_k, ksteps))
    grid_mn = triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn)
    if split > 1 and (grid_mn > _COUNTER_SLOTS or split * m * n >= 2**31):
        split = 1
    k_per_split = triton.cdiv(ksteps, split) * cfg.bkh
    split = triton.cdiv(kh, k_per_split)
    if split > 1:
        ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        cnt = _tile_counters(x.device)
    else:
        ws, cnt = y, y  # unused (SPLIT is a constexpr False)
    _nvfp4_fwd_kernel[(grid_mn, split)](
        x, packed, scale_u8, global_scale.reshape(1).to(torch.float32), bias if bias is not None else y,
        y, ws, cnt,
        m, n, kh, k_per_split,
        x.stride(0), packed.stride(0), scale_u8.stride(0), y.stride(0),
        BM=cfg.bm, BN=cfg.bn, BKH=cfg.bkh, GROUP_M=cfg.group_m,
        SWAP=cfg.swap, SPLIT=split > 1, HAS_BIAS=bias is not None, FAST=fast,
        EPI=FAST_EPILOGUE if fast else PORTABLE_EPILOGUE, IEEE=x.dtype == torch.float32,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return y
