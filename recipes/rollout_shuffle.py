"""Whether a run's rollouts were made with ``--shuffle``, as the manifests of the first step (below STEPS) holding a
finished one record it: prints 1 or 0, or nothing where no step holds a finished rollout (none, or one under way:
its directory has no manifest yet).

    python3 recipes/rollout_shuffle.py RUN_DIR STEPS

Why: the recipes pass ``rollout --shuffle`` per SHUFFLE (recipes/lib.sh, ``qerl_resolve_shuffle``), whose ``auto``
keeps a run dir begun without it (before the knob) in file order: the flag is part of every rollout's fingerprint, so
turning it on there made the next rollout refuse (exit 4). A step's rollout is grpo.sh's ``shards`` or a Slurm
chain's ``shards-<i>``; the first step's is read (step 0's, unless its directory was pruned to free space). Rollouts of
that step that disagree (a step both scripts rolled out, with other flags) exit 3 naming them. Standard library only:
it runs on the host even where qerl runs in a container, on Python 3.6 too (annotations quoted, no ``from
__future__ import annotations``): the host's python3 is 3.6 on RHEL 8 and CentOS 7, where SHUFFLE=auto exited 2
(a SyntaxError; a review, session 59).
"""

import json
import re
import sys
from pathlib import Path


def recorded_shuffle(rollout_dir: Path) -> "bool | None":
    """``config.shuffle`` of a finished rollout's manifest (False where qerl recorded none: older than the flag), or
    None where ``rollout_dir`` holds no finished rollout."""
    try:
        m = json.loads((rollout_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("stage") != "rollout" or not isinstance(m.get("config"), dict):
        return None
    return m["config"].get("shuffle") is True


def step_shuffle(step_dir: Path) -> "dict[str, bool]":
    """{directory name: recorded shuffle} of the step's finished rollouts (shards, shards-<i>)."""
    names = sorted(p.name for p in step_dir.glob("shards*") if re.fullmatch(r"shards(-[0-9]+)?", p.name))
    found = {n: recorded_shuffle(step_dir / n) for n in names}
    return {n: s for n, s in found.items() if s is not None}


def main(argv: "list[str]") -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: rollout_shuffle.py RUN_DIR STEPS", file=sys.stderr)
        return 2
    for step in range(int(argv[1])):
        step_dir = Path(argv[0]) / f"step-{step:06d}"
        found = step_shuffle(step_dir) if step_dir.is_dir() else {}
        if len(set(found.values())) > 1:
            print(f"{step_dir}: its rollouts disagree on --shuffle: "
                  + ", ".join(f"{n} {'with' if s else 'without'} it" for n, s in found.items()), file=sys.stderr)
            return 3
        if found:
            print(int(next(iter(found.values()))))
            return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
