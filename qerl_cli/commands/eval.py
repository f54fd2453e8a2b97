"""`qerl eval`: not built yet (tracked by issue 5)."""

from __future__ import annotations

from qerl_cli.errors import NotBuiltError

SHORT = "Score a model (+ adapter) on a benchmark: pass@1 / pass@k."
HELP = SHORT + "\n\nNot built yet: this command exits with an error until its issue lands."


def command() -> None:
    raise NotBuiltError("`qerl eval` is not built yet (see issue 5); nothing was done")
