"""Tests that kill mutants of what session 58 added or changed which survived the suite (manual mutation testing,
round 10: outputs.py's new directories and the metrics rewrite's copy beside the file, the TRL NaN hint and the
`environments` refusal hint, the dataset's `messages` column, eval's GPU model (--compare's record, the rescoring's
refusal and record) and math rule 2's new readings: TeX spaces, slashes and bold between boxes, words that are no unit,
scale words, runs of tag spans, an exact value beside its decimal). docs/reliability.md has the counts; each
docstring names the mutant it kills."""

from pathlib import Path

import pytest

from qerl_cli import outputs
from qerl_cli.errors import BadInputError
from qerl_cli.rewards import RewardSet

# ---- outputs.py: _make_dirs, copy_beside --------------------------------------------------------------------------


def test_a_directory_another_process_makes_meanwhile_is_no_error(tmp_path, monkeypatch):
    """Mutant: ``_make_dirs``'s mkdir with ``exist_ok=False``. Two shards of a step make run/step-000012 at once: the
    one whose mkdir comes second, after its own "not there" check, failed its whole rollout (FileExistsError)."""
    real = Path.mkdir

    def racing(self, *args, **kwargs):
        real(self, parents=True, exist_ok=True)  # the other shard's, between the check and this mkdir
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", racing)
    outputs._make_dirs(tmp_path / "run" / "step-000012")
    assert (tmp_path / "run" / "step-000012").is_dir()


def _metrics(tmp_path, name="metrics.jsonl") -> Path:
    path = tmp_path / name
    path.write_text('{"step":0,"loss":1}\n{"step":1,"loss":2}\n')
    return path


def test_a_file_beside_the_metrics_named_like_a_copy_but_no_pid_is_left_alone(tmp_path):
    """Mutant: ``copy_beside`` without its ``pid.isdigit()`` (``int("old")`` raised ValueError: the rewrite failed on
    a user's own ``.metrics.jsonl.tmp-old`` beside the file)."""
    from qerl_cli.train_step import _drop_step_lines

    path = _metrics(tmp_path)
    mine = tmp_path / ".metrics.jsonl.tmp-old"
    mine.write_text("a user's")
    _drop_step_lines(path, 1)
    assert path.read_text() == '{"step":0,"loss":1}\n'
    assert mine.read_text() == "a user's"


@pytest.mark.parametrize("name", ["metrics[1].jsonl", "m.tmp-1.jsonl"])
def test_a_dead_runs_copy_is_removed_whatever_the_metrics_file_is_named(tmp_path, name):
    """Mutants: ``copy_beside``'s glob without ``glob.escape`` (``metrics[1].jsonl`` globbed as ``metrics1.jsonl``,
    its dead copies kept) and its pid read after the first ``.tmp-`` (``split``: a name holding one read no pid)."""
    from qerl_cli.train_step import _drop_step_lines

    path = _metrics(tmp_path, name)
    dead = tmp_path / f".{name}.tmp-{2 ** 22 + 12345}-{outputs._HOST}"  # no such pid
    dead.write_text("half a copy")
    _drop_step_lines(path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_a_copy_names_its_host_so_another_hosts_run_leaves_it(tmp_path, monkeypatch):
    """Mutant: ``copy_beside``'s name without the host. A copy named by its pid alone reads as the host's own to a
    run on another node sharing the file system, which removed it (the pid dead there) while this run wrote it."""
    path = _metrics(tmp_path)
    copy = outputs.copy_beside(path)
    copy.write_text("being written")
    monkeypatch.setattr(outputs, "_HOST", "another_node")
    monkeypatch.setattr(outputs, "_pid_alive", lambda pid: False)  # no process of this pid there
    outputs.copy_beside(path)
    assert copy.read_text() == "being written"


# ---- rewards.py: the TRL NaN hint ----------------------------------------------------------------------------------


def test_a_trl_rewards_infinity_is_not_told_to_return_none(tmp_path):
    """Mutant: ``_checked``'s TRL hint for any non-finite value (``if trl``, not ``trl and isnan``): an infinity is no
    "does not apply" TRL reads, and its hint named None as the way out."""
    f = tmp_path / "inf_r.py"
    f.write_text("def inf_trl(completions, **kwargs):\n    return [float('inf')] * len(completions)\n")
    with pytest.raises(BadInputError, match="returned inf") as e:
        RewardSet.from_specs([f"{f}:inf_trl"]).score_group(["a", "b"], None, "q")
    assert e.value.hint == "rewards must be finite"


# ---- trl_rewards.py: the refusal hint for `environments` -------------------------------------------------------------


@pytest.mark.parametrize("params, hint", [
    ("environments, trainer_state", "qerl has no TRL environments (GRPOTrainer's environment_factory)"),
    ("trainer_state, environments", "qerl has no TRL trainer to pass as `trainer_state`"),
])
def test_the_refusal_hint_names_the_first_trainer_name_a_reward_requires(tmp_path, params, hint):
    """Mutants: ``_trl_refusal_hint``'s environments branch taken on the last missing name (``missing[-1]``) or on any
    (``in missing``): the hint named another parameter than the one the refusal (Python's binding) names."""
    f = tmp_path / "two.py"
    f.write_text(f"def two(completions, {params}):\n    return [0.0] * len(completions)\n")
    with pytest.raises(BadInputError, match="missing a required argument") as e:
        RewardSet.from_specs([f"{f}:two"])
    assert e.value.hint.startswith(hint)


# ---- data.py: `messages` where it is the prompt ----------------------------------------------------------------------

CHAT = [{"role": "user", "content": "2+2?"}]


def _rows(tmp_path, row: dict, **kwargs):
    import json

    from qerl_cli.data import load_prompts

    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps(row) + "\n")
    return load_prompts(p, **kwargs)


def test_messages_beside_a_null_prompt_is_the_prompt_and_no_column(tmp_path):
    """Mutant: ``_messages_is_prompt`` asking whether the row has a ``prompt`` key, not a value (``"prompt" not in
    raw``): a row whose ``prompt`` is null (a Parquet file of text and chat rows) takes ``messages`` as its prompt, and
    was passed it again as a column."""
    row = _rows(tmp_path, {"id": 1, "prompt": None, "messages": CHAT, "answer": "4", "level": 2})[0]
    assert row.prompt_field == CHAT
    assert row.columns == {"id": 1, "level": 2}



# ---- eval_metrics.py: the GPU model --compare reads -------------------------------------------------------------------


def test_compare_reads_a_gpu_record_that_is_no_text_as_none(tmp_path):
    """Mutant: ``_made_on`` taking metrics.json's ``gpu`` as it is, not only a string: a hand-edited or foreign
    metrics.json's ``"gpu": {...}`` failed --compare (TypeError: unhashable type), where an unreadable record is none."""
    import json

    from rich.console import Console

    from qerl_cli.eval_metrics import compare_table
    from tests.test_eval_metrics import _fake_run

    runs = []
    for name, gpu in (("h", "NVIDIA H100 80GB HBM3"), ("x", {"name": "NVIDIA A100"})):
        run = _fake_run(tmp_path / name, name, 0.6)
        m = json.loads((run / "metrics.json").read_text())
        m.update(device="cuda", dtype="bf16", gpu=gpu)
        (run / "metrics.json").write_text(json.dumps(m))
        runs.append(run)
    console = Console(record=True, width=400)
    console.print(compare_table(runs))
    assert "generated on different" not in " ".join(console.export_text().split())


# ---- evaluate.py: a rescoring and the GPU model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def eval_model(tmp_path_factory):
    from tests.helpers import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("evalg"), arch="qwen2", hidden=32, layers=1)


def _eval_cfg(eval_model, tmp_path):
    from dataclasses import replace

    from tests.test_eval_review import ROWS, _cfg, _jsonl

    return replace(_cfg(eval_model, tmp_path, _jsonl(tmp_path / "d.jsonl", ROWS), max_num_seqs=3), device="auto")


def _old_rules_eval(cfg, monkeypatch, gpus):
    import qerl_cli.evaluate as ev
    from qerl_cli.evaluate import evaluate
    from tests.test_eval_review import BySeed, _gpus

    with monkeypatch.context() as m:
        _gpus(m, gpus)
        m.setattr(ev, "RULE_VERSION", {"gsm8k": 0, "math": 1})  # an older qerl's rules: scored again below
        return evaluate(cfg, generate=BySeed())


def test_a_rescoring_on_another_gpu_model_records_the_model_that_generated_the_samples(eval_model, tmp_path,
                                                                                      monkeypatch):
    """Mutant: ``evaluate`` recording this run's GPU model in a rescoring's metrics.json (``_metrics(..., gpu)``), not
    the finished eval's: an H100's samples scored again on an A100 node read as the A100's to --compare."""
    from dataclasses import replace

    from qerl_cli.evaluate import evaluate
    from tests.test_eval_review import BySeed, _gpus

    cfg = _eval_cfg(eval_model, tmp_path)
    assert _old_rules_eval(cfg, monkeypatch, ["H100", "A100"])["metrics"]["gpu"] == "H100"
    gen = BySeed()
    with monkeypatch.context() as m:
        _gpus(m, ["H100", "A100"])
        res = evaluate(replace(cfg, device="cuda:1"), generate=gen)  # nothing to generate again: scored on the A100
    assert gen.asked == [] and not res["already_done"]
    assert res["metrics"]["gpu"] == "H100"


def test_a_rescoring_where_cuda_names_no_gpu_model_is_not_refused_for_one(eval_model, tmp_path, monkeypatch):
    """Mutant: the rescoring refusal without its ``gpu is not None``: where CUDA names no model (``gpu_model`` None),
    there is no second model to compare with (as check_made_on_this_gpu leaves a resume alone), and a rescoring that
    must generate some problems again was refused "generated on 'H100' ... which this None would do"."""
    from qerl_cli.evaluate import evaluate
    from tests.test_eval_review import BySeed, _gpus

    cfg = _eval_cfg(eval_model, tmp_path)
    _old_rules_eval(cfg, monkeypatch, ["H100"])
    samples = cfg.out / "samples.jsonl"
    samples.write_text(samples.read_text().replace('"prompt": "q1"', '"prompt": "Q1"'))  # rendered otherwise today
    gen = BySeed()
    with monkeypatch.context() as m:
        _gpus(m, [None])
        evaluate(cfg, generate=gen)
    assert gen.asked  # generated again here


# ---- math_rule.py: math rule 2's new readings (s58r05) ---------------------------------------------------------------


@pytest.mark.parametrize("completion, reference, ok", [
    ("\\boxed{3}\\hfil\\boxed{4}", "4", False),  # hfill? without its `?`
    ("\\boxed{3}\\enskip\\boxed{4}", "4", False),  # enskip dropped
    ("\\boxed{3}\\thinspace\\boxed{4}", "4", False), ("\\boxed{3}\\medspace\\boxed{4}", "4", False),
    ("\\boxed{3}\\thickspace\\boxed{4}", "4", False), ("\\boxed{3}\\space\\boxed{4}", "4", False),
    ("\\boxed{3} / so \\boxed{4}", "4", True),  # a word after the slash: a correction (a run of slashes lists since s59r14)
])
def test_every_tex_space_of_the_separator_lists_boxes_and_a_word_after_a_slash_does_not(completion, reference, ok):
    """Mutants: ``_SEPARATOR_TEX_SPACE`` without one of its new spacing commands (only ``\\enspace`` and ``\\hfill``
    were tested) and ``_SIDE_BY_SIDE`` taking any text after a slash ("\\boxed{3} // \\boxed{4}" lists since review
    s59r14: a run of separators is no words)."""
    from qerl_cli.answers import is_correct

    assert is_correct(completion, reference, "math") is ok


@pytest.mark.parametrize("completion", [
    "$\\boldsymbol{\\boxed{3}}$ $\\boldsymbol{\\boxed{4}}$", "$\\bm{\\boxed{3}}$ $\\bm{\\boxed{4}}$",
    "\\textbf{ \\boxed{3} } \\textbf{ \\boxed{4} }", "\\textbf {\\boxed{3}} \\textbf {\\boxed{4}}",
    "\\textbf{\\mathbf{\\boxed{3}}} \\textbf{\\mathbf{\\boxed{4}}}",
])
def test_every_bold_around_boxes_side_by_side_lists_them(completion):
    """Mutants: ``_BOLD_OPEN`` without ``boldsymbol|bm`` or the space before its brace, ``_BOLD_CLOSE`` without the
    space before its brace, ``_bold_widened`` taking one bold group (not a nested pair): each read as the last box,
    right for 4."""
    from qerl_cli.answers import is_correct

    assert is_correct(completion, "4", "math") is False
    assert is_correct(completion, "3, 4", "math") is True


@pytest.mark.parametrize("completion, reference, ok", [
    ("\\boxed{5\\text{ cubed}}", "5", False), ("\\boxed{5\\text{ factorial}}", "5", False),
    ("\\boxed{2\\text{ thirds}}", "2", False), ("\\boxed{3\\text{ quarters}}", "3", False),
    ("\\boxed{3\\text{ halves}}", "3", False),
    ("\\boxed{\\text{5 is WRONG}}", "5", False),
    ("\\boxed{5\\text{ Squared}}", "5", False),
    ("\\boxed{5\\text{ pints}}", "5", True),  # "pi" is a word of its own only
])
def test_every_word_that_is_no_unit_is_no_answer(completion, reference, ok):
    """Mutants: ``_NOT_A_UNIT`` without one of its words (only squared, pi, thousandths and wrong were tested), its
    case left, or its first words' closing ``\\b`` ("5 pints" read as 5 pi: no answer)."""
    from qerl_cli.answers import is_correct

    assert is_correct(completion, reference, "math") is ok


@pytest.mark.parametrize("completion, reference, ok", [
    ("\\boxed{3\\text{ billion}}", "3000000000", True), ("\\boxed{2\\text{ hundred}}", "200", True),
    ("\\boxed{2\\text{ Million}}", "2000000", True),  # its case: the power read of the word as written
    ("\\boxed{5\\text{ thousandths}}", "5000", False),  # a scale word whole, not "thousand" + "ths"
    ("\\boxed{5 \\,\\text{thousand}}", "5000", True), ("\\boxed{5~ \\text{thousand}}", "5000", True),
])
def test_every_scale_word_is_its_own_power_of_ten(completion, reference, ok):
    """Mutants: ``_SCALES`` with another power for billion or hundred (thousand and million were tested), the scale
    word read without its case (``IGNORECASE`` dropped, or ``_SCALES`` looked up unlowered), without its closing ``\\b``,
    and at most one spacing between number and group (``{0,1}``)."""
    from qerl_cli.answers import is_correct

    assert is_correct(completion, reference, "math") is ok


def test_a_run_of_as_many_spans_as_boxes_listed_is_still_an_answer():
    """Mutant: ``_tag_hedge``'s degenerate run at ``>= MAX_LISTED_BOXES`` (as boxes, a run of 16 is a list)."""
    from qerl_cli.answers import is_correct
    from qerl_cli.math_rule import MAX_LISTED_BOXES

    spans = [str(i) for i in range(1, MAX_LISTED_BOXES + 1)]
    completion = "<answer>" + " ".join(f"${s}$" for s in spans) + "</answer>"
    assert is_correct(completion, ", ".join(spans), "math") is True


def test_the_run_read_is_the_one_of_the_span_math_verify_reads():
    """Mutant: ``_span_read`` taking the first span of the text math-verify reads (``same[0]``), not the last: the
    run "$5$ $3$" at the end read as the lone "$3$" the prose began with, right for 3."""
    from qerl_cli.answers import is_correct

    completion = "<answer>$3$. So it is not $5$ but $5$ $3$</answer>"
    assert is_correct(completion, "3", "math") is False
    assert is_correct(completion, "5, 3", "math") is True


@pytest.mark.parametrize("completion, reference, ok", [
    ("\\boxed{\\frac13 = .333}", "\\frac13", True),  # a decimal without its 0
    ("\\boxed{-0.333 = -\\frac13}", "-\\frac13", True),  # a negative decimal on the left
])
def test_an_exact_value_beside_its_decimal_reads_every_decimal_at_its_digits(completion, reference, ok):
    """Mutants: ``_EXACT_THEN_DECIMAL`` requiring a digit before the point, ``_DECIMAL_THEN_EXACT`` without its
    minus sign (each read as a false equation: no answer)."""
    from qerl_cli.answers import is_correct

    assert is_correct(completion, reference, "math") is ok


def test_a_bold_group_holding_words_beside_its_box_is_no_bold_box():
    """Mutant: ``_BOLD_OPEN`` without its ``\\s*$``: a bold group anywhere in the 30 characters before a box was taken as
    the box's own, so "Answer: 3", then "Answer: 4" in bold (a correction, the last box) read as a list, "3, 4"."""
    from qerl_cli.answers import is_correct

    assert is_correct("\\textbf{Answer: \\boxed{3}} \\textbf{Answer: \\boxed{4}}", "4", "math") is True


@pytest.mark.parametrize("completion, reference", [
    ("\\boxed{2x = 0.5}", "0.5"),  # no exact number beside the decimal: math-verify's right side
    ("\\boxed{0.34 = 0.3}", "0.3"),  # two decimals: a false equation, though 0.34 rounds to 0.3 at one digit
])
def test_an_equation_of_a_decimal_and_no_exact_number_is_not_an_approximation(completion, reference):
    """Mutants: ``_approximation`` without its ``exact.is_number`` ("2x = 0.5" read as a false approximation: no
    answer, where math-verify reads its right side, 0.5) or without its ``exact.atoms(Float)`` ("0.34 = 0.3" read as
    0.34 beside its rounding, right for 0.3, where it is a false equation)."""
    from qerl_cli.answers import is_correct

    assert is_correct(completion, reference, "math") is (completion == "\\boxed{2x = 0.5}")
