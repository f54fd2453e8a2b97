"""Which prompt rows a step and a shard of ``qerl rollout`` take: a pure function of the flags.

Every shard of a Slurm array and every step of an RL loop agree on the selection without talking to each other:
``--max-prompts`` caps the dataset (``run_rows``), ``--prompts-per-step P`` makes step k use rows ``[k*P, (k+1)*P)``
(wrapping around, optionally reshuffled every epoch), and ``--shard-index i --num-shards n`` keeps every n-th of those
(round robin, so shards are balanced, disjoint, and cover the step).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from qerl_cli.data import PromptRow
from qerl_cli.errors import BadInputError

if TYPE_CHECKING:  # rollout imports this module: its config is only named in annotations here
    from qerl_cli.rollout import RolloutConfig


def run_rows(rows: Sequence[PromptRow], cfg: RolloutConfig) -> list[PromptRow]:
    """The rows the run's steps take theirs from: the file's, capped by --max-prompts."""
    return list(rows[: cfg.max_prompts] if cfg.max_prompts else rows)


def select_prompts(rows: Sequence[PromptRow], cfg: RolloutConfig) -> list[PromptRow]:
    """The rows this step and shard use (see the module docstring); deterministic in the flags."""
    capped = bool(cfg.max_prompts) and cfg.max_prompts < len(rows)
    rows = run_rows(rows, cfg)
    n = len(rows)
    if cfg.prompts_per_step:
        p = cfg.prompts_per_step
        if p > n:
            raise BadInputError(f"--prompts-per-step {p} is more than the {n} prompts "
                                + (f"--max-prompts {cfg.max_prompts} keeps of" if capped else "in") + f" {cfg.prompts}")
        start = cfg.step * p
        shuffled: dict[int, list[int]] = {}
        ordered: dict[int, list[int]] = {}  # order(epoch) once per epoch: per row it cost O(n), O(P * n) a step

        def raw(epoch: int) -> list[int]:
            if epoch not in shuffled:
                idx = list(range(n))
                if cfg.shuffle:
                    random.Random(f"qerl-rollout-shuffle:{cfg.run_seed}:{epoch}").shuffle(idx)
                shuffled[epoch] = idx
            return shuffled[epoch]

        def order(epoch: int) -> list[int]:
            """Epoch ``epoch``'s permutation. With --shuffle, the step that crosses into it takes its
            first rows from the end of the last epoch: those rows are moved out of this epoch's head
            (the first non-repeating rows go first), so the step holds P distinct rows and the epoch
            still uses every row once. The head takes rows from the first P positions only, so the
            last epoch's tail is its raw shuffle's wherever the dataset holds 2P rows or more; below
            that the tail may reach the last epoch's moved head, so that epoch is built first (back to
            one whose tail is untouched: at most P / gcd(N, P) epochs)."""
            if epoch in ordered:
                return ordered[epoch]
            first = epoch
            while cfg.shuffle and first > 0 and 0 < (first * n) % p and n - (first * n) % p < p:
                first -= 1  # order(first)'s head depends on the moved head of order(first - 1)
            for e in range(first, epoch + 1):
                if e in ordered:
                    continue
                idx = raw(e)
                a = (e * n) % p  # rows of the crossing step that come from the last epoch
                if cfg.shuffle and e > 0 and a > 0:
                    tail = set((ordered.get(e - 1) or raw(e - 1))[n - a:])
                    head = [i for i in idx if i not in tail][: p - a]
                    taken = set(head)
                    idx = head + [i for i in idx if i not in taken]
                ordered[e] = idx
            return ordered[epoch]

        picked, seen = [], set()
        for j in range(start, start + p):
            i = order(j // n)[j % n]
            if i in seen:  # cannot happen: the crossing step's head skips the rows of the last epoch's tail
                raise AssertionError(f"select_prompts: row {i} twice in step {cfg.step}")
            seen.add(i)
            picked.append(rows[i])
        rows = picked
    return rows[cfg.shard_index :: cfg.num_shards]
