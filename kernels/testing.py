"""Adversarial NVFP4 weights and kernel-vs-reference checks, shared by tests and benchmarks.

Trade-off: weights made by ``reference.quantize`` from Gaussian data never contain the awkward
cases (``-0`` codes, all-zero blocks, e4m3 subnormal and maximal scales, tiny or huge global
scales), so the checks here draw raw codes and raw scale bytes directly and plant those cases.
The checks run on any device; under ``TRITON_INTERPRET=1`` they exercise the portable decode
on CPU (the only way to test kernel indexing without a GPU), on a GPU the sm_90 fast decode.
"""

from __future__ import annotations

import torch
from qerl_kernels import reference
from qerl_kernels.twiddle import to_kernel_layout


def random_nvfp4(n: int, k: int, seed: int = 0, device="cpu", special: bool = True, global_scale: float | None = None):
    """(packed uint8 [n, k/2], scale e4m3 [n, k/16], global fp32 [1]) with planted edge cases."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    # Mostly moderate scales (the common case), e4m3 bytes 0x30..0x50 ~ [0.5, 8].
    sbytes = torch.randint(0x30, 0x50, (n, k // 16), generator=g, dtype=torch.uint8)
    if special:
        blocks = codes.view(n, k // 16, 16)
        nb = blocks.shape[0] * blocks.shape[1]
        flat = blocks.reshape(nb, 16)
        pick = torch.randperm(nb, generator=g)
        zero_blocks = pick[: max(1, nb // 16)]
        flat[zero_blocks] = torch.where(torch.rand(len(zero_blocks), 16, generator=g) < 0.5, 0, 8).to(torch.uint8)
        negzero = pick[nb // 16 : nb // 16 + max(1, nb // 16)]
        flat[negzero, ::3] = 8  # -0 scattered among live codes
        codes = flat.view(n, k)
        sflat = sbytes.view(-1)
        spick = torch.randperm(sflat.numel(), generator=g)
        q = max(1, sflat.numel() // 20)
        sflat[spick[:q]] = 0x01  # smallest e4m3 subnormal, 2^-9
        sflat[spick[q : 2 * q]] = 0x7E  # 448, the largest finite e4m3
        sflat[spick[2 * q : 3 * q]] = 0x05  # another subnormal (5 * 2^-9)
        sflat[spick[3 * q : 4 * q]] = 0x08  # smallest normal, 2^-6
    packed = reference.pack_codes(codes)
    scale = sbytes.view(torch.float8_e4m3fn)
    gs = torch.tensor([global_scale if global_scale is not None else 300.0], dtype=torch.float32)
    return packed.to(device), scale.to(device), gs.to(device)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().cpu().double(), b.detach().cpu().double()
    if not torch.isfinite(a64).all():
        return float("inf")
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))


def reference_fwd(x, packed, scale, gs, bias=None) -> torch.Tensor:
    """fp64 Y = X W^T + b with the exact dequantized weight (the ground truth for any dtype)."""
    w = reference.dequantize(packed.cpu(), scale.cpu(), gs.cpu(), dtype=torch.float64)
    y = x.cpu().double() @ w.T
    return y if bias is None else y + bias.cpu().double()


def reference_grad_input(dy, packed, scale, gs) -> torch.Tensor:
    w = reference.dequantize(packed.cpu(), scale.cpu(), gs.cpu(), dtype=torch.float64)
    return dy.cpu().double() @ w


# Tolerances by activation dtype: the kernels accumulate in fp32 on exact decoded weights, so the
# error is the inputs' own rounding (fp16 ~5e-4, bf16 ~4e-3 relative) plus accumulation.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}

# Interpreter cases: (name, kind, M, N, K, dtype, config kwargs, bias). Small, because the
# interpreter runs each program in numpy; block K is 32 elements (BKH=16), so K=48/80/144 have a
# partial last K tile, N=24/40/72 are not powers of two, and the split-K cases take the
# counter/workspace path.
INTERP_CASES = [
    ("fwd_m1_swap_split3", "fwd", 1, 40, 528, "float32", dict(bm=16, bn=32, bkw=16, split_k=3, swap=True), True),
    ("fwd_m3_swap", "fwd", 3, 24, 48, "float16", dict(bm=16, bn=16, bkw=16, swap=True), False),
    ("fwd_m17_nt_split2", "fwd", 17, 40, 272, "float16", dict(bm=16, bn=32, bkw=16, split_k=2), True),
    ("fwd_m17_fp32", "fwd", 17, 72, 144, "float32", dict(bm=16, bn=32, bkw=16), False),
    ("fwd_m100_nt", "fwd", 100, 24, 48, "float16", dict(bm=32, bn=16, bkw=16), True),
    ("fwd_m1000_nt", "fwd", 1000, 24, 48, "float32", dict(bm=64, bn=32, bkw=16, group_m=4), False),
    ("fwd_m100_swap_split2", "fwd", 100, 72, 272, "float32", dict(bm=64, bn=64, bkw=16, split_k=2, swap=True), True),
    ("fwd_m3_join_split2", "fwd", 3, 40, 272, "float16", dict(bm=16, bn=16, bkw=16, split_k=2, swap=True, join=True), True),
    ("fwd_m100_join_nt", "fwd", 100, 72, 144, "float32", dict(bm=64, bn=64, bkw=16, join=True), False),
    ("fwd_m1000_dequant", "fwd", 1000, 40, 144, "float32", dict(bm=0, bn=0, bkw=0, dequant=True), True),
    ("deq_fp32", "deq", 0, 40, 272, "float32", None, False),
    ("deq_fp16", "deq", 0, 72, 48, "float16", None, False),
    # Twiddled codes (twiddle.py's load-time layout): the same kernels through the portable decode.
    ("tw_fwd_m3_swap_split2", "fwd", 3, 40, 272, "float16", dict(bm=16, bn=16, bkw=16, split_k=2, swap=True, twiddled=True), True),
    ("tw_fwd_m17_join", "fwd", 17, 72, 144, "float32", dict(bm=16, bn=32, bkw=16, join=True, twiddled=True), False),
    ("tw_fwd_m100_nt", "fwd", 100, 24, 48, "float16", dict(bm=32, bn=16, bkw=16, twiddled=True), True),
    ("tw_deq_fp32", "deq", 0, 40, 272, "float32", dict(twiddled=True), False),
    # PERM: one dot per K step in the MMA fragment's K order (X permuted to match).
    ("tw_perm_m3_swap_split2", "fwd", 3, 40, 272, "float16", dict(bm=16, bn=16, bkw=16, split_k=2, swap=True, perm=True, twiddled=True), True),
    ("tw_perm_m100_nt", "fwd", 100, 72, 144, "float32", dict(bm=32, bn=16, bkw=16, perm=True, twiddled=True), False),
    ("perm_m17_swap_ondisk", "fwd", 17, 24, 528, "float16", dict(bm=16, bn=16, bkw=32, swap=True, perm=True), False),
    # STAGGER: each program starts its K walk at step pid % steps (5 steps of K here, 3 + 2 per split).
    ("stagger_m1_swap_split2", "fwd", 1, 40, 528, "float16", dict(bm=16, bn=16, bkw=16, split_k=2, swap=True, stagger=True), True),
    ("tw_stagger_m17_perm", "fwd", 17, 40, 528, "float32", dict(bm=16, bn=16, bkw=16, swap=True, perm=True, twiddled=True, stagger=True), False),
    # Blocked (1 KB tiles of 16 rows x 128 elements): N % 16 == 0, K % 128 == 0.
    ("bl_fwd_m3_perm_split2", "fwd", 3, 48, 384, "float16", dict(bm=16, bn=16, bkw=16, split_k=2, swap=True, perm=True, twiddled=True, blocked=True), True),
    ("bl_fwd_m17_nt", "fwd", 17, 32, 256, "float32", dict(bm=16, bn=32, bkw=32, twiddled=True, blocked=True), False),
    ("bl_deq_fp32", "deq", 0, 48, 256, "float32", dict(twiddled=True, blocked=True), False),
    ("tw_bwd_m17", "bwd", 17, 72, 80, "float16", dict(twiddled=True), False),
    ("bwd_m1", "bwd", 1, 24, 80, "float16", dict(bm=16, bn=16, bkh=16), False),
    ("bwd_m3", "bwd", 3, 40, 48, "float32", dict(bm=16, bn=16, bkh=16), False),
    ("bwd_m17", "bwd", 17, 72, 80, "float16", dict(bm=16, bn=32, bkh=16), False),
    ("bwd_m100", "bwd", 100, 24, 144, "float32", dict(bm=64, bn=16, bkh=32, group_m=2), False),
    ("bwd_m1000", "bwd", 1000, 40, 48, "float16", dict(bm=128, bn=32, bkh=16), False),
]


def run_case(kind, m, n, k, dtype, cfg, bias, device="cpu", seed=0, fast=None) -> float:
    """Relative error of one kernel call against the fp64 reference."""
    from qerl_kernels.gemm_bwd import nvfp4_matmul_grad_input
    from qerl_kernels.gemm_fwd import nvfp4_matmul
    from qerl_kernels.tile_configs import BwdConfig, FwdConfig

    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    packed, scale, gs = random_nvfp4(n, k, seed=seed, device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    cfg = dict(cfg or {})
    tw = cfg.pop("twiddled", False)  # run the kernel on twiddle.py's layout; references use the on-disk codes
    bl = cfg.pop("blocked", False)  # ... and its 1 KB blocks
    kpacked = to_kernel_layout(packed, bl) if tw else packed
    if kind == "deq":
        from qerl_kernels.dequant import nvfp4_dequantize

        w = nvfp4_dequantize(kpacked, scale, gs, dtype=dt, fast=fast, twiddled=tw, blocked=bl)
        if w.shape != (n, k) or w.dtype != dt:
            return float("inf")
        return rel_err(w, reference.dequantize(packed.cpu(), scale.cpu(), gs.cpu(), dtype=torch.float64))
    if kind == "fwd":
        x = torch.randn(m, k, generator=gen).to(device=device, dtype=dt)
        b = torch.randn(n, generator=gen).to(device=device, dtype=dt) if bias else None
        y = nvfp4_matmul(x, kpacked, scale, gs, bias=b, config=FwdConfig(**cfg) if cfg else None, fast=fast, twiddled=tw,
                         blocked=bl)
        if y.shape != (m, n) or y.dtype != dt:
            return float("inf")
        return rel_err(y, reference_fwd(x, packed, scale, gs, b))
    dy = torch.randn(m, n, generator=gen).to(device=device, dtype=dt)
    dx = nvfp4_matmul_grad_input(dy, kpacked, scale, gs, config=BwdConfig(**cfg) if cfg else None, fast=fast,
                                 twiddled=tw, blocked=bl)
    if dx.shape != (m, k) or dx.dtype != dt:
        return float("inf")
    return rel_err(dx, reference_grad_input(dy, packed, scale, gs))


def grad_check(m, n, k, dtype, device="cpu", seed=0, twiddled=False, blocked=False) -> dict:
    """Autograd through ``nvfp4_linear`` vs autograd through the fp64 reference: rel errs of y, dx, db."""
    from qerl_kernels.ops import NVFP4Weight, nvfp4_linear

    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    packed, scale, gs = random_nvfp4(n, k, seed=seed, device=device)
    w = NVFP4Weight(to_kernel_layout(packed, blocked) if twiddled else packed, scale, gs, twiddled, blocked)
    gen = torch.Generator().manual_seed(seed + 7)
    x0 = torch.randn(2, m, k, generator=gen)
    b0 = torch.randn(n, generator=gen)
    r = torch.randn(2, m, n, generator=gen)
    x = x0.to(device=device, dtype=dt).clone().requires_grad_(True)
    b = b0.to(device=device, dtype=dt).clone().requires_grad_(True)
    y = nvfp4_linear(x, w, b)
    (y.float() * r.to(device)).sum().backward()

    xr = x0.double().clone().requires_grad_(True)
    br = b0.double().clone().requires_grad_(True)
    wr = reference.dequantize(packed.cpu(), scale.cpu(), gs.cpu(), dtype=torch.float64)
    yr = torch.nn.functional.linear(xr, wr, br)
    (yr * r.double()).sum().backward()
    return {"y": rel_err(y, yr), "dx": rel_err(x.grad, xr.grad), "db": rel_err(b.grad, br.grad)}


def gluon_pairing_configs(m: int) -> list:
    """Tiles the pairing-epilogue tests run at M = m: both widths of each Gluon kernel with and without
    split-K, and of the warp-specialised candidates one per (width, MMA mode, X path) (a few seconds of
    compile each), plus ``halved``: the halves launches of the TMA-fed and warp-specialised kernels
    (M <= 16, or X by TMA above 32). Returns (plain tiles, halved tiles)."""
    from dataclasses import replace

    from qerl_kernels.tile_configs import FwdConfig, _gluon_ws_candidates, _gluon_ws_xtma_candidates

    bm = max(8, min(1 << (m - 1).bit_length(), 64))
    per_thread = [FwdConfig(bm, 64, 16, split_k=1, warps=4, swap=True, gluon=True),
                  FwdConfig(bm, 128, 16, split_k=4, warps=8, swap=True, gluon=True)]
    tma = [FwdConfig(max(bm, 16), bn, 16, split_k=sp, warps=w, stages=3, swap=True, gluon=True, xtma=True,
                     inflight=True) for bn, w, sp in ((64, 4, 3), (128, 8, 1))]
    ws = {(c.bn, c.half): c for c in _gluon_ws_candidates(bm) if not c.halves} if bm <= 32 else {}
    if bm >= 32:  # X by TMA: the warp-specialised tiles of M = 17-128
        ws.update({(c.bn, c.half, "xtma"): c for c in _gluon_ws_xtma_candidates(bm) if not c.halves})
    plain = per_thread + tma + [replace(c, split_k=sp) for c in ws.values() for sp in (1, 2)]
    hbm = 64 if m > 32 else 16
    halved = [FwdConfig(hbm, bn, 16, warps=w, stages=3, swap=True, gluon=True, xtma=True, inflight=True, halves=True)
              for bn, w in ((64, 4), (128, 8))]
    if m <= 16:
        halved += [c for c in _gluon_ws_candidates(16) if c.halves]
    elif m > 32:
        halved += [c for c in _gluon_ws_xtma_candidates(64) if c.halves][:1]
    return plain, halved
