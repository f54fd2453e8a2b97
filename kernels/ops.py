"""Dispatch for NVFP4 linear algebra: Triton kernels on CUDA, the torch reference elsewhere.

``nvfp4_linear(x, w, bias)`` is differentiable with respect to ``x`` and ``bias`` (the base
weight is frozen; LoRA trains around it), so training backpropagates through the quantized base
without ever materialising a dequantized copy of the model: on CUDA the forward is
``gemm_fwd.nvfp4_matmul`` (bias fused into its epilogue) and the backward's grad-input is
``gemm_bwd.nvfp4_matmul_grad_input``, both decoding the on-disk layout in registers.

Dispatch rule: CUDA tensors in bf16/fp16 take the Triton kernels; fp32 activations on CUDA take
the reference (dequantize + cuBLAS fp32: exact, and fp32 models are for tests, not speed); CPU
always takes the reference. ``QERL_KERNELS=reference`` forces the reference everywhere (debugging);
``QERL_KERNELS=triton`` forces the kernels for any device and dtype (with ``TRITON_INTERPRET=1``
that runs them on CPU, which is how the CPU test suite checks them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from qerl_kernels import reference


@dataclass
class NVFP4Weight:
    """One quantized Linear weight: [N, K/2] uint8 codes, [N, K/16] e4m3 scales, fp32 [1] global.

    ``twiddled``: the codes are in ``twiddle.py``'s load-time bit layout (the sm_90 decode's), not
    the on-disk one; every consumer here reads either, and ``ondisk_packed()`` restores the file's.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    twiddled: bool = False
    blocked: bool = False  # twiddled and stored in 1 KB blocks (twiddle.block); implies twiddled
    # Where the reference path runs (CPU), keep the dequantized weight between calls instead of decoding
    # it on every call (``dense``): the owner opts in where the copy fits its memory.
    keep_dense: bool = False
    _dense: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 2

    def ondisk_packed(self) -> torch.Tensor:
        return _ondisk(self.packed, self.twiddled, self.blocked)

    def dequantize(self, dtype=torch.bfloat16) -> torch.Tensor:
        return reference.dequantize(self.ondisk_packed(), self.scale, self.global_scale, dtype)

    def dense(self, dtype) -> torch.Tensor:
        """The dequantized weight in ``dtype``, kept until the codes or scales change in place (their
        version counters; a write through ``.data`` bumps none and is not seen) or another dtype is asked
        for. Made outside inference mode, so a cache filled by the engine still serves autograd. Buffers
        made in inference mode have no version counter: decoded on every call."""
        if any(t.is_inference() for t in (self.packed, self.scale, self.global_scale)):
            return self.dequantize(dtype)  # no version counter to tell an in-place change by: decode each call
        key = (dtype, self.packed.device, self.packed._version, self.scale._version, self.global_scale._version)
        if self._dense is None or self._dense[0] != key:
            self._dense = None  # the old copy is freed before the new one is made
            with torch.inference_mode(False), torch.no_grad():
                self._dense = (key, self.dequantize(dtype))
        return self._dense[1]

    def __getstate__(self):
        # pickling / deepcopy: the dequantized copy is a cache (4-8x the codes' size), not state
        return {**self.__dict__, "_dense": None}

    def to(self, device) -> NVFP4Weight:
        return NVFP4Weight(self.packed.to(device), self.scale.to(device), self.global_scale.to(device), self.twiddled,
                           self.blocked)


KERNEL_MODES = ("auto", "reference", "triton")


def kernels_mode_error(device: torch.device) -> str | None:
    """Why ``QERL_KERNELS`` cannot run NVFP4 layers on ``device``, or None. Unset or empty is ``auto``."""
    mode = os.environ.get("QERL_KERNELS") or "auto"
    if mode not in KERNEL_MODES:  # a typo ("refernce") silently ran the kernels being debugged
        return f"QERL_KERNELS={mode!r}: expected one of {', '.join(KERNEL_MODES)}"
    if mode == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"QERL_KERNELS=triton on {device.type} needs TRITON_INTERPRET=1 (Triton's CPU interpreter; "
                "without it Triton finds no GPU driver)")
    return None


def _kernels_mode(x: torch.Tensor) -> str:
    why = kernels_mode_error(x.device)
    if why is not None:
        raise ValueError(why)
    return os.environ.get("QERL_KERNELS") or "auto"


def _use_triton(x: torch.Tensor) -> bool:
    mode = _kernels_mode(x)
    if mode == "triton":  # forced: any device (the CPU interpreter tests use this), any dtype they take
        return x.dtype in reference.ACTIVATION_DTYPES
    return mode != "reference" and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def _ondisk(packed, twiddled, blocked=False):
    if not twiddled:
        return packed
    from qerl_kernels.twiddle import from_kernel_layout

    return from_kernel_layout(packed, blocked)


def _forward(x2d, packed, scale, global_scale, bias, layout):
    if _use_triton(x2d):
        from qerl_kernels.gemm_fwd import nvfp4_matmul

        return nvfp4_matmul(x2d, packed, scale, global_scale, bias=bias, twiddled=layout[0], blocked=layout[1])
    return reference.linear(x2d, _ondisk(packed, *layout), scale, global_scale, bias)


def _grad_input(gy, packed, scale, global_scale, layout):
    if _use_triton(gy):
        from qerl_kernels.gemm_bwd import nvfp4_matmul_grad_input

        return nvfp4_matmul_grad_input(gy, packed, scale, global_scale, twiddled=layout[0], blocked=layout[1])
    return gy @ reference.dequantize(_ondisk(packed, *layout), scale, global_scale, dtype=gy.dtype)


class _NVFP4LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, packed, scale, global_scale, bias, layout):
        ctx.save_for_backward(packed, scale, global_scale)
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.layout = layout
        return _forward(x2d, packed, scale, global_scale, bias, layout)

    @staticmethod
    def backward(ctx, grad_out):
        packed, scale, global_scale = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        gx = None
        if ctx.needs_input_grad[0]:
            gx = _NVFP4GradInputFn.apply(grad_out, packed, scale, global_scale, ctx.layout)
        gb = None
        if ctx.has_bias and ctx.needs_input_grad[4]:
            # fp32 at least: an fp64 bias gets an fp64 sum
            gb = grad_out.sum(0, dtype=torch.promote_types(grad_out.dtype, torch.float32)).to(ctx.bias_dtype)
        return gx, None, None, None, gb, None


class _NVFP4GradInputFn(torch.autograd.Function):
    """gy @ dequant(W) as a differentiable op, so a double backward (a gradient penalty) sees the
    grad-input term: the kernels' output has no autograd history, and would drop it silently."""

    @staticmethod
    def forward(ctx, gy, packed, scale, global_scale, layout):
        ctx.save_for_backward(packed, scale, global_scale)
        ctx.layout = layout
        return _grad_input(gy, packed, scale, global_scale, layout)

    @staticmethod
    def backward(ctx, ggx):
        packed, scale, global_scale = ctx.saved_tensors
        ggy = None
        if ctx.needs_input_grad[0]:  # d(gy W)/d(gy) . ggx = ggx W^T: the forward again, itself differentiable
            ggy = _NVFP4LinearFn.apply(ggx.contiguous(), packed, scale, global_scale, None, ctx.layout)
        return ggy, None, None, None, None


def nvfp4_linear(x: torch.Tensor, w: NVFP4Weight, bias: torch.Tensor | None = None,
                 x_korder: bool = False) -> torch.Tensor:
    """y = x @ dequant(w)^T (+ bias), any leading dims on x; gradients flow to x and bias, never to w.
    ``x_korder`` (inference): x's columns are in the MMA's K order (``takes_korder_x``)."""
    _, k = reference.check_linear(x, w.packed, w.scale, bias)
    lead = x.shape[:-1]
    if x_korder:
        from qerl_kernels.gemm_fwd import natural_order, nvfp4_matmul

        if torch.is_grad_enabled() and x.requires_grad:
            raise ValueError("x_korder is an inference path: no autograd through it")
        x2 = x.reshape(-1, k)
        if _use_triton(x2) and x2.is_cuda:
            y = nvfp4_matmul(x2, w.packed, w.scale, w.global_scale, bias=bias, twiddled=w.twiddled, blocked=w.blocked,
                             x_korder=True)
            return y.reshape(*lead, w.out_features)
        x = natural_order(x2).reshape(x.shape)
    if w.keep_dense and not _use_triton(x):  # the reference path's numbers, without decoding every call
        return torch.nn.functional.linear(x, w.dense(x.dtype), bias)
    y = _NVFP4LinearFn.apply(x.reshape(-1, k), w.packed, w.scale, w.global_scale, bias, (w.twiddled, w.blocked))
    # 2-D x: the kernel's own tensor, not a view of it (a view cannot be added into in place under
    # autograd, which cost NVFP4's LoRA term a copy of the output per projection in training)
    return y if x.dim() == 2 else y.reshape(*lead, w.out_features)


def nvfp4_grad_input(gy: torch.Tensor, w: NVFP4Weight) -> torch.Tensor:
    """``gy @ dequant(w)``, [M, N] -> [M, K]: ``nvfp4_linear``'s gradient for its input, itself
    differentiable (a double backward sees it), for a caller writing its own backward around the base.
    Any leading dims on gy, as ``nvfp4_linear``'s x; checked as its x is (dtype, width)."""
    n, k = reference.check_weight(w.packed, w.scale)
    dtypes = (*reference.ACTIVATION_DTYPES, torch.float64)
    if gy.dtype not in dtypes:
        raise ValueError(f"gy must be one of {', '.join(str(d) for d in dtypes)}, got {gy.dtype}")
    if gy.dim() == 0 or gy.shape[-1] != n:
        raise ValueError(f"gy has {gy.shape[-1] if gy.dim() else 0} output features, the NVFP4 weight has {n}")
    if w.keep_dense and not _use_triton(gy):
        return gy @ w.dense(gy.dtype)
    gx = _NVFP4GradInputFn.apply(gy.reshape(-1, n).contiguous(), w.packed, w.scale, w.global_scale,
                                 (w.twiddled, w.blocked))
    return gx if gy.dim() == 2 else gx.reshape(*gy.shape[:-1], k)


def nvfp4_swiglu(x: torch.Tensor, w: NVFP4Weight, x_korder: bool = False, y_korder: bool = False) -> torch.Tensor | None:
    """``silu(x @ G^T) * (x @ U^T)`` for ``w`` stacking gate G over up U, in one GEMM
    (``gemm_fwd.nvfp4_swiglu``: the GEMM followed by SwiGLU, bit for bit outside halved launches), or None where that kernel
    cannot run the call: the reference path (CPU), autograd (training saves gate and up), a layout or
    tile that cannot pair. Inference only; the caller falls back to ``nvfp4_linear`` + its SwiGLU.
    ``x_korder``, ``y_korder``: input, output columns in the MMA's K order (``gemm_fwd.nvfp4_swiglu``)."""
    k = w.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the NVFP4 weight expects {k}")
    if not _use_triton(x) or not x.is_cuda or (torch.is_grad_enabled() and x.requires_grad):
        return None
    from qerl_kernels.gemm_fwd import nvfp4_swiglu as _swiglu

    y = _swiglu(x.reshape(-1, k), w.packed, w.scale, w.global_scale, twiddled=w.twiddled, blocked=w.blocked,
                x_korder=x_korder, y_korder=y_korder)
    return None if y is None else y.reshape(*x.shape[:-1], w.out_features // 2)


def nvfp4_qkv_rope(x: torch.Tensor, w: NVFP4Weight, bias: torch.Tensor | None, rope,
                   x_korder: bool = False) -> torch.Tensor | None:
    """The fused q/k/v GEMM with rotary + cache write in its epilogue (``gemm_fwd.nvfp4_qkv_rope``;
    ``rope`` a ``gemm_gluon.RopeEpilogue``), or None where it cannot run (as ``nvfp4_swiglu``)."""
    k = w.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the NVFP4 weight expects {k}")
    if not _use_triton(x) or not x.is_cuda or (torch.is_grad_enabled() and x.requires_grad):
        return None
    from qerl_kernels.gemm_fwd import nvfp4_qkv_rope as _qkv_rope

    y = _qkv_rope(x.reshape(-1, k), w.packed, w.scale, w.global_scale, bias, rope, twiddled=w.twiddled,
                  blocked=w.blocked, x_korder=x_korder)
    return None if y is None else y.reshape(*x.shape[:-1], w.out_features)


def takes_korder_x(w: NVFP4Weight, m: int, device: torch.device) -> bool:
    """Whether this weight's GEMM at ``m`` rows runs a TMA-fed tile, which saves its X permutation pass
    when the kernel producing X writes it in the MMA's K order (``gemm_fwd.takes_korder_x``)."""
    if os.environ.get("QERL_KORDER_X", "1") == "0" or os.environ.get("QERL_KERNELS", "auto") != "auto":
        return False
    from qerl_kernels.gemm_fwd import takes_korder_x as _takes

    return _takes(m, w.out_features, w.in_features, device, w.twiddled, w.blocked)
