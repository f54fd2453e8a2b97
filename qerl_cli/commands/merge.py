"""`qerl merge`: not built yet (tracked by issue 5)."""

from __future__ import annotations

from qerl_cli.errors import NotBuiltError

SHORT = "Merge a LoRA adapter into the base: a servable bf16 or NVFP4 checkpoint."
HELP = SHORT + "\n\nNot built yet: this command exits with an error until its issue lands."


def command() -> None:
    raise NotBuiltError("`qerl merge` is not built yet (see issue 5); nothing was done")
