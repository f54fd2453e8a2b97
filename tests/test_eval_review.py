"""`qerl eval` checked against implementations written here, independently of qerl_cli.eval_metrics:
pass@k from exact binomial coefficients, per-problem aggregation recomputed from samples.jsonl, the
paired sign-flip p-value by enumerating every sign pattern, and an interrupted eval's resume."""

import itertools
import json
import warnings
from dataclasses import replace
from fractions import Fraction
from math import comb

import pytest

from qerl_cli.errors import BadInputError
from qerl_cli.eval_devices import MADE_ON
from qerl_cli.eval_metrics import paired_difference, pass_at_k, per_problem_pass1, score_block
from qerl_cli.evaluate import EvalConfig, Sample, evaluate
from tests.helpers import make_tiny_hf_model


def exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Chen et al. (2021), exactly: 1 - C(n-c, k) / C(n, k)."""
    return 1 - Fraction(comb(n - c, k), comb(n, k))


@pytest.mark.parametrize("n, c, k", [(n, c, k) for n in (1, 2, 3, 5, 16) for c in range(n + 1) for k in range(1, n + 1)]
                         + [(2000, 3, 1), (2000, 3, 1000), (100_000, 1, 7), (1024, 1023, 1), (1024, 0, 1024)])
def test_pass_at_k_equals_the_exact_binomial_ratio(n, c, k):
    # large n: C(n, k) overflows a float; the running product must still hold 1e-12
    assert pass_at_k(n, c, k) == pytest.approx(float(exact_pass_at_k(n, c, k)), rel=1e-9, abs=1e-12)


def test_per_problem_aggregation_k_above_n_and_a_problem_without_samples():
    counts = [(4, 0), (4, 1), (6, 3), (8, 8), (1, 1)]  # unequal n per problem: each is averaged alone
    want = sum(exact_pass_at_k(n, c, 1) for n, c in counts) / len(counts)
    assert score_block(counts, [1])["pass@1"]["value"] == pytest.approx(float(want), abs=1e-6)
    with pytest.raises(ValueError, match="pass@2 needs at least 2 samples"):
        score_block(counts, [2])  # the n = 1 problem cannot give pass@2
    with pytest.raises(ValueError, match="at least 1 samples"):
        score_block([(3, 1), (0, 0)], [1])  # a problem without samples is refused, not dropped from the mean
    assert score_block([(1, 0), (1, 1)], [1])["pass@1"]["value"] == 0.5  # n = 1: greedy pass@1 is the fraction


def test_paired_sign_flip_p_value_against_every_sign_pattern():
    a = {"0": 0.0, "1": 1 / 3, "2": 1.0, "3": 2 / 3, "4": 0.0, "5": 1 / 3}
    b = {"0": 2 / 3, "1": 1.0, "2": 2 / 3, "3": 2 / 3, "4": 1 / 3, "5": 1.0}
    d = [Fraction(round(3 * b[i]), 3) - Fraction(round(3 * a[i]), 3) for i in a]
    nz = [x for x in d if x]
    obs = abs(sum(nz))
    want = Fraction(sum(abs(sum(s * x for s, x in zip(signs, nz))) >= obs
                        for signs in itertools.product((1, -1), repeat=len(nz))), 2 ** len(nz))
    r = paired_difference(a, b)
    assert r["test"] == "sign-flip" and r["p"] == pytest.approx(float(want))
    assert r["diff"] == pytest.approx(100 * float(sum(d)) / len(d))


def _every_sign_pattern_p(d: list[Fraction]) -> Fraction:
    nz = [x for x in d if x]
    obs = abs(sum(nz))
    return Fraction(sum(abs(sum(s * x for s, x in zip(signs, nz))) >= obs
                        for signs in itertools.product((1, -1), repeat=len(nz))), 2 ** len(nz))


@pytest.mark.parametrize("na, nb, ca, cb", [
    # 256 and 257 samples: the float differences c'/257 - c/256 have no fraction of denominator <= 2^16 near them;
    # their approximations' common denominator sent 6 problems onto the normal approximation, p = 0.042 < 0.05
    (256, 257, [11, 51, 101, 151, 201, 31], [40, 90, 150, 180, 250, 20]),
    # the first three differences sum to 0 exactly: sign patterns tie with the observed sum, which approximated
    # differences broke (p = 0.625 for an exact 0.75, with the table counted however large)
    (256, 257, [193, 7, 56, 159], [64, 68, 125, 50]),
    # 255 and 256 (denominator 65,280): 12 differences of thousands each, 2^12 sign patterns, were approximated
    (255, 256, [1, 11, 21, 31, 41, 51, 61, 71, 81, 91, 101, 111], [201, 151, 161, 101, 201, 1, 221, 251, 31, 241, 181, 251]),
])
def test_paired_sign_flip_is_exact_for_runs_of_other_sample_counts(na, nb, ca, cb):
    a = {str(i): c / na for i, c in enumerate(ca)}
    b = {str(i): c / nb for i, c in enumerate(cb)}
    want = _every_sign_pattern_p([Fraction(y, nb) - Fraction(x, na) for x, y in zip(ca, cb)])
    r = paired_difference(a, b)
    assert r["test"] == "sign-flip" and r["p"] == pytest.approx(float(want), rel=1e-9)


# ---- the stage, with a scripted engine ---------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("evalr"), arch="qwen2", hidden=32, layers=1)


ROWS = [  # references in the forms the brief names; answers[i] are problem i's samples
    {"id": "thousand", "question": "q1", "answer": "... #### 1,000"},
    {"id": "price", "prompt": "q2", "answer": "3.50"},
    {"id": "neg", "messages": [{"role": "user", "content": "q3"}], "answer": -2},
    {"id": "half", "problem": "q4", "answer": "\\frac{1}{2}"},
    {"id": "dec", "prompt": "q5", "answer": "0.5"},
]
ANSWERS = [
    ["#### 1000", "\\boxed{1{,}000}", "#### 100"],     # 2 of 3
    ["#### $3.5", "#### 3.05", "\\boxed{3.500}"],        # 2 of 3
    ["#### -2", "#### 2", "no answer here"],             # 1 of 3
    ["\\boxed{0.5}", "\\boxed{\\dfrac{2}{4}}", "#### 0.5"],  # 2 of 3 (math-verify reads only \boxed{})
    ["\\boxed{\\frac{1}{2}}", "#### 1/2", "#### 2"],   # 2 of 3
]
CORRECT = [[1, 1, 0], [1, 0, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0]]
CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


class Scripted:
    def __init__(self, answers, fail_at_call=None):
        self.answers, self.seen, self.calls, self.fail_at_call = answers, 0, 0, fail_at_call

    def __call__(self, prompt_ids, n, seeds, progress=None):
        self.calls += 1
        if self.calls == self.fail_at_call:
            raise KeyboardInterrupt  # a crash (Ctrl-C, OOM kill) mid-eval
        out = []
        for _ in prompt_ids:
            out.append([Sample([1] * (j + 1), t, "stop") for j, t in enumerate(self.answers[self.seen])])
            self.seen += 1
        return out


def _cfg(model_dir, tmp_path, dataset, name="e", **kw):
    (tmp_path / "chat.jinja").write_text(CHAT)
    return EvalConfig(model=model_dir, dataset=dataset, out=tmp_path / name, device="cpu", k=2, num_samples=3,
                      max_new_tokens=32, progress=False, chat_template_file=tmp_path / "chat.jinja", **kw)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _recomputed(out):
    """metrics.json's numbers, from samples.jsonl alone."""
    lines = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    by_id: dict[str, list[bool]] = {}
    for r in lines:
        by_id.setdefault(r["id"], []).append(r["correct"])
    return lines, {f"pass@{k}": float(sum(exact_pass_at_k(len(v), sum(v), k) for v in by_id.values()) / len(by_id))
                   for k in (1, 2)}


def test_metrics_equal_an_independent_recount_of_samples_jsonl(model_dir, tmp_path):
    res = evaluate(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS)), generate=Scripted(ANSWERS))
    m, out = res["metrics"], tmp_path / "e"
    lines, want = _recomputed(out)
    assert [[r["correct"] for r in lines if r["id"] == row["id"]] for row in ROWS] == [list(map(bool, c)) for c in CORRECT]
    assert {k: v["value"] for k, v in m["scores"].items()} == pytest.approx(want, abs=1e-6)
    assert m["counts"] == {"problems": 5, "samples_per_problem": 3, "samples": 15, "correct_samples": 9,
                           "problems_solved": 5, "no_answer": sum(r["extracted"] is None for r in lines),
                           "truncated": 0}
    assert m["scored_with"] == {"gsm8k": 4, "math": 1}
    assert json.loads((out / "metrics.json").read_text())["scores"] == m["scores"]
    assert per_problem_pass1(out) == {row["id"]: sum(c) / 3 for row, c in zip(ROWS, CORRECT)}


def test_parquet_rows_score_as_their_jsonl_twin(model_dir, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"id": r["id"], "prompt": f"q{i}", "answer": str(r["answer"])} for i, r in enumerate(ROWS)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    a = evaluate(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", rows), "j"), generate=Scripted(ANSWERS))
    b = evaluate(_cfg(model_dir, tmp_path, tmp_path / "d.parquet", "p"), generate=Scripted(ANSWERS))
    assert a["metrics"]["scores"] == b["metrics"]["scores"] and a["metrics"]["counts"] == b["metrics"]["counts"]


@pytest.mark.parametrize("rows, message", [
    ([{"id": "a", "prompt": "x", "answer": "1"}, {"id": "a", "prompt": "y", "answer": "2"}], "id 'a' already used"),
    ([{"id": 1, "prompt": "x", "answer": "1"}, {"id": "1", "prompt": "y", "answer": "2"}], "id '1' already used"),
    ([{"prompt": "x", "answer": "1"}, {"id": 0, "prompt": "y", "answer": "2"}], "id '0' already used"),
    ([{"prompt": "x", "answer": "1"}, {"prompt": "y"}], "d.jsonl:2: row has no `answer`"),
    ([{"prompt": "x", "answer": "1"}, {"prompt": "y", "answer": "  "}], "d.jsonl:2: row has no `answer`"),
])
def test_duplicate_ids_and_missing_answers_are_refused_before_any_generation(model_dir, tmp_path, rows, message):
    gen = Scripted([["#### 1"] * 3] * 2)
    with pytest.raises(BadInputError, match=message):
        evaluate(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", rows)), generate=gen)
    assert gen.calls == 0 and not (tmp_path / "e").exists()


def test_a_row_whose_reference_is_under_another_name_is_told_of_answer_key(model_dir, tmp_path):
    # "row has no reference `answer`; eval needs one per problem", no hint, of a chat set holding its references in
    # `final_answer`; and with --answer-key final_answer, a null there was named `answer`
    rows = [{"messages": [{"role": "user", "content": "1+1?"}], "final_answer": "2"}] * 2
    gen = Scripted([["#### 2"] * 3] * 2)
    with pytest.raises(BadInputError) as e:
        evaluate(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", rows)), generate=gen)
    assert "d.jsonl:1: row has no `answer`; eval needs a reference per problem" in str(e.value)
    assert e.value.hint.endswith("--answer-key COLUMN; the row's keys: final_answer, messages")
    rows = [*rows[:1], {**rows[1], "final_answer": " "}]
    with pytest.raises(BadInputError, match=r"d.jsonl:2: row has no reference \(its `final_answer`, named by "
                                            r"--answer-key, is null or blank\)"):
        evaluate(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", rows), answer_key="final_answer"), generate=gen)
    assert gen.calls == 0


class BySeed:
    """Problem i's samples (seed i at --seed 0) whatever the chunk it comes in; records the seeds asked for."""

    def __init__(self, fail_at_call=None, sleep=0.0):
        self.asked, self.fail_at_call, self.sleep = [], fail_at_call, sleep

    def __call__(self, prompt_ids, n, seeds, progress=None):
        import time

        self.asked.append(list(seeds))
        if len(self.asked) == self.fail_at_call:
            raise KeyboardInterrupt  # Ctrl-C, or SIGTERM (a Slurm pre-emption), mid-eval
        time.sleep(self.sleep)
        return [[Sample([1] * (j + 1), t, "stop") for j, t in enumerate(ANSWERS[i])] for i in seeds]


def _without_time(out):
    m = json.loads((out / "metrics.json").read_text())
    m.pop("time")
    return m


@pytest.fixture
def two_chunks(model_dir, tmp_path):
    """(cfg, its uninterrupted output): 5 problems of 3 samples, 4 * 3 // 3 = 4 problems a chunk."""
    data = _jsonl(tmp_path / "d.jsonl", ROWS)
    evaluate(_cfg(model_dir, tmp_path, data, "ref", max_num_seqs=3), generate=BySeed())
    return _cfg(model_dir, tmp_path, data, max_num_seqs=3), tmp_path / "ref"


def test_an_interrupted_eval_keeps_its_finished_problems_and_the_rerun_equals_an_uninterrupted_one(two_chunks, tmp_path):
    # It kept nothing: its rerun generated every problem again (a 32B --k 16 MATH-500 eval lost hours to a pre-emption).
    cfg, ref = two_chunks
    with pytest.raises(KeyboardInterrupt) as e:
        evaluate(cfg, generate=BySeed(fail_at_call=2))
    partial = e.value.kept_problems[2]
    assert e.value.kept_problems[:2] == (4, 5) and partial.name.startswith(".e.partial-") and not cfg.out.exists()
    assert len((partial / "samples.jsonl").read_text().splitlines()) == 12
    gen = BySeed(sleep=0.05)
    res = evaluate(cfg, generate=gen)
    assert gen.asked == [[4]] and not res["already_done"]  # only the problem left
    assert (cfg.out / "samples.jsonl").read_bytes() == (ref / "samples.jsonl").read_bytes()
    assert _without_time(cfg.out) == _without_time(ref)
    assert res["manifest"]["resumed"] == {"problems": 4, "dropped_lines": 0} and not partial.exists()
    t = res["metrics"]["time"]  # this run's 1 + 2 + 3 tokens, not the 30 of every sample over its 0.05 s
    assert t["tokens_per_s"] * t["generate_s"] == pytest.approx(6, rel=0.1)


@pytest.mark.parametrize("cut", ["nothing", "mid-line", "mid-problem", "one-problem", "four-problems", "no-last-newline",
                                 "all", "foreign-first"])
def test_a_resume_keeps_the_whole_problems_before_a_torn_or_foreign_tail(two_chunks, tmp_path, cut):
    cfg, ref = two_chunks
    with pytest.raises(KeyboardInterrupt) as e:
        evaluate(cfg, generate=BySeed(fail_at_call=2))
    samples = e.value.kept_problems[2] / "samples.jsonl"
    whole = (ref / "samples.jsonl").read_bytes()
    lines = whole.splitlines(keepends=True)
    at = {"nothing": 0, "mid-line": len(lines[0]) // 2, "mid-problem": len(b"".join(lines[:5])),
          "one-problem": len(b"".join(lines[:3])), "four-problems": len(b"".join(lines[:12])) + 7,
          "no-last-newline": len(whole) - 1, "all": len(whole), "foreign-first": None}[cut]
    samples.write_bytes(b"".join(lines[3:6] + lines[:3]) if at is None else whole[:at])
    kept = {"nothing": 0, "mid-line": 0, "mid-problem": 1, "one-problem": 1, "four-problems": 4,
            "no-last-newline": 4, "all": 5, "foreign-first": 0}[cut]
    gen = BySeed()
    res = evaluate(cfg, generate=gen)
    start = kept - kept % 4  # the chunk of the first missing problem, generated whole
    assert gen.asked == ([] if kept == 5 else [list(range(start, 4)), [4]] if start == 0 else [[4]])
    assert res["manifest"]["resumed"]["problems"] == kept
    assert (cfg.out / "samples.jsonl").read_bytes() == whole and _without_time(cfg.out) == _without_time(ref)
    assert res["metrics"]["time"]["tokens_per_s"] is None or kept < 5


def test_an_eval_stopped_before_its_first_problem_leaves_nothing(model_dir, tmp_path):
    cfg = _cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS), max_num_seqs=3)
    with pytest.raises(KeyboardInterrupt) as e:
        evaluate(cfg, generate=BySeed(fail_at_call=1))
    assert e.value.kept_problems[:2] == (0, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jinja", "d.jsonl"]  # no --out, no partial, no lock


def test_a_second_eval_into_the_same_out_is_refused_while_the_first_runs(model_dir, tmp_path):
    from qerl_cli.errors import OutputBusyError

    cfg = _cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS), max_num_seqs=3)
    inner = []

    def generate(prompt_ids, n, seeds, progress=None):
        if not inner:  # the same command started again (a requeued Slurm job) while this one generates
            with pytest.raises(OutputBusyError, match=f"another qerl eval is writing {cfg.out} right now") as e:
                evaluate(cfg, generate=BySeed())
            inner.append(e.value.exit_code)
        return BySeed()(prompt_ids, n, seeds)

    res = evaluate(cfg, generate=generate)
    assert inner == [8] and res["metrics"]["counts"]["samples"] == 15


def test_an_already_done_rerun_removes_the_partial_an_interrupted_force_redo_left(two_chunks, tmp_path):
    cfg, ref = two_chunks
    evaluate(cfg, generate=BySeed())
    with pytest.raises(KeyboardInterrupt) as e:
        evaluate(replace(cfg, force=True), generate=BySeed(fail_at_call=2))
    assert e.value.kept_problems[2].is_dir()
    assert evaluate(cfg, generate=BySeed())["already_done"]
    assert not e.value.kept_problems[2].exists() and not list(tmp_path.glob(".e.*"))


def _stopped_with_stale_verdicts(cfg):
    """An eval of ``cfg`` stopped after its first chunk, its kept samples' verdicts flipped (an older rule's):
    the partial samples.jsonl."""
    with pytest.raises(KeyboardInterrupt) as e:
        evaluate(cfg, generate=BySeed(fail_at_call=2))
    samples = e.value.kept_problems[2] / "samples.jsonl"
    stale = [json.loads(x) for x in samples.read_text().splitlines()]
    for r in stale:
        r.update(correct=not r["correct"], extracted="stale")
    samples.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in stale))
    return samples


def test_a_resume_scores_the_kept_samples_with_todays_rule(two_chunks, tmp_path):
    # The fingerprint does not count qerl's answer rule: a partial file from an older qerl kept its verdicts, and
    # the score mixed two rules. Its lines are scored again, and the file holds today's verdicts.
    cfg, ref = two_chunks
    _stopped_with_stale_verdicts(cfg)
    res = evaluate(cfg, generate=BySeed())
    assert res["manifest"]["resumed"]["problems"] == 4
    assert (cfg.out / "samples.jsonl").read_bytes() == (ref / "samples.jsonl").read_bytes()
    assert _without_time(cfg.out) == _without_time(ref)


def test_a_rescoring_rewrite_stopped_midway_keeps_the_finished_problems(two_chunks, tmp_path, monkeypatch):
    # The kept lines were written again in place: a full disk (or a kill) mid-write left samples.jsonl empty, and
    # the stop then deleted the partial directory as one that had kept nothing: every finished problem was lost.
    import builtins
    import errno

    import qerl_cli.evaluate as ev
    from qerl_cli.errors import OutputWriteError

    cfg, ref = two_chunks
    samples = _stopped_with_stale_verdicts(cfg)  # an older rule's verdicts: the resume rewrites them
    before = samples.read_bytes()

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_open(file, mode="r", *a, **kw):  # a file written from its start fails; appending does not
        f = builtins.open(file, mode, *a, **kw)
        return Full(f) if "w" in mode else f

    monkeypatch.setattr(ev, "open", full_open, raising=False)
    with pytest.raises(OutputWriteError):
        evaluate(cfg, generate=BySeed())
    monkeypatch.undo()
    assert samples.read_bytes() == before
    gen = BySeed()
    res = evaluate(cfg, generate=gen)
    assert res["manifest"]["resumed"]["problems"] == 4 and gen.asked == [[4]]
    assert (cfg.out / "samples.jsonl").read_bytes() == (ref / "samples.jsonl").read_bytes()
    assert sorted(p.name for p in cfg.out.iterdir()) == ["manifest.json", "metrics.json", "samples.jsonl"]  # no leftover


@pytest.mark.parametrize("older", ["version", "none"])
def test_a_finished_eval_of_older_answer_rules_is_scored_again_without_generating(two_chunks, tmp_path, monkeypatch,
                                                                                 capsys, older):
    # A finished eval recorded no version of the rules that scored it: after an upgrade that changed a rule, the same
    # command said "already done" and printed the old rule's score. Now it scores the kept completions again.
    import qerl_cli.evaluate as ev

    cfg, ref = two_chunks
    today, metrics = ev.score_completion, ev._metrics
    with monkeypatch.context() as m:  # an older qerl: other verdicts, and another rule version (or none recorded)
        m.setattr(ev, "score_completion", lambda *a: replace(today(*a), correct=not today(*a).correct))
        if older == "version":
            m.setattr(ev, "RULE_VERSION", {"gsm8k": 0, "math": 1})
        else:
            m.setattr(ev, "_metrics", lambda *a: {k: v for k, v in metrics(*a).items() if k != "scorer_version"})
        old = evaluate(cfg, generate=BySeed())["metrics"]
    assert old["scores"] != json.loads((ref / "metrics.json").read_text())["scores"]
    finished = {p.name: p.read_bytes() for p in cfg.out.iterdir()}

    def stop(*a):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:  # stopped before its rename: the old output stays whole, for the next rerun
        m.setattr(ev, "_metrics", stop)
        with pytest.raises(KeyboardInterrupt):
            evaluate(cfg, generate=BySeed())
    assert {p.name: p.read_bytes() for p in cfg.out.iterdir()} == finished
    from qerl_cli.outputs import completed_outputs

    assert cfg.out not in completed_outputs()  # the stop line said "complete (a rerun says already done)"
    gen = BySeed()
    res = evaluate(replace(cfg, progress=True), generate=gen)
    assert not res["already_done"] and gen.asked == []  # scored, not generated
    assert "scored by older answer rules" in capsys.readouterr().err
    assert (cfg.out / "samples.jsonl").read_bytes() == (ref / "samples.jsonl").read_bytes()
    assert _without_time(cfg.out) == _without_time(ref) and res["metrics"]["time"] == old["time"]
    assert res["manifest"]["rescored_from"] == {k: old.get(k) for k in ("scorer_version", "scorer_packages")}
    assert evaluate(cfg, generate=gen)["already_done"] and not list(tmp_path.glob(".e.*"))


def test_only_the_rules_an_eval_scored_with_decide_its_rescoring(model_dir, tmp_path, monkeypatch):
    # RULE_VERSION was compared whole: a new math rule scored every gsm8k-only eval again
    import qerl_cli.evaluate as ev

    cfg = _cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", [r for r in ROWS if r["id"] != "half"]))
    evaluate(cfg, generate=BySeed())
    assert set(json.loads((cfg.out / "metrics.json").read_text())["scored_with"]) == {"gsm8k"}
    gen = BySeed()
    monkeypatch.setattr(ev, "RULE_VERSION", dict(ev.RULE_VERSION, math=ev.RULE_VERSION["math"] + 1))
    assert evaluate(cfg, generate=gen)["already_done"]
    monkeypatch.setattr(ev, "RULE_VERSION", dict(ev.RULE_VERSION, gsm8k=ev.RULE_VERSION["gsm8k"] + 1))
    res = evaluate(cfg, generate=gen)
    assert not res["already_done"] and gen.asked == []  # scored again, nothing generated
    assert res["metrics"]["scorer_version"] == ev.RULE_VERSION


def test_the_gsm8k_rule_decides_every_auto_evals_rescoring(model_dir, tmp_path, monkeypatch):
    # --scorer auto reads each reference with the gsm8k rule to choose its problem's rule (gsm8k 4 moved "~18" to
    # math): a new gsm8k rule left an eval that scored with math alone "already done" with the old verdicts
    import qerl_cli.evaluate as ev

    data = _jsonl(tmp_path / "d.jsonl", [r for r in ROWS if r["id"] == "half"])
    auto, forced = _cfg(model_dir, tmp_path, data), _cfg(model_dir, tmp_path, data, name="m", scorer="math")
    for cfg in (auto, forced):
        evaluate(cfg, generate=BySeed())
        assert json.loads((cfg.out / "metrics.json").read_text())["scored_with"] == {"math": 1}
    monkeypatch.setattr(ev, "RULE_VERSION", dict(ev.RULE_VERSION, gsm8k=ev.RULE_VERSION["gsm8k"] + 1))
    gen = BySeed()
    assert not evaluate(auto, generate=gen)["already_done"] and gen.asked == []  # scored again, nothing generated
    assert evaluate(forced, generate=gen)["already_done"]  # --scorer math reads no reference with gsm8k


def test_a_stopped_rescoring_through_a_symlinked_out_is_not_called_complete(two_chunks, tmp_path, monkeypatch):
    # A finished eval found "already done" is recorded complete by its resolved path (StageOutput follows a symlinked
    # --out); the rescoring forgot it by --out as given, the link: stopped midway, the stop line still said "TARGET is
    # complete (a rerun says already done)", yet the rerun scores it again.
    import qerl_cli.evaluate as ev
    from qerl_cli.outputs import completed_outputs, forget_completed

    cfg, _ = two_chunks
    real, link = tmp_path / "real", tmp_path / "link"
    with monkeypatch.context() as m:  # an older qerl's rules
        m.setattr(ev, "RULE_VERSION", {"gsm8k": 0, "math": 1})
        evaluate(replace(cfg, out=real), generate=BySeed())
    link.symlink_to(real)
    forget_completed()  # a new CLI invocation

    def stop(*a):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(ev, "_metrics", stop)
        with pytest.raises(KeyboardInterrupt):
            evaluate(replace(cfg, out=link), generate=BySeed())
    assert completed_outputs() == []
    assert not evaluate(replace(cfg, out=link), generate=BySeed())["already_done"]  # the rerun rescores


def test_a_rescoring_that_had_to_generate_reports_its_own_time(two_chunks, monkeypatch):
    # A finished eval under older rules whose samples.jsonl does not hold today's prompts (an older qerl rendered them
    # otherwise; the fingerprint counts the template, not the text) is generated again from the first such problem.
    # Its metrics.json kept the old run's time: 0.0 s of generation for the 5 problems generated here.
    import qerl_cli.evaluate as ev

    cfg, ref = two_chunks
    with monkeypatch.context() as m:
        m.setattr(ev, "RULE_VERSION", {"gsm8k": 0, "math": 1})
        old = evaluate(cfg, generate=BySeed())["metrics"]
    samples = cfg.out / "samples.jsonl"
    samples.write_text(samples.read_text().replace('"prompt": "q1"', '"prompt": "Q1"'))  # same size: not "damaged"
    gen = BySeed(sleep=0.05)
    res = evaluate(cfg, generate=gen)
    assert gen.asked == [[0, 1, 2, 3], [4]] and res["manifest"]["resumed"]["problems"] == 0
    assert res["metrics"]["time"] != old["time"] and res["metrics"]["time"]["generate_s"] >= 0.1
    assert samples.read_bytes() == (ref / "samples.jsonl").read_bytes()


@pytest.mark.parametrize("older", ["versions", "none"])
def test_an_eval_the_math_rule_scored_is_scored_again_under_other_math_verify_or_sympy(model_dir, tmp_path, monkeypatch,
                                                                                      capsys, older):
    # The math rule's verdicts are math-verify's (and sympy's), whose versions metrics.json did not record: after an
    # upgrade of them a finished MATH eval said "already done" with the old verdicts. Now they are recorded and count,
    # for an eval the math rule scored only; one made before they were recorded (none) is scored again once.
    import qerl_cli.evaluate as ev

    rows = _jsonl(tmp_path / "d.jsonl", ROWS)
    maths, gsm8k = _cfg(model_dir, tmp_path, rows), _cfg(model_dir, tmp_path, _jsonl(tmp_path / "g.jsonl", ROWS[:3]), "g")
    today, metrics = ev.rule_packages(), ev._metrics
    with monkeypatch.context() as m:
        if older == "versions":
            m.setattr(ev, "rule_packages", lambda: dict(today, **{"math-verify": "0.5.0", "sympy": "1.12"}))
        else:  # written before the field was
            m.setattr(ev, "_metrics", lambda *a: {k: v for k, v in metrics(*a).items() if k != "scorer_packages"})
        old = [evaluate(cfg, generate=BySeed())["metrics"] for cfg in (maths, gsm8k)]
    assert [set(x["scored_with"]) for x in old] == [{"gsm8k", "math"}, {"gsm8k"}]
    gen = BySeed()
    res = evaluate(replace(maths, progress=True), generate=gen)
    assert not res["already_done"] and gen.asked == []  # scored again, nothing generated
    assert "scored by other versions of math-verify" in capsys.readouterr().err
    assert res["metrics"]["scorer_packages"] == today and res["metrics"]["scores"] == old[0]["scores"]
    assert res["manifest"]["rescored_from"]["scorer_packages"] == old[0].get("scorer_packages")
    assert evaluate(maths, generate=gen)["already_done"]
    assert evaluate(gsm8k, generate=gen)["already_done"]  # no math verdict in it: math-verify's version is moot


def _on_a_gpu(monkeypatch):
    """What --device auto resolves to on a GPU node (and so --dtype auto: bf16), for evals whose engine is scripted."""
    import qerl_cli.runtime

    monkeypatch.setattr(qerl_cli.runtime, "resolve_device", lambda device: "cuda" if device == "auto" else device)


def test_a_finished_gpu_eval_is_done_and_scored_again_on_a_cpu_node(model_dir, tmp_path, monkeypatch, capsys):
    # The fingerprint holds the device and dtype --device auto / --dtype auto resolve to: the same command on a CPU node
    # (to print the score, or to score it again after an upgrade) exited 4, "device: cuda -> cpu; dtype: bf16 -> fp32".
    import qerl_cli.evaluate as ev
    from qerl_cli.errors import OutputExistsError

    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS)), device="auto")
    with monkeypatch.context() as m:
        _on_a_gpu(m)
        m.setattr(ev, "RULE_VERSION", {"gsm8k": 0, "math": 1})  # an older qerl's rules
        made = evaluate(cfg, generate=BySeed())
    assert made["manifest"]["config"]["device"] == "cuda" and made["metrics"]["dtype"] == "bf16"
    gen = BySeed()
    capsys.readouterr()
    res = evaluate(cfg, generate=gen)  # on this CPU: scored again with today's rules, where the samples were made
    assert not res["already_done"] and gen.asked == []
    assert (res["metrics"]["device"], res["metrics"]["dtype"]) == ("cuda", "bf16")
    assert res["manifest"]["fingerprint"] == made["manifest"]["fingerprint"]
    # said, --quiet or not: a user who asked for this CPU sees the GPU's bf16 score (unsaid until a review)
    made_there = f"note: {cfg.out} was generated on cuda (bf16), not cpu (fp32): its score is that device's"
    assert made_there in capsys.readouterr().err
    assert evaluate(cfg, generate=gen)["already_done"] and evaluate(replace(cfg, dtype="bf16"), generate=gen)["already_done"]
    err = capsys.readouterr().err
    assert made_there in err and "generated on cuda (bf16), not cpu (bf16): its score is that device's" in err
    with monkeypatch.context() as m:  # made where it runs: nothing to say
        _on_a_gpu(m)
        assert evaluate(cfg, generate=gen)["already_done"]
    assert "was generated on" not in capsys.readouterr().err
    with pytest.raises(OutputExistsError, match="dtype: \"bf16\" -> \"fp16\""):  # other numbers asked for: another eval
        evaluate(replace(cfg, dtype="fp16"), generate=gen)
    redo = evaluate(replace(cfg, force=True), generate=gen)  # --force generates it here
    assert gen.asked == [[0, 1, 2, 3, 4]] and redo["metrics"]["device"] == "cpu"


def test_an_eval_made_on_another_gpu_of_the_node_is_done_without_a_note(model_dir, tmp_path, monkeypatch, capsys):
    # Made with --device cuda:1, rerun with auto (cuda): "generated on cuda:1 (bf16), not cuda (bf16): its score is that
    # device's (pass --force to generate it here)", which sent a user to generate it all again on the same GPUs.
    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS)), device="auto")
    with monkeypatch.context() as m:
        _on_a_gpu(m)
        evaluate(replace(cfg, device="cuda:1"), generate=BySeed())
        capsys.readouterr()
        assert evaluate(cfg, generate=BySeed())["already_done"]
        assert "was generated on" not in capsys.readouterr().err
    assert evaluate(cfg, generate=BySeed())["already_done"]  # a CPU node: another kind of device, said
    assert f"{cfg.out} was generated on cuda:1 (bf16), not cpu (fp32)" in capsys.readouterr().err

def test_a_gpu_eval_is_not_completed_on_a_cpu_node(model_dir, tmp_path, monkeypatch):
    # Samples a CPU generates beside a GPU's would be another device's numbers in one eval: a stopped GPU eval is not
    # resumed on a CPU node (it starts afresh, beside the GPU's partial directory), nor is a finished one whose rescoring
    # must generate some problems again (their prompts render otherwise today) completed there.
    import qerl_cli.evaluate as ev
    from qerl_cli.errors import OutputExistsError

    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS), max_num_seqs=3), device="auto")
    with monkeypatch.context() as m:
        _on_a_gpu(m)
        with pytest.raises(KeyboardInterrupt) as e:
            evaluate(cfg, generate=BySeed(fail_at_call=2))
    gpu_partial = e.value.kept_problems[2]
    gen = BySeed()
    with pytest.warns(Warning, match="unfinished run made with other arguments"):
        assert evaluate(cfg, generate=gen)["metrics"]["device"] == "cpu"
    assert gen.asked == [[0, 1, 2, 3], [4]] and not gpu_partial.exists()  # obsolete once --out holds this eval

    with monkeypatch.context() as m:
        _on_a_gpu(m)
        m.setattr(ev, "RULE_VERSION", {"gsm8k": 0, "math": 1})
        evaluate(replace(cfg, force=True), generate=BySeed())
    samples = cfg.out / "samples.jsonl"
    samples.write_text(samples.read_text().replace('"prompt": "q1"', '"prompt": "Q1"'))  # same size: not "damaged"
    finished = samples.read_bytes()
    gen = BySeed()
    with pytest.raises(OutputExistsError, match="generated on cuda \\(bf16\\).*rerun this eval on cuda"):
        evaluate(cfg, generate=gen)
    assert gen.asked == [] and samples.read_bytes() == finished and not list(tmp_path.glob(".e.partial-*"))
    with monkeypatch.context() as m:  # there, it is scored again and the problems generated again
        _on_a_gpu(m)
        res = evaluate(cfg, generate=gen)
    assert gen.asked == [[0, 1, 2, 3], [4]] and res["metrics"]["device"] == "cuda"


def _indexed(monkeypatch):
    """qerl before 2026-11-28 (from 30c049c, which recorded .made_on.json): its eval fingerprint named the GPU's index
    (cuda:1), where today's names the device's kind."""
    import qerl_cli.evaluate as ev

    monkeypatch.setattr(ev, "device_kind", lambda device: device)
    monkeypatch.setattr(ev, "adopt_indexed_partial", lambda *args: None)  # today's name is not its own: not taken over


def _stopped(cfg, monkeypatch, on_gpu=True):
    """The partial directory an eval of ``cfg`` stopped on its second chunk leaves (on a GPU node, or here)."""
    with monkeypatch.context() as m, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "an unfinished run made with other arguments": the other partial directories
        if on_gpu:
            _on_a_gpu(m)
        with pytest.raises(KeyboardInterrupt) as e:
            evaluate(cfg, generate=BySeed(fail_at_call=2))
    return e.value.kept_problems[2]


def test_an_eval_finished_on_one_device_removes_its_partial_dirs_of_other_devices(model_dir, tmp_path, monkeypatch,
                                                                                  capsys):
    # A stopped eval resumes on its own device only; finished on another, its partial directory stayed for good beside
    # --out: the same command on the GPU node found --out done (made elsewhere) and never resumed or removed it.
    import fcntl

    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS), max_num_seqs=3), device="auto")
    gpu = _stopped(cfg, monkeypatch)  # cuda (bf16)
    with monkeypatch.context() as m:  # another GPU of the node, bf16 too, named by its index (an older qerl's)
        _indexed(m)
        gpu1 = _stopped(replace(cfg, device="cuda:1"), m)
    fp16 = _stopped(replace(cfg, dtype="fp16"), monkeypatch)  # another eval: --out (fp32) is not a --dtype fp16 one's
    longer = _stopped(replace(cfg, max_new_tokens=40), monkeypatch, on_gpu=False)  # another eval, on this device
    assert len({gpu, gpu1, fp16, longer}) == 4
    capsys.readouterr()
    with open(gpu1.with_name(gpu1.name + ".lock"), "a+") as live:  # a run on cuda:1 writing it right now
        fcntl.flock(live.fileno(), fcntl.LOCK_EX)
        with pytest.warns(Warning, match="unfinished run made with other arguments"):
            assert evaluate(cfg, generate=BySeed())["metrics"]["device"] == "cpu"
    assert not gpu.exists() and gpu1.is_dir() and fp16.is_dir() and longer.is_dir()
    err = capsys.readouterr().err
    assert f"note: removed {gpu}, this eval stopped on cuda (bf16): {cfg.out} holds it finished" in err
    assert err.count("note: removed") == 1
    with monkeypatch.context() as m:  # on the GPU node, already done (made elsewhere): cuda:1's writer stopped since
        _on_a_gpu(m)
        assert evaluate(replace(cfg, device="cuda:1"), generate=BySeed())["already_done"]
    assert not gpu1.exists() and fp16.is_dir() and longer.is_dir()
    assert f"note: removed {gpu1}, this eval stopped on cuda:1 (bf16)" in capsys.readouterr().err
    # --dtype fp32 finds the same --out done, but asks for fp32 on the GPU too: the fp16 one is still another eval
    assert evaluate(replace(cfg, dtype="fp32"), generate=BySeed())["already_done"] and fp16.is_dir()


def test_the_sweep_keeps_a_partial_dir_of_a_dtype_named_where_auto_gives_the_same(model_dir, tmp_path, monkeypatch,
                                                                                   capsys):
    # A partial directory is named by the dtype --dtype resolved to, not the flag: judged by this command's flag, a CPU's
    # --dtype auto eval removed a GPU's stopped --dtype bf16 one (bf16 too, as auto there), which that command, finding
    # --out's fp32 eval another one, still resumes with --force; the GPU's auto eval removed a CPU's --dtype fp32 one.
    from qerl_cli.errors import OutputExistsError

    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS), max_num_seqs=3), device="auto")
    named = _stopped(replace(cfg, dtype="bf16"), monkeypatch)  # cuda (bf16), --dtype bf16
    with monkeypatch.context() as m:  # cuda:1 (bf16), --dtype auto: an older qerl's, named by the index (else the
        _indexed(m)  # same directory as the bf16 one's)
        auto = _stopped(replace(cfg, device="cuda:1"), m)
    with pytest.warns(Warning, match="unfinished run made with other arguments"):
        evaluate(cfg, generate=BySeed())  # on this CPU node: fp32
    assert named.is_dir() and not auto.exists()
    assert "note: removed" in capsys.readouterr().err and not list(cfg.out.glob(".made_on*"))
    with monkeypatch.context() as m:
        _on_a_gpu(m)
        with pytest.raises(OutputExistsError):  # fp32 at --out is not this command's eval
            evaluate(replace(cfg, dtype="bf16"), generate=BySeed())
        gen = BySeed()
        evaluate(replace(cfg, dtype="bf16", force=True), generate=gen)
    assert gen.asked == [[4]] and not named.exists()  # resumed, as it could not be once removed

    fp32 = _stopped(replace(cfg, dtype="fp32", out=tmp_path / "f"), monkeypatch, on_gpu=False)  # cpu (fp32), named
    with monkeypatch.context() as m:
        _on_a_gpu(m)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            evaluate(replace(cfg, out=tmp_path / "f"), generate=BySeed())  # the GPU's auto eval: bf16
    assert fp32.is_dir()


def test_the_sweep_judges_a_partial_dir_of_an_older_qerl_by_its_dtype_alone(model_dir, tmp_path, monkeypatch, capsys):
    # One that records no --dtype (qerl before 2026-11-28) is obsolete whatever --dtype made it only in --out's dtype

    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS), max_num_seqs=3), device="auto")
    bf16 = _stopped(cfg, monkeypatch)  # cuda (bf16): auto, or --dtype bf16?
    fp32 = _stopped(replace(cfg, dtype="fp32"), monkeypatch)  # cuda (fp32): --dtype fp32 alone gives it
    for part in (bf16, fp32):
        (part / MADE_ON).unlink()
    with pytest.warns(Warning, match="unfinished run made with other arguments"):
        evaluate(cfg, generate=BySeed())  # on this CPU node: fp32
    assert bf16.is_dir() and not fp32.exists()
    assert f"note: removed {fp32}, this eval stopped on cuda (fp32)" in capsys.readouterr().err


def _gpus(monkeypatch, names):
    """A GPU node whose devices are ``names`` (cuda:i -> its model, as torch.cuda.get_device_name says)."""
    import qerl_cli.runtime

    _on_a_gpu(monkeypatch)
    monkeypatch.setattr(qerl_cli.runtime, "gpu_model",
                        lambda device: names[int(device.split(":")[1]) if ":" in device else 0])


def test_a_stopped_eval_resumes_on_another_gpu_of_the_same_model(model_dir, tmp_path, monkeypatch):
    # Stopped with --device cuda:1, the same command with --device cuda (or auto) started over (its partial directory was
    # named by the index) and, once finished, removed cuda:1's: the problems kept there were generated twice. The
    # fingerprint names the device's kind: one partial directory and one writer lock whichever GPU of the node resumes.
    import fcntl

    from qerl_cli.errors import OutputBusyError

    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS), max_num_seqs=3), device="auto")
    with monkeypatch.context() as m:
        _gpus(m, ["H100", "H100"])
        stopped = _stopped(replace(cfg, device="cuda:1"), m)
        gen = BySeed()
        with open(stopped.with_name(stopped.name + ".lock"), "a+") as live:  # a run on cuda:1 writing it right now
            fcntl.flock(live.fileno(), fcntl.LOCK_EX)
            with pytest.raises(OutputBusyError):  # the same eval is being written: exit 8, not a second one beside it
                evaluate(cfg, generate=gen)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # not "an unfinished run made with other arguments": it is resumed
            res = evaluate(cfg, generate=gen)
        ref = evaluate(replace(cfg, out=tmp_path / "ref"), generate=BySeed())  # uninterrupted, on cuda
        ref1 = evaluate(replace(cfg, device="cuda:1", out=tmp_path / "ref1"), generate=BySeed())  # and on cuda:1
    assert gen.asked == [[4]] and not stopped.exists() and res["manifest"]["resumed"]["problems"] == 4
    assert _without_time(cfg.out) == _without_time(tmp_path / "ref")
    assert (cfg.out / "samples.jsonl").read_bytes() == (tmp_path / "ref" / "samples.jsonl").read_bytes()
    assert res["manifest"]["fingerprint"] == ref["manifest"]["fingerprint"] == ref1["manifest"]["fingerprint"]
    # the fingerprint holds the kind, metrics.json the device given (what --compare and the CPU node's note show)
    assert ref1["manifest"]["config"]["device"] == "cuda" and ref1["metrics"]["device"] == "cuda:1"
    assert res["metrics"]["device"] == "cuda"


def test_a_stopped_eval_is_not_resumed_on_another_gpu_model(model_dir, tmp_path, monkeypatch):
    # cuda:0 and cuda:1 of one node (or an A100 node and an H100 node over a shared file system) may be different
    # GPUs: other numerics, so no resume; refused (exit 4), its kept problems left for a GPU of its model. Its own kind
    # of exit 4, which the recipes' note tells from the others (QERL_ERROR_FILE).
    from qerl_cli.errors import OtherGpuModelError

    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS), max_num_seqs=3), device="auto")
    with monkeypatch.context() as m:
        _gpus(m, ["A100", "H100"])
        stopped = _stopped(replace(cfg, device="cuda:1"), m)
        kept = (stopped / "samples.jsonl").read_bytes()
        gen = BySeed()
        with pytest.raises(OtherGpuModelError, match="stopped on 'H100', another GPU model than this 'A100'"):
            evaluate(cfg, generate=gen)
        assert gen.asked == [] and (stopped / "samples.jsonl").read_bytes() == kept
        assert json.loads((stopped / MADE_ON).read_text())["gpu"] == "H100"  # its record left as it was
        with pytest.warns(Warning, match="stopped on 'H100': started afresh on this 'A100'"):
            evaluate(replace(cfg, force=True), generate=gen)  # --force: generated here, all of it
        assert gen.asked == [[0, 1, 2, 3], [4]] and not stopped.exists()
        _stopped(replace(cfg, device="cuda:1", out=tmp_path / "h"), m)
        gen = BySeed()
        evaluate(replace(cfg, device="cuda:1", out=tmp_path / "h"), generate=gen)  # on its model: resumed
    assert gen.asked == [[4]]


def test_a_finished_eval_records_its_gpu_model_and_is_not_completed_on_another(model_dir, tmp_path, monkeypatch):
    # metrics.json said "cuda" alone: two evals of an A100 and an H100 read alike (--compare said nothing), and a
    # rescoring that must generate some problems again (their prompts render otherwise today) did so on any GPU model,
    # two kernels' roundings in one eval (a stopped eval's resume was refused there: check_made_on_this_gpu).
    import qerl_cli.evaluate as ev
    from qerl_cli.errors import OtherGpuModelError

    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS), max_num_seqs=3), device="auto")
    with monkeypatch.context() as m:
        _gpus(m, ["H100", "A100"])
        m.setattr(ev, "RULE_VERSION", {"gsm8k": 0, "math": 1})  # an older qerl's rules: scored again below
        made = evaluate(cfg, generate=BySeed())
    assert made["metrics"]["gpu"] == "H100"
    assert evaluate(replace(cfg, out=tmp_path / "cpu"), generate=BySeed())["metrics"]["gpu"] is None  # a CPU has none
    samples = cfg.out / "samples.jsonl"
    samples.write_text(samples.read_text().replace('"prompt": "q1"', '"prompt": "Q1"'))  # same size: not "damaged"
    finished = samples.read_bytes()
    gen = BySeed()
    with monkeypatch.context() as m:
        _gpus(m, ["H100", "A100"])
        with pytest.raises(OtherGpuModelError, match="generated on 'H100'.* which this 'A100' would do with other"):
            evaluate(replace(cfg, device="cuda:1"), generate=gen)
        assert gen.asked == [] and samples.read_bytes() == finished and not list(tmp_path.glob(".e.partial-*"))
        res = evaluate(cfg, generate=gen)  # on its model: scored again, the problems generated again
    assert gen.asked == [[0, 1, 2, 3], [4]] and res["metrics"]["gpu"] == "H100"


def test_a_finished_eval_found_done_on_another_gpu_model_says_whose_score_it_is(model_dir, tmp_path, monkeypatch,
                                                                               capsys):
    # A finished eval is the eval's on any GPU (the model is not in the fingerprint), but a rerun on an A100 node of an
    # eval an H100 generated printed the H100's score as "already done" unsaid, where a CPU node's rerun says whose
    # device's score it is (a review, session 59: grpo.sh's rerun, a requeued Slurm job).
    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS), max_num_seqs=3), device="auto")
    with monkeypatch.context() as m:
        _gpus(m, ["H100", "A100"])
        evaluate(cfg, generate=BySeed())
        capsys.readouterr()
        gen = BySeed()
        assert evaluate(replace(cfg, device="cuda:1"), generate=gen)["already_done"] and gen.asked == []
        assert capsys.readouterr().err == (f"note: {cfg.out} was generated on 'H100', not this 'A100': its score is that "
                                           "GPU model's numerics (pass --force to generate it here)\n")
        assert evaluate(cfg, generate=gen)["already_done"]  # on its model: nothing to say
        assert "note:" not in capsys.readouterr().err


def test_a_stop_on_one_gpu_and_then_another_keeps_one_partial_dir(model_dir, tmp_path, monkeypatch, capsys):
    # Stopped under --device cuda and under cuda:1, the eval kept two partial directories, and --device cuda resumed
    # the one that kept less (review s57r10): now the second run resumes the first's, and the third the second's.
    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS), max_num_seqs=3), device="auto")
    with monkeypatch.context() as m:
        _gpus(m, ["H100", "H100"])
        first = _stopped(cfg, m)  # problems 0-3
        with pytest.raises(KeyboardInterrupt) as e:
            evaluate(replace(cfg, device="cuda:1"), generate=BySeed(fail_at_call=1))  # stopped again at once
        assert e.value.kept_problems == (4, 5, first) and list(tmp_path.glob(".e.partial-*")) == [first]
        gen = BySeed()
        evaluate(cfg, generate=gen)
    assert gen.asked == [[4]] and not first.exists() and "note: removed" not in capsys.readouterr().err


def test_an_own_partial_dir_is_resumed_beside_an_older_qerls_on_the_same_gpu(model_dir, tmp_path, monkeypatch, capsys):
    # Beside this eval's partial directory (4 problems), one an older qerl left on cuda:1, named by the index (1 kept):
    # the run on cuda:1 resumes its own, the one that kept the most (review s57r10: the other was resumed and this one
    # removed), and removes the older one once finished.
    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS), max_num_seqs=3), device="auto")
    with monkeypatch.context() as m:
        _gpus(m, ["H100", "H100"])
        own = _stopped(cfg, m)
        with monkeypatch.context() as old:
            _indexed(old)
            other = _stopped(replace(cfg, device="cuda:1"), old)
        lines = (other / "samples.jsonl").read_text().splitlines(keepends=True)
        (other / "samples.jsonl").write_text("".join(lines[:3]))  # stopped sooner there: problem 0 only
        gen = BySeed()
        res = evaluate(replace(cfg, device="cuda:1"), generate=gen)
    assert gen.asked == [[4]] and res["manifest"]["config"]["device"] == "cuda"
    assert not own.exists() and not other.exists()
    assert f"note: removed {other}, this eval stopped on cuda:1" in capsys.readouterr().err


def test_an_eval_finished_on_another_gpu_while_this_one_started_is_not_generated_again(model_dir, tmp_path,
                                                                                       monkeypatch):
    # The run on cuda:1 finished the stopped eval between this run's check of --out and its writer lock (review s57r10:
    # the run went on, generating every problem again and replacing the finished output with the same eval). One lock
    # for both: exit 8, nothing generated.
    import qerl_cli.evaluate as ev
    from qerl_cli.errors import OutputBusyError

    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS), max_num_seqs=3), device="auto")
    with monkeypatch.context() as m:
        _gpus(m, ["H100", "H100"])
        _stopped(replace(cfg, device="cuda:1"), m)
        real = ev._encode

        def finished_there_meanwhile(*args, **kw):
            m.setattr(ev, "_encode", real)
            evaluate(replace(cfg, device="cuda:1"), generate=BySeed())  # that run, resumed and finished
            return real(*args, **kw)

        m.setattr(ev, "_encode", finished_there_meanwhile)
        gen = BySeed()
        with pytest.raises(OutputBusyError, match="finished by another qerl eval"):  # exit 8: nothing to do
            evaluate(cfg, generate=gen)
    assert gen.asked == [] and evaluate(cfg, generate=gen)["already_done"]


def test_an_eval_an_older_qerl_finished_on_cuda1_is_still_done(model_dir, tmp_path, monkeypatch, capsys):
    # Its fingerprint names cuda:1: done on any GPU of the node without a note, on a CPU node with one; scored again
    # under today's rules on cuda, the problems whose prompts render otherwise are generated again there (the same
    # numerics), not refused with "rerun this eval on cuda:1".
    import qerl_cli.evaluate as ev

    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS), max_num_seqs=3), device="auto")
    with monkeypatch.context() as m:
        _gpus(m, ["H100", "H100"])
        with monkeypatch.context() as old:
            _indexed(old)
            old.setattr(ev, "RULE_VERSION", {"gsm8k": 0, "math": 1})
            made = evaluate(replace(cfg, device="cuda:1"), generate=BySeed())
        assert made["manifest"]["config"]["device"] == "cuda:1"
        capsys.readouterr()
        samples = cfg.out / "samples.jsonl"
        samples.write_text(samples.read_text().replace('"prompt": "q1"', '"prompt": "Q1"'))  # same size: not damaged
        gen = BySeed()
        res = evaluate(cfg, generate=gen)  # scored again with today's rules
        assert gen.asked == [[0, 1, 2, 3], [4]] and res["metrics"]["device"] == "cuda:1"
        assert res["manifest"]["fingerprint"] == made["manifest"]["fingerprint"]
        for device in ("cuda:1", "cuda", "auto"):
            assert evaluate(replace(cfg, device=device), generate=gen)["already_done"]
        assert "was generated on" not in capsys.readouterr().err
    assert evaluate(cfg, generate=gen)["already_done"]  # a CPU node: another kind of device, said
    assert f"{cfg.out} was generated on cuda:1 (bf16), not cpu (fp32)" in capsys.readouterr().err


def test_a_partial_dir_an_older_qerl_left_on_cuda1_resumes_there(model_dir, tmp_path, monkeypatch):
    # qerl before 2026-11-28 named it by the GPU's index: taken over under its writer lock (exit 8 while that qerl
    # still writes it), renamed to today's name and resumed, not started afresh beside it.
    import fcntl

    from qerl_cli.errors import OutputBusyError

    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS), max_num_seqs=3), device="cuda:1")
    with monkeypatch.context() as m:
        _on_a_gpu(m)
        with monkeypatch.context() as old:
            _indexed(old)
            stopped = _stopped(cfg, old)
        gen = BySeed()
        with open(stopped.with_name(stopped.name + ".lock"), "a+") as live:  # that qerl writing it right now
            fcntl.flock(live.fileno(), fcntl.LOCK_EX)
            with pytest.raises(OutputBusyError):
                evaluate(cfg, generate=gen)
        assert stopped.is_dir()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # not "an unfinished run made with other arguments"
            res = evaluate(cfg, generate=gen)
    assert gen.asked == [[4]] and res["manifest"]["resumed"]["problems"] == 4 and not stopped.exists()
    assert res["manifest"]["config"]["device"] == "cuda" and not list(tmp_path.glob(".e.partial-*"))


def test_a_partial_dir_an_older_qerl_left_on_cuda1_recording_this_gpu_model_resumes_under_auto(model_dir, tmp_path,
                                                                                                monkeypatch):
    # qerl of cc4cca7 recorded the GPU model and resumed its stop on cuda:1 under --device cuda or auto; after the
    # upgrade that command started afresh and, once finished, removed it (review s57r16): its problems generated twice.
    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS), max_num_seqs=3), device="auto")
    for names, out, adopted in ((["H100", "H100"], "same", True), (["A100", "H100"], "other", False),
                                (["H100", "H100"], "unrecorded", False)):
        with monkeypatch.context() as m:
            _gpus(m, names)
            with monkeypatch.context() as old:
                _indexed(old)
                stopped = _stopped(replace(cfg, device="cuda:1", out=tmp_path / out), old)
            if out == "unrecorded":  # qerl before cc4cca7: no model recorded, another index may be another model
                made = json.loads((stopped / MADE_ON).read_text())
                (stopped / MADE_ON).write_text(json.dumps({k: v for k, v in made.items() if k != "gpu"}) + "\n")
            gen = BySeed()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                evaluate(replace(cfg, out=tmp_path / out), generate=gen)
        assert gen.asked == ([[4]] if adopted else [[0, 1, 2, 3], [4]]), out
        assert any("unfinished run made with other arguments" in str(w.message) for w in seen) is not adopted
        assert not stopped.exists()  # resumed, or (another eval's numerics) removed once this one finished


def test_the_sweep_judges_a_partial_dir_under_its_writer_lock(model_dir, tmp_path, monkeypatch):
    # The sweep read a partial directory's record, then took its writer lock and removed it: a run that took the lock
    # between the two (here a GPU's --dtype bf16 --force, resuming the stopped --dtype auto eval: `.made_on.json` now
    # says bf16, an eval --out's fp32 one does not stand for) and stopped again lost its problems to a stale verdict.
    import qerl_cli.outputs as outputs

    cfg = replace(_cfg(model_dir, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS), max_num_seqs=3), device="auto")
    gpu = _stopped(cfg, monkeypatch)  # cuda (bf16), --dtype auto: obsolete once this CPU node finishes fp32
    real_enter = outputs.WriterLock.__enter__

    def a_forced_resume_first(lock):
        if lock.path == gpu.with_name(gpu.name + ".lock"):  # the sweep's, after its verdict: the --force run got there
            made = json.loads((gpu / MADE_ON).read_text())
            (gpu / MADE_ON).write_text(json.dumps(dict(made, dtype_flag="bf16")) + "\n")
        return real_enter(lock)

    monkeypatch.setattr(outputs.WriterLock, "__enter__", a_forced_resume_first)
    with pytest.warns(Warning, match="unfinished run made with other arguments"):
        evaluate(cfg, generate=BySeed())  # on this CPU node: fp32
    assert gpu.is_dir()  # kept: there, --out is another eval, and `--dtype bf16 --force` resumes it
