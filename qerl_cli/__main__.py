"""The CLI's entry point (``python -m qerl_cli`` and the ``qerl`` script): how a qerl process starts and ends.

Starting: the CLI module is imported inside ``run`` so a Ctrl-C during the first second (imports, Typer's command
table) is one line and exit 130. Ending: a finished command leaves through ``exit_now``, which flushes, runs the
atexit handlers and calls ``os._exit`` with the status: the trade is skipping the interpreter's teardown (about a
second a stage with torch loaded, and a window where a SIGTERM killed a finished stage) against work a normal exit
would do, so it falls back to Python's own exit wherever something could still be pending (threads, tracers, a
failed flush, ``QERL_FULL_EXIT=1``). Library calls never reach this module.
"""

import os
import sys

STARTING_STOP = "interrupted while starting: nothing was written"
FULL_EXIT_ENV = "QERL_FULL_EXIT"


def stopped_while_starting() -> None:
    """Ctrl-C before a stage began (qerl's modules importing, the command table being built: the first
    second of every run) as one line and exit 130, as a stop anywhere later; it was a KeyboardInterrupt
    traceback of importlib and Typer frames (exit by SIGINT) that hid whether anything was written."""
    print(STARTING_STOP, file=sys.stderr)
    sys.exit(130)


def forget_caught_interrupts() -> None:
    """Under ``python -m`` (torchrun's ranks, the recipes' ``QERL="python -m qerl_cli"``) a Ctrl-C that passed through
    code run by ``exec``/``eval`` of a string (class bodies that dataclasses, namedtuple and typing build while a
    module imports) leaves CPython's "unhandled KeyboardInterrupt" flag set even when it was caught: the process
    then killed itself by SIGINT after its stop line (a caller saw -2, not 130; Python 3.11). Running one string
    clears it; an interrupt nobody caught still sets it again, and ends the process by SIGINT as before."""
    exec("pass")  # a string on purpose: only that path resets the flag


def exit_now(code) -> None:
    """End the process with the stage's exit status once its output is flushed and the atexit handlers have run,
    without the interpreter's teardown. With torch, transformers and peft loaded (1,800 modules, 240,000 objects)
    that teardown is several full garbage collections and torch's C++ destructors: 0.5-2 s after the result line
    on a busy 2-core node (perf, session 55), every stage of a RL loop, and a SIGTERM meanwhile (Slurm, grpo.sh
    passing one on) killed the finished stage by that signal (143 in the shell, not a word). Here a SIGINT or SIGTERM
    ends it with its own status. Returns, leaving Python's own exit to the caller, where this could skip work:
    a non-daemon thread still running (Python joins it first), ``sys.exit("text")`` (printed), stdout or stderr
    failing to flush (Python says so and exits 120), a tracer or profiler to write out, ``QERL_FULL_EXIT=1``."""
    import atexit
    import signal
    import threading

    if code is not None and not isinstance(code, int):
        return
    if os.environ.get(FULL_EXIT_ENV) == "1" or _observed():
        return
    if threading.current_thread() is not threading.main_thread():
        return
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    code = code or 0
    if not _flushed():
        return
    for signum in (signal.SIGINT, signal.SIGTERM):
        # one its starter ignores stays ignored (a script's `qerl ... &` ignores Ctrl-C): it cut the handlers short
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, lambda *_: os._exit(code))
    atexit._run_exitfuncs()  # logging's flush, weakref.finalize (temporary directories), multiprocessing's joins
    code = code if _flushed() else 120
    _flush_c_stdio()
    os._exit(code)


def _observed() -> bool:
    """A tracer or profiler that writes its results when the program returns: one set by ``sys.settrace`` or
    ``sys.setprofile`` (coverage, cProfile on Python 3.10-3.11), or, from Python 3.12, a ``sys.monitoring`` tool,
    which neither shows: cProfile itself is one there (``python -m cProfile -o x.prof -m qerl_cli ...`` wrote
    no file at all; a review)."""
    if sys.gettrace() is not None or sys.getprofile() is not None:
        return True
    monitoring = getattr(sys, "monitoring", None)
    return monitoring is not None and any(monitoring.get_tool(i) is not None for i in range(6))


def _flush_c_stdio() -> None:
    """C's stdio buffers, which ``exit()`` flushes and ``os._exit`` does not: what a C library wrote with
    printf (NCCL_DEBUG's lines go to C's stdout, block-buffered into a Slurm log) lost its last block (a review)."""
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no C library to reach (CDLL(None) is POSIX only)
        pass


def _flushed() -> bool:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            return False
    return True


def run() -> None:
    """The CLI's entry point (``python -m qerl_cli``, the ``qerl`` script): the CLI module is imported here,
    where a Ctrl-C during its import is caught (the script's own top-level import would not be). The process
    ends in ``exit_now``; a traceback (a bug) goes through Python's own exit."""
    try:
        try:
            from qerl_cli.cli import main
        except KeyboardInterrupt:
            stopped_while_starting()
        try:
            main()
        except SystemExit as e:
            exit_now(e.code)
            raise
        exit_now(0)
    finally:
        forget_caught_interrupts()


if __name__ == "__main__":
    run()
