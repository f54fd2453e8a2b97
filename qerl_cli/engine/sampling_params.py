"""What to sample and what comes back."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this qerl refuses a temperature: vLLM treats temperatures under 1e-5 as greedy (and raises those under
# 1e-2 to 1e-2: engine_vllm), and far enough below it logits / T overflow fp32 (1e-40 gave inf, then NaN).
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Sampling controls for one ``generate`` call (every prompt and completion shares them).

    Truncation order, vLLM's: temperature, then min-p (relative to the most likely token), then top-k,
    then top-p (nucleus on what is left). ``temperature == 0`` is greedy. ``seed`` with a
    prompt's index in the call seeds its completions (unless ``generate`` gets a seed per prompt):
    each sequence draws from its own stream, so the same seeds give the same tokens in any batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int = 0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature {self.temperature:g} is below {MIN_TEMPERATURE:g}, which vLLM treats as "
                             "greedy (use 0 for greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if isinstance(self.stop, str):  # one stop string, as vLLM takes it: tuple("####") was four stops of "#"
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):  # None, vLLM's default: none (it was a TypeError)
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Completion:
    """One sampled continuation. ``logprobs[t]`` is log p(token_ids[t]) under the exact distribution it
    was drawn from. ``text`` is cut before the first stop string (the stop string's tokens stay in
    ``token_ids`` so they line up with ``logprobs``); an EOS token is kept in ``token_ids`` and left out
    of ``text``."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length"
    stop_reason: str | int | None = field(default=None)  # the stop string or token id that ended it
