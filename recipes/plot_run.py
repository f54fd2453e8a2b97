"""Plot an RL run's learning curves: reward and entropy per step, pass@1 where evaluated.

    python recipes/plot_run.py RUN_DIR [--out RUN_DIR/curves.png]

Reads RUN_DIR/metrics.jsonl (one line per `qerl train-step`) and the `metrics.json` of
RUN_DIR/eval-base, RUN_DIR/step-*/eval and RUN_DIR/eval-final (`qerl eval`). Prints the
table it plots, so a run is readable without an image viewer. Only the steps and evals of the run
that made step 0 are shown (`this_run`): a FORCE=1 rerun with fewer STEPS leaves the earlier run's
later steps in RUN_DIR, and they are left out with a note.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from resume_point import adapter_inputs_hash, files_hash  # noqa: E402  (a sibling script, not a package)

# qerl_cli.adapters.adapter_hash: the files of an adapter that rollout, eval and merge record as inputs["adapter"].
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def peft_hash(outputs: dict) -> str:
    """qerl_cli.adapters.adapter_hash (hashing.dir_hash over PEFT_FILES), rebuilt from an adapter manifest's file
    hashes: what an eval or merge of that adapter records as its inputs["adapter"]."""
    return files_hash(outputs, sorted(PEFT_FILES))


def read_manifest(d: Path, stage: str) -> dict | None:
    """``d``'s manifest.json when a ``stage`` output wrote it (with its inputs and outputs), else None."""
    try:
        m = json.loads((d / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("stage") != stage:
        return None
    return m if isinstance(m.get("inputs"), dict) and isinstance(m.get("outputs"), dict) else None


def step_dir(run: Path, step: int) -> Path:
    return run / f"step-{step:06d}"


def this_run(run: Path) -> tuple[int | None, dict[int, dict]]:
    """(the first step that is not this run's, or None; this run's adapter manifests by step). This run is the one
    that made step 0: its steps are the adapters from step 0 on, each trained from the one before it (the input
    hash train-step records) with the same --total-steps. A FORCE=1 rerun with fewer STEPS redoes steps 0..STEPS-1
    and leaves the earlier run's later steps, whose adapters descend from the earlier run's: the table and plot
    showed them, and their evals, as this run's. A step without an adapter manifest (its directory deleted to free
    space) cannot be checked: the next step is taken on trust, and the shared --total-steps still holds."""
    numbers = [int(m.group(1)) for d in run.glob("step-*") if (m := re.fullmatch(r"step-(\d+)", d.name))]
    chain: dict[int, dict] = {}
    prev, total = None, None
    for s in range(max(numbers, default=-1) + 1):
        m = read_manifest(step_dir(run, s) / "adapter", "train-step")
        if m is None:
            prev = None
            continue
        steps = (m.get("config") or {}).get("total_steps")
        total = total if total is not None else steps
        if ((prev is not None and m["inputs"].get("adapter") != adapter_inputs_hash(prev["outputs"]))
                or (steps is not None and steps != total) or (total is not None and s >= total)):
            return s, chain
        chain[s] = prev = m
    return None, chain


def load_train_metrics(run: Path, cut: int | None = None) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"error: {path} not found (is {run} a qerl run directory?)")
    return this_runs_rows(run, read_steps(path), cut)


def this_runs_rows(run: Path, rows: list[dict], cut: int | None) -> list[dict]:
    """``rows`` before step ``cut`` (this_run), with a note naming the later steps left out."""
    if cut is None:
        return rows
    later = sorted(int(m.group(1)) for d in run.glob("step-*") if (m := re.fullmatch(r"step-(\d+)", d.name))
                   and int(m.group(1)) >= cut)
    if later:
        print(f"note: {run}: left out step-{later[0]:06d}" + (f" .. step-{later[-1]:06d}" if len(later) > 1 else "")
              + f": not made by the run of steps 0-{cut - 1} (an earlier run's later steps, left by a FORCE=1 rerun"
              " with fewer STEPS, or a rerun still going)", file=sys.stderr)
    return [r for r in rows if r["step"] < cut]


def read_steps(path: Path) -> list[dict]:
    """One row per step of a metrics.jsonl, in step order: a forced rerun of a step replaces its line, and a
    line that is not a step's JSON (torn by a kill mid-append or a full disk; train-step keeps such lines) is
    skipped with a note: it ended the plot in a traceback, and quickstart.sh with it (a review)."""
    by_step, torn = {}, 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            by_step[int(row["step"])] = row
        except (ValueError, KeyError, TypeError):
            torn += 1
    if torn:
        print(f"note: {path}: skipped {torn} line(s) that are not a step's metrics", file=sys.stderr)
    return [by_step[s] for s in sorted(by_step)]


def value(row: dict, key: str) -> float:
    """``row[key]`` as a float; NaN (a gap in the curve) where the line holds no number: train-step writes a
    non-finite value as null (JSON has no NaN; an older qerl's reward mean of 1e308s overflowed to one), and the
    table's format of that None ended the plot in a traceback (a review)."""
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) else math.nan


def cell(row: dict, key: str) -> str:
    """``row[key]`` for the table: three decimals, or n/a where the line holds no number (``value``)."""
    v = value(row, key)
    return "n/a" if math.isnan(v) else f"{v:.3f}"


def load_evals(run: Path, last: int, cut: int | None = None, chain: dict[int, dict] | None = None
               ) -> list[tuple[int, float]]:
    """(policy step, pass@1): the base policy counts as step -1, the final one as the step merged/ was made from
    (``last``, the last step, where no manifest says). A step's eval counts where it scored this run's adapter
    (this_run's ``cut`` and ``chain``): one of an earlier run's adapter stays when the rerun does not evaluate that
    step (fewer STEPS, another EVAL_EVERY)."""
    chain = chain or {}
    found = []
    if (run / "eval-base" / "metrics.json").exists():
        found.append((-1, run / "eval-base"))
    for d in sorted(run.glob("step-*/eval")):
        s = int(re.search(r"step-(\d+)", str(d)).group(1))
        if (cut is None or s < cut) and _scored(d, chain.get(s)):
            found.append((s, d))
        else:
            print(f"note: {d} is left out: it scored an earlier run's adapter", file=sys.stderr)
    if (run / "eval-final" / "metrics.json").exists():
        final = final_step(run, chain)
        if final is False:
            print(f"note: {run / 'eval-final'} is left out: merged/ was not made from this run's steps "
                  "(a rerun not finished yet)", file=sys.stderr)
        else:
            found.append((last if final is None else final, run / "eval-final"))
    return [(s, json.loads((d / "metrics.json").read_text())["score"]) for s, d in found]


def _scored(eval_dir: Path, adapter: dict | None) -> bool:
    """Whether the eval in ``eval_dir`` scored ``adapter`` (its manifest); True where a manifest is missing."""
    m = read_manifest(eval_dir, "eval")
    return m is None or adapter is None or m["inputs"].get("adapter") == peft_hash(adapter["outputs"])


def final_step(run: Path, chain: dict[int, dict]) -> int | bool | None:
    """The step of this run (``chain``) whose adapter merged/ holds; False where it holds none of them (merged/
    is an earlier run's), None where that cannot be told (no merge manifest, no adapter manifests)."""
    m = read_manifest(run / "merged", "merge")
    if m is None or not chain:
        return None
    return next((s for s, a in chain.items() if peft_hash(a["outputs"]) == m["inputs"].get("adapter")), False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cut, chain = this_run(args.run)
    train = load_train_metrics(args.run, cut)
    evals = load_evals(args.run, train[-1]["step"] if train else -1, cut, chain)

    print(f"{'step':>5} {'reward':>8} {'entropy':>8}")
    for r in train:
        print(f"{r['step']:>5} {cell(r, 'reward_mean'):>8} {cell(r, 'entropy'):>8}")
    for s, score in evals:
        print(f"pass@1 {'of the base policy' if s < 0 else f'after step {s:>3}'}: {100 * score:.1f}%")

    try:
        import matplotlib
    except ImportError:
        raise SystemExit("error: plotting needs matplotlib: pip install 'qerl[plot]' (or matplotlib)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    steps = [r["step"] for r in train]
    axes[0].plot(steps, [value(r, "reward_mean") for r in train], marker="o", ms=3)
    axes[0].set(title="mean reward (rollouts)", xlabel="step")
    axes[1].plot(steps, [value(r, "entropy") for r in train], marker="o", ms=3, color="tab:orange")
    axes[1].set(title="policy entropy (nats/token)", xlabel="step")
    if evals:
        axes[2].plot([s + 1 for s, _ in evals], [100 * v for _, v in evals], marker="s", color="tab:green")
    # x: steps taken, so the table's "after step 4" (steps 0-4) is at 5; "adapter after step" read as step 5's.
    axes[2].set(title="test pass@1 (%)", xlabel="RL steps taken (0 = the base policy)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"qerl run: {args.run}")
    fig.tight_layout()
    out = args.out or args.run / "curves.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
