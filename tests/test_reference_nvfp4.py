"""qerl's NVFP4 reference is bit-identical to the installed compressed-tensors package.

The expected side is always computed by compressed-tensors itself, the way llm-compressor
drives it for a weight-only NVFP4 (NVFP4A16) Linear: min/max observed in the weight's own
dtype -> ``generate_gparam`` (global) and ``calculate_qparams`` (fp8 block scales) ->
``NVFP4PackedCompressor.compress`` (packed E2M1 bytes). Nothing here is a copied number.
"""

from __future__ import annotations

import math

import pytest
import torch

# A core dependency (tests/test_packaging.py fails without it); the device machines lack it.
pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from qerl_kernels import reference as R

SCHEME = preset_name_to_scheme("NVFP4A16", ["Linear"])
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def ct_quantize(w: torch.Tensor, global_scale: torch.Tensor | None = None):
    """compressed-tensors' own path for one weight (llm-compressor's observer + compressor)."""
    if global_scale is None:
        global_scale = generate_gparam(w.amin(), w.amax())
    n, k = w.shape
    groups = w.reshape(n, k // 16, 16)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), SCHEME.weights, global_scale=global_scale)
    # llm-compressor stores the scale in a parameter of the weight's dtype before compressing.
    scale = scale.to(w.dtype)
    out = NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_global_scale": global_scale}, SCHEME
    )
    return out["weight_packed"], out["weight_scale"], out["weight_global_scale"]


def ct_decompress(packed, scale, global_scale):
    sd = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": global_scale}
    return NVFP4PackedCompressor.decompress(sd, SCHEME)["weight"]


def assert_bit_identical(w: torch.Tensor, global_scale=None):
    ours = R.quantize(w, global_scale)
    theirs = ct_quantize(w, global_scale)
    assert ours[1].dtype == theirs[1].dtype == torch.float8_e4m3fn
    assert torch.equal(ours[2].view(torch.int32), theirs[2].view(torch.int32)), (ours[2], theirs[2])
    mism = (ours[1].view(torch.uint8) != theirs[1].view(torch.uint8)).sum().item()
    assert mism == 0, f"{mism} block scales differ"
    mism = (ours[0] != theirs[0]).sum().item()
    assert mism == 0, f"{mism} packed bytes differ"
    return ours


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 16), (64, 128), (256, 512), (3, 48)])
def test_random_weights_bit_identical(dtype, shape):
    g = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    w = (torch.randn(shape, generator=g) * 0.02).to(dtype)
    assert_bit_identical(w)


def test_bf16_global_is_computed_in_bf16():
    """The format doc's point: for bf16 weights the global is 448*6/amax rounded in bf16."""
    w = (torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    _, _, g = assert_bit_identical(w)
    amax = w.abs().amax()
    assert g.item() == torch.tensor(2688.0 / amax.float().item()).to(torch.bfloat16).float().item()
    assert g.item() != 2688.0 / amax.float().item()  # the fp32 value would differ


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_blocks_and_all_zero_tensor(dtype):
    w = (torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) * 0.1).to(dtype)
    w[:, 16:32] = 0  # whole zero blocks
    w[5] = 0  # a zero row
    packed, scale, _ = assert_bit_identical(w)
    assert (scale[:, 1].float() == 0.125).all()  # a zero block gets fp8 eps, not 0 (no division by 0)
    zero = torch.zeros(16, 32, dtype=dtype)
    packed, scale, g = assert_bit_identical(zero)
    assert (packed == 0).all() and g.item() == 1.0  # 448*6/tiny overflows -> 1.0, as compressed-tensors


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("magnitude", ["tiny", "subnormal", "huge", "mixed"])
def test_extreme_magnitudes(dtype, magnitude):
    fi = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(32, 64, generator=gen, dtype=torch.float64)
    if magnitude == "tiny":
        w = base * fi.tiny * 64
    elif magnitude == "subnormal":
        w = base * fi.tiny / 8
    elif magnitude == "huge":
        w = base / base.abs().max() * fi.max / 2
    else:  # blocks spanning the whole exponent range: some scales underflow fp8, some saturate it
        exps = torch.linspace(math.log2(fi.tiny), math.log2(fi.max) - 2, 32 * 4, dtype=torch.float64)
        w = base * torch.repeat_interleave(2.0**exps, 16).reshape(32, 64)
    w = w.to(dtype)
    assert torch.isfinite(w).all()
    assert_bit_identical(w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_on_rounding_thresholds(dtype):
    """With amax 6 (exact in every dtype) global = 448 and every block scale 448, so x / (s/g) == x:
    the values below land exactly on the E2M1 decision thresholds, and one ulp either side."""
    thresholds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    vals = []
    for t in thresholds.tolist():
        tt = torch.tensor(t, dtype=dtype)
        for v in (
            tt,
            torch.nextafter(tt, torch.tensor(0.0, dtype=dtype)),
            torch.nextafter(tt, torch.tensor(9.0, dtype=dtype)),
        ):
            vals += [v.item(), -v.item()]
    vals += [0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -6.0, 0.1, -0.1]  # grid points, signed zeros
    n_blocks = math.ceil(len(vals) / 15)
    rows = []
    for b in range(n_blocks):
        chunk = vals[b * 15 : (b + 1) * 15]
        chunk = chunk + [0.0] * (15 - len(chunk))
        rows += [6.0] + chunk  # each block carries amax 6 so its scale is exactly 448
    w = torch.tensor(rows, dtype=torch.float64).reshape(1, -1).to(dtype)
    w = torch.cat([w, -w])
    packed, scale, g = assert_bit_identical(w)
    assert g.item() == 448.0 and (scale.float() == 448.0).all()
    # and the rounding itself is the documented round-half-to-even onto the E2M1 grid
    codes = R.unpack_codes(packed)
    assert R.decode_codes(codes)[0, 1:16].tolist()[:6] == [0.0, -0.0, 0.0, -0.0, 0.5, -0.5]


@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_global_scale(dtype):
    """q/k/v share min(globals): quantizing with a given global matches compressed-tensors too."""
    gen = torch.Generator().manual_seed(4)
    ws = [(torch.randn(32, 64, generator=gen) * s).to(dtype) for s in (0.02, 0.05, 0.01)]
    shared = torch.min(torch.cat([generate_gparam(w.amin(), w.amax()) for w in ws])).reshape(1)
    ours_g = torch.min(torch.cat([R.global_scale_for(w.abs().amax()) for w in ws])).reshape(1)
    assert torch.equal(shared, ours_g)
    for w in ws:
        assert_bit_identical(w, shared)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_matches_compressed_tensors_decompressor(out_dtype):
    w = (torch.randn(64, 128, generator=torch.Generator().manual_seed(5)) * 0.03).to(torch.bfloat16)
    packed, scale, g = R.quantize(w)
    theirs = ct_decompress(packed, scale, g)  # bf16, compressed-tensors' default
    assert torch.equal(R.dequantize(packed, scale, g, dtype=theirs.dtype), theirs)
    # compressed-tensors' dequantize at other output dtypes, too
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    unpacked = unpack_fp4_from_uint8(packed, 64, 128, dtype=torch.float32)
    ct = dequantize(unpacked, scale.to(torch.float32), args=SCHEME.weights, global_scale=g, dtype=out_dtype)
    assert torch.equal(R.dequantize(packed, scale, g, dtype=out_dtype), ct)


def test_pack_unpack_match_compressed_tensors():
    codes = torch.randint(0, 16, (8, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    packed = R.pack_codes(codes)
    assert torch.equal(R.unpack_codes(packed), codes)
    values = R.decode_codes(codes)
    assert torch.equal(pack_fp4_to_uint8(values), packed)
    theirs = unpack_fp4_from_uint8(packed, 8, 64, dtype=torch.float32)
    assert torch.equal(theirs, values)  # -0 included (code 8)


def test_quantize_rejects_bad_shapes():
    with pytest.raises(ValueError, match="K % 16"):
        R.quantize(torch.zeros(4, 24))
    with pytest.raises(ValueError):
        R.quantize(torch.zeros(16))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 8),
    groups=st.integers(1, 6),
    log2_scale=st.floats(-40, 40),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
    zero_frac=st.floats(0, 0.5),
)
def test_property_bit_identical(rows, groups, log2_scale, dtype, seed, zero_frac):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, groups * 16, generator=gen, dtype=torch.float64) * 2.0**log2_scale
    w[torch.rand(w.shape, generator=gen, dtype=torch.float64) < zero_frac] = 0
    w = w.to(dtype)
    if not torch.isfinite(w).all():
        return  # overflowed the dtype: such a weight is refused by `qerl quantize`
    assert_bit_identical(w)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu_and_compressed_tensors_triton(dtype):
    """On CUDA compressed-tensors runs its Triton kernels; qerl's reference on CUDA must agree with both."""
    w = (torch.randn(512, 1024, generator=torch.Generator().manual_seed(7)) * 0.02).to(dtype)
    w[:, :16] = 0
    cpu = R.quantize(w)
    wc = w.cuda()
    gpu = R.quantize(wc)
    theirs = ct_quantize(wc)
    for a, b, c in zip(cpu, gpu, theirs):
        a8, b8, c8 = (t.cpu().contiguous().view(torch.uint8) for t in (a, b, c))
        assert torch.equal(a8, b8) and torch.equal(a8, c8)
