"""QLinear: a frozen base Linear whose weight is either NVFP4 (packed) or dense.

Trade-off: one class for both bases keeps the decoder free of branches and lets the 16-bit LoRA
baseline and QeRL share every line of model code; the cost is a type switch per call. NVFP4
weights live as buffers under their compressed-tensors names (``weight_packed``, ``weight_scale``,
``weight_global_scale``) so ``state_dict()`` matches the on-disk checkpoint; the matmul goes through
``qerl_kernels.ops.nvfp4_linear`` (Triton on CUDA, the torch reference on CPU), which never
materialises a dequantized weight and is differentiable with respect to the input only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qerl_kernels.ops import NVFP4Weight, nvfp4_linear


class QLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, quantized: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.quantized = in_features, out_features, quantized
        if quantized:
            self.register_buffer("weight_packed", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
            self.register_buffer("weight_scale", torch.empty(out_features, in_features // 16, dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer("weight_global_scale", torch.empty(1, dtype=torch.float32, device=device))
            self.weight = None
        else:
            # A Parameter (frozen) rather than a buffer so it is tied/shared the usual torch way.
            self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False) if bias else None
        self._nvfp4: NVFP4Weight | None = None

    def nvfp4_weight(self) -> NVFP4Weight:
        # Kernels may cache a repacked copy on the NVFP4Weight object, so keep one per set of buffers
        # and rebuild it only when .to()/load replaced the tensors.
        w = self._nvfp4
        if w is None or w.packed is not self.weight_packed or w.scale is not self.weight_scale \
                or w.global_scale is not self.weight_global_scale:
            w = self._nvfp4 = NVFP4Weight(self.weight_packed, self.weight_scale, self.weight_global_scale)
        return w

    def dense_weight(self, dtype=None) -> torch.Tensor:
        """The base weight as a dense tensor (dequantized for NVFP4)."""
        if self.quantized:
            return self.nvfp4_weight().dequantize(dtype or torch.float32)
        return self.weight if dtype is None else self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.quantized:
            return nvfp4_linear(x, self.nvfp4_weight(), bias)
        return F.linear(x, self.weight, bias)

    def extra_repr(self) -> str:
        kind = "nvfp4" if self.quantized else "dense"
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, {kind}"
