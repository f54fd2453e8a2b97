"""`qerl train-step`: not built yet (tracked by issue 4)."""

from __future__ import annotations

from qerl_cli.errors import NotBuiltError

SHORT = "One GRPO/DAPO step: rollout shards -> next LoRA adapter + optimizer state."
HELP = SHORT + "\n\nNot built yet: this command exits with an error until its issue lands."


def command() -> None:
    raise NotBuiltError("`qerl train-step` is not built yet (see issue 4); nothing was done")
