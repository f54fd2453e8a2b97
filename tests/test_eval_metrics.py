"""pass@k estimator, Wilson interval, length stats and the --compare table."""

import itertools
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qerl_cli.errors import BadInputError
from qerl_cli.eval_metrics import (
    compare_table,
    k_values,
    length_stats,
    mean_pass_at_k,
    pass_at_k,
    score_block,
    wilson_interval,
)


def brute_pass_at_k(n, c, k):
    """Fraction of all k-subsets of n samples (c of them correct) holding a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


@given(st.integers(1, 200), st.data())
def test_pass_at_k_matches_closed_form(n, data):
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    want = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-9)


def test_pass_at_1_is_fraction_correct_and_monotone_in_k():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    vals = [pass_at_k(10, 3, k) for k in range(1, 11)]
    assert all(a <= b + 1e-15 for a, b in zip(vals, vals[1:]))
    assert vals[-1] == 1.0 and pass_at_k(10, 0, 5) == 0.0


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least 4 samples"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="no problems"):
        mean_pass_at_k([], 1)


def test_wilson_known_values():
    lo, hi = wilson_interval(0.5, 100)
    assert (lo, hi) == (pytest.approx(0.4038, abs=1e-4), pytest.approx(0.5962, abs=1e-4))
    # p_hat = 0 still gives a non-degenerate upper bound (the normal interval would give [0, 0])
    lo, hi = wilson_interval(0.0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson_interval(1.0, 10)
    assert hi == 1.0 and lo == pytest.approx(0.7225, abs=1e-4)


@given(st.floats(0, 1), st.integers(1, 10_000))
def test_wilson_contains_estimate(p, n):
    lo, hi = wilson_interval(p, n)
    assert 0.0 <= lo <= p + 1e-12 and p - 1e-12 <= hi <= 1.0


def test_k_values_and_score_block():
    assert k_values(1) == [1]
    assert k_values(8) == [1, 2, 4, 8]
    assert k_values(5) == [1, 2, 4, 5]
    block = score_block([(4, 0), (4, 2), (4, 4)], [1, 4])
    assert block["pass@1"]["value"] == pytest.approx(0.5)
    assert block["pass@4"]["value"] == pytest.approx(2 / 3, abs=1e-6)
    lo, hi = block["pass@1"]["ci95"]
    assert lo < 0.5 < hi


def test_length_stats():
    s = length_stats([5, 1, 3, 10, 2, 8, 7, 4, 6, 9])
    assert s == {"mean": 5.5, "p50": 5, "p90": 9, "min": 1, "max": 10}
    assert length_stats([])["mean"] == 0.0


def _fake_run(path, name, p1, dataset_hash="abc"):
    path.mkdir()
    m = {
        "model": f"/m/{name}",
        "adapter": None,
        "dataset": "/d/gsm8k.jsonl",
        "dataset_hash": dataset_hash,
        "sampling": {"temperature": 0.0},
        "scores": {"pass@1": {"value": p1, "ci95": [p1 - 0.1, p1 + 0.1]}},
        "counts": {"problems": 10, "samples_per_problem": 1, "samples": 10, "no_answer": 2, "truncated": 1},
        "lengths": {"mean": 12.0},
        "time": {"total_s": 3.0},
    }
    (path / "metrics.json").write_text(json.dumps(m))
    return path


def test_compare_table_renders_runs_side_by_side(tmp_path):
    from rich.console import Console

    a = _fake_run(tmp_path / "base", "base", 0.4)
    b = _fake_run(tmp_path / "trained", "trained", 0.7, dataset_hash="other")
    console = Console(record=True, width=200)
    console.print(compare_table([a, b]))
    text = console.export_text()
    assert "base" in text and "trained" in text
    assert "40.0 [30.0, 50.0]" in text and "70.0 [60.0, 80.0]" in text
    assert "different datasets" in text


def test_paths_in_the_tables_are_printed_as_they_are(tmp_path):
    # Table cells are Rich markup: "run [x]" was printed "run ", and "a[/b]" (a directory "a[" holding "b]") was a
    # closing tag without an opening one, a MarkupError after the eval had been written
    from rich.console import Console

    from qerl_cli.evaluate import render_metrics

    (tmp_path / "x" / "a[").mkdir(parents=True)
    (tmp_path / "y" / "a[").mkdir(parents=True)
    a = _fake_run(tmp_path / "x" / "a[" / "b]", "run [bf16]", 0.4)
    b = _fake_run(tmp_path / "y" / "a[" / "b]", "run [bf16]", 0.7)
    console = Console(record=True, width=300)
    console.print(compare_table([a, b]))
    text = console.export_text()
    assert "x/a[/b]" in text and "y/a[/b]" in text and "run [bf16]" in text, text
    m = json.loads((a / "metrics.json").read_text())
    m.update(model=str(a / "m"), counts={**m["counts"], "problems_solved": 4}, lengths={"mean": 1, "p90": 1, "max": 1})
    render_metrics(m, console)
    assert str(a / "m") in " ".join(console.export_text().split()), console.export_text()


def test_compare_names_runs_apart_and_flags_other_problem_counts(tmp_path):
    from rich.console import Console

    (tmp_path / "cmpA").mkdir()
    (tmp_path / "cmpB").mkdir()
    a = _fake_run(tmp_path / "cmpA" / "run", "base", 0.4)
    b = _fake_run(tmp_path / "cmpB" / "run", "trained", 0.7)
    m = json.loads((b / "metrics.json").read_text())
    m["counts"]["problems"] = 12  # same file, --max-problems 12
    (b / "metrics.json").write_text(json.dumps(m))
    console = Console(record=True, width=200)
    console.print(compare_table([a, b]))
    text = console.export_text()
    assert "cmpA/run" in text and "cmpB/run" in text  # both were headed "run"
    assert "different numbers of problems" in text


def test_compare_rejects_non_eval_dirs(tmp_path):
    with pytest.raises(BadInputError, match="not a directory"):
        compare_table([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInputError, match="metrics.json not found"):
        compare_table([tmp_path / "empty"])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.json").write_text("{")
    with pytest.raises(BadInputError, match="not valid JSON"):
        compare_table([tmp_path / "bad"])


def _samples(path, correct_by_id):
    path.joinpath("samples.jsonl").write_text("".join(
        json.dumps({"id": str(i), "sample": j, "correct": c}) + "\n"
        for i, cs in correct_by_id.items() for j, c in enumerate(cs)))


def test_paired_difference_mcnemar_and_sign_flip_against_direct_sums():
    from qerl_cli.eval_metrics import paired_difference

    base = {str(i): float(i < 120) for i in range(200)}
    tuned = {str(i): float(i < 132) for i in range(200)}
    r = paired_difference(base, tuned)  # 12 fixed, none broken: exact binomial 2 * 0.5^12
    assert r["test"] == "McNemar" and r["discordant"] == (12, 0)
    assert r["diff"] == pytest.approx(6.0) and r["p"] == pytest.approx(2 * 0.5**12)
    mixed = {str(i): float(i < 125) for i in range(200)}
    mixed["0"] = 0.0  # 5 fixed, 1 broken: 2 * (C(6,0) + C(6,1)) / 2^6
    assert paired_difference(base, mixed)["p"] == pytest.approx(2 * 7 / 64)
    # several samples a problem: every sign pattern of the nonzero differences, enumerated here
    a = {"0": 0.25, "1": 0.5, "2": 1.0, "3": 0.0}
    b = {"0": 0.75, "1": 0.5, "2": 0.75, "3": 0.5}
    d = [0.5, -0.25, 0.5]
    obs = abs(sum(d))
    want = sum(abs(sum(s * x for s, x in zip(signs, d))) >= obs - 1e-12
               for signs in itertools.product((1, -1), repeat=3)) / 8
    r = paired_difference(a, b)
    assert r["test"] == "sign-flip" and r["p"] == pytest.approx(want) and r["diff"] == pytest.approx(100 * 0.75 / 4)


def test_compare_pairs_runs_over_the_same_problems_and_flags_other_scorers(tmp_path):
    from rich.console import Console

    a = _fake_run(tmp_path / "base", "base", 0.6)
    b = _fake_run(tmp_path / "tuned", "tuned", 0.66)
    _samples(a, {i: [i < 6] for i in range(10)})
    _samples(b, {i: [i < 9] for i in range(10)})
    m = json.loads((b / "metrics.json").read_text())
    m["scorer"] = "math"
    (b / "metrics.json").write_text(json.dumps(m))
    console = Console(record=True, width=200)
    console.print(compare_table([a, b]))
    text = console.export_text()
    assert "+30.0 (p=0.25, 3/0)" in text and "McNemar" in text
    assert "scored by different rules" in text


def test_compare_still_pairs_the_runs_on_the_first_runs_problems_beside_one_on_other_problems(tmp_path):
    # A third run on another dataset dropped the paired row for every run (a user's trial).
    from rich.console import Console

    a = _fake_run(tmp_path / "base", "base", 0.6)
    b = _fake_run(tmp_path / "tuned", "tuned", 0.9)
    c = _fake_run(tmp_path / "math", "tuned", 0.5, dataset_hash="other")
    _samples(a, {i: [i < 6] for i in range(10)})
    _samples(b, {i: [i < 9] for i in range(10)})
    _samples(c, {i: [i < 5] for i in range(10)})
    console = Console(record=True, width=250)
    console.print(compare_table([a, b, c]))
    text = console.export_text()
    assert "+30.0 (p=0.25, 3/0)" in text and "other problems" in text and "different datasets" in text


def test_the_summary_table_says_the_rate_is_over_generation_time_only():
    # It printed "2.0s (3091.1 tok/s)": a rate over 0.18 s of generation beside the whole run's 2.0 s (a review).
    from rich.console import Console

    from qerl_cli.evaluate import render_metrics

    m = {"model": "/m", "dataset": "/d/t.jsonl", "scores": {"pass@1": {"value": 0.5, "ci95": [0.4, 0.6]}},
         "counts": {"problems": 2, "samples": 2, "problems_solved": 1, "no_answer": 0, "truncated": 0},
         "lengths": {"mean": 10.0, "p90": 12, "max": 14},
         "time": {"total_s": 2.026, "generate_s": 0.182, "tokens_per_s": 3091.1}}
    console = Console(record=True, width=200)
    render_metrics(m, console)
    assert "2.0s in all; generating 0.2s = 3091.1 tok/s" in console.export_text()
    m["time"] = {"total_s": 2.026, "generate_s": 0.0, "tokens_per_s": None}
    console = Console(record=True, width=200)
    render_metrics(m, console)
    assert "2.0s in all" in console.export_text() and "tok/s" not in console.export_text()


def test_compare_says_which_generation_settings_differ(tmp_path):
    # bf16 at --max-new-tokens 64 against NVFP4 at another --prompt-template: "-16.5 (p=2.3e-10, 0/33)" with no
    # word that the runs saw other prompts (a review)
    from rich.console import Console

    a = _fake_run(tmp_path / "base", "base", 0.6)
    b = _fake_run(tmp_path / "other", "tuned", 0.5)
    c = _fake_run(tmp_path / "same", "tuned", 0.5)
    for run, template, tokens in ((a, "{prompt}", 64), (b, "Q: {prompt}", 20), (c, "{prompt}", 64)):
        m = json.loads((run / "metrics.json").read_text())
        m["prompt_template"], m["sampling"]["max_new_tokens"] = template, tokens
        (run / "metrics.json").write_text(json.dumps(m))
    console = Console(record=True, width=250)
    console.print(compare_table([a, b]))
    assert "different --prompt-template, --max-new-tokens;" in " ".join(console.export_text().split())
    console = Console(record=True, width=250)
    console.print(compare_table([a, c]))
    assert "generated with different" not in console.export_text()


def test_compare_notes_runs_generated_on_other_devices_or_dtypes(tmp_path):
    # A GPU's bf16 samples against a CPU's fp32 ones were paired with no word that they differ by numerics too
    from rich.console import Console

    def caption(*runs):
        console = Console(record=True, width=400)
        console.print(compare_table(list(runs)))
        return " ".join(console.export_text().split())

    def made_on(run, device, dtype, where="metrics"):
        if where == "metrics":
            m = json.loads((run / "metrics.json").read_text())
            m.update(device=device, dtype=dtype)
            (run / "metrics.json").write_text(json.dumps(m))
        else:  # metrics.json without the fields (not written by qerl eval): the manifest says
            (run / "manifest.json").write_text(json.dumps({"stage": "eval", "config": {"device": device, "dtype": dtype}}))
        return run

    gpu = made_on(_fake_run(tmp_path / "gpu", "base", 0.6), "cuda", "bf16")
    gpu1 = made_on(_fake_run(tmp_path / "gpu1", "tuned", 0.7), "cuda:1", "bf16")
    cpu = made_on(_fake_run(tmp_path / "cpu [x]", "tuned", 0.7), "cpu", "fp32", where="manifest")
    unknown = _fake_run(tmp_path / "old", "tuned", 0.7)  # records neither: unknown, not different
    assert "devices or dtypes" not in caption(gpu, gpu1)  # one node's GPUs
    assert "devices or dtypes" not in caption(gpu, unknown)
    note = caption(gpu, gpu1, cpu, unknown)
    assert ("note: the runs were generated on different devices or dtypes (cuda (bf16): gpu, gpu1; cpu (fp32): cpu [x]); "
            "their samples differ by those numerics too, not by the model alone") in note
    assert "different devices or dtypes (cuda (fp16)" in caption(made_on(gpu, "cuda", "fp16"), gpu1)


def test_compare_notes_runs_generated_on_other_gpu_models(tmp_path):
    # metrics.json recorded "cuda" alone: an A100's eval and an H100's were paired with no word that their samples
    # differ by two kernels' roundings; it records the GPU model now, compared among the runs that record one
    from rich.console import Console

    def caption(*runs):
        console = Console(record=True, width=400)
        console.print(compare_table(list(runs)))
        return " ".join(console.export_text().split())

    def made_on(run, gpu):
        m = json.loads((run / "metrics.json").read_text())
        m.update(device="cuda", dtype="bf16", **({"gpu": gpu} if gpu != "unrecorded" else {}))
        (run / "metrics.json").write_text(json.dumps(m))
        return run

    h100 = made_on(_fake_run(tmp_path / "h", "base", 0.6), "NVIDIA H100 80GB HBM3")
    h100b = made_on(_fake_run(tmp_path / "h2", "tuned", 0.7), "NVIDIA H100 80GB HBM3")
    a100 = made_on(_fake_run(tmp_path / "a", "tuned", 0.7), "NVIDIA A100-SXM4-80GB")
    old = made_on(_fake_run(tmp_path / "old", "tuned", 0.7), "unrecorded")  # before the field: unknown, not different
    assert "generated on different" not in caption(h100, h100b, old)
    assert ("note: the runs were generated on different GPU models (cuda (NVIDIA H100 80GB HBM3, bf16): h, h2; cuda "
            "(NVIDIA A100-SXM4-80GB, bf16): a; cuda (bf16): old); their samples differ by those numerics too") in caption(
        h100, h100b, a100, old)


def test_compare_groups_runs_by_gpu_model_only_where_two_are_recorded(tmp_path):
    # An H100's eval beside an older one (no "gpu") and a CPU's: the note listed the two cuda (bf16) runs apart, as if
    # made on two devices (the older one's model is unknown, not another), where it said "cuda (bf16): h, old" before
    # the field; a note naming both other dtypes and other GPU models called them all "devices or dtypes"
    from rich.console import Console

    def caption(*runs):
        console = Console(record=True, width=400)
        console.print(compare_table(list(runs)))
        return " ".join(console.export_text().split())

    def made_on(run, device, dtype, gpu=None):
        m = json.loads((run / "metrics.json").read_text())
        m.update(device=device, dtype=dtype, **({"gpu": gpu} if gpu else {}))
        (run / "metrics.json").write_text(json.dumps(m))
        return run

    h100 = made_on(_fake_run(tmp_path / "h", "base", 0.6), "cuda", "bf16", "NVIDIA H100 80GB HBM3")
    old = made_on(_fake_run(tmp_path / "old", "tuned", 0.7), "cuda", "bf16")
    cpu = made_on(_fake_run(tmp_path / "c", "tuned", 0.7), "cpu", "fp32")
    assert ("note: the runs were generated on different devices or dtypes (cuda (bf16): h, old; cpu (fp32): c); "
            "their samples differ") in caption(h100, old, cpu)
    a100 = made_on(_fake_run(tmp_path / "a", "tuned", 0.7), "cuda", "fp16", "NVIDIA A100-SXM4-80GB")
    assert ("note: the runs were generated on different devices, dtypes or GPU models (cuda (NVIDIA H100 80GB HBM3, "
            "bf16): h; cuda (NVIDIA A100-SXM4-80GB, fp16): a); their samples differ") in caption(h100, a100)

def test_compare_flags_runs_scored_by_other_versions_of_the_answer_rules(tmp_path):
    from rich.console import Console

    from qerl_cli.rewards import RULE_VERSION

    a = _fake_run(tmp_path / "old", "base", 0.6)  # no scorer_version: an eval from before 2026-11-27
    b = _fake_run(tmp_path / "new", "tuned", 0.66)
    m = json.loads((b / "metrics.json").read_text())
    m["scorer_version"] = RULE_VERSION
    (b / "metrics.json").write_text(json.dumps(m))
    console = Console(record=True, width=300)
    console.print(compare_table([a, b]))
    assert "different versions of the answer rules" in " ".join(console.export_text().split())  # the caption wraps
    m = json.loads((a / "metrics.json").read_text())
    m["scorer_version"] = dict(RULE_VERSION)
    (a / "metrics.json").write_text(json.dumps(m))
    console = Console(record=True, width=300)
    console.print(compare_table([a, b]))
    assert "answer rules" not in " ".join(console.export_text().split())
    for run in (a, b):  # both scored with gsm8k alone: another math rule is moot
        m = json.loads((run / "metrics.json").read_text())
        m["scored_with"] = {"gsm8k": 10}
        m["scorer_version"] = dict(RULE_VERSION, math=RULE_VERSION["math"] + (run == a))
        (run / "metrics.json").write_text(json.dumps(m))
    console = Console(record=True, width=300)
    console.print(compare_table([a, b]))
    assert "answer rules" not in " ".join(console.export_text().split())
    for run in (a, b):  # both scored with math alone under --scorer auto: the gsm8k rule chose math for each problem
        m = json.loads((run / "metrics.json").read_text())
        m["scorer"], m["scored_with"] = "auto", {"math": 10}
        m["scorer_version"] = dict(RULE_VERSION, gsm8k=RULE_VERSION["gsm8k"] + (run == a))
        (run / "metrics.json").write_text(json.dumps(m))
    console = Console(record=True, width=300)
    console.print(compare_table([a, b]))
    assert "different versions of the answer rules" in " ".join(console.export_text().split())
    for run in (a, b):  # --scorer math reads no reference with the gsm8k rule
        m = json.loads((run / "metrics.json").read_text())
        m["scorer"] = "math"
        (run / "metrics.json").write_text(json.dumps(m))
    console = Console(record=True, width=300)
    console.print(compare_table([a, b]))
    assert "answer rules" not in " ".join(console.export_text().split())


def _rules_caption(runs, scored_with, packages, versions=None):
    """--compare's caption, unwrapped, over ``runs`` whose metrics.json say they scored with ``scored_with`` (one
    per run) under qerl's rule ``versions`` (today's where None) and the math rule's ``packages`` (None: unrecorded)."""
    from rich.console import Console

    from qerl_cli.rewards import RULE_VERSION

    for run, used, p, v in zip(runs, scored_with, packages, versions or [RULE_VERSION] * len(runs)):
        m = json.loads((run / "metrics.json").read_text())
        m.update(scorer="auto", scored_with=used, scorer_version=dict(v))
        m.pop("scorer_packages", None)
        m.update({} if p is None else {"scorer_packages": p})
        (run / "metrics.json").write_text(json.dumps(m))
    console = Console(record=True, width=300)
    console.print(compare_table(runs))
    return " ".join(console.export_text().split())


def test_compare_flags_math_runs_scored_under_other_math_verify_or_sympy_versions(tmp_path):
    # The math rule's verdicts are math-verify's and sympy's: two MATH runs scored under other versions of them
    # compared without a word, while a rerun of either now scores it again (scorer_packages)
    from qerl_cli.answers import rule_packages

    def caption(runs, scored_with, packages):
        return _rules_caption(runs, [scored_with] * len(runs), packages)

    runs = [_fake_run(tmp_path / "a", "base", 0.6), _fake_run(tmp_path / "b", "tuned", 0.66)]
    older = dict(rule_packages(), sympy="1.12")
    assert "different versions of the answer rules" in caption(runs, {"math": 10}, [older, rule_packages()])
    assert "different versions of the answer rules" in caption(runs, {"math": 10}, [None, rule_packages()])
    assert "answer rules" not in caption(runs, {"math": 10}, [rule_packages(), rule_packages()])
    assert "answer rules" not in caption(runs, {"gsm8k": 10}, [older, rule_packages()])  # no math verdict: moot


def test_compare_weighs_math_verify_versions_only_among_the_runs_the_math_rule_scored(tmp_path):
    # A gsm8k-only run's scorer_packages (another node's sympy, or none: made before they were recorded) beside a run
    # the math rule scored warned "different versions of the answer rules ... rerun each eval command", and did so
    # after the rerun too: the gsm8k-only eval is already done (no math verdict in it), its packages stay as they are.
    from qerl_cli.answers import rule_packages
    from qerl_cli.rewards import RULE_VERSION

    caption = _rules_caption

    runs = [_fake_run(tmp_path / "a", "base", 0.6), _fake_run(tmp_path / "b", "tuned", 0.66)]
    older = dict(rule_packages(), sympy="1.12")
    mixed = [{"gsm8k": 10}, {"gsm8k": 6, "math": 4}]
    assert "answer rules" not in caption(runs, mixed, [None, rule_packages()])
    assert "answer rules" not in caption(runs, mixed, [older, rule_packages()])
    assert "answer rules" not in caption(runs, mixed, [older, rule_packages()],  # math's version: moot for the first
                                         [dict(RULE_VERSION, math=0), RULE_VERSION])
    assert "different versions of the answer rules" in caption(runs, mixed, [older, rule_packages()],
                                                               [dict(RULE_VERSION, gsm8k=4), RULE_VERSION])
    assert "different versions of the answer rules" in caption(runs, [{"math": 3, "gsm8k": 7}, mixed[1]],
                                                               [older, rule_packages()])
