"""Sampling with exact per-token log-probabilities.

The log-probability recorded for a token is taken from the very tensor it was sampled from: the
log-softmax of the tempered logits after top-k / top-p / min-p masking. Training's importance
ratios then compare against the real behaviour policy rather than an untruncated approximation.
Sampling is Gumbel-max in the exponential form (``argmax p / E``, ``E ~ Exp(1)`` from a seeded
generator): one pass, no sort, no CPU sync, and reproducible for a fixed seed and batch order.
Sorting happens only when top-p is active.
"""

from __future__ import annotations

import torch

from qerl_cli.engine.sampling_params import SamplingParams


def truncated_logprobs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """fp32 logits [B, V] -> log-probabilities [B, V] of the distribution tokens are drawn from."""
    if sp.greedy:
        return torch.log_softmax(logits, dim=-1)
    x = logits / sp.temperature
    if sp.top_k and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= sp.top_p
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    logp = torch.log_softmax(x, dim=-1)
    if sp.min_p > 0:
        floor = logp.max(dim=-1, keepdim=True).values + torch.log(torch.tensor(sp.min_p, device=x.device))
        logp = torch.log_softmax(logp.masked_fill(logp < floor, float("-inf")), dim=-1)
    return logp


class Sampler:
    def __init__(self, device, seed: int):
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, sp: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (token ids [B] int64, their log-probabilities [B] fp32)."""
        logp = truncated_logprobs(logits.float(), sp)
        if sp.greedy:
            tokens = logits.argmax(dim=-1)
        else:
            e = torch.empty_like(logp).exponential_(generator=self.generator).clamp_min_(torch.finfo(torch.float32).tiny)
            tokens = (logp - e.log()).argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
