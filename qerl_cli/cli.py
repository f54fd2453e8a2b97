"""The ``qerl`` command line: one Typer app, one module per command under ``commands/``.

Commands only parse flags into a config dataclass and call the stage's library function;
``guarded`` turns a ``QerlError`` into one line on stderr and its exit code.
"""

from __future__ import annotations

import functools
import os
import sys

import typer

from qerl_cli.errors import QerlError

app = typer.Typer(
    name="qerl",
    help="RL post-training of LLMs on NVFP4 base weights with LoRA and Adaptive Quantization Noise.\n\n"
    "An RL run is a chain of stages that hand over through directories: "
    "quantize -> (rollout -> train-step)* -> merge -> eval. Any stage can be rerun alone; "
    "a rerun with the same inputs says 'already done'.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)


def guarded(fn):
    """Wrap a command: QerlError -> 'error: ...' on stderr and its exit code; KeyboardInterrupt -> 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except QerlError as e:
            if os.environ.get("QERL_DEBUG"):
                raise
            print(f"error: {e}", file=sys.stderr)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            print("interrupted: no partial output was kept", file=sys.stderr)
            raise typer.Exit(130) from None

    return wrapper


def _register() -> None:
    from qerl_cli.commands import eval as eval_cmd
    from qerl_cli.commands import merge, quantize, rollout, train_step

    for name, module in (
        ("quantize", quantize),
        ("rollout", rollout),
        ("train-step", train_step),
        ("merge", merge),
        ("eval", eval_cmd),
    ):
        app.command(name, help=module.HELP, short_help=module.SHORT, no_args_is_help=True)(guarded(module.command))


_register()


def main() -> None:
    app()
