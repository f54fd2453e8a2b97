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
