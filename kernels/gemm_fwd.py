"""Forward NVFP4 x bf16 GEMM: Y[M, N] = X[M, K] @ dequant(W[N, K])^T (+ bias), one Triton kernel.

Trade-off: one kernel covers every M by its tile config rather than two specialised kernels.
- Small M (decode) is bound by reading W (0.5625 B/weight vs 2 B for bf16, so up to 3.56x over
  an ideal bf16 GEMV). ``SWAP`` computes the tile transposed (acc[BN, BM] = Wdec @ X^T) so the
  decoded weights are the wgmma's 64-row operand and the handful of X rows its narrow N; split-K
  spreads K over programs so N / BLOCK_N tiles still fill all SMs.
- Large M is compute-bound: BLOCK_M multiples of 64 (wgmma), each weight tile decoded once and
  reused across BLOCK_M rows; a grouped (GROUP_M) launch order keeps W tiles in L2.
The on-disk byte layout is used as is (no repack, no second copy of the weights in memory), read
as 32-bit words of 8 codes: the decode yields 8 tiles, tile i holding K elements 8w+i, so X is
loaded contiguously and split into the matching 8 column sets in registers, and each K step is
8 dots of depth BLOCK_K/8. With ``join`` the 8 tiles are re-interleaved into K order instead and
each step is one dot: one more register shuffle, but X feeds the MMA straight from the pipelined
shared-memory buffer and Triton keeps one wgmma in flight rather than waiting on each of 8.
Loading words, not bytes, keeps Triton from unpacking bytes one by one (a byte-tile first version
spent ~15 PTX ops per weight on it and ran at 0.92-1.53x of cuBLAS at M <= 16).
- Above a measured M (``FwdConfig.dequant``) the fused kernel loses to cuBLAS's bf16 GEMM, so the
  weight is decoded once into a transient bf16 buffer (``dequant.py``, memory-bound, ~2.6 B per
  weight) and cuBLAS does the GEMM, at the cost of a transient bf16 copy of one weight.
- ``TMA`` tiles (blocked twiddled codes): the codes arrive as one [BN/16, 1 KB] bulk-copy box per K
  step and X as one [BM, 128] box, through Triton's descriptor loads; same decode and MMA. They win
  most M = 32-256 points (5-12%) and are neutral at M <= 16.
- ``gluon`` table entries run ``gemm_gluon.py`` instead (blocked bf16 weights on sm_90; the
  heuristic Triton tile otherwise): it wins M = 1-4 on almost every shape; ``gluon`` + ``xtma``
  entries run ``gemm_gluon_tma.py`` (X permuted once and streamed by TMA): most of M = 32-256 and
  the large weights at M = 1024; ``gluon`` + ``ws`` entries run ``gemm_gluon_ws.py`` (warp-specialised:
  a producer warpgroup fills a shared-memory ring by TMA, the consumer only decodes and multiplies):
  13 of the 24 points at M = 1-16 (fourteenth pass).
Measured on an H100 (docs/benchmarks.md, 2026-11-22, fourteenth pass): 2.4x of cuBLAS bf16 at M = 1-4
and 2.1x at M = 16 (target 3x; a bare streaming read of the same bytes reaches 3.4x there), 1.22x at
M = 64, 0.96x at M = 128, 0.79x at M = 1024, 0.92x at M = 4096.

Split-K without extra launches: every split writes its fp32 partial to a workspace, then bumps a
per-tile counter (acq_rel atomic); the program that arrives last sums the partials in split order
(deterministic), adds the bias, writes Y and resets the counter for the next call. One launch
matters at decode sizes, where a GEMM takes a few microseconds.

Activations in K order (inference only, ``x_korder``): a TMA-fed tile reads X permuted within each
128-column step, one ``permute_x`` launch per call unless the kernel that produced X wrote it so
(``decode.k_order``); ``takes_korder_x`` tells a producer when to, and ``tile_configs.KORDER_FWD`` holds
the tiles that win only with such input (docs/benchmarks.md, rollout, nineteenth pass: the 64-sequence
decode step 2.8% shorter).

Epilogues (inference only): ``nvfp4_swiglu`` and ``nvfp4_qkv_rope`` run the table's Gluon tile with
its rows paired (``gemm_gluon._tile_rows``), so that SwiGLU, or the rotary embedding and the
paged-cache write, happen in the GEMM's epilogue: one launch fewer per decoder layer each, with the
bits of the two-kernel path (docs/benchmarks.md, rollout, eighteenth pass: 7B decode step at 16
sequences 3.28 -> 3.18 ms).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from qerl_kernels.decode import (
    FAST_EPILOGUE,
    PORTABLE_EPILOGUE,
    decode_or_probe,
    fast_decode_supported,
    from_k_order,
    grouped_tile,
    join8,
    load_word_tile,
    perm_weights,
    perm_x,
    split8,
)
from qerl_kernels.dequant import as_words, nvfp4_dequantize
from qerl_kernels.reference import ACTIVATION_DTYPES, check_linear
from qerl_kernels.tile_configs import (
    DEQUANT,
    FwdConfig,
    fwd_config,
    heuristic_fwd,
    korder_fwd_config,
    layout_safe,
)
from triton.tools.tensor_descriptor import TensorDescriptor

COUNTER_SLOTS = 1 << 16
_counters: dict[tuple[str, int | None], torch.Tensor] = {}


def arrival_counters(device: torch.device, cache: dict | None = None, slots: int = COUNTER_SLOTS) -> torch.Tensor | None:
    """Per-device zeroed int32 counters; each launch that uses them (split-K here, the decode
    attention's split merge in qerl_cli) leaves them zero again. One stream at a time; a kernel that
    runs beside these on another stream (the LoRA shrink) keeps its own ``cache`` of ``slots``.

    None while a CUDA graph is being captured and no counters exist yet: memory allocated during
    capture belongs to the graph's private pool, so it must not be cached for later eager calls
    (the caller then runs without split-K). Engines warm up eagerly before capturing, which
    allocates them.
    """
    cache = _counters if cache is None else cache
    key = (device.type, device.index)
    buf = cache.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = cache[key] = torch.zeros(slots, dtype=torch.int32, device=device)
    return buf


@triton.jit
def _mma(acc, w, x, SWAP: tl.constexpr, IP: tl.constexpr):
    """acc += the tile's product: [BN, BM] = W X^T when SWAP, else [BM, BN] = X W^T."""
    if SWAP:
        out = tl.dot(w, tl.trans(x), acc, input_precision=IP)
    else:
        out = tl.dot(x, tl.trans(w), acc, input_precision=IP)
    return out


@triton.jit(do_not_specialize=["M"])
def _nvfp4_fwd_kernel(
    X, PW, S, G, B, Y, WS, CNT,
    M, N, KW, k_per_split,
    stride_xm, stride_pw, stride_sn, stride_ym,
    BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr,
    EPI: tl.constexpr, IEEE: tl.constexpr, JOIN: tl.constexpr = False, TWIDDLED: tl.constexpr = False,
    PERM: tl.constexpr = False, PROBE_NODECODE: tl.constexpr = False, BLOCKED: tl.constexpr = False,
    EVEN_K: tl.constexpr = False, STAGGER: tl.constexpr = False, TMA: tl.constexpr = False,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    pid_m, pid_n = grouped_tile(pid, grid_m, grid_n, GROUP_M)

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    # Out-of-range weight rows are wrapped onto valid ones (no mask on the hot code loads, so they
    # vectorise); out-of-range X rows are masked instead (a row mask is uniform along K and does
    # not stop vectorisation). Wrapping X rows made every program of an M = 1 call fetch row 0
    # BM times per step, all programs the same two L2 lines: measured 55.5 vs 40.0 us for the
    # same tile on 7B gate_up at M = 1 vs 16. Results of out-of-range rows are dropped by the
    # masked store.
    rm_ld = rm % M
    xrow_ok = rm < M
    rn_ld = rn % N
    rg = tl.arange(0, BKW // 2)
    rx = tl.arange(0, 8 * BKW)
    dtype = Y.dtype.element_ty  # X's (the wrapper allocates Y in it); X may be a TMA descriptor
    IP: tl.constexpr = "ieee" if IEEE else "tf32"

    k_lo = pid_k * k_per_split
    k_hi = min(k_lo + k_per_split, KW)
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    nsteps = tl.cdiv(k_hi - k_lo, BKW)
    # STAGGER: each program starts its K walk at a different step (wrapping), so concurrent
    # programs read different X columns instead of all hitting the same few L2 lines per step.
    # The order is fixed per program: results stay deterministic.
    for step in range(0, nsteps):
        if STAGGER:
            kw = k_lo + ((step + pid % nsteps) % nsteps) * BKW
        else:
            kw = k_lo + step * BKW
        if TMA:
            # PW / X are TMA descriptors (``_tma_descriptors``): one bulk copy per operand and step,
            # zero-filled past M, N and K, so no index or mask arithmetic per element.
            pw = tl.reshape(PW.load([pid_n * (BN // 16), (kw // 16) * 128]), (BN, BKW // 2))
            x = X.load([pid_m * BM, 8 * kw])
        else:
            pw = load_word_tile(PW, rn_ld, kw, stride_pw, KW, BKW, TWIDDLED, FAST, BLOCKED, EVEN_K)
            xk = 8 * kw + rx
            x = tl.load(X + rm_ld[:, None] * stride_xm + xk[None, :], mask=xrow_ok[:, None] & (xk < 8 * KW)[None, :],
                        other=0.0)
        gidx = kw // 2 + rg
        s = tl.load(S + rn_ld[:, None] * stride_sn + gidx[None, :], mask=(gidx < KW // 2)[None, :], other=0)
        # PROBE_NODECODE: benchmark probe only (wrong results, benchmarks/probe_small_m.py).
        e0, e1, e2, e3, e4, e5, e6, e7 = decode_or_probe(pw, s, BN, BKW, FAST, dtype, TWIDDLED, PROBE_NODECODE)
        if PERM:
            # One dot per step over a K order matched to the MMA register fragment (perm_weights):
            # no re-interleave of decoded tiles, X permuted the same way (it is the small operand).
            acc = _mma(acc, perm_weights(e0, e1, e2, e3, e4, e5, e6, e7, BN, BKW), perm_x(x, BM, BKW), SWAP, IP)
        elif JOIN:
            # Re-interleave the 8 decoded tiles into natural K order: one dot per step with X
            # straight from the pipelined shared-memory buffer (no X split, one MMA wait per step).
            acc = _mma(acc, join8(e0, e1, e2, e3, e4, e5, e6, e7, BN, BKW), x, SWAP, IP)
        else:
            x0, x1, x2, x3, x4, x5, x6, x7 = split8(x, BM, BKW)
            acc = _mma(acc, e0, x0, SWAP, IP)
            acc = _mma(acc, e1, x1, SWAP, IP)
            acc = _mma(acc, e2, x2, SWAP, IP)
            acc = _mma(acc, e3, x3, SWAP, IP)
            acc = _mma(acc, e4, x4, SWAP, IP)
            acc = _mma(acc, e5, x5, SWAP, IP)
            acc = _mma(acc, e6, x6, SWAP, IP)
            acc = _mma(acc, e7, x7, SWAP, IP)

    factor = EPI / tl.load(G)
    if SWAP:
        out = tl.trans(acc) * factor
    else:
        out = acc * factor
    omask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT > 1:
        ws_tile = WS + rm[:, None] * N + rn[None, :]
        tl.store(ws_tile + pid_k * M * N, out, mask=omask)
        # All threads' partial stores must precede the release of the counter bump.
        tl.debug_barrier()
        tile = pid_m * grid_n + pid_n
        arrived = tl.atomic_add(CNT + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            total = tl.zeros((BM, BN), dtype=tl.float32)
            # Unrolled (SPLIT is a constexpr), so all partials' loads are in flight at once: a
            # runtime loop waited one L2 round trip per split, most of a small GEMM's time.
            # Summed in split order whichever program arrives last: deterministic.
            for sk in tl.static_range(SPLIT):
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


def split_k_plan(y: torch.Tensor, split_k: int, ksteps: int, grid_mn: int, n_cols: int | None = None):
    """(splits, K steps per split, fp32 workspace, tile counters) of a last-arriver split-K launch
    writing ``y`` [M, N] (``n_cols``: the GEMM's N where it differs from y's, the gate/up pairing's).
    One split (``y`` standing in for the unused buffers) where the counters are not available yet (a
    first call during graph capture) or the tile or workspace index would overflow; the split count is
    recomputed so that no split is empty."""
    m, n = y.shape[0], n_cols or y.shape[1]
    split = max(1, min(split_k, ksteps))
    cnt = arrival_counters(y.device) if split > 1 else None
    if split > 1 and (cnt is None or grid_mn > COUNTER_SLOTS or split * m * n >= 2**31):
        split = 1
    per = triton.cdiv(ksteps, split)
    split = triton.cdiv(ksteps, per)
    if split == 1:
        return 1, per, y, y
    return split, per, torch.empty((split, m, n), dtype=torch.float32, device=y.device), cnt


def _tma_descriptors(x: torch.Tensor, groups: torch.Tensor, cfg: FwdConfig):
    """TMA descriptors (X [M, K], the blocked int64 code groups), in the kernel's argument order, or
    None where TMA cannot read them (alignment, tile shape). Blocked groups of a 16-row block and
    128-element K block are 1 KB contiguous, so the codes are a 2-D array [N / 16, (K / 128) * 128]
    of int64 whose box [BN / 16, 128] is exactly one K step of one tile."""
    n, kg = groups.shape
    if cfg.bkw != 16 or cfg.bn % 16 or n % 16 or kg % 8 or cfg.bm > 256:
        return None
    if x.data_ptr() % 16 or (x.stride(0) * x.element_size()) % 16 or groups.data_ptr() % 16:
        return None
    w2 = groups.view(n // 16, kg * 16)
    wd = TensorDescriptor(w2, list(w2.shape), [kg * 16, 1], [cfg.bn // 16, 128])
    xd = TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [cfg.bm, 8 * cfg.bkw])
    return xd, wd


def _check(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
           bias: torch.Tensor | None = None) -> tuple[int, int, int]:
    if x.ndim != 2:
        raise ValueError(f"want x [M, K], got {tuple(x.shape)}")
    # The tiles read bias[0 .. N) at unit stride in x's dtype: anything else read out of bounds or garbage;
    # fp64 x was read as fp32 bits (relative error 1, no error raised).
    n, k = check_linear(x, packed, scale, bias, dtypes=ACTIVATION_DTYPES)
    return x.shape[0], n, k


def nvfp4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: FwdConfig | None = None,
    fast: bool | None = None,
    twiddled: bool = False,
    blocked: bool = False,
    _probe_nodecode: bool = False,
    x_korder: bool = False,
) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) @ dequant(packed [N, K/2], scale [N, K/16] e4m3, global [1])^T.

    ``config`` overrides the table/heuristic (benchmarks, tests); a Gluon ``config`` where the Gluon kernels
    cannot run (``gemm_gluon.gluon_unsupported``: not bf16 on sm_90 with twiddled + blocked codes) is a
    ValueError, while the table's Gluon entries (and any Gluon tile under ``QERL_GLUON=0``) run the heuristic
    Triton tile instead; ``fast`` forces the decode path
    (default: the PTX decode for bf16 on sm_90, the portable decode otherwise); ``twiddled``: the
    codes are in ``twiddle.py``'s load-time layout, ``blocked`` also in its 1 KB blocks.
    ``x_korder``: x's columns are in the MMA's K order (``decode.k_order``), as a producing kernel wrote
    them for a TMA-fed tile (``takes_korder_x``); any other tile gets them back in natural order first.
    """
    m, n, k = _check(x, packed, scale, bias)
    if m == 0:  # nothing to launch (and the split heuristics divide by the tile count)
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    cfg = config or (korder_fwd_config if x_korder else fwd_config)(m, n, k)
    if x_korder and not (m > 0 and _korder_tile(x, n, k, cfg, twiddled, blocked)):
        x, x_korder = natural_order(x), False  # a tile that reads natural X (the caller did not ask first)
    if fast is None:
        fast = x.dtype == torch.bfloat16 and fast_decode_supported(x.device)
    if cfg.gluon:
        from qerl_kernels.gemm_gluon import GLUON_OFF, gluon_unsupported

        why = gluon_unsupported(x, n, k, twiddled, blocked) or (None if fast else "fast=False (the Gluon kernels decode by PTX only)")
        if why is not None:
            if config is not None and why != GLUON_OFF:  # a caller's tile is run as itself or not at all
                raise ValueError(f"config is a Gluon tile, which cannot run here: {why} (pass a Triton tile, or "
                                 "config=None for the table's, which falls back to a Triton tile)")
            cfg = heuristic_fwd(m, n, k, gluon=False)  # not a layout (or device) the Gluon kernels read
    if twiddled and not layout_safe(cfg):
        cfg = DEQUANT  # a tile family Triton cannot compile on these codes (tile_configs.layout_safe)
    if cfg.dequant:
        # Compute-bound regime: one decode pass to a transient bf16 weight, then cuBLAS.
        w = nvfp4_dequantize(packed, scale, global_scale, dtype=x.dtype, twiddled=twiddled, blocked=blocked)
        return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))
    words = as_words(packed)
    if twiddled and fast:
        words = words.view(torch.int64)  # whole scale groups: see decode.load_word_tile
    scale_u8 = scale.contiguous().view(torch.uint8)
    if cfg.gluon and m > 0:
        return _launch_gluon_tile(x, words, scale_u8, global_scale, bias, cfg, x_korder=x_korder)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    kw = k // 8
    grid_mn = triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn)
    split, steps_per_split, ws, cnt = split_k_plan(y, cfg.split_k, triton.cdiv(kw, cfg.bkw), grid_mn)
    k_per_split = steps_per_split * cfg.bkw
    tma = None
    if cfg.tma and twiddled and blocked and fast:
        tma = _tma_descriptors(x, words, cfg)
    x_arg, w_arg = tma or (x, words)
    _nvfp4_fwd_kernel[(grid_mn, split)](
        x_arg, w_arg, scale_u8, global_scale.reshape(1).to(torch.float32), bias if bias is not None else y,
        y, ws, cnt,
        m, n, kw, k_per_split,
        x.stride(0), words.stride(0), scale_u8.stride(0), y.stride(0),
        BM=cfg.bm, BN=cfg.bn, BKW=cfg.bkw, GROUP_M=cfg.group_m,
        SWAP=cfg.swap, SPLIT=split, HAS_BIAS=bias is not None, FAST=fast,
        EPI=FAST_EPILOGUE if fast else PORTABLE_EPILOGUE, IEEE=x.dtype == torch.float32, JOIN=cfg.join, TWIDDLED=twiddled, PERM=cfg.perm, PROBE_NODECODE=_probe_nodecode, BLOCKED=blocked,
        EVEN_K=kw % cfg.bkw == 0, STAGGER=cfg.stagger, TMA=tma is not None,
        num_warps=cfg.warps, num_stages=cfg.stages, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )
    return y


def nvfp4_swiglu(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    config: FwdConfig | None = None,
    twiddled: bool = False,
    blocked: bool = False,
    x_korder: bool = False,
    y_korder: bool = False,
) -> torch.Tensor | None:
    """SwiGLU in the GEMM's epilogue: ``silu(x @ G^T) * (x @ U^T)`` [M, N / 2] for a weight [N, K] that
    stacks gate G over up U (an MLP's fused gate/up), or None where no Gluon tile can pair the columns
    (the caller then runs ``nvfp4_matmul`` and its own SwiGLU).

    Why: at decode sizes the separate SwiGLU is one more launch per layer (~1.5 us on a 7B model at 16
    rows, ~1.3% of the step) plus a round trip of the [M, N] gate/up output. Each tile here takes BN / 2
    rows of G and the same rows of U (``gemm_gluon._tile_rows``), so a gate value and its up value
    finish in the same program. Same tile as ``nvfp4_matmul`` on the stacked weight (the table's), same
    sums in the same order, rounded where the unfused path rounds: the results are identical, except
    in a launch whose last tiles run as two K halves (``FwdConfig.halves``): there the halved rows are
    other rows than in the unfused launch (whole gate/up pairs here), and a row summed in two halves
    rounds differently in fp32, so up to one bf16 step apart on a few outputs (7B gate/up at M = 16: 27
    of 303,104 on an H100). Either way deterministic.
    Needs what the Gluon kernels need (bf16 on sm_90, twiddled + blocked codes) and N / 2 a multiple of
    BN / 2; stream-K tiles (``cfg.sk``) are not paired. ``x_korder`` as ``nvfp4_matmul``; ``y_korder``:
    write the output in the MMA's K order, for a down projection whose tile ``takes_korder_x``.
    """
    return _pairing_launch(x, packed, scale, global_scale, None, config, twiddled, blocked, pair=True,
                           x_korder=x_korder, y_korder=y_korder)


def nvfp4_qkv_rope(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None,
    rope,
    config: FwdConfig | None = None,
    twiddled: bool = False,
    blocked: bool = False,
    x_korder: bool = False,
) -> torch.Tensor | None:
    """The fused q/k/v GEMM with the rotary embedding and the cache write in its epilogue: returns the
    [M, Nq + 2 Nk] output with q and k rotated, and writes each token's rotated k and its v into the
    paged caches at its slot (``rope``: a ``gemm_gluon.RopeEpilogue``); None where no Gluon tile can
    (the caller runs ``nvfp4_matmul`` and ``layers.fused.rope_``).

    Why: at decode sizes the rotary + cache write is one more launch per layer (~2.6 us on a 7B model
    at 16 rows, ~2% of the step). Each tile takes BN / 2 dims of one head's first half and the same
    dims of its second half (``gemm_gluon._tile_rows``), so both members of every rotated pair finish in
    one program. Bit-identical to the two-kernel path where the launch halves no tiles (as
    ``nvfp4_swiglu``); the rotation's products may round differently where the compilers contract
    them into FMAs differently (tests/test_rope_epilogue_gpu.py measures it). ``x_korder`` as ``nvfp4_matmul``.
    """
    return _pairing_launch(x, packed, scale, global_scale, bias, config, twiddled, blocked, rope=rope,
                           x_korder=x_korder)


def _pairing_launch(x, packed, scale, global_scale, bias, config, twiddled, blocked, pair=False, rope=None,
                    x_korder=False, y_korder=False):
    """A Gluon launch with a pairing epilogue (SwiGLU or rotary), or None where the table's tile for
    this shape cannot run one (a Triton or stream-K tile, a layout or shape it cannot pair)."""
    m, n, k = _check(x, packed, scale)
    if y_korder and (n // 2) % 128:  # K order permutes whole 128-column steps: other widths would be written past Y
        raise ValueError(f"y_korder permutes 128-column steps; the SwiGLU output has {n // 2} columns")
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or (korder_fwd_config if x_korder else fwd_config)(m, n, k)
    if x_korder and not _korder_tile(x, n, k, cfg, twiddled, blocked):
        x, x_korder = natural_order(x), False
    if not (cfg.gluon and m > 0 and not getattr(cfg, "sk", 0) and twiddled and blocked and x.dtype == torch.bfloat16
            and fast_decode_supported(x.device)):
        return None
    from qerl_kernels.gemm_gluon import gluon_supported, pair_supported

    if not gluon_supported(x, n, k, twiddled, blocked):
        return None
    if not (rope.supported(x, n, cfg) if rope is not None else pair_supported(n, cfg, bias)):
        return None
    words = as_words(packed).view(torch.int64)
    scale_u8 = scale.contiguous().view(torch.uint8)
    bias = None if bias is None else bias.to(x.dtype)
    return _launch_gluon_tile(x, words, scale_u8, global_scale, bias, cfg, pair=pair, rope=rope, x_korder=x_korder,
                              y_korder=y_korder)


def takes_korder_x(m: int, n: int, k: int, device: torch.device, twiddled: bool, blocked: bool) -> bool:
    """Whether ``nvfp4_matmul`` of this shape, given X in the MMA's K order (``korder_fwd_config``), runs a
    tile that reads X by TMA: one that otherwise pays a ``permute_x`` launch per GEMM, or the faster tile
    ``tile_configs.KORDER_FWD`` holds for that input. A producer that can write K order should then."""
    if m <= 0 or device.type != "cuda" or not (twiddled and blocked):
        return False
    return _takes_korder_x(m, n, k, device, os.environ.get("QERL_GLUON", "1"))


@functools.cache
def _takes_korder_x(m: int, n: int, k: int, device: torch.device, gluon_env: str) -> bool:
    # Cached: the engine asks once per GEMM of every eager forward (a graph asks only while capturing);
    # the env switch the answer depends on is part of the key. Tests that patch the tile lookup clear it.
    return _korder_tile(torch.empty(0, k, dtype=torch.bfloat16, device=device), n, k, korder_fwd_config(m, n, k),
                        True, True)


def _korder_tile(x, n, k, cfg, twiddled, blocked) -> bool:
    """The config is a TMA-fed Gluon tile that can run on x (bf16 on sm_90, the blocked layout)."""
    from qerl_kernels.gemm_gluon import gluon_supported
    from qerl_kernels.gemm_gluon_tma import HAVE_GLUON_TMA

    return bool(cfg.gluon and cfg.xtma and HAVE_GLUON_TMA and (not cfg.ws or k % 256 == 0)
                and fast_decode_supported(x.device) and gluon_supported(x, n, k, twiddled, blocked))


def natural_order(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with columns in the MMA's K order (``decode.k_order``) -> natural order."""
    return from_k_order(x)


def _launch_gluon_tile(x, words, scale_u8, global_scale, bias, cfg, pair=False, rope=None, x_korder=False,
                       y_korder=False):
    """A ``gluon`` table entry on the kernel it names: the warp-specialised one (``ws``, X by TMA with
    ``xtma``; where it cannot run, K % 256 != 0 or alignment, the same tile per thread), the TMA-fed one
    (``xtma``), else the per-thread one. ``pair``/``rope``: the pairing epilogues
    (``gemm_gluon.launch_gluon``); ``x_korder``, ``y_korder``: X, Y in the MMA's K order."""
    from qerl_kernels.gemm_gluon import launch_gluon
    from qerl_kernels.gemm_gluon_tma import HAVE_GLUON_TMA, launch_gluon_tma

    if cfg.ws:
        from qerl_kernels.gemm_gluon_ws import launch_gluon_ws, ws_supported

        if ws_supported(x, words, scale_u8, cfg):
            if x_korder and not cfg.xtma:
                x, x_korder = natural_order(x), False
            return launch_gluon_ws(x, words, scale_u8, global_scale, bias, cfg, pair=pair, rope=rope, y_korder=y_korder,
                                   x_korder=x_korder)
    elif cfg.xtma and HAVE_GLUON_TMA:
        return launch_gluon_tma(x, words, scale_u8, global_scale, bias, cfg, pair=pair, rope=rope, y_korder=y_korder,
                                x_korder=x_korder)
    if x_korder:  # only TMA-fed tiles read K-ordered X (callers check _korder_tile first)
        x = natural_order(x)
    return launch_gluon(x, words, scale_u8, global_scale, bias, cfg, pair=pair, rope=rope, y_korder=y_korder)
