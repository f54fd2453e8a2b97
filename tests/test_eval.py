"""`qerl eval`: scoring rules, metrics/samples files, pass@k wiring, reruns and bad inputs.

The engine is replaced by a scripted generator here (fast, exact control over what is correct);
tests/test_eval_e2e.py runs the real engine on a tiny model.
"""

import json
import re
import warnings

import pytest

import qerl_cli.evaluate as ev
from qerl_cli.errors import BadInputError, LineageError, OutputExistsError
from qerl_cli.eval_metrics import pass_at_k
from qerl_cli.evaluate import (
    EvalConfig,
    Sample,
    default_max_new_tokens,
    evaluate,
    score_completion,
    scorer_for,
)
from tests.helpers import make_tiny_hf_model


# ---- scoring on crafted answers ----------------------------------------------------------------
@pytest.mark.parametrize(
    "completion, reference, extracted, correct",
    [
        ("so the total is \\boxed{72}.", "72", "72", True),
        ("She pays 3*24 = 72.\n#### 72", "72", "72", True),
        ("#### 72\nthen more text #### 5", "72", "72", True),  # the first #### with a number (task rule)
        ("So the total is 72", "72", None, False),  # no final-answer marker, no statement: not credited
        ("The answer is 72", "72", "72", True),  # an answer statement, the lowest fallback (RULE_VERSION gsm8k 3)
        ("\\boxed{\\frac{1}{2}}", "0.5", "0.5", True),  # fraction vs decimal
        ("\\boxed{0.5}", "\\frac{1}{2}", "0.5", True),  # math-verify, the other way round
        ("\\boxed{\\dfrac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", "\\dfrac{\\sqrt{3}}{2}", True),
        ("\\boxed{3/4}", "\\frac34", "3/4", True),
        ("\\boxed{x^2+1}", "1+x^2", "x^2+1", True),  # equivalent expressions
        ("\\boxed{[1,2)}", "[1, 2)", "[1,2)", True),  # intervals
        ("\\boxed{-3}", "-3", "-3", True),  # negative numbers
        ("#### -3", "3", "-3", False),
        ("#### \u22127", "-7", "-7", True),  # unicode minus
        ("\\boxed{18 \\text{ dollars}}", "18", "18", True),  # units
        ("#### $1,200", "1200", "1200", True),  # currency and thousands separators
        ("#### 5 apples", "5", "5", True),
        ("\\boxed{10\\%}", "10", "10", True),
        ("I am not sure.", "\\frac{1}{2}", None, False),  # no answer (math scorer)
        ("I am not sure.", "4", None, False),  # no answer (gsm8k scorer)
        ("\\boxed{\\frac{1}{3}}", "0.33", "1/3", False),  # not rounded into a match
    ],
)
def test_scoring_crafted_answers(completion, reference, extracted, correct):
    s = score_completion(completion, reference)
    assert (s.extracted, s.correct) == (extracted, correct)


def test_scorer_choice():
    for ref in ("72", "-3.5", "1,000", "$12", "3/4", "10%"):
        assert scorer_for(ref) == "gsm8k", ref
    for ref in ("\\frac{1}{2}", "x^2", "(1, 2)", "\\sqrt{2}", "B"):
        assert scorer_for(ref) == "math", ref
    assert scorer_for("72", "math") == "math"
    # forcing the math scorer on a GSM8K-style answer still works (math-verify on \boxed{})
    assert score_completion("\\boxed{72}", "72", "math").correct
    assert not score_completion("#### 72", "72", "math").correct  # math reads only \boxed{}


# ---- the stage with a scripted engine ------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("evalm"), arch="qwen2", hidden=32, layers=1)


GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A pen costs $2. How much are 5 pens?", "answer": "5 * 2 = 10\n#### 10"},
    {"question": "What is 12 / 4?", "answer": "#### 3"},
    {"question": "What is 1 - 6?", "answer": "#### -5"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class Scripted:
    """A generator whose i-th call answers from a script: text per (prompt index, sample index)."""

    def __init__(self, answers):
        self.answers, self.calls, self.seen = answers, [], 0

    def __call__(self, prompt_ids, n, seeds, progress=None):
        self.calls.append((len(prompt_ids), n, seeds))
        out = []
        for _ in prompt_ids:
            texts = self.answers[self.seen]
            self.seen += 1
            assert len(texts) == n
            out.append([Sample(list(range(len(t.split()))), t, "length" if "..." in t else "stop") for t in texts])
            if progress is not None:
                progress(len(out), 0)
        return out


def run(model_dir, tmp_path, rows, answers, name="e", **kw):
    data = write_jsonl(tmp_path / f"{name}.jsonl", rows) if rows is not None else kw.pop("dataset")
    kw.setdefault("max_new_tokens", 64)  # the tiny model's context is 512 tokens
    kw.setdefault("progress", False)
    cfg = EvalConfig(model=model_dir, dataset=data, out=tmp_path / name, device="cpu", **kw)
    gen = Scripted(answers)
    return evaluate(cfg, generate=gen), gen


def test_greedy_pass1_metrics_and_samples(model_dir, tmp_path):
    answers = [["so \\boxed{7}"], ["#### 10"], ["it is four"], ["#### -5 ..."]]
    res, gen = run(model_dir, tmp_path, GSM8K_ROWS, answers, max_num_seqs=3, progress=True)
    m = res["metrics"]
    assert m["score_name"] == "pass@1" and m["score"] == pytest.approx(0.75)
    lo, hi = m["ci95"]
    assert 0.2 < lo < 0.75 < hi <= 1.0
    assert m["counts"] == {"problems": 4, "samples_per_problem": 1, "samples": 4, "correct_samples": 3,
                           "problems_solved": 3, "no_answer": 1, "truncated": 1}
    assert m["sampling"]["temperature"] == 0.0 and m["scored_with"] == {"gsm8k": 4}
    assert m["lengths"]["max"] == 3 and m["time"]["total_s"] > 0
    assert [c[:2] for c in gen.calls] == [(4, 1)]  # chunks of 4 * max_num_seqs // n prompts
    out = tmp_path / "e"
    assert json.loads((out / "metrics.json").read_text()) == m
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["correct"] for s in samples] == [True, True, False, True]
    assert samples[0]["reference"] == "7" and samples[2]["extracted"] is None
    # no --prompt-template: the row's prompt as rollout uses it, in the tokenizer's chat template
    assert samples[0]["prompt"] == ("<|im_start|>user\nTom has 3 apples and buys 4 more. How many?<|im_end|>\n"
                                    "<|im_start|>assistant\n")
    assert m["prompt_template"] is None
    man = json.loads((out / "manifest.json").read_text())
    assert man["stage"] == "eval" and man["summary"]["score"] == pytest.approx(0.75)


def test_pass_at_k_uses_unbiased_estimator(model_dir, tmp_path):
    right, wrong = "#### 7", "#### 8"
    # n = 4 samples; correct counts per problem: 0, 1, 2, 4
    answers = [[wrong] * 4, [right] + [wrong] * 3, [right, wrong, right, wrong], [right] * 4]
    rows = [{"prompt": f"q{i}", "answer": "7"} for i in range(4)]
    res, gen = run(model_dir, tmp_path, rows, answers, k=2, num_samples=4, temperature=0.8, max_num_seqs=6)
    s = res["metrics"]["scores"]
    assert set(s) == {"pass@1", "pass@2"}
    assert s["pass@1"]["value"] == pytest.approx((0 + 1 + 2 + 4) / 16)
    want = sum(pass_at_k(4, c, 2) for c in (0, 1, 2, 4)) / 4
    assert s["pass@2"]["value"] == pytest.approx(want) and res["metrics"]["score"] == pytest.approx(want)
    assert res["metrics"]["counts"]["problems_solved"] == 3
    assert [c[:2] for c in gen.calls] == [(4, 4)]  # 4 * max_num_seqs // n = 6 prompts per chunk
    seeds = [s for *_, chunk in gen.calls for s in chunk]  # each problem draws from its own seed
    assert len(set(seeds)) == 4 and seeds == [ev._problem_seed(0, i) for i in range(4)]


def test_math500_parquet_without_chat_template_and_custom_template(model_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"problem": "Simplify $\\frac{2}{4}$.", "answer": "\\frac{1}{2}", "unique_id": "a"},
            {"problem": "Solve $x+1=3$.", "answer": "2", "unique_id": "b"}]
    path = tmp_path / "math500.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    res, _ = run(model_dir, tmp_path, None, [["\\boxed{0.5}"], ["\\boxed{3}"]], dataset=path,
                 prompt_template="Q: {prompt}\nA:", chat_template=False)
    m = res["metrics"]
    assert m["score"] == pytest.approx(0.5) and m["scored_with"] == {"math": 1, "gsm8k": 1}
    first = json.loads((tmp_path / "e" / "samples.jsonl").read_text().splitlines()[0])
    assert first["prompt"] == "Q: Simplify $\\frac{2}{4}$.\nA:" and first["id"] == "a"


def test_rerun_is_already_done_and_force(model_dir, tmp_path):
    answers = [["#### 7"], ["#### 1"], ["#### 3"], ["#### -5"]]
    first, _ = run(model_dir, tmp_path, GSM8K_ROWS, answers)
    again, gen = run(model_dir, tmp_path, GSM8K_ROWS, answers)
    assert again["already_done"] and gen.calls == [] and again["metrics"] == first["metrics"]
    with pytest.raises(OutputExistsError, match="--force") as e:
        run(model_dir, tmp_path, GSM8K_ROWS, answers, max_new_tokens=32)
    assert "(max_new_tokens: 64 -> 32; fingerprint " in str(e.value), e.value  # what changed, not two hashes
    redo, gen = run(model_dir, tmp_path, GSM8K_ROWS, answers, max_new_tokens=32, force=True)
    assert not redo["already_done"] and len(gen.calls) == 1


def test_bad_inputs(model_dir, tmp_path):
    with pytest.raises(BadInputError, match="does not exist"):
        evaluate(EvalConfig(model=model_dir, dataset=tmp_path / "nope.jsonl", out=tmp_path / "o"), generate=Scripted([]))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(BadInputError, match="holds no rows"):
        evaluate(EvalConfig(model=model_dir, dataset=tmp_path / "empty.jsonl", out=tmp_path / "o"), generate=Scripted([]))
    with pytest.raises(BadInputError, match=r"noans.jsonl:2: row has no `answer`"):
        run(model_dir, tmp_path, [{"prompt": "a", "answer": "1"}, {"prompt": "b"}], [], name="noans")
    with pytest.raises(BadInputError, match="--model .*: not a directory"):
        evaluate(EvalConfig(model=tmp_path / "m", dataset=tmp_path / "empty.jsonl", out=tmp_path / "o"))
    with pytest.raises(BadInputError, match="--num-samples 2 is less than --k 4"):
        EvalConfig(model=model_dir, dataset="d", out="o", k=4, num_samples=2)
    with pytest.raises(BadInputError, match="identical samples"):
        EvalConfig(model=model_dir, dataset="d", out="o", k=4, temperature=0.0)
    with pytest.raises(BadInputError, match="--scorer"):
        EvalConfig(model=model_dir, dataset="d", out="o", scorer="exact")
    with pytest.raises(BadInputError, match="no room for the prompt"):
        run(model_dir, tmp_path, GSM8K_ROWS, [], name="long", max_new_tokens=600)
    assert not (tmp_path / "o").exists()


def test_default_max_new_tokens_fits_a_small_context(model_dir, tmp_path):
    # The default was a fixed 1024, refused outright on the bundled model's 255-token context (a trial's
    # first `qerl eval`). Now: 1024, or half the context where that is less, recorded as a number.
    answers = [["#### 7"], ["#### 10"], ["#### 4"], ["#### -5"]]
    res, _ = run(model_dir, tmp_path, GSM8K_ROWS, answers, max_new_tokens=None)
    assert res["metrics"]["sampling"]["max_new_tokens"] == 256  # the fixture's 512 positions: 511 halved, up
    res, _ = run(model_dir, tmp_path, GSM8K_ROWS, answers[:0], max_new_tokens=256)
    assert res["already_done"]  # the default and the same number given are one run
    res, _ = run(model_dir, tmp_path, GSM8K_ROWS, answers, name="e100", max_new_tokens=None, max_model_len=100)
    assert res["metrics"]["sampling"]["max_new_tokens"] == 50  # the context it runs with, not the model's
    assert default_max_new_tokens(32767) == 1024 and default_max_new_tokens(255) == 128
    assert default_max_new_tokens(2047) == 1024  # 2048 positions less one: the old default, unchanged
    assert default_max_new_tokens(1) == 1


def test_an_eval_older_qerl_made_with_its_default_still_reads_as_done(model_dir, tmp_path, monkeypatch, capsys):
    # Older qerl's default was a fixed number (1024); where this run takes the default and that number
    # fits the context, an output made with it is this run (a review: 1024 -> 1023 on 2048 positions made
    # every finished eval a new one). Scaled down: the fixture's context is 511 tokens.
    monkeypatch.setattr(ev, "DEFAULT_MAX_NEW_TOKENS", 200)
    answers = [["#### 7"], ["#### 10"], ["#### 4"], ["#### -5"]]
    run(model_dir, tmp_path, GSM8K_ROWS, answers, max_new_tokens=200, max_model_len=300)  # as older qerl ran it
    # Made by today's qerl with an explicit --max-new-tokens 200, it is another eval than the default's 150
    # (a review: it read as done, and one command meant two evals depending on what --out held).
    with pytest.raises(OutputExistsError, match="max_new_tokens: 200 -> 150"):
        run(model_dir, tmp_path, GSM8K_ROWS, [], max_new_tokens=None, max_model_len=300)
    manifest = tmp_path / "e" / "manifest.json"
    m = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(dict(m, created="2026-11-25T10:00:00Z")))  # older qerl's, before the change
    res, _ = run(model_dir, tmp_path, GSM8K_ROWS, [], max_new_tokens=None, max_model_len=300)
    assert res["already_done"]
    # Scored by older answer rules, too: not scored again, as its manifest would then say the samples were
    # generated with today's default (150 tokens); a note says its score is the old rules'.
    metrics = tmp_path / "e" / "metrics.json"
    metrics.write_text(json.dumps({k: v for k, v in json.loads(metrics.read_text()).items() if k != "scorer_version"}))
    sizes = dict(m["output_bytes"], **{"metrics.json": metrics.stat().st_size})
    manifest.write_text(json.dumps(dict(m, created="2026-11-25T10:00:00Z", output_bytes=sizes)))
    res, _ = run(model_dir, tmp_path, GSM8K_ROWS, [], max_new_tokens=None, max_model_len=300, progress=True)
    assert res["already_done"] and "older default --max-new-tokens" in capsys.readouterr().err
    with pytest.raises(OutputExistsError, match="max_new_tokens: 200 -> 100"):  # where the old one did not fit: a new eval
        run(model_dir, tmp_path, GSM8K_ROWS, [], max_new_tokens=None, max_model_len=200)


def test_refuses_adapter_for_another_base(model_dir, tmp_path):
    adapter = tmp_path / "ad"
    adapter.mkdir()
    (adapter / "trainer_state.json").write_text(json.dumps({"global_step": 1, "base_model_hash": "f" * 64}))
    with pytest.raises(LineageError, match=r"trained on base ffffffffffff .* has hash"):
        run(model_dir, tmp_path, GSM8K_ROWS, [], adapter=adapter)
    res, _ = run(model_dir, tmp_path, GSM8K_ROWS, [["#### 7"]] * 4, adapter=adapter, allow_base_mismatch=True)
    assert res["metrics"]["lineage"] == "mismatch-allowed"


def test_compare_cli_prints_runs_side_by_side(model_dir, tmp_path):
    from typer.testing import CliRunner

    from qerl_cli.cli import app

    run(model_dir, tmp_path, GSM8K_ROWS, [["#### 7"], ["#### 1"], ["#### 3"], ["#### 0"]], name="base")
    run(model_dir, tmp_path, GSM8K_ROWS, [["#### 7"], ["#### 10"], ["#### 3"], ["#### -5"]], name="tuned")
    r = CliRunner().invoke(app, ["eval", "--compare", str(tmp_path / "base"), str(tmp_path / "tuned")],
                           terminal_width=200)
    assert r.exit_code == 0, r.output
    assert "50.0 [" in r.output and "100.0 [" in r.output and "pass@1" in r.output
    r = CliRunner().invoke(app, ["eval", "--compare", str(tmp_path / "base"), str(tmp_path)])
    assert r.exit_code == 2 and "metrics.json not found" in r.output
    r = CliRunner().invoke(app, ["eval", "--dataset", "x.jsonl", "--out", "o"])
    assert r.exit_code == 2 and "--model" in r.output
    both = [str(tmp_path / "base"), str(tmp_path / "tuned")]
    r = CliRunner().invoke(app, ["eval", "--compare", *both, "--model", str(model_dir), "--k=2"])
    assert r.exit_code == 2 and "--model, --k would run an eval" in r.output  # not a table without the run asked for
    r = CliRunner().invoke(app, ["eval", "--compare", *both, "-q"], terminal_width=200)
    assert r.exit_code == 0 and "pass@1" in r.output  # --quiet runs nothing: a script's habit is no error


def test_a_stopped_compare_says_nothing_was_written(model_dir, tmp_path, monkeypatch):
    """--compare has no --out and saves no problems: stopped (grpo.sh's last command, Ctrl-C), it said "--out was not
    written (a rerun resumes its saved problems)" (a review, session 57)."""
    from typer.testing import CliRunner

    import qerl_cli.eval_metrics as em
    from qerl_cli.cli import app

    run(model_dir, tmp_path, GSM8K_ROWS, [["#### 7"], ["#### 1"], ["#### 3"], ["#### 0"]], name="base")

    def stop(runs):
        raise KeyboardInterrupt

    monkeypatch.setattr(em, "compare_table", stop)
    r = CliRunner().invoke(app, ["eval", "--compare", str(tmp_path / "base")])
    assert r.exit_code == 130 and r.output.strip() == "interrupted: nothing was written", r.output


def test_vllm_engine_missing_is_a_clear_error(model_dir, tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    data = write_jsonl(tmp_path / "d.jsonl", GSM8K_ROWS)
    cfg = EvalConfig(model=model_dir, dataset=data, out=tmp_path / "o", engine="vllm", max_new_tokens=16,
                     progress=False)  # device auto: --device cpu with --engine vllm is refused first
    with pytest.raises(BadInputError, match="--engine vllm needs vLLM"):
        evaluate(cfg)
    assert not (tmp_path / "o").exists()


def test_template_file_content_is_part_of_the_fingerprint(model_dir, tmp_path):
    tpl = tmp_path / "tpl.txt"
    tpl.write_text("Solve: {prompt}")
    answers = [["#### 7"], ["#### 10"], ["#### 3"], ["#### -5"]]
    res, _ = run(model_dir, tmp_path, GSM8K_ROWS, answers, prompt_template=str(tpl))
    assert res["metrics"]["prompt_template"] == "Solve: {prompt}"
    tpl.write_text("Answer with ####: {prompt}")
    with pytest.raises(OutputExistsError):
        run(model_dir, tmp_path, GSM8K_ROWS, answers, prompt_template=str(tpl))


def test_out_must_not_overlap_inputs(model_dir, tmp_path):
    with pytest.raises(BadInputError, match="--out .* overlaps --model"):
        EvalConfig(model=model_dir, dataset=tmp_path / "d.jsonl", out=model_dir)


def test_samples_from_nan_logits_are_a_numerical_error_not_a_score(model_dir, tmp_path, monkeypatch):
    # fp16 overflow once gave exit 0 and a score of 0 over empty completions.
    from qerl_cli.engine import Completion, LLMEngine
    from qerl_cli.errors import NumericalError

    def nan_generate(self, prompt_ids, sp, n, progress=None, seeds=None):
        return [[Completion([5, 6], [-0.1, float("nan")], "x", "length") for _ in range(n)] for _ in prompt_ids]

    monkeypatch.setattr(LLMEngine, "generate", nan_generate)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Q: 1+1?", "answer": "2"}])
    with pytest.raises(NumericalError, match=r"d.jsonl:1: sample 0 was drawn from NaN/Inf logits") as e:
        evaluate(EvalConfig(model=model_dir, dataset=data, out=tmp_path / "e", device="cpu", max_new_tokens=8,
                            progress=False))
    assert e.value.exit_code == 5 and "--dtype" in e.value.hint
    assert not (tmp_path / "e").exists()


def test_max_model_len_must_be_positive(model_dir, tmp_path):
    with pytest.raises(BadInputError, match="--max-model-len must be >= 1"):
        EvalConfig(model=model_dir, dataset=tmp_path / "d.jsonl", out=tmp_path / "o", max_model_len=0)


def test_a_missing_extra_keeps_its_install_hint(model_dir, tmp_path, monkeypatch):
    # eval replaced every dataset hint with "fix or remove it", also "pip install 'qerl[parquet]'".
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    with pytest.raises(BadInputError, match="needs pyarrow") as e:
        evaluate(EvalConfig(model=model_dir, dataset=tmp_path / "p.parquet", out=tmp_path / "o", device="cpu",
                            progress=False), generate=Scripted([]))
    assert "qerl[parquet]" in e.value.hint


def test_sampled_eval_with_other_batching_is_already_done(model_dir, tmp_path, monkeypatch):
    # Every problem is seeded by (--seed, its row): --max-num-seqs changes no sample, so a rerun with
    # another value is the same eval; one finished by the batch-seeded qerl (which counted the flag) too.
    rows = [{"question": f"{i}+1?", "answer": str(i + 1)} for i in range(3)]
    answers = [["#### 1", "#### 2"]] * 3
    kw = dict(k=2, temperature=0.8)
    res, _ = run(model_dir, tmp_path, rows, answers, max_num_seqs=2, **kw)
    assert not res["already_done"]
    again, gen = run(model_dir, tmp_path, rows, answers, max_num_seqs=8, **kw)
    assert again["already_done"] and gen.calls == []
    new = ev._fingerprint_config
    monkeypatch.setattr(ev, "_fingerprint_config", lambda cfg, *a: dict(new(cfg, *a), max_num_seqs=cfg.max_num_seqs,
                                                                       max_model_len=cfg.max_model_len))
    run(model_dir, tmp_path, rows, answers, name="old", max_num_seqs=2, **kw)
    monkeypatch.setattr(ev, "_fingerprint_config", new)
    assert run(model_dir, tmp_path, rows, answers, name="old", max_num_seqs=2, **kw)[0]["already_done"]


def test_max_model_len_is_not_a_new_eval(model_dir, tmp_path, monkeypatch):
    # Every prompt must fit beside --max-new-tokens, so the context changes no sample: --max-model-len
    # equal to the model's own (or any that fits) once made "different config" and a needless --force.
    from qerl_cli.runtime import context_length

    rows = [{"question": "1+1?", "answer": "2"}]
    assert not run(model_dir, tmp_path, rows, [["#### 2"]])[0]["already_done"]
    assert run(model_dir, tmp_path, rows, [["#### 2"]], max_model_len=context_length(model_dir))[0]["already_done"]
    assert run(model_dir, tmp_path, rows, [["#### 2"]], max_model_len=200)[0]["already_done"]
    # an output finished while the flag counted still reads as done
    new = ev._fingerprint_config
    monkeypatch.setattr(ev, "_fingerprint_config", lambda cfg, *a: dict(new(cfg, *a), max_model_len=cfg.max_model_len))
    run(model_dir, tmp_path, rows, [["#### 2"]], name="old", max_model_len=300)
    monkeypatch.setattr(ev, "_fingerprint_config", new)
    assert run(model_dir, tmp_path, rows, [["#### 2"]], name="old", max_model_len=300)[0]["already_done"]


def test_tokenizer_and_generation_config_are_inputs_of_the_eval(model_dir, tmp_path):
    # The chat template and generation_config.json's EOS change the prompts and where samples stop;
    # an eval after changing them was "already done" with the old score (audit 2026-11-26).
    import shutil

    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    rows = [{"question": "1+1?", "answer": "2"}]
    assert not run(model, tmp_path, rows, [["#### 2"]])[0]["already_done"]
    assert run(model, tmp_path, rows, [["#### 2"]])[0]["already_done"]
    gen = model / "generation_config.json"
    old = gen.read_text() if gen.exists() else None
    gen.write_text(json.dumps({"eos_token_id": [1, 15]}))
    with pytest.raises(OutputExistsError, match="different inputs"):
        run(model, tmp_path, rows, [["#### 2"]])
    gen.write_text(old) if old is not None else gen.unlink()
    assert run(model, tmp_path, rows, [["#### 2"]])[0]["already_done"]
    cfg = model / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace("{", '{"model_max_length": 77, ', 1))
    with pytest.raises(OutputExistsError, match="different inputs"):
        run(model, tmp_path, rows, [["#### 2"]])


def test_eval_finished_before_the_tokenizer_counted_stays_done(model_dir, tmp_path, monkeypatch):
    rows = [{"question": "1+1?", "answer": "2"}]
    real = ev.text_files_hash
    monkeypatch.setattr(ev, "StageOutput", _without_text_input(ev.StageOutput))
    run(model_dir, tmp_path, rows, [["#### 2"]])
    monkeypatch.undo()
    assert ev.text_files_hash is real
    assert run(model_dir, tmp_path, rows, [["#### 2"]])[0]["already_done"]


def _without_text_input(cls):
    """StageOutput as qerl before 2026-11-26 built it: no "text" input."""
    def make(*a, inputs, **kw):
        kw.pop("legacy_inputs", None)
        return cls(*a, inputs={k: v for k, v in inputs.items() if k != "text"}, **kw)
    return make


@pytest.mark.parametrize("answer", ["", "   "])
def test_blank_reference_answer_is_refused(model_dir, tmp_path, answer):
    # A blank reference was scored against a blank \boxed{} as correct.
    with pytest.raises(BadInputError, match="row has no `answer`"):
        run(model_dir, tmp_path, [{"question": "1+1?", "answer": answer}], [["\\boxed{}"]])


def test_sample_count_and_temperature_the_engine_cannot_run_are_refused_early(model_dir, tmp_path):
    rows = [{"question": "1+1?", "answer": "2"}]
    with pytest.raises(BadInputError, match="--num-samples 100 exceeds --max-num-seqs 64") as e:
        run(model_dir, tmp_path, rows, [], k=100)
    assert "--max-num-seqs 100" in e.value.hint
    for t in (1e-40, 1e-6):
        with pytest.raises(BadInputError, match="below 1e-05"):
            run(model_dir, tmp_path, rows, [], k=2, temperature=t)
    (tmp_path / "ds").mkdir()
    with pytest.raises(BadInputError, match="^--dataset /.* is a directory") as e:  # was "--dataset: --dataset ..."
        run(model_dir, tmp_path, None, [], dataset=tmp_path / "ds")
    assert str(e.value).count("--dataset") == 1, str(e.value)


def test_float_answers_are_plain_decimals():
    from qerl_cli.data import _answer

    assert [_answer(x, "w") for x in (1e16, 2.5e-7, 3.0, -4.5)] == ["10000000000000000", "0.00000025", "3", "-4.5"]
    assert score_completion("#### 10000000000000000", _answer(1e16, "w"), scorer_for(_answer(1e16, "w"))).correct


def test_replace_resolves_the_defaults_again(tmp_path):
    import dataclasses

    cfg = EvalConfig(tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "o", k=4)
    assert (cfg.samples, cfg.sampling_temperature) == (4, 1.0)
    one = dataclasses.replace(cfg, k=1)                       # one greedy sample, as a fresh k = 1 config
    assert (one.samples, one.sampling_temperature) == (1, 0.0)
    assert (dataclasses.replace(EvalConfig(tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "o"), k=4).samples) == 4
    kept = dataclasses.replace(EvalConfig(tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "o", k=4, num_samples=8,
                                          temperature=0.7), k=2)
    assert (kept.samples, kept.sampling_temperature) == (8, 0.7)  # values the caller set stay set


def test_fingerprint_is_the_same_with_defaults_spelled_out(tmp_path):
    base = dict(model=tmp_path / "m", dataset=tmp_path / "d.jsonl", out=tmp_path / "o", k=2)
    implicit = ev._fingerprint_config(EvalConfig(**base), "cpu", "float32", None)
    explicit = ev._fingerprint_config(EvalConfig(**base, num_samples=2, temperature=1.0), "cpu", "float32", None)
    assert implicit == explicit and implicit["num_samples"] == 2 and implicit["temperature"] == 1.0


def test_a_chat_template_file_renders_messages_rows_and_is_an_input(model_dir, tmp_path):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(model_dir, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    rows = [{"messages": [{"role": "user", "content": "What is 3 + 4?"}], "answer": "7"}]
    with pytest.raises(BadInputError, match="--chat-template-file"):
        run(base, tmp_path, rows, [["#### 7"]])
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}Q: {{ m.content }}\n{% endfor %}A:")
    res, _ = run(base, tmp_path, rows, [["#### 7"]], chat_template_file=tpl)
    assert res["metrics"]["score"] == 1.0 and "chat_template" in res["manifest"]["inputs"]
    assert run(base, tmp_path, rows, [["#### 7"]], chat_template_file=tpl)[0]["already_done"]
    tpl.write_text("{% for m in messages %}Question: {{ m.content }}\n{% endfor %}Answer:")
    with pytest.raises(OutputExistsError, match="input chat_template changed"):
        run(base, tmp_path, rows, [["#### 7"]], chat_template_file=tpl)


def test_a_max_model_len_beyond_the_model_gets_the_rollouts_note(model_dir, tmp_path, capsys):
    # eval capped it without a word where rollout prints a note (a review, 2026-11-27); -q leaves it out.
    rows = [{"question": "1+1?", "answer": "2"}]
    run(model_dir, tmp_path, rows, [["#### 2"]], max_model_len=100000, progress=True)
    assert "note: --max-model-len 100000 is beyond the model's limit; the model's context is" in capsys.readouterr().err
    run(model_dir, tmp_path, rows, [["#### 2"]], name="q", max_model_len=100000)
    assert "--max-model-len" not in capsys.readouterr().err


def test_max_problems_at_or_above_the_rows_is_the_whole_dataset(model_dir, tmp_path):
    # --max-problems 50, 60 and none all score the same 4 rows; the typed value was fingerprinted, so each
    # was "made from different arguments" (exit 4) and FORCE=1 redid identical evals (a review).
    answers = [["#### 7"], ["#### 1"], ["#### 3"], ["#### -5"]]
    assert not run(model_dir, tmp_path, GSM8K_ROWS, answers, max_problems=50)[0]["already_done"]
    assert run(model_dir, tmp_path, GSM8K_ROWS, answers, max_problems=60)[0]["already_done"]
    assert run(model_dir, tmp_path, GSM8K_ROWS, answers)[0]["already_done"]
    assert run(model_dir, tmp_path, GSM8K_ROWS, answers, max_problems=4)[0]["already_done"]
    with pytest.raises(OutputExistsError, match="max_problems: null -> 3"):  # fewer rows: another eval
        run(model_dir, tmp_path, GSM8K_ROWS, answers, max_problems=3)


def test_an_eval_finished_with_the_typed_max_problems_stays_done(model_dir, tmp_path, monkeypatch):
    answers = [["#### 7"], ["#### 1"], ["#### 3"], ["#### -5"]]
    new = ev._fingerprint_config
    monkeypatch.setattr(ev, "_fingerprint_config", lambda cfg, *a: {**new(cfg, *a), "max_problems": cfg.max_problems})
    monkeypatch.setattr(ev, "_legacy_fingerprint_config", lambda *a, **k: ())  # older qerl wrote just this
    run(model_dir, tmp_path, GSM8K_ROWS, answers, max_problems=50)
    monkeypatch.undo()
    assert run(model_dir, tmp_path, GSM8K_ROWS, answers, max_problems=50)[0]["already_done"]


def test_a_sampled_eval_finished_before_the_batch_seeds_with_the_typed_max_problems_stays_done(model_dir, tmp_path,
                                                                                              monkeypatch):
    # Until 2026-11-26 a sampled eval counted --max-num-seqs; until 2026-11-27 --max-problems as typed. An eval
    # of both eras (pass@2, --max-problems 50 of 4 rows) was done before the every-row change, then exit 4.
    answers = [["#### 7", "#### 8"], ["#### 1", "#### 2"], ["#### 3", "#### 4"], ["#### -5", "#### 5"]]
    new = ev._fingerprint_config
    monkeypatch.setattr(ev, "_fingerprint_config", lambda cfg, *a: {**new(cfg, *a), "max_problems": cfg.max_problems,
                                                                     "max_num_seqs": cfg.max_num_seqs,
                                                                     "max_model_len": cfg.max_model_len})
    monkeypatch.setattr(ev, "_legacy_fingerprint_config", lambda *a, **k: ())
    run(model_dir, tmp_path, GSM8K_ROWS, answers, max_problems=50, k=2)
    monkeypatch.undo()
    assert run(model_dir, tmp_path, GSM8K_ROWS, answers, max_problems=50, k=2)[0]["already_done"]


def test_a_named_chat_template_is_not_an_input_of_the_eval(model_dir, tmp_path):
    # The named chat templates (additional_chat_templates/*.jinja) were hashed into inputs.text when quantize
    # started copying them: an eval that qerl before then had finished on such a model (or on a QDIR re-quantized
    # with them) was refused, "input text changed", though eval renders the default template only.
    import shutil

    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    rows = [{"question": "1+1?", "answer": "2"}]
    assert not run(model, tmp_path, rows, [["#### 2"]])[0]["already_done"]
    (model / "additional_chat_templates").mkdir()
    (model / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS {{ messages[0]['content'] }}")
    assert run(model, tmp_path, rows, [["#### 2"]])[0]["already_done"]


def test_the_datasets_own_column_names_are_read_as_rollout_reads_them(model_dir, tmp_path):
    # eval had no --prompt-key / --answer-key: a dataset rollout read with them had every row refused
    rows = [{"input": "Tom has 3 apples and buys 4 more. How many?", "meta": {"gold": "7"}},
            {"input": "What is 5 + 5?", "meta": {"gold": "10"}}]
    res, gen = run(model_dir, tmp_path, rows, [["#### 7"], ["#### 11"]], prompt_key="input", answer_key="meta.gold")
    assert res["metrics"]["score"] == pytest.approx(0.5)
    samples = [json.loads(x) for x in (tmp_path / "e" / "samples.jsonl").read_text().splitlines()]
    assert [s["reference"] for s in samples] == ["7", "10"] and "Tom has 3 apples" in samples[0]["prompt"]
    # unset, the keys stay out of the fingerprint: evals finished before the flags existed stay done
    base = dict(model=tmp_path / "m", dataset=tmp_path / "d.jsonl", out=tmp_path / "o")
    assert "prompt_key" not in ev._fingerprint_config(EvalConfig(**base), "cpu", "float32", None)
    assert ev._fingerprint_config(EvalConfig(**base, answer_key="a.b"), "cpu", "float32", None)["answer_key"] == "a.b"
    from typer.testing import CliRunner

    from qerl_cli.cli import app

    r = CliRunner().invoke(app, ["eval", "--help"], terminal_width=200)
    assert "--prompt-key" in r.output and "--answer-key" in r.output


def test_a_stop_that_takes_think_s_end_out_of_a_think_prompt_s_samples_is_refused(model_dir, tmp_path):
    # The stop is cut from the text scored: with --stop '</think>' and a template that opens <think>, every sample
    # was judged "<think>" + "... #### 7" with no </think>, where every rule reads nothing: a 0 score, silently.
    from qerl_cli.errors import QerlWarning
    from tests.helpers import THINKING_CHAT_TEMPLATE

    tpl = tmp_path / "think.jinja"
    tpl.write_text(THINKING_CHAT_TEMPLATE)
    rows = [{"prompt": "What is 3 + 4?", "answer": "7"}]
    assert not score_completion("3 + 4 = 7, #### 7\n", "7", opens_think=True).correct  # what "... </think>" leaves
    for stop in ("</think>", "think>", "</think>\n"):
        with pytest.raises(BadInputError, match=r"never holds </think>, and the prompt opens a <think> "
                                                r"\(.*e.jsonl:1\).* so every sample"):
            run(model_dir, tmp_path, rows, [["3 + 4 = 7, #### 7\n"]], stop=(stop,), chat_template_file=tpl)
    assert not (tmp_path / "e").exists()
    with pytest.warns(QerlWarning, match=r"--stop '</answer>' .* the gsm8k rule reads no <answer> tag's answer"):
        res, _ = run(model_dir, tmp_path, rows, [["<answer>7"]], stop=("</answer>",))
    assert res["metrics"]["score"] == 0.0
    with pytest.warns(QerlWarning, match=r"a sample it stops that opened its own <think> scores 0"):  # as rollout
        assert run(model_dir, tmp_path, rows, [["#### 7"]], name="m", stop=("</think>",))[0]["metrics"]["score"] == 1.0


def test_a_stop_that_overlaps_a_tag_or_takes_the_opening_think_is_refused_or_warned_of(model_dir, tmp_path):
    # A review of the check above: eval said nothing of a stop that takes </think> where no prompt opens <think>
    # (rollout warned of it), nor of --stop '<think>', which cuts a sample that opens its own <think> to "" before
    # its answer, nor of a stop that overlaps a tag's edge with whitespace ("\n<answer", ">\n"), which cuts the tag.
    from qerl_cli.errors import QerlWarning
    from tests.helpers import THINKING_CHAT_TEMPLATE

    rows = [{"prompt": "What is 3 + 4?", "answer": "7"}]
    sample = "<think>3 + 4 = 7</think>\n#### 7"
    assert score_completion(sample, "7").correct and not score_completion(sample[:sample.find("<think>")], "7").correct
    with pytest.warns(QerlWarning, match=r"--stop '<think>' .* a sample that opens its own <think> \(its prompt opens "
                                         r"none: .*a.jsonl:1\) is cut there, before its answer: it scores 0"):
        run(model_dir, tmp_path, rows, [["#### 7"]], name="a", stop=("<think>",))
    with pytest.warns(QerlWarning, match=r"--stop '\\n<answer' .* a sample that answers inside an <answer> tag is "
                                         r"cut before its answer"):
        run(model_dir, tmp_path, rows, [["#### 7"]], name="b", stop=("\n<answer",))
    tpl = tmp_path / "think.jinja"
    tpl.write_text(THINKING_CHAT_TEMPLATE)
    with pytest.raises(BadInputError, match=r"--stop '>\\n' .* never holds </think>, and the prompt opens a <think> "
                                            r"\(.*c.jsonl:1\).* so every sample it stops scores 0"):
        run(model_dir, tmp_path, rows, [["7</think>\n#### 7"]], name="c", stop=(">\n",), chat_template_file=tpl)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QerlWarning)  # the prompt opens <think>: its samples hold none to cut
        run(model_dir, tmp_path, rows, [["7</think>\n#### 7"]], name="d", stop=("<think>",), chat_template_file=tpl)


def test_a_stop_that_takes_the_opening_answer_tag_is_warned_of_under_scorer_math(model_dir, tmp_path):
    # A review: '--stop <answer>' cuts a sample that boxes its answer inside the tag (R1-Zero's layout) before it:
    # scored 0 with --scorer math, which was told nothing (the warning was the gsm8k rule's only).
    from qerl_cli.errors import QerlWarning

    rows = [{"prompt": "What is 3 + 4?", "answer": "7"}]
    assert score_completion("<think>3 + 4</think>\n<answer>\\boxed{7}</answer>", "7", "math").correct
    with pytest.warns(QerlWarning, match=r"--stop '<answer>' .* a sample that answers inside an <answer> tag is cut "
                                         r"before its answer: it scores 0"):
        res, _ = run(model_dir, tmp_path, rows, [["<think>3 + 4</think>\n"]], scorer="math", stop=("<answer>",))
    assert res["metrics"]["score"] == 0.0
    # the closing tag's stop leaves the box, which math reads; since math 2 it also reads a tag without a box, which
    # that stop leaves unclosed: warned of under --scorer math too (it was not, the rule reading no tag)
    assert score_completion("<think>3 + 4</think>\n<answer>7</answer>", "7", "math").correct
    with pytest.warns(QerlWarning, match=r"--stop '</answer>' .* the math rule reads no <answer> tag's answer from "
                                         r"a sample it stops \(\\boxed\{\} still scores\)"):
        res, _ = run(model_dir, tmp_path, rows, [["<think>3 + 4</think>\n<answer>\\boxed{7}"]], name="c",
                     scorer="math", stop=("</answer>",))
    assert res["metrics"]["score"] == 1.0


def test_a_whitespace_stop_where_the_prompt_opens_think_is_warned_of(model_dir, tmp_path):
    # A base model's few-shot stop ($'\n\n', $'\n') with a template that opens <think> cut every sample at its
    # thought's first blank line or line break, the <think> left open, where no rule reads: 0 nearly always, unsaid.
    from qerl_cli.engine.llm_engine import _stop_cut
    from qerl_cli.errors import QerlWarning
    from tests.helpers import THINKING_CHAT_TEMPLATE

    done = "3 + 4.\n\nIt is 7.\n</think>\n#### 7"
    assert score_completion(done, "7", opens_think=True).correct
    for stop in ("\n\n", "\n"):
        assert not score_completion(done[:_stop_cut(done, done, (stop,))], "7", opens_think=True).correct
    tpl = tmp_path / "think.jinja"
    tpl.write_text(THINKING_CHAT_TEMPLATE)
    rows = [{"prompt": "What is 3 + 4?", "answer": "7"}]
    for name, stop in (("a", "\n\n"), ("b", "\n")):
        x = re.escape(repr(stop))
        with pytest.warns(QerlWarning, match=rf"--stop {x} is only whitespace and the prompt opens a <think> "
                                             rf"\(.*{name}.jsonl:1\): a sample is cut at the first {x} of its "
                                             r"thought, the <think> left open, .* it scores 0"):
            run(model_dir, tmp_path, rows, [["3 + 4."]], name=name, stop=(stop,), chat_template_file=tpl)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QerlWarning)  # no prompt opens <think>: a sample holds no thought to cut
        run(model_dir, tmp_path, rows, [["#### 7"]], name="c", stop=("\n\n",))


def test_a_math_reference_the_rule_cannot_read_is_warned_of(model_dir, tmp_path):
    # The math rule reads a reference over MAX_MATH_ANSWER_CHARS as no answer: every sample of that problem scored 0,
    # however right, unsaid.
    from qerl_cli.errors import QerlWarning
    from qerl_cli.math_rule import MAX_MATH_ANSWER_CHARS

    long = "x^{2} + " * (MAX_MATH_ANSWER_CHARS // 8) + "1"
    rows = [{"prompt": "What is 3 + 4?", "answer": "7"}, {"prompt": "Expand it.", "answer": long}]
    with pytest.warns(QerlWarning, match=r"a.jsonl:2: the reference is over 1,000 characters, which the math rule "
                                         r"reads as no answer: every sample of its problem scores 0"):
        res, _ = run(model_dir, tmp_path, rows, [["#### 7"], [f"\\boxed{{{long}}}"]], name="a")
    assert res["metrics"]["counts"]["correct_samples"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", QerlWarning)  # --scorer gsm8k: the math rule scores nothing
        run(model_dir, tmp_path, rows, [["#### 7"], ["no"]], name="b", scorer="gsm8k")


def test_a_stop_that_takes_the_closing_answer_tag_names_only_the_rules_that_score(model_dir, tmp_path):
    # --scorer auto: where every reference is LaTeX the math rule scores every problem, yet the warning said the gsm8k
    # rule's #### lines still score (a sample's "#### 1/2" scores 0 there).
    from qerl_cli.errors import QerlWarning

    assert not score_completion("#### 1/2", "\\frac{1}{2}").correct
    latex = [{"prompt": "Half of one?", "answer": "\\frac{1}{2}"}, {"prompt": "Root of 4?", "answer": "\\sqrt{4}"}]
    with pytest.warns(QerlWarning, match=r"the math rule reads no <answer> tag's answer from a sample it stops "
                                         r"\(\\boxed\{\} still scores\)") as got:
        run(model_dir, tmp_path, latex, [["\\boxed{\\frac{1}{2}}"], ["\\boxed{2}"]], name="a", stop=("</answer>",))
    assert not any("gsm8k" in str(w.message) for w in got)
    with pytest.warns(QerlWarning, match=r"the gsm8k and math rules read no <answer> tag's answer from a sample it "
                                         r"stops \(#### lines and \\boxed\{\} still score\)"):
        run(model_dir, tmp_path, latex[:1] + [{"prompt": "3 + 4?", "answer": "7"}], [["#### 1/2"], ["#### 7"]],
            name="b", stop=("</answer>",))


def test_a_template_that_opens_think_scores_completions_from_inside_it(model_dir, tmp_path):
    # A reasoning template's prompt ends in "<think>\n": a completion cut short mid-thought ("#### 7 ..." and no
    # </think>) was credited with its draft; eval now judges it as rollout's rewards do, "<think>" + completion.
    from qerl_cli.eval_metrics import compare_table
    from tests.helpers import THINKING_CHAT_TEMPLATE

    tpl = tmp_path / "think.jinja"
    tpl.write_text(THINKING_CHAT_TEMPLATE)
    rows = [{"prompt": "What is 3 + 4?", "answer": "7"}, {"prompt": "What is 2 + 2?", "answer": "4"}]
    answers = [["maybe #### 7 ..."], ["2 and 2.</think> #### 4"]]
    res, _ = run(model_dir, tmp_path, rows, answers, chat_template_file=tpl)
    samples = [json.loads(x) for x in (tmp_path / "e" / "samples.jsonl").read_text().splitlines()]
    assert [s["correct"] for s in samples] == [False, True] and samples[0]["extracted"] is None
    assert samples[0]["completion"] == "maybe #### 7 ..."  # stored as generated
    assert samples[0]["prompt"].endswith("<think>\n") and "chat_template_kwargs" not in res["manifest"]["config"]
    # enable_thinking=false closes the block in the prompt: the direct answer counts, and it is another eval
    res, _ = run(model_dir, tmp_path, rows, answers, name="off", chat_template_file=tpl,
                 chat_template_kwargs='{"enable_thinking": false}')
    assert res["metrics"]["score"] == 1.0 and res["manifest"]["config"]["chat_template_kwargs"] == {"enable_thinking": False}
    with pytest.raises(OutputExistsError, match="chat_template_kwargs"):
        run(model_dir, tmp_path, rows, answers, name="off", chat_template_file=tpl)
    # --compare names the kwargs among the flags that differ: the score may come from them
    assert "different --chat-template-kwargs" in compare_table([tmp_path / "e", tmp_path / "off"]).caption
    with pytest.raises(BadInputError, match="--chat-template-kwargs with --no-chat-template"):
        run(model_dir, tmp_path, rows, answers, name="x", chat_template=False, chat_template_kwargs={"enable_thinking": True})
