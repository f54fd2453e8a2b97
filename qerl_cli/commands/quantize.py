"""`qerl quantize`: not built yet (tracked by issue 2)."""

from __future__ import annotations

from qerl_cli.errors import NotBuiltError

SHORT = "Quantize a Hugging Face safetensors checkpoint to NVFP4 (compressed-tensors)."
HELP = SHORT + "\n\nNot built yet: this command exits with an error until its issue lands."


def command() -> None:
    raise NotBuiltError("`qerl quantize` is not built yet (see issue 2); nothing was done")
