"""Plot an RL run's learning curves: reward and entropy per step, pass@1 where evaluated.

    python recipes/plot_run.py RUN_DIR [--out RUN_DIR/curves.png]

Reads RUN_DIR/metrics.jsonl (one line per `qerl train-step`) and the `metrics.json` of
RUN_DIR/eval-base, RUN_DIR/step-*/eval and RUN_DIR/eval-final (`qerl eval`). Prints the
table it plots, so a run is readable without an image viewer.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def load_train_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"error: {path} not found (is {run} a qerl run directory?)")
    return read_steps(path)


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


def load_evals(run: Path, steps: int) -> list[tuple[int, float]]:
    """(policy step, pass@1): the base policy counts as step -1, the final one as the last step."""
    found = []
    if (run / "eval-base" / "metrics.json").exists():
        found.append((-1, run / "eval-base"))
    for d in sorted(run.glob("step-*/eval")):
        found.append((int(re.search(r"step-(\d+)", str(d)).group(1)), d))
    if (run / "eval-final" / "metrics.json").exists():
        found.append((steps - 1, run / "eval-final"))
    return [(s, json.loads((d / "metrics.json").read_text())["score"]) for s, d in found]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    train = load_train_metrics(args.run)
    evals = load_evals(args.run, len(train))

    print(f"{'step':>5} {'reward':>8} {'entropy':>8}")
    for r in train:
        print(f"{r['step']:>5} {r['reward_mean']:>8.3f} {r['entropy']:>8.3f}")
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
    axes[0].plot(steps, [r["reward_mean"] for r in train], marker="o", ms=3)
    axes[0].set(title="mean reward (rollouts)", xlabel="step")
    axes[1].plot(steps, [r["entropy"] for r in train], marker="o", ms=3, color="tab:orange")
    axes[1].set(title="policy entropy (nats/token)", xlabel="step")
    if evals:
        axes[2].plot([s + 1 for s, _ in evals], [100 * v for _, v in evals], marker="s", color="tab:green")
    axes[2].set(title="test pass@1 (%)", xlabel="adapter after step (0 = base)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"qerl run: {args.run}")
    fig.tight_layout()
    out = args.out or args.run / "curves.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
