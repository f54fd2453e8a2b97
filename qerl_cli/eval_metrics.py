"""Benchmark statistics for `qerl eval`: pass@k, confidence intervals, length stats, run tables.

pass@k uses the unbiased estimator of Chen et al. (2021): with ``n`` samples of which ``c`` are
correct, ``pass@k = 1 - C(n-c, k) / C(n, k)``, averaged over problems. Taking the best of k of
the n samples directly (or ``1 - (1-c/n)^k``) is biased; the combinatorial form is exact in
expectation. It is computed as a running product, ``prod_{i=n-c+1..n} (1 - k/i)``, because
``C(n, k)`` overflows floats for the n of a large sampling run.

The 95% interval is Wilson's score interval over problems. For greedy pass@1 every problem is a
Bernoulli trial and the interval is the textbook one. For pass@k with several samples the
per-problem score is a fraction in [0, 1]; its variance is at most p(1-p), so treating the mean
as a binomial proportion over the problems gives an interval at least as wide as the true one
(conservative), without a bootstrap. It says how much the score would move on another draw of
problems of the same kind -- the number that matters when comparing two checkpoints.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

from qerl_cli.answers import ANSWER_KINDS
from qerl_cli.errors import BadInputError

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased probability that at least one of k samples drawn from the n is correct."""
    if not (0 <= c <= n) or k < 1:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and k >= 1, got n={n} c={c} k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    # 1 - C(n-c, k)/C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i)
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """Mean pass@k over problems given (n, c) per problem."""
    if not counts:
        raise ValueError("no problems to score")
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)


def wilson_interval(p_hat: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a proportion ``p_hat`` measured on ``n`` trials."""
    if n <= 0:
        return (0.0, 1.0)
    p_hat = min(max(p_hat, 0.0), 1.0)
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p_hat + z2 / (2 * n)) / denom
    half = z * math.sqrt(p_hat * (1 - p_hat) / n + z2 / (4 * n * n)) / denom
    lo, hi = max(0.0, centre - half), min(1.0, centre + half)
    # analytically exact at the ends; float rounding would otherwise leave 0.9999999999999999
    return (0.0 if p_hat == 0.0 else lo, 1.0 if p_hat == 1.0 else hi)


def k_values(max_k: int) -> list[int]:
    """The k's reported for ``--k max_k``: 1, powers of two below it, and max_k itself."""
    ks, k = [], 1
    while k < max_k:
        ks.append(k)
        k *= 2
    ks.append(max_k)
    return ks


def length_stats(lengths: Sequence[int]) -> dict:
    """Completion length summary in tokens (mean, percentiles, min, max)."""
    if not lengths:
        return {"mean": 0.0, "p50": 0, "p90": 0, "min": 0, "max": 0}
    xs = sorted(lengths)

    def pct(q: float) -> int:
        # nearest-rank percentile: an observed length, not an interpolation
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]

    return {
        "mean": round(sum(xs) / len(xs), 2),
        "p50": pct(0.5),
        "p90": pct(0.9),
        "min": xs[0],
        "max": xs[-1],
    }


def score_block(counts: Sequence[tuple[int, int]], ks: Sequence[int]) -> dict:
    """{"pass@k": {"value", "ci95"}} for each k, from (n, c) per problem."""
    out = {}
    for k in ks:
        v = mean_pass_at_k(counts, k)
        lo, hi = wilson_interval(v, len(counts))
        out[f"pass@{k}"] = {"value": round(v, 6), "ci95": [round(lo, 6), round(hi, 6)]}
    return out


# ---- reading and comparing finished runs -------------------------------------------------
METRICS = "metrics.json"
SAMPLES = "samples.jsonl"


def read_metrics(eval_dir: Path) -> dict:
    """metrics.json of a finished eval directory; BadInputError naming the path otherwise."""
    path = Path(eval_dir) / METRICS
    if not Path(eval_dir).is_dir():
        raise BadInputError(f"--compare: {eval_dir} is not a directory")
    if not path.exists():
        raise BadInputError(f"--compare: {path} not found (is {eval_dir} a finished `qerl eval` output?)")
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise BadInputError(f"--compare: {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or "scores" not in data:
        raise BadInputError(f"--compare: {path} has no 'scores' (not written by `qerl eval`)")
    return data


def _fmt_score(entry: dict | None) -> str:
    if not entry:
        return "-"
    lo, hi = entry["ci95"]
    return f"{100 * entry['value']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def rules_used(metrics: dict) -> set[str]:
    """The answer rules whose versions decide a finished eval's verdicts: those it scored with (``scored_with``), and
    under ``--scorer auto`` gsm8k too, which reads each reference to choose its problem's rule (gsm8k 4 moved "~18"
    to math: an eval that scored with math alone may score otherwise under a new gsm8k rule); none recorded: all."""
    used = set(metrics.get("scored_with") or ANSWER_KINDS)
    return used | {"gsm8k"} if metrics.get("scorer", "auto") == "auto" else used


def _rule_version(m: dict, kind: str) -> str:
    """The version of the answer rule ``kind`` a run was scored by, as JSON: qerl's (``scorer_version``) and, for the
    math rule, the packages its verdicts come from (``scorer_packages``, none recorded before they were: unknown, as a
    missing ``scorer_version``)."""
    version = [(m.get("scorer_version") or {}).get(kind)]
    if kind == "math":
        version.append(m.get("scorer_packages"))
    return json.dumps(version, sort_keys=True)


def _scored_by_other_versions(metrics: Sequence[dict]) -> bool:
    """Whether two runs scored with a rule (``rules_used``) under other versions of it. Only among the runs it scored:
    a gsm8k-only run's math versions (another node's sympy, none before they were recorded) are moot, and its rerun,
    already done, keeps them, so the warning's advice could not clear them."""
    kinds = {k for m in metrics for k in rules_used(m)}
    return any(len({_rule_version(m, k) for m in metrics if k in rules_used(m)}) > 1 for k in kinds)


def compare_table(eval_dirs: Sequence[Path]):
    """A rich Table with one column per run: scores with 95% CI, counts, lengths, time.

    Runs on different datasets are still shown side by side, but the dataset row makes the
    mismatch visible (their scores are not comparable).
    """
    from rich.markup import escape
    from rich.table import Table

    runs = [(Path(d), read_metrics(d)) for d in eval_dirs]
    ks = sorted({int(k.split("@")[1]) for _, m in runs for k in m["scores"]})
    table = Table(title="qerl eval: side by side (scores in %, 95% CI)", show_lines=False)
    table.add_column("", style="bold")
    for name in _column_names([d for d, _ in runs]):  # escaped, as the names below: Rich markup, "run [x]" lost "[x]"
        table.add_column(escape(name), justify="right")

    def row(label, fn):
        table.add_row(label, *[fn(m) for _, m in runs])

    row("model", lambda m: escape(Path(m.get("model", "?")).name))
    row("adapter", lambda m: escape(Path(m["adapter"]).name) if m.get("adapter") else "-")
    row("dataset", lambda m: escape(f"{Path(m.get('dataset', '?')).name} ({m.get('dataset_hash', '')[:8]})"))
    row("problems", lambda m: str(m["counts"]["problems"]))
    row("samples/problem", lambda m: str(m["counts"]["samples_per_problem"]))
    row("temperature", lambda m: str(m.get("sampling", {}).get("temperature", "-")))
    for k in ks:
        row(f"pass@{k}", lambda m, k=k: _fmt_score(m["scores"].get(f"pass@{k}")))
    row("no answer", lambda m: f"{100 * m['counts']['no_answer'] / max(1, m['counts']['samples']):.1f}%")
    row("truncated", lambda m: f"{100 * m['counts']['truncated'] / max(1, m['counts']['samples']):.1f}%")
    row("mean length (tok)", lambda m: f"{m['lengths']['mean']:.0f}")
    row("time (s)", lambda m: f"{m['time']['total_s']:.1f}")
    row("scorer", lambda m: m.get("scorer", "-"))
    datasets = {m.get("dataset_hash") for _, m in runs}
    problems = {m["counts"]["problems"] for _, m in runs}
    notes = []
    if len(datasets) > 1:
        notes.append("warning: the runs used different datasets; their scores are not comparable")
    elif len(problems) > 1:
        notes.append("warning: the runs scored different numbers of problems; their scores are not comparable")
    first = runs[0][1]

    def same_problems(m) -> bool:
        return (m.get("dataset_hash"), m["counts"]["problems"]) == (first.get("dataset_hash"), first["counts"]["problems"])

    if any(same_problems(m) for _, m in runs[1:]):  # each run on the first's problems against it, problem by problem
        base = per_problem_pass1(runs[0][0])
        table.add_row("pass@1 vs first, paired", "-", *[
            _fmt_paired(paired_difference(base, per_problem_pass1(d))) if same_problems(m) else "other problems"
            for d, m in runs[1:]])
        notes.append("paired: the difference in points over the same problems, and a two-sided p-value: "
                     "exact McNemar where both runs took one sample a problem, else a paired sign-flip test")
    if len({m.get("scorer") for _, m in runs}) > 1:
        notes.append("warning: the runs were scored by different rules (--scorer)")
    elif _scored_by_other_versions([m for _, m in runs]):  # the rules the runs scored with ("scored_with")
        notes.append("warning: the runs were scored by different versions of the answer rules (a qerl, math-verify or "
                     "sympy upgrade); rerun each eval command to score its samples again with today's")
    settings = [_generation_settings(d, m) for d, m in runs]
    differ = [flag for flag in settings[0] if len({json.dumps(s[flag], sort_keys=True) for s in settings}) > 1]
    if differ:
        notes.append(f"warning: the runs were generated with different {', '.join(differ)}; a difference in "
                     "score may come from them, not from the model")
    made = _made_on_note([d for d, _ in runs], [_made_on(d, m) for d, m in runs])
    if made:
        notes.append(made)
    table.caption = "\n".join(notes) or None
    return table


def _manifest(eval_dir: Path) -> dict:
    """manifest.json of an eval directory, or {} where it is missing or unreadable."""
    try:
        manifest = json.loads((Path(eval_dir) / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _made_on(eval_dir: Path, m: dict) -> tuple[str, str, str | None] | None:
    """(device, dtype, GPU model) a run's samples were generated on, from metrics.json or, where it holds neither (not
    written by qerl eval), its manifest's config; None where neither says. The device's kind only: ``cuda:1`` and
    ``cuda`` are a node's GPUs, alike in numerics; the GPU model where metrics.json records one (``gpu``: none on a CPU,
    nor before 2026-11-28), as two models' kernels round otherwise."""
    config = _manifest(eval_dir).get("config") or {}
    device, dtype = m.get("device", config.get("device")), m.get("dtype", config.get("dtype"))
    if not isinstance(device, str) or not isinstance(dtype, str):
        return None
    from qerl_cli.runtime import device_kind

    gpu = m.get("gpu")
    return device_kind(device), dtype, gpu if isinstance(gpu, str) else None


def _made_on_note(dirs: Sequence[Path], made: Sequence[tuple[str, str, str | None] | None]) -> str | None:
    """A note where runs were generated on other devices, dtypes or GPU models: their samples differ by those numerics
    too (greedy decoding takes another token at a near tie), not by the policy alone. Runs that record none say
    nothing (unknown, not different), and a GPU model is compared only among the runs that record one (an A100's
    eval and an H100's both read "cuda (bf16)" until 2026-11-28)."""
    named = [(name, m) for name, m in zip(_column_names(dirs), made) if m is not None]
    kinds, gpus = {m[:2] for _, m in named}, {m[2] for _, m in named if m[2] is not None}
    if len(kinds) < 2 and len(gpus) < 2:
        return None
    from rich.markup import escape

    where: dict[tuple[str, str, str | None], list[str]] = {}
    for name, m in named:
        # grouped by the GPU model only where two are recorded: one model beside runs that record none tells no run
        # apart ("cuda (H100, bf16): a; cuda (bf16): b; cpu (fp32): c" read a and b as made on two devices)
        where.setdefault(m if len(gpus) > 1 else (*m[:2], None), []).append(name)
    # escaped: the caption is Rich markup, as the column names (a directory "a[/b]" was a MarkupError)
    listed = "; ".join(escape(f"{d} ({f'{g}, ' if g else ''}{t}): {', '.join(names)}") for (d, t, g), names in where.items())
    what = {(True, False): "devices or dtypes", (False, True): "GPU models"}.get((len(kinds) > 1, len(gpus) > 1),
                                                                                 "devices, dtypes or GPU models")
    return (f"note: the runs were generated on different {what} ({listed}); their samples differ by those "
            "numerics too, not by the model alone")


def _generation_settings(eval_dir: Path, m: dict) -> dict:
    """The flags besides the model that change what a run generates from the same problems (its prompts,
    where it stops), from metrics.json and, for those only the fingerprint holds, manifest.json."""
    manifest = _manifest(eval_dir)
    config = manifest.get("config") or {}
    sampling = m.get("sampling") or {}
    return {
        "--prompt-template": m.get("prompt_template", config.get("prompt_template")),
        "--system-prompt": config.get("system_prompt"),
        "--no-chat-template": config.get("chat_template"),
        "--chat-template-file": (manifest.get("inputs") or {}).get("chat_template"),
        "--chat-template-kwargs": config.get("chat_template_kwargs"),  # enable_thinking: another prompt altogether
        "--max-new-tokens": sampling.get("max_new_tokens", config.get("max_new_tokens")),
        "--stop": sampling.get("stop", config.get("stop")),
        "--top-p": sampling.get("top_p", config.get("top_p")),
    }


def per_problem_pass1(eval_dir: Path) -> dict[str, float] | None:
    """Each problem's fraction of correct samples (its pass@1), from ``samples.jsonl`` (None without it)."""
    right: dict[str, list[int]] = {}
    if not (Path(eval_dir) / SAMPLES).is_file():
        return None
    with open(Path(eval_dir) / SAMPLES) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                right.setdefault(str(r["id"]), []).append(bool(r["correct"]))
    return {i: sum(v) / len(v) for i, v in right.items()}


def paired_difference(a: dict[str, float] | None, b: dict[str, float] | None) -> dict | None:
    """b - a over the problems both scored: the mean difference (points) and a two-sided p-value. Both
    0/1 (one sample a problem): exact McNemar, a binomial test on the discordant problems. Else an exact
    sign-flip test on the per-problem differences (``_sign_flip_p``)."""
    if a is None or b is None:
        return None
    ids = sorted(a.keys() & b.keys())
    if not ids:
        return None
    d = [b[i] - a[i] for i in ids]
    mean = 100 * sum(d) / len(d)
    if all(a[i] in (0.0, 1.0) and b[i] in (0.0, 1.0) for i in ids):
        up, down = sum(x > 0 for x in d), sum(x < 0 for x in d)
        n = up + down
        tail = _binomial_tail(n, min(up, down))
        return {"diff": mean, "p": min(1.0, 2 * tail), "test": "McNemar", "discordant": (up, down)}
    # Each pass@1 exactly (c/n), the differences then too: a float difference c'/257 - c/256 has no fraction of
    # denominator <= 2^16 near it, and its approximations' common denominator sent 6 problems onto the normal
    # approximation (p = 0.042 for an exact 0.0625). Cached: a run's pass@1s take at most n + 1 values.
    exact: dict[float, Fraction] = {}

    def frac(x: float) -> Fraction:
        if x not in exact:
            exact[x] = Fraction(x).limit_denominator(1 << 16)  # c/n of n <= 65,536 samples, recovered as it is
        return exact[x]

    nz = [frac(b[i]) - frac(a[i]) for i in ids if b[i] != a[i]]
    p = _sign_flip_p(nz)
    return {"diff": mean, "p": min(1.0, p), "test": "sign-flip", "discordant": None}


def _binomial_tail(n: int, m: int) -> float:
    """P(X <= m) for X ~ Binomial(n, 1/2), exactly: each C(n, i) from the last (a math.comb per term cost
    O(n^3): 9 minutes for 50,000 discordant problems)."""
    if not n:
        return 1.0
    term = total = 1
    for i in range(m):
        term = term * (n - i) // (i + 1)
        total += term
    return total / 2**n


def _sign_flip_p(nz: Sequence[float | Fraction], max_states: int = 2_000_000) -> float:
    """Two-sided p-value of the paired sign-flip test on the nonzero differences ``nz`` (Fractions, exact; a
    float is read as the nearest fraction of denominator <= 2^16). Each is a difference of two fractions c/n
    of samples, so scaled by the common denominator they are integers and the null distribution of their
    signed sum is counted exactly, sum by sum (a few thousand sums for 200 problems of 8 samples; at most
    2^m for m differences, whatever their denominator). The normal approximation is used only where that
    table would be too large (it understated p by 40% at 16 nonzero differences: 0.046 for an exact 0.077)."""
    if not nz:
        return 1.0
    fr = [x if isinstance(x, Fraction) else Fraction(x).limit_denominator(1 << 16) for x in nz]
    scale = math.lcm(*(f.denominator for f in fr))
    ints = [abs(int(f * scale)) for f in fr]
    # the table's work: about sum(ints) sums a step, never more than 2^m for m differences however large
    if min(1 << min(len(ints), 62), sum(ints)) * len(ints) <= max_states:
        dist = {0: 1.0}
        for x in ints:
            nxt: dict[int, float] = {}
            for s, q in dist.items():
                nxt[s + x] = nxt.get(s + x, 0.0) + 0.5 * q
                nxt[s - x] = nxt.get(s - x, 0.0) + 0.5 * q
            dist = nxt
        obs = abs(sum(int(f * scale) for f in fr))
        return sum(q for s, q in dist.items() if abs(s) >= obs)
    xs = [float(f) for f in fr]
    z = abs(sum(xs)) / math.sqrt(sum(x * x for x in xs))
    return math.erfc(z / math.sqrt(2))


def _fmt_paired(r: dict | None) -> str:
    if r is None:
        return "-"
    extra = f", {r['discordant'][0]}/{r['discordant'][1]}" if r["discordant"] else ""
    return f"{r['diff']:+.1f} (p={r['p']:.2g}{extra})"


def _column_names(dirs: Sequence[Path]) -> list[str]:
    """Each run's directory name, with as many parent directories as it takes to tell runs apart
    (``a/run`` and ``b/run``, not ``run`` twice)."""
    dirs = [Path(d).resolve() for d in dirs]
    for depth in range(1, max(len(d.parts) for d in dirs) + 1):
        names = [str(Path(*d.parts[-depth:])) for d in dirs]
        if len(set(names)) == len(names):
            return names
    return [str(d) for d in dirs]  # the same directory given twice
