"""Token-budget micro-batches, packed longest first, and their padded tensors.

A micro-batch holds whole sequences (prompt + completion) right-padded to its longest one, so
its cost is ``rows * longest``; ``pack_microbatches`` fills each micro-batch up to
``budget`` padded tokens. Sequences are taken longest first: the first micro-batch is the most
expensive one, so a too-small GPU fails in seconds instead of after minutes of work, and
sequences of similar length end up together (little padding). Ties break by input index, so the
packing depends only on the shard contents, never on rank count or dict order: the multi-GPU run
splits the *same* micro-batches across ranks.

A sequence longer than the budget gets a micro-batch of its own rather than an error (the
budget is a memory hint; one oversized sequence may still fit).

Padding is right-sided with ``attention_mask`` 0; ``Microbatch.targets`` are the completion tokens
in row-major order and ``positions`` the (row, column) of the hidden state that predicts each
one, i.e. column ``prompt_len + t - 1`` for completion token ``t``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl_cli.errors import BadInputError


def pack_microbatches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into micro-batches with ``rows * max_len <= budget``."""
    if budget <= 0:
        raise BadInputError(f"--micro-batch-tokens must be positive, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        length = lengths[i]
        new_max = max(cur_max, length)
        if cur and new_max * (len(cur) + 1) > budget:
            batches.append(cur)
            cur, new_max = [], length
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    return batches


@dataclass
class Microbatch:
    index: int                   # position in the step's micro-batch list (stable across ranks)
    seqs: list[int]              # sequence indices (into the step's record list), one per row
    input_ids: torch.Tensor      # long [B, L], right-padded
    attention_mask: torch.Tensor  # long [B, L]
    rows: torch.Tensor           # long [T]: row of each completion token
    cols: torch.Tensor           # long [T]: column of the hidden state predicting it
    targets: torch.Tensor        # long [T]: the completion tokens
    seq_of_token: torch.Tensor   # long [T]: sequence index (into the step) of each token

    @property
    def padded_tokens(self) -> int:
        return self.input_ids.numel()


def collate(index: int, seqs: list[int], prompts: list[list[int]], completions: list[list[int]], pad_id: int = 0):
    """Build the padded tensors of micro-batch ``index`` from whole-step prompt/completion lists."""
    lens = [len(prompts[s]) + len(completions[s]) for s in seqs]
    width = max(lens)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    rows, cols, targets, owner = [], [], [], []
    for r, s in enumerate(seqs):
        p, c = prompts[s], completions[s]
        if not p:
            raise BadInputError(f"sequence {s} has an empty prompt: the first completion token has no context")
        seq = torch.tensor(p + c, dtype=torch.long)
        ids[r, : len(seq)] = seq
        mask[r, : len(seq)] = 1
        n = len(c)
        rows.append(torch.full((n,), r, dtype=torch.long))
        cols.append(torch.arange(len(p) - 1, len(p) - 1 + n, dtype=torch.long))
        targets.append(torch.tensor(c, dtype=torch.long))
        owner.append(torch.full((n,), s, dtype=torch.long))
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long)  # noqa: E731
    return Microbatch(index, list(seqs), ids, mask, cat(rows), cat(cols), cat(targets), cat(owner))
