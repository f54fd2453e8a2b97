"""Tile configurations for the NVFP4 GEMMs: a measured table for known shapes, a heuristic otherwise.

Trade-off: Triton's autotuner would time every candidate on first use of each shape, which
costs seconds per shape in every process (and is unsafe during CUDA-graph capture). A small
table measured once on an H100 (``benchmarks/bench_kernels.py --sweep`` prints its entries)
plus a shape heuristic gives a config instantly and deterministically; an unknown shape gets the
heuristic, which follows the same rules the sweep picked for the known shapes.

Rules (why the shapes are what they are; all from the 2026-11-22 H100 sweep):
- M <= 32: weight-read-bound. ``swap`` computes Y^T = W X^T so the decoded weight tile is the
  wgmma's 64-row operand (from registers) and the few activation rows are its N (16..32).
  Split-K fills the 132 SMs when N / BLOCK_N tiles alone are too few.
- M = 1..32 on sm_90 with blocked codes: the Gluon kernel (``gluon``) wins most points; its
  warp-specialised form (``gluon`` + ``ws``: codes and scales by TMA into a shared-memory ring, X by a
  producer warpgroup) wins the points listed in docs/benchmarks.md (kernels, fourteenth pass).
- M = 32..256: the TMA-fed Gluon kernel (``gluon`` + ``xtma``, mostly one warpgroup of 64 weight
  rows) wins 21 of the 24 points of M = 64..256 (ninth pass); ``swap`` + ``join`` Triton tiles the
  rest. Where Gluon cannot run (not sm_90, codes not blocked, ``QERL_GLUON=0``) a Gluon entry runs
  the heuristic Triton tile. Its stream-K mode (``sk``: programs per SM sharing all K steps) wins
  only the long-K ``down`` weights at M = 32-128 and two large weights at M = 1024 (eleventh pass).
- M >= 1024 (fwd) / 512 (grad-input): decode once to bf16 and call cuBLAS (``dequant``), except the
  four large weights at M = 1024, where the TMA-fed Gluon tile (BM 256) wins.
- ``duo`` (2026-11-25 sweep): a BN 128 warp-specialised tile with its two consumer warpgroups as two
  partitions; 7B q/k/v and down at M = 129-256. On gate/up, which the engine runs paired (SwiGLU), only
  whole tiles (split-K 1, not halved: those pair in two partitions): both gate/up at M = 65-128 and, with
  X in a ring of its own (``xstages``), 32B gate/up at M = 1024 (docs/benchmarks.md, kernels, twentieth
  pass). Those three gate/up entries, and 7B gate/up at M = 129-256 (BM 128), run as persistent programs
  (``persist``, twenty-first pass).
- ``tstore`` (2026-11-25 sweep, on an H200): persistent tiles that hand each tile's rows to a TMA store.
  Gate/up at M = 65-1024, q/k/v at M = 129-256 (BM 128) and 32B q/k/v at M = 1024, 7B o at M = 1024 (BM 256;
  before, decode once + cuBLAS) (docs/benchmarks.md, kernels, twenty-second pass).
- ``tail`` (2026-11-25 sweep, H100): those persistent tiles with the last, partial wave's tiles split in K
  among the programs. Gate/up at M = 65-256 and M = 1024 (32B gate/up 906 -> 838 us in the sweep), 32B
  down and 32B o at M = 1024 (the latter BM 128; before, decode once + cuBLAS).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

M_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 1024, 4096)
NUM_SMS_DEFAULT = 132


@dataclass(frozen=True)
class FwdConfig:
    bm: int  # rows of X per tile (the MMA's N when swap)
    bn: int  # output features per tile
    bkw: int  # 32-bit words of packed K per step (= 8 * bkw elements; >= 16 for tl.dot)
    split_k: int = 1
    warps: int = 4
    stages: int = 3
    swap: bool = False
    group_m: int = 8
    dequant: bool = False  # decode W to a transient bf16 buffer and let cuBLAS do the GEMM
    join: bool = False  # re-interleave decoded tiles into K order: one dot per step, async wgmma
    perm: bool = False  # one dot per step in the MMA fragment's K order (X permuted to match, no shuffle)
    stagger: bool = False  # programs start their K walk at different steps (spreads X reads over L2)
    tma: bool = False  # codes and X arrive by TMA bulk copies (blocked twiddled codes, bkw 16, sm_90)
    maxnreg: int | None = None  # register cap per thread (ptxas .maxnreg): more programs per SM
    gluon: bool = False  # the Gluon kernel (gemm_gluon.py; bm, bn, split_k, warps): blocked bf16 sm_90 only
    xtma: bool = False  # with gluon: X permuted once and fed by TMA (gemm_gluon_tma.py; stages = X ring)
    inflight: bool = False  # with xtma: one MMA half step in flight while the next decodes
    sk: int = 0  # with xtma: stream-K, this many resident programs per SM share all (tile, K step) pairs
    ws: bool = False  # with gluon: warp-specialised (gemm_gluon_ws.py; stages = ring of K-step pairs, maxnreg)
    pregs: int = 0  # with ws: registers per producer thread (the consumer warpgroup gets 2 x maxnreg - pregs)
    half: int = 0  # with ws: 0 one MMA per K step, 1 half-step MMAs, 2 half steps with one in flight
    halves: bool = False  # with ws or xtma, split_k 1: a wave's last tiles run as two K halves (gemm_gluon.halves_split)
    duo: bool = False  # with ws, BN 128: the two consumer warpgroups as separate partitions (gemm_gluon_ws)
    xstages: int = 0  # with ws, xtma and half 2: X in a ring of this many [BM, 64] half steps of its own
    persist: int = 0  # with duo and xstages, split-K 1: this many persistent programs per SM walk the tiles
    tstore: bool = False  # with persist: each tile's rows leave by a TMA store the consumers do not wait for
    tail: bool = False  # with persist and tstore: the last partial wave's tiles split in K among the programs (plain)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class BwdConfig:
    bm: int  # rows of dY per tile
    bn: int  # reduction (output features of the forward) per step
    bkh: int  # packed bytes of K per tile: the tile writes 2 * bkh columns of dX
    warps: int = 8
    stages: int = 3
    group_m: int = 8
    dequant: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


DEQUANT = FwdConfig(bm=0, bn=0, bkw=0, dequant=True)
BWD_DEQUANT = BwdConfig(bm=0, bn=0, bkh=0, dequant=True)
# Above these M the fused kernels lose to decode-once + cuBLAS (heuristic; the table overrides).
DEQUANT_MIN_M = 256
BWD_DEQUANT_MIN_M = 512


def layout_safe(cfg: FwdConfig) -> bool:
    """Whether a tile compiles on the load-time code layout (twiddle.py: twiddled, blocked or not).

    Measured: tiles where W is the shared-memory operand (no swap) and each warp covers >= 32 of its
    rows (BM 64 / BN 128 / 4 warps, BM 128 / BN 256 / 8 warps) crash Triton's
    ``OptimizeDotOperands`` pass on twiddled codes (3.6 on the H100 with blocked codes, 3.9 on a CPU
    machine with both); every other candidate compiles (tests/test_kernels_compile.py). None is in
    the measured table; the GEMM runs such a tile as decode-once + cuBLAS.
    """
    return cfg.dequant or cfg.gluon or cfg.swap or cfg.bn // cfg.warps < 32


def m_bucket(m: int) -> int:
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


# (m_bucket, N, K) -> FwdConfig, measured on an H100 (see docs/benchmarks.md, "kernels").
FWD_TABLE: dict[tuple[int, int, int], FwdConfig] = {}
# (N, K) -> BwdConfig for the grad-input kernel at M >= 1024.
BWD_TABLE: dict[tuple[int, int], BwdConfig] = {}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def choose_split(m: int, n: int, k: int, cfg: FwdConfig, num_sms: int = NUM_SMS_DEFAULT) -> int:
    """Split-K factor that gives about two waves of programs without starving each of K."""
    if cfg.dequant:
        return 1
    tiles = _cdiv(m, cfg.bm) * _cdiv(n, cfg.bn)
    ksteps = _cdiv(k // 8, cfg.bkw)
    if tiles >= num_sms:
        return 1
    want = _cdiv(2 * num_sms, tiles)
    # Keep >= 3 K steps per program so the software pipeline has something to overlap.
    return max(1, min(want, ksteps // 3, 32))


# N x K from which the warp-specialised tile won the table's points at M <= 16 (7B down, 68M weights;
# 32B qkv, 37M) and below which the per-thread Gluon tile did (7B q/k/v and o, 13-17M; 32B o, 26M,
# split between them).
GLUON_WS_MIN_WEIGHTS = 30_000_000


def gluon_heuristic(m: int, n: int, k: int, num_sms: int = NUM_SMS_DEFAULT) -> FwdConfig | None:
    """A Gluon tile for a shape the table does not hold (M <= 128), following the table's rules. None
    where neither kernel's layout rules fit (the wrapper checks the device and the code layout at run
    time and falls back to ``heuristic_fwd(gluon=False)``)."""
    if m > 128 or k % 128 or n % 16:
        return None
    if m > 16:
        return _ws_xtma_heuristic(m, n, k, num_sms) if k % 256 == 0 else None
    bm = 8 if m <= 8 else 16
    if n * k >= GLUON_WS_MIN_WEIGHTS and k % 256 == 0:
        cfg = FwdConfig(bm, 64, 16, warps=4, stages=2, swap=True, gluon=True, ws=True, maxnreg=48,
                        pregs=32 if m <= 8 else 40, half=0 if m <= 8 else 2)
    else:
        cfg = FwdConfig(bm, 64, 16, warps=4, swap=True, gluon=True)
    tiles = _cdiv(n, 64) * _cdiv(m, bm)
    split = 1 if tiles >= 2 * num_sms else max(1, min(_cdiv(4 * num_sms, tiles), k // 128 // 3, 32))
    return FwdConfig(**{**cfg.as_dict(), "split_k": split})


# N x K from which two consumer warpgroups sharing one X ring (BN 128) won the table's points at M = 64
# (7B and 32B gate_up, 136M and 283M weights; every smaller weight ran BN 64).
WS_XTMA_WIDE_MIN_WEIGHTS = 100_000_000


def _ws_xtma_heuristic(m: int, n: int, k: int, num_sms: int) -> FwdConfig:
    """M = 17-128 (``_gluon_ws_xtma_candidates``' tiles, the table's picks at M = 32-128): BM 32 or 64 (two
    row tiles at M > 64), BN 128 on the largest weights, else BN 64 at the cap most points took. Split-K
    only up to one program per SM (two where K is long at BN 64): the sweep put q/k/v and o at M = 64 on
    one program per SM, 7B down on two; split-K 1 grids halve a wave's last tiles."""
    bm = 32 if m <= 32 else 64
    if n * k >= WS_XTMA_WIDE_MIN_WEIGHTS and bm == 64:
        cfg = FwdConfig(bm, 128, 16, warps=8, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=80,
                        pregs=32, half=1)
    else:
        r, p = (96, 32) if bm == 32 else (112, 32)
        cfg = FwdConfig(bm, 64, 16, warps=4, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=r,
                        pregs=p, half=2)
    tiles = _cdiv(n, cfg.bn) * _cdiv(m, bm)
    per_sm = 2 if k >= 12288 and cfg.bn == 64 else 1
    split = max(1, min(per_sm * num_sms // tiles, k // 256 // 2))
    return replace(cfg, split_k=split, halves=split == 1)


def heuristic_fwd(m: int, n: int, k: int, num_sms: int = NUM_SMS_DEFAULT, gluon: bool = True) -> FwdConfig:
    """The config for a shape the table does not hold; ``gluon=False``: a plain Triton tile (what runs
    where the Gluon kernels cannot)."""
    if m >= DEQUANT_MIN_M:
        return DEQUANT
    g = gluon_heuristic(m, n, k, num_sms) if gluon else None
    if g is not None:
        return g
    if m <= 16:
        cfg = FwdConfig(bm=16, bn=128, bkw=16, warps=4, stages=3, swap=True)
    elif m <= 32:
        cfg = FwdConfig(bm=32, bn=128, bkw=16, warps=4, stages=4, swap=True)
    elif m <= 64:
        cfg = FwdConfig(bm=64, bn=128, bkw=16, warps=8, stages=3, swap=True, join=True)
    else:
        cfg = FwdConfig(bm=128, bn=128, bkw=16, warps=8, stages=3, swap=True, join=True)
    split = choose_split(m, n, k, cfg, num_sms)
    return FwdConfig(**{**cfg.as_dict(), "split_k": split})


def fwd_config(m: int, n: int, k: int, num_sms: int = NUM_SMS_DEFAULT) -> FwdConfig:
    hit = FWD_TABLE.get((m_bucket(m), n, k))
    return hit if hit is not None else heuristic_fwd(m, n, k, num_sms)


# Tiles for activations that arrive in the MMA's K order (written so by the kernel that produced them:
# the engine's norm, SwiGLU and attention, decode.k_order), where they beat the table's tile, which is
# measured on natural-order X. The warp-specialised kernel then takes X by TMA, so its producer
# warpgroup holds no X registers and the consumer gets more. H100, `benchmarks/probe_ws.py --models 7B
# --layers down,gate_up --ms 16 --bns 64 --warps 4 --stages 2 --rp 40:24,48:24,48:32 --half 1,2 --xtma 0,1
# --halves 0,1` (docs/benchmarks.md, kernels, sixteenth pass): 7B down at M = 16 22.6 -> 21.3 us; no
# other shape gained past run-to-run spread (7B gate_up 0.98x, 7B o 0.98x, 32B down 0.96x).
KORDER_FWD = {
    (16, 3584, 18944): FwdConfig(bm=16, bn=64, bkw=16, split_k=8, warps=4, stages=2, swap=True, maxnreg=48,
                                 gluon=True, xtma=True, ws=True, pregs=32, half=1),
}


def korder_fwd_config(m: int, n: int, k: int, num_sms: int = NUM_SMS_DEFAULT) -> FwdConfig:
    """The tile for X already in the MMA's K order: ``KORDER_FWD``'s, else the table's (``fwd_config``)."""
    hit = KORDER_FWD.get((m_bucket(m), n, k))
    return hit if hit is not None else fwd_config(m, n, k, num_sms)


def bwd_config(m: int, n: int, k: int) -> BwdConfig:
    hit = BWD_TABLE.get((n, k)) if m >= 1024 else None
    if hit is not None:
        return hit
    if m >= BWD_DEQUANT_MIN_M:
        return BWD_DEQUANT
    if m <= 64:
        return BwdConfig(bm=64, bn=64, bkh=32, warps=4, stages=3)
    return BwdConfig(bm=128, bn=64, bkh=64, warps=8, stages=3)


def fwd_candidates(m: int) -> list[FwdConfig]:
    """Configs the sweep times for one M bucket (split_k filled in per shape by ``choose_split``).

    Pruned to the families that won at least one point of the first 2026-11-22 H100 sweep (mma.sync
    variants, num_warps < 4 or wgmma disabled, and 1-2 warp programs never did and were removed),
    plus the ``perm`` tiles (one dot per step in the fragment's K order) added after it. Candidates added
    in later sweeps that hold no entry in the final table were dropped too (5-6 stage small-M tiles, swap-AB tiles at
    M = 1024, staggered tiles above M = 16; docs/benchmarks.md, fourth pass).
    """
    if m <= 16:
        return [
            FwdConfig(16, 128, 16, warps=4, stages=3, swap=True, perm=True),
            FwdConfig(16, 128, 16, warps=4, stages=4, swap=True, perm=True),
            FwdConfig(16, 256, 16, warps=8, stages=3, swap=True, perm=True),
            FwdConfig(16, 64, 16, warps=4, stages=4, swap=True, perm=True),
            FwdConfig(16, 128, 32, warps=4, stages=3, swap=True, perm=True),
            FwdConfig(16, 128, 16, warps=4, stages=4, swap=True),
            FwdConfig(16, 128, 16, warps=4, stages=3, swap=True),
            FwdConfig(16, 64, 16, warps=4, stages=2, swap=True),
            FwdConfig(16, 256, 16, warps=8, stages=3, swap=True),
            FwdConfig(16, 128, 16, warps=4, stages=4, swap=True, join=True),
            FwdConfig(16, 64, 16, warps=4, stages=4, swap=True, join=True),
            # Staggered K walks: concurrent programs read different X columns (the same few L2
            # lines per step otherwise).
            FwdConfig(16, 128, 16, warps=4, stages=3, swap=True, perm=True, stagger=True),
            FwdConfig(16, 64, 16, warps=4, stages=4, swap=True, perm=True, stagger=True),
            # TMA-fed (FwdConfig.tma): within +-5% of the pointer loads on most small-M points.
            FwdConfig(16, 128, 16, warps=4, stages=3, swap=True, perm=True, tma=True),
            FwdConfig(16, 128, 16, warps=4, stages=4, swap=True, perm=True, tma=True),
            FwdConfig(16, 256, 16, warps=8, stages=3, swap=True, perm=True, tma=True),
            FwdConfig(16, 64, 16, warps=4, stages=4, swap=True, perm=True, tma=True),
            FwdConfig(16, 128, 16, warps=4, stages=3, swap=True, perm=True, stagger=True, tma=True),
            *_gluon_candidates(16),
        ] + (_gluon_candidates(8) if m <= 8 else _gluon_tma_candidates(16)) + _gluon_ws_candidates(8 if m <= 8 else 16)
    if m <= 64:
        bm = 32 if m <= 32 else 64
        return [
            FwdConfig(bm, 128, 16, warps=4, stages=4, swap=True, perm=True),
            FwdConfig(bm, 64, 16, warps=4, stages=4, swap=True, perm=True),
            FwdConfig(bm, 64, 16, warps=4, stages=4, perm=True),
            FwdConfig(bm, 128, 16, warps=4, stages=4, swap=True),
            FwdConfig(bm, 128, 32, warps=4, stages=3, swap=True),
            FwdConfig(bm, 128, 16, warps=4, stages=4, swap=True, join=True),
            FwdConfig(bm, 64, 32, warps=4, stages=3, swap=True, join=True),
            FwdConfig(bm, 64, 16, warps=4, stages=4, join=True),
            # swap + join keeps one wgmma in flight (pendings = 1) with W from registers; two
            # warpgroups per program alternate decode and MMA.
            FwdConfig(bm, 128, 16, warps=8, stages=3, swap=True, join=True),
            # The same tiles fed by TMA bulk copies (FwdConfig.tma), deeper rings.
            FwdConfig(bm, 128, 16, warps=8, stages=3, swap=True, join=True, tma=True),
            FwdConfig(bm, 128, 16, warps=8, stages=4, swap=True, join=True, tma=True),
            FwdConfig(bm, 128, 16, warps=8, stages=6, swap=True, join=True, tma=True),
            FwdConfig(bm, 128, 16, warps=4, stages=4, swap=True, perm=True, tma=True),
            *_gluon_candidates(bm),
            *_gluon_tma_candidates(bm),
            *(_gluon_ws_candidates(bm) if bm == 32 else []),
            *_gluon_ws_xtma_candidates(bm),
        ]
    if m <= 256:
        return [
            FwdConfig(128, 128, 16, warps=8, stages=3, perm=True),
            FwdConfig(64, 128, 16, warps=4, stages=4, perm=True),
            FwdConfig(128, 128, 16, warps=8, stages=3),
            FwdConfig(128, 128, 16, warps=8, stages=3, join=True),
            FwdConfig(64, 128, 16, warps=4, stages=4, join=True),
            FwdConfig(128, 64, 16, warps=4, stages=4, swap=True, join=True),
            FwdConfig(128, 128, 8, warps=8, stages=4, swap=True, join=True),
            FwdConfig(128, 128, 16, warps=8, stages=3, swap=True, join=True),
            FwdConfig(128, 256, 8, warps=8, stages=3, swap=True, join=True),
            FwdConfig(128, 128, 16, warps=8, stages=3, swap=True, join=True, tma=True),
            FwdConfig(128, 128, 16, warps=8, stages=4, swap=True, join=True, tma=True),
            FwdConfig(64, 128, 16, warps=8, stages=4, swap=True, join=True, tma=True),
            DEQUANT,
            *_gluon_tma_candidates(128),
        ] + (_gluon_ws_xtma_candidates(64) if m <= 128 else []) + _gluon_ws_xtma_candidates(128) + ([
            FwdConfig(256, 128, 8, warps=8, stages=3, swap=True, join=True),
            FwdConfig(256, 64, 8, warps=4, stages=3, swap=True, join=True),
            *_gluon_tma_candidates(256),
        ] if m > 128 else [])
    return [
        DEQUANT,
        FwdConfig(128, 128, 16, warps=8, stages=3, join=True),
        FwdConfig(128, 256, 16, warps=8, stages=3, join=True),
        *_gluon_tma_candidates(256),
        # Warp-specialised, two consumer partitions, X in a ring of three half steps (four would not leave
        # room for a SwiGLU launch's exchange of rows): 32B gate/up at M = 1024 with SwiGLU 939 -> 908 us
        # (benchmarks/probe_ws.py --swiglu, H100 2026-11-25, docs/benchmarks.md, kernels, twentieth pass).
        FwdConfig(256, 128, 16, warps=8, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=168, pregs=40,
                  half=2, duo=True, xstages=3),
        # The same, persistent: 32B gate/up with SwiGLU 920.8 -> 894.0 us in one probe run (twenty-first pass).
        FwdConfig(256, 128, 16, warps=8, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=168, pregs=40,
                  half=2, duo=True, xstages=3, persist=1),
        # Both storing by TMA (twenty-second pass): at BM 256 7B gate/up 414.6 -> 388.6 us, 7B o 45.1 -> 40.4; at
        # BM 128 32B down 546.9 -> 521.5 (benchmarks/probe_ws.py --tstore 0,1, from K-order X, H200 2026-11-25).
        FwdConfig(256, 128, 16, warps=8, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=168, pregs=40,
                  half=2, duo=True, xstages=3, persist=1, tstore=True),
        FwdConfig(128, 128, 16, warps=8, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=168, pregs=40,
                  half=2, duo=True, xstages=6, persist=1, tstore=True),
        # Both with the last wave's tiles split in K (``tail``): BM 256 leaves a short second wave on 7B q/k/v
        # (144 tiles on 132 SMs), 32B o and down (160). H100 sweep (twenty-second pass): 32B down 457.1 -> 445.2
        # us, 32B o (BM 128) 98.4 -> 94.2, 32B gate/up 906.4 -> 837.5; 7B q/k/v lost (77.8 against 60.7).
        FwdConfig(256, 128, 16, warps=8, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=168, pregs=40,
                  half=2, duo=True, xstages=3, persist=1, tstore=True, tail=True),
        FwdConfig(128, 128, 16, warps=8, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=168, pregs=40,
                  half=2, duo=True, xstages=6, persist=1, tstore=True, tail=True),
        # One program per tile with a wave's last tiles halved (``halves``): where BM 256 tiles leave a short
        # second wave (7B q/k/v 144 tiles, 32B o and down 160, on 132 SMs).
        FwdConfig(256, 128, 16, warps=8, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=168, pregs=40,
                  half=2, duo=True, xstages=3, halves=True),
        FwdConfig(128, 128, 16, warps=8, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=168, pregs=40,
                  half=2, duo=True, xstages=6, halves=True),
    ]


def _gluon_candidates(bm: int) -> list[FwdConfig]:
    """The Gluon kernel's tiles (gemm_gluon.py): 64 or 128 weight rows per warpgroup, one or two
    warpgroups (wider tiles re-read X from L2 less often: at M = 16-64 X costs as much traffic as the
    codes at BN 64); bkw 16 (one 128-element K step) and swap describe what it computes, for the split
    heuristic."""
    return [FwdConfig(bm, bn, 16, warps=w, swap=True, gluon=True) for bn, w in ((64, 4), (128, 4), (128, 8), (256, 8))]


def _gluon_ws_candidates(bm: int) -> list[FwdConfig]:
    """The warp-specialised Gluon kernel's tiles (gemm_gluon_ws.py): consumer warpgroups of 64 weight
    rows, a ring of two K-step pairs, and the register splits that ran fastest in the probes
    (benchmarks/probe_ws.py, H100 2026-11-22).

    BN 64 (one consumer): launch cap 48 (5 programs per SM) or 40 (6), producer 24-40 registers, full or
    half-step MMAs; at BM 32 the producer's X rows need cap 56. BN 128 with 8 warps (two consumers
    sharing one producer: cap 40 still gives each consumer 48 registers at 4 programs per SM) won 7B
    gate_up at M = 32 (51.8 -> 46.1 us) and 32B gate_up at M = 1 (69.9 -> 67.3 us), lost elsewhere.
    Some splits make ptxas spill or serialise the wgmmas and still win a shape, so the sweep, not the
    SASS, decides."""
    if bm <= 16:
        narrow = ((48, 32, 0), (48, 32, 2), (48, 40, 1), (48, 40, 2), (40, 40, 0), (40, 24, 2))
        wide = ((48, 32, 2), (40, 24, 2), (40, 32, 0))
    else:
        narrow, wide = ((56, 48, 2),), ((48, 40, 0),)
    tiles = [FwdConfig(bm, bn, 16, warps=bn // 16, stages=2, swap=True, gluon=True, ws=True, maxnreg=r, pregs=p,
                       half=h)
             for bn, regs in ((64, narrow), (128, wide)) for r, p, h in regs]
    # A wave's last tiles halved (gemm_gluon.halves_split), on the splits that won split-K 1 points:
    # 7B gate_up at M = 16 36.8 -> 34.5 us, 32B gate_up (BN 128) at M = 1 66.4 -> 64.5 us in the probe.
    halved = {(64, 48, 40, 2), (64, 48, 32, 2), (64, 48, 40, 1), (128, 40, 24, 2)} if bm <= 16 else set()
    return tiles + [replace(c, halves=True) for c in tiles if (c.bn, c.maxnreg, c.pregs, c.half) in halved]


def _gluon_ws_xtma_candidates(bm: int) -> list[FwdConfig]:
    """The warp-specialised kernel with X by TMA (``xtma``: four [BM, 64] boxes per ring stage, so the
    producer holds no X registers and BM 32-128 fit) for M = 17-256. A natural-order X pays a
    ``permute_x`` launch first, which the sweep times with the tile; the engine's producers write K
    order and skip it. Two ring stages (BM 64: 82 KB of shared memory, two programs per SM), plus deeper
    rings below, and the register splits that won in the probe (``benchmarks/probe_ws.py --xtma 1``, H100
    2026-11-23, docs/benchmarks.md, kernels, seventeenth pass): caps 64-128 (by BM) with half steps in
    flight at BN 64, cap 80 with plain half steps for two consumers at BN 128 (won 32B gate_up at M = 64).
    At BM 128 also two consumers at caps 96 and 128 with half steps in flight: in the M = 256 probe
    (``--xtma 1 --bm 128``, H100 2026-11-23, docs/benchmarks.md, kernels, eighteenth pass) they ran 7B
    down 87.2 -> 71.4 us and 7B gate_up 149.5 -> 137.5 us from K-order X; BN 64 ran 7B o 23.7 -> 17.4."""
    by_bm = {32: ((64, 24, 2), (96, 32, 2)), 64: ((96, 32, 2), (112, 32, 2), (128, 48, 2))}
    regs = by_bm.get(bm, ((128, 32, 2), (128, 48, 2)))
    tiles = [FwdConfig(bm, 64, 16, warps=4, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=r, pregs=p,
                       half=h) for r, p, h in regs]
    # Deeper rings where a program runs alone on its SM anyway (few tiles) or stages are small (BM 32):
    # 5-8% on the small weights at M = 32 in the probe, up to 0.6 us at M = 64-128.
    deep = {32: ((3, 96, 32), (4, 96, 32)), 64: ((4, 128, 48),)}.get(bm, ())
    tiles += [replace(tiles[0], stages=st, maxnreg=r, pregs=p) for st, r, p in deep]
    if bm == 64:
        tiles.append(FwdConfig(bm, 128, 16, warps=8, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=80,
                               pregs=32, half=1))
    if bm == 128:  # two consumers sharing 128 X rows: 4 of the 8 M = 256 probe points (eighteenth pass)
        tiles += [FwdConfig(bm, 128, 16, warps=8, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=r,
                            pregs=p, half=2) for r, p in ((96, 24), (128, 32))]
    # The BN 128 tiles again with their two consumers in separate partitions (``duo``): 2-13% faster than
    # the same tile in one partition at M = 128-1024 (benchmarks/probe_ws.py --duo 0,1, H100 2026-11-25,
    # docs/benchmarks.md, kernels, nineteenth pass); with 168 registers at BM 128 too. A duo tile pairs
    # SwiGLU rows only as a whole tile (gemm_gluon_ws.duo_runs), so on the gate/up shapes, which the engine
    # always pairs, the sweep times only those.
    wide = [c for c in tiles if c.bn == 128] + ([replace(tiles[-1], maxnreg=168, pregs=40)] if bm == 128 else [])
    tiles += [replace(c, duo=True) for c in wide]
    # At BM 128 also with X in a ring of six half steps of its own (``xstages``: MMAs stay in flight past a
    # codes stage): 32B gate/up at M = 128 as the engine runs it (SwiGLU, K-order X) 145.4 -> 137.8 us
    # (benchmarks/probe_ws.py --swiglu, H100 2026-11-25, docs/benchmarks.md, kernels, twentieth pass).
    if bm == 128:
        tiles += [replace(c, xstages=6) for c in tiles if c.duo and c.half == 2]
    # Those again as persistent programs (``persist``: one per SM walks the tiles, its producer filling the
    # next tile's stages while the consumers store the last): gate/up as the engine runs it 2.9-3.7% faster at
    # M = 128 (benchmarks/probe_ws.py --persist 0,1, H100 2026-11-25, docs/benchmarks.md, kernels,
    # twenty-first pass).
    tiles += [replace(c, persist=1) for c in tiles if c.duo and c.xstages]
    # And those storing by TMA (``tstore``: the consumers hand each tile to a TMA store and go on): 1-11% faster
    # on every plain point at M = 128-1024 (benchmarks/probe_ws.py --tstore 0,1, H200 2026-11-25,
    # docs/benchmarks.md, kernels, twenty-second pass).
    tiles += [replace(c, tstore=True) for c in tiles if c.persist]
    # And with the last, partial wave's tiles split in K among the programs (``tail``), for shapes whose
    # tiles leave a short last wave: gate/up at M = 128 7B 70.8 -> 63.7 us, 32B 133.0 -> 120.2 (H100 sweep,
    # docs/benchmarks.md, kernels, twenty-second pass).
    tiles += [replace(c, tail=True) for c in tiles if c.tstore]
    return tiles + [replace(c, halves=True) for c in tiles if not c.persist]


def _gluon_tma_candidates(bm: int) -> list[FwdConfig]:
    """The TMA-fed Gluon kernel's tiles (gemm_gluon_tma.py), one MMA half step in flight: one warpgroup
    of 64 weight rows (won most of M = 64-256 in the first probe, H100 2026-11-22: several programs per
    SM) or two of 64; the X ring as deep as shared memory allows (BM x 256 bytes per stage). Each as a
    split-K grid (``sk`` 0) and as stream-K with 1, 2 or 4 programs per SM (what fits: 4 of BM 64 x BN
    64, 2 of BM 128, 1-2 of BM 256; more is allowed, just not resident at once)."""
    rings = (3, 4) if bm <= 128 else (3,)
    tiles = [FwdConfig(bm, bn, 16, warps=w, stages=st, swap=True, gluon=True, xtma=True, inflight=True, sk=sk)
             for bn, w in ((64, 4), (128, 8)) for st in rings for sk in (0, 1, 2, 4)]
    # The split-K grids again with a wave's last tiles halved (gemm_gluon.halves_split).
    return tiles + [replace(c, halves=True) for c in tiles if not c.sk]


def bwd_candidates() -> list[BwdConfig]:
    return [
        BWD_DEQUANT,
        BwdConfig(128, 64, 64, warps=8, stages=3),
        BwdConfig(128, 64, 128, warps=8, stages=3),
    ]


# The measured table lives in a generated module (benchmarks/bench_kernels.py --sweep --table-out).
try:
    from qerl_kernels.tile_table import BWD as _MEASURED_BWD
    from qerl_kernels.tile_table import FWD as _MEASURED_FWD
except ImportError:  # no measurements yet: the heuristic alone
    _MEASURED_FWD, _MEASURED_BWD = {}, {}
FWD_TABLE.update(_MEASURED_FWD)
BWD_TABLE.update(_MEASURED_BWD)
