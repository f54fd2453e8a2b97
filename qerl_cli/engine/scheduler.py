"""Continuous batching: admit whole prompt groups as slots and KV blocks free up.

A group (one prompt, its G completions) is admitted when G sequence slots and its worst-case KV
blocks are free, and the padded prefill batch stays under ``max_num_batched_tokens``. Admitted
groups are prefilled together in the next step; running sequences decode one token per step;
a sequence that finishes returns its slot and blocks at once, so the next waiting prompt joins the
decode batch on the following step instead of waiting for the whole batch to drain.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from qerl_cli.engine.block_manager import BlockManager
from qerl_cli.engine.sequence import Sequence


@dataclass(eq=False)
class Group:
    index: int
    prompt_ids: list[int]
    n: int
    max_len: int
    seqs: list[Sequence] = field(default_factory=list)
    done: int = 0


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks, self.max_num_seqs, self.max_num_batched_tokens = blocks, max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Group] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))

    def add(self, group: Group) -> None:
        if group.n > self.max_num_seqs:
            raise ValueError(f"n={group.n} completions per prompt exceeds max_num_seqs={self.max_num_seqs}")
        cost = self.blocks.group_cost(len(group.prompt_ids), group.max_len, group.n)
        if cost > self.blocks.num_blocks - 1:
            raise ValueError(f"prompt {group.index} needs {cost} KV blocks, the cache has {self.blocks.num_blocks - 1}: "
                             "lower max_new_tokens or n, or give the engine more memory")
        self.waiting.append(group)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        """Whether the first waiting group would be admitted now."""
        if not self.waiting:
            return False
        g = self.waiting[0]
        return (len(self.running) + g.n <= self.max_num_seqs
                and self.blocks.group_cost(len(g.prompt_ids), g.max_len, g.n) <= self.blocks.num_free)

    def admit(self) -> list[Group]:
        """Groups to prefill now (their sequences are created, slotted and given blocks)."""
        out: list[Group] = []
        longest = 0
        while self.waiting:
            g = self.waiting[0]
            cost = self.blocks.group_cost(len(g.prompt_ids), g.max_len, g.n)
            padded = max(longest, len(g.prompt_ids)) * (len(out) + 1)
            if len(self.running) + g.n > self.max_num_seqs or cost > self.blocks.num_free:
                break
            if out and padded > self.max_num_batched_tokens:
                break
            self.waiting.popleft()
            longest = max(longest, len(g.prompt_ids))
            self._place(g)
            out.append(g)
        return out

    def _place(self, g: Group) -> None:
        bs = self.blocks.block_size
        p = len(g.prompt_ids)
        shared = self.blocks.allocate(p // bs)
        self.blocks.share(shared * (g.n - 1))
        own = self.blocks.group_cost(p, g.max_len, 1) - len(shared)
        for c in range(g.n):
            blocks = self.blocks.allocate(own)
            seq = Sequence(group=g.index, child=c, token_ids=list(g.prompt_ids), num_prompt=p, max_len=g.max_len,
                           block_table=shared + blocks, slot=self.free_slots.pop())
            g.seqs.append(seq)
            self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        self.free_slots.append(seq.slot)
        self.running.remove(seq)
