"""What the ``train-step`` stage says: the progress bar, notes and warnings, and the result line.

Notes and the progress bar go to stderr, the result line (or "already done") to stdout, as the other stages; under
torchrun rank 0 alone speaks (``_say``, ``_warn``), unless a note is a rank's own. ``result_line`` is also the CLI's
under -q (``commands/train_step.py``), where the step itself prints nothing.
"""

from __future__ import annotations

import sys
import warnings

from qerl_cli.errors import QerlWarning
from qerl_cli.train import distributed


class _NoProgress:
    def advance(self):
        pass

    def stop(self):
        pass


class _RichProgress:
    def __init__(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.p = Progress(TextColumn("train-step"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          transient=True, console=_console())
        self.task = self.p.add_task("micro-batches", total=total)
        self.p.start()

    def advance(self):
        self.p.advance(self.task)

    def stop(self):
        self.p.stop()


def _console():
    from rich.console import Console

    return Console(file=sys.stderr)


def _progress(cfg, dist, total):
    if cfg.progress and dist.is_main and sys.stderr.isatty():
        return _RichProgress(total)
    return _NoProgress()


def _warn(msg: str, held: list[str] | None = None) -> None:
    """A warning of the step, the same on every torchrun rank: rank 0 alone gives it (each rank did, so 8 GPUs
    printed each line 8 times; a review). Another rank's goes to ``held``, where given, for the caller to say."""
    if distributed.main_by_environment():
        warnings.warn(QerlWarning(msg), stacklevel=3)
    elif held is not None:
        held.append(msg)


def _say(cfg, msg: str, result: bool = False, every_rank: bool = False) -> None:
    """Notes and warnings to stderr; the result line (and "already done") to stdout, as the other stages.
    Under torchrun only rank 0 speaks, unless the note is the rank's own (``every_rank``: it names the rank)."""
    if cfg.progress and (every_rank or distributed.main_by_environment()):
        print(msg, file=sys.stdout if result else sys.stderr)


def result_line(out, manifest: dict, already_done: bool = False) -> str:
    """The line a finished (or already done) step prints on stdout: with progress, by train_step; under
    -q, by the CLI (the result and warnings were lost with the progress bar; docs audit, session 44)."""
    if already_done:
        return f"already done: {out} holds this step (pass --force to redo it)"
    metrics = manifest.get("metrics", {})
    return f"step {metrics.get('step')} -> {out}: {_result_numbers(metrics)}"


def _result_numbers(metrics: dict) -> str:
    """The result line's numbers; a value the metrics could not hold as a float (None) reads n/a (a
    reward of 1.7e308 overflowed the mean, and formatting None failed after --out was written; audit)."""
    def f(key: str, spec: str) -> str:
        v = metrics.get(key)
        return "n/a" if v is None else format(v, spec)

    return (f"loss {f('loss', '.4g')}, reward {f('reward_mean', '.3f')}, grad norm {f('grad_norm', '.3g')}, "
            f"{f('tokens_per_s', '.0f')} tok/s")
