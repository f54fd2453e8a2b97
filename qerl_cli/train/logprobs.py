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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qerl_cli.train.recompute import checkpoint

_ROWS = 128  # row block for the per-row reductions: bounds temporaries at _ROWS x vocab


def _logits(h, w, b, inv_temp):
    z = F.linear(h, w, None if b is None else b.to(h.dtype)).float()
    return z.mul_(inv_temp.unsqueeze(-1))


def _lse_logp_entropy(z: torch.Tensor, targets: torch.Tensor):
    """Row-blocked log-sum-exp, target log-prob and entropy of fp32 logits ``z`` (left unchanged)."""
    n = z.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=z.device)
    ent = torch.empty(n, dtype=torch.float32, device=z.device)
    for i in range(0, n, _ROWS):
        blk = z[i : i + _ROWS]
        m = torch.logsumexp(blk, dim=-1)
        lse[i : i + _ROWS] = m
        ls = blk - m.unsqueeze(-1)
        ent[i : i + _ROWS] = -(ls.exp() * ls).sum(-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    return lse, logp, ent


class _TokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, b, targets, inv_temp):
        with torch.no_grad():
            z = _logits(h, w, b, inv_temp)
            lse, logp, ent = _lse_logp_entropy(z, targets)
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
            z = _logits(h, w, b, inv_temp)
            scale = (g_logp.float() * inv_temp)  # d logp / d z = (onehot - softmax) / T
            for i in range(0, z.shape[0], _ROWS):
                blk = z[i : i + _ROWS]
                blk.sub_(lse[i : i + _ROWS].unsqueeze(-1)).exp_().mul_(-scale[i : i + _ROWS].unsqueeze(-1))
            z.scatter_add_(1, targets.unsqueeze(-1), scale.unsqueeze(-1))
            grad_h = z.to(h.dtype) @ w.to(h.dtype)
        return grad_h, None, None, None, None


def _autograd_chunk(model, h, targets, inv_temp):
    logits = model.compute_logits(h) * inv_temp.unsqueeze(-1)
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    with torch.no_grad():
        ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
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


def token_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, inv_temp: torch.Tensor, chunk: int = 2048):
    """Log-prob (differentiable wrt ``hidden``) and entropy (detached) of ``targets`` [T].

    ``hidden`` [T, H] are the final hidden states that predict each target; ``inv_temp`` [T] is
    1 / sampling temperature per token (log-probs are those of the tempered distribution).
    """
    chunk = max(1, int(chunk))
    head = _dense_head(model)
    grad = hidden.requires_grad and torch.is_grad_enabled()
    lps, ents = [], []
    for i in range(0, hidden.shape[0], chunk):
        h, t, it = hidden[i : i + chunk], targets[i : i + chunk], inv_temp[i : i + chunk]
        if head is not None:
            if grad:
                lp, ent = _TokenLogprob.apply(h, head[0], head[1], t, it)
            else:
                with torch.no_grad():
                    _, lp, ent = _lse_logp_entropy(_logits(h, head[0], head[1], it), t)
        elif grad:
            lp, ent = checkpoint(lambda a, b, c: _autograd_chunk(model, a, b, c), h, t, it)
            ent = ent.detach()
        else:
            lp, ent = _autograd_chunk(model, h, t, it)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        z = hidden.new_zeros(0, dtype=torch.float32)
        return z, z
    return torch.cat(lps), torch.cat(ents)
