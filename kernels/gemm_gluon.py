"""Small-M forward GEMM in Gluon: each thread loads exactly the codes its wgmma register fragment
decodes, straight from global memory (``FwdConfig.gluon`` tiles, M <= 64 where the table picks them).

Measured (H100, 2026-11-22, docs/benchmarks.md "Seventh pass" and "Eighth pass"): once each lane's
scale groups became adjacent pairs of a blocked row (the ``perm`` order below: two 16-byte code
loads and two 2-byte scale loads per thread and K step, where the first version gathered 8-byte
pieces), the best tile per shape ran 13% faster than the Triton tile table at M = 1-4 (geomean of
the eight Qwen2.5 shapes; 2.34x of cuBLAS bf16 at M = 1) and wins the smaller weights at M = 16-32;
at M = 16-64 it loses on the large weights, where each K step re-reads as many bytes of X from L2
as it reads codes. The sweep puts it in the table where it wins.

Why Gluon (Triton's explicit-layout dialect): plain Triton chooses register layouts itself and
stages loads through shared memory even when every weight has exactly one consumer thread. Here:
- the codes of a K step go from global memory into the registers of the thread whose A fragment
  needs them, prefetched one step ahead;
- the decode produces the A fragment itself: the MMA's K order is permuted (the ``perm`` mapping of
  ``decode.perm_weights``) so each thread owns whole scale groups of the twiddled codes; one e4m3
  conversion per 16 weights and no shuffles (``convert_layout(..., assert_trivial=True)`` checks it
  at compile time);
- X, the small operand, is permuted the same way in registers and stored to a double-buffered
  shared tile for the wgmma's B side.
The MMA is waited for each step: keeping one in flight while the next step decodes measured ~2.5%
faster but is wrong as written (ptxas reuses the in-flight A registers; commit 758360c has it).
Limits: bf16, sm_90, twiddled + blocked codes and scales, K % 128 == 0, N % 16 == 0.
Split-K reduces through the same last-arriver workspace as ``gemm_fwd``.
All three Gluon kernels share this module's epilogue (``_store_tile``), including the pairing
epilogues (``PAIR``: SwiGLU of a stacked gate/up weight, rotary + cache write of a fused q/k/v).

The permutation: logical MMA column k = 16 b + 8 h + 2 c + t (b = 4 g_lo + 2 bb1 + bb0) is physical
element i = 4 bb1 + 2 bb0 + h of word t of scale group g = 2 c + g_lo. Lane c of each quad thus
holds groups 2c and 2c + 1 (adjacent: one 16-byte load) of its two fragment rows; the twiddled group
decode yields bf16x2 registers (element i of word 0, element i of word 1) = logical (t = 0, t = 1):
the fragment's pair.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

try:  # Gluon ships with Triton >= 3.5; its API is experimental, so a missing piece disables the path.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # Triton 3.6 (the H100's) calls the CTA-wide barrier thread_barrier; later ones barrier.
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    HAVE_GLUON = True
except Exception:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

from qerl_kernels.decode import _TWIDDLED_ASM
from qerl_kernels.gemm_fwd import split_k_plan

K_STEP = 128  # K elements per step: 8 scale groups, one 1 KB block per 16 rows


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


GLUON_OFF = "QERL_GLUON=0 turns the Gluon kernels off"


def gluon_unsupported(x: torch.Tensor, n: int, k: int, twiddled: bool, blocked: bool) -> str | None:
    """Why the Gluon kernels cannot run this call (see the module docstring's limits), or None where they can.
    ``GLUON_OFF`` (``QERL_GLUON=0``) only where nothing else stands in the way."""
    if not HAVE_GLUON:
        return "this Triton has no Gluon (triton.experimental.gluon)"
    if not x.is_cuda:
        return f"x is on {x.device.type}, not a CUDA GPU"
    if x.dtype != torch.bfloat16:
        return f"x is {x.dtype}, not torch.bfloat16"
    if not (twiddled and blocked):
        return f"the codes are not in the twiddled + blocked layout (twiddled={twiddled}, blocked={blocked})"
    if k % K_STEP or n % 16:
        return f"K = {k} is not a multiple of {K_STEP} or N = {n} not of 16"
    if x.stride(1) != 1:
        return "x's last dimension is not contiguous"
    if not _is_sm90(x.device.index or 0):
        return "the GPU is not sm_90"
    return GLUON_OFF if os.environ.get("QERL_GLUON", "1") == "0" else None


def gluon_supported(x: torch.Tensor, n: int, k: int, twiddled: bool, blocked: bool) -> bool:
    """Whether the Gluon kernels can run this call (see the module docstring's limits).
    ``QERL_GLUON=0`` turns them off (Gluon is Triton's experimental API; the table's Gluon entries then
    run the heuristic Triton tile), e.g. to tell a Gluon fault from a model one."""
    return gluon_unsupported(x, n, k, twiddled, blocked) is None


if HAVE_GLUON:

    @gluon.constexpr_function
    def _codes_layout(BN, NW):
        """[BN, 8] scale groups of one K step -> the threads whose A fragment they decode into."""
        wg_rows = 16 * NW  # rows covered by the warps once (a warp owns 16 fragment rows)
        reg = [[0, 1], [8, 0]]  # a lane's two adjacent groups (one 16-byte load), then its row + 8
        r = wg_rows
        while r < BN:  # rows past one pass of the warps repeat in registers
            reg.append([r, 0])
            r *= 2
        lane = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]  # lane % 4 = c owns groups 2c, 2c + 1
        warp = [[16 << i, 0] for i in range(NW.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg, lane, warp, [], [BN, 8])

    @gluon.constexpr_function
    def _x_layout(BM, NW):
        """[BM, 128] activations: 16-byte vectors along K, threads over K first then rows."""
        tpw_k = 16  # 16 threads x 8 elements = 128 columns
        return gl.BlockedLayout([1, 8], [32 // tpw_k, tpw_k], [NW, 1], [1, 0])

    @gluon.jit
    def _decode_groups(pw, s):
        """int64 twiddled scale groups [BN, G] + raw e4m3 scales [BN, G] -> bf16 [BN, G, t, h, bb0, bb1]:
        element i = 4 bb1 + 2 bb0 + h of word t of each group (the twiddled decode's register pairs)."""
        sc = (s.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 3.32306998946229e35).to(gl.bfloat16)
        o = gl.inline_asm_elementwise(
            asm=_TWIDDLED_ASM, constraints="=h," * 16 + "l,h", args=[pw, sc],
            dtype=(gl.bfloat16,) * 16, is_pure=True, pack=1)
        # o[2 i + t]: element i of word t. Stack (t, h, bb0, bb1) as new minor dims, i = 4 bb1 + 2 bb0 + h.
        p0 = gl.join(gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3])),
                     gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7])))
        p1 = gl.join(gl.join(gl.join(o[8], o[9]), gl.join(o[10], o[11])),
                     gl.join(gl.join(o[12], o[13]), gl.join(o[14], o[15])))
        return gl.join(p0, p1)

    @gluon.jit
    def _decode_fragment(pw, s, BN: gl.constexpr, DOT: gl.constexpr):
        """int64 groups [BN, 8] + raw e4m3 scales [BN, 8] -> the wgmma A fragment [BN, 128] (permuted K)."""
        w = _decode_groups(pw, s)  # [BN, 8 (g = 2 c + g_lo), t, h, bb0, bb1]
        w = gl.reshape(w, [BN, 4, 2, 2, 2, 2, 2])  # [BN, c, g_lo, t, h, bb0, bb1]
        w = gl.permute(w, [0, 2, 6, 5, 4, 1, 3])  # [BN, g_lo, bb1, bb0, h, c, t]
        w = gl.reshape(w, [BN, 128])
        return gl.convert_layout(w, DOT, assert_trivial=True)

    @gluon.jit
    def _tile_coords(pid_m, pid_n, M, N, BM: gl.constexpr, BN: gl.constexpr, ACC: gl.constexpr):
        """A swapped tile's output columns rn [BN], its (n, m) index grids and the in-bounds mask."""
        rn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
        rm = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, ACC))
        n2 = gl.expand_dims(rn, 1)
        m2 = gl.expand_dims(rm, 0)
        return rn, n2, m2, (n2 < N) & (m2 < M)

    @gluon.jit
    def _write_y(total, B, Y, rb, n2, m2, omask, stride_ym, HAS_BIAS: gl.constexpr):
        """The finished fp32 tile [BN, BM] (+ bias B[rb], rb the columns wrapped into range) -> Y [M, N]
        in bf16."""
        if HAS_BIAS:
            total += gl.expand_dims(gl.load(B + rb).to(gl.float32), 1)
        gl.store(Y + m2 * stride_ym + n2, total.to(gl.bfloat16), mask=omask)

    @gluon.jit
    def _pair_base(pid_n, BN: gl.constexpr, PAIR: gl.constexpr, HD: gl.constexpr):
        """The first weight row of a pairing tile (its other BN / 2 rows lie _pair_distance further).
        SWIGLU: gate rows pid_n BN / 2 ..; ROPE: the heads' first halves (HD rows each), BN / 2 rows per tile."""
        if PAIR % 2 == 1:
            b = pid_n * (BN // 2)
        else:
            per: gl.constexpr = HD // (BN // 2)  # tiles per head
            b = (pid_n // per) * (2 * HD) + (pid_n % per) * (BN // 2)
        return b

    @gluon.jit
    def _pair_distance(N, PAIR: gl.constexpr, HD: gl.constexpr):
        """Rows from a pairing tile's first half to its second: up is N / 2 below gate; a head's second
        half HD below its first."""
        if PAIR % 2 == 1:
            d = N // 2
        else:
            d = N * 0 + HD
        return d

    @gluon.jit
    def _tile_rows(pid_n, N, BN: gl.constexpr, layout: gl.constexpr, PAIR: gl.constexpr, HD: gl.constexpr = 64):
        """The weight rows of a tile's BN accumulator rows: pid_n BN + r, or for a pairing tile
        (PAIR: 1 or 3 SwiGLU, 2 rotary) BN / 2 rows from _pair_base, then the rows _pair_distance further."""
        r = gl.arange(0, BN, layout=layout)
        if PAIR:
            rows = _pair_base(pid_n, BN, PAIR, HD) + r % (BN // 2) + (r // (BN // 2)) * _pair_distance(N, PAIR, HD)
        else:
            rows = pid_n * BN + r
        return rows

    @gluon.constexpr_function
    def _pair_layout(NW):
        """[BN / 2, BM, 2]: a value and its partner in one thread, columns over the lanes."""
        return gl.BlockedLayout([1, 1, 2], [32, 1, 1], [1, NW, 1], [2, 0, 1])

    @gluon.jit
    def _split_pairs(total, BM: gl.constexpr, BN: gl.constexpr, NW: gl.constexpr):
        """A pairing tile's finished fp32 rows -> (first half, second half) [BN / 2, BM], a row and its
        partner in one thread, and that layout."""
        PL: gl.constexpr = _pair_layout(NW)
        OL: gl.constexpr = gl.SliceLayout(2, PL)
        t = gl.convert_layout(gl.permute(gl.reshape(total, [2, BN // 2, BM]), [1, 2, 0]), PL)
        a, b = gl.split(t)
        return gl.convert_layout(a, OL), gl.convert_layout(b, OL)

    @gluon.jit
    def _k_order(c):
        """decode.k_order: natural column c -> its column in the MMA's K order (within 128-column steps)."""
        n = c % 128
        return (c - n + ((n >> 4) & 1) * 64 + ((n >> 2) & 1) * 32 + ((n >> 1) & 1) * 16 + (n & 1) * 8 + (n >> 5) * 2
                + ((n >> 3) & 1))

    @gluon.jit
    def _write_swiglu(total, Y, pid_m, pid_n, M, N, stride_ym, BM: gl.constexpr, BN: gl.constexpr,
                      NW: gl.constexpr, KORDER: gl.constexpr = False):
        """A SwiGLU tile's finished fp32 rows (gate, then up; _tile_rows) -> Y [M, N / 2] = silu(gate) * up,
        rounded where the unfused path rounds: the GEMM's bf16 outputs, silu's, the product's
        (layers/fused.py's silu_mul, the same operations). KORDER: each column lands where the next
        GEMM's TMA-fed tile reads it (_k_order), so that GEMM skips its permutation pass."""
        g, u = _split_pairs(total, BM, BN, NW)
        _write_swiglu_rows(g, u, Y, pid_m, pid_n, M, N, stride_ym, BM, BN // 2, KORDER,
                           gl.SliceLayout(2, _pair_layout(NW)))

    @gluon.jit
    def _write_swiglu_rows(g, u, Y, pid_m, pid_n, M, N, stride_ym, BM: gl.constexpr, R: gl.constexpr,
                           KORDER: gl.constexpr, OL: gl.constexpr):
        """R finished gate rows and their up rows (fp32 [R, BM], layout OL) -> columns pid_n R .. of
        Y [M, N / 2]: _write_swiglu's arithmetic and store, for whichever layout holds the pairs."""
        g = g.to(gl.bfloat16).to(gl.float32)
        u = u.to(gl.bfloat16).to(gl.float32)
        s = (g / (1.0 + gl.exp(-g))).to(gl.bfloat16).to(gl.float32)
        rn = pid_n * R + gl.arange(0, R, layout=gl.SliceLayout(1, OL))
        rm = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, OL))
        n2 = gl.expand_dims(rn, 1)
        m2 = gl.expand_dims(rm, 0)
        col = n2
        if KORDER:
            col = _k_order(n2)
        gl.store(Y + m2 * stride_ym + col, (s * u).to(gl.bfloat16), mask=(n2 < N // 2) & (m2 < M))

    @gluon.jit
    def _write_rope(total, Y, RA, pid_m, pid_n, M, N, stride_ym, BM: gl.constexpr, BN: gl.constexpr,
                    NW: gl.constexpr, HD: gl.constexpr):
        """A rotary tile's finished fp32 rows (BN / 2 dims of one head's first half, then the same dims of
        its second half) of the fused q/k/v output -> Y [M, N] with q and k rotated (rotate-half, cos/sin
        of each token's position) and, for k and v, the token's row of the paged cache: what
        layers/fused.py's rotary + cache write does after the GEMM, rounded where it rounds.
        RA = (positions, cos/sin table [P, 2 HD] fp32, cache slots, k cache, v cache, q width, k width)."""
        P, CS, SLOT, KC, VC, NQ, NK = RA
        OL: gl.constexpr = gl.SliceLayout(2, _pair_layout(NW))
        x1, x2 = _split_pairs(total, BM, BN, NW)
        base = _pair_base(pid_n, BN, 2, HD)
        c1 = base + gl.arange(0, BN // 2, layout=gl.SliceLayout(1, OL))
        rm = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, OL))
        n1 = gl.expand_dims(c1, 1)
        m2 = gl.expand_dims(rm, 0)
        mask = (m2 < M) & (n1 < N)
        x1 = x1.to(gl.bfloat16).to(gl.float32)  # the GEMM's output (bias added: _finish), as the unfused path stores it
        x2 = x2.to(gl.bfloat16).to(gl.float32)
        if base < NQ + NK:  # q or k: rotate (a tile never straddles two heads)
            pos = gl.expand_dims(gl.load(P + rm, mask=rm < M, other=0).to(gl.int64), 0)
            cs = CS + pos * (2 * HD) + gl.expand_dims(c1 % (2 * HD), 1)
            cos = gl.load(cs, mask=mask, other=0.0)
            sin = gl.load(cs + HD, mask=mask, other=0.0)
            y1 = gl.fma(x1, cos, -(x2 * sin)).to(gl.bfloat16)  # explicit FMAs, as layers/fused.py's _rope_rows
            y2 = gl.fma(x2, cos, x1 * sin).to(gl.bfloat16)
        else:
            y1 = x1.to(gl.bfloat16)
            y2 = x2.to(gl.bfloat16)
        out = Y + m2 * stride_ym + n1
        gl.store(out, y1, mask=mask)
        gl.store(out + HD, y2, mask=mask)
        if base >= NQ:  # k or v: the token's cache row [Hk, 2 HD] at its slot
            slot = gl.expand_dims(gl.load(SLOT + rm, mask=rm < M, other=0).to(gl.int64), 0)
            if base < NQ + NK:
                row = KC + slot * NK + (n1 - NQ)
            else:
                row = VC + slot * NK + (n1 - NQ - NK)
            gl.store(row, y1, mask=mask)
            gl.store(row + HD, y2, mask=mask)

    @gluon.jit
    def _finish(total, B, Y, rn, n2, m2, omask, pid_m, pid_n, M, N, stride_ym, BM: gl.constexpr, BN: gl.constexpr,
                HAS_BIAS: gl.constexpr, PAIR: gl.constexpr, NW: gl.constexpr, RA, HD: gl.constexpr):
        if PAIR % 2 == 1:
            _write_swiglu(total, Y, pid_m, pid_n, M, N, stride_ym, BM, BN, NW, PAIR == 3)
        elif PAIR == 2:
            if HAS_BIAS:  # here, in the accumulator's layout as _write_y adds it: the same FMA contraction
                rb = _tile_rows(pid_n, N, BN, gl.SliceLayout(1, total.type.layout), PAIR, HD)
                total += gl.expand_dims(gl.load(B + rb).to(gl.float32), 1)
            _write_rope(total, Y, RA, pid_m, pid_n, M, N, stride_ym, BM, BN, NW, HD)
        else:
            _write_y(total, B, Y, rn % N, n2, m2, omask, stride_ym, HAS_BIAS)

    @gluon.jit
    def _store_tile(acc, G, B, Y, WS, CNT, pid, pid_k, pid_m, pid_n, M, N, stride_ym,
                    BM: gl.constexpr, BN: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr,
                    ACC: gl.constexpr, PAIR: gl.constexpr = 0, NW: gl.constexpr = 4, RA=None, HD: gl.constexpr = 64):
        """The swapped tile acc [BN, BM] -> Y [M, N] (bias, the fast decode's 2^8 and the global scale
        applied); with SPLIT > 1 through the fp32 workspace, the last program to arrive reducing. A pairing
        tile's rows (``PAIR``, _tile_rows) go through _write_swiglu (Y [M, N / 2]) or _write_rope; the
        workspace holds any tile's rows in tile order."""
        out = acc * (256.0 / gl.load(G))  # decode.FAST_EPILOGUE: the fast decode leaves 2^-8 in the weights
        rn, n2, m2, omask = _tile_coords(pid_m, pid_n, M, N, BM, BN, ACC)
        if SPLIT > 1:
            ws_tile = WS + m2 * N + n2
            gl.store(ws_tile + pid_k * M * N, out, mask=omask)
            _cta_barrier()  # all partial stores precede the counter's release
            arrived = gl.atomic_add(CNT + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:
                total = gl.zeros([BN, BM], gl.float32, layout=ACC)
                for sk in gl.static_range(SPLIT):
                    total += gl.load(ws_tile + sk * M * N, mask=omask, other=0.0, cache_modifier=".cg")
                _finish(total, B, Y, rn, n2, m2, omask, pid_m, pid_n, M, N, stride_ym, BM, BN, HAS_BIAS, PAIR, NW,
                        RA, HD)
                gl.atomic_xchg(CNT + pid, 0)
        else:
            _finish(out, B, Y, rn, n2, m2, omask, pid_m, pid_n, M, N, stride_ym, BM, BN, HAS_BIAS, PAIR, NW, RA, HD)

    @gluon.jit
    def _halves_program(n_full, total):
        """(tile, split index, first K unit, unit count) of a halves launch (halves_split): programs below
        ``n_full`` run whole tiles of ``total`` units; each later pair splits one tile's units in two."""
        p = gl.program_id(0)
        pid = p
        pid_k = p * 0
        lo = p * 0
        count = total + p * 0
        if p >= n_full:
            q = p - n_full
            pid = n_full + q // 2
            pid_k = q % 2
            half = (total + 1) // 2
            lo = pid_k * half
            count = gl.minimum(lo + half, total) - lo
        return pid, pid_k, lo, count

    @gluon.jit
    def _program_k_range(n_full, per_split, total, HALVES: gl.constexpr):
        """(tile, split index, first K unit, unit count) of this program: a halves launch's mapping
        (_halves_program) or the split-K grid's (program_id 0 the tile, 1 the split)."""
        if HALVES:
            pid, pid_k, lo, count = _halves_program(n_full, total)
        else:
            pid = gl.program_id(0)
            pid_k = gl.program_id(1)
            lo = pid_k * per_split
            count = gl.minimum(lo + per_split, total) - lo
        return pid, pid_k, lo, count

    @gluon.jit
    def _store_program(acc, G, B, Y, WS, CNT, pid, pid_k, n_full, pid_m, pid_n, M, N, stride_ym,
                       BM: gl.constexpr, BN: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr,
                       ACC: gl.constexpr, HALVES: gl.constexpr, PAIR: gl.constexpr, NW: gl.constexpr, RA,
                       HD: gl.constexpr):
        """_store_tile of this program: of a split-K grid (SPLIT), or of a halves launch (HALVES, whole
        tiles directly, halved ones through the workspace)."""
        if HALVES:
            if pid >= n_full:
                _store_tile(acc, G, B, Y, WS, CNT, pid, pid_k, pid_m, pid_n, M, N, stride_ym, BM, BN, 2, HAS_BIAS,
                            ACC, PAIR, NW, RA, HD)
            else:
                _store_tile(acc, G, B, Y, WS, CNT, pid, pid_k, pid_m, pid_n, M, N, stride_ym, BM, BN, 1, HAS_BIAS,
                            ACC, PAIR, NW, RA, HD)
        else:
            _store_tile(acc, G, B, Y, WS, CNT, pid, pid_k, pid_m, pid_n, M, N, stride_ym, BM, BN, SPLIT, HAS_BIAS,
                        ACC, PAIR, NW, RA, HD)

    @gluon.jit
    def _permute_x(x, BM: gl.constexpr):
        """Activations [BM, 128] in natural K order -> the MMA's permuted K order (see module doc)."""
        x = gl.reshape(x, [BM, 4, 2, 2, 2, 2, 2])  # [BM, c, g_lo, t, bb1, bb0, h]
        x = gl.permute(x, [0, 2, 4, 5, 6, 1, 3])  # [BM, g_lo, bb1, bb0, h, c, t]
        return gl.reshape(x, [BM, 128])

    @gluon.jit
    def _group_offsets(pid_n, N, KG, stride_sn, BN: gl.constexpr, CODES: gl.constexpr, PAIR: gl.constexpr = 0,
                       HD: gl.constexpr = 64):
        """Offsets of a tile's first K step: int64 code groups [BN, 8] in the blocked layout (16 rows x
        8 groups per 1 KB block, a row band's blocks contiguous in K) and their scale bytes."""
        rn_c = _tile_rows(pid_n, N, BN, gl.SliceLayout(1, CODES), PAIR, HD)
        rows = gl.expand_dims(rn_c % N, 1)  # out-of-range rows wrap (results dropped at the store)
        rg = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, CODES)), 0)
        return (rows // 16) * KG * 16 + (rows % 16) * 8 + rg, rows * stride_sn + rg

    @gluon.jit
    def _program_tile(M, N, KG, steps_per_split, stride_sn, BM: gl.constexpr, BN: gl.constexpr,
                      CODES: gl.constexpr, XL: gl.constexpr, PAIR: gl.constexpr = 0, HD: gl.constexpr = 64):
        """This program's place in the (row x column tile, split) grid: (pid, pid_k, pid_m, pid_n), the
        activation row and column index grids and row mask, the code and scale offsets of the tile's first
        K step, its split's first step and step count."""
        pid = gl.program_id(0)
        pid_k = gl.program_id(1)
        grid_n = gl.cdiv(N, BN)
        pid_m = pid // grid_n
        pid_n = pid % grid_n
        rm_x = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, XL))
        xm = gl.expand_dims(rm_x, 1)
        xk = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, XL)), 0)
        code_off, scale_off = _group_offsets(pid_n, N, KG, stride_sn, BN, CODES, PAIR, HD)
        s_lo = pid_k * steps_per_split
        nsteps = gl.minimum(s_lo + steps_per_split, KG // 8) - s_lo
        return pid, pid_k, pid_m, pid_n, xm, xk, xm < M, code_off, scale_off, s_lo, nsteps

    @gluon.jit
    def _load_step(X, PW, S, code_off, scale_off, xm, xk, xrow_ok, step, stride_xm):
        """One K step's codes, scales and activations (global -> registers). Codes: blocked layout,
        16 rows x 8 groups (1 KB) per block, a row band's blocks contiguous in K, so a lane's two
        adjacent groups are one 16-byte load; scales row-major (two 2-byte loads per lane)."""
        pw = gl.load(PW + code_off + step * 128)
        s = gl.load(S + scale_off + step * 8)
        x = gl.load(X + xm * stride_xm + step * 128 + xk, mask=xrow_ok, other=0.0)
        return pw, s, x

    @gluon.jit(do_not_specialize=["M"])
    def _nvfp4_fwd_gluon_kernel(
        X, PW, S, G, B, Y, WS, CNT,
        M, N, KG, steps_per_split,
        stride_xm, stride_sn, stride_ym,
        BM: gl.constexpr, BN: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, NW: gl.constexpr,
        PAIR: gl.constexpr = 0, P=None, CS=None, SLOT=None, KC=None, VC=None, NQ=0, NK=0, HD: gl.constexpr = 64,
    ):
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        CODES: gl.constexpr = _codes_layout(BN, NW)
        XL: gl.constexpr = _x_layout(BM, NW)
        XS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, 128], gl.bfloat16)

        pid, pid_k, pid_m, pid_n, xm, xk, xrow_ok, code_off, scale_off, s_lo, nsteps = _program_tile(
            M, N, KG, steps_per_split, stride_sn, BM, BN, CODES, XL, PAIR, HD)
        xs = gl.allocate_shared_memory(gl.bfloat16, [2, BM, 128], XS)
        acc = gl.zeros([BN, BM], gl.float32, layout=ACC)

        pw, s, x = _load_step(X, PW, S, code_off, scale_off, xm, xk, xrow_ok, s_lo, stride_xm)
        for i in range(nsteps):
            # Next step's loads go out first (clamped on the last step: a harmless re-read).
            nxt = s_lo + gl.minimum(i + 1, nsteps - 1)
            pw_n, s_n, x_n = _load_step(X, PW, S, code_off, scale_off, xm, xk, xrow_ok, nxt, stride_xm)
            buf = xs.index(i % 2)
            buf.store(_permute_x(x, BM))
            fence_async_shared()
            _cta_barrier()  # every warp's X rows are in shared memory before the wgmma reads them
            a = _decode_fragment(pw, s, BN, DOT)
            acc = warpgroup_mma_wait(0, deps=[warpgroup_mma(a, buf.permute((1, 0)), acc, is_async=True)])
            pw, s, x = pw_n, s_n, x_n

        _store_tile(acc, G, B, Y, WS, CNT, pid, pid_k, pid_m, pid_n, M, N, stride_ym, BM, BN, SPLIT, HAS_BIAS, ACC,
                    PAIR, NW, (P, CS, SLOT, KC, VC, NQ, NK), HD)


def halves_split(tiles: int, sms: int) -> int | None:
    """Whole tiles of a launch whose last tiles run as two K halves (``FwdConfig.halves``), or None where
    halving helps nothing. q = ceil(tiles / sms) tiles per SM leave some SMs a q-th tile and others not
    when (q - 1) sms < tiles <= (q - 1/2) sms: the busiest SM then runs up to q / (tiles / sms) past the
    mean. Halving the last tiles - (q - 1) sms tiles gives every SM q - 1 whole tiles and at most one half
    (the block scheduler hands programs out in order, breadth-first over the SMs)."""
    q = -(-tiles // sms)
    return (q - 1) * sms if q > 1 and tiles <= (q - 1) * sms + sms // 2 else None


# Above this tile height the rotary epilogue (a [BM, BN] tile regrouped through shared memory, then
# gathers of cos/sin per element) costs more than the rotary kernel it replaces: 7B q/k/v at M = 128
# (BM 128) 26.1 -> 29.3 us, at M = 256 30.0 -> 34.7 us on an H100; at M = 64 21.8 -> 20.3 us
# (docs/benchmarks.md, rollout, eighteenth pass).
ROPE_MAX_BM = 64


@dataclass
class RopeEpilogue:
    """What the rotary epilogue (``nvfp4_qkv_rope``) needs besides the GEMM: per token its position and
    cache slot, the rotary table, the paged caches, and the fused q/k/v layout (q, k, v widths)."""

    positions: torch.Tensor  # [M] integer positions
    cos_sin: torch.Tensor  # [P, head_dim] fp32: cos of each frequency, then sin
    slots: torch.Tensor  # [M] integer cache slots
    k_cache: torch.Tensor  # [blocks, block, Hk, head_dim], contiguous, the activations' dtype
    v_cache: torch.Tensor
    nq: int
    nk: int
    head_dim: int

    def kernel_args(self) -> dict:
        return dict(P=self.positions, CS=self.cos_sin, SLOT=self.slots, KC=self.k_cache, VC=self.v_cache,
                    NQ=self.nq, NK=self.nk, HD=self.head_dim // 2)

    def supported(self, x: torch.Tensor, n: int, cfg) -> bool:
        """Tiles of BN / 2 rows fit whole in a head's half; the tensors are what the kernel indexes."""
        half, hd = cfg.bn // 2, self.head_dim // 2
        caches = (self.k_cache, self.v_cache)
        return (cfg.bm <= ROPE_MAX_BM and half % 16 == 0 and hd % half == 0 and self.nq % self.head_dim == 0 and self.nk % self.head_dim == 0
                and n == self.nq + 2 * self.nk and self.positions.numel() == x.shape[0] == self.slots.numel()
                and self.cos_sin.dtype == torch.float32 and self.cos_sin.is_contiguous()
                and self.cos_sin.shape[-1] == self.head_dim
                and all(c.is_contiguous() and c.dtype == x.dtype and c.shape[-2:].numel() == self.nk for c in caches)
                and self.positions.is_contiguous() and self.slots.is_contiguous())


def pair_supported(n: int, cfg, bias) -> bool:
    """Whether a tile can run the gate/up pairing (``pair=True`` launches): each tile takes BN / 2 whole
    16-row bands of gate and the same of up, so N / 2 must be a multiple of BN / 2 (and no bias)."""
    half = cfg.bn // 2
    return bias is None and half % 16 == 0 and n % 2 == 0 and (n // 2) % half == 0


@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_halves(y: torch.Tensor, cfg, split: int, units: int, grid_mn: int, n_cols: int, ws, cnt):
    """The grid of a launch, halved (``FwdConfig.halves``, halves_split) where it pays: (n_full or None,
    grid, fp32 workspace, tile counters). Whole tiles (n_full None, the split-K grid, ``ws``/``cnt`` as
    given) for other configs, split-K above 1, under two K units (``units``: the kernel's K steps or
    pairs), a launch whose wave is even, or no counters yet (a first call under graph capture)."""
    if getattr(cfg, "halves", False) and split == 1 and units >= 2 and y.device.type == "cuda":
        n_full = halves_split(grid_mn, num_sms(y.device))
        if n_full is not None:
            split2, _, ws2, cnt2 = split_k_plan(y, 2, units, grid_mn, n_cols=n_cols)
            if split2 == 2:
                return n_full, (n_full + 2 * (grid_mn - n_full), 1), ws2, cnt2
    return None, (grid_mn, split), ws, cnt


def launch_plan(x: torch.Tensor, groups: torch.Tensor, cfg, pair: bool = False):
    """What both Gluon launches need: (M, N, K / 16, the output Y, row x column tiles, split-K count,
    K steps per split, fp32 workspace, tile counters). ``pair``: Y is [M, N / 2] (silu(gate) * up)."""
    m, k = x.shape
    n = groups.shape[0]
    kg = k // 16
    y = torch.empty((m, n // 2 if pair else n), dtype=x.dtype, device=x.device)
    grid_mn = triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn)
    split, per, ws, cnt = split_k_plan(y, cfg.split_k, kg // 8, grid_mn, n_cols=n)
    return m, n, kg, y, grid_mn, split, per, ws, cnt


def pair_mode(pair: bool, rope: RopeEpilogue | None, y_korder: bool = False) -> int:
    """The kernels' PAIR constexpr: 0 plain, 1 SwiGLU, 2 rotary + cache write, 3 SwiGLU written in the
    MMA's K order (``decode.k_order``: the input of a TMA-fed GEMM)."""
    return (3 if y_korder else 1) if pair else 2 if rope is not None else 0


def launch_gluon(x, groups, scale_u8, global_scale, bias, cfg, pair: bool = False,
                 rope: RopeEpilogue | None = None, y_korder: bool = False) -> torch.Tensor:
    """``x [M, K] @ W^T`` (+ bias) by the Gluon kernel: ``groups`` int64 [N, K / 16] twiddled, blocked
    codes, ``scale_u8`` [N, K / 16] e4m3 bytes; ``cfg`` needs bm, bn, split_k, warps. ``pair`` (W stacks
    gate over up, ``pair_supported``): silu(x G^T) * (x U^T) [M, N / 2] instead. ``rope`` (W is a fused
    q/k/v, ``RopeEpilogue.supported``): q and k come out rotated and k, v are written to the caches too.
    ``y_korder`` (with ``pair``): the SwiGLU output in the MMA's K order (``pair_mode``)."""
    m, n, kg, y, grid_mn, split, per, ws, cnt = launch_plan(x, groups, cfg, pair)
    _nvfp4_fwd_gluon_kernel[(grid_mn, split)](
        x, groups, scale_u8, global_scale.reshape(1).to(torch.float32), bias if bias is not None else y,
        y, ws, cnt,
        m, n, kg, per,
        x.stride(0), scale_u8.stride(0), y.stride(0),
        BM=cfg.bm, BN=cfg.bn, SPLIT=split, HAS_BIAS=bias is not None, NW=cfg.warps,
        PAIR=pair_mode(pair, rope, y_korder), num_warps=cfg.warps, **(rope.kernel_args() if rope is not None else {}),
    )
    return y
