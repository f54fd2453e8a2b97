"""nvfp4_linear on CPU (the reference path every stage falls back to): shapes, bias, autograd."""

import pytest
import torch
from qerl_kernels import reference
from qerl_kernels.ops import NVFP4Weight, nvfp4_linear
from qerl_kernels.testing import grad_check, random_nvfp4, reference_fwd, rel_err


def test_leading_dims_and_bias_match_reference():
    packed, scale, gs = random_nvfp4(24, 64, seed=3)
    w = NVFP4Weight(packed, scale, gs)
    x = torch.randn(2, 3, 64)
    b = torch.randn(24)
    y = nvfp4_linear(x, w, b)
    assert y.shape == (2, 3, 24)
    assert rel_err(y, reference_fwd(x.reshape(-1, 64), packed, scale, gs, b).reshape(2, 3, 24)) < 1e-6


def test_autograd_reference_path():
    res = grad_check(4, 24, 64, "float32")
    assert res["y"] < 1e-6 and res["dx"] < 1e-6 and res["db"] < 1e-6, res


def test_weight_gets_no_gradient_and_x_without_grad_works():
    packed, scale, gs = random_nvfp4(16, 32, seed=4)
    w = NVFP4Weight(packed, scale, gs)
    y = nvfp4_linear(torch.randn(5, 32), w)
    assert not y.requires_grad
    assert torch.equal(w.dequantize(torch.float32), reference.dequantize(packed, scale, gs, torch.float32))


def test_wrong_in_features_is_a_clear_error():
    packed, scale, gs = random_nvfp4(16, 32, seed=5)
    with pytest.raises(ValueError, match="input features"):
        nvfp4_linear(torch.randn(2, 48), NVFP4Weight(packed, scale, gs))


def test_random_nvfp4_plants_edge_cases():
    packed, scale, gs = random_nvfp4(64, 256, seed=6)
    codes = reference.unpack_codes(packed)
    sb = scale.view(torch.uint8)
    assert (codes == 8).any()  # -0
    assert ((codes.view(64, 16, 16) & 7) == 0).all(-1).any()  # all-zero blocks
    assert (sb == 0x01).any() and (sb == 0x7E).any()


def test_tma_descriptors_only_where_tma_can_read():
    # Host-side descriptors need 16-byte aligned bases and row strides and whole 16-row blocks;
    # anything else falls back to pointer loads (None), never a wrong box.
    from qerl_kernels.gemm_fwd import _tma_descriptors
    from qerl_kernels.tile_configs import FwdConfig

    cfg = FwdConfig(64, 128, 16, warps=8, stages=4, swap=True, join=True, tma=True)
    groups = torch.zeros(256, 768 // 16, dtype=torch.int64)
    x = torch.zeros(5, 768, dtype=torch.bfloat16)
    xd, wd = _tma_descriptors(x, groups, cfg)
    assert wd.block_shape == [8, 128] and list(wd.shape) == [16, 768]
    assert xd.block_shape == [64, 128] and list(xd.shape) == [5, 768]
    assert _tma_descriptors(x, groups, FwdConfig(64, 128, 32, swap=True, tma=True)) is None  # bkw 32
    assert _tma_descriptors(x, groups[:200], cfg) is None  # N not whole 16-row blocks
    odd = torch.zeros(5, 776, dtype=torch.bfloat16)[:, 1:769]  # base 2 bytes off 16-byte alignment
    assert _tma_descriptors(odd, groups, cfg) is None


def test_heuristic_picks_gluon_tiles_by_the_tables_rules():
    # Shapes outside the measured table get Gluon tiles at M <= 16: the warp-specialised one for large
    # weights with K % 256 == 0, the per-thread one otherwise; a plain Triton tile above M = 16, where
    # K is not whole 128-element steps, and wherever the caller asks for no Gluon (the wrapper's
    # fallback on other devices and layouts).
    from qerl_kernels.tile_configs import GLUON_WS_MIN_WEIGHTS, heuristic_fwd

    big = heuristic_fwd(1, 28672, 4096)  # Llama-3-8B gate/up
    assert big.gluon and big.ws and big.bm == 8 and big.split_k == 1
    assert heuristic_fwd(16, 28672, 4096).bm == 16
    down = heuristic_fwd(4, 4096, 14336)  # 64 tiles of 64 rows: split-K to ~4 programs per SM
    assert down.ws and down.split_k == 9 and 4096 * 14336 >= GLUON_WS_MIN_WEIGHTS
    small = heuristic_fwd(1, 6144, 4096)
    assert small.gluon and not small.ws and small.split_k > 1
    odd = heuristic_fwd(1, 4096, 4096 + 128)  # K % 256 != 0: the per-thread kernel still reads it
    assert odd.gluon and not odd.ws
    for cfg in (heuristic_fwd(1, 4096, 4096 + 16), heuristic_fwd(1, 28672, 4096, gluon=False),
                heuristic_fwd(64, 4096, 4096 + 128), heuristic_fwd(256, 4096, 4096)):
        assert not cfg.gluon


def test_heuristic_takes_x_by_tma_from_17_to_128_rows():
    # M = 17-128 outside the table: the warp-specialised tile with X by TMA (BM 32, or 64 with two row
    # tiles above 64), two consumers on the largest weights, split-K up to one program per SM (two on long
    # K at BN 64), a wave's last tiles halved when not split.
    from qerl_kernels.tile_configs import WS_XTMA_WIDE_MIN_WEIGHTS, heuristic_fwd

    o = heuristic_fwd(64, 4096, 4096)  # Llama-3-8B o: 64 tiles -> split 2 (128 programs)
    assert o.ws and o.xtma and o.half and (o.bm, o.bn, o.split_k, o.halves) == (64, 64, 2, False)
    gate_up = heuristic_fwd(40, 28672, 4096)  # 115M weights: BN 128, 224 tiles, not split
    assert 28672 * 4096 >= WS_XTMA_WIDE_MIN_WEIGHTS
    assert (gate_up.bn, gate_up.warps, gate_up.split_k, gate_up.halves) == (128, 8, 1, True)
    down = heuristic_fwd(64, 4096, 14336)  # long K at BN 64: two programs per SM
    assert (down.bn, down.split_k) == (64, 4)
    assert heuristic_fwd(32, 4096, 4096).bm == 32 and heuristic_fwd(100, 4096, 4096).bm == 64
    assert heuristic_fwd(100, 4096, 4096).split_k == 1  # 2 row tiles x 64 already fill the SMs
    assert heuristic_fwd(64, 2048, 1536).split_k == 3  # Qwen2.5-1.5B q/k/v: 32 tiles, 3 pairs per split


def test_halves_split_evens_out_one_wave():
    # 7B gate_up (592 tiles of 64 rows) on 132 SMs: q = 5 tiles would land on 64 SMs and 4 on 68; halving
    # the last 64 tiles gives every SM four whole tiles and at most one half.
    from qerl_kernels.gemm_gluon import halves_split

    n_full = halves_split(592, 132)
    assert n_full == 4 * 132 and 2 * (592 - n_full) <= 132
    assert halves_split(432, 132) == 3 * 132  # 32B gate_up, BN 128
    assert halves_split(528, 132) is None  # whole waves: nothing to even out
    assert halves_split(640, 132) is None  # more halves than SMs
    assert halves_split(100, 132) is None  # one wave, not full: no SM holds two


def test_k_order_is_the_permutation_pass_and_its_consumers_undo_it():
    # decode.k_order(_index) is where permute_x puts each column; the paths that receive K-order X
    # without a TMA-fed tile (CPU reference, the activation's torch fallback) bring it back first.
    from qerl_kernels.decode import k_order_index
    from qerl_kernels.gemm_fwd import natural_order, takes_korder_x
    from qerl_kernels.gemm_gluon_tma import permute_x_reference

    from qerl_cli.layers.activation import silu_mul

    x = torch.randn(5, 384)
    idx = k_order_index(384)
    assert torch.equal(permute_x_reference(x)[:, idx], x)
    assert torch.equal(natural_order(permute_x_reference(x)), x)
    assert sorted(idx.tolist()) == list(range(384)) and not torch.equal(idx, torch.arange(384))
    packed, scale, gscale = random_nvfp4(32, 384, seed=3)
    w = NVFP4Weight(packed, scale, gscale)
    assert torch.equal(nvfp4_linear(permute_x_reference(x), w, x_korder=True), nvfp4_linear(x, w))
    g, u = torch.randn(2, 3, 256), torch.randn(2, 3, 256)
    assert torch.equal(silu_mul(g, u, korder=True)[..., k_order_index(256)], silu_mul(g, u))
    from qerl_kernels.decode import from_k_order, to_k_order

    o = torch.randn(2, 3, 128)
    assert torch.equal(to_k_order(o).reshape(6, 128), permute_x_reference(o.reshape(6, 128)))
    assert torch.equal(from_k_order(to_k_order(o)), o)
    assert not takes_korder_x(16, 32, 384, torch.device("cpu"), True, True)  # CPU: no TMA-fed tile
    gx = torch.randn(2, 384, requires_grad=True)
    with pytest.raises(ValueError, match="inference"):
        nvfp4_linear(gx, w, x_korder=True)
    # Producers and consumers that cannot honour K order say so instead of mixing up columns.
    from qerl_cli.layers.linear import QLinear
    from qerl_cli.layers.norm import RMSNorm

    dense = QLinear(384, 8)
    torch.nn.init.normal_(dense.weight)
    assert not dense.takes_korder_x(x)
    with pytest.raises(ValueError, match="natural order"):
        dense(x, x_korder=True)
    norm = RMSNorm(384)
    torch.nn.init.ones_(norm.weight)
    with pytest.raises(ValueError, match="fused norm kernel"):
        norm.with_shrink(x, None, None, korder=True)  # CPU: the torch path cannot write K order


def test_duo_tiles_are_two_consumer_tiles_that_pair_whole():
    # FwdConfig.duo (gemm_gluon_ws: the two consumer warpgroups of a BN 128 tile as two partitions): the
    # sweep's candidates are twins of the BN 128 tiles only; on the gate/up shapes, whose engine launches
    # pair rows (SwiGLU), the table's duo tiles are whole tiles (split-K 1, not halved), the only ones
    # that pair in two partitions (duo_runs); the second consumer's registers fit setmaxnreg (a multiple of
    # 8, at most 256) and leave the first consumer as many or a few more.
    from qerl_kernels.gemm_gluon_ws import duo_consumer_regs, duo_runs
    from qerl_kernels.tile_configs import FWD_TABLE, _gluon_ws_xtma_candidates

    for bm in (32, 64, 128):
        cands = _gluon_ws_xtma_candidates(bm)
        duo = [c for c in cands if c.duo]
        assert all(c.bn == 128 and c.warps == 8 for c in duo)
        assert {(c.bm, c.stages, c.half, c.halves) for c in duo} <= {(c.bm, c.stages, c.half, c.halves)
                                                                      for c in cands if c.bn == 128 and not c.duo}
        assert bool(duo) == (bm >= 64)
    table_duo = {key: c for key, c in FWD_TABLE.items() if c.duo}
    assert table_duo and all(c.bn == 128 and c.ws for c in table_duo.values())
    paired = {key: c for key, c in table_duo.items() if key[1] in (37888, 55296)}  # 7B and 32B gate/up
    assert paired and all(c.split_k == 1 and not c.halves for c in paired.values())
    assert all(duo_runs(c, True, None, 1, False, 10**6) for c in paired.values())
    c = next(iter(paired.values()))
    assert not duo_runs(c, True, None, 2, False, 1) and not duo_runs(c, True, None, 1, True, 1)
    assert not duo_runs(c, False, object(), 1, False, 1)  # rotary: both halves of a head in one warpgroup
    assert duo_runs(c, False, None, 2, False, 1) and not duo_runs(c, False, None, 1, False, 10**6)
    for c in [*table_duo.values(), *(c for bm in (64, 128) for c in _gluon_ws_xtma_candidates(bm) if c.duo)]:
        r = duo_consumer_regs(c)
        first = 3 * c.maxnreg - c.pregs - r  # what the launch's three warpgroups leave the first consumer
        assert r % 8 == 0 and r <= 256 and r <= first < r + 16


def test_tma_store_and_tail_split_plans():
    # The host side of FwdConfig.tstore and .tail (gemm_gluon_ws): a TMA store only for persistent plain
    # launches with 16-byte aligned rows of Y; a tail split only where the last wave is partial and few enough
    # tiles are left to give each >= 2 parts (P // R, at most the K pairs), with a workspace slot per program.
    from types import SimpleNamespace

    from qerl_kernels.gemm_gluon_ws import tail_plan, tma_store_runs

    cfg = SimpleNamespace(tstore=True, tail=True, bm=256)
    y = torch.empty(8, 64)
    assert tma_store_runs(cfg, 132, False, None, y)
    assert not tma_store_runs(cfg, 0, False, None, y)  # not persistent
    assert not tma_store_runs(cfg, 132, True, None, y)  # SwiGLU pairs through its exchange buffer
    assert not tma_store_runs(cfg, 132, False, object(), y)  # rotary
    assert not tma_store_runs(cfg, 132, False, None, torch.empty(8, 66)[:, :60])  # 264-byte rows
    assert not tma_store_runs(SimpleNamespace(tstore=False), 132, False, None, y)

    def parts(tiles, pairs=14, persist=132, store=True):
        plan = tail_plan(cfg, persist, store, tiles, pairs, y)
        if plan is not None:
            n, grid, ws, cnt = plan
            assert grid == (min(persist, tiles),) and ws.numel() == grid[0] * 128 * cfg.bm and cnt.dtype == torch.int32
            return n
        return None

    assert parts(144) == 11  # 7B q/k/v at M = 1024, BM 256: 132 whole, 12 tiles in 11 parts
    assert parts(160) == 4  # 32B o / down: 28 tiles in 4
    assert parts(296) == 4 and parts(592) == 2  # 7B gate/up at M = 128, 256 (BM 128)
    assert parts(144, pairs=5) == 5  # never more parts than K pairs
    assert parts(1184) is None  # 128 tiles left on 132 programs: 1 part each, nothing to split
    assert parts(264) is None and parts(112) is None  # whole waves; one wave, not full
    assert parts(144, store=False) is None and parts(144, persist=0) is None
    assert tail_plan(SimpleNamespace(tail=False, bm=256), 132, True, 144, 14, y) is None


def test_swiglu_korder_output_needs_whole_128_column_steps():
    # K order permutes within 128-column steps; a SwiGLU output of another width would be written past Y.
    from qerl_kernels.gemm_fwd import nvfp4_swiglu
    from qerl_kernels.testing import random_nvfp4

    p, s, g = random_nvfp4(384, 256, seed=1)
    x = torch.randn(4, 256)
    with pytest.raises(ValueError, match="192 columns"):
        nvfp4_swiglu(x, p, s, g, y_korder=True)
    assert nvfp4_swiglu(x, p, s, g) is None  # CPU: no pairing tile, the caller runs its own SwiGLU


def test_pdl_only_where_a_hopper_gpu_runs_compiled_kernels(monkeypatch):
    # kernels/pdl.py: the GEMM after permute_x launches early only when asked (QERL_PDL=1), on CUDA sm_90+,
    # never in Triton's interpreter nor while a CUDA graph is captured (replayed, it hung); X already in K
    # order (no permute_x before the GEMM) never does, nor X of fewer rows than pdl.PDL_MIN_ROWS.
    from qerl_kernels import pdl
    from qerl_kernels.gemm_gluon_tma import permuted_for_pdl

    x = torch.randn(4, 256)
    xk, on = permuted_for_pdl(x, True)
    assert xk is x and not on
    assert not pdl.pdl_enabled(torch.device("cpu"))
    assert pdl.launch_kwargs(False) == {} and pdl.launch_kwargs(True) == {"launch_pdl": True}
    gpu = torch.device("cuda", 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("QERL_PDL", raising=False)
    monkeypatch.setattr(pdl, "_capable", {0: True})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert not pdl.pdl_enabled(gpu)  # off by default
    monkeypatch.setenv("QERL_PDL", "1")
    assert pdl.pdl_enabled(gpu) == (pdl.gdc_wait is not None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not pdl.pdl_enabled(gpu)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.pdl_enabled(gpu)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(pdl, "_capable", {0: False})  # pre-Hopper
    assert not pdl.pdl_enabled(gpu)
    assert 64 < pdl.PDL_MIN_ROWS <= 256


def test_reference_refuses_scales_that_are_not_e4m3_and_sums_an_fp64_bias_in_fp64():
    from qerl_kernels import ops
    from qerl_kernels import reference as R
    from qerl_kernels.korder import k_order_index

    w = torch.randn(8, 32, dtype=torch.float64)
    gs = R.global_scale_for(w.abs().amax())
    p, sc = R.quantize(w, gs)[:2]
    for bad in (sc.float(), sc.view(torch.uint8)):  # the values of fp32 / byte scales were taken as numbers
        with pytest.raises(ValueError, match="float8_e4m3fn"):
            R.dequantize(p, bad, gs)
    x = torch.randn(64, 32, dtype=torch.float64)
    b = torch.zeros(8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(64, 8, dtype=torch.float64) * 1e3
    ops.nvfp4_linear(x, ops.NVFP4Weight(p, sc, gs), b).backward(g)
    assert torch.equal(b.grad, g.sum(0))  # was summed in fp32 (error 0.02 at this scale)
    with pytest.raises(ValueError, match="multiple of 128"):
        k_order_index(48)


def test_reference_path_checks_what_the_kernels_check():
    # K = 24 failed inside a view; a [2, N] bias passed forward and broke in backward; a bias of another
    # dtype failed in F.linear: the CPU path now refuses each as the Triton path does.
    packed, scale, gs = random_nvfp4(24, 64, seed=7)
    w = NVFP4Weight(packed, scale, gs)
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_linear(torch.randn(2, 24), NVFP4Weight(packed[:, :12], scale[:, :1], gs))
    with pytest.raises(ValueError, match="multiple of 16"):
        reference.dequantize(packed[:, :12], scale[:, :1], gs)
    for bias in (torch.randn(2, 24), torch.randn(24, dtype=torch.float64), torch.randn(23)):
        with pytest.raises(ValueError, match="bias must be"):
            nvfp4_linear(x, w, bias)
    with pytest.raises(ValueError, match="activations must be"):
        nvfp4_linear(x.to(torch.int32), w)


def test_double_backward_keeps_the_grad_input_term(monkeypatch):
    # The kernels' grad-input has no autograd history; called bare in backward, a gradient penalty lost
    # its term silently. Emulate a kernel (a detached result) and compare with dense autograd.
    from qerl_kernels import ops
    real = ops._grad_input
    monkeypatch.setattr(ops, "_grad_input", lambda *a: real(*a).detach())
    packed, scale, gs = random_nvfp4(24, 64, seed=8)
    wd = reference.dequantize(packed, scale, gs, torch.float64)
    x = torch.randn(5, 64, dtype=torch.float64, requires_grad=True)
    gx = torch.autograd.grad((nvfp4_linear(x, NVFP4Weight(packed, scale, gs)) ** 2).sum(), x, create_graph=True)[0]
    assert gx.requires_grad
    (gx ** 2).sum().backward()
    xr = x.detach().clone().requires_grad_()
    gr = torch.autograd.grad(((xr @ wd.t()) ** 2).sum(), xr, create_graph=True)[0]
    (gr ** 2).sum().backward()
    assert torch.allclose(x.grad, xr.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("keep_dense", [False, True])
def test_grad_input_checks_its_input_as_nvfp4_linear_does(keep_dense):
    # nvfp4_grad_input ran gy @ dequant(W) unchecked: integer gy dequantized W to integers (every weight
    # below 1 truncated to 0: an all-zero result, no error), a wrong N failed deep in torch's matmul, and
    # [B, T, N] worked on the reference path while the kernels refused it ("does not fit weight").
    from qerl_kernels.ops import nvfp4_grad_input

    packed, scale, gs = random_nvfp4(24, 64, seed=9)
    w = NVFP4Weight(packed, scale, gs, keep_dense=keep_dense)
    with pytest.raises(ValueError, match="must be one of"):
        nvfp4_grad_input(torch.ones(2, 24, dtype=torch.int64), w)
    with pytest.raises(ValueError, match="output features"):
        nvfp4_grad_input(torch.randn(2, 16), w)
    gy = torch.randn(2, 3, 24)
    gx = nvfp4_grad_input(gy, w)
    assert gx.shape == (2, 3, 64)
    want = gy.reshape(-1, 24).double() @ reference.dequantize(packed, scale, gs, torch.float64)
    assert rel_err(gx.reshape(-1, 64), want) < 1e-6


def test_an_explicit_gluon_config_that_cannot_run_is_refused_not_replaced(monkeypatch):
    # A caller's Gluon tile where Gluon cannot run (here: CPU tensors) ran the heuristic Triton tile under its name
    # (a benchmark timed a fallback as that tile); the table's own Gluon entries still fall back.
    from qerl_kernels import gemm_fwd
    from qerl_kernels.tile_configs import DEQUANT, FwdConfig

    packed, scale, gs = random_nvfp4(32, 128, seed=7)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    tile = FwdConfig(16, 64, 16, warps=4, swap=True, gluon=True)
    for tw in (False, True):
        with pytest.raises(ValueError, match=r"config is a Gluon tile, which cannot run here: x is on cpu, not a CUDA"):
            gemm_fwd.nvfp4_matmul(x, packed, scale, gs, config=tile, twiddled=tw, blocked=tw)
    fallbacks = []
    monkeypatch.setattr(gemm_fwd, "fwd_config", lambda m, n, k: tile)
    monkeypatch.setattr(gemm_fwd, "heuristic_fwd", lambda m, n, k, gluon=True: fallbacks.append(gluon) or DEQUANT)
    monkeypatch.setattr(gemm_fwd, "nvfp4_dequantize", lambda p, s, g, dtype, twiddled, blocked:
                        reference.dequantize(p, s, g, dtype))
    y = gemm_fwd.nvfp4_matmul(x, packed, scale, gs)
    assert fallbacks == [False]
    assert torch.equal(y, torch.nn.functional.linear(x, reference.dequantize(packed, scale, gs, torch.bfloat16)))


def test_zero_dim_and_foreign_device_x_are_refused():
    # A 0-dim x failed with IndexError inside the check; a weight left on the meta device (a QLinear
    # never loaded) with a CPU x returned uninitialised CPU memory, no error (nn.Linear refuses it).
    from qerl_cli.layers.linear import QLinear

    packed, scale, gs = random_nvfp4(24, 64, seed=10)
    with pytest.raises(ValueError, match="0-dim"):
        nvfp4_linear(torch.tensor(1.0), NVFP4Weight(packed, scale, gs))
    q = QLinear(64, 24, quantized=True, device="meta")
    for keep_dense in (False, True):
        q.keep_dense = keep_dense
        with pytest.raises(ValueError, match="NVFP4 weight on meta"):
            q(torch.randn(2, 64))


def test_pickled_and_copied_weights_leave_the_dense_cache_behind():
    import copy
    import io

    from qerl_cli.layers.linear import QLinear

    packed, scale, gs = random_nvfp4(64, 256, seed=11)
    q = QLinear(256, 64, quantized=True)
    q.load_state_dict({"weight_packed": packed, "weight_scale": scale, "weight_global_scale": gs})
    q.keep_dense = True

    def size():
        b = io.BytesIO()
        torch.save(q, b)
        return b.tell()

    before = size()
    x = torch.randn(3, 256)
    y = q(x)
    assert q._nvfp4._dense is not None
    assert size() < before + 4096  # was + 64 KB: the fp32 dense copy pickled with the module
    c = copy.deepcopy(q)
    assert c._nvfp4._dense is None and torch.equal(c(x), y)
    b = io.BytesIO()
    torch.save(q, b)
    b.seek(0)
    assert torch.equal(torch.load(b, weights_only=False)(x), y)


def test_a_mistyped_or_unrunnable_kernels_mode_is_refused(monkeypatch):
    # QERL_KERNELS=refernce ran the Triton kernels as "auto" (the ones being debugged), and =triton on CPU
    # without the interpreter failed deep inside Triton with "0 active drivers".
    packed, scale, gs = random_nvfp4(24, 64, seed=12)
    w, x = NVFP4Weight(packed, scale, gs), torch.randn(2, 64)
    monkeypatch.setenv("QERL_KERNELS", "refernce")
    with pytest.raises(ValueError, match="QERL_KERNELS='refernce': expected one of auto, reference, triton"):
        nvfp4_linear(x, w)
    monkeypatch.setenv("QERL_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs TRITON_INTERPRET=1"):
        nvfp4_linear(x, w)
    monkeypatch.setenv("QERL_KERNELS", "reference")
    assert torch.equal(nvfp4_linear(x, w), reference.linear(x, packed, scale, gs, None))


def test_the_stages_refuse_a_bad_kernels_mode_in_one_line_and_an_empty_one_is_auto(monkeypatch, tmp_path):
    # The layers' ValueError reached the CLI as a 100-line traceback, exit 1, after the model loaded (a
    # rollout left its partial directory); QERL_KERNELS= (set, empty) ran as auto until it was refused.
    from qerl_cli.assets import TINY_MODEL
    from qerl_cli.errors import BadInputError
    from qerl_cli.models.loader import load_model
    from qerl_cli.quantize import QuantizeConfig, quantize

    quantize(QuantizeConfig(TINY_MODEL, tmp_path / "q", device="cpu", progress=False))
    monkeypatch.setenv("QERL_KERNELS", "refernce")
    with pytest.raises(BadInputError, match="QERL_KERNELS='refernce': expected one of auto, reference, triton"):
        load_model(tmp_path / "q", device="cpu", dtype=torch.float32)
    monkeypatch.setenv("QERL_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BadInputError, match="needs TRITON_INTERPRET=1"):
        load_model(tmp_path / "q", device="cpu", dtype=torch.float32)
    load_model(TINY_MODEL, device="cpu", dtype=torch.float32)  # no NVFP4 layer: the kernels never run
    monkeypatch.setenv("QERL_KERNELS", "")
    packed, scale, gs = random_nvfp4(24, 64, seed=12)
    x = torch.randn(2, 64)
    assert torch.equal(nvfp4_linear(x, NVFP4Weight(packed, scale, gs)), reference.linear(x, packed, scale, gs, None))
