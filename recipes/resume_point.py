"""The step a resumed RL loop (grpo.sh, submit.sh) may start qerl from: the last step with a finished adapter,
where every adapter before it belongs to the same run. Prints that step, or 0 (go through every step).

    python3 recipes/resume_point.py RUN_DIR STEPS

Why: each finished stage a rerun starts again costs a qerl process (~2 s) or, on Slurm, a GPU job, only to say
"already done". The last finished step's own stages still check the current config and inputs (their
fingerprints hold both); what they cannot see is an earlier step made otherwise, e.g. by an interrupted
FORCE=1 redo with other flags. So every adapter up to that step must record the same train-step config as it,
and each one's input adapter must be the one before it (the hash train-step records, rebuilt here from the
previous manifest's file hashes). Standard library only: it runs on the host even where qerl runs in a container.
Python 3.6 too (annotations quoted, no ``from __future__ import annotations``): the host's python3 is 3.6 on RHEL 8
and CentOS 7, where the resume shortcut was silently gone (a SyntaxError; a review, session 59).
"""

import hashlib
import json
import sys
from pathlib import Path

# qerl_cli.train.inputs._adapter_inputs_hash: these files of an input adapter, in this order, where present.
ADAPTER_INPUT_FILES = ("adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors",
                       "trainer_state.json", "norms.safetensors")


def files_hash(outputs: dict, names) -> str:
    """The hash qerl_cli.hashing.dir_hash gives the files ``names`` (in this order, where present) of an output whose
    manifest lists their sha256 in ``outputs``."""
    h = hashlib.sha256()
    for name in names:
        if name in outputs:
            h.update(name.encode())
            h.update(outputs[name].encode())
    return h.hexdigest()


def adapter_inputs_hash(outputs: dict) -> str:
    return files_hash(outputs, ADAPTER_INPUT_FILES)


def manifest(run_dir: Path, step: int) -> "dict | None":
    try:
        m = json.loads((run_dir / f"step-{step:06d}" / "adapter" / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("stage") == "train-step" else None


def resume_point(run_dir: Path, steps: int) -> int:
    last = next((s for s in range(steps - 1, 0, -1) if manifest(run_dir, s) is not None), 0)
    if last == 0:
        return 0
    chain = [manifest(run_dir, s) for s in range(last + 1)]
    if any(m is None or not isinstance(m.get("inputs"), dict) or not isinstance(m.get("outputs"), dict)
           for m in chain):
        return 0
    if any(m.get("config") != chain[-1].get("config") for m in chain) or "adapter" in chain[0]["inputs"]:
        return 0
    for prev, m in zip(chain, chain[1:]):
        if m["inputs"].get("adapter") != adapter_inputs_hash(prev["outputs"]):
            return 0
    return last


def main(argv: "list[str]") -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: resume_point.py RUN_DIR STEPS", file=sys.stderr)
        return 2
    print(resume_point(Path(argv[0]), int(argv[1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
