"""SwiGLU's ``silu(g) * u`` with a backward that recomputes ``silu(g)`` instead of saving it.

Trade-off: plain autograd keeps ``silu(g)`` alive from the forward to the backward, one more
[tokens, intermediate] tensor per layer under training (277 MiB per 8192 tokens on a 7B model,
measured at the step's memory peak on an H100). Recomputing it costs one elementwise pass in
backward. On CPU the gradients are bit-identical to autograd's: the same aten ops (``silu``, the two
products and ``silu_backward``) run on the same inputs, only later, and write in place. On CUDA each
direction is one Triton pass (``fused.silu_mul``, ``fused.silu_mul_backward``) that rounds where those
ops round; its exp may differ from CUDA's in the last fp32 bit, so a 16-bit result can move by one
unit in the last place. Outside autograd on CUDA (rollout) the forward is the same kernel, or none at
all where the NVFP4 gate/up GEMM computes it in its epilogue (``swiglu_epilogue``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from qerl_cli.layers import fused


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g, u)
        if _fusable(g, u):  # the inference kernel: a checkpointed recompute gives the first forward's bits
            return fused.silu_mul(g, u)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Two [tokens, intermediate] buffers beyond g, u and grad, each written in place: this
        # backward is the train step's memory peak (H100 trace), so every transient counts.
        g, u = ctx.saved_tensors
        dg = du = None
        # On CUDA one Triton pass (fused.silu_mul_backward) where torch runs four kernels.
        if torch.is_grad_enabled():  # a double backward: differentiable ops (the in-place silu_backward
            sig = torch.sigmoid(g)    # below has no derivative: "not implemented" at the second order)
            dg = grad * u * (sig * (1 + g * (1 - sig))) if ctx.needs_input_grad[0] else None
            return dg, (grad * F.silu(g) if ctx.needs_input_grad[1] else None)
        if _fusable(g, u) and grad.shape == g.shape:
            return fused.silu_mul_backward(grad, g, u, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        if ctx.needs_input_grad[0]:
            dg = grad * u
            torch.ops.aten.silu_backward.grad_input(dg, g, grad_input=dg)
        if ctx.needs_input_grad[1]:
            du = F.silu(g).mul_(grad)
        return dg, du


def _fusable(g: torch.Tensor, u: torch.Tensor) -> bool:
    """The fused kernels take this pair: on CUDA (``QERL_FUSED`` not 0), same shape and 16/32-bit dtype,
    rows of unit column stride (g and u may be the halves of one gate/up output)."""
    return (fused._on(g) and g.shape == u.shape and g.dtype == u.dtype and g.dtype in _KERNEL_DTYPES
            and g.stride(-1) == 1 and u.stride(-1) == 1)


_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the kernels compute in fp32: not fp64


def silu_mul(g: torch.Tensor, u: torch.Tensor, dg: torch.Tensor | None = None, du: torch.Tensor | None = None,
             korder: bool = False):
    """``F.silu(g) * u``; under autograd it saves only g and u; outside it on CUDA, one fused kernel.
    ``dg``, ``du``: deferred LoRA terms of the gate/up GEMM, ``silu(g + dg) * (u + du)`` (engine only).
    ``korder`` (inference): the output's columns in the MMA's K order (``fused.silu_mul``)."""
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        if korder:
            raise ValueError("korder is an inference path: no autograd through it")
        return _SiluMul.apply(g, u)
    if _fusable(g, u):  # (autograd wants nothing here: returned above otherwise)
        return fused.silu_mul(g, u, dg, du, korder=korder)
    if dg is not None:
        g, u = g + dg, u + du
    y = F.silu(g) * u
    if korder:
        from qerl_kernels.korder import to_k_order

        y = to_k_order(y)
    return y


def swiglu_epilogue(gate_up, x: torch.Tensor, x_korder: bool = False, y_korder: bool = False) -> torch.Tensor | None:
    """``silu(gate) * up`` straight out of a fused gate/up GEMM (``QLinear.swiglu``: NVFP4 on sm_90,
    one launch fewer per layer; the same bits except where a launch halves its last tiles:
    ``gemm_fwd.nvfp4_swiglu``), or None: fused kernels off (``QERL_FUSED=0``, or
    autograd needs the op), ``QERL_SWIGLU_EPILOGUE=0``, or a GEMM that cannot pair. ``x_korder``,
    ``y_korder``: input, output in the MMA's K order (``QLinear.takes_korder_x``)."""
    if os.environ.get("QERL_SWIGLU_EPILOGUE", "1") == "0" or not fused.enabled(x):
        return None
    return gate_up.swiglu(x, x_korder, y_korder)
