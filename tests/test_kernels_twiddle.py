"""twiddle.py's load-time code layout: an exact bijection, and every consumer reads it as the file's."""

import pytest
import torch
from qerl_kernels import reference
from qerl_kernels.ops import NVFP4Weight, nvfp4_linear
from qerl_kernels.testing import random_nvfp4
from qerl_kernels.twiddle import (
    block,
    can_block,
    decode_registers,
    from_kernel_layout,
    to_kernel_layout,
    twiddle,
    unblock,
    untwiddle,
)


def test_round_trip_every_byte_in_every_position():
    # 8 bytes = one scale group; put each byte value at each of the 8 positions.
    v = torch.arange(256, dtype=torch.uint8)
    packed = torch.stack([v.roll(i) for i in range(8)], dim=1).reshape(256, 8)
    tw = twiddle(packed)
    assert tw.shape == packed.shape and tw.dtype == torch.uint8
    assert not torch.equal(tw, packed)
    assert torch.equal(untwiddle(tw), packed)


def test_register_emulation_recovers_the_codes():
    packed, _, _ = random_nvfp4(37, 96, seed=3)
    assert torch.equal(decode_registers(twiddle(packed)), reference.unpack_codes(packed))


def test_rejects_shapes_that_are_not_whole_groups():
    with pytest.raises(ValueError, match="K % 16"):
        twiddle(torch.zeros(4, 12, dtype=torch.uint8))
    with pytest.raises(ValueError):
        twiddle(torch.zeros(4, 16, dtype=torch.int32))


def test_weight_object_and_reference_linear_read_twiddled_codes():
    packed, scale, gs = random_nvfp4(24, 64, seed=5)
    plain = NVFP4Weight(packed, scale, gs)
    tw = NVFP4Weight(twiddle(packed), scale, gs, twiddled=True)
    assert torch.equal(tw.ondisk_packed(), packed)
    assert torch.equal(tw.dequantize(torch.float32), plain.dequantize(torch.float32))
    x = torch.randn(3, 64, requires_grad=True)
    y = nvfp4_linear(x, tw)
    y.sum().backward()
    g = x.grad.clone()
    x.grad = None
    y0 = nvfp4_linear(x, plain)
    y0.sum().backward()
    assert torch.equal(y, y0) and torch.equal(g, x.grad)


def test_model_twiddle_in_place_keeps_every_output(tmp_path):
    # The tiny model on CPU, twiddled explicitly (the loader only does it on sm_90): fused and
    # per-projection modules share storage, and every Linear's output must stay bit-identical.
    from qerl_cli.layers.attention import fuse_projections
    from qerl_cli.layers.linear import _all_qlinears, twiddle_codes_
    from qerl_cli.models.config import ModelConfig
    from qerl_cli.models.loader import build_random_model

    cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, qkv_bias=True)
    model = build_random_model(cfg, device="cpu", dtype=torch.float32, quantized=True)
    fuse_projections(model)
    mods = [m for m in _all_qlinears(model) if m.quantized]  # fused q/k/v, gate/up included
    assert len(mods) > len([m for m in model.modules() if getattr(m, 'quantized', False)])
    x = torch.randn(3, 64)
    before = {id(m): m(x[:, : m.in_features].contiguous()) if m.in_features == 64 else None for m in mods}
    dense = {id(m): m.dense_weight() for m in mods}
    assert twiddle_codes_(model) == len(mods)
    assert all(m.twiddled for m in mods)
    for m in mods:
        assert torch.equal(m.dense_weight(), dense[id(m)])
        if before[id(m)] is not None:
            assert torch.equal(m(x), before[id(m)])
    assert twiddle_codes_(model) == 0  # idempotent: already twiddled modules are skipped


@pytest.mark.parametrize("chunk_bytes", [1, 100, 10**6])
def test_twiddling_in_row_chunks_writes_what_one_pass_does(chunk_bytes):
    # chunks of 1 row (chunk_bytes under a row), of a few rows, of a whole small weight
    from qerl_cli.layers.linear import _all_qlinears, twiddle_codes_
    from qerl_cli.models.config import ModelConfig
    from qerl_cli.models.loader import build_random_model

    cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    a, b = (build_random_model(cfg, device="cpu", dtype=torch.float32, quantized=True, seed=3) for _ in range(2))
    twiddle_codes_(a)
    twiddle_codes_(b, chunk_bytes=chunk_bytes)
    pairs = [(ma, mb) for ma, mb in zip(_all_qlinears(a), _all_qlinears(b), strict=True) if ma.quantized]
    assert len(pairs) >= 4
    for ma, mb in pairs:
        assert torch.equal(ma.weight_packed, mb.weight_packed) and ma.twiddled and mb.twiddled


def test_block_round_trip_and_tile_contiguity():
    packed, _, _ = random_nvfp4(48, 384, seed=7)
    assert can_block(48, 384) and not can_block(40, 384) and not can_block(48, 320)
    b = block(packed)
    assert torch.equal(unblock(b), packed)
    # The first 1 KB of the blocked tensor is rows 0..15, bytes 0..63 of each, row after row.
    assert torch.equal(b.reshape(-1)[:1024].view(16, 64), packed[:16, :64])
    assert torch.equal(from_kernel_layout(to_kernel_layout(packed, True), True), packed)
    with pytest.raises(ValueError, match="tile"):
        block(packed[:40])


def test_blocked_weight_reads_back_on_the_reference_path():
    packed, scale, gs = random_nvfp4(32, 256, seed=8)
    w = NVFP4Weight(to_kernel_layout(packed, True), scale, gs, twiddled=True, blocked=True)
    assert torch.equal(w.ondisk_packed(), packed)
    x = torch.randn(2, 256)
    assert torch.equal(nvfp4_linear(x, w), nvfp4_linear(x, NVFP4Weight(packed, scale, gs)))


def _blockable_model():
    """A tiny NVFP4 model whose every Linear tiles into 16-row x 128-element blocks."""
    from qerl_cli.models.config import ModelConfig
    from qerl_cli.models.loader import build_random_model

    cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=32, qkv_bias=True)
    return build_random_model(cfg, device="cpu", dtype=torch.float32, quantized=True)


def test_model_twiddle_blocks_where_every_reader_tiles():
    from qerl_cli.layers.attention import fuse_projections
    from qerl_cli.layers.linear import _all_qlinears, twiddle_codes_
    model = _blockable_model()
    fuse_projections(model)
    mods = [m for m in _all_qlinears(model) if m.quantized]
    dense = {id(m): m.dense_weight() for m in mods}
    twiddle_codes_(model)
    assert all(m.twiddled and m.blocked for m in mods)
    for m in mods:
        assert torch.equal(m.dense_weight(), dense[id(m)])


def test_state_dict_returns_the_files_codes_after_twiddling():
    from qerl_cli.layers.linear import twiddle_codes_
    model = _blockable_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    twiddle_codes_(model)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    q = model.model.layers[0].self_attn.q_proj
    q = getattr(q, "base", q)
    assert q.blocked and not torch.equal(q.weight_packed, before["model.layers.0.self_attn.q_proj.weight_packed"])


def test_load_state_dict_writes_the_files_codes_in_the_kernel_layout():
    # A state dict holds the file's codes; loading one into a twiddled model copied them over the
    # kernel layout unconverted (outputs off by ~65, no error). Fused modules share the parts' bytes.
    from qerl_cli.layers.attention import fuse_projections
    from qerl_cli.layers.linear import _all_qlinears, twiddle_codes_
    model = _blockable_model()
    fuse_projections(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    twiddle_codes_(model)
    mods = [m for m in _all_qlinears(model) if m.quantized]
    dense = {id(m): m.dense_weight() for m in mods}
    codes = {id(m): m.weight_packed.clone() for m in mods}
    model.load_state_dict(state)
    for m in mods:
        assert m.twiddled and torch.equal(m.weight_packed, codes[id(m)])
        assert torch.equal(m.dense_weight(), dense[id(m)])


def test_to_dtype_moves_nvfp4_buffers_without_casting_them():
    # torch counts float8 as floating point: model.to(bf16) cast the block scales and rounded the
    # fp32 global scale, and the next forward failed far from the cause.
    from qerl_cli.layers.linear import QLinear
    model = _blockable_model()
    q = model.model.layers[0].self_attn.q_proj
    q = getattr(q, "base", q)
    x = torch.randn(3, 128)
    y = q(x)
    gs = q.weight_global_scale.clone()
    model.to(torch.bfloat16)
    assert (q.weight_packed.dtype, q.weight_scale.dtype, q.weight_global_scale.dtype) == (
        torch.uint8, torch.float8_e4m3fn, torch.float32)
    assert torch.equal(q.weight_global_scale, gs) and q.bias.dtype == torch.bfloat16
    assert (q(x.bfloat16()).float() - y).abs().max() < 0.05 * y.abs().max()
    model.half().float()
    assert q.weight_scale.dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="divisible by 16"):
        QLinear(24, 8, quantized=True)


TWIDDLE_CHECK = """
import torch
from qerl_kernels.twiddle import twiddle
from qerl_kernels.twiddle_triton import twiddle_

def check(device, shapes, block=1024):
    g = torch.Generator().manual_seed(5)
    for n, kh in shapes:
        p = torch.randint(0, 256, (n, kh), generator=g, dtype=torch.uint8)
        if n * kh >= 256:
            p.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every byte value
        got = twiddle_(p.clone().to(device), block=block).cpu()  # in place: never p itself
        assert torch.equal(got, twiddle(p)), (n, kh)
"""


def test_the_triton_twiddle_writes_the_references_bits_in_interpreter():
    # one pass in place instead of ~20 int64 torch ops per chunk (docs/benchmarks.md, RL loop, fourth pass)
    from tests.helpers import run_in_interpreter

    pytest.importorskip("triton")
    shapes = [(1, 8), (3, 24), (17, 40), (5, 1000), (64, 64)]
    run_in_interpreter(TWIDDLE_CHECK + f"check('cpu', {shapes})\ncheck('cpu', [(7, 72)], block=16)\nprint('ok')\n")


def test_the_triton_twiddle_refuses_what_it_cannot_view_as_word_pairs():
    from qerl_kernels.twiddle_triton import twiddle_

    for bad in (torch.zeros(4, 12, dtype=torch.uint8), torch.zeros(4, 16, dtype=torch.int8),
                torch.zeros(8, 16, dtype=torch.uint8)[:, :8]):
        with pytest.raises(ValueError, match="contiguous packed uint8"):
            twiddle_(bad)


@pytest.mark.gpu
def test_the_triton_twiddle_writes_the_references_bits_on_gpu():
    ns = {}
    exec(TWIDDLE_CHECK, ns)
    ns["check"]("cuda", [(1, 8), (3, 24), (17, 40), (37888, 1792), (3584, 9472)])
