"""Policy-gradient losses: PPO clipping, truncated importance sampling, KL, four normalizations.

All four loss types share one per-token term and differ only in how tokens are weighted
into the step's scalar loss. qerl makes that weighting a per-*sequence* factor computed once for
the whole step (``sequence_weights``), before micro-batching. Each micro-batch then contributes
``sum(per_token_loss * weight)`` and the micro-batch losses simply add up, on one GPU or many:
gradient accumulation and the multi-GPU all-reduce are a plain SUM, with no "divide by the number
of micro-batches" fix-ups that silently change the loss when ``--micro-batch-tokens`` or the GPU
count changes.

| loss | per-token weight of sequence b (``n_b`` its unmasked completion tokens, N sequences) |
| --- | --- |
| ``grpo`` | ``1 / (n_b * N)``: mean over each sequence, then over sequences (long answers diluted) |
| ``dapo`` | ``1 / sum_b n_b``: token mean over the whole step (default; DAPO) |
| ``dr_grpo`` | ``1 / (N * L_max)``: constant, ``L_max`` = max completion length (Dr. GRPO) |
| ``bnpo`` | ``1 / (tokens of b's micro-batch * M)``: token mean per micro-batch, mean over all M micro-batches (TRL's bnpo: one whose completions are all masked adds 0 and still counts) |

N counts masked (``--mask-truncated``) sequences too, as TRL does: they add zero, not shrink N.
Zero-variance groups (advantage 0) likewise count in ``sum_b n_b`` and N, as in TRL: the DAPO paper's
dynamic sampling would drop them (and sample more), which a file-based step cannot.

Per token (``ratio = exp(logp - old_logp)``, ``A`` the sequence's advantage)::

    pg  = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high))     # PPO, DAPO clip-higher
    tis = min(exp(old_logp - sampling_logp), cap)                        # detached (TIS)
    loss_t = tis * pg + beta * (exp(ref - logp) - (ref - logp) - 1)      # k3 KL estimator

``old_logp`` is the training policy's log-prob before this step's first update (recomputed in
epoch 1, stored for later epochs) and ``sampling_logp`` the rollout engine's (noisy FP4 kernel,
possibly another engine). TIS corrects the rollout/training mismatch without touching the PPO
ratio; the KL term is not importance-weighted (as verl).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qerl_cli.errors import BadInputError

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")


@dataclass(frozen=True)
class LossConfig:
    loss_type: str = "dapo"
    clip_eps: float = 0.2
    clip_eps_high: float = 0.28
    beta: float = 0.0
    tis_cap: float | None = 2.0  # None/0: no importance weighting

    def validate(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise BadInputError(f"--loss must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        if not (0 <= self.clip_eps < 1):
            raise BadInputError(f"--clip-eps must be in [0, 1), got {self.clip_eps}")
        # "not x >= 0", not "x < 0": NaN passes the latter, and a NaN beta silently dropped the KL term
        if not self.clip_eps_high >= 0:
            raise BadInputError(f"--clip-eps-high must be >= 0, got {self.clip_eps_high}")
        if not (self.beta >= 0 and math.isfinite(self.beta)):
            raise BadInputError(f"--beta must be a finite number >= 0, got {self.beta}")
        if self.tis_cap is not None and not self.tis_cap >= 0:
            raise BadInputError(f"--tis-cap must be >= 0 (0 disables TIS), got {self.tis_cap}")
        # torch makes float32 clamp bounds of these: a finite value past its range was a RuntimeError traceback,
        # exit 1, after the model loaded and the step ran; inf already means "no bound"
        big = torch.finfo(torch.float32).max
        for flag, v in (("--clip-eps-high", self.clip_eps_high), ("--tis-cap", self.tis_cap)):
            if v is not None and math.isfinite(v) and v > big:
                raise BadInputError(f"{flag} must be at most {big:.4g} (float32's largest; inf for no bound), got {v}")


def sequence_weights(
    loss_type: str,
    token_counts: list[int],
    microbatch_of: list[int] | None = None,
    max_completion_length: int | None = None,
) -> torch.Tensor:
    """fp64 [N] per-token weight of each sequence (see the module table); 0 where ``n_b`` is 0.

    ``token_counts`` are unmasked completion tokens (0 for a masked sequence);
    ``microbatch_of[b]`` is b's micro-batch (bnpo only); ``max_completion_length`` defaults to
    the longest completion in the step (dr_grpo only).
    """
    n = torch.tensor(token_counts, dtype=torch.float64)
    num = len(token_counts)
    total = float(n.sum())
    if num == 0 or total == 0:
        raise BadInputError("no completion tokens left to train on (all completions empty or masked)")
    return _weights(loss_type, n, num, total, microbatch_of, max_completion_length) * (n > 0)


def _weights(loss_type, n, num, total, microbatch_of, max_completion_length) -> torch.Tensor:
    if loss_type == "grpo":
        return torch.where(n > 0, 1.0 / (n.clamp(min=1) * num), torch.zeros_like(n))
    if loss_type == "dapo":
        return torch.full_like(n, 1.0 / total)
    if loss_type == "dr_grpo":
        lmax = max_completion_length or int(n.max())
        if lmax < int(n.max()):
            raise BadInputError(f"--max-completion-length {lmax} is shorter than a completion of {int(n.max())} tokens")
        return torch.full_like(n, 1.0 / (num * lmax))
    if loss_type == "bnpo":
        if microbatch_of is None:
            raise ValueError("bnpo needs each sequence's micro-batch")
        mb = torch.tensor(microbatch_of, dtype=torch.long)
        m = int(mb.max()) + 1
        per_mb = torch.zeros(m, dtype=torch.float64).index_add_(0, mb, n)
        # all M, as TRL divides by its gradient-accumulation steps: counting only those with trained
        # tokens scaled the loss up by M / (M - 1) when --mask-truncated emptied one (2026-11-26 audit)
        return torch.where(per_mb[mb] > 0, 1.0 / (per_mb[mb].clamp(min=1) * m), torch.zeros_like(n))
    raise BadInputError(f"--loss must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")


def _f32(t: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16 log-probs would round ratios to ~1%); fp64 stays fp64 for tests."""
    return t if t.dtype == torch.float64 else t.float()


def tis_weights(old_logp: torch.Tensor, sampling_logp: torch.Tensor, cap: float | None):
    """(capped weight, raw ratio), both detached: ``min(exp(old - sampling), cap)``."""
    raw = torch.exp(_f32(old_logp - sampling_logp).detach())
    if not cap:
        return torch.ones_like(raw), raw
    return raw.clamp(max=cap), raw


@dataclass
class TokenStats:
    """Sums over tokens (divide by ``tokens`` for means); all-reducible as a vector."""

    tokens: float = 0.0
    clip_low: float = 0.0
    clip_high: float = 0.0
    kl: float = 0.0


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    weight: torch.Tensor,
    cfg: LossConfig,
    *,
    is_weight: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
):
    """Weighted loss of flat completion tokens [T] -> (scalar loss, per-token loss, TokenStats).

    ``weight`` is each token's sequence weight (0 for masked tokens); ``adv`` each token's
    sequence advantage.
    """
    logp = _f32(logp)
    ratio = torch.exp(logp - _f32(old_logp))
    low, high = 1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps_high
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(low, high))
    if is_weight is not None:
        pg = pg * is_weight
    per_token = pg
    kl = None
    if cfg.beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs reference log-probs")
        d = _f32(ref_logp) - logp
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + cfg.beta * kl
    loss = (per_token * weight).sum()
    with torch.no_grad():
        live = weight > 0
        r = ratio.detach()
        stats = TokenStats(
            tokens=float(live.sum()),
            clip_low=float(((r < low) & (adv < 0) & live).sum()),
            clip_high=float(((r > high) & (adv > 0) & live).sum()),
            kl=float((kl.detach() * live).sum()) if kl is not None else 0.0,
        )
    return loss, per_token, stats
