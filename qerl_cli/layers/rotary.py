"""Rotary position embedding (rotate-half convention of Llama/Qwen/Mistral).

cos/sin for every position up to ``max_positions`` are precomputed once in fp32 (a few MB) so the
decode step only gathers rows, which keeps it CUDA-graph friendly. Supports the rope types these
model families ship with: default, linear and llama3 (Llama 3.1+ frequency smoothing).
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from qerl_cli.layers import fused


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wl, high_wl = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(medium, smoothed, out)
    raise ValueError(f"unsupported rope_type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None, device=None):
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        device = torch.empty(0, device=device).device  # None: the default device, or a torch.device context's
        if device.type == "meta":  # a model built on meta: ``reset`` makes the real table
            table = torch.empty(max_positions, head_dim, device=device)
        else:
            table = self._table(device)
        self.register_buffer("cos_sin", table, persistent=False)

    def _table(self, device) -> torch.Tensor:
        with torch.device("cpu"):  # math on meta tensors would go through torch._refs, which imports torch._dynamo
            inv = rope_inv_freq(self.head_dim, self.theta, self.scaling)
            t = torch.arange(self.max_positions, dtype=torch.float32)
            freqs = torch.outer(t, inv)
            table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, head_dim]
        return table.to(device)

    def reset(self, device) -> None:
        self.cos_sin = self._table(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [..., Hq, D], k [..., Hk, D], positions [...] -> rotated (q, k) in their dtype.

        Outside autograd on CUDA this rotates in place with one fused kernel (see layers/fused.py).
        """
        if self._fusable(q, k) and positions_ok(q, k, positions):
            return fused.rope_(q, k, positions, self.cos_sin)
        if self._trainable(q, k, positions):
            return _RopeFn.apply(q, k, positions, self.cos_sin, self._cos_neg_sin())
        return _rot_torch(q, k, positions, self.cos_sin)

    def rotate_and_cache(self, positions, q, k, v, k_cache, v_cache, slots, delta=None):
        """``forward`` plus writing each token's rotated k and its v into cache row ``slots[i]`` of
        ``k_cache`` / ``v_cache`` [blocks, block_size, Hk, D]: one fused kernel where ``forward``'s is
        used (the rotation's launch also does the cache write), else rotation + two ``index_copy_``.
        ``delta`` (dq, dk, dv), shaped like q, k, v: added to them first (a deferred LoRA term).
        Returns (q, k, v)."""
        if self._fusable(q, k, v) and fused.rope_ok(v) and k_cache.is_contiguous() and v_cache.is_contiguous():
            q, k = fused.rope_(q, k, positions, self.cos_sin, cache=(v, k_cache, v_cache, slots), delta=delta)
            return q, k, v
        if delta is not None:
            q, k, v = q + delta[0], k + delta[1], v + delta[2]
        q, k = self(positions, q, k)
        hk, d = k.shape[-2:]
        k_cache.view(-1, hk, d).index_copy_(0, slots, k.reshape(-1, hk, d))
        v_cache.view(-1, hk, d).index_copy_(0, slots, v.reshape(-1, hk, d))
        return q, k, v

    def gemm_epilogue(self, qkv, x, positions, k_cache, v_cache, slots, nq: int, nk: int,
                      x_korder: bool = False) -> torch.Tensor | None:
        """The fused q/k/v GEMM ``qkv`` on x with this rotation and the cache write in its epilogue
        (``QLinear.qkv_rope``: NVFP4 on sm_90, one launch fewer per layer than the GEMM followed by
        ``rotate_and_cache``), or None: fused kernels off (``QERL_FUSED=0``, or autograd needs the op),
        ``QERL_ROPE_EPILOGUE=0``, or a GEMM that cannot pair."""
        if os.environ.get("QERL_ROPE_EPILOGUE", "1") == "0" or not fused.enabled(x) or x.dtype != k_cache.dtype:
            return None
        from qerl_kernels.gemm_gluon import RopeEpilogue

        rope = RopeEpilogue(positions.reshape(-1), self.cos_sin, slots.reshape(-1), k_cache, v_cache, nq, nk,
                            self.head_dim)
        return qkv.qkv_rope(x, rope, x_korder)

    def _trainable(self, q, k, positions) -> bool:
        """The fused rotation under autograd (``_RopeFn``): training's q and k on CUDA in 16-bit."""
        return (fused.trainable(q, k) and self.head_dim in (32, 64, 128, 256) and q.dtype == k.dtype
                and q.dtype in (torch.bfloat16, torch.float16) and positions_ok(q, k, positions)
                and os.environ.get("QERL_TRAIN_ROPE", "1") != "0")

    def _cos_neg_sin(self) -> torch.Tensor:
        """The table of the inverse rotation (sin negated): the backward of a rotation rotates back."""
        cs = self.cos_sin
        key = (cs.data_ptr(), cs.dtype, cs.device, cs._version)  # a new or re-cast table (reset, .to) makes a new one
        if getattr(self, "_neg_key", None) != key:
            half = self.head_dim // 2
            self._neg, self._neg_key = torch.cat([cs[:, :half], -cs[:, half:]], -1), key
        return self._neg

    def _fusable(self, q, k, v=None) -> bool:
        return (fused.enabled(q, k, v) and self.head_dim in (32, 64, 128, 256) and fused.rope_ok(q)
                and fused.rope_ok(k))


def _rot(x, cos, sin, half):
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _rot_torch(q, k, positions, table):
    """q and k rotated by ``table`` (cos | sin rows) at ``positions`` in torch ops (differentiable)."""
    half = table.shape[-1] // 2
    cs = table[positions]  # [..., D]
    cos = torch.cat([cs[..., :half], cs[..., :half]], -1).unsqueeze(-2).to(q.dtype)
    sin = torch.cat([cs[..., half:], cs[..., half:]], -1).unsqueeze(-2).to(q.dtype)
    return _rot(q, cos, sin, half), _rot(k, cos, sin, half)


def positions_ok(q, k, positions) -> bool:
    """The kernels' view: one position per row of q and k (``[L]`` against a batched ``[B, L, H, D]``
    broadcasts in torch but not there: the kernel read past the positions' end; a review)."""
    return (q.shape[:-2] == k.shape[:-2] and q.stride(-1) == 1 and k.stride(-1) == 1
            and positions.numel() == q.numel() // (q.shape[-1] * q.shape[-2]))


def _rotate(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, table: torch.Tensor):
    """q and k rotated by ``table`` (cos | sin rows) at ``positions``, into fresh tensors (the fused kernel
    rotates in place: a copy first, so autograd's inputs stay as they were)."""
    q, k = q.clone(memory_format=torch.contiguous_format), k.clone(memory_format=torch.contiguous_format)
    return fused.rope_(q, k, positions, table)


class _RopeFn(torch.autograd.Function):
    """Training's rotation of q and k in one Triton pass each way (``fused.rope_``, the inference kernel:
    fp32 math on the fp32 cos/sin table, rounded once, as the engine rotates, where the torch path rounds
    cos and sin to 16 bits and each of its five ops). The backward rotates the gradients back (sin
    negated). A double backward takes the torch ops."""

    @staticmethod
    def forward(ctx, q, k, positions, cos_sin, cos_neg_sin):
        ctx.save_for_backward(positions, cos_neg_sin)
        return _rotate(q, k, positions, cos_sin)

    @staticmethod
    def backward(ctx, dq, dk):
        positions, cos_neg_sin = ctx.saved_tensors
        rotate_back = _rot_torch if torch.is_grad_enabled() else _rotate  # a double backward: torch ops
        return (*rotate_back(dq, dk, positions, cos_neg_sin), None, None, None)
