"""Sampling with exact per-token log-probabilities.

The log-probability recorded for a token is taken from the very tensor it was sampled from: the
log-softmax of the tempered logits after top-k / top-p / min-p masking. Training's importance
ratios then compare against the real behaviour policy rather than an untruncated approximation.
Sampling is Gumbel-max in the exponential form (``argmax p / E``, ``E ~ Exp(1)`` from a seeded
generator): one pass, no sort, no CPU sync, and reproducible for a fixed seed and batch order.
Sorting happens only when top-p is active.
"""

from __future__ import annotations

import math

import torch

from qerl_cli.engine.sampling_params import SamplingParams


def truncated_logprobs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """fp32 logits [B, V] -> log-probabilities [B, V] of the distribution tokens are drawn from.

    vLLM's order (v1 sampler): temperature, min-p, then top-k and top-p, so that ``--engine vllm``
    draws from the same distribution for the same flags. Min-p commutes with top-k, not with top-p.
    """
    if sp.greedy:
        return torch.log_softmax(logits, dim=-1)
    x = logits / sp.temperature
    if sp.min_p > 0:
        logp = torch.log_softmax(x, dim=-1)
        floor = logp.max(dim=-1, keepdim=True).values + math.log(sp.min_p)
        x = x.masked_fill(logp < floor, float("-inf"))
    if sp.top_k and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= sp.top_p
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(x, dim=-1)


def row_seed(seed: int, group: int, child: int, position: int) -> int:
    """A 62-bit seed per (run seed, prompt, completion, position): a cheap integer hash (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + group * 0xBF58476D1CE4E5B9 + child * 0x94D049BB133111EB + position) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) >> 2


def _fast_path(logits: torch.Tensor, sp: SamplingParams) -> bool:
    if not logits.is_cuda or sp.greedy or sp.top_k or sp.top_p < 1.0 or sp.min_p > 0:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class Sampler:
    """Plain temperature sampling on CUDA uses the one-pass Triton kernel with per-row seeds (a
    sequence's sample does not depend on its batch); truncated sampling, greedy and CPU use the torch
    path with one seeded generator (reproducible for the same inputs and batch order)."""

    def __init__(self, device, seed: int):
        self.seed = seed
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, sp: SamplingParams, row_seeds: torch.Tensor | None = None):
        """-> (token ids [B] int64, their log-probabilities [B] fp32). ``row_seeds``: [B] int64 on the device."""
        if row_seeds is not None and _fast_path(logits, sp):
            from qerl_cli.engine.triton_sampler import gumbel_sample

            return gumbel_sample(logits, sp.temperature, row_seeds)
        logp = truncated_logprobs(logits.float(), sp)
        if sp.greedy:
            tokens = logits.argmax(dim=-1)
        else:
            e = torch.empty_like(logp).exponential_(generator=self.generator).clamp_min_(torch.finfo(torch.float32).tiny)
            tokens = (logp - e.log()).argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
