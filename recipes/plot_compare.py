"""Summarise recipes/compare_aqn.sh: curves per variant (mean over seeds) and final pass@1 with spread.

    python recipes/plot_compare.py OUT_DIR

Writes OUT_DIR/curves.png and OUT_DIR/results.md (a table to paste into docs/results.md) and
prints the table. Run directories are OUT_DIR/<variant>-s<seed> as written by compare_aqn.sh.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_run import final_step, read_steps, this_run, this_runs_rows, value  # noqa: E402  (a sibling script, not a package)

VARIANTS = ("bf16-lora", "nvfp4-lora", "nvfp4-aqn")


def load(out: Path) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = defaultdict(list)
    for d in sorted(out.glob("*-s*")):
        m = re.fullmatch(r"(.+)-s(\d+)", d.name)
        if not d.is_dir() or not m or not (d / "metrics.jsonl").exists():
            continue
        why = _unfinished(d)
        if why:  # its loop has not finished (interrupted, failed, running)
            print(f"note: {d.name} is left out: its loop has not finished ({why})", file=sys.stderr)
            continue
        # Only this run's steps (plot_run.this_run): a FORCE=1 rerun with fewer STEPS kept the earlier run's later
        # steps, whose reward was this table's "last-step reward" and whose curves were averaged in.
        cut, _ = this_run(d)
        train = this_runs_rows(d, read_steps(d / "metrics.jsonl"), cut)
        score = lambda p: json.loads((p / "metrics.json").read_text())["score"] if (p / "metrics.json").exists() else None  # noqa: E731
        runs[m.group(1)].append({"seed": int(m.group(2)), "train": train,
                                 "base": score(d / "eval-base"), "final": score(d / "eval-final")})
    return runs


def _unfinished(run: Path) -> str | None:
    """Why ``run``'s loop has not finished, or None: its merge must exist and be newer than every step's
    adapter (manifests' ``created``), else a finished run rerun with more STEPS or FORCE=1 and then stopped
    kept its old merged/ and eval-final/ beside newer steps, and counted as finished (a review)."""
    merged = run / "merged" / "manifest.json"
    if not merged.exists():
        return "no merged/"
    created = json.loads(merged.read_text()).get("created", "")
    for a in run.glob("step-*/adapter/manifest.json"):
        if json.loads(a.read_text()).get("created", "") > created:
            return f"{a.parent.parent.name} is newer than merged/"
    if final_step(run, this_run(run)[1]) is False:
        return "merged/ holds none of this run's adapters"
    return None


def _mean(xs) -> float:
    """Mean of the numbers in ``xs`` (``plot_run.value``: NaN where a line held null); NaN where there are none.
    statistics.mean over a null ended the table in a traceback (a review)."""
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.mean(xs) if xs else math.nan


def _at_steps(rs: list[dict], key: str) -> tuple[list[int], list[list[float]]]:
    """(the steps every run of ``rs`` has a line for, each run's ``key`` at them). By step number, not by line: a
    run missing a step's line had its later steps averaged with the other seeds' earlier ones (a review)."""
    steps = sorted(set.intersection(*({t["step"] for t in r["train"]} for r in rs)))
    return steps, [[value(by[s], key) for s in steps] for by in ({t["step"]: t for t in r["train"]} for r in rs)]


def _fmt(xs):
    missing = sum(x is None for x in xs)
    xs = [100 * x for x in xs if x is not None]
    if not xs:
        return "n/a"
    sd = f"{statistics.stdev(xs):.1f}" if len(xs) > 1 else "n/a"  # one seed has no spread to show
    return (f"{statistics.mean(xs):.1f} ± {sd} ({', '.join(f'{x:.1f}' for x in xs)})"
            + (f", {missing} without a score" if missing else ""))


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/compare")
    runs = load(out)
    if not runs:
        raise SystemExit(f"error: no finished runs under {out}")
    # the entropy of the first steps (3, or fewer where a run has fewer: "first 3 steps" over a 2-step run misled),
    # steps 0 .. first-1 by number (a run missing a step's line has fewer of them, not a later step instead)
    first = min([3] + [r["train"][-1]["step"] + 1 for rs in runs.values() for r in rs if r["train"]])
    steps = f"first {first} steps" if first > 1 else "first step"
    lines = [f"| variant | seeds | base pass@1 (%) | final pass@1 (%) mean ± sd (per seed) | last-step reward | mean entropy, {steps} |",
             "| --- | --- | --- | --- | --- | --- |"]
    for v in [v for v in VARIANTS if v in runs] + [v for v in runs if v not in VARIANTS]:
        rs = runs[v]
        trained = [r for r in rs if r["train"]]
        last_reward = _mean([value(r["train"][-1], "reward_mean") for r in trained])
        ent = _mean([_mean([value(t, "entropy") for t in r["train"] if t["step"] < first]) for r in trained])
        last_reward, ent = ("n/a" if math.isnan(x) else f"{x:.3f}" for x in (last_reward, ent))
        lines.append(f"| {v} | {len(rs)} | {_fmt([r['base'] for r in rs])} | {_fmt([r['final'] for r in rs])} "
                     f"| {last_reward} | {ent} |")
    table = "\n".join(lines)
    (out / "results.md").write_text(table + "\n")
    print(table)

    try:
        import matplotlib
    except ImportError:
        raise SystemExit("error: plotting needs matplotlib: pip install 'qerl[plot]' (or matplotlib)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for v, rs in runs.items():
        for ax, key in zip(axes, ("reward_mean", "entropy")):
            steps, per_run = _at_steps(rs, key)
            ax.plot(steps, [_mean(at) for at in zip(*per_run)] if steps else [], label=f"{v} (n={len(rs)})")
            for ys in per_run:
                ax.plot(steps, ys, alpha=0.15, color=ax.lines[-1].get_color())
    axes[0].set(title="mean rollout reward", xlabel="step")
    axes[1].set(title="policy entropy (nats/token)", xlabel="step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    print(f"wrote {out / 'curves.png'} and {out / 'results.md'}")


if __name__ == "__main__":
    main()
