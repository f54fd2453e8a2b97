"""A sequence being generated: its tokens, its KV blocks, and why it stopped."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Sequence:
    group: int  # index of its prompt in the generate() call
    child: int  # 0..n-1 within the group
    token_ids: list[int]  # prompt + completion so far
    num_prompt: int
    max_len: int  # prompt + the most new tokens it may produce
    block_table: list[int] = field(default_factory=list)
    slot: int = -1  # row in the runner's persistent block-table tensor
    rng: int = 0  # per-sequence sampling seed base (position is added each step)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
