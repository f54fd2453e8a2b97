"""RMSNorm with an Adaptive Quantization Noise slot.

AQN folds channel-wise Gaussian noise into the norm weight: ``y = (w_clean + Z) * x / rms(x)``.
``noise`` is a separate fp32 buffer that is *overwritten* (``copy_``) for each step and never added
into ``weight``, so the clean weight cannot drift and a CUDA graph captured once sees every new
noise vector. The scale multiply runs in fp32 and rounds once: in bf16, ``w + Z`` with ``w ~ 1`` and
``sigma = 1e-4`` would round the noise away entirely (bf16 spacing near 1 is 2^-7).
"""

from __future__ import annotations

import torch
from torch import nn

from qerl_cli.layers import fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, *, noise_slot: bool = False, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype), requires_grad=False)
        self.noise_slot = noise_slot
        if noise_slot:
            self.register_buffer("noise", torch.zeros(dim, dtype=torch.float32, device=device), persistent=False)
        else:
            self.noise = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, delta: torch.Tensor | None = None):
        """norm(x), or with ``residual``: (norm(x + residual), x + residual), the residual in x's dtype.
        ``delta``: a term to add to x first (rounded to x's dtype), the producing GEMM's deferred LoRA term."""
        if fused.enabled(x, residual, self.weight):
            return fused.rmsnorm(x, self._as_used(x.dtype), self.noise, self.eps, residual, delta=delta)
        if delta is None and fused.trainable(x, residual, self.weight):
            return _RMSNormFn.apply(x, residual, self.weight, self._as_used(x.dtype), self.noise, self.eps)
        return self._torch(x, residual, delta)

    def _as_used(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as the forward uses it: an fp32 master that trains (--train-norms in bf16/fp16)
        rounded to the activations' dtype, as the rollout loads it (``_torch`` does the same with the
        gradient passing through). The fused kernel runs without grad, e.g. a checkpointed layer's first
        forward, which had used the fp32 values there while its recompute used the rounded ones."""
        w = self.weight
        return w.detach().to(dtype) if w.requires_grad and w.dtype != dtype else w

    def with_shrink(self, x: torch.Tensor, residual: torch.Tensor | None, lora_a: torch.Tensor | None,
                    delta: torch.Tensor | None = None, korder: bool = False):
        """(normed, residual or None, ``normed @ lora_a^T`` or None): the LoRA shrink of the next GEMM from
        the norm's own launch where the fused kernel runs (``fused.rmsnorm``), else None (the caller
        shrinks). ``lora_a`` None: plain norm. ``delta`` as in ``forward``. ``korder``: normed columns in
        the MMA's K order for the next GEMM (``QLinear.takes_korder_x``; fused kernel only)."""
        if (lora_a is not None or korder) and fused.enabled(x, residual, self.weight):
            out = fused.rmsnorm(x, self._as_used(x.dtype), self.noise, self.eps, residual, lora_a=lora_a,
                                delta=delta, korder=korder)
            if lora_a is not None:
                return out
        elif korder:
            raise ValueError("korder needs the fused norm kernel (CUDA, no autograd, QERL_FUSED on)")
        else:
            out = self(x, residual, delta)
        return (out, None, None) if residual is None else (*out, None)

    def _torch(self, x: torch.Tensor, residual: torch.Tensor | None, delta: torch.Tensor | None = None):
        if delta is not None:
            x = x + delta
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight
        if w.requires_grad and w.dtype != dtype:
            # An fp32 master (train-step --train-norms in bf16/fp16) acts as the copy the rollout holds,
            # rounded to the activations' dtype (load_model), so both stages run one policy; its gradient
            # passes straight through to the master, which keeps the steps bf16 would round away.
            w = w + (w.to(dtype).float() - w).detach()
        w = w.float()
        if self.noise is not None:
            w = w + self.noise
        y = (h * w).to(dtype)
        return y if residual is None else (y, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, noise_slot={self.noise_slot}"


class _RMSNormFn(torch.autograd.Function):
    """The fused norm under autograd (training's recomputed forward and its backward): one Triton pass
    each way, where torch runs ~8 elementwise kernels forward and ~10 back over fp32 copies of the rows;
    the forward is the inference kernel's, so a checkpointed layer's recompute gives its first forward's
    bits (the backward adds the returned residual's gradient in fp32 and rounds once, where autograd's
    sum rounds twice: in 16-bit, checkpointed and plain gradients agree to that rounding, not bit for
    bit). ``weight`` is the parameter (it gets the gradient, straight through to an fp32 master);
    ``used`` the copy the forward multiplies by (``RMSNorm._as_used``). Returns y, or (y, x + residual)."""

    @staticmethod
    def forward(ctx, x, residual, weight, used, noise, eps):
        out = fused.rmsnorm(x, used, noise, eps, residual)
        s = x if residual is None else out[1]
        ctx.save_for_backward(s, used, noise if noise is not None else used)
        ctx.eps, ctx.has_noise, ctx.has_res, ctx.w_dtype = eps, noise is not None, residual is not None, weight.dtype
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None, not a tensor of zeros
        return out

    @staticmethod
    def backward(ctx, dy, ds_out=None):
        s, used, noise = ctx.saved_tensors
        noise = noise if ctx.has_noise else None
        w_grad = ctx.needs_input_grad[2] and dy is not None  # only the residual used: no weight gradient
        if dy is None:
            dy = torch.zeros_like(s)
        if torch.is_grad_enabled():  # a double backward (create_graph): the same gradient in torch ops
            ds, dw = _rmsnorm_grad(s, used, noise, ctx.eps, dy, ds_out, w_grad)
        else:  # the kernel's output has no autograd history, which a second order would drop silently
            ds, dw = fused.rmsnorm_backward(s, used, noise, ctx.eps, dy, ds_out, w_grad)
        return ds, (ds if ctx.has_res else None), (dw.to(ctx.w_dtype) if w_grad else None), None, None, None


def _rmsnorm_grad(s, used, noise, eps, dy, dres, w_grad):
    """``fused.rmsnorm_backward`` in differentiable torch ops (through ``s`` and ``dy``; ``used`` is the
    weight as the forward multiplied by it, a detached copy for an fp32 master)."""
    h = s.float()
    r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    xh = h * r
    w = used.float() if noise is None else used.float() + noise
    g = dy.float() * w
    ds = r * (g - xh * (g * xh).mean(-1, keepdim=True))
    if dres is not None:
        ds = ds + dres.float()
    dw = (dy.float() * xh).reshape(-1, s.shape[-1]).sum(0) if w_grad else None
    return ds.to(s.dtype), dw
