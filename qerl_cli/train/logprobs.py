"""Log-probs (and entropies) of chosen tokens from hidden states, without big logits tensors.

The lm_head of a 150k-vocabulary model turns every token into 600 KB of fp32 logits, so a
micro-batch's full logits would be gigabytes. ``token_logprobs`` therefore works in chunks of
``chunk`` tokens, and for each chunk a custom autograd function keeps *one* fp32
``[chunk, vocab]`` buffer alive at a time:

- forward: logits = lm_head(h).float() / T; log-sum-exp, the target's log-prob and the entropy
  are computed from that buffer in row blocks (so no second full-size temporary), and only ``h``,
  the targets and the per-row log-sum-exp are saved;
- backward: the logits are recomputed into one buffer and turned *in place* into the gradient
  ``g * (onehot - softmax) / T``, then one bf16 matmul with the lm_head weight gives the gradient
  of ``h``.

Plain autograd (even under activation checkpointing) keeps the fp32 logits, their softmax, the
gather's scattered gradient and their sum alive together: 3-5 buffers instead of 1. The price is
one lm_head matmul recomputed in backward, which checkpointing pays too. The entropy is a metric
only (no gradient). When the lm_head is not a plain dense Linear (e.g. quantized) the same
formula runs through ordinary autograd with checkpointing.

Records sampled with top-k, top-p or min-p were drawn from the distribution renormalised over the
tokens the cut kept, and their recorded log-probs are of that distribution. Over the full vocabulary
the trainer's log-prob of the same token is lower by log S (S: the mass the cut kept), so the
importance weight exp(old - sampled) would scale every token by S instead of measuring a policy
change. ``trunc`` replays the sampler's cut (``engine.sampler.truncate``, same order and ties) on the
trainer's own logits, in forward and in the backward's recompute, so log-probs, gradients and
entropies are over the kept support; the sampled token is always kept, where the trainer's logits, a
rounding away from the sampler's, would cut it (prime-rl's "sampling replay"; TRL issue 6789).
Every cut keeps a prefix of the row's stable ranking (logit descending, ties by index), so the
forward stores it as two numbers per row (``Kept``) and the backward, whose recomputed logits are the
same bits, applies them without the top-p sort again: the sort is most of what the replay costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qerl_cli.engine.sampler import truncate
from qerl_cli.train.recompute import checkpoint

_ROWS = 128  # row block for the per-row reductions: bounds temporaries at _ROWS x vocab
_FMIN = torch.finfo(torch.float32).min  # stands in for a cut token's -inf where 0 * -inf would be NaN
_ALL_TIES = torch.iinfo(torch.int32).max  # Kept.ties: every token at the row's last kept logit stays


def _logits(h, w, b, inv_temp):
    """Tempered fp32 logits of hidden states ``h`` under a dense head (``w``, ``b``)."""
    return F.linear(h, w, None if b is None else b.to(h.dtype)).float().mul_(inv_temp.unsqueeze(-1))


@dataclass
class Kept:
    """A cut of each row as a prefix of its stable ranking: the tokens above ``last``, and the first
    ``ties`` (by index) of those equal to it (``_ALL_TIES``: all of them). Rows not cut: ``last`` -inf."""

    last: torch.Tensor  # fp32 [n]
    ties: torch.Tensor  # int32 [n]


def find_kept(z: torch.Tensor, trunc: torch.Tensor) -> Kept:
    """What the rollout's sampler keeps of each row of tempered fp32 logits ``z`` [n, V] (``trunc`` [n, 3]
    fp64: the row's top_p, top_k, min_p), by the sampler's own function: on CUDA the radix select the
    engine's GPU sampler cuts with (no sort), elsewhere ``engine.sampler.truncate``."""
    n = z.shape[0]
    last = torch.full((n,), float("-inf"), dtype=torch.float32, device=z.device)
    ties = torch.zeros(n, dtype=torch.int32, device=z.device)
    combos = [c for c in torch.unique(trunc, dim=0).tolist() if c[0] < 1.0 or c[1] > 0 or c[2] > 0]
    if len(combos) == 1 and _radix_ok(z) and bool((trunc == trunc.new_tensor(combos[0])).all()):
        top_p, top_k, min_p = combos[0]  # one cut for every row (the usual case): all rows in one call
        return Kept(*_kept_by_radix(z, top_p, int(top_k), min_p))
    for i in range(0, n, _ROWS):
        blk, pb = z[i : i + _ROWS], trunc[i : i + _ROWS]
        for top_p, top_k, min_p in combos:
            rows = (pb == pb.new_tensor([top_p, top_k, min_p])).all(-1).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            sub = blk[rows]
            if _radix_ok(sub):
                last[i + rows], ties[i + rows] = _kept_by_radix(sub, top_p, int(top_k), min_p)
                continue
            keep = truncate(sub, top_p, int(top_k), min_p) > float("-inf")
            low = torch.where(keep, sub, float("inf")).amin(-1)
            at = sub == low.unsqueeze(-1)
            stay = (keep & at).sum(-1, dtype=torch.int32)
            last[i + rows] = low
            ties[i + rows] = torch.where(stay == at.sum(-1, dtype=torch.int32), _ALL_TIES, stay)
    return Kept(last, ties)


def _radix_ok(z: torch.Tensor) -> bool:
    return z.dtype == torch.float32 and z.is_contiguous() and _triton_on_cuda(z)


def _kept_by_radix(x: torch.Tensor, top_p: float, top_k: int, min_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(last, ties) of each row of tempered fp32 logits ``x``, from the GPU sampler's radix select
    (``engine.triton_truncation.find_cut``, its keys of fp32 logits are their bits): a key and a tie count
    per row, where the sort costs 2.2 ms per 128 x 152k block on an H100. Masses are summed there in
    fp64 from fp32 parts, so a token whose preceding mass lies within ~1e-6 of top_p may fall the other
    way than in ``truncate`` (the engine's own cut has that trade-off)."""
    from qerl_cli.engine.sampling_params import SamplingParams
    from qerl_cli.engine.triton_truncation import find_cut

    cut = find_cut(x, SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k, min_p=min_p), x.shape[1], 1)
    if top_p < 1.0:  # ``ties``: the row's tokens at the cut key (one Gumbel chunk: the whole row)
        keep = cut.keep.to(torch.int32)
        return _key_value(cut.kcut), torch.where(keep >= cut.ties[:, 0], _ALL_TIES, keep)
    if top_k and top_k < x.shape[1]:  # every token at or above the k-th key stays, ties included
        return _key_value(cut.kcut + 1), torch.full_like(cut.kcut, _ALL_TIES, dtype=torch.int32)
    floor = cut.pmax.amax(-1) + cut.log_min_p  # min-p alone: what the sampler keeps, x >= max + log(min_p)
    last = torch.where(x >= floor.unsqueeze(-1), x, float("inf")).amin(-1)
    return last, torch.full_like(last, _ALL_TIES, dtype=torch.int32)


def _key_value(key: torch.Tensor) -> torch.Tensor:
    """fp32 value of a radix key (``triton_truncation._radix_key`` of fp32 logits, inverted)."""
    t = key - 2147483648
    return torch.where(t < 0, t ^ 0x7FFFFFFF, t).to(torch.int32).view(torch.float32)


def apply_kept_(z: torch.Tensor, targets: torch.Tensor, kept: Kept) -> torch.Tensor:
    """Set what ``kept`` cuts of each row of ``z`` to -inf, in place; each row's target stays."""
    # The tie ranks are counted for every row, with no host sync: lm_head logits are bf16 values, so a
    # top-p cut lands inside a tie group in nearly every chunk, and skipping the count where none did
    # (one sync a call to find out) made a 7B step 0.3 s slower, not faster (H100, 2026-11-26).
    # Written as what is dropped: below ``last``, or a tie past its count. A NaN is neither (it stays, for
    # the step's NaN check), nor is anything in a row not cut (``last`` -inf).
    for i in range(0, z.shape[0], _ROWS):
        blk, last = z[i : i + _ROWS], kept.last[i : i + _ROWS].unsqueeze(-1)
        at = blk == last
        drop = (blk < last) | (at & (at.cumsum(-1, dtype=torch.int32) > kept.ties[i : i + _ROWS].unsqueeze(-1)))
        drop.scatter_(1, targets[i : i + _ROWS].unsqueeze(-1), False)
        blk.masked_fill_(drop, float("-inf"))
    return z


def replay_truncation_(z: torch.Tensor, targets: torch.Tensor | None, trunc: torch.Tensor | None) -> torch.Tensor:
    """Tempered fp32 logits ``z`` [n, V], cut in place as the rollout's sampler cut each row's token
    (``trunc`` [n, 3] fp64: the row's top_p, top_k, min_p; None: nothing to cut), the row's target kept."""
    return z if trunc is None else apply_kept_(z, targets, find_kept(z, trunc))


def _fused(z: torch.Tensor) -> bool:
    """The one-pass Triton kernels (``train.triton_logprobs``) on CUDA; torch elsewhere (a separate switch
    from ``_radix_ok``'s: ``bench_train.py --torch-logprobs`` turns off these passes alone)."""
    return _triton_on_cuda(z)


def _triton_on_cuda(z: torch.Tensor) -> bool:
    """z on CUDA with Triton importable: the GPU sampler's own test (``sampler._fast_path``)."""
    from qerl_cli.engine.sampler import _fast_path
    from qerl_cli.engine.sampling_params import SamplingParams

    return _fast_path(z, SamplingParams(temperature=1.0))


def _cut_lse_logp_entropy(z: torch.Tensor, targets: torch.Tensor, kept: Kept | None):
    """(log-sum-exp, target log-prob, entropy) of each row of ``z`` cut by ``kept``; on CUDA ``z`` is left
    as it is, in torch it is cut in place."""
    if _fused(z):
        from qerl_cli.train.triton_logprobs import lse_logp_entropy

        return lse_logp_entropy(z, targets, kept)
    return _lse_logp_entropy(z if kept is None else apply_kept_(z, targets, kept), targets)


def _logits_grad_(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                  kept: Kept | None) -> torch.Tensor:
    """``z`` overwritten with scale * (onehot(target) - softmax(z cut by ``kept``))."""
    if _fused(z):
        from qerl_cli.train.triton_logprobs import logits_grad_

        return logits_grad_(z, targets, lse, scale, kept)
    if kept is not None:
        apply_kept_(z, targets, kept)
    for i in range(0, z.shape[0], _ROWS):
        blk = z[i : i + _ROWS]
        blk.sub_(lse[i : i + _ROWS].unsqueeze(-1)).exp_().mul_(-scale[i : i + _ROWS].unsqueeze(-1))
    return z.scatter_add_(1, targets.unsqueeze(-1), scale.unsqueeze(-1))


def _lse_logp_entropy(z: torch.Tensor, targets: torch.Tensor):
    """Row-blocked log-sum-exp, target log-prob and entropy of fp32 logits ``z`` (left unchanged)."""
    n = z.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=z.device)
    ent = torch.empty(n, dtype=torch.float32, device=z.device)
    for i in range(0, n, _ROWS):
        blk = z[i : i + _ROWS]
        m = torch.logsumexp(blk, dim=-1)
        lse[i : i + _ROWS] = m
        ls = (blk - m.unsqueeze(-1)).clamp_(min=_FMIN)  # a cut token: p = 0, p log p = 0
        ent[i : i + _ROWS] = -(ls.exp() * ls).sum(-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    return lse, logp, ent


class _TokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, b, targets, inv_temp, trunc):
        with torch.no_grad():
            z = _logits(h, w, b, inv_temp)
            ctx.kept = None if trunc is None else find_kept(z, trunc)
            lse, logp, ent = _cut_lse_logp_entropy(z, targets, ctx.kept)
        del z
        ctx.save_for_backward(h, w, b if b is not None else torch.empty(0, device=h.device), targets, inv_temp, lse)
        ctx.has_bias = b is not None
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, w, b, targets, inv_temp, lse = ctx.saved_tensors
        b = b if ctx.has_bias else None
        with torch.no_grad():
            z = _logits(h, w, b, inv_temp)  # the same logits as the forward's, so the same cut
            scale = (g_logp.float() * inv_temp)  # d logp / d z = (onehot - softmax) / T
            _logits_grad_(z, targets, lse, scale, ctx.kept)
            grad_h = z.to(h.dtype) @ w.to(h.dtype)
        return grad_h, None, None, None, None, None


def _autograd_chunk(model, h, targets, inv_temp, trunc=None):
    logits = model.compute_logits(h) * inv_temp.unsqueeze(-1)
    if trunc is not None:
        with torch.no_grad():
            cut = torch.isneginf(replay_truncation_(logits.detach().float().clone(), targets, trunc))
        logits = logits.masked_fill(cut, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    with torch.no_grad():
        ent = lse - (torch.softmax(logits, dim=-1) * logits.clamp(min=_FMIN)).sum(-1)
    return logp, ent


def _dense_head(model):
    """(weight, bias) of a plain dense, frozen lm_head whose logits are lm_head(h).float(); else None."""
    from qerl_cli.layers.linear import QLinear

    head = getattr(model, "lm_head", None)
    if not isinstance(head, QLinear) or head.quantized or head.weight is None or head.weight.requires_grad:
        return None
    if head.bias is not None and head.bias.requires_grad:
        return None
    if type(model).compute_logits is not _standard_compute_logits():
        return None
    return head.weight, head.bias


def _standard_compute_logits():
    from qerl_cli.models.decoder import CausalLM

    return CausalLM.compute_logits


def token_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, inv_temp: torch.Tensor, chunk: int = 2048,
                   trunc: torch.Tensor | None = None):
    """Log-prob (differentiable wrt ``hidden``) and entropy (detached) of ``targets`` [T].

    ``hidden`` [T, H] are the final hidden states that predict each target; ``inv_temp`` [T] is
    1 / sampling temperature per token (log-probs are those of the tempered distribution); ``trunc``
    [T, 3] fp64 (top_p, top_k, min_p per token; None when no token was sampled with a cut): each
    distribution is cut as the sampler cut it (see the module's docstring).
    """
    chunk = max(1, int(chunk))
    head = _dense_head(model)
    grad = hidden.requires_grad and torch.is_grad_enabled()
    lps, ents = [], []
    for i in range(0, hidden.shape[0], chunk):
        h, t, it = hidden[i : i + chunk], targets[i : i + chunk], inv_temp[i : i + chunk]
        tr = None if trunc is None else trunc[i : i + chunk]
        if head is not None:
            if grad:
                lp, ent = _TokenLogprob.apply(h, head[0], head[1], t, it, tr)
            else:
                with torch.no_grad():
                    z = _logits(h, head[0], head[1], it)
                    _, lp, ent = _cut_lse_logp_entropy(z, t, None if tr is None else find_kept(z, tr))
        elif grad:
            lp, ent = checkpoint(lambda a, b, c, tr=tr: _autograd_chunk(model, a, b, c, tr), h, t, it)
            ent = ent.detach()
        else:
            lp, ent = _autograd_chunk(model, h, t, it, tr)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        z = hidden.new_zeros(0, dtype=torch.float32)
        return z, z
    return torch.cat(lps), torch.cat(ents)
