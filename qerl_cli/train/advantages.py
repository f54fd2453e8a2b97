"""Group-relative advantages (GRPO): reward minus its group's mean, optionally scaled.

Every completion of one prompt shares a ``group_id``; its advantage is ``r - mean(group)``,
divided by the group's std (``scale="group"``, GRPO), by the std of all rewards in the step
(``scale="batch"``, less noisy when groups are small), or not at all (``"none"``, Dr. GRPO's
advice: dividing by a tiny std inflates almost-solved prompts). The std is the *unbiased* one
(torch default, as TRL) plus ``eps`` so a zero-variance group gives advantage 0, not NaN.

A group of one completion has no baseline to compare against; it is a bad input, not a
silently zero advantage, because it almost always means the rollout's ``--num-generations``
was 1 or shards of one step were split mid-group.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from qerl_cli.errors import BadInputError

SCALES = ("group", "batch", "none")


@dataclass
class Advantages:
    values: torch.Tensor          # fp32 [N], one per completion, in input order
    group_index: torch.Tensor     # long [N], dense 0..G-1 index of each completion's group
    num_groups: int
    zero_variance_fraction: float  # groups whose rewards are all equal (no learning signal)


def group_advantages(
    rewards, group_ids: list, *, scale: str = "group", eps: float = 1e-4, where: str = "shards"
) -> Advantages:
    """Advantages for completions with ``rewards[i]`` in group ``group_ids[i]``.

    ``where`` names the input in error messages (e.g. the shard directory).
    """
    if scale not in SCALES:
        raise BadInputError(f"--scale-rewards must be one of {', '.join(SCALES)}, got {scale!r}")
    r = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
    if r.numel() != len(group_ids):
        raise ValueError(f"{r.numel()} rewards for {len(group_ids)} group ids")
    if r.numel() == 0:
        raise BadInputError(f"{where}: no completions to train on")
    if not torch.isfinite(r).all():
        bad = int((~torch.isfinite(r)).nonzero()[0])
        raise BadInputError(f"{where}: reward of completion {bad} (group {group_ids[bad]!r}) is {r[bad].item()}")
    # Dense group index in first-appearance order (deterministic, independent of hashing).
    index: OrderedDict = OrderedDict()
    gi = torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)
    g = len(index)
    counts = torch.bincount(gi, minlength=g)
    if (counts < 2).any():
        lone = list(index)[int((counts < 2).nonzero()[0])]
        raise BadInputError(
            f"{where}: group {lone!r} has only one completion; group advantages need >= 2 per prompt",
            hint="rollout with --num-generations >= 2 and keep each group inside one step",
        )
    sums = torch.zeros(g, dtype=torch.float64).index_add_(0, gi, r)
    mean = sums / counts
    # Equal rewards compared as equal, not through the mean: (0.1 + 0.1 + 0.1) / 3 != 0.1 in floating
    # point, which left such a group a std of ~1e-17, advantages of ~1e-13 and out of the zero-variance count.
    same = (torch.full((g,), -torch.inf, dtype=torch.float64).scatter_reduce_(0, gi, r, "amax")
            == torch.full((g,), torch.inf, dtype=torch.float64).scatter_reduce_(0, gi, r, "amin"))
    centered = torch.where(same[gi], 0.0, r - mean[gi])
    sq = torch.zeros(g, dtype=torch.float64).index_add_(0, gi, centered**2)
    group_std = (sq / (counts - 1)).sqrt()
    if scale == "group":
        adv = centered / (group_std[gi] + eps)
    elif scale == "batch":
        adv = centered / (r.std() + eps) if r.numel() > 1 else centered
    else:
        adv = centered
    zero_var = float(same.double().mean())
    return Advantages(adv.to(torch.float32), gi, g, zero_var)
