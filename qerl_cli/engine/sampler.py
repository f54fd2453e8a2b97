"""Sampling with exact per-token log-probabilities, from per-sequence seeds.

The log-probability recorded for a token is taken from the very tensor it was sampled from: the
log-softmax of the tempered logits after top-k / top-p / min-p masking. Training's importance
ratios then compare against the real behaviour policy rather than an untruncated approximation.

Every draw is keyed by its sequence's seed (``row_seed``: run seed, prompt, completion, position),
never by a shared generator, so a sequence samples the same token whichever sequences share its
batch: a rerun with another ``--max-num-seqs``, a resumed batch or a different scheduling order
gives the same completions (up to the batched matmuls' rounding of the logits). Two paths:
- sampling on CUDA: the one-pass Triton Gumbel-max kernel (``triton_sampler``), which masks the
  tokens that min-p / top-k / top-p cut as it goes; the cut itself comes from a radix select on the
  logits' bits (``triton_truncation``), not a sort of the vocabulary;
- the reference, everywhere else (CPU, and greedy): ``truncated_logprobs`` (a stable sort for
  top-p), then inverse-CDF sampling with one fp64 uniform per sequence from Philox(seed, 0) (53 bits
  from two words: ``philox.uniform53``, whose bits a Triton kernel also draws on the GPU). The CDF
  is summed in fp64 (in two levels), so the drawn token follows the recorded probabilities to fp32
  rounding, with no CPU sync.
"""

from __future__ import annotations

import functools
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
    return torch.log_softmax(truncate(logits / sp.temperature, sp.top_p, sp.top_k, sp.min_p), dim=-1)


def truncate(x: torch.Tensor, top_p: float, top_k: int, min_p: float) -> torch.Tensor:
    """Tempered fp32 logits [B, V] with the tokens that min-p, top-k and top-p cut set to -inf (a new
    tensor; ``x`` itself where nothing is cut). Train-step replays it on its own logits, so that its
    log-probs are over the same support as the ones sampled (``qerl_cli.train.logprobs``)."""
    if min_p > 0:
        logp = torch.log_softmax(x, dim=-1)
        floor = logp.max(dim=-1, keepdim=True).values + math.log(min_p)
        x = x.masked_fill(logp < floor, float("-inf"))
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        # Stable: tied logits (common in bf16) keep index order, so the cut does not depend on the batch.
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return x


def row_seed(seed: int, group: int, child: int, position: int) -> int:
    """A 62-bit seed per (run seed, prompt, completion, position): a cheap integer hash (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + group * 0xBF58476D1CE4E5B9 + child * 0x94D049BB133111EB + position) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) >> 2


def sequence_seed(seed: int, prompt_seeds: list[int] | None, prompt: int, child: int) -> int:
    """The stream key of completion ``child`` of prompt ``prompt`` in one ``generate`` call: from the
    prompt's own seed when the caller gives one per prompt, else from the call's seed and the index."""
    if prompt_seeds is None:
        return row_seed(seed, prompt, child, 0)
    return row_seed(prompt_seeds[prompt], 0, child, 0)


def _fast_path(logits: torch.Tensor, sp: SamplingParams) -> bool:
    if not logits.is_cuda or sp.greedy:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache  # called every decode step; the search is ~4k Python comparisons
def _chunk_len(vocab: int) -> int:
    """A chunk length near sqrt(V) that divides V (no padding copy), else 1024."""
    target = max(64, math.isqrt(vocab))
    for d in sorted(range(256, 4097), key=lambda d: abs(d - target)):
        if vocab % d == 0:
            return d
    return 1024


def inverse_cdf(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens [B] drawn from log-probabilities [B, V] (-inf: masked) with uniforms ``u`` [B] in [0, 1):
    the first token whose cumulative probability exceeds ``u`` x the total.

    In two levels, summed in fp64: chunk sums, the chunk the target falls in, then that chunk's
    cumulative sum. (torch's cumulative sum along a 152k-long row runs one thread block per row:
    232 us for 16 rows on an H100, against ~10 us for a pass over the logits.) A token without
    mass is never drawn: its cumulative value equals its predecessor's, and the targets stay below
    each total, which rounding could otherwise reach."""
    b, v = logp.shape
    n = _chunk_len(v)
    c = -(-v // n)
    p = logp.exp()
    if c * n != v:
        p = torch.nn.functional.pad(p, (0, c * n - v))
    p = p.view(b, c, n)
    cum = p.sum(-1, dtype=torch.float64).cumsum_(-1)  # [B, C]
    total = cum[:, -1]
    zero = torch.zeros_like(total)
    target = torch.minimum(u.double() * total, torch.nextafter(total, zero))
    # [B, 1]: the first chunk whose sum passes it (clamped: NaN logits must give a token whose NaN
    # log-prob the stages report, not an index error)
    j = torch.searchsorted(cum, target[:, None], right=True).clamp_(max=c - 1)
    before = torch.where(j > 0, cum.gather(1, (j - 1).clamp_min_(0)), 0.0).squeeze(1)
    local = p.gather(1, j[:, :, None].expand(b, 1, n)).squeeze(1).double().cumsum_(-1)  # [B, n]
    rest = torch.minimum(target - before, torch.nextafter(local[:, -1], zero))
    return (j.squeeze(1) * n + torch.searchsorted(local, rest[:, None], right=True).squeeze(1)).clamp_(max=v - 1)


def row_uniforms(seeds: torch.Tensor) -> torch.Tensor:
    """One fp64 uniform per row from Philox(seed, 0): the Triton kernel on CUDA, the same bits in torch elsewhere."""
    if seeds.is_cuda:
        try:
            from qerl_cli.engine.triton_sampler import row_uniforms as triton_uniforms
        except ImportError:
            pass
        else:
            return triton_uniforms(seeds)
    from qerl_cli.engine.philox import uniform53

    return uniform53(seeds, torch.zeros_like(seeds))


def sample(logits: torch.Tensor, sp: SamplingParams, row_seeds: torch.Tensor):
    """-> (token ids [B] int64, their log-probabilities [B] fp32). ``row_seeds``: [B] int64 on the
    logits' device, one per sequence (``row_seed`` of its position)."""
    if _fast_path(logits, sp):
        from qerl_cli.engine.triton_sampler import gumbel_sample

        return gumbel_sample(logits, sp.temperature, row_seeds, sp=sp)
    logp = truncated_logprobs(logits.float(), sp)
    tokens = logits.argmax(dim=-1) if sp.greedy else inverse_cdf(logp, row_uniforms(row_seeds))
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
