"""One error type for every stage, with an exit code per kind of failure.

Stages raise ``QerlError`` (or a subclass) for anything the user can fix; the CLI prints the
message as one line on stderr and exits with ``exit_code``. Anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations


class QerlError(Exception):
    """A failure the user can act on. The message is one line and names the file/flag/tensor."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        msg = super().__str__()
        return f"{msg} ({self.hint})" if self.hint else msg


class QerlWarning(UserWarning):
    """Something the user should know that does not stop the stage (``warnings.warn``; the CLI prints it
    as one ``warning: ...`` line on stderr, a library caller sees it through Python's warnings)."""


class BadInputError(QerlError):
    """Malformed, missing or inconsistent input files or flags."""

    exit_code = 2


class LineageError(QerlError):
    """Inputs made for a different base model or adapter (hash mismatch)."""

    exit_code = 3


class OutputExistsError(QerlError):
    """The output directory exists with different inputs and --force was not given."""

    exit_code = 4


class OtherGpuModelError(OutputExistsError):
    """An eval begun on another GPU model (stopped there, or finished there and to be scored again with some problems
    generated anew), which this one would go on with other numerics. Exit 4 as any refusal; its own kind so that a
    script running the stage can tell it from "made from other inputs" (``QERL_ERROR_FILE``: the recipes' note on
    going on only on a GPU of that model)."""


class OutputBusyError(OutputExistsError):
    """Another qerl run is writing the same --out, or wrote it while this one ran. Not exit 4: a loop that
    redoes an exit-4 stage with --force (the recipes' FORCE=1) would replace what the other run made."""

    exit_code = 8


# Sampled log-probs that are NaN/Inf: the logits were (rollout, eval).
NONFINITE_LOGITS_HINT = "the forward overflows: run with --dtype bf16 or fp32 (fp16 overflows easily), or check --adapter"


class NumericalError(QerlError):
    """NaN/Inf in weights, logits or loss."""

    exit_code = 5


class OutOfMemoryError(QerlError):
    """The device ran out of memory; the message says which flag to lower."""

    exit_code = 6


class OutputWriteError(QerlError):
    """The file system refused to write the output (no space, no permission, a file in the way);
    nothing was left at --out."""

    exit_code = 7
