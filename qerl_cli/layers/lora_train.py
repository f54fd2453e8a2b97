"""LoRA's training step through one projection as one autograd Function over the frozen base.

Trade-off: autograd over ``base(x) + (x A^T)(B s)^T`` makes x's gradient as two [tokens, in] tensors,
the base's grad-input and the LoRA path's ``(dY B s) A``, then adds them: five passes over [tokens, in]
per projection, and a 7B step runs 7 projections x 28 layers x 13 micro-batches of them. Here the LoRA
term is added by the GEMM that makes it (``addmm_`` into the base's grad-input: cuBLAS adds in its
epilogue), three passes. The forward adds its LoRA term into the base's fresh 2-D output in place. The
price is a hand-written backward: gradients for x, A and B s equal autograd's up to the order of one
sum (tests/test_lora_train.py); a double backward takes out-of-place, differentiable ops.
``QERL_LORA_FN=0`` turns it off (A/B measurements).
"""

from __future__ import annotations

import os

import torch
from torch import nn


def trains_through_fn(lora, x: torch.Tensor) -> bool:
    """Whether ``lora`` (a LoRALinear) runs this training forward through ``lora_train``: gradients on,
    no dropout (its mask would be a second saved tensor), no autocast (the GEMMs' dtype is not x's),
    a frozen QLinear base."""
    from qerl_cli.layers.linear import QLinear

    base = lora.base
    return (torch.is_grad_enabled() and isinstance(lora.dropout, nn.Identity) and isinstance(base, QLinear)
            and not torch.is_autocast_enabled(x.device.type) and os.environ.get("QERL_LORA_FN", "1") != "0"
            and (base.weight is None or not base.weight.requires_grad)
            and (base.bias is None or not base.bias.requires_grad))


def lora_train(lora, x: torch.Tensor) -> torch.Tensor:
    """``base(x) + (x A^T)(B s)^T`` for ``lora`` (see ``trains_through_fn``), gradients to x and the fp32
    masters (through their casts to x's dtype)."""
    a = lora.lora_A.to(x.dtype)
    bs = (lora.lora_B * lora.scaling).to(x.dtype)
    y = _LoRATrainFn.apply(x.reshape(-1, x.shape[-1]), a, bs, lora.base)
    return y.view(*x.shape[:-1], y.shape[-1])


def _base_grad_input(base, gy: torch.Tensor) -> torch.Tensor:
    if base.quantized:
        from qerl_kernels.ops import nvfp4_grad_input

        return nvfp4_grad_input(gy, base.nvfp4_weight())
    return gy @ base.weight


class _LoRATrainFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, a, bs, base):
        t = x2 @ a.t()
        y = base(x2)
        if y._is_view() or not y.is_contiguous() or y.dtype != t.dtype:
            y = torch.addmm(y.to(t.dtype), t, bs.t())
        else:
            y.addmm_(t, bs.t())
        ctx.save_for_backward(x2, a, bs, t)
        ctx.base = base
        return y

    @staticmethod
    def backward(ctx, gy):
        x2, a, bs, t = ctx.saved_tensors
        gy = gy.contiguous()
        need_x, need_a, need_b = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():  # a double backward: t again, with its history (saved, it is a constant
            t = x2 @ a.t()           # and dB's dependence on x and A is lost; a review)
        gt = gy @ bs if (need_x or need_a) else None
        da = gt.t() @ x2 if need_a else None
        db = gy.t() @ t if need_b else None
        dx = None
        if need_x:
            dx = _base_grad_input(ctx.base, gy)
            if torch.is_grad_enabled() or dx.dtype != gt.dtype:  # a double backward: out of place
                dx = dx + gt @ a
            else:
                dx.addmm_(gt, a)
        return dx, da, db, None
