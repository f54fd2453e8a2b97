"""Activations written in the MMA's K order by the kernels that produce them (norm, SwiGLU, decode
attention), read by the TMA-fed GEMM tiles without their permutation pass: the same bits as the
natural-order path, kernel by kernel and in the engine's samples."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from qerl_kernels.testing import gluon_pairing_configs

pytestmark = pytest.mark.gpu

N, K = 384, 1280


def _weights(n: int, k: int, seed: int):
    from qerl_kernels.testing import random_nvfp4
    from qerl_kernels.twiddle import to_kernel_layout

    p, s, g = random_nvfp4(n, k, seed=seed, device="cuda")
    return to_kernel_layout(p, True), s, g


def _gemm_case(m: int, n: int, seed: int):
    """A biased NVFP4 GEMM of M rows: (kernel-layout codes, scales, global scale, X, bias, the reference
    output, X in the MMA's K order)."""
    from qerl_kernels.gemm_gluon_tma import permute_x
    from qerl_kernels.testing import random_nvfp4, reference_fwd
    from qerl_kernels.twiddle import to_kernel_layout

    p, s, g = random_nvfp4(n, K, seed=seed, device="cuda")
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    return to_kernel_layout(p, True), s, g, x, bias, reference_fwd(x, p, s, g, bias), permute_x(x)


def _force_tma_tiles(monkeypatch):
    """Every GEMM on a TMA-fed tile (the table has no tiny shapes), with and without K-order input."""
    from qerl_kernels import gemm_fwd
    from qerl_kernels.tile_configs import FwdConfig

    def tma_tile(m, n, k):
        return FwdConfig(16 if m <= 16 else 64, 64, 16, split_k=1, warps=4, stages=3, swap=True, gluon=True,
                         xtma=True, inflight=True)

    monkeypatch.setattr(gemm_fwd, "fwd_config", tma_tile)
    monkeypatch.setattr(gemm_fwd, "korder_fwd_config", tma_tile)


def _tma_configs(m: int) -> list:
    """The TMA-fed tiles at m rows: split-K grids, a halved launch, stream-K."""
    plain, halved = gluon_pairing_configs(m)
    tma = [c for c in plain + halved if c.xtma]
    return tma + [replace(tma[0], split_k=1, sk=2)]


@pytest.mark.parametrize("m", [40, 100])
def test_korder_x_gives_the_gemm_bit_for_bit(m):
    from qerl_kernels.gemm_fwd import nvfp4_matmul
    from qerl_kernels.gemm_gluon_tma import permute_x

    tp, s, g = _weights(N, K, seed=m)
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    xk = permute_x(x)
    others = [c for c in gluon_pairing_configs(m)[0] if not c.xtma][:2]  # not TMA-fed: x goes back first
    for cfg in _tma_configs(m) + others:
        ref = nvfp4_matmul(x, tp, s, g, bias=bias, config=cfg, twiddled=True, blocked=True)
        got = nvfp4_matmul(xk, tp, s, g, bias=bias, config=cfg, twiddled=True, blocked=True, x_korder=True)
        assert torch.equal(got, ref), cfg


@pytest.mark.parametrize("m", [5, 16, 30])
def test_warp_specialised_tiles_take_x_by_tma(m):
    # The warp-specialised kernel with X by TMA (cfg.xtma: activations in K order, as the engine's
    # producers write them; natural X gets a permute_x copy): the same bits as the same tile with X
    # through the producer's registers, for every half-step candidate, split-K and halved launch.
    from qerl_kernels.gemm_fwd import nvfp4_matmul, nvfp4_swiglu
    from qerl_kernels.gemm_gluon_tma import permute_x
    from qerl_kernels.tile_configs import _gluon_ws_candidates

    tp, s, g = _weights(2 * N, K, seed=m + 11)
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    xk = permute_x(x)
    bm = 8 if m <= 8 else 16 if m <= 16 else 32
    cands = [c for c in _gluon_ws_candidates(bm) if c.half]
    assert cands
    for cfg in cands:
        for c in ([cfg] if cfg.halves else [cfg, replace(cfg, split_k=2)]):
            ref = nvfp4_matmul(x, tp, s, g, config=c, twiddled=True, blocked=True)
            xc = replace(c, xtma=True)
            got = nvfp4_matmul(xk, tp, s, g, config=xc, twiddled=True, blocked=True, x_korder=True)
            assert torch.equal(got, ref), c
            assert torch.equal(nvfp4_matmul(x, tp, s, g, config=xc, twiddled=True, blocked=True), ref), c
        sw = nvfp4_swiglu(x, tp, s, g, config=cfg, twiddled=True, blocked=True)
        sw_k = nvfp4_swiglu(xk, tp, s, g, config=replace(cfg, xtma=True), twiddled=True, blocked=True, x_korder=True)
        assert torch.equal(sw_k, sw), cfg


@pytest.mark.parametrize("m", [24, 64, 100, 200])
def test_warp_specialised_x_by_tma_tiles_for_17_to_256_rows(m):
    # The tiles of M = 17-256 (tile_configs._gluon_ws_xtma_candidates: BM 32-128, no X registers in the
    # producer), split-K, halved and partial M tiles: near the reference, and the same bits from natural X
    # (a permute_x copy first, as the kernel benchmark times them) and from K-order X (the engine's).
    from qerl_kernels.gemm_fwd import nvfp4_matmul
    from qerl_kernels.testing import TOL, rel_err
    from qerl_kernels.tile_configs import _gluon_ws_xtma_candidates

    tp, s, g, x, bias, ref, xk = _gemm_case(m, N, seed=m + 23)
    bms = (32,) if m <= 32 else (128,) if m > 128 else (64, 128) if m > 64 else (64,)
    cands = [c for bm in bms for c in _gluon_ws_xtma_candidates(bm)]
    assert cands and all(c.ws and c.xtma for c in cands)
    for cfg in cands:
        for c in ([cfg] if cfg.halves else [cfg, replace(cfg, split_k=2)]):
            y = nvfp4_matmul(x, tp, s, g, bias=bias, config=c, twiddled=True, blocked=True)
            assert rel_err(y, ref) < TOL[torch.bfloat16], (c, rel_err(y, ref))
            assert torch.equal(nvfp4_matmul(xk, tp, s, g, bias=bias, config=c, twiddled=True, blocked=True,
                                            x_korder=True), y), c


def test_korder_table_routes_down_at_16_rows():
    # 7B down at M = 16 has a K-order tile (tile_configs.KORDER_FWD): the engine then asks SwiGLU for
    # K order; natural-order callers keep the table's tile.
    from qerl_kernels.gemm_fwd import takes_korder_x
    from qerl_kernels.tile_configs import fwd_config, korder_fwd_config

    assert korder_fwd_config(16, 3584, 18944).xtma and korder_fwd_config(16, 3584, 18944).ws
    assert not fwd_config(16, 3584, 18944).xtma
    assert korder_fwd_config(16, 37888, 3584) == fwd_config(16, 37888, 3584)
    dev = torch.device("cuda")
    assert takes_korder_x(16, 3584, 18944, dev, True, True) and not takes_korder_x(16, 37888, 3584, dev, True, True)
    assert takes_korder_x(64, 37888, 3584, dev, True, True)  # the TMA-fed table tile


@pytest.mark.parametrize("m", [16, 64])
def test_swiglu_writes_korder_and_reads_it(m):
    from qerl_kernels.decode import k_order_index
    from qerl_kernels.gemm_fwd import nvfp4_swiglu
    from qerl_kernels.gemm_gluon_tma import permute_x

    tp, s, g = _weights(2 * N, K, seed=m + 7)
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    idx = k_order_index(N, "cuda")
    plain, halved = gluon_pairing_configs(m)
    for cfg in plain + halved:  # every Gluon kernel writes K order; the TMA-fed ones also read it
        ref = nvfp4_swiglu(x, tp, s, g, config=cfg, twiddled=True, blocked=True)
        y = nvfp4_swiglu(x, tp, s, g, config=cfg, twiddled=True, blocked=True, y_korder=True)
        assert torch.equal(y[:, idx], ref), cfg
        if cfg.xtma:
            y2 = nvfp4_swiglu(permute_x(x), tp, s, g, config=cfg, twiddled=True, blocked=True, x_korder=True,
                              y_korder=True)
            assert torch.equal(y2, y), cfg


def test_qkv_rope_reads_korder():
    from qerl_kernels.gemm_fwd import nvfp4_qkv_rope
    from qerl_kernels.gemm_gluon import RopeEpilogue
    from qerl_kernels.gemm_gluon_tma import permute_x

    from qerl_cli.layers.rotary import RotaryEmbedding

    m, head, hq, hk = 48, 128, 4, 2
    tp, s, g = _weights((hq + 2 * hk) * head, K, seed=5)
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 4096, (m,), device="cuda")
    slots = torch.randperm(256, device="cuda")[:m]
    cos_sin = RotaryEmbedding(head, 4096, 1e6, device="cuda").cos_sin
    for cfg in [c for c in gluon_pairing_configs(m)[0] if c.xtma]:
        out = []
        for xin, korder in ((x, False), (permute_x(x), True)):
            kc, vc = (torch.zeros(16, 16, hk, head, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            rope = RopeEpilogue(positions, cos_sin, slots, kc, vc, hq * head, hk * head, head)
            y = nvfp4_qkv_rope(xin, tp, s, g, None, rope, config=cfg, twiddled=True, blocked=True, x_korder=korder)
            out.append((y, kc, vc))
        assert all(torch.equal(a, b) for a, b in zip(*out)), cfg


def test_norm_and_attention_write_korder_in_bf16():
    # The interpreter checks these kernels in fp16/fp32; here bf16 on the GPU, a 7B-shaped row and
    # attention over the engine's split and whole-context tiles.
    from qerl_kernels.decode import k_order_index

    from qerl_cli.layers import fused
    from qerl_cli.layers.triton_attention import paged_decode_attention_triton

    x, r = (torch.randn(16, 3584, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(3584, device="cuda")).to(torch.bfloat16)
    z = 0.01 * torch.randn(3584, device="cuda")
    y, ro = fused.rmsnorm(x, w, z, 1e-6, r)
    yk, rok = fused.rmsnorm(x, w, z, 1e-6, r, korder=True)
    assert torch.equal(yk[:, k_order_index(3584, "cuda")], y) and torch.equal(rok, ro)
    kc, vc = (torch.randn(200, 16, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    idx = k_order_index(28 * 128, "cuda")
    for b in (16, 64):
        q = torch.randn(b, 28, 128, device="cuda", dtype=torch.bfloat16)
        tables = torch.randint(1, 200, (b, 48), device="cuda", dtype=torch.int32)
        lens = torch.randint(1, 768, (b,), device="cuda", dtype=torch.int32)
        o = paged_decode_attention_triton(q, kc, vc, tables, lens, 128**-0.5)
        ok = paged_decode_attention_triton(q, kc, vc, tables, lens, 128**-0.5, korder=True)
        assert torch.equal(ok.reshape(b, -1)[:, idx], o.reshape(b, -1)), b


def _tiny_nvfp4(tmp_path, lora=None):
    """A tiny quantized Qwen2 on the GPU (hidden 128: whole K-order steps), with ``lora`` random and non-zero."""
    from qerl_cli.layers.lora import lora_parameters
    from qerl_cli.models import load_model
    from qerl_cli.quantize import QuantizeConfig, quantize
    from tests.helpers import make_tiny_hf_model

    src = make_tiny_hf_model(tmp_path, arch="qwen2", init_std=0.05, hidden=128, heads=2, kv_heads=1, intermediate=256)
    quantize(QuantizeConfig(src=src, out=tmp_path / "q", device="cpu", progress=False))
    model = load_model(tmp_path / "q", device="cuda", dtype=torch.bfloat16, lora=lora)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.normal_(0, 0.05)
    return model


def _korder_engine_runs(model, monkeypatch, log: list) -> dict:
    """The engine's samples with QERL_KORDER_X=1 and 0 on the forced TMA-fed tiles; ``log`` (the spied
    calls' x_korder flags) must show most reads in K order at 1 and none at 0."""
    from qerl_kernels import gemm_fwd

    from qerl_cli.engine import LLMEngine, SamplingParams
    from tests.test_engine_gpu import PROMPTS

    sp = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=17)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("QERL_KORDER_X", flag)
        log.clear()
        runs[flag] = LLMEngine(model, None, max_num_seqs=8).generate(PROMPTS, sp, n=2)
        # At 1 only a prefill's o_proj reads natural X (the prefill attention is SDPA's).
        assert log and (log.count(True) > len(log) // 2 if flag == "1" else not any(log)), \
            (flag, log.count(True), len(log))
    gemm_fwd._takes_korder_x.cache_clear()  # nor keep the forced tiles' answers for later tests
    return runs


def test_engine_samples_with_korder_on_and_off(tmp_path, monkeypatch):
    # A tiny NVFP4 model whose GEMMs all run a TMA-fed tile (the table has no such shapes, so the test
    # forces one): with QERL_KORDER_X=1 the norms, SwiGLU and decode attention write K order and their
    # GEMMs skip permute_x; the samples equal those of the permutation passes.
    from qerl_kernels import gemm_fwd, gemm_gluon_tma

    _force_tma_tiles(monkeypatch)
    gemm_fwd._takes_korder_x.cache_clear()  # answers cached under the real tile table
    real, korder = gemm_gluon_tma.launch_gluon_tma, []

    def spy(*args, **kw):
        korder.append(kw.get("x_korder", False))
        return real(*args, **kw)

    monkeypatch.setattr(gemm_gluon_tma, "launch_gluon_tma", spy)
    runs = _korder_engine_runs(_tiny_nvfp4(tmp_path), monkeypatch, korder)
    for a, b in zip(runs["1"], runs["0"]):
        for c1, c2 in zip(a, b):
            assert c1.token_ids == c2.token_ids and c1.logprobs == c2.logprobs


def test_engine_lora_reads_korder_x(tmp_path, monkeypatch):
    # The same forced TMA-fed tiles with LoRA r=8 (random, non-zero) on all seven projections: with
    # QERL_KORDER_X=1 the norms, SwiGLU and decode attention still write K order, and every adapter's
    # shrink reads it through its K-order A (lora.korder_copy) beside the base GEMM; the samples match
    # the natural-order run up to the shrinks' K sum order (bf16: long samples may drift apart).
    from qerl_kernels import gemm_fwd

    import qerl_cli.layers.lora as lora
    from qerl_cli.layers.lora import LoraSpec

    _force_tma_tiles(monkeypatch)
    gemm_fwd._takes_korder_x.cache_clear()
    real, korder = lora.base_and_shrink, []
    monkeypatch.setattr(lora, "base_and_shrink", lambda base, x, a, b=None, t=None, x_korder=False:
                        korder.append(x_korder) or real(base, x, a, b, t, x_korder))
    runs = _korder_engine_runs(_tiny_nvfp4(tmp_path, LoraSpec(r=8, alpha=16)), monkeypatch, korder)
    diffs = []
    for a, b in zip(runs["1"], runs["0"]):
        for c1, c2 in zip(a, b):
            n = min(len(c1.token_ids), 8)
            assert c1.token_ids[:n] == c2.token_ids[:n]
            diffs += [abs(x - y) for x, y in zip(c1.logprobs[:n], c2.logprobs[:n])]
    assert sum(diffs) / len(diffs) < 2e-2 and max(diffs) < 0.2, (sum(diffs) / len(diffs), max(diffs))


@pytest.mark.parametrize("m", [24, 100, 200])
def test_duo_consumers_give_the_one_partition_bits(m, monkeypatch):
    # FwdConfig.duo runs a BN 128 warp-specialised tile's two consumer warpgroups as separate partitions:
    # every weight row goes through the same MMAs in the same order, so the output is bit for bit the
    # one-partition tile's, near the reference, also where the last tile's second half is all past N
    # (N = 400: rows 448-511 of the fourth tile), with split-K 2 and with halved tiles (halves_split
    # forced to 2 whole tiles); SwiGLU launches (natural and K-order output) pair the two partitions' rows
    # through shared memory.
    from qerl_kernels import gemm_gluon
    from qerl_kernels.gemm_fwd import nvfp4_matmul, nvfp4_swiglu
    from qerl_kernels.testing import TOL, rel_err
    from qerl_kernels.tile_configs import FwdConfig

    tp, s, g, x, bias, ref, xk = _gemm_case(m, 400, seed=m + 5)
    tp2, s2, g2 = _weights(512, K, seed=m + 6)  # a gate/up stack for the SwiGLU epilogue (K order: 256 wide)
    bm = 32 if m <= 32 else 64 if m <= 64 else 128
    for r, pr in ((96, 24), (128, 32)):
        one = FwdConfig(bm, 128, 16, warps=8, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=r, pregs=pr,
                        half=2)
        for c in (one, replace(one, split_k=2), replace(one, halves=True)):
            duo = replace(c, duo=True)
            if c.halves:
                monkeypatch.setattr(gemm_gluon, "halves_split", lambda tiles, sms: 2)
            y1 = nvfp4_matmul(xk, tp, s, g, bias=bias, config=c, twiddled=True, blocked=True, x_korder=True)
            y2 = nvfp4_matmul(xk, tp, s, g, bias=bias, config=duo, twiddled=True, blocked=True, x_korder=True)
            monkeypatch.undo()
            assert rel_err(y2, ref) < TOL[torch.bfloat16], (duo, rel_err(y2, ref))
            assert torch.equal(y2, y1), duo
        duo = replace(one, duo=True)
        for yk in (False, True):  # SwiGLU pairs a duo tile's rows through shared memory: the same bits
            sw1 = nvfp4_swiglu(xk, tp2, s2, g2, config=one, twiddled=True, blocked=True, x_korder=True, y_korder=yk)
            sw2 = nvfp4_swiglu(xk, tp2, s2, g2, config=duo, twiddled=True, blocked=True, x_korder=True, y_korder=yk)
            assert sw1 is not None and torch.equal(sw2, sw1), (duo, yk)


@pytest.mark.parametrize("m", [100, 300])
def test_persistent_duo_tiles_give_the_same_bits(m, monkeypatch):
    # FwdConfig.persist: one program per SM slot walks tiles pid, pid + programs, ... with its rings'
    # stages and phases carried over. Same MMAs per tile in the same order: the one-program-per-tile bits.
    # Two or three SMs (monkeypatched) make every program walk several tiles, unevenly; X rings of 3 and
    # 4 half steps wrap at other points than the tiles; bias; SwiGLU with natural and K-order output
    # (the exchange barrier's phase flips every tile); plain tiles stored by TMA too (FwdConfig.tstore).
    from qerl_kernels import gemm_gluon_ws
    from qerl_kernels.gemm_fwd import nvfp4_matmul, nvfp4_swiglu
    from qerl_kernels.testing import TOL, rel_err
    from qerl_kernels.tile_configs import FwdConfig

    tp, s, g, x, bias, ref, xk = _gemm_case(m, 400, seed=m + 13)
    tp2, s2, g2 = _weights(1024, K, seed=m + 14)
    for bm, r, pr, depths in ((64, 128, 32, (3, 4)), (128, 168, 40, (3, 4)), (256, 168, 40, (3,))):
        for xst in depths:
            one = FwdConfig(bm, 128, 16, warps=8, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=r,
                            pregs=pr, half=2, duo=True, xstages=xst)
            y0 = nvfp4_matmul(xk, tp, s, g, bias=bias, config=one, twiddled=True, blocked=True, x_korder=True)
            sw0 = [nvfp4_swiglu(xk, tp2, s2, g2, config=one, twiddled=True, blocked=True, x_korder=True, y_korder=yk)
                   for yk in (False, True)]
            for sms in (2, 3):
                monkeypatch.setattr(gemm_gluon_ws, "num_sms", lambda device, n=sms: n)
                per = replace(one, persist=1)
                assert gemm_gluon_ws.persist_programs(per, True, 1, False, K // 256, xk.device) == sms
                for tst in (False, True):  # FwdConfig.tstore: rows out by TMA, N = 400 clipping a half tile
                    y = nvfp4_matmul(xk, tp, s, g, bias=bias, config=replace(per, tstore=tst), twiddled=True,
                                     blocked=True, x_korder=True)
                    assert rel_err(y, ref) < TOL[torch.bfloat16], (per, tst, rel_err(y, ref))
                    assert torch.equal(y, y0), (per, sms, tst)
                for yk, want in zip((False, True), sw0):
                    sw = nvfp4_swiglu(xk, tp2, s2, g2, config=per, twiddled=True, blocked=True, x_korder=True,
                                      y_korder=yk)
                    assert want is not None and torch.equal(sw, want), (per, sms, yk)
                monkeypatch.undo()


@pytest.mark.parametrize("m", [100, 300])
def test_tail_split_duo_tiles_match_the_reference(m, monkeypatch):
    # FwdConfig.tail: persistent programs run whole waves of tiles, then the last partial wave's tiles in
    # K-parts, one per program, the last to arrive adding the fp32 partials in program order. Against the
    # reference, run to run bit for bit, and the whole waves' rows equal to the whole-tile launch's. SMs
    # (monkeypatched) and M pick the cases: BM 64 at M = 300 is 20 tiles, so 3 SMs give 6 whole waves and
    # a 2-tile tail in 1 part each (no split: whole tiles), 6 SMs 3 waves and a 2-tile tail in 3 parts; 7
    # SMs a 6-tile tail in 1 part; BM 128 / 256 tails of 1-2 tiles in 3-5 parts (K = 1280: 5 pairs).
    from qerl_kernels import gemm_gluon_ws
    from qerl_kernels.gemm_fwd import nvfp4_matmul
    from qerl_kernels.testing import TOL, rel_err
    from qerl_kernels.tile_configs import FwdConfig

    tp, s, g, x, bias, ref, xk = _gemm_case(m, 400, seed=m + 21)
    split_seen = 0
    for bm, r, pr, xst in ((64, 128, 32, 4), (128, 168, 40, 6), (256, 168, 40, 3)):
        whole = FwdConfig(bm, 128, 16, warps=8, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=r,
                          pregs=pr, half=2, duo=True, xstages=xst, persist=1, tstore=True)
        for sms in (3, 6, 7):
            monkeypatch.setattr(gemm_gluon_ws, "num_sms", lambda device, n=sms: n)
            y0 = nvfp4_matmul(xk, tp, s, g, bias=bias, config=whole, twiddled=True, blocked=True, x_korder=True)
            tail = replace(whole, tail=True)
            tiles = -(-m // bm) * -(-400 // 128)
            plan = gemm_gluon_ws.tail_plan(tail, min(sms, tiles), True, tiles, K // 256, y0)
            split_seen += plan is not None
            y = nvfp4_matmul(xk, tp, s, g, bias=bias, config=tail, twiddled=True, blocked=True, x_korder=True)
            assert rel_err(y, ref) < TOL[torch.bfloat16], (bm, sms, rel_err(y, ref))
            again = nvfp4_matmul(xk, tp, s, g, bias=bias, config=tail, twiddled=True, blocked=True, x_korder=True)
            assert torch.equal(y, again), (bm, sms)
            if plan is not None:  # the whole waves' tiles: rows of tiles before the tail are the whole-tile bits
                n_dp = tiles - tiles % min(sms, tiles)
                rows = (n_dp // 4) * bm  # whole row blocks of tiles (grid_n = 4) finished before the tail
                assert torch.equal(y[:rows], y0[:rows]), (bm, sms)
            else:
                assert torch.equal(y, y0), (bm, sms)
            monkeypatch.undo()
    assert split_seen >= 3


@pytest.mark.parametrize("m", [100, 300])
def test_x_ring_gives_the_shared_ring_bits(m):
    # FwdConfig.xstages puts X in a ring of [BM, 64] half steps of its own (each released once the MMA
    # that read it is done; the codes' stage as soon as its codes are in registers). The MMAs per weight
    # row are the same, in the same order, so the output is the shared-ring tile's bits: at BM 128 and at
    # BM 256 (where two shared stages would not fit: the baseline runs one), odd ring depths that wrap at
    # other points than the codes' stages, split-K 2 (2 and 3 pairs per split), duo and one partition,
    # and the SwiGLU epilogue (a duo tile pairs through shared memory).
    from qerl_kernels.gemm_fwd import nvfp4_matmul, nvfp4_swiglu
    from qerl_kernels.testing import TOL, rel_err
    from qerl_kernels.tile_configs import FwdConfig

    from qerl_cli.layers.fused import silu_mul

    tp, s, g, x, bias, ref, xk = _gemm_case(m, 400, seed=m + 7)
    tp2, s2, g2 = _weights(384, K, seed=m + 8)
    for bm, stages, r, pr, depths in ((128, 2, 128, 32, (3, 4, 6)), (256, 1, 168, 40, (3, 5))):
        for split in (1, 2):
            base = FwdConfig(bm, 128, 16, split_k=split, warps=8, stages=stages, swap=True, gluon=True, ws=True,
                             xtma=True, maxnreg=r, pregs=pr, half=2)
            y0 = nvfp4_matmul(xk, tp, s, g, bias=bias, config=base, twiddled=True, blocked=True, x_korder=True)
            assert rel_err(y0, ref) < TOL[torch.bfloat16], (base, rel_err(y0, ref))
            for xst in depths:
                for duo in (False, True):
                    c = replace(base, stages=2, xstages=xst, duo=duo)
                    y = nvfp4_matmul(xk, tp, s, g, bias=bias, config=c, twiddled=True, blocked=True, x_korder=True)
                    assert torch.equal(y, y0), c
        # SwiGLU: the fused epilogue (duo: pairing through shared memory) against the unfused path on the
        # shared-ring tile's gate/up output, which it matches bit for bit (gemm_fwd.nvfp4_swiglu).
        gu = nvfp4_matmul(xk, tp2, s2, g2, config=replace(base, split_k=1), twiddled=True, blocked=True, x_korder=True)
        sw0 = silu_mul(gu[:, :192].contiguous(), gu[:, 192:].contiguous())
        for xst in depths:
            if (xst + 2) * bm * 128 + 2 * 18432 > 227 * 1024:  # X ring + exchanged gate/up rows + 2 code stages
                continue
            c = replace(base, split_k=1, stages=2, xstages=xst, duo=True)
            sw = nvfp4_swiglu(xk, tp2, s2, g2, config=c, twiddled=True, blocked=True, x_korder=True)
            assert sw is not None and torch.equal(sw, sw0), c
