import sys

STARTING_STOP = "interrupted while starting: nothing was written"


def stopped_while_starting() -> None:
    """Ctrl-C before a stage began (qerl's modules importing, the command table being built: the first
    second of every run) as one line and exit 130, as a stop anywhere later; it was a KeyboardInterrupt
    traceback of importlib and Typer frames (exit by SIGINT) that hid whether anything was written."""
    print(STARTING_STOP, file=sys.stderr)
    sys.exit(130)


def run() -> None:
    """The CLI's entry point (``python -m qerl_cli``, the ``qerl`` script): the CLI module is imported here,
    where a Ctrl-C during its import is caught (the script's own top-level import would not be)."""
    try:
        from qerl_cli.cli import main
    except KeyboardInterrupt:
        stopped_while_starting()
    main()


if __name__ == "__main__":
    run()
