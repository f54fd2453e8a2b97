"""`qerl rollout`: not built yet (tracked by issue 8)."""

from __future__ import annotations

from qerl_cli.errors import NotBuiltError

SHORT = "Generate G completions per prompt, score them, write JSONL rollout shards."
HELP = SHORT + "\n\nNot built yet: this command exits with an error until its issue lands."


def command() -> None:
    raise NotBuiltError("`qerl rollout` is not built yet (see issue 8); nothing was done")
