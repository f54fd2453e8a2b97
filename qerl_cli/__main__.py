import sys

STARTING_STOP = "interrupted while starting: nothing was written"


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


def run() -> None:
    """The CLI's entry point (``python -m qerl_cli``, the ``qerl`` script): the CLI module is imported here,
    where a Ctrl-C during its import is caught (the script's own top-level import would not be)."""
    try:
        try:
            from qerl_cli.cli import main
        except KeyboardInterrupt:
            stopped_while_starting()
        main()
    finally:
        forget_caught_interrupts()


if __name__ == "__main__":
    run()
