"""Fused inference kernels (Triton): residual-add + RMSNorm (+ AQN noise), rotary embedding in place, SwiGLU.

A 7B decode step in plain torch is ~45 small elementwise kernels per layer (casts, pow, mean, rsqrt,
cat, neg ...), ~1,300 per step at ~2 us each: more time than the NVFP4 weight reads they sit between.
These kernels cut that to 4 per layer. Norm and rotary compute in fp32 and round once, so they agree
with the torch path (used for training, where autograd is needed) to within one bf16 rounding; SwiGLU
rounds where torch does (``silu(g)``, then the product). Used for CUDA tensors outside autograd (rollout,
scoring); the norm also under autograd (training's recompute and backward: ``rmsnorm_backward``,
``norm._RMSNormFn``). ``QERL_FUSED=0`` turns them all off.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from qerl_kernels.decode import k_order
except ImportError:  # triton is Linux-only; the torch paths cover everything without it
    triton = None


def enabled(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Fused kernels run when x is on CUDA and autograd needs nothing from this op (no input, weight
    or residual requires grad, e.g. trained norm weights)."""
    return _on(x) and not _wants_grad(x, *others)


def trainable(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """The autograd form of a fused kernel runs (``norm._RMSNormFn``): x on CUDA, gradients wanted."""
    return _on(x) and _wants_grad(x, *others)


def _on(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and os.environ.get("QERL_FUSED", "1") != "0"


def _wants_grad(*ts: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@_jit
def _rmsnorm_kernel(X, R, W, Z, Y, RO, A, T, D, stride_x, stride_r, stride_y, stride_ro, stride_a, stride_t, stride_d,
                    N, NA, eps, HAS_RES: tl.constexpr, HAS_NOISE: tl.constexpr, BLOCK: tl.constexpr,
                    SHRINK: tl.constexpr = False, RC: tl.constexpr = 4, HAS_DELTA: tl.constexpr = False,
                    KORDER: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:  # the producing GEMM's LoRA term, added (and rounded) as its own output would have been
        x = (x + tl.load(D + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
        x = x.to(tl.float32)
    if HAS_RES:
        x = x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        xr = x.to(RO.dtype.element_ty)  # the residual stream is stored (and normalised) in model dtype
        if c == 0:
            tl.store(RO + row * stride_ro + cols, xr, mask=mask)
        x = xr.to(tl.float32)
    var = tl.sum(x * x, 0) / N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_NOISE:
        w = w + tl.load(Z + cols, mask=mask, other=0.0)
    y = x * tl.rsqrt(var + eps) * w
    if c == 0:
        if KORDER:  # columns where the next GEMM's TMA-fed tile reads them (no permutation pass there)
            tl.store(Y + row * stride_y + k_order(cols), y.to(Y.dtype.element_ty), mask=mask)
        else:
            tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    if SHRINK:
        # LoRA shrink rows [c*RC, c*RC + RC) of A: t = y @ A^T on the rounded y the store above wrote,
        # fp32 sums, rounded once. The whole row at once: one round of loads per program.
        j = c * RC + tl.arange(0, RC)
        jm = j < NA
        a = tl.load(A + j[:, None] * stride_a + cols[None, :], mask=jm[:, None] & mask[None, :], other=0.0)
        yr = y.to(Y.dtype.element_ty).to(tl.float32)
        tl.store(T + row * stride_t + j, tl.sum(a.to(tl.float32) * yr[None, :], 1).to(T.dtype.element_ty), mask=jm)


@_jit
def _rmsnorm_bwd_kernel(S, W, Z, DY, DR, DS, DW, M, N, stride_s, stride_dy, stride_dr, stride_ds, eps,
                        HAS_NOISE: tl.constexpr, HAS_DRES: tl.constexpr, W_GRAD: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Rows [pid*ROWS, pid*ROWS + ROWS) of the gradient of y = s * rsqrt(mean(s^2) + eps) * (w + z): ds,
    plus the gradient reaching the returned residual (DR), in s's dtype; with W_GRAD this program's
    partial sum of dy * s * rsqrt(...) over its rows (fp32, one row of DW)."""
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_NOISE:
        w = w + tl.load(Z + cols, mask=mask, other=0.0)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(ROWS):
        row = tl.program_id(0).to(tl.int64) * ROWS + i
        if row < M:
            x = tl.load(S + row * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
            xh = x * r
            dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            g = dy * w
            ds = r * (g - xh * (tl.sum(g * xh, 0) / N))
            if HAS_DRES:
                ds += tl.load(DR + row * stride_dr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DS + row * stride_ds + cols, ds.to(DS.dtype.element_ty), mask=mask)
            if W_GRAD:
                dw += dy * xh
    if W_GRAD:
        tl.store(DW + tl.program_id(0).to(tl.int64) * N + cols, dw, mask=mask)


BWD_ROWS = 4  # rows per backward program: the weight gradient's partial sums are [rows / 4, n]


def rmsnorm_backward(s: torch.Tensor, weight: torch.Tensor, noise: torch.Tensor | None, eps: float,
                     dy: torch.Tensor, dres: torch.Tensor | None, weight_grad: bool):
    """Gradients of ``rmsnorm`` for its input ``s`` (x + residual as the forward rounded it; it reaches x
    and the residual alike) and, with ``weight_grad``, for the weight (fp32): one pass over the rows.
    ``dres``: the gradient of the residual the forward returned (added into ds), or None."""
    n = s.shape[-1]
    s2, dy2 = s.reshape(-1, n), dy.contiguous().reshape(-1, n)
    m = s2.shape[0]
    ds = torch.empty_like(s2)
    dr2 = dy2 if dres is None else dres.contiguous().reshape(-1, n)
    grid = triton.cdiv(m, BWD_ROWS)
    dw = torch.empty(grid if weight_grad else 1, n, dtype=torch.float32, device=s.device)
    _rmsnorm_bwd_kernel[(grid,)](s2, weight, noise if noise is not None else weight, dy2, dr2, ds, dw, m, n,
                                 s2.stride(0), dy2.stride(0), dr2.stride(0), ds.stride(0), eps,
                                 HAS_NOISE=noise is not None, HAS_DRES=dres is not None, W_GRAD=weight_grad,
                                 ROWS=BWD_ROWS, BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8)
    return ds.view(s.shape), (dw.sum(0) if weight_grad else None)


def shrink_rows_per_program(rows: int, n: int) -> int:
    """Rows of A per program of the norm's shrink: the fastest of 2/4/8 x 4/8 warps in
    ``benchmarks/probe_norm_shrink.py`` on an H100 (hidden 3584, r = 32 and 48; docs/benchmarks.md): 2 up
    to 16 batch rows, 4 above (fewer programs re-reading the normed rows). Wider rows (hidden > 4096)
    keep 2: the A tile is held in registers next to the whole normed row."""
    return 2 if rows <= 16 or n > 4096 else 4


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, noise: torch.Tensor | None, eps: float,
            residual: torch.Tensor | None = None, lora_a: torch.Tensor | None = None, delta: torch.Tensor | None = None,
            korder: bool = False):
    """-> normed (and the new residual x + residual when one is given), both in x's dtype.

    ``delta`` (x's shape and dtype): added to x first and rounded, as if the GEMM that produced x had
    added it (a LoRA term computed beside that GEMM, ``LoRALinear.forward_deferred``).

    ``lora_a`` [r, n]: also return ``normed @ lora_a^T`` [..., r] (a LoRA shrink, for the GEMM that reads
    the normed rows), computed by extra programs of the same launch: each row's programs rebuild the
    normed row and read ``shrink_rows_per_program`` rows of A. Why: at decode batch sizes the separate
    shrink is a cuBLAS split-K GEMM plus its reduce kernel, two launches of a few us for a read of
    ~100 KB; here it rides on the norm's launch. -> (normed, residual or None, shrink).

    ``korder`` (n % 128 == 0): the normed row's columns come out in the MMA's K order
    (``qerl_kernels.decode.k_order``), for a GEMM whose TMA-fed tile reads them so
    (``QLinear.takes_korder_x``); the residual and the shrink stay in natural order."""
    n = x.shape[-1]
    if korder and n % 128:
        raise ValueError(f"korder permutes 128-column steps; the row has {n} columns")
    x = x if x.stride(-1) == 1 else x.contiguous()  # the kernel reads rows of unit column stride
    x2 = x.reshape(-1, n)
    # Outputs made in x's shape (no view of a tensor made here: autograd forbids in-place ops on those)
    y_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = y_out.view(-1, n)
    if residual is not None:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
        r2 = residual.reshape(-1, n)
        ro_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ro = ro_out.view(-1, n)
    else:
        r2 = ro = x2
    d2 = x2 if delta is None else delta.reshape(-1, n)
    if delta is not None and (d2.shape != x2.shape or d2.dtype != x.dtype or d2.stride(-1) != 1):
        raise ValueError(f"delta must match x {tuple(x.shape)} {x.dtype}, got {tuple(delta.shape)} {delta.dtype}")
    chunks, t, rc = 1, x2, 1
    if lora_a is not None:
        if lora_a.shape[-1] != n or lora_a.stride(-1) != 1 or lora_a.dtype != x.dtype:
            raise ValueError(f"lora_a must be a row-major [r, {n}] {x.dtype} matrix, got {tuple(lora_a.shape)} {lora_a.dtype}")
        t = torch.empty(x2.shape[0], lora_a.shape[0], dtype=x.dtype, device=x.device)
        rc = shrink_rows_per_program(x2.shape[0], n)
        chunks = triton.cdiv(lora_a.shape[0], rc)
    _rmsnorm_kernel[(x2.shape[0], chunks)](
        x2, r2, weight, noise if noise is not None else weight, y, ro, lora_a if lora_a is not None else x2, t, d2,
        x2.stride(0), r2.stride(0), y.stride(0), ro.stride(0), n if lora_a is None else lora_a.stride(0), t.stride(0),
        d2.stride(0), n, 0 if lora_a is None else lora_a.shape[0], eps,
        HAS_RES=residual is not None, HAS_NOISE=noise is not None, BLOCK=triton.next_power_of_2(n),
        SHRINK=lora_a is not None, RC=rc, HAS_DELTA=delta is not None, KORDER=korder,
        num_warps=4 if n <= 4096 and lora_a is None else 8,
    )
    if lora_a is not None:
        return y_out, None if residual is None else ro_out, t.view(*x.shape[:-1], lora_a.shape[0])
    return y_out if residual is None else (y_out, ro_out)


@_jit
def _rope_rows(X, OUT, t, slot, stride_t, stride_h, stride_cs, stride_ch, H, cos, sin, HALF: tl.constexpr,
               HP: tl.constexpr, ROTATE: tl.constexpr, IN_PLACE: tl.constexpr, CACHE: tl.constexpr,
               DX=None, stride_dt=0, stride_dh=0, HAS_D: tl.constexpr = False):
    """Token t's H heads of X: rotated (ROTATE) in place (IN_PLACE) and/or written to cache row ``slot``;
    with HAS_D, X + DX (rounded to X's dtype, as the GEMM that produced X would have stored it) first."""
    d = tl.arange(0, HALF)
    h = tl.arange(0, HP)[:, None]
    m = h < H
    base = X + t * stride_t + h * stride_h + d[None, :]
    x1 = tl.load(base, mask=m, other=0.0)
    x2 = tl.load(base + HALF, mask=m, other=0.0)
    if HAS_D:
        dbase = DX + t * stride_dt + h * stride_dh + d[None, :]
        x1 = (x1.to(tl.float32) + tl.load(dbase, mask=m, other=0.0).to(tl.float32)).to(x1.dtype)
        x2 = (x2.to(tl.float32) + tl.load(dbase + HALF, mask=m, other=0.0).to(tl.float32)).to(x2.dtype)
    if ROTATE:
        # Explicit FMAs: what the compiler would contract is its choice, and the q/k/v GEMM's rotary
        # epilogue (qerl_kernels.gemm_gluon._write_rope) must round exactly as this kernel does.
        y1 = tl.fma(x1.to(tl.float32), cos, -(x2.to(tl.float32) * sin)).to(x1.dtype)
        y2 = tl.fma(x2.to(tl.float32), cos, x1.to(tl.float32) * sin).to(x1.dtype)
    else:
        y1, y2 = x1, x2
    if IN_PLACE:
        tl.store(base, y1, mask=m)
        tl.store(base + HALF, y2, mask=m)
    if CACHE:
        c = OUT + slot * stride_cs + h * stride_ch + d[None, :]
        tl.store(c, y1.to(OUT.dtype.element_ty), mask=m)
        tl.store(c + HALF, y2.to(OUT.dtype.element_ty), mask=m)


@_jit
def _rope_kernel(Q, K, V, KC, VC, SLOT, CS, P, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_cs, stride_ch, HQ, HK, HALF: tl.constexpr, HQP: tl.constexpr, HKP: tl.constexpr,
                 CACHE: tl.constexpr, DQ=None, DK=None, DV=None, stride_dt=0, stride_dh=0, HAS_D: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(P + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(CS + pos * 2 * HALF + d)[None, :]
    sin = tl.load(CS + pos * 2 * HALF + HALF + d)[None, :]
    slot = t * 0
    if CACHE:
        slot = tl.load(SLOT + t).to(tl.int64)
    _rope_rows(Q, Q, t, 0, stride_qt, stride_qh, 0, 0, HQ, cos, sin, HALF, HQP, True, True, False,
               DQ, stride_dt, stride_dh, HAS_D)
    _rope_rows(K, KC, t, slot, stride_kt, stride_kh, stride_cs, stride_ch, HK, cos, sin, HALF, HKP, True, True, CACHE,
               DK, stride_dt, stride_dh, HAS_D)
    if CACHE:  # v + its delta goes back in place too: a prefill's attention reads v from there
        _rope_rows(V, VC, t, slot, stride_vt, stride_vh, stride_cs, stride_ch, HK, cos, sin, HALF, HKP, False, HAS_D, True,
                   DV, stride_dt, stride_dh, HAS_D)


def rope_ok(x: torch.Tensor) -> bool:
    """x [..., H, D] can be rotated in place as rows of [T, H, D] (e.g. a slice of a fused qkv output)."""
    if x.stride(-1) != 1:
        return False
    try:
        return x.view(-1, x.shape[-2], x.shape[-1]).data_ptr() == x.data_ptr()
    except RuntimeError:
        return False


def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, cache=None, delta=None):
    """Rotate q [..., Hq, D] and k [..., Hk, D] in place (rotate-half convention); returns (q, k).

    ``cache = (v, k_cache, v_cache, slots)``: also write the rotated k and v [..., Hk, D] of token i
    into row ``slots[i]`` of the paged caches [blocks, block_size, Hk, D] (what two ``index_copy_``
    launches did before, in the same kernel).
    ``delta = (dq, dk, dv)`` (with ``cache`` only; column slices of one [tokens, width] tensor, shaped
    like q, k, v): added to q, k, v first and rounded, v + dv stored back in place too (the q/k/v
    GEMM's LoRA term computed beside it, ``GroupedLoRA.run_deferred``).
    """
    hq, d = q.shape[-2:]
    hk = k.shape[-2]
    if not (rope_ok(q) and rope_ok(k)):
        raise ValueError("rope_ rotates in place: q and k must be viewable as [T, H, D] with unit last stride")
    q2, k2 = q.view(-1, hq, d), k.view(-1, hk, d)
    p = positions.reshape(-1)
    if cache is not None:
        v, kc, vc, slots = cache
        if not rope_ok(v) or kc.shape[-2:] != (hk, d) or vc.shape != kc.shape or not (kc.is_contiguous() and vc.is_contiguous()):
            raise ValueError("rope_ cache write wants v [..., Hk, D] rows and contiguous caches [blocks, block, Hk, D]")
        v2, slots = v.view(-1, hk, d), slots.reshape(-1)
        if slots.numel() != q2.shape[0]:
            raise ValueError(f"{slots.numel()} cache slots for {q2.shape[0]} tokens")
        svt, svh, scs, sch = v2.stride(0), v2.stride(1), hk * d, d
    else:  # CACHE=False: these pointers and strides are never read
        v2 = kc = vc = k2
        slots, svt, svh, scs, sch = p, 0, 0, 0, 0
    dq = dk = dv = q2
    sdt = sdh = 0
    if delta is not None:
        if cache is None:
            raise ValueError("rope_ adds a delta only together with the cache write (v needs it too)")
        dq, dk, dv = (x.reshape(-1, x.shape[-2], d) for x in delta)
        rows = q2.shape[0]  # one token: its row stride is meaningless (views of size-1 dims may report any)
        if dq.shape != q2.shape or dk.shape != k2.shape or dv.shape != k2.shape or dq.stride(2) != 1 or \
                len({(x.stride(0) if rows > 1 else 0, x.stride(1), x.stride(2), x.dtype) for x in (dq, dk, dv)}) != 1:
            raise ValueError("rope_ delta wants dq, dk, dv shaped like q, k, v with one row and head stride")
        sdt, sdh = (dq.stride(0) if rows > 1 else 0), dq.stride(1)
    _rope_kernel[(q2.shape[0],)](q2, k2, v2, kc, vc, slots, cos_sin, p, q2.stride(0), q2.stride(1), k2.stride(0),
                                 k2.stride(1), svt, svh, scs, sch, hq, hk, HALF=d // 2, HQP=triton.next_power_of_2(hq),
                                 HKP=triton.next_power_of_2(hk), CACHE=cache is not None,
                                 DQ=dq, DK=dk, DV=dv, stride_dt=sdt, stride_dh=sdh, HAS_D=delta is not None, num_warps=4)
    return q, k


@_jit
def _silu_mul_kernel(G, U, Y, stride_g, stride_u, stride_y, N, BLOCK: tl.constexpr, DG=None, DU=None, stride_d=0,
                     HAS_D: tl.constexpr = False, KORDER: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0)
    if HAS_D:  # the gate/up GEMM's deferred LoRA terms, rounded in as its output would have been
        g = (g + tl.load(DG + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)).to(u.dtype).to(tl.float32)
        u = (u.to(tl.float32) + tl.load(DU + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)).to(u.dtype)
    s = (g / (1.0 + tl.exp(-g))).to(u.dtype)  # rounded like torch's silu output
    out = cols
    if KORDER:
        out = k_order(cols)
    tl.store(Y + row * stride_y + out, (s.to(tl.float32) * u.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


def silu_mul(g: torch.Tensor, u: torch.Tensor, dg: torch.Tensor | None = None, du: torch.Tensor | None = None,
             korder: bool = False):
    """``silu(g) * u`` in one kernel (torch runs two); g and u may be the halves of one gate/up output.
    ``dg``, ``du`` (the halves of one [tokens, 2 n] tensor): ``silu(g + dg) * (u + du)``, each sum rounded.
    ``korder`` (n % 128 == 0): the output's columns in the MMA's K order (as ``rmsnorm``)."""
    n = g.shape[-1]
    if korder and n % 128:
        raise ValueError(f"korder permutes 128-column steps; the rows have {n} columns")
    if u.shape != g.shape or g.stride(-1) != 1 or u.stride(-1) != 1:
        raise ValueError(f"silu_mul wants matching row-major g and u, got {tuple(g.shape)} and {tuple(u.shape)}")
    g2, u2 = g.reshape(-1, n), u.reshape(-1, n)
    dg2 = du2 = g2
    if dg is not None:
        dg2, du2 = dg.reshape(-1, n), du.reshape(-1, n)
        if dg2.shape != g2.shape or du2.shape != g2.shape or dg2.stride() != du2.stride() or dg2.stride(-1) != 1:
            raise ValueError(f"silu_mul deltas must match g {tuple(g.shape)} with one row stride")
    out = torch.empty(g.shape, dtype=g.dtype, device=g.device)  # in g's shape: no view returned (autograd's
    y = out.view(-1, n)                                            # in-place checks refuse views of outputs)
    block = 1024
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](g2, u2, y, g2.stride(0), u2.stride(0), y.stride(0), n,
                                                           BLOCK=block, DG=dg2, DU=du2, stride_d=dg2.stride(0),
                                                           HAS_D=dg is not None, KORDER=korder, num_warps=4)
    return out


@_jit
def _silu_mul_bwd_kernel(GR, G, U, DG, DU, stride_gr, stride_g, stride_u, stride_dg, stride_du, N, BLOCK: tl.constexpr,
                         NEED_DG: tl.constexpr, NEED_DU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gr = tl.load(GR + row * stride_gr + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    if NEED_DG:  # torch: dg = grad * u, rounded; then silu_backward(dg, g) in fp32, rounded
        u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0)
        t = (gr * u.to(tl.float32)).to(u.dtype).to(tl.float32)
        tl.store(DG + row * stride_dg + cols, (t * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)
    if NEED_DU:  # torch: du = silu(g), rounded, times grad, rounded
        s = (g * sig).to(DU.dtype.element_ty).to(tl.float32)
        tl.store(DU + row * stride_du + cols, (s * gr).to(DU.dtype.element_ty), mask=mask)


def silu_mul_backward(grad: torch.Tensor, g: torch.Tensor, u: torch.Tensor, need_dg: bool = True,
                      need_du: bool = True):
    """Gradients of ``silu(g) * u`` for g and u (None where not needed) in one pass over the rows: reads
    grad, g, u once and writes dg, du, where torch's backward runs four kernels (grad * u, silu_backward,
    silu, the product) over seven reads and four writes. Each step rounds where torch's does."""
    n = g.shape[-1]
    if u.shape != g.shape or grad.shape != g.shape:
        raise ValueError(f"silu_mul_backward wants matching shapes, got {tuple(grad.shape)}, {tuple(g.shape)}, "
                         f"{tuple(u.shape)}")
    gr2, g2, u2 = (t.reshape(-1, n) if t.stride(-1) == 1 else t.contiguous().reshape(-1, n) for t in (grad, g, u))
    dg = torch.empty(g.shape, dtype=g.dtype, device=g.device) if need_dg else None  # in g's shape, as silu_mul
    du = torch.empty(g.shape, dtype=u.dtype, device=g.device) if need_du else None
    dg2 = dg.view(-1, n) if need_dg else g2
    du2 = du.view(-1, n) if need_du else g2
    block = 1024
    _silu_mul_bwd_kernel[(g2.shape[0], triton.cdiv(n, block))](
        gr2, g2, u2, dg2, du2, gr2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0), du2.stride(0), n,
        BLOCK=block, NEED_DG=need_dg, NEED_DU=need_du, num_warps=4)
    return dg, du


@_jit
def _decode_inputs_kernel(BT, SLOT, POS, TABLES, SM, CL, stride_bt, stride_t, NB, BS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(SLOT + b)
    pos = tl.load(POS + b)
    cols = tl.arange(0, BLOCK)
    for c in range(0, NB, BLOCK):
        m = c + cols < NB
        tl.store(TABLES + b * stride_t + c + cols, tl.load(BT + row * stride_bt + c + cols, mask=m), mask=m)
    blk = tl.load(BT + row * stride_bt + pos // BS).to(tl.int64)
    tl.store(SM + b, blk * BS + pos % BS)
    tl.store(CL + b, (pos + 1).to(tl.int32))


def decode_inputs(block_tables: torch.Tensor, slot_idx: torch.Tensor, positions: torch.Tensor, block_size: int):
    """A decode step's attention inputs from the batch's state, in one launch (nine small torch kernels
    otherwise): (its sequences' rows of ``block_tables`` [B, max_blocks] int32, each new token's cache
    slot [B] int64, context lengths [B] int32). ``slot_idx``, ``positions``: [B] int64 on the device."""
    b, nb = slot_idx.shape[0], block_tables.shape[1]
    if not (block_tables.is_contiguous() and slot_idx.dtype == positions.dtype == torch.int64
            and block_tables.dtype == torch.int32):
        raise ValueError("decode_inputs wants contiguous int32 block tables and int64 slot rows and positions")
    tables = torch.empty(b, nb, dtype=torch.int32, device=block_tables.device)
    slots = torch.empty(b, dtype=torch.int64, device=block_tables.device)
    lens = torch.empty(b, dtype=torch.int32, device=block_tables.device)
    if b:
        _decode_inputs_kernel[(b,)](block_tables, slot_idx, positions, tables, slots, lens, block_tables.stride(0),
                                    tables.stride(0), nb, BS=block_size, BLOCK=min(1024, triton.next_power_of_2(nb)),
                                    num_warps=1)
    return tables, slots, lens
