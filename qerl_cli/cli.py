"""The ``qerl`` command line: one Typer app, one module per command under ``commands/``.

Commands only parse flags into a config dataclass and call the stage's library function;
``guarded`` turns a ``QerlError`` into one line on stderr and its exit code.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import platform
import re
import shutil
import signal
import sys
import textwrap
import threading
import warnings

import typer
from typer.core import TyperCommand, TyperGroup

from qerl_cli import __version__
from qerl_cli.errors import BadInputError, OutOfMemoryError, QerlError, QerlWarning


def _click_exceptions():
    """The click exceptions Typer raises: its own vendored copy since typer 0.2x, click's before."""
    try:
        from typer._click import exceptions
    except ImportError:  # an older typer on click itself
        from click import exceptions
    return exceptions


def current_context():
    """The running command's click context, or None (Typer's vendored click since typer 0.2x, click's before)."""
    try:
        from typer._click.globals import get_current_context
    except ImportError:
        from click import get_current_context
    return get_current_context(silent=True)


def repeated_flag(command, args: list[str]) -> str | None:
    """The repeatable flag (``--shards``, ``--reward``, ``--stop``) given a second value without its name, if any:
    a bare word right after such a flag's value (the stages take no positional arguments; eval only with --compare)."""
    multi = {o for p in getattr(command, "params", ()) if getattr(p, "multiple", False) for o in p.opts}
    for i in range(1, len(args)):
        if args[i].startswith("-"):
            continue
        named = args[i - 1].split("=", 1)[0] if args[i - 1].startswith("--") and "=" in args[i - 1] else None
        named = named if named in multi else args[i - 2] if i >= 2 and args[i - 2] in multi else None  # --shards=a b
        if named:
            return named
    return None


def _repeat_hint(command, args: list[str], message: str) -> str:
    """For `--shards a b`: the flag takes one value and is repeated (Click said only "unexpected extra argument b")."""
    if "unexpected extra argument" not in message:
        return ""
    named = repeated_flag(command, args)
    return f"; {named} takes one value, repeated for several ({named} A {named} B)" if named else ""


def _usage_error(e, command_path: str, root, extra: str = "") -> None:
    """A flag-parsing error as one `error:` line on stderr, exit 2, as every other bad input: Click and Typer
    printed the usage, a hint and a Rich box (five lines, no `error:`; docs audit, session 44). Only where
    the app runs standalone (the `qerl` command, CliRunner): a caller of ``app(..., standalone_mode=False)``
    gets click's exception, as before."""
    if not getattr(root, "standalone", True):
        raise e
    print(f"error: {e.format_message()}{extra} (see `{command_path} --help`)", file=sys.stderr)
    sys.exit(e.exit_code)


class _OneLineUsageErrors:
    """make_context for the group and the stages: a usage error (missing, unknown or ill-typed flag) as
    one line; no arguments at all still print the help."""

    def make_context(self, info_name, args, parent=None, **extra):
        exceptions = _click_exceptions()
        help_error = getattr(exceptions, "NoArgsIsHelpError", ())  # click >= 8.2; older click prints the help itself
        given = list(args)  # click's parser consumes the list it is given
        try:
            ctx = super().make_context(info_name, args, parent=parent, **extra)
            ctx.meta["qerl.args"] = given  # for eval, whose stray word is no usage error (it takes --compare's dirs)
            return ctx
        except help_error:
            raise  # the help, printed
        except exceptions.UsageError as e:
            path = e.ctx.command_path if e.ctx is not None else " ".join(
                x for x in (parent.command_path if parent is not None else "", info_name or "") if x)
            _usage_error(e, path, parent.find_root().command if parent is not None else self,
                         _repeat_hint(self, given, e.format_message()))


class _SwitchesShowNoType:
    """get_params for the group and the stages: no type beside a switch. Typer's Rich help showed `<bool>` beside
    --force, --quiet, --help and every other switch, as if each took a value; `--force true` is an error."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for p in params:
            if getattr(p, "is_flag", False) and p.metavar is None:
                p.metavar = ""  # what Rich's type column shows; a switch's plain help and errors use none
        return params


class _Group(_SwitchesShowNoType, _OneLineUsageErrors, TyperGroup):
    """The top level: an unknown command or top-level flag is one error line too."""

    standalone = True

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        self.standalone = standalone_mode
        return super().main(*args, standalone_mode=standalone_mode, **kwargs)

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except _click_exceptions().UsageError as e:
            _usage_error(e, ctx.command_path, self)


app = typer.Typer(
    cls=_Group,
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


# What a bug report needs: versions read from the installed distributions' metadata, so that
# `qerl --version` answers at once, without importing torch or transformers.
VERSION_DISTRIBUTIONS = ("torch", "triton", "transformers", "peft", "safetensors", "compressed-tensors",
                         "math-verify", "vllm")


def version_text() -> str:
    from importlib import metadata

    lines = [f"qerl {__version__}", f"  python {platform.python_version()}"]
    for dist in VERSION_DISTRIBUTIONS:
        try:
            found = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found = "not installed"
        lines.append(f"  {dist} {found}")
    return "\n".join(lines)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_text())
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", "-V", callback=_print_version, is_eager=True,
                                 help="Print qerl's version and its dependencies' versions, then exit."),
) -> None:
    pass


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
    if isinstance(e, MemoryError) or (torch is not None and isinstance(e, torch.OutOfMemoryError)):
        return True
    # torch's CPU allocator raises a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory")
    return isinstance(e, RuntimeError) and "can't allocate memory" in str(e)


class Terminated(KeyboardInterrupt):
    """SIGTERM (Slurm's pre-emption or time limit, ``kill``), raised where the stage is, so that it
    cleans up as after Ctrl-C: its temporary output removed, a rollout's finished groups kept. A
    requeued job usually lands on another node, whose reruns leave a foreign host's temporaries alone."""


def _raise_terminated(signum, frame):
    # Once: a second SIGTERM (a process-group kill on top of the one grpo.sh passes on) raised again
    # inside the clean-up the first started, and cut it short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


STOP_WITH_PARENT_ENV = "QERL_STOP_WITH_PARENT"


def _stop_with_parent() -> None:
    """With ``QERL_STOP_WITH_PARENT=1`` (recipes/grpo.sh sets it), SIGTERM this stage when the process
    that started it dies (Linux ``PR_SET_PDEATHSIG``). grpo.sh runs each stage in a process group of its
    own so that a signal reaches it once; a SIGKILL or SIGQUIT of the script's group (``timeout -k``, a CI
    cancel, Ctrl-\\) then left the stage running on its own, still writing (a review). Off by default:
    a stage started by hand under ``nohup`` must outlive its shell."""
    if os.environ.get(STOP_WITH_PARENT_ENV) != "1" or not sys.platform.startswith("linux"):
        return None
    import ctypes
    import ctypes.util

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return None
    except (OSError, AttributeError):
        return None
    # The parent died before prctl: re-parented, nobody will signal. Not "parent is PID 1", which a live
    # parent may be (a container's entrypoint; a review).
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
    return libc


def _stop_with_parent_off(libc) -> None:
    """Clear the death signal at the stage's end: a process that goes on (the library API) keeps none."""
    if libc is not None:
        libc.prctl(1, 0, 0, 0, 0)


def interrupt_outcome(e: KeyboardInterrupt) -> tuple[str, int]:
    """(the word a stopped stage's line starts with, its exit code): SIGTERM 143, Ctrl-C 130."""
    return ("terminated (SIGTERM)", 143) if isinstance(e, Terminated) else ("interrupted", 130)


@contextlib.contextmanager
def _stage_signals():
    """SIGTERM raises ``Terminated`` for the stage's length (main thread only; the old handler after).
    torch is imported first with SIGINT and SIGTERM held: torch's C setup imports NumPy and drops any
    exception raised meanwhile, so a Ctrl-C there was lost and the stage ran on to exit 0 (and a bash
    loop with it). Held, the signal is raised the moment the import is done."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _raise_terminated)
    libc = None
    try:
        libc = _stop_with_parent()
        if "torch" not in sys.modules and hasattr(signal, "pthread_sigmask"):
            held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            try:
                import torch  # noqa: F401
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
        yield
    finally:
        _stop_with_parent_off(libc)
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def _plain_warnings():
    """A stage's QerlWarning as one `warning: ...` line on stderr, every time, instead of Python's
    `file:line: QerlWarning: ...` shown once; other warnings as Python shows them."""
    show = warnings.showwarning

    def plain(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, QerlWarning):
            print(f"warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always", QerlWarning)
        warnings.showwarning = plain
        yield


def _bad_path(e: Exception) -> BadInputError | None:
    """A path no file system call can take (a name over the length limit, a symlink loop) as bad input: it
    was a traceback (exit 1) from whichever check first touched it (a review)."""
    if isinstance(e, OSError) and e.errno in (errno.ENAMETOOLONG, errno.ELOOP):
        return BadInputError(f"{e.filename}: {e.strerror}", hint="check the paths given")
    if type(e) is RuntimeError and str(e).startswith("Symlink loop"):  # Path.resolve() before Python 3.13
        return BadInputError(f"{str(e).removeprefix('Symlink loop from ')}: a symlink loop", hint="check the paths given")
    return None


def _expand_home(value):
    """A path flag's leading ``~`` as the user's home: the shell expands none after ``=`` (``--out=~/x``), nor in
    a quoted or Slurm-templated argument, and the stage then wrote a directory named ``~`` under the working
    directory while it printed ``wrote ~/x`` (a review)."""
    from pathlib import Path

    if isinstance(value, Path) and value.parts[:1] and value.parts[0].startswith("~"):
        try:
            return value.expanduser()
        except RuntimeError:  # no home directory to expand to: leave it as given
            return value
    if isinstance(value, (list, tuple)):
        return type(value)(_expand_home(v) for v in value)
    return value


def guarded(fn, stage: str | None = None):
    """Wrap a command: QerlError -> 'error: ...' on stderr and its exit code; an out-of-memory the
    stage did not handle itself -> OutOfMemoryError (exit 6) naming the flag to lower;
    KeyboardInterrupt -> 130; SIGTERM -> the same clean-up, exit 143."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from qerl_cli import outputs

        outputs.forget_completed()
        kwargs = {k: _expand_home(v) for k, v in kwargs.items()}
        try:
            try:
                with _stage_signals(), _plain_warnings():
                    return fn(*args, **kwargs)
            except Exception as e:
                bad = _bad_path(e)
                if bad is not None:
                    raise bad from None
                if not _is_oom(e):
                    raise
                what = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                # A rollout (eval) appends finished prompt groups (problems) to its partial directory as it goes:
                # they stay.
                kept = (f"--out was not written; {outputs.KEPT_FOR_RERUN[stage]} finished before it are kept for a "
                        "rerun" if stage in outputs.KEPT_FOR_RERUN else "nothing was written")
                raise OutOfMemoryError(f"out of memory in {stage or 'qerl'}: {what}; {kept}",
                                       hint=OOM_HINTS.get(stage or "", None)) from None
        except QerlError as e:
            if os.environ.get("QERL_DEBUG"):
                raise
            print(f"error: {e}", file=sys.stderr)
            record_error(e)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt as e:
            saved = outputs.KEPT_FOR_RERUN.get(stage)
            resume = f" (a rerun resumes its saved {saved.split()[-1]})" if saved else ""
            word, code = interrupt_outcome(e)
            done = outputs.completed_outputs()
            if done:  # after the rename: the output is whole, only the summary lines were cut short
                print(f"{word} after --out was written: {done[-1]} is complete (a rerun says already done)",
                      file=sys.stderr)
            elif "out" in kwargs and kwargs["out"] is None:  # eval --compare: it reads finished evals, writes nothing
                # (it said "--out was not written (a rerun resumes its saved problems)": grpo.sh's log after a Ctrl-C
                # in its last line, `qerl eval --compare`, offered a resume that does not exist; a review, session 57)
                print(f"{word}: nothing was written", file=sys.stderr)
            elif (rank := _writer_elsewhere()) is not None:
                print(f"{word}: torchrun rank {rank} stopped (rank 0 alone writes --out: its line, or a rerun's "
                      "\"already done\", says whether it was written)", file=sys.stderr)
            else:
                print(f"{word}: --out was not written{resume}", file=sys.stderr)
            raise typer.Exit(code) from None

    return wrapper


ERROR_FILE_ENV = "QERL_ERROR_FILE"


def record_error(e: QerlError) -> None:
    """With ``QERL_ERROR_FILE=PATH`` (the recipes set it for each stage), append ``CODE KIND MESSAGE`` to PATH: why the
    stage failed, for the script that ran it. It told one refusal (exit 4) from another by nothing (any eval's exit 4
    got the note on an eval begun on another GPU model, ``OtherGpuModelError``), and torchrun exits 1 whatever its
    ranks' codes (any failure of a multi-GPU train job got the refusal's note; a review, session 59). Not read from
    the stage's stderr, which stays the terminal (through a pipe its live progress ends). Each torchrun rank appends
    its own line. Best effort: a file that cannot be written leaves the script without the reason, nothing else."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{e.exit_code} {type(e).__name__} {' '.join(str(e).split())}\n")
    except OSError:
        pass


def _writer_elsewhere() -> str | None:
    """This process's RANK when it is a torchrun rank other than 0, which never writes --out: its "--out was not
    written" contradicted rank 0's "after --out was written: ... is complete" when both were stopped after rank 0's
    rename (a review, session 55). None otherwise, or when the variables are not numbers."""
    try:
        multi, rank = int(os.environ.get("WORLD_SIZE", "1")) > 1, int(os.environ.get("RANK", "0"))
    except ValueError:
        return None
    return str(rank) if multi and rank != 0 else None


def exit_on_resumable_stop(e: KeyboardInterrupt, kept, one: str, many: str, note: str | None = None) -> None:
    """The stop line of a stage that keeps its finished work (rollout's groups, eval's problems) in its partial
    directory: how many of how many are saved, and where; ``kept`` is (saved, total, partial dir), or None when
    the stop came before generating. Re-raises when --out is already whole, which ``guarded`` says."""
    from rich.console import Console

    from qerl_cli import outputs

    if outputs.completed_outputs():
        raise e
    word, code = interrupt_outcome(e)
    if kept is None:
        what = "stopped before generating; rerun the same command to start or resume"
    elif kept[0] == 0:
        what = f"no {one} was saved yet (0 of {kept[1]}{f'; {note}' if note else ''}); rerun the same command"
    else:
        what = (f"{kept[0]} of {kept[1]} {many} are saved in {kept[2]}{f' ({note})' if note else ''}; "
                "rerun the same command to resume")
    Console(stderr=True, highlight=False).print(f"{word}: {what}", soft_wrap=True, markup=False)  # one line, also in a piped log
    raise typer.Exit(code) from None


# Below this many columns Rich squeezes the option table until flag names are cut short
# ("--prompts-per-s…"); an 80-column terminal, or help piped to a file (Rich then assumes 80),
# gets click's plain layout instead, which wraps the text and never truncates a name.
RICH_HELP_MIN_COLUMNS = 100


def help_columns() -> int:
    """Width the help is laid out for: Typer's TERMINAL_WIDTH, else COLUMNS or the terminal, else 80."""
    forced = os.environ.get("TERMINAL_WIDTH", "")
    return int(forced) if forced.isdigit() else shutil.get_terminal_size((80, 24)).columns


_Context = TyperCommand.context_class  # the click Typer runs on (typer 0.29 vendors its own)


_QUOTED = re.compile(r"\$?'[^']*'|\"[^\"]*\"")
_FLAG_VALUE = re.compile(r"(?<!\S)(--?[A-Za-z][\w-]*) (?=([^\s-][^ ]*))")  # `--out DIR`: a flag and the word after it
_GLUE = "\u00a0"  # a space textwrap does not break at


def _glue_example(text: str, room: int) -> str:
    """``text`` (an example) with the spaces inside its quoted values glued, and a flag glued to its value where the
    pair fits in ``room`` columns: wrapped, `--out \\` / `adapters/step-1` read as a flag without a value."""
    text = _QUOTED.sub(lambda m: m[0].replace(" ", _GLUE), text)
    return _FLAG_VALUE.sub(lambda m: m[1] + _GLUE if len(m[1]) + 1 + len(m[2]) <= room else m[0], text)


def _wrap(text: str, width: int, indent: str = "", hang: str = "", command: bool = False) -> list[str]:
    """Lines of ``text``; a flag in it is never split at its hyphens (--max-|new-tokens), nor a quoted value
    of its example (`--system-prompt 'You are a careful` / `mathematician.'` pasted a newline into it), nor
    (where they fit on a line) a flag and its value. ``command``: all of ``text`` is an example command."""
    width = max(width, 20)
    at = 0 if command else text.find("Example")
    if at >= 0:
        text = text[:at] + _glue_example(text[at:], width - len(indent) - len(hang))
    lines = textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent + hang,
                          break_on_hyphens=False, break_long_words=False) or [indent]
    return [line.replace(_GLUE, " ") for line in lines]


def _wrap_command(line: str, width: int, indent: str) -> list[str]:
    """An example command line wrapped for a narrow terminal as a shell would still run it: every line
    it continues on ends in `` \\`` (wrapped bare, a pasted example broke at the first wrap)."""
    text = line.strip()
    lead = indent + " " * (len(line) - len(line.lstrip()))
    if text.startswith("#"):  # a comment ends at the newline: a backslash there continues nothing, so each
        # wrapped piece is a comment of its own (wrapped with ` \\`, the second piece ran as a command)
        return _wrap(text.lstrip("#").strip(), width - len(indent), lead + "# ")
    continued = text.endswith("\\")
    text = text.removesuffix("\\").rstrip()
    pieces = _wrap(text, width - len(indent) - 2, lead, "    ", command=True)
    return [p + " \\" if i < len(pieces) - 1 or continued else p for i, p in enumerate(pieces)]


def _wrap_examples(help_text: str, width: int) -> str:
    """``help_text`` with each example paragraph (indented) wrapped to ``width`` as `_wrap_command` wraps it."""
    paras = textwrap.dedent(help_text).strip("\n").split("\n\n")
    return "\n\n".join("\n".join(w for line in p.splitlines() for w in _wrap_command(line, width, ""))
                       if p.startswith("  ") else p for p in paras)


class _PlainFormatter(_Context.formatter_class):
    def write_dl(self, rows, col_max: int = 30, col_spacing: int = 2) -> None:
        rows = list(rows)
        term_width = min(max((len(term) for term, _ in rows), default=0), col_max) + col_spacing
        indent = " " * (self.current_indent + term_width)
        for term, text in rows:
            lines = _wrap(text.replace("\\[", "["), self.width - len(indent))  # Rich's markup escape
            head = " " * self.current_indent + term
            if len(term) + col_spacing > term_width:  # a long term gets its own line
                self.write(head + "\n")
                head = indent
            self.write(head.ljust(len(indent)) + lines[0] + "\n")
            for line in lines[1:]:
                self.write(indent + line + "\n")


class _PlainContext(_Context):
    formatter_class = _PlainFormatter


class StageCommand(_SwitchesShowNoType, _OneLineUsageErrors, TyperCommand):
    """A stage's command: Rich help where the option table fits, plain help where it would not."""

    context_class = _PlainContext

    def format_help(self, ctx, formatter) -> None:
        if help_columns() >= RICH_HELP_MIN_COLUMNS:
            # Rich wraps an example longer than the terminal bare, as the plain layout once did: pasted, the
            # shell ran the first line alone (`--reward format=0.1` dropped) and the rest as commands. Wrap
            # them here first, to the width Rich leaves inside its one-column padding on each side.
            text, self.help = self.help, _wrap_examples(self.help or "", help_columns() - 2)
            try:
                return super().format_help(ctx, formatter)
            finally:
                self.help = text
        mode, self.rich_markup_mode = self.rich_markup_mode, None
        try:
            return super().format_help(ctx, formatter)
        finally:
            self.rich_markup_mode = mode

    def parse_args(self, ctx, args):
        # With no arguments Typer raises NoArgsIsHelpError, whose Rich handler prints nothing: Rich's
        # help has printed itself while the error was built. The plain help is only a string, so print it.
        if not args and self.no_args_is_help and not ctx.resilient_parsing and help_columns() < RICH_HELP_MIN_COLUMNS:
            typer.echo(ctx.get_help())
            ctx.exit(2)
        return super().parse_args(ctx, args)

    def format_help_text(self, ctx, formatter) -> None:
        """Prose paragraphs wrapped; an indented paragraph (an example command) kept line by line."""
        indent = " " * (formatter.current_indent + 2)
        for para in textwrap.dedent(self.help or "").strip("\n").split("\n\n"):
            formatter.write_paragraph()
            if para.startswith("  "):
                lines = [w for line in para.splitlines() for w in _wrap_command(line, formatter.width, indent)]
            else:
                lines = _wrap(" ".join(para.split()), formatter.width - len(indent), indent)
            formatter.write("\n".join(lines) + "\n")


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
        app.command(name, cls=StageCommand, help=module.HELP, short_help=module.SHORT,
                    no_args_is_help=True)(guarded(module.command, name))


_register()


def use_expandable_segments() -> None:
    """Let the CUDA caching allocator grow segments by pages (unless the user configured it): a stage's
    freed tensors then go back to the driver page by page. With fixed segments, fusing the q/k/v and
    gate/up weights of a 32B bf16 model left 16.7 GiB reserved that nothing could use (78.24 GiB
    reserved for 61.53 allocated; 61.58 with this, H100, benchmarks/probe_fuse_memory.py), and the KV
    cache, sized from the driver's free memory, lost it all. Read when CUDA starts: set before torch."""
    if os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        return
    # torch before 2.10 reads only the old name for CUDA (2.9.1 ignores the new one there); later ones
    # take the new name. Read from the package metadata: importing torch here would start too early.
    os.environ[_alloc_conf_variable()] = "expandable_segments:True"


def _alloc_conf_variable() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(x) for x in version("torch").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return "PYTORCH_CUDA_ALLOC_CONF"
    return "PYTORCH_ALLOC_CONF" if (major, minor) >= (2, 10) else "PYTORCH_CUDA_ALLOC_CONF"


def main() -> None:
    from qerl_cli.outputs import record_invocation

    try:
        record_invocation(sys.argv[1:])
        use_expandable_segments()
        app()  # a stage's own stop (guarded) exits inside; before the stage, Typer builds the command table
    except KeyboardInterrupt:
        _stopped_while_starting()
    except SystemExit as e:
        # Typer turns a Ctrl-C while it parses the flags into a silent exit 130 (the stop line then missing)
        if e.code == 130 and isinstance(getattr(e.__context__, "__cause__", None), KeyboardInterrupt):
            _stopped_while_starting()
        raise


def _stopped_while_starting() -> None:
    from qerl_cli.__main__ import stopped_while_starting

    stopped_while_starting()
