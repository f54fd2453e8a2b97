"""The engine's forward context: what attention needs to know about the current batch.

Set by the model runner around each engine forward (``None`` otherwise: training and scoring), read
by attention (cache slots, block tables) and LoRA (whether to use its inference copies). A module
global rather than an argument threaded through every layer, so CUDA graphs capture the decode step
with its tensors fixed (nano-vllm does the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    """What the engine tells attention about the current batch (tensors on the model device)."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot per token (pads -> a scratch slot)
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32, decode only
    context_lens: torch.Tensor | None = None  # [B] int32 tokens in cache incl. the new one, decode only
    max_context_len: int = 0  # upper bound of context_lens (sizes the fallback's gather)


_CONTEXT: ForwardContext | None = None


def set_context(ctx: ForwardContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_context() -> ForwardContext | None:
    return _CONTEXT
