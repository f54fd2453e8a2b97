"""Grouped-query attention with two paths: training (whole sequences) and cached (engine).

Trade-off: the training path is a single causal SDPA call over right-padded sequences (padding at
the end cannot leak into earlier positions under a causal mask, so no mask tensor is built and
PyTorch picks its fused kernel). The cached path reads a *forward context* set by the engine
(nano-vllm style): prefill writes the prompt's K/V into the paged cache and attends within the
prompt; decode writes one token per sequence and attends over the sequence's blocks through
``paged_decode_attention`` (Triton on CUDA, a gather + SDPA fallback elsewhere). Keeping the context
global rather than threading it through every call lets a CUDA graph capture the decode step with
its input tensors fixed.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from qerl_cli.layers.context import ForwardContext, get_context, set_context  # noqa: F401 (re-exported)
from qerl_cli.layers.linear import QLinear, fuse_linears
from qerl_cli.layers.lora import GroupedLoRA, LoRALinear
from qerl_cli.layers.norm import RMSNorm
from qerl_cli.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int, rotary: RotaryEmbedding, quantized: dict, device=None, dtype=None):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.scale = d**-0.5
        kw = dict(device=device, dtype=dtype)
        self.q_proj = QLinear(h, cfg.num_heads * d, bias=cfg.qkv_bias, quantized=quantized.get("q_proj", False), **kw)
        self.k_proj = QLinear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, quantized=quantized.get("k_proj", False), **kw)
        self.v_proj = QLinear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, quantized=quantized.get("v_proj", False), **kw)
        self.o_proj = QLinear(cfg.num_heads * d, h, bias=cfg.o_bias, quantized=quantized.get("o_proj", False), **kw)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, **kw)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, **kw)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = [rotary]  # a list so the shared module is not registered once per layer
        # Inference-only fused q/k/v GEMM (see fuse_projections); a list so it is not a registered submodule.
        self._qkv: list[QLinear] = []
        self._qkv_lora: GroupedLoRA | None = None  # the q/k/v LoRA terms in two kernels (see group_lora)
        # Set by the engine: this layer's views into the paged cache, [num_blocks, block, Hk, D] each.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def korder_input(self, x: torch.Tensor) -> bool:
        """Whether this layer's input norm should write x in the MMA's K order: the fused q/k/v GEMM is
        NVFP4 on a TMA-fed tile for x's rows (``QLinear.takes_korder_x``), and any LoRA reading x is the
        grouped one with its A in K order (``GroupedLoRA.takes_korder``)."""
        if not self._qkv or not korder_lora_ok(self._qkv_lora, (self.q_proj, self.k_proj, self.v_proj), x):
            return False
        return self._qkv[0].takes_korder_x(x)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, lora_t: torch.Tensor | None = None,
                defer: bool = False, x_korder: bool = False):
        """``lora_t``: x @ A^T of the q/k/v ``GroupedLoRA`` when the norm kernel computed it (``shrink_source``).
        ``defer``: return (o_proj's base output, its LoRA term or None) for the next norm to add.
        ``x_korder``: x's columns are in the MMA's K order (``korder_input`` said so to the norm)."""
        b, s, _ = x.shape
        ctx = get_context()
        cached = ctx is not None and self.k_cache is not None
        delta = None  # the q/k/v LoRA terms, when the rotary + cache write adds them (run_deferred)
        rotated = False  # q, k rotated and k, v cached by the GEMM's epilogue (RotaryEmbedding.gemm_epilogue)
        if self._qkv:
            nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            fused, grouped = self._qkv[0], self._qkv_lora
            if grouped is not None and (lora_t is not None or grouped.active(x)):
                pair = grouped.run_deferred(fused, x, lora_t, x_korder) if cached and self.q_norm is None else None
                if pair is not None:
                    q, k, v = pair[0].split([nq, nk, nk], dim=-1)
                    delta = [t.view(b, s, -1, self.head_dim) for t in pair[1].split([nq, nk, nk], dim=-1)]
                else:
                    q, k, v = grouped.run(fused, x, lora_t, x_korder).split([nq, nk, nk], dim=-1)
            else:
                if x_korder and any(map(lora_enabled, (self.q_proj, self.k_proj, self.v_proj))):
                    raise ValueError("x in K order with a per-part LoRA (korder_input says no to that)")
                y = None
                if cached and self.q_norm is None and not any(map(lora_enabled, (self.q_proj, self.k_proj, self.v_proj))):
                    y = self.rotary[0].gemm_epilogue(fused, x, positions, self.k_cache, self.v_cache,
                                                     ctx.slot_mapping, nq, nk, x_korder)
                rotated = y is not None
                if not rotated:
                    y = fused(x, x_korder=x_korder)
                q, k, v = y.split([nq, nk, nk], dim=-1)
                q, k, v = add_lora(self.q_proj, x, q), add_lora(self.k_proj, x, k), add_lora(self.v_proj, x, v)
        else:
            if x_korder:
                raise ValueError("x in K order needs the fused q/k/v GEMM")
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, s, self.num_heads, self.head_dim)
        k = k.view(b, s, self.num_kv_heads, self.head_dim)
        v = v.view(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cached and not rotated:
            q, k, v = self.rotary[0].rotate_and_cache(positions, q, k, v, self.k_cache, self.v_cache, ctx.slot_mapping,
                                                      delta)
        elif not cached:
            q, k = self.rotary[0](positions, q, k)
        if ctx is None or ctx.is_prefill:
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            ).transpose(1, 2)
        else:
            from qerl_cli.layers.paged_attention import paged_decode_attention

            lora = lora_enabled(self.o_proj)
            korder = (defer and self.o_proj.takes_korder(x)) if lora else base_of(self.o_proj).takes_korder_x(x)
            o = paged_decode_attention(q.view(b, self.num_heads, self.head_dim), self.k_cache, self.v_cache,
                                       ctx.block_tables, ctx.context_lens, self.scale, ctx.max_context_len, korder=korder)
            if korder:  # o's columns are where o_proj's TMA-fed tile reads them: no permutation pass there
                o = o.reshape(b, s, self.num_heads * self.head_dim)
                if lora:
                    return self.o_proj.forward_deferred(o, x_korder=True)
                y = base_of(self.o_proj)(o, x_korder=True)
                return (y, None) if defer else y
        o = o.reshape(b, s, self.num_heads * self.head_dim)
        return deferred(self.o_proj, o) if defer else self.o_proj(o)


def base_of(m):
    return m.base if isinstance(m, LoRALinear) else m


def deferred(m, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(m's base output, m's LoRA term or None): ``LoRALinear.forward_deferred`` where m has an adapter."""
    return m.forward_deferred(x) if isinstance(m, LoRALinear) else (m(x), None)


def lora_enabled(m) -> bool:
    return isinstance(m, LoRALinear) and m.enabled


def korder_lora_ok(grouped: GroupedLoRA | None, parts, x: torch.Tensor) -> bool:
    """Whether the LoRA terms of a fused GEMM's parts can read x in K order: none is enabled and no group
    is in place, or the group takes K order (``GroupedLoRA.takes_korder``) and so runs them all."""
    if grouped is None and not any(map(lora_enabled, parts)):
        return True
    return grouped is not None and grouped.takes_korder(x)


def add_lora(m, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y (the base output of ``m``) plus m's LoRA term when ``m`` is an enabled LoRALinear."""
    if lora_enabled(m):
        return m.add_delta(x, y)
    return y


def fuse_projections(model) -> int:
    """Give every layer a fused q/k/v and gate/up GEMM for inference; returns how many were fused.

    The per-projection modules stay (they now view slices of the fused tensors), so LoRA, adapters
    and training are unaffected; in-place updates (``copy_``) of a part reach the fused GEMM. Moving the
    model to another device or *replacing* a part's tensor afterwards unshares the views: fuse after
    the final ``.to()`` and update weights in place.
    """
    count = 0
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        if not a._qkv:
            f = fuse_linears([base_of(a.q_proj), base_of(a.k_proj), base_of(a.v_proj)])
            if f is not None:
                a._qkv.append(f)
                count += 1
        if not m._gate_up:
            f = fuse_linears([base_of(m.gate_proj), base_of(m.up_proj)])
            if f is not None:
                m._gate_up.append(f)
                count += 1
    return count


def group_lora(model, dtype: torch.dtype) -> int:
    """Give every fused q/k/v and gate/up GEMM a ``GroupedLoRA`` for its parts' adapters; returns how many
    groups are in place. Call after ``fuse_projections`` and after the LoRA inference copies exist
    (``refresh_inference_copies``); a group that is still valid is kept, so calling again after an
    in-place refresh changes nothing (CUDA graphs keep reading the same tensors). ``QERL_LORA_GROUPED=0``
    turns grouping off (the per-part path: two kernels per LoRA projection)."""
    off = os.environ.get("QERL_LORA_GROUPED", "1") == "0"
    count = 0
    for layer in model.model.layers:
        for owner, fused, attr, names in ((layer.self_attn, "_qkv", "_qkv_lora", ("q_proj", "k_proj", "v_proj")),
                                          (layer.mlp, "_gate_up", "_gate_up_lora", ("gate_proj", "up_proj"))):
            if not getattr(owner, fused):
                continue
            g = getattr(owner, attr)
            if off:
                g = None
            elif g is None or not g.valid():
                g = GroupedLoRA.build([getattr(owner, n) for n in names], dtype)
            setattr(owner, attr, g)
            count += g is not None
    return count
