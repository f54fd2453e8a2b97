"""The summary of a rollout shard: reward mean/std per function, completion lengths, the fraction of zero-variance
groups (which carry no GRPO signal); the manifest's ``summary`` (``summarize``) and the table the command prints at
the end of a run (``summary_table``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def _stats(xs: Sequence[float]) -> dict:
    if not xs:
        return {"mean": None, "std": None, "min": None, "max": None}
    return {
        "mean": statistics.fmean(xs),
        "std": statistics.pstdev(xs) if len(xs) > 1 else 0.0,
        "min": min(xs),
        "max": max(xs),
    }


def summarize(groups: Sequence[Sequence[dict]], reward_names: Sequence[str]) -> dict:
    """Reward mean/std per function, completion length stats, zero-variance groups."""
    recs = [r for g in groups for r in g]
    lengths = [len(r["completion_token_ids"]) for r in recs]
    totals = [r["reward"] for r in recs]
    per_fn = {name: _stats([r["rewards"][name] for r in recs if name in r["rewards"]]) for name in reward_names}
    zero_var = sum(1 for g in groups if len({r["reward"] for r in g}) <= 1)
    length_stats = _stats(lengths)
    if lengths:
        length_stats["p50"] = statistics.median(lengths)
    return {
        "groups": len(groups),
        "completions": len(recs),
        "reward": _stats(totals),
        "rewards": per_fn,
        "completion_tokens": length_stats,
        "truncated_fraction": (sum(r["finish_reason"] == "length" for r in recs) / len(recs)) if recs else None,
        "zero_variance_group_fraction": (zero_var / len(groups)) if groups else None,
    }


def summary_table(summary: dict):
    """A rich Table of a rollout summary (for the command's end-of-run print)."""
    from rich.table import Table

    def f(x, digits=3):
        return "-" if x is None else (f"{x:.{digits}f}" if isinstance(x, float) else str(x))

    t = Table(title=f"rollout {summary.get('shard', '')}".strip(), show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("prompts (groups)", f"{summary['groups']} ({summary.get('resumed_groups', 0)} resumed)")
    t.add_row("completions", str(summary["completions"]))
    if summary.get("skipped_long_prompts"):
        t.add_row("skipped: prompt too long", str(summary["skipped_long_prompts"]))
    if summary.get("skipped_bad_rows"):
        t.add_row("skipped: bad prompt rows", str(summary["skipped_bad_rows"]))
    r = summary["reward"]
    t.add_row("reward (weighted) mean ± std", f"{f(r['mean'])} ± {f(r['std'])}")
    for name, s in summary["rewards"].items():
        t.add_row(f"  {name} mean ± std", f"{f(s['mean'])} ± {f(s['std'])}")
    c = summary["completion_tokens"]
    t.add_row("completion tokens mean / p50 / min / max",
              f"{f(c['mean'], 1)} / {f(c.get('p50'), 1)} / {f(c['min'])} / {f(c['max'])}")
    t.add_row("truncated (--max-new-tokens or the context)", f(summary["truncated_fraction"]))
    t.add_row("zero-variance groups", f(summary["zero_variance_group_fraction"]))
    sigma = summary.get("sigma")  # %g: a fixed 6 decimals printed 0.000000 for a sigma under 5e-7 that was on
    t.add_row("AQN sigma", "-" if sigma is None else f"{sigma:.3g}")
    thr = summary.get("throughput", {})
    if thr.get("generated_tokens"):
        t.add_row("generated tokens / s", f"{thr['generated_tokens']} in {thr['generate_s']:.1f}s = {thr['tokens_per_s']:.1f} tok/s")
    return t
