"""Run one `qerl` stage and print where a module is first imported (qerl, transformers, peft and torch frames).

    python benchmarks/trace_import.py torch._dynamo [--depth 12] -- rollout --model QDIR --prompts P --out D ...

A heavy import found this way is a fixed cost of every stage process: torch._dynamo takes 4-6 s on the
H100 machine (docs/benchmarks.md, RL loop). Prints "never imported" when the stage finishes without it.
"""

from __future__ import annotations

import builtins
import sys
import traceback


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    target, argv = sys.argv[1], sys.argv[2:]
    depth = 12
    if argv[:1] == ["--depth"]:
        depth, argv = int(argv[1]), argv[2:]
    argv = argv[1:] if argv[:1] == ["--"] else argv
    real_import = builtins.__import__
    found: list[str] = []

    def watch(name, *args, **kwargs):
        if not found and name.startswith(target) and target not in sys.modules:
            stack = [f for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename]
            found.append("\n".join(f"  {f.filename}:{f.lineno}  {f.line}" for f in stack[-depth:]))
        return real_import(name, *args, **kwargs)

    builtins.__import__ = watch
    from qerl_cli.cli import main as qerl_main

    sys.argv = ["qerl", *argv]
    try:
        qerl_main()
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        builtins.__import__ = real_import
        print(f"\n# {target}: " + (f"first imported from\n{found[0]}" if found else "never imported"), file=sys.stderr)


if __name__ == "__main__":
    main()
