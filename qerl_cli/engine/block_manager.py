"""KV-cache block pool with reference counts, so the G completions of a prompt share its KV.

A prompt's full blocks are written once by prefill and referenced by all G children; the partial
last block (if any) is copied into each child's own first block, after which children only ever
append to their own blocks. Blocks are reserved for a group's worst case at admission
(``prompt + max_new_tokens + 1`` per child), which rules out preemption and recomputation: simpler and
deterministic, at the price of idle reservations when completions stop early on EOS. Block 0 is a
scratch block that absorbs writes from padding tokens.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    SCRATCH = 0

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is scratch), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: deque[int] = deque(range(1, num_blocks))
        self.refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    def group_cost(self, prompt_len: int, max_len: int, n: int) -> int:
        """Blocks a group of n children needs in the worst case: shared full prompt blocks + own blocks."""
        shared = prompt_len // self.block_size
        own = -(-(max_len + 1) // self.block_size) - shared  # +1: the engine's one-step lag may write one more
        return shared + n * own

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise RuntimeError(f"KV cache exhausted: need {count} blocks, {len(self.free)} free")
        out = [self.free.popleft() for _ in range(count)]
        for b in out:
            self.refs[b] = 1
        return out

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)
            elif self.refs[b] < 0:
                raise RuntimeError(f"KV block {b} released more often than referenced")
