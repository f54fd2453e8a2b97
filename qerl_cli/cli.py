"""The ``qerl`` command line: one Typer app, one module per command under ``commands/``.

Commands only parse flags into a config dataclass and call the stage's library function;
``guarded`` turns a ``QerlError`` into one line on stderr and its exit code.
"""

from __future__ import annotations

import functools
import os
import sys

import typer

from qerl_cli.errors import OutOfMemoryError, QerlError

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


# Out of memory anywhere in a stage: the flag that lowers its peak memory.
OOM_HINTS = {
    "quantize": "pass --device cpu (host memory stays near three layers), or free the GPU",
    "rollout": "lower --max-num-seqs (and --batch-prompts) or --max-model-len",
    "train-step": "lower --micro-batch-tokens or --logits-chunk-tokens",
    "merge": "merge holds one tensor at a time; free host memory (and GPU memory for --dtype nvfp4)",
    "eval": "lower --max-num-seqs or --max-model-len",
}


def _is_oom(e: BaseException) -> bool:
    torch = sys.modules.get("torch")
    return isinstance(e, MemoryError) or (torch is not None and isinstance(e, torch.OutOfMemoryError))


def guarded(fn, stage: str | None = None):
    """Wrap a command: QerlError -> 'error: ...' on stderr and its exit code; an out-of-memory the
    stage did not handle itself -> OutOfMemoryError (exit 6) naming the flag to lower;
    KeyboardInterrupt -> 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if not _is_oom(e):
                    raise
                what = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                raise OutOfMemoryError(f"out of memory in {stage or 'qerl'}: {what}; nothing was written",
                                       hint=OOM_HINTS.get(stage or "", None)) from None
        except QerlError as e:
            if os.environ.get("QERL_DEBUG"):
                raise
            print(f"error: {e}", file=sys.stderr)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            resume = " (a rerun resumes its saved groups)" if stage == "rollout" else ""
            print(f"interrupted: --out was not written{resume}", file=sys.stderr)
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
        app.command(name, help=module.HELP, short_help=module.SHORT, no_args_is_help=True)(guarded(module.command, name))


_register()


def main() -> None:
    app()
