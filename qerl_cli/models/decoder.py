"""The one decoder implementation (Llama / Mistral / Qwen2 / Qwen2.5 / Qwen3) used by rollout, train and eval.

Module names mirror Hugging Face's (``model.layers.{i}.self_attn.q_proj`` ...), so checkpoint keys,
compressed-tensors names and PEFT adapter keys map onto ``named_modules()`` without a table. The same
``forward`` serves training (no cache: ``forward_train``) and the engine (paged cache through the
attention forward context), so rollout and training run identical numerics, LoRA and AQN noise.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from qerl_cli.layers import lora
from qerl_cli.layers.activation import silu_mul, swiglu_epilogue
from qerl_cli.layers.attention import Attention, add_lora, base_of, deferred, korder_lora_ok, lora_enabled
from qerl_cli.layers.fused import enabled as fused_enabled
from qerl_cli.layers.linear import QLinear
from qerl_cli.layers.norm import RMSNorm
from qerl_cli.layers.rotary import RotaryEmbedding
from qerl_cli.models.config import ModelConfig
from qerl_cli.train.recompute import checkpoint

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, quantized: dict, device=None, dtype=None):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        kw = dict(device=device, dtype=dtype)
        self.gate_proj = QLinear(h, i, bias=b, quantized=quantized.get("gate_proj", False), **kw)
        self.up_proj = QLinear(h, i, bias=b, quantized=quantized.get("up_proj", False), **kw)
        self.down_proj = QLinear(i, h, bias=b, quantized=quantized.get("down_proj", False), **kw)
        self._gate_up: list[QLinear] = []  # inference-only fused GEMM (layers.attention.fuse_projections)
        self._gate_up_lora = None  # a GroupedLoRA for gate/up (layers.attention.group_lora)

    def korder_input(self, x: torch.Tensor) -> bool:
        """Whether the norm before this MLP should write x in the MMA's K order: the fused gate/up GEMM is
        NVFP4 on a TMA-fed tile for x's rows (``QLinear.takes_korder_x``), and any LoRA reading x is the
        grouped one with its A in K order (``GroupedLoRA.takes_korder``)."""
        if not self._gate_up or not korder_lora_ok(self._gate_up_lora, (self.gate_proj, self.up_proj), x):
            return False
        return self._gate_up[0].takes_korder_x(x)

    def forward(self, x: torch.Tensor, lora_t: torch.Tensor | None = None, defer: bool = False, x_korder: bool = False):
        """``lora_t``: x @ A^T of the gate/up ``GroupedLoRA`` when the norm kernel computed it. ``defer``:
        return (down_proj's base output, its LoRA term or None) for the next norm to add. ``x_korder``:
        x's columns are in the MMA's K order (``korder_input`` said so to the norm)."""
        dg = du = h = None  # gate/up's LoRA terms when SwiGLU adds them; h once SwiGLU ran
        # SwiGLU writes h in the MMA's K order where down_proj's TMA-fed tile reads it so (and its LoRA, if
        # any, has A in K order and runs beside the GEMM: LoRALinear.takes_korder).
        down_lora = lora_enabled(self.down_proj)
        yk = fused_enabled(x) and (defer and self.down_proj.takes_korder(x) if down_lora
                                   else base_of(self.down_proj).takes_korder_x(x))
        if self._gate_up:
            fused, grouped = self._gate_up[0], self._gate_up_lora
            if grouped is not None and (lora_t is not None or grouped.active(x)):
                # Over an NVFP4 gate/up only above NVFP4_GATE_UP_DEFER_ROWS (GroupedLoRA.run_deferred).
                rows = x.numel() // x.shape[-1]
                defer_gu = not fused.quantized or rows > lora.NVFP4_GATE_UP_DEFER_ROWS
                pair = grouped.run_deferred(fused, x, lora_t, x_korder) if defer_gu else None
                if pair is not None:
                    (g, u), (dg, du) = pair[0].chunk(2, dim=-1), pair[1].chunk(2, dim=-1)
                else:
                    g, u = grouped.run(fused, x, lora_t, x_korder).chunk(2, dim=-1)
            else:
                if not (lora_enabled(self.gate_proj) or lora_enabled(self.up_proj)):
                    h = swiglu_epilogue(fused, x, x_korder, yk)
                elif x_korder:
                    raise ValueError("x in K order with a per-part LoRA (korder_input says no to that)")
                if h is None:
                    g, u = fused(x, x_korder=x_korder).chunk(2, dim=-1)
                    g, u = add_lora(self.gate_proj, x, g), add_lora(self.up_proj, x, u)
        else:
            if x_korder:
                raise ValueError("x in K order needs the fused gate/up GEMM")
            g, u = self.gate_proj(x), self.up_proj(x)
        if h is None:
            h = silu_mul(g, u, dg, du, korder=yk)
        if yk:
            if down_lora:
                return self.down_proj.forward_deferred(h, x_korder=True)
            y = base_of(self.down_proj)(h, x_korder=True)
            return (y, None) if defer else y
        return deferred(self.down_proj, h) if defer else self.down_proj(h)


def shrink_source(grouped, x: torch.Tensor) -> torch.Tensor | None:
    """The A a norm should multiply its output by for the next fused GEMM's LoRA (None: the GEMM's own shrink)."""
    return None if grouped is None else grouped.shrink_source(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding, quantized: dict, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.self_attn = Attention(cfg, idx, rotary, quantized, **kw)
        self.mlp = MLP(cfg, quantized, **kw)
        # The two norms that feed Linears carry the AQN noise slot (q/k/v share one vector, gate/up the other).
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, noise_slot=True, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, noise_slot=True, **kw)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, residual: torch.Tensor | None,
                delta: torch.Tensor | None = None):
        """Residual-stream form (vLLM style): returns (mlp output, delta, residual); the next layer's norm
        adds them, ``delta`` (down_proj's LoRA term when computed beside its GEMM, else None) first.

        Same arithmetic as HF's ``x + attn(norm(x))`` / ``x + mlp(norm(x))`` (each add rounds to the model
        dtype), but lets the adds fuse into the following norm.
        """
        kq = fused_enabled(x) and self.self_attn.korder_input(x)  # norms write K order for TMA-fed GEMMs
        h, res, t = self.input_layernorm.with_shrink(x, residual, shrink_source(self.self_attn._qkv_lora, x), delta,
                                                     korder=kq)
        residual = x if residual is None else res
        h, d = self.self_attn(h, positions, t, defer=True, x_korder=kq)
        km = fused_enabled(h) and self.mlp.korder_input(h)
        h, residual, t = self.post_attention_layernorm.with_shrink(h, residual, shrink_source(self.mlp._gate_up_lora, h),
                                                                   d, korder=km)
        return *self.mlp(h, t, defer=True, x_korder=km), residual

    def forward_stream(self, s: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Residual stream in, residual stream out: the checkpointed training form of ``forward``.

        ``s`` is what ``forward`` would add up inside its first norm (the previous layer's mlp output +
        residual, or the embedding), and the result is this layer's mlp output + residual, added here
        instead of in the next layer's norm. Same operations in the same order, so the same bits (but for
        the fused norm's backward in 16-bit on CUDA: ``norm._RMSNormFn``); and a checkpoint around it saves
        one [tokens, hidden] tensor per layer instead of two.
        """
        h = self.input_layernorm(s)
        h = self.self_attn(h, positions)
        h, residual = self.post_attention_layernorm(h, s)
        return self.mlp(h) + residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, quantized: set[str], device=None, dtype=None, max_positions: int | None = None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        # Given its weight, Embedding skips its normal_ init: on the meta device that init imports
        # torch._dynamo (1.5 s on a CPU machine, more with CUDA), in every stage that builds a model.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, **kw))
        self.embed_tokens.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling, device=device)
        layers = []
        for i in range(cfg.num_layers):
            q = {n.rsplit(".", 1)[-1]: True for n in quantized if n.startswith(f"model.layers.{i}.")}
            layers.append(DecoderLayer(cfg, i, self.rotary, q, **kw))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)


class CausalLM(nn.Module):
    """``model.forward_train(ids, mask) -> hidden``; ``model.compute_logits(hidden) -> fp32 logits``."""

    def __init__(self, cfg: ModelConfig, quantized: set[str] = frozenset(), device=None, dtype=None,
                 max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, quantized, device, dtype, max_positions)
        self.lm_head = QLinear(cfg.hidden_size, cfg.vocab_size, device=device, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gradient_checkpointing = False
        self.keep_activations = 0  # under checkpointing: the last N layers keep their activations instead
        self.measure_kept = False  # set by --keep-activations auto: measure what the kept layers hold (CUDA)
        self.kept_bytes_per_layer: float | None = None  # measured by the last such forward
        self.activation_offload = None  # a qerl_cli.train.offload.ActivationOffloader (training only)
        self.is_quantized = bool(quantized)
        self.base_hash: str | None = None
        self.model_dir = None

    @property
    def device(self) -> torch.device:
        # the final norm's, not the embedding's: that table may live in CPU memory (embeddings_to_cpu)
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [B, L, H] for token ids [B, L] at the given positions [B, L].

        Under gradient checkpointing (training) each layer runs as ``forward_stream`` inside one
        checkpoint whose only saved input is the residual stream [B, L, H], but for the last
        ``keep_activations`` layers, which run the same ``forward_stream`` outside any checkpoint (their
        activations stay for the backward: no recompute, more memory; the same bits); with
        ``activation_offload`` set, that saved input waits in pinned CPU memory until the backward
        recomputes the layer (``qerl_cli.train.offload``). Otherwise (inference, the engine, no
        checkpointing) the (mlp output, residual) pair flows on and each add fuses into the next norm.
        """
        x = self.embed(input_ids)
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            off = self.activation_offload
            if off is not None:
                off.begin()
            recomputed = len(self.model.layers) - self.keep_activations
            before = None
            for i, layer in enumerate(self.model.layers):
                if i >= recomputed:  # kept: the same forward_stream, its activations saved by autograd
                    if before is None and self.measure_kept:
                        before = torch.cuda.memory_allocated(x.device)
                    x = layer.forward_stream(x, positions)
                    continue
                with off.hooks() if off is not None else nullcontext():
                    x = checkpoint(layer.forward_stream, x, positions)
            if before is not None:  # what --keep-activations auto sizes by (train/activation_budget.py)
                self.kept_bytes_per_layer = (torch.cuda.memory_allocated(x.device) - before) / self.keep_activations
            return self.model.norm(x)
        residual = delta = None
        for layer in self.model.layers:
            x, delta, residual = layer(x, positions, residual, delta)
        return self.model.norm(x, residual, delta)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings on the model's device. With the table in CPU memory (``embeddings_to_cpu``)
        the rows are gathered there into pinned memory and only [B, L, H] is copied over (the same
        bytes as a gather on the GPU); ``input_ids`` may then live on either device."""
        emb = self.model.embed_tokens
        dev = self.device
        if emb.weight.device == dev:
            return emb(input_ids)
        w = emb.weight
        ids = input_ids.to(w.device)
        rows = torch.empty((*ids.shape, w.shape[1]), dtype=w.dtype, pin_memory=dev.type == "cuda")
        torch.index_select(w, 0, ids.reshape(-1), out=rows.view(-1, w.shape[1]))
        return rows.to(dev, non_blocking=True)

    @property
    def embeddings_on_cpu(self) -> bool:
        """True when the input embedding table lives in CPU memory while the model runs elsewhere."""
        return self.model.embed_tokens.weight.device != self.device

    def embeddings_to_cpu(self) -> None:
        """Keep the frozen input embedding table in CPU memory: frees vocab x hidden x 2 bytes of GPU
        memory (1.1 GB on Qwen2.5-7B) for one [B, L, H] host gather + copy per forward. Refused
        (ValueError) for tied embeddings, whose table the lm_head needs on the GPU, and for a
        trainable table."""
        emb = self.model.embed_tokens
        if self.config.tie_word_embeddings or self.lm_head.weight is emb.weight:
            raise ValueError("the input embedding is tied to the lm_head (tie_word_embeddings), which needs it "
                             "on the model's device")
        if emb.weight.requires_grad:
            raise ValueError("the input embedding is trainable; only a frozen table can live in CPU memory")
        emb.weight.data = emb.weight.data.to("cpu")

    def forward_train(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Right-padded batch [B, L] -> hidden [B, L, H]; causal attention, no KV cache.

        Right padding needs no mask: under causal attention a pad at the end is never seen by an
        earlier position. Left padding would shift positions and leak pads, so it is rejected.
        """
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, L], got shape {tuple(input_ids.shape)}")
        b, seq = input_ids.shape
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
            m = attention_mask.to(torch.int8)
            if seq > 1 and bool((m[:, 1:] > m[:, :-1]).any()):
                raise ValueError("attention_mask must be right-padded (ones then zeros in every row)")
        if seq > self.model.rotary.max_positions:
            raise ValueError(f"sequence length {seq} exceeds the model's {self.model.rotary.max_positions} positions")
        if self.config.sliding_window and seq > self.config.sliding_window:
            raise ValueError(f"sequence length {seq} exceeds sliding_window {self.config.sliding_window} (not implemented)")
        positions = torch.arange(seq, device=self.device).expand(b, seq)
        return self(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.raw_logits(hidden).float()

    def raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head's output in the model's dtype (``compute_logits`` is its exact fp32 upcast): what the
        engine's decode graphs keep, saving two passes over [B, V] per step; its samplers upcast."""
        return self.lm_head(hidden)
