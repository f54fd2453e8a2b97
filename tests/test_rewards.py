"""Reward registry and answer extractors (shared with eval)."""

import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qerl_cli.errors import BadInputError
from qerl_cli.gsm8k_numbers import _APPROX_BEFORE
from qerl_cli.rewards import (
    REWARDS,
    RewardSet,
    extract_answer,
    format_reward,
    get_reward,
    is_correct,
    last_boxed,
    normalize_number,
    parse_reward_specs,
    reference_answer,
)


@pytest.mark.parametrize(
    "text, want",
    [
        ("She sold 48 + 24 = 72 clips.\n#### 72", "72"),
        ("#### 1,234", "1234"),
        ("#### $1,234.50 dollars", "1234.5"),
        ("#### 18.0", "18"),
        ("#### -3", "-3"),
        ("#### \u22127", "-7"),  # unicode minus
        ("#### - 5", "-5"),
        ("#### 1/2", "0.5"),
        ("#### .25", "0.25"),
        ("#### 12 apples", "12"),
        ("#### 40%", "40"),
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{2}", "2"),  # last box wins
        ("\\boxed{\\frac{3}{4}}", "0.75"),
        ("\\boxed{\\dfrac{1}{3}}", "1/3"),
        ("\\boxed{\\$18.00}", "18"),
        ("\\boxed{18\\text{ dollars}}", "18"),
        ("\\boxed{1{,}000}", "1000"),
        ("\\boxed{-2.50}", "-2.5"),
        ("\\boxed 7", "7"),
        ("<think>x</think><answer>3.0</answer>", "3"),
        ("#### 5 \\boxed{6}", "5"),  # #### takes precedence
        ("17+5=22. #### 22\nQ: Tom has 3 pens.\nA: 3+1=4. #### 4", "22"),  # ran on past its answer
        ("#### \n#### 9", "9"),  # a bare #### does not hide the next one
        ("She has 42 left", None),  # no "last number" fallback (an answer statement: test_a_plain_answer_statement_*)
        ("\\boxed{3", None),  # box cut off by max tokens
        ("#### unknown", None),
        ("", None),
        # an equation on a #### line: the number the line starts with, unless it opens an expression
        # (the right side of the last "=" was taken always: 48, 4, 180, 3 below; 2026-11-26 audit)
        ("#### 72 = 48 + 24", "72"),
        ("#### 20 = 4*5", "20"),
        ("#### 3 hours (t = 180 minutes)", "3"),
        ("#### 5 (check: x = 3 + 2)", "5"),
        ("#### 48 + 24 = 72", "72"),
        ("#### 4 \\times 5 = 20", "20"),
        ("#### x = 5", "5"),
    ],
)
def test_gsm8k_extract(text, want):
    assert extract_answer(text, "gsm8k") == want


def test_last_boxed_nested_braces():
    assert last_boxed("x \\boxed{\\frac{1}{\\sqrt{2}}} y") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("nothing") is None
    assert extract_answer("\\boxed{x^{2}+1}", "math") == "x^{2}+1"


def test_normalize_number():
    assert normalize_number("-0") == "0"
    assert normalize_number("007") == "7"
    assert normalize_number("1,000,000.000") == "1000000"
    assert normalize_number("abc") is None


@pytest.mark.parametrize(
    "completion, ref, ok",
    [
        ("#### 72", "72", True),
        ("#### 72.00", "Natalia sold 48/2 = 24 clips in May.\n#### 72", True),  # raw GSM8K answer
        ("#### 0.5", "1/2", True),
        ("#### 1,000", "1000", True),
        ("#### 71", "72", False),
        ("#### -72", "72", False),
        ("no answer", "72", False),
        ("#### 5", None, False),
    ],
)
def test_gsm8k_is_correct(completion, ref, ok):
    assert is_correct(completion, ref, "gsm8k") is ok


@pytest.mark.parametrize(
    "completion, ref, ok",
    [
        ("\\boxed{0.5}", "\\frac{1}{2}", True),
        ("\\boxed{\\frac12}", "0.5", True),
        ("\\boxed{x^2+2x+1}", "(x+1)^2", True),
        ("\\boxed{[1,2)}", "[1,2)", True),
        ("\\boxed{3}", "\\boxed{3}", True),  # reference given as a boxed solution
        ("\\boxed{4}", "3", False),
        ("the answer is 3", "3", False),  # math wants a box
    ],
)
def test_math_is_correct(completion, ref, ok):
    assert is_correct(completion, ref, "math") is ok


def test_reference_answer():
    assert reference_answer("blah\n#### 1,234", "gsm8k") == "1234"
    assert reference_answer("The answer is \\boxed{5}", "math") == "5"
    assert reference_answer("18 dollars") == "18" and reference_answer("$1,000.00") == "1000"
    # a non-numeric reference is not mistaken for the number inside it
    assert reference_answer("x^2") is None and reference_answer("2x") is None
    assert not is_correct("#### 2", "x^2", "gsm8k")
    with pytest.raises(BadInputError, match="unknown answer kind"):
        reference_answer("1", "nope")


@pytest.mark.parametrize(
    "text, want",
    [
        ("<think>step</think><answer>4</answer>", 1.0),
        ("  <think>a\nb</think>\n<answer> 4 </answer>\n", 1.0),
        # never opened: where the chat template opens it, rollout and eval judge "<think>" + completion (below)
        ("step</think><answer>4</answer>", 0.0),
        ("<think>a</think><answer>4</answer> trailing", 0.0),
        ("<answer>4</answer>", 0.0),
        ("<think>a</think>", 0.0),
        ("<think>a</think><answer> </answer>", 0.0),
        ("<think>a</think><think>b</think><answer>4</answer>", 0.0),
    ],
)
def test_format_reward(text, want):
    assert format_reward(text) == want


def test_a_prompt_that_opens_think_is_judged_from_inside_it():
    from qerl_cli.rewards import judged_completion, prompt_opens_think

    assert prompt_opens_think("<|im_start|>assistant\n<think>\n") and prompt_opens_think("Assistant: <think>")
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, enable_thinking=false
    assert not prompt_opens_think("user: what does <think> do?\nassistant:")  # a tag the question mentions
    rs = RewardSet.from_specs(["gsm8k", "format"])
    cut = "so #### 72\nbut wait"  # generation stopped mid-thought: a draft, no </think>
    assert rs.score(judged_completion(cut, True), "72")[0] == {"gsm8k": 0.0, "format": 0.0}
    assert rs.score(judged_completion(cut, False), "72")[0]["gsm8k"] == 1.0  # no open block: an answer
    done = "a</think><answer>72</answer>"
    assert rs.score(judged_completion(done, True), "72")[0] == {"gsm8k": 1.0, "format": 1.0}
    assert format_reward(judged_completion("<think>a</think><answer>72</answer>", True)) == 0.0  # a second <think>


def test_a_stop_that_overlaps_a_tag_with_whitespace_beyond_takes_it():
    # A stop ends the text where it first appears, so one that starts a tag after a newline ("\n<answer") or ends one
    # before it (">\n") cuts every tag an R1-style completion spaces so ("</think>\n<answer>"): the rewards scored
    # the cut text 0 and stop_takes_tag said the stop left the tag alone (only one inside or holding a tag counted).
    from qerl_cli.engine.llm_engine import _stop_cut
    from qerl_cli.stops import THINK_CLOSE, stop_takes_tag

    rs = RewardSet.from_specs(["gsm8k", "format"])
    done = "<think>1 mod 4 is 1.</think>\n<answer>1</answer>"
    spaced = "<think>\n1 mod 4 is 1.\n</think>\n\n<answer>\n1\n</answer>\n"
    for text, stop, tag in ((done, "\n<answer", "<answer>"), (spaced, "\n\n<ans", "<answer>"),
                            (done, ">\n", THINK_CLOSE), (spaced, "\n</", THINK_CLOSE), (spaced, "r>\n", "</answer>")):
        assert rs.score(text, "1")[0] == {"gsm8k": 1.0, "format": 1.0}
        cut = text[:_stop_cut(text, text, (stop,))]  # as the engine cuts it
        assert tag not in cut and rs.score(cut, "1")[0]["format"] == 0.0, (stop, cut)
        assert stop_takes_tag(stop, tag), stop
    assert rs.score(done[:_stop_cut(done, done, ("\n<answer",))], "1")[0] == {"gsm8k": 0.0, "format": 0.0}
    # a stop that holds other text beyond the tag's edge fires at it only where a completion writes that text there
    for stop in (">>>", "x<", "</s>", "<|im_end|>", "\nQ:", "\n\n", "Answer:"):
        assert not any(stop_takes_tag(stop, t) for t in ("<think>", "</think>", "<answer>", "</answer>")), stop


def test_specs_weights_and_scoring():
    rs = RewardSet.from_specs(["gsm8k", "format=0.1"])
    assert rs.weights == {"gsm8k": 1.0, "format": 0.1}
    vals, total = rs.score("<think>a</think><answer>#### 4</answer>", "4")
    assert vals == {"gsm8k": 1.0, "format": 1.0} and total == pytest.approx(1.1)
    vals, total = rs.score("#### 5", "4")
    assert vals == {"gsm8k": 0.0, "format": 0.0} and total == 0.0
    assert rs.needs_answer == ["gsm8k"]
    # comma form is the same thing
    assert [s.name for s in parse_reward_specs(["gsm8k,format=-0.5"])] == ["gsm8k", "format"]


@pytest.mark.parametrize(
    "specs, msg",
    [
        (["nope"], r"unknown reward 'nope' \(known: format, gsm8k, math"),
        (["format=abc"], "weight 'abc' is not a number"),
        (["format=inf"], "finite"),
        (["gsm8k", "gsm8k=2"], "named twice"),
        ([], "no reward named"),
        (["no_such_module_xyz:fn"], "cannot import no_such_module_xyz"),
        (["json:no_such_fn"], "json has no attribute 'no_such_fn'"),
        (["json:__doc__"], "not callable"),
        (["missing_file.py:f"], "does not exist"),
        (["gsm8k:1.0", "format:0.2"], r"'gsm8k:1.0': a weight follows '=', not ':' \(pass --reward gsm8k=1.0\)"),
    ],
)
def test_bad_specs(specs, msg):
    with pytest.raises(BadInputError, match=msg):
        parse_reward_specs(specs)


def test_user_reward_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(
        textwrap.dedent(
            """
            CALLS = []
            def length_penalty(completion, answer, prompt=None):
                CALLS.append(prompt)
                return -len(completion) / 100
            def two_args(completion, answer):
                return 1 if answer in completion else 0
            def bad(completion, answer):
                return "lots"
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "my_rewards_mod", raising=False)
    rs = RewardSet.from_specs(["my_rewards_mod:length_penalty=2", "my_rewards_mod:two_args"])
    assert "my_rewards_mod:length_penalty" not in REWARDS  # user functions are not registered globally
    vals, total = rs.score("x" * 10, "x", prompt="P")
    assert vals == {"my_rewards_mod:length_penalty": -0.1, "my_rewards_mod:two_args": 1.0}
    assert total == pytest.approx(2 * -0.1 + 1.0)
    import my_rewards_mod

    assert my_rewards_mod.CALLS == ["P"]
    bad = RewardSet.from_specs(["my_rewards_mod:bad"])
    with pytest.raises(BadInputError, match="returned str 'lots' for prompt 7, not a number"):
        bad.score("x", "y", where=" for prompt 7")
    # a file path works too, without touching sys.path
    fileset = RewardSet.from_specs([f"{tmp_path / 'my_rewards_mod.py'}:two_args"])
    assert fileset.score("abc", "b")[1] == 1.0


def test_user_reward_that_cannot_be_called_or_raises_is_a_one_line_error(tmp_path):
    f = tmp_path / "rw.py"
    f.write_text("def one(c):\n    return 1.0\n\ndef boom(completion, answer):\n    return 1 / 0\n")
    with pytest.raises(BadInputError, match=r"one\(c\) cannot be called as f\(completion, answer"):
        RewardSet.from_specs([f"{f}:one"])  # found when the flags are read, before any generation
    with pytest.raises(BadInputError, match="cannot be called"):
        RewardSet.from_specs(["os:getcwd"])
    rs = RewardSet.from_specs([f"{f}:boom"])
    with pytest.raises(BadInputError, match=r"reward '.*:boom' raised ZeroDivisionError: division by zero for row 3"):
        rs.score("x", "y", where=" for row 3")


def test_get_reward_builtin():
    assert get_reward("gsm8k")("#### 3", "3") == 1.0
    assert get_reward("math").needs_answer and not get_reward("format").needs_answer


@settings(max_examples=200, deadline=None)
@given(
    value=st.decimals(min_value=-10**7, max_value=10**7, places=3, allow_nan=False, allow_infinity=False),
    commas=st.booleans(), dollar=st.booleans(), pad=st.integers(0, 2), unit=st.sampled_from(["", " dollars", " cm", "%"]),
    boxed=st.booleans(),
)
def test_gsm8k_normalisation_property(value, commas, dollar, pad, unit, boxed):
    """However a number is dressed up, it extracts to the same canonical form and is_correct agrees."""
    from decimal import Decimal

    text = f"{abs(value):,f}" if commas else f"{abs(value):f}"
    if "." in text and pad:
        text += "0" * pad
    text = ("-" if value < 0 else "") + ("$" if dollar else "") + text + unit
    completion = f"\\boxed{{{text}}}" if boxed else f"#### {text}"
    got = extract_answer(completion, "gsm8k")
    want = Decimal(value).normalize()
    assert Decimal(got) == want, (completion, got)
    assert is_correct(completion, format(want, "f"), "gsm8k")
    assert not is_correct(completion, format(want + 1, "f"), "gsm8k")


@pytest.mark.parametrize("text", ["\\boxed{" * 20000, "<answer>" * 20000, "#### " * 20000, "\\boxed " * 20000,
                                  "<think>" + "x" * 50000 + "</think><answer>" + "</answer>" * 5000],
                         ids=["boxed", "answer-tag", "hashes", "bare-boxed", "think"])
def test_degenerate_completions_stay_cheap(text):
    """RL policies do collapse into repeating one token. On these ~100k-char texts a quadratic
    extractor takes minutes; the linear ones take ~0.1 s. The bound only separates the two
    (50x margin for a loaded CI box); it is not a speed target."""
    import time

    t0 = time.perf_counter()
    for kind in ("gsm8k", "math"):
        extract_answer(text, kind)
    format_reward(text)
    assert time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize(
    "completion, ref, ok",
    [
        # a boxed / tagged answer must BE a number: no reward for the 2 in 2*sqrt(2) (2026-11-26 audit)
        ("\\boxed{2\\sqrt{2}}", "2", False), ("\\boxed{3\\pi}", "3", False), ("\\boxed{2^{10}}", "2", False),
        ("\\boxed{-2\\sqrt{3}}", "-2", False), ("\\boxed{5!}", "5", False), ("\\boxed{2 \\cdot 3}", "2", False),
        ("#### 2x", "2", False), ("#### 2^{10}", "2", False), ("<answer>5x</answer>", "5", False),
        ("\\boxed{48+24=72}", "72", True), ("\\boxed{x_1 = 5}", "5", True),  # an equation: its right side
        ("<answer>The answer is 72.</answer>", "72", True), ("#### **72**", "72", True), ("#### 5 \\boxed{6}", "5", True),
        # \frac: mixed numbers, braceless, nested, negative denominators
        ("\\boxed{1\\frac{1}{2}}", "1.5", True), ("\\boxed{1\\frac{1}{2}}", "5.5", False),
        ("\\boxed{\\frac12}", "0.5", True), ("\\boxed{\\frac12}", "12", False),
        ("\\boxed{\\frac{\\frac{1}{2}}{3}}", "1/6", True), ("\\boxed{\\frac{1}{-2}}", "-0.5", True),
        # commas only as thousands separators (groups of 3; Indian 2s inside)
        ("#### 3,5", "35", False), ("#### 1,2", "12", False), ("#### 12,50", "1250", False),
        ("#### 10,00,000", "1000000", True), ("#### 1,234", "1234", True),
        # \text{} content is kept; exact comparison past 28 digits; a leading +
        ("\\boxed{\\text{72}}", "72", True), ("\\boxed{\\textbf{72}}", "72", True), ("\\boxed{\\text{\\$72}}", "72", True),
        ("#### 1.00000000000000000000000000001", "1", False), ("#### 0.99999999999999999999999999999", "1", False),
        ("#### +5", "5", True), ("\\boxed{5}", "+5", True), ("\\boxed{30^\\circ}", "30", True),
        # units after TeX spacing, units with / and ^2, extra braces, \displaystyle (eval audit, 2026-11-26)
        ("\\boxed{18\\ \\text{dollars}}", "18", True), ("\\boxed{18\\;\\text{dollars}}", "18", True),
        ("\\boxed{18\\quad\\text{dollars}}", "18", True), ("\\boxed{18 \\text{ km/h}}", "18", True),
        ("\\boxed{18 \\text{ ft}^2}", "18", True), ("\\boxed{18^\\circ \\text{F}}", "18", True),
        ("\\boxed{{18}}", "18", True), ("\\boxed{\\displaystyle 18}", "18", True), ("\\boxed{18~km}", "18", True),
        # a bracket glued to a number is a product, not digits; "x" between numbers is times; two answers are none
        ("\\boxed{2(3)}", "23", False), ("\\boxed{2(3)}", "6", False), ("#### 5(2) = 10", "10", True),
        ("#### 2 x 3 = 6", "6", True), ("#### 3 (t = 180 minutes)", "3", True), ("\\boxed{x = 5, y = 18}", "18", False),
        ("\\boxed{x = y = 5}", "5", True), ("\\boxed{x = 5 and y = 18}", "18", False),
        # (review of the above) thousands commas are no second equation, one variable is one answer,
        # and a power stands only on a unit word
        ("The total is \\boxed{x = 1,200 + 300 = 1,500}", "1500", True),
        ("\\boxed{2,000 \\times 3 = 6,000 = 6000}", "6000", True), ("\\boxed{n^2 = 25, n = 5}", "5", True),
        ("\\boxed{10 ^{2}}", "10", False), ("\\boxed{10 ^2}", "10", False), ("\\boxed{9.8 \\text{ m/s}^2}", "9.8", True),
        ("\\boxed{12\\text{ cm}^{2}}", "12", True),
    ],
)
def test_gsm8k_rule_edge_cases(completion, ref, ok):
    assert is_correct(completion, ref, "gsm8k") is ok


@pytest.mark.parametrize("text", ["#### " + "1" * 4301, "\\boxed{" + "9" * 5000 + "}", "#### " + "1," * 4400,
                                  "#### 0." + "3" * 100000], ids=["int-4301", "boxed-5000", "commas", "decimal-100k"])
def test_absurdly_long_numbers_are_no_answer_and_cheap(text):
    # int() refuses 4300+ digits: one collapsed sample of repeated digits stopped a whole rollout.
    import time

    t0 = time.perf_counter()
    assert extract_answer(text, "gsm8k") is None and not is_correct(text, "1", "gsm8k")
    assert time.perf_counter() - t0 < 2.0


def test_format_tags_inside_the_parts_are_refused():
    assert format_reward("<think>a<answer>3</answer></think><answer>4</answer>") == 0.0
    assert format_reward("<think>a</think><answer>4</think></answer>") == 0.0


def test_eval_auto_scorer_follows_the_training_rule_and_stays_cheap():
    import time

    from qerl_cli.evaluate import scorer_for

    assert [scorer_for(r) for r in ("72", "+5", "7 apples", "$1,000", "5.", "\\frac{1}{2}", "x^2", "-2,1")] == [
        "gsm8k", "gsm8k", "gsm8k", "gsm8k", "gsm8k", "math", "math", "math"]
    t0 = time.perf_counter()
    scorer_for("1" + " " * 100000 + "!")  # the old regex backtracked for 11 s on 1,500 spaces
    assert time.perf_counter() - t0 < 2.0


def test_user_rewards_the_2026_11_26_audit_found(tmp_path):
    # A string "1" was scored 1.0; 10**400 was an OverflowError traceback; SystemExit from a reward (or a
    # module parsing its argv at import) ended qerl with that code and no message; a .py file using
    # dataclasses failed to import (not in sys.modules while it ran); a functools.partial had no source
    # file, so editing its file left the rollout "already done".
    f = tmp_path / "rw2.py"
    f.write_text(textwrap.dedent("""
        from __future__ import annotations
        import dataclasses, functools, sys

        @dataclasses.dataclass
        class Cfg:
            k: float = 0.5

        def as_text(c, a):
            return "1"
        def huge(c, a):
            return 10 ** 400
        def leaves(c, a):
            sys.exit(3)
        def _scaled(c, a, k):
            return k
        scaled = functools.partial(_scaled, k=Cfg().k)
    """))
    for fn, why in (("as_text", "returned str '1'"), ("huge", "returned an integer beyond float"), ("leaves", "raised SystemExit")):
        with pytest.raises(BadInputError, match=why):
            RewardSet.from_specs([f"{f}:{fn}"]).score("x", "y")
    rs = RewardSet.from_specs([f"{f}:scaled"])
    assert rs.score("x", "y")[1] == 0.5
    assert rs.specs[0].reward.source == str(f)
    g = tmp_path / "argv_at_import.py"
    g.write_text("import sys\nsys.exit(2)\ndef r(c, a):\n    return 0.0\n")
    with pytest.raises(BadInputError, match=r"cannot import .*\(SystemExit: 2\)"):
        RewardSet.from_specs([f"{g}:r"])



def test_a_reward_made_by_exec_or_eval_hashes_the_file_it_was_loaded_from(tmp_path):
    # Such a function has no source file of its own: eval's lambda named "<string>", which the rollout hashed as
    # a path (FileNotFoundError traceback), and exec's into a dict named none, so the reward file went unhashed
    # and an edited one left the rollout "already done" with the old rewards.
    f = tmp_path / "made.py"
    f.write_text('ns = {}\nexec("def made(completion, answer):\\n    return 1.0\\n", ns)\nmade = ns["made"]\n'
                 'short = eval("lambda completion, answer: float(len(completion) < 5)")\n')
    for fn in ("made", "short"):
        rs = RewardSet.from_specs([f"{f}:{fn}"])
        assert rs.specs[0].reward.source == str(f)
        assert rs.score("abc", None)[1] == 1.0


def test_a_reward_named_nan_or_inf_loads_and_one_from_a_zip_hashes_the_archive(tmp_path, monkeypatch):
    # A review of the two checks above. float() reads "nan", "inf" and "infinity", which are names a function may
    # have: 'r.py:nan' was refused as a weight typo. A module zipimport loaded has no file of its own nor a __file__
    # that is one ("r.zip/zipped.py"): its reward went unhashed, so an edited archive left a rollout "already done".
    import zipfile

    f = tmp_path / "r.py"
    f.write_text("def nan(completion, answer):\n    return 1.0\n\ninf = infinity = nan\n")
    for fn in ("nan", "inf", "infinity"):
        assert RewardSet.from_specs([f"{f}:{fn}"]).score("a", None) == ({f"{f}:{fn}": 1.0}, 1.0)
    with pytest.raises(BadInputError, match=r"a weight follows '=', not ':' \(pass --reward r.py:inf=1e-3\)"):
        RewardSet.from_specs(["r.py:inf:1e-3"])
    z = tmp_path / "r.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("zipped_reward_review.py", "def r(completion, answer):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(z))
    assert RewardSet.from_specs(["zipped_reward_review:r"]).specs[0].reward.source == str(z)


def test_a_reward_file_under_a_folder_whose_name_holds_an_equals_sign_loads(tmp_path, monkeypatch):
    # Hydra-style run dirs (outputs/lr=1e-5/): the spec's last '=' was read as NAME=WEIGHT, "weight '1e-5/r.py:fn' is
    # not a number". A weight holds no ':': one after the '=' is the path's. Weights and their typos read as before.
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "outputs" / "lr=1e-5"
    run.mkdir(parents=True)
    (run / "r.py").write_text("def fn(completion, answer):\n    return 1.0\n")
    (tmp_path / "r.py").write_text((run / "r.py").read_text())
    for spec, name, weight in (("outputs/lr=1e-5/r.py:fn", "outputs/lr=1e-5/r.py:fn", 1.0),
                               ("outputs/lr=1e-5/r.py:fn=0.5", "outputs/lr=1e-5/r.py:fn", 0.5),
                               (f"{run}/r.py:fn=-2", f"{run}/r.py:fn", -2.0), ("r.py:fn=0.5", "r.py:fn", 0.5),
                               ("gsm8k=1.0", "gsm8k", 1.0)):
        (s,) = parse_reward_specs([spec])
        assert (s.name, s.weight) == (name, weight)
    assert parse_reward_specs(["outputs/lr=1e-5/r.py:fn"])[0].reward.source == str(run / "r.py")
    with pytest.raises(BadInputError, match=r"reward 'outputs/lr=2e-5/r.py:fn': file outputs/lr=2e-5/r.py does not"):
        parse_reward_specs(["outputs/lr=2e-5/r.py:fn"])
    with pytest.raises(BadInputError, match=r"weight 'x0.5' is not a number"):
        parse_reward_specs(["outputs/lr=1e-5/r.py:fn=x0.5"])


HINT_COMMA_PATH = "a reward file whose path holds ',' is read whole only from a --reward of its own"


def test_a_reward_file_whose_path_holds_a_comma_is_one_spec_where_it_exists(tmp_path, monkeypatch):
    # Commas separated specs everywhere, so runs/a,b/r.py (a Hydra multirun's lr=1e-5,seed=1/ dir) could not be named:
    # "unknown reward 'runs/a'". A value that is one file.py:function[=WEIGHT] whose file exists is taken whole.
    monkeypatch.chdir(tmp_path)
    for d in ("runs/a,b", "outputs/lr=1e-5,seed=1"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "r.py").write_text("def fn(completion, answer):\n    return 1.0\n")
    (tmp_path / "r.py").write_text("def fn(completion, answer):\n    return 1.0\n")
    for specs, want in ((["runs/a,b/r.py:fn=0.5"], [("runs/a,b/r.py:fn", 0.5)]),
                        (["outputs/lr=1e-5,seed=1/r.py:fn"], [("outputs/lr=1e-5,seed=1/r.py:fn", 1.0)]),
                        ([f"{tmp_path}/runs/a,b/r.py:fn=-2", "gsm8k,format=0.1"],
                         [(f"{tmp_path}/runs/a,b/r.py:fn", -2.0), ("gsm8k", 1.0), ("format", 0.1)]),
                        (["r.py:fn,gsm8k"], [("r.py:fn", 1.0), ("gsm8k", 1.0)]),  # the comma after the path separates
                        (["gsm8k,r.py:fn=2"], [("gsm8k", 1.0), ("r.py:fn", 2.0)])):
        assert [(s.name, s.weight) for s in parse_reward_specs(specs)] == want
    assert parse_reward_specs(["runs/a,b/r.py:fn"])[0].reward.source == str(tmp_path / "runs/a,b/r.py")
    for spec, hint in (("runs/a,c/r.py:fn", HINT_COMMA_PATH),
                       ("gsm8k,runs/a,b/r.py:fn", HINT_COMMA_PATH),
                       ("format=0,1", "a weight's decimal mark is '.'")):
        with pytest.raises(BadInputError, match="unknown reward") as e:
            parse_reward_specs([spec])
        assert hint in e.value.hint, e.value


def test_a_weight_past_the_reward_limit_is_refused_before_any_generation():
    # 'format=1e20' was accepted, and the first completion it scored 1 failed the rollout: "the weighted reward
    # total is 1e+20", after that batch's generation.
    with pytest.raises(BadInputError, match=r"weight 1e\+20 is beyond the limit \(rewards .* within \+-1e15\)"):
        parse_reward_specs(["gsm8k", "format=1e20"])
    assert parse_reward_specs(["format=-1e15"])[0].weight == -1e15


def test_an_async_or_generator_reward_is_refused_when_loaded(tmp_path):
    # (TRL takes async rewards) its coroutine passed the signature check and was refused as "returned coroutine ...,
    # not a number" at the first completion scored, after the first batch's generation.
    f = tmp_path / "ar.py"
    f.write_text("async def judge(completion, answer):\n    return 1.0\n\n"
                 "def gen(completion, answer):\n    yield 1.0\n\n"
                 "class Judge:\n    async def __call__(self, completion, answer):\n        return 1.0\n\njudge_obj = Judge()\n")
    for fn, why in (("judge", "is async"), ("judge_obj", "is async"), ("gen", "is a generator")):
        with pytest.raises(BadInputError, match=why):
            RewardSet.from_specs([f"{f}:{fn}"])


def test_a_reward_value_whose_float_conversion_raises_is_a_one_line_error(tmp_path):
    # float() of what the function returned raising anything but TypeError/ValueError (a meta tensor's .item(), a
    # CUDA tensor whose kernel failed: RuntimeError) escaped as a traceback, exit 1, as if qerl had a bug.
    f = tmp_path / "fr.py"
    f.write_text("import torch\n\nclass Score:\n    def __float__(self):\n        raise RuntimeError('device-side assert')\n\n"
                 "def obj(completion, answer):\n    return Score()\n\n"
                 "def meta(completion, answer):\n    return torch.empty((), device='meta')\n")
    for fn, msg in (("obj", "returned Score for p.jsonl:3, which float() refused (RuntimeError: device-side assert)"),
                    ("meta", "returned Tensor for p.jsonl:3, which float() refused (RuntimeError: ")):
        with pytest.raises(BadInputError) as e:
            RewardSet.from_specs([f"{f}:{fn}"]).score("x", "y", where=" for p.jsonl:3")
        assert msg in str(e.value), e.value


def test_a_reward_that_raises_names_the_line_of_its_file_on_one_line(tmp_path):
    # "raised KeyError: 'x' for p.jsonl:3" was all: no line of the user's function (the traceback is dropped), and an
    # exception message of several lines (an assert's) made the one-line error several.
    f = tmp_path / "rr.py"
    f.write_text("import json\n\ndef lookup(completion, answer):\n    table = {}\n    return table[completion]\n\n"
                 "def parse(completion, answer):\n    return json.loads(completion)\n\n"
                 "def checks(completion, answer):\n    assert False, 'bad\\ncompletion'\n\n"
                 "def bare(completion, answer):\n    raise ValueError\n")
    for fn, msg in (("lookup", f"raised KeyError: 'x' for p.jsonl:3 (at {f}:5, in lookup)"),
                    ("parse", f"for p.jsonl:3 (at {f}:8, in parse)"),  # the user's line, not json's
                    ("checks", f"raised AssertionError: bad completion for p.jsonl:3 (at {f}:11, in checks)"),
                    ("bare", "raised ValueError for p.jsonl:3")):
        with pytest.raises(BadInputError) as e:
            RewardSet.from_specs([f"{f}:{fn}"]).score("x", "y", where=" for p.jsonl:3")
        assert msg in str(e.value) and "\n" not in str(e.value), e.value


def test_a_reward_file_value_with_commas_around_it_or_several_in_it_reads_right(tmp_path, monkeypatch):
    # A review of the comma rule. 'runs/a,b/r.py:fn,' (a list joined with a trailing comma; 'gsm8k,' is gsm8k) was
    # split, "unknown reward 'runs/a'", hinting to give the file the --reward it had; a decimal comma in its weight was
    # hinted as a path. Every other value with a comma path that names no reward gets the one rule as its hint.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs/a,b").mkdir(parents=True)
    (tmp_path / "runs/a,b/r.py").write_text("def fn(completion, answer):\n    return 1.0\n\ng = fn\n")
    (tmp_path / "runs/d,e/r.py").mkdir(parents=True)
    for raw in ("runs/a,b/r.py:fn,", ",runs/a,b/r.py:fn=2, ", "runs/a,b/r.py:fn=2,\n"):
        assert [(s.name, s.weight) for s in parse_reward_specs([raw])] == [("runs/a,b/r.py:fn", 1.0 if "=" not in raw else 2.0)]
    for spec, hint in (("runs/a,b/r.py:fn=0,5", "a weight's decimal mark is '.'"),
                       ("runs/a,b/r.py:fn,runs/a,b/r.py:g", HINT_COMMA_PATH),
                       ("runs/d,e/r.py:fn", HINT_COMMA_PATH)):
        with pytest.raises(BadInputError, match="unknown reward 'runs/") as e:
            parse_reward_specs([spec])
        assert hint in e.value.hint, e.value


def test_a_reward_from_a_zip_that_raises_names_its_line_in_the_archive(tmp_path, monkeypatch):
    # A module zipimport loaded has its archive as its source, and "r.zip/mod.py" as its frames' file: none matched,
    # so the error named the deepest line of the call, json's decoder, not the reward's.
    import zipfile

    z = tmp_path / "r.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("zipped_raising_review.py", "import json\n\ndef r(completion, answer):\n    return json.loads(completion)\n")
    monkeypatch.syspath_prepend(str(z))
    with pytest.raises(BadInputError) as e:
        RewardSet.from_specs(["zipped_raising_review:r"]).score("x", "y")
    assert f"(at {z / 'zipped_raising_review.py'}:4, in r)" in str(e.value), e.value


def test_a_complex_or_a_fraction_past_floats_range_is_refused_by_its_type(tmp_path):
    # float() of a numpy complex kept its real part with only a ComplexWarning (np.emath.sqrt(-1) scored 0.0, a Python
    # complex is refused); a Fraction past float's range was "returned an integer beyond float's range".
    f = tmp_path / "cr.py"
    f.write_text("import fractions\nimport numpy as np\nimport torch\n\n"
                 "def root(completion, answer):\n    return np.emath.sqrt(-1.0)\n\n"
                 "def arr(completion, answer):\n    return np.array(1 + 0j)\n\n"
                 "def ten(completion, answer):\n    return torch.tensor(1 + 0j)\n\n"
                 "def frac(completion, answer):\n    return fractions.Fraction(10 ** 400, 3)\n")
    for fn, msg in (("root", "returned complex128 '1j', not a number"), ("arr", "returned ndarray '(1+0j)', not a number"),
                    ("ten", "returned Tensor 'tensor(1.+0.j)', not a number"),
                    ("frac", "returned Fraction beyond float's range")):
        with pytest.raises(BadInputError) as e:
            RewardSet.from_specs([f"{f}:{fn}"]).score("x", "y")
        assert msg in str(e.value), e.value


def test_braceless_mixed_numbers_and_huge_whole_parts():
    # 3\frac12 is the mixed number 3.5 (as 3\frac{1}{2} is), not "3" glued to "0.5" = 30.5
    assert extract_answer("\\boxed{3\\frac12}", "gsm8k") == "3.5"
    assert extract_answer("#### 3\\tfrac{1}2 cups", "gsm8k") == "3.5"
    assert is_correct("\\boxed{3\\frac12}", "3.5") and not is_correct("\\boxed{3\\frac12}", "30.5")
    assert extract_answer("\\boxed{1\\frac{\\frac{1}{2}}{3}}", "gsm8k") == "7/6"
    assert extract_answer("\\boxed{\\frac12}", "gsm8k") == "0.5"  # a braceless \frac's digits are no whole part
    # a whole part of 4300+ digits made int() raise out of the built-in reward (a traceback ending the rollout)
    for text in ("\\boxed{" + "1" * 5000 + "\\frac{1}{2}}", "#### " + "1" * 5000 + "\\frac{1}{2}",
                 "\\boxed{1\\frac{1}{" + "3" * 5000 + "}}"):
        assert extract_answer(text, "gsm8k") is None
        assert REWARDS["gsm8k"](text, "5") == 0.0


def test_a_frac_glued_to_another_number_is_no_answer():
    # a \frac's value merged with a neighbour into a wrong number: \frac12\frac13 -> "0.51/3" = 0.17,
    # (2)\frac12 and {2}\frac12 -> 20.5, \frac{1}{2}3 -> 0.53, 2\frac12\frac13 -> "2.51/3" = 251/300
    for glued, wrong in (("\\frac{1}{2}\\frac{1}{3}", "0.17"), ("\\frac12\\frac13", "0.17"), ("(2)\\frac12", "20.5"),
                         ("{2}\\frac12", "20.5"), ("\\frac{1}{2}3", "0.53"), ("2\\frac12\\frac13", "251/300")):
        for text in ("\\boxed{" + glued + "}", "#### " + glued, "<answer>" + glued + "</answer>"):
            assert extract_answer(text, "gsm8k") is None, text  # the eval path
            assert REWARDS["gsm8k"](text, wrong) == 0.0, text  # the reward
        assert reference_answer("#### " + glued, "gsm8k") is None
    # what stays a number: spaced or TeX-spaced mixed numbers, a sign, \dfrac/\tfrac, %, a full stop after
    for text, value in (("2\\,\\frac12", "2.5"), ("2 \\frac{1}{2}", "2.5"), ("-3\\frac12", "-3.5"),
                        ("\\tfrac{1}{2}", "0.5"), ("\\dfrac{1}{2}", "0.5"), ("\\frac12\\%", "0.5"), ("\\frac12.", "0.5"),
                        ("(\\frac12)", "0.5"), ("\\frac{\\frac{1}{2}}{3}", "1/6")):
        assert extract_answer("\\boxed{" + text + "}", "gsm8k") == value, text


def test_a_reward_that_mutates_the_chat_prompt_changes_nothing_else():
    def judge(completion, answer, prompt=None):
        prompt.append({"role": "assistant", "content": completion})  # building a judge's conversation
        return float(len(prompt))

    from qerl_cli.rewards import Reward, RewardSpec

    rs = RewardSet([RewardSpec("m:judge", 1.0, Reward("m:judge", judge, "user", source="m.py"))])
    chat = [{"role": "user", "content": "q"}]
    assert [rs.score(c, "1", chat)[1] for c in ("a", "b")] == [2.0, 2.0]
    assert chat == [{"role": "user", "content": "q"}]


def test_math_verify_log_lines_do_not_carry_a_whole_completion(caplog):
    import logging

    from qerl_cli.math_rule import _math_verify_equal

    _math_verify_equal("1", "1")  # installs the filter
    # what math-verify logs when parsing a degenerate completion's box times out (after 5 s)
    logging.getLogger("math_verify.parser").warning(f"Timeout during parsing: {'x+' * 50_000}")
    assert caplog.records and len(caplog.records[-1].getMessage()) < 400


def test_a_reward_past_floats_range_gets_the_limit_message():
    # 10**5000 is a number (past str()'s 4300 digits too); float() overflowed and the message said "not a number (a float)" (a review)
    from qerl_cli.rewards import Reward, RewardSpec

    rs = RewardSet([RewardSpec("m:big", 1.0, Reward("m:big", lambda c, a, prompt=None: 10**5000, "user", source="m.py"))])
    with pytest.raises(BadInputError, match="returned an integer beyond float's range") as e:
        rs.score("a", "1", "q")
    assert "1e15" in (e.value.hint or "")


def test_the_math_reward_off_the_main_thread_runs_without_a_timeout_and_says_so(caplog, monkeypatch):
    # math-verify's timeout is SIGALRM (main thread only): a reward scored from a worker thread got none, silently
    # but for math-verify's own "you must provide the logic for timeout interuption yourself"
    import threading
    import warnings

    import math_verify
    import math_verify.grader
    import math_verify.parser

    from qerl_cli import math_rule
    from qerl_cli.errors import QerlWarning

    for mod in (math_verify.parser, math_verify.grader):  # math-verify logs its note once a process
        monkeypatch.setattr(mod, "TIMEOUT_WARNING_SHOWN", False, raising=False)
    math_rule._math_verify_equal.cache_clear()
    math_rule._warn_no_timeout.cache_clear()
    timeouts = []
    parse, verify = math_verify.parse, math_verify.verify
    monkeypatch.setattr(math_verify, "parse", lambda *a, **kw: timeouts.append(kw["parsing_timeout"]) or parse(*a, **kw))
    monkeypatch.setattr(math_verify, "verify", lambda *a, **kw: timeouts.append(kw["timeout_seconds"]) or verify(*a, **kw))
    got = []

    def score():
        got.extend(REWARDS["math"](c, "0.5") for c in ("\\boxed{\\frac12}", "\\boxed{\\frac13}", "\\boxed{\\frac12}"))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = threading.Thread(target=score)
        t.start()
        t.join(60)
    assert got == [1.0, 0.0, 1.0]  # no error: signal.signal is never called off the main thread
    assert [str(w.message)[:60] for w in caught if issubclass(w.category, QerlWarning)] == [
        "the math reward is scored off the main thread: math-verify's"]  # once a process
    assert not [r for r in caplog.records if "Timeout is disabled" in r.getMessage()]
    assert timeouts == [0, 0, 0, 0, 0, 0]  # two verdicts (one cached): two parses and a verify each, no timeout
    timeouts.clear()
    assert REWARDS["math"]("\\boxed{2}", "2") == 1.0 and timeouts == [5, 5, 5]  # the main thread keeps 5 s


_PLAIN_SPANS = ["72", " 72", "72 ", " 72\n", "\t-72\r", "-0", "0", "000", "007", "-007", " 10", "1" * 100, "1" * 101,
                "0" * 5 + "1" * 98, "-" + "9" * 100, "72\x0b", "\x0c72", " 72.", "+72", "7 2", "--7", "-", "", " ",
                "\u0667\u0662", "72\u00a0", "\n\n1234567890\n"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list(" \t\r\n\x0b-+0123456789.,")), max_size=12).map("".join))
def test_plain_integer_fast_path_equals_the_full_parse(text):
    """span_number skips the parse for spans that are only an ASCII integer (a million GSM8K rows spent 72 s of their
    load in it); over every span made of digits, signs, dots, commas and whitespace, both paths give the same."""
    from qerl_cli.gsm8k_numbers import _parsed_span_number, span_number

    for span in (text, *_PLAIN_SPANS):
        for whole in (True, False):
            assert span_number(span, whole) == _parsed_span_number(span, whole), (span, whole)


def test_plain_integer_fast_path_is_taken_for_gsm8k_references():
    """The point of the fast path: a GSM8K worked solution's reference never reaches the full parse."""
    from unittest import mock

    import qerl_cli.gsm8k_numbers as gsm8k_numbers

    with mock.patch.object(gsm8k_numbers, "_parsed_span_number", side_effect=AssertionError("parsed")):
        assert reference_answer("She sold 48 + 24 = 72 clips.\n#### 72") == "72"
        assert reference_answer("so -5 degrees.\n####  -005 \n") == "-5"


@pytest.mark.parametrize(
    "completion, ref, ok",
    [
        # {,} and \, between digits are thousands separators only in groups of three ("0{,}5" is a European 0.5)
        ("\\boxed{0{,}5}", "5", False), ("\\boxed{1{,}5}", "15", False), ("\\boxed{2\\,3}", "23", False),
        ("\\boxed{1{,}000}", "1000", True), ("\\boxed{1\\,000\\,000}", "1000000", True),
        # a #### line's number followed by an operand or another number is not a number standing alone
        ("#### 10 - 2", "10", False), ("#### 3 * 4", "3", False), ("#### 2 x 3", "2", False), ("#### 2 ^ 3", "2", False),
        ("#### 2 \u00d7 3", "2", False), ("#### 1 000 000", "1", False), ("#### 1 1/2", "1", False), ("#### 3:30", "3", False),
        ("#### 10 - 2\n#### 8", "8", True), ("#### 72 (48 + 24)", "72", True), ("#### 72 - done", "72", True),
        # several names assigned, on a #### line or apart by TeX spacing, as in a box with commas
        ("#### x = 5, y = 18", "18", False), ("\\boxed{x=5 \\quad y=18}", "18", False), ("\\boxed{x = y = 5}", "5", True),
        # words that change the number or deny it
        ("\\boxed{2 \\text{ dozen}}", "2", False), ("\\boxed{5 \\text{ million}}", "5", False), ("#### minus 5", "5", False),
        ("\\boxed{\\text{not } 5}", "5", False), ("#### 72 apples. Then she has no more", "72", True),
        ("#### 4 dozen eggs", "4", False), ("#### 72 not counting tax", "72", True),  # a denial counts before only
        # only the word next to the number: one further away is the sentence's (all of these scored 0)
        ("<answer>After giving away half of her marbles, she has 36 marbles left.</answer>", "36", True),
        ("<answer>There are no cookies left, so 0.</answer>", "0", True),
        ("\\boxed{\\text{She does not need any more boxes, so the answer is 120.}}", "120", True),
        ("#### Since there is no discount, the total cost is $1,250.", "1250", True),
        ("<answer>24 eggs, which is two dozen</answer>", "24", True), ("<answer>The answer is not 5</answer>", "5", False),
    ],
)
def test_gsm8k_rule_no_number_read_from_a_longer_answer(completion, ref, ok):
    assert is_correct(completion, ref, "gsm8k") is ok


def test_markdown_headings_before_a_final_answer_line_do_not_give_the_answer():
    """"#### Step 1: ..." headings, then "#### Final Answer: 72" and no box: the first words-first line was read (1);
    now the last one is (a review). A line that starts with its number still comes first."""
    c = "#### Step 1: add\n24 + 48 = 72\n#### Step 2: check\nok\n#### Final Answer: 72"
    assert extract_answer(c) == "72" and is_correct(c, "72", "gsm8k") and not is_correct(c, "1", "gsm8k")
    assert extract_answer("#### Step 1: add\n#### 72\n#### Final Answer: 7") == "72"


@pytest.mark.parametrize("completion", [
    # a base model's run-on in its few-shot's words-first form: judged on the answer it gave, not the next question's
    "48+24=72 clips.\n#### The answer is 72\n\nQuestion: Weng earns $12 an hour...\nAnswer: 12*5=60\n#### The answer is 60",
    # a note or a check after the final answer line
    "#### Step 1: add\n24 + 48 = 72\n#### Final Answer: 72\n\n#### Note: Natalia sold 48 clips in April.",
    "#### Result: 72\n#### Check: 72 - 24 = 48",
    "#### Answer: **72**\n\n#### Step 3: Double-check\n48 + 24 = 72",
    # heading labels in other spellings
    "#### **Step 1:** add\n#### Part 2 - check\n#### Final Answer: 72",
    # TeX math delimiters around the number
    "#### Final Answer: \\(72\\)", "<answer>\\[72\\]</answer>",
])
def test_words_first_answer_line_is_not_replaced_by_a_later_line(completion):
    """Taking the *last* words-first #### line (so that "#### Step 1:" headings gave way to "#### Final Answer: 72")
    read a later note, check or run-on instead of the answer (a review): headings are skipped by their label instead."""
    assert extract_answer(completion) == "72" and is_correct(completion, "72", "gsm8k")


def test_a_draft_inside_think_is_not_the_answer():
    """With the format reward's layout a draft answer inside <think> outranked the final <answer> (a review): only the
    text after a closed </think> is read; a completion that gives its answer only inside <think> gives none."""
    for kind in ("gsm8k", "math"):
        draft = "\\boxed{70}" if kind == "math" else "#### 70"
        assert extract_answer(f"<think>first guess {draft}, no wait</think> so \\boxed{{72}}", kind) == "72"
        assert extract_answer(f"<think>the answer is {draft}</think><answer></answer>", kind) is None
    assert REWARDS["gsm8k"]("<think>first guess \\boxed{70}, no wait</think><answer>72</answer>", "72") == 1.0
    assert extract_answer("no think tags: \\boxed{5}") == "5"


def test_a_draft_inside_an_unclosed_think_is_not_the_answer():
    """A completion cut short mid-thought (<think> never closed) was scored on its draft: "<think>first guess
    \\boxed{72}, let me recheck 5*" earned gsm8k and math 1.0, though a draft inside <think> is no answer (a review)."""
    for draft in ("\\boxed{72}", "#### 72", "<answer>72</answer>"):
        cut = f"<think>first guess {draft}? wait, let me recheck 5*"
        assert extract_answer(cut, "gsm8k") is None
        assert REWARDS["gsm8k"](cut, "72") == 0.0
    assert extract_answer("<think>guess \\boxed{72}, recheck", "math") is None
    # a final answer before a new, unclosed <think> still counts; so does one after a closed block
    assert extract_answer("<think>a</think> \\boxed{72} <think>more", "gsm8k") == "72"
    assert extract_answer("<think>a \\boxed{70}</think> \\boxed{72}", "math") == "72"


def test_an_empty_box_echoed_after_the_answer_does_not_hide_it():
    # a base model that runs on into the next question echoes the prompt's instruction with an empty box
    c = ("48 + 24 = 72.\nThe answer is \\boxed{72}.\n\nQuestion: Weng earns $12 an hour. How much did she earn?\n"
         "Please reason step by step, and put your final answer within \\boxed{}.")
    assert last_boxed(c) == "72" and last_boxed("\\boxed{ }") is None
    assert REWARDS["gsm8k"](c, "72") == 1.0 and REWARDS["math"](c, "72") == 1.0


@pytest.mark.parametrize(
    "completion, want",
    [
        # a Markdown heading "#### Step 1:" was the answer 1, outranking the final box (or a later "#### 12")
        ("#### Step 1: Find the total\nThere are 24 + 48 = 72 apples.\n\\boxed{72}", "72"),
        ("#### Step 1: Add\n5 + 7 = 12\n#### Step 2: Answer\n#### 12", "12"),
        ("#### Step 1: Add\n<answer>12</answer>", "12"),
        ("#### The answer is 72", "72"),  # words before the number: still an answer where nothing else gives one
        ("#### 5 \\boxed{6}", "5"),  # a #### line that starts with its number still outranks a box
        ("#### **72**\n\\boxed{6}", "72"), ("#### $72\n\\boxed{6}", "72"), ("#### -\\frac12\n\\boxed{6}", "-0.5"),
    ],
)
def test_a_markdown_heading_is_not_the_answer(completion, want):
    assert extract_answer(completion, "gsm8k") == want


@pytest.mark.parametrize("completion", [
    "#### Part 2", "#### Step 1: count the pens\nZoe has 5 pens and buys", "#### Step 1:\n#### Step 2: add",
])
def test_a_heading_alone_gives_no_answer(completion):
    """A completion whose only #### lines are heading labels (docs/merge-eval.md: "#### Part 2" gives no answer) fell
    back to the first span and was read as the heading's number: a truncated "#### Step 1:" scored 1 against "1"."""
    assert extract_answer(completion, "gsm8k") is None and not is_correct(completion, completion[10:11], "gsm8k")


def test_a_point_is_not_a_number_with_thousands_commas():
    # a MATH reference (1,500) or (-2,100) read as 1500 / -2100: eval's auto scorer sent it to the exact rule, where
    # the right answer \boxed{(1, 500)} scored wrong and \boxed{1500} right
    from qerl_cli.evaluate import score_completion

    for ref, point, number in (("(1,500)", "(1, 500)", "1500"), ("(-2,100)", "(-2, 100)", "-2100")):
        assert reference_answer(ref, "gsm8k") is None
        assert score_completion("\\boxed{" + point + "}", ref).correct
        assert not score_completion("\\boxed{" + number + "}", ref).correct
    assert extract_answer("\\boxed{(3)}") == "3" and extract_answer("\\boxed{(-2.5)}") == "-2.5"


@pytest.mark.parametrize("completion", [
    "48 + 24 = 72\n#### Final Answer\n72", "#### **Final Answer:**\n\n$72$", "#### 2. Final Answer\n72 apples.",
    "#### Answer\nShe has 72 in total.", "#### The final answer is:\n**72**",
])
def test_the_answer_on_the_line_under_an_answer_heading_is_read(completion):
    """"#### Final Answer" with the number on the next line: the heading holds no number, so the answer under it was
    never read (no answer at all; a leftover of session 52)."""
    assert extract_answer(completion) == "72" and is_correct(completion, "72", "gsm8k")
    # prose under the heading does not outrank the final box; a heading with no number below gives none
    assert extract_answer("#### Answer\nFirst, 3 apples are left.\n48 + 24 = 72\n\\boxed{72}") == "72"
    assert extract_answer("#### Final Answer\nSee above.") is None
    assert extract_answer("#### Final Answer\nSee above.\n#### 5") == "5"


@pytest.mark.parametrize("completion", [
    "#### 72 or 73", "#### **72** or 73", "#### 72 (or 73)", "#### The answer is 72, or maybe 73", "#### 72 or so",
    "#### 72 and/or 73", "\\boxed{72 \\text{ or so}}", "<answer>72 or more</answer>",
])
def test_a_hedge_is_no_answer(completion):
    """"#### 72 or 73" scored 1 against 72 (and against 73 nothing): a hedge must not be rewarded for the
    alternative that happens to be right."""
    assert extract_answer(completion) is None and not is_correct(completion, "72", "gsm8k")
    assert extract_answer("#### 72 oranges") == "72" and extract_answer("\\boxed{72 \\text{ ordered}}") == "72"


@pytest.mark.parametrize("completion", [
    "So \\boxed{72}. I put it in \\boxed as asked.", "\\boxed{72}, written in \\boxed.",
    "\\boxed{72} (the \\boxed\ncommand)",
])
def test_a_bare_boxed_in_prose_does_not_hide_the_answer(completion):
    """A bare \\boxed after the answer, in prose, was the last box, and its "argument" (a word) no number: no answer."""
    assert last_boxed(completion) == "72" and is_correct(completion, "72", "gsm8k")
    assert REWARDS["math"](completion, "72") == 1.0
    # a number, a letter or a command after a bare \boxed is still its argument
    assert last_boxed("\\boxed 7") == "7" and last_boxed("so \\boxed x") == "x" and last_boxed("\\boxed\\pi") == "\\pi"
    assert last_boxed("\\boxed -5.") == "-5."


@pytest.mark.parametrize("completion", [
    "#### Final Answer\n- 72\n\n\\boxed{72}", "#### Final Answer\n- $72$", "#### **Answer:**\n  * 72 apples",
    "#### Final Answer\n+ 72",
])
def test_a_bullet_under_an_answer_heading_is_no_minus_sign(completion):
    """A Markdown list item under "#### Final Answer" ("- 72") read as -72 and, as the line under the heading, outranked
    the final \\boxed{72} (a review of session 53's rule; before it the box gave 72)."""
    assert extract_answer(completion) == "72" and is_correct(completion, "72", "gsm8k")
    assert extract_answer("#### Final Answer\n-72") == "-72"  # glued to the number: a minus sign


@pytest.mark.parametrize("completion", [
    "#### 72 (or 72.0)", "#### 72, or $72", "#### 0.5 (or 1/2)", "#### The answer is 72 (or 72 apples)",
    "#### $72 or \\frac{144}{2}",
])
def test_a_hedge_that_restates_its_number_is_the_answer(completion):
    """"#### 72 (or 72.0)" offers one answer, said twice: the hedge rule made it no answer (it read as 72 before)."""
    want = "0.5" if "0.5" in completion else "72"
    assert extract_answer(completion) == want and is_correct(completion, want, "gsm8k")
    for hedge in ("#### 72 or 72 or 73", "#### 72 (or 72.0), or 73", "#### 72 or -72"):  # more than one answer
        assert extract_answer(hedge) is None


@pytest.mark.parametrize("completion", [
    "#### **Final Answer:** 72", "#### **Answer**: 72", "#### **The answer is** 72", "<answer>**Answer:** 72</answer>",
])
def test_bold_words_before_the_number_name_the_answer(completion):
    """"#### **Final Answer:** 72" (Markdown bold around the label) gave no answer: only bold right before the number
    ("The answer is **72**") was taken for words."""
    assert extract_answer(completion) == "72" and is_correct(completion, "72", "gsm8k")
    assert extract_answer("#### **Step 1:** add 3\n\\boxed{72}") == "72"  # a bold heading label stays a label


@pytest.mark.parametrize("completion, want", [
    ("#### Double-check the answer: 18 eggs * $2 = $36\n\\boxed{36}", "36"),  # a note that mentions the answer
    ("#### Verify the answer: 3 + 4\nSo \\boxed{7}", "7"),
    ("#### Therefore, the final answer is 72\n\\boxed{73}", "72"),  # only answer words: it names the answer
    ("#### So our answer is 72\n\\boxed{73}", "72"),
])
def test_only_a_line_that_just_names_the_answer_outranks_the_box(completion, want):
    """A #### line whose words merely ended on "answer" ranked with "#### 72": a check line's first number (18)
    outranked the final box (36)."""
    assert extract_answer(completion) == want


@pytest.mark.parametrize("completion", [
    # a words-first answer line, then a base model's run-on "#### 7"
    "48 + 24 = 72\n#### The answer is 72\n\nQuestion: Tom has 9 marbles and loses 2.\nAnswer: 9 - 2 = 7\n#### 7",
    "#### Final Answer: **72**\n\nQuestion: ...\n\\boxed{7}",
    # a heading with a number in its words before a words-first answer line (or a plain one)
    "#### Add the 3 eggs\n48 + 24 = 72\n#### The answer is 72",
    "#### Add the 3 eggs\n48 + 24 = 72\n#### Answer = 72",
])
def test_a_hash_line_that_names_the_answer_is_the_answer(completion):
    """A #### line whose words name the answer ("The answer is 72", "Final Answer: 72") ranked with headings, below
    a later run-on "#### 7" or box; and "#### Add the 3 eggs" before it was read as 3."""
    assert extract_answer(completion) == "72" and is_correct(completion, "72", "gsm8k")
    assert extract_answer("#### Add the 3 eggs\n48 + 24 = 72\n#### 72") == "72"  # a plain line still wins


@pytest.mark.parametrize("completion", [
    "#### 1. Understand the problem\n48 + 24 = 72\n#### 2. Answer\n\\boxed{72}",
    "#### 1. Understand the problem\n48 + 24 = 72\n#### 72", "#### 1. Add\n#### 2. Answer: 72",
    "#### 2. Add the 3 eggs\n<answer>72</answer>",
])
def test_a_numbered_heading_does_not_outrank_the_answer(completion):
    """"#### 1. Understand the problem" read as 1 before the final \\boxed{72}: a numbered heading's number is now the
    last resort, and "#### 72. She makes $72" (the number said again) still leads."""
    assert extract_answer(completion) == "72" and is_correct(completion, "72", "gsm8k")
    for alone in ("#### 72. She makes $72", "#### 72. That is the total.", "#### 72."):  # a numbered-looking answer
        assert extract_answer(alone) == "72"


@pytest.mark.parametrize("completion", ["#### The answer is $72$", "#### $72", "#### 1. Add\n#### 72 apples"])
def test_a_hash_span_is_cleaned_once(completion):
    """Each #### span went through _clean_number_text two or three times (_leads_with_number, span_number in
    _hash_spans, span_number again in extract_answer): wasted work per completion."""
    from unittest import mock

    from qerl_cli import gsm8k_numbers, gsm8k_rule

    clean = mock.Mock(wraps=gsm8k_numbers._clean_number_text)  # called from both modules: one count
    with mock.patch.object(gsm8k_numbers, "_clean_number_text", clean), \
            mock.patch.object(gsm8k_rule, "_clean_number_text", clean):
        assert extract_answer(completion) == "72"
    assert clean.call_count == completion.count("####")


def test_an_escaped_brace_does_not_close_the_box():
    """``\\{`` is a literal brace in TeX, no group: ``\\boxed{\\left\\{ ... \\right.}`` (a piecewise answer) closed on
    its ``\\{``, so the box was unclosed and no answer."""
    piecewise = "so \\boxed{\\left\\{ \\begin{array}{ll} x & x > 0 \\\\ 0 & x \\le 0 \\end{array} \\right.}"
    assert last_boxed(piecewise) == piecewise[len("so \\boxed{"):-1].strip()
    assert last_boxed("\\boxed{x \\in \\{1, 2\\}}") == "x \\in \\{1, 2\\}"
    assert last_boxed("\\boxed{a \\\\{b}}") == "a \\\\{b}"  # "\\\\" is a line break: the brace after it is a group


@pytest.mark.parametrize("completion", [
    "So \\boxed{73} or \\boxed{72}.", "$\\boxed{73}$, or maybe $\\boxed{72}$", "\\boxed{73}. Or is it \\boxed{72}?",
    "\\boxed 73 or \\boxed 72",
])
def test_a_hedge_across_two_boxes_is_no_answer(completion):
    """"\\boxed{73} or \\boxed{72}" read as its last box, 72: a hedge across boxes was rewarded for the alternative that
    happened to be right (session 53's leftover), by gsm8k and by math (which since math 2 reads both boxes as one
    answer, "73, 72", a set that a one-value reference does not equal)."""
    assert extract_answer(completion) is None and not is_correct(completion, "72", "gsm8k")
    assert extract_answer(completion, "math") == "73, 72" and REWARDS["math"](completion, "72") == 0.0
    # the same answer restated, or a correction, is one answer
    for one in ("\\boxed{72} or \\boxed{72.0}", "\\boxed{73}, or rather \\boxed{72}", "\\boxed{73}.\nOr, rechecking: \\boxed{72}"):
        assert extract_answer(one) == "72"
    assert REWARDS["math"]("\\boxed{\\frac{1}{2}} or \\boxed{0.5}", "0.5") == 1.0


@pytest.mark.parametrize("completion", [
    "#### 72 to 73", "#### from 72 to 73", "#### between 72 and 73", "#### 72 through 73", "#### 72 and 73",
    "#### 72 and 3/4", "#### 72 and a half", "#### 72 apples or 73 apples", "#### 72 dollars, or 73",
    "#### 72 hours 30 minutes", "#### 72 hours, 30 minutes", "#### 72 hours and 30 minutes", "#### 72 feet 6 inches",
    "#### at least 72", "#### more than 72", "#### less than 72", "\\boxed{72 \\text{ to } 73}",
])
def test_a_range_or_a_second_number_is_no_answer(completion):
    """A range ("#### 72 to 73", session 53's leftover), a second number ("72 and 3/4", "72 hours 30 minutes"), a hedge
    after a unit word ("72 apples or 73 apples") and an inequality ("at least 72") each read as 72."""
    assert extract_answer(completion) is None and not is_correct(completion, "72", "gsm8k")
    for still in ("#### 72 to go", "#### 72 apples in 3 boxes", "#### 72 not counting tax or tip", "#### 72 hours"):
        assert extract_answer(still) == "72"


@pytest.mark.parametrize("completion, want", [
    ("#### 90 (or 1.5 hours)", "90"), ("#### 90 minutes (or 1.5 hours)", "90"), ("#### 1.5 hours (or 90 minutes)", "1.5"),
    ("#### $2 (or 200 cents)", "2"), ("#### 3 feet, or 36 inches", "3"),
])
def test_the_same_quantity_in_other_units_is_no_hedge(completion, want):
    """"#### 90 (or 1.5 hours)" was a hedge, no answer (session 53's leftover): it offers one quantity, said twice."""
    assert extract_answer(completion) == want
    for hedge in ("#### 90 (or 1.6 hours)", "#### 90 (or 1.5 apples)", "#### 90 apples (or 1.5 hours)"):
        assert extract_answer(hedge) is None


def test_a_box_right_under_the_answer_headings_line_is_the_answer():
    """"#### Final Answer\\n2 hours\\n\\boxed{120}" read as 2 (session 53's leftover): the box under the line gives the
    answer in the form asked for."""
    for completion in ("#### Final Answer\n2 hours\n\\boxed{120}", "#### Final Answer\n2 hours\n\n$\\boxed{120}$"):
        assert extract_answer(completion) == "120" and is_correct(completion, "120", "gsm8k")
    assert extract_answer("#### Final Answer\n120\n\nQuestion: Tom has 9 apples.\n\\boxed{5}") == "120"  # not a run-on's


def test_reward_files_are_one_module_per_file_and_content(tmp_path):
    # a/r.py and b/r.py shared the module name qerl_user_reward_r: the second replaced the first in sys.modules
    # (where dataclasses and pickle look a module up); one file named twice ran its top level twice
    import sys

    for sub, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "r.py").write_text(textwrap.dedent(f"""
            import sys
            with open({str(tmp_path / (sub + '.runs'))!r}, "a") as log:
                log.write("x")
            def f(c, a):
                return {value} if sys.modules[__name__].__file__ == __file__ else -1.0
            def g(c, a):
                return 0.5
        """))
    a, b = tmp_path / "a" / "r.py", tmp_path / "b" / "r.py"
    rs = RewardSet.from_specs([f"{a}:f", f"{a}:g", f"{b}:f"])
    assert rs.score("x", None)[0] == {f"{a}:f": 1.0, f"{a}:g": 0.5, f"{b}:f": 2.0}
    assert (tmp_path / "a.runs").read_text() == "x"  # a/r.py ran once for both of its functions
    b.write_text(b.read_text().replace("2.0 if", "3.0 if"))  # edited: the same process runs the new code
    assert RewardSet.from_specs([f"{b}:f"]).score("x", None)[1] == 3.0
    assert sum(name.startswith("qerl_user_reward_r_") for name in sys.modules) >= 3


# ---- a review of the two commits above (s54r07): correct answers the new rule read as none, a hedge it rewarded ----
@pytest.mark.parametrize("completion, want", [
    ("#### 3 hours (180 minutes)", "3"), ("#### 72 hours (3 days)", "72"), ("#### 18 dollars (1800 cents)", "18"),
    ("#### 6 feet (72 inches)", "6"), ("#### 2 weeks, 14 days", "2"),
])
def test_the_same_quantity_in_another_unit_without_or_is_one_answer(completion, want):
    """"#### 3 hours (180 minutes)" read as two quantities in units of one kind ("3 hours 30 minutes"): no answer, a
    right answer scored 0 (until 1d5624a it was 3). Two different quantities still are none."""
    assert extract_answer(completion) == want and is_correct(completion, want, "gsm8k")
    for two in ("#### 3 hours 30 minutes", "#### 3 hours (3 minutes)", "#### 3 hours 3 minutes",
                "#### 18 dollars (18 cents)"):
        assert extract_answer(two) is None


@pytest.mark.parametrize("completion, want", [
    ("#### 90 minutes (or 1 hour 30 minutes)", "90"), ("#### 150 minutes (2 hours and 30 minutes)", "150"),
    ("#### 1.5 hours, or 1 hour and 30 minutes", "1.5"), ("#### 150 minutes, or 2 hours, 30 minutes", "150"),
    ("#### 90 (or 1 hour and 30 minutes)", "90"),
])
def test_a_quantity_restated_in_two_units_is_one_answer(completion, want):
    """"#### 90 minutes (or 1 hour 30 minutes)" compared 90 minutes with 1 hour alone: a hedge, no answer (until 1d5624a
    it was 90). The parts of one kind add up; a different total, or a hedge after them, is still none."""
    assert extract_answer(completion) == want and is_correct(completion, want, "gsm8k")
    for hedge in ("#### 100 minutes (1 hour 30 minutes)", "#### 90 minutes (or 1 hour 30 minutes, or 2 hours)",
                  "#### 90 minutes (1 hour 30 minutes 10 seconds)", "#### 90 (or 1 hour and 20 minutes)"):
        assert extract_answer(hedge) is None


@pytest.mark.parametrize("completion, want", [
    ("#### 72.50, to 2 decimal places", "72.5"), ("#### 3.75 rounded to 2 significant figures", "3.75"),
    ("#### 72 to 2 sig figs", "72"), ("#### 0.33 (rounded to 2 d.p.)", "0.33"),
])
def test_a_rounding_note_is_no_second_number(completion, want):
    """"to 2 decimal places" read as a range "72 to 2": no answer (until 1d5624a it was the number)."""
    assert extract_answer(completion) == want
    assert extract_answer("#### 72 to 73") is None and extract_answer("#### 3.75 to 4 hours") is None


@pytest.mark.parametrize("completion, want", [
    ("#### 18 dollars and 9 eggs sold", "18"), ("#### 72 apples, and 8 are left over", "72"),
    ("#### 10 cookies and 5 brownies", "10"), ("#### The answer is 150 miles and 3 hours", "150"),
])
def test_a_number_of_another_thing_after_and_is_no_second_number(completion, want):
    """"and" then a number of something else read as a second number of the answer: no answer, 0 for a right answer
    (until 1d5624a it was the number). A second part of the same quantity, one that adds to it, or one after a bare
    number is still none."""
    assert extract_answer(completion) == want and is_correct(completion, want, "gsm8k")
    for second in ("#### 3 hours and 30 minutes", "#### 18 dollars and 50 cents", "#### 72 apples and 8 apples",
                   "#### 72 apples and 8", "#### 18 dollars and 9 more", "#### 72 and 5 of them are red",
                   "#### 3 hours and a half"):
        assert extract_answer(second) is None


def test_a_bound_word_before_a_labels_colon_is_no_bound():
    """"#### She spent the most: $72" read as the bound "most 72": no answer (until 1d5624a it was 72)."""
    for completion in ("#### She spent the most: $72", "#### The most she can buy: **72**", "#### Least: 72"):
        assert extract_answer(completion) == "72" and is_correct(completion, "72", "gsm8k")
    assert extract_answer("#### at least 72") is None and extract_answer("#### no more than 72") is None


@pytest.mark.parametrize("completion", ["#### at least **72**", "#### more than **72** apples", "#### not **5**",
                                        "#### minus **5**", "#### **5** dozen"])
def test_bold_hides_no_word_that_changes_the_number(completion):
    """"**" was the word next to the number: "#### at least **72**" read as 72, a bound rewarded as the answer."""
    assert extract_answer(completion) is None
    assert not is_correct(completion, "72" if "72" in completion else "5", "gsm8k")


def test_a_hedge_across_two_boxes_under_the_answer_heading_gives_no_box():
    """The box under an answer heading's line was read as last_boxed: "\\boxed{72} or \\boxed{73}" there gave 73, a
    hedge rewarded. Now it gives no box, and the heading's own line (72) stands, as before 1d5624a."""
    completion = "#### Answer\n72\n\\boxed{72} or \\boxed{73}"
    assert extract_answer(completion) == "72" and not is_correct(completion, "73", "gsm8k")
    assert extract_answer("#### Answer\n2 hours\n\\boxed{120} or \\boxed{120.0}") == "120"


@pytest.mark.parametrize("completion", [
    "She sold 6 + 12 = 18.\nThe answer is 18.", "6 + 12 = 18\n\n**Final Answer:** 18",
    "## Step 1: Add\n6 + 12 = 18\n\nThe final answer is 18", "6 + 12 = 18.\nTherefore, the final answer is: $18",
    "So the answer is $18.00. I hope it is correct.", "The answer is \\(18\\) dollars.", "Answer: 18 eggs",
    "**The final answer is 18.**", "\\textbf{Final Answer:} 18", "The answer is 17.\nWait, 6 + 12 = 18.\nSo the answer is 18.",
    "<think>the answer is 17</think>\nThe answer is 18.", "The answer is 17.\nNo, the answer is 18.",
    "Final Answer: The answer is 18", "The answer is 18.\n\n(Note: the answer assumes 3 eggs a day.)",
    "She sold 6. Then 12 more. The answer is 18.", "The answer is 17. No, the answer is 18. Done.",
    "It checks out! The answer is 18.",
])
def test_a_plain_answer_statement_is_the_answer(completion):
    """An instruct model's plain-prose final statement ("The answer is 18.", "**Final Answer:** 18", Llama-3's "The
    final answer is 18") gave no answer: 30 of 223 realistic Qwen2.5/Llama-3 completions a review collected, so an
    eval without a "####"/box instruction scored near 0. The last such statement now counts, as the lowest fallback."""
    assert extract_answer(completion) == "18" and is_correct(completion, "18", "gsm8k")


@pytest.mark.parametrize("completion", [
    "The answer is not 18", "The answer is 18 or 19", "The answer is between 18 and 20", "The answer is at least 18",
    "The answer is approximately 18", "The answer is 18 or so", "The answer is that she has 18 left",
    "What is the answer? 18 eggs, I think.", "Is the answer 18?", "So the answer is 18 eggs?", "If the answer is 18, she has 3 left.",
    "I think the answer is 18.", "So the total is 18.", "The answer is 18.\nNo, the answer is not 18.",
    "The answer is 18.\nSo \\boxed{18} or \\boxed{19}.", "The answer is 18.\n#### 18 or 19",
    "The answer is \\boxed{18\\sqrt{2}}", "The answers are 18 and 19", "The answer is 2 dozen",
    "<think>The answer is 18.</think> Let me see.", "<think>The answer is 18.",
])
def test_a_plain_answer_statement_that_hedges_denies_or_asks_is_no_answer(completion):
    """The statement fallback reads no "last number": one that denies, hedges, bounds or asks, one that is not the
    last (a later "not 18", a later hedged box or #### line), or a number after other words is no answer."""
    assert extract_answer(completion) is None and not is_correct(completion, "18", "gsm8k")


@pytest.mark.parametrize("completion, answer", [
    ("The answer is 18. Actually, it is 19.", None), ("The answer is 18. Wait, no: 19.", None),
    ("The answer is 18. I mean 19.", None), ("The answer is 18.\nOn second thought, it is 19 eggs.", None),
    ("The answer is 18 (actually 19).", None), ("The answer is 18. Oops, 6 + 13 = 19.", None),
    ("The answer is 18. Actually, it is 18.", "18"), ("The answer is 18. Wait, let me check: 6 + 12 = 18.", "18"),
    ("The answer is 18 rather than 19.", "18"), ("The answer is 18. Actually, the answer is 19.", "19"),
])
def test_an_answer_statement_its_words_take_back_is_no_answer(completion, answer):
    """"The answer is 18. Actually, it is 19." read as 18, right for the answer taken back (the later words name no
    answer, so the statement was the last one): as the math rule reads a tag's prose since s59r03, no answer (review
    s59r09). A take-back that ends on the same number, or a new statement, is read as before."""
    assert extract_answer(completion) == answer and is_correct(completion, "18", "gsm8k") is (answer == "18")


@pytest.mark.parametrize("completion, answer", [
    ("#### 18\nWait, no, it is 19", None), ("#### 18\nActually, it is 19.", None), ("#### 18. Hmm, 19?", None),
    ("#### 18 (actually 19)", None), ("#### Final Answer\n18\nActually, 19.", None),
    ("\\boxed{18}. Actually, it is 19.", None), ("<answer>18</answer> Actually, it is 19.", None),
    ("\\boxed{18} or 19", None), ("\\boxed{18} (or maybe 19)", None), ("19 or \\boxed{18}", None),
    ("\\boxed{19} \\text{ or } \\boxed{18}", None), ("\\textbf{\\boxed{19}} or \\textbf{\\boxed{18}}", None),
    ("\\boxed{19} \\boxed{18}", None), ("\\boxed{19} | \\boxed{18}", None), ("\\boxed{19}; \\boxed{18}", None),
    ("#### 18\nWait, let me verify: 6 + 12 = 18.", "18"), ("#### 18 eggs instead of 19", "18"),
    ("\\boxed{18} (or 18.0)", "18"), ("\\boxed{18} (or 1080 minutes)", "18"), ("\\boxed{6} + \\boxed{12} = \\boxed{18}", "18"),
    ("\\boxed{18}\n\nQuestion: Tom has 40 marbles. Actually, he has 35.", "18"), ("\\boxed{18} or \\boxed{18.0}", "18"),
])
def test_words_around_a_final_number_that_offer_or_take_back_another_are_no_answer(completion, answer):
    """Review s59r14: a take-back after a #### line, box or tag ("#### 18\nWait, no, it is 19") read as 18, as a
    statement's did until review s59r09; a number offered beside a box in prose ("\\boxed{18} or 19") or a box beside
    it with TeX between ("\\text{ or }", bold, side by side) read as the last. A check, a contrast, a restatement, a
    run-on's next question and a sum's boxes read as before."""
    assert extract_answer(completion) == answer and is_correct(completion, "18", "gsm8k") is (answer == "18")


@pytest.mark.parametrize("completion, answer", [
    ("\\boxed{18}, not \\boxed{19}", "18"), ("So she makes $\\boxed{18}$ (not $\\boxed{19}$).", "18"),
    ("\\boxed{18} rather than \\boxed{19}", "18"), ("\\boxed{19}, not \\boxed{18}", "19"),
    ("\\boxed{18}, not \\boxed{19}. Actually, it is 20.", None), ("\\boxed{17} or \\boxed{18}, not \\boxed{19}", None),
    ("\\boxed{\\boxed{18}}", "18"), ("$\\fbox{\\boxed{18}}$.", "18"), ("\\boxed{\\boxed{19}} \\boxed{\\boxed{18}}", None),
])
def test_a_denied_last_box_leaves_the_box_before_and_a_box_around_a_box_is_its_own(completion, answer):
    """Review s60r02: "\\boxed{18}, not \\boxed{19}" read as 19, a wrong answer scored 1; a box around a box
    ("\\boxed{\\boxed{18}}") stood beside it as another answer, none since review s59r14 (18 before it)."""
    assert extract_answer(completion) == answer and is_correct(completion, "18", "gsm8k") is (answer == "18")


@pytest.mark.parametrize("completion, answer", [
    ("So $x = \\boxed{18}$, not $x = \\boxed{19}$.", "18"), ("\\boxed{18}, not $x = \\boxed{19}$", "18"),
    (", not ".join(f"\\boxed{{{n}}}" for n in range(18, 38)), "18"), ("\\boxed{x = \\boxed{18}}", "18"),
    ("\\boxed{\\boxed{18} + 1}", None), ("\\boxed{19 \\text{ or } \\boxed{18}}", None),
])
def test_a_denied_named_box_leaves_the_box_before_and_a_box_inside_a_box_is_the_box_arounds(completion, answer):
    """Review s60r07: "$x = \\boxed{18}$, not $x = \\boxed{19}$" read as 19 (the name read as words), a wrong answer
    scored 1, as did the 17th box from the last of a longer run of denials; a box inside a box is part of it."""
    assert extract_answer(completion) == answer and is_correct(completion, "18", "gsm8k") is (answer == "18")


@pytest.mark.parametrize("completion, answer", [
    ("So she makes $\\boxed{18}$ dollars, not $\\boxed{19}$.", "18"), ("\\boxed{18} eggs (not \\boxed{19} eggs)", "18"),
    ("\\boxed{18}\\text{ dollars}, not \\boxed{19}", "18"), ("\\boxed{18} - not - \\boxed{19}", "18"),
    ("\\boxed{18} (_not_ \\boxed{19})", "18"), ("\\boxed{18} is the answer, not \\boxed{19}", "18"),
    ("\\boxed{19}? Why not \\boxed{18}", "18"), ("\\boxed{19} is wrong, not \\boxed{18}", "18"),  # a correction still
    ("\\boxed{18} \\neq \\boxed{19}", None), ("\\boxed{18} is not \\boxed{19}", None),
    ("\\boxed{18}, which is not \\boxed{19}", "18"), ("The total is \\boxed{18} dollars. It is not \\boxed{19}.", "18"),
])
def test_a_unit_or_emphasis_before_a_denied_box_leaves_the_box_before_and_boxes_said_to_differ_are_none(completion, answer):
    """Review s60r13: a unit between the box and the denial ("\\boxed{18} dollars, not \\boxed{19}"), "- not -" and
    "(_not_ ...)" read as words, a correction: 19, a wrong answer scored 1; so did two boxes said to differ
    ("\\boxed{18} \\neq \\boxed{19}"), which say neither is the answer: none."""
    assert extract_answer(completion) == answer and is_correct(completion, "18", "gsm8k") is (answer == "18")


@pytest.mark.parametrize("completion, answer", [
    ("\\boxed{19} failed, not \\boxed{18}", "18"), ("\\boxed{19} miscounted, not \\boxed{18}", "18"),
    ("$\\boxed{19}$ contradicts the total, not $\\boxed{18}$", "18"), ("\\boxed{18} eggs, not \\boxed{18} dozen", "18"),
])
def test_a_verb_that_rejects_the_box_before_a_denial_is_no_unit(completion, answer):
    """Review s60r16: a verb rejecting the box ("failed", "miscounted"; "fails" alone was blocked) read as its unit, so
    the box before the denial, 19, was the answer: a wrong answer scored 1."""
    assert extract_answer(completion) == answer and is_correct(completion, "18", "gsm8k") is (answer == "18")


def test_a_plain_answer_statement_ranks_below_every_other_answer():
    """The statement is the last resort: a #### line, a box, a tag, a words-first #### line outrank it."""
    for completion in ("The answer is 17.\n#### 18", "The answer is 17.\n\\boxed{18}", "The answer is 17. <answer>18</answer>",
                       "#### She has 18 left\nThe answer is 17.", "\\boxed{18}\nThe answer is 17."):
        assert extract_answer(completion) == "18"
    # a base model's run-on into the next question: its statements answer that question
    run_on = "6 + 12 = 18. The answer is 18.\n\nQuestion: Tom has 40 marbles and loses 5.\nAnswer: 40 - 5 = 35\n"
    assert extract_answer(run_on) == "18" and extract_answer("Question: 6 + 12?\nThe answer is 18.") == "18"
    # a number of another thing after "and" is no second number, as on a #### line ("#### 18 apples and 3 pears" is 18)
    assert extract_answer("The answer is 18 apples and 3 pears.") == extract_answer("#### 18 apples and 3 pears") == "18"


def test_an_answer_statement_is_read_to_its_sentence_end():
    """The statement's span ran to its line's end, so a later sentence's equation gave the number ("The answer is 6 + 12 =
    18. She ate 3, so 18 - 3 = 15." read as 15: the right side of the line's last "="; a review)."""
    assert extract_answer("The answer is 6 + 12 = 18. She ate 3, so 18 - 3 = 15.") == "18"
    assert extract_answer("The answer is 6 x 3 = 18 eggs. At $2 each, 18 x 2 = 36 dollars.") == "18"
    assert extract_answer("The answer is 18 - 3 = 15. Check: 12 + 3 = 15.") == "15"  # its own expression still counts


@pytest.mark.parametrize("label", ["Problem:", "Question 2:", "**Question:**", "### Question:", "Q.", "Q2:", "User:",
                                   "Human:", "> Question:"])
def test_a_run_on_under_another_few_shot_label_gives_no_statement(label):
    """Only "Question:"/"Q:" ended a base model's run-on: after Minerva's "Problem:", a numbered or bold question or a
    chat turn, the last statement was the run-on's answer (35 here, for a question the model was not asked; a review)."""
    completion = f"6 + 12 = 18. The answer is 18.\n\n{label} Tom has 40 marbles and loses 5.\nThe answer is 35."
    assert extract_answer(completion) == "18"
    minerva = ("6 + 12 = 18\nFinal Answer: The final answer is $18$. I hope it is correct.\n\nProblem:\nTom has 40 "
               "marbles and loses 5.\n\nSolution:\n40 - 5 = 35\nFinal Answer: The final answer is $35$. I hope it is correct.")
    assert extract_answer(minerva) == "18"
    assert extract_answer("6 + 12 = 18.\nQuick check: done. The answer is 18.") == "18"  # a word that starts with Q


@pytest.mark.parametrize("completion, answer", [
    ("The answer is 18 times 2.", None), ("The answer is 18 plus 2.", None), ("The answer is 18 minus 3.", None),
    ("The answer is 18 divided by 2.", None), ("#### 18 multiplied by 2", None), ("The answer is 18 – 20.", None),
    ("The answer is 18 times 2 = 36.", "36"), ("#### 18 times 2 = 36", "36"), ("#### 18 – 3 = 15", "15"),
    ("The answer is 18 times.", "18"), ("#### 18 plus tax", "18"), ("#### 18 ~ 20", None),
])
def test_an_operator_in_words_makes_the_number_an_operand(completion, answer):
    """"18 times 2", "18 plus 2", "18 – 20" (an en dash) read as 18, and "18 times 2 = 36" as its left side 18: only
    symbols were operators (a review of the statement fallback). A word with no number after it is no operator."""
    assert extract_answer(completion) == answer


@pytest.mark.parametrize("completion, answer", [
    ("The answer is >= 18.", None), ("The answer is <= 18", None), ("The answer != 18", None),
    ("#### The answer is >= 18", None), ("\\boxed{x \\le 18} \\boxed{x <= 18}", None), ("<answer>>= 18</answer>", None),
    ("The answer is ~18.", None), ("The answer: ~ 18", None), ("#### ~18", None),
    ("#### 18 (since 18 >= 10)", "18"), ("#### 18~km", "18"), ("The answer is~18.", "18"), ("\\boxed{x = 18}", "18"),
])
def test_an_inequality_or_a_tilde_before_the_number_is_no_answer(completion, answer):
    """">= 18", "<= 18", "!= 18" read as 18 (the right side of an "="), where "\\geq 18" and "at least 18" are no answer;
    "~18" (approximately) read as 18, the "~" taken for a TeX tie, where "about 18" and "\\approx 18" are none (a
    review). A tie glued to its left ("18~km", "is~18") is still a space."""
    assert extract_answer(completion) == answer


# ---- session 54's leftovers (s55r03, RULE_VERSION gsm8k 5) ------------------------------------------------------------
@pytest.mark.parametrize("completion, answer", [
    ("#### 18 at most", None), ("#### 18 at least", None), ("#### 18 (approximately)", None), ("#### 18 approx.", None),
    ("#### 18 dollars at the most", None), ("#### 18 maximum", None), ("#### 18 hours max", None), ("#### 18 tops", "18"),
    ("#### 18 roughly", None), ("#### 18, give or take", None), ("The answer is 18 (approximately).", None),
    ("\\boxed{18 \\text{ at most}}", None), ("<answer>18 at least</answer>", None),
    ("#### 18 (approximately 17.6 before rounding)", "18"), ("#### 18 (at most 20 fit)", "18"), ("#### 18 min", "18"),
    ("#### 18 laps around the track", "18"), ("#### 18 Max's marbles", "18"), ("#### 18 (rounded)", "18"), ("#### 18\nAt most 18 fit, as found.", "18"),
])
def test_a_bound_after_the_number_is_no_answer(completion, answer):
    """"#### 18 at most" and "#### 18 (approximately)" read as 18, where "#### at least 18" and "~18" were no answer:
    a bounded or hedged answer is none on either side of its number (session 54's leftover). A number after the word
    ("(approximately 17.6 before rounding)") notes another value; a word further on ("laps around") is no bound."""
    assert extract_answer(completion) == answer


@pytest.mark.parametrize("word", sorted(_APPROX_BEFORE) + ["up to"])
def test_an_approximation_before_the_number_is_no_answer(word):
    """"#### about 18" read as 18 (and "\\boxed{\\text{about } 18}", "**Final Answer:** about 18"), where "#### ~18"
    and "The answer is about 18" were no answer since gsm8k 4 (session 54's leftover). Case aside, each word."""
    for completion in (f"#### {word} 18", f"#### {word.capitalize()} **18**", f"\\boxed{{\\text{{{word} }} 18}}",
                       f"**Final Answer:** {word} 18", f"<answer>{word} $18</answer>"):
        assert extract_answer(completion) is None, completion
    # the word in the reasoning is none of the answer's business
    assert extract_answer(f"She walks {word} 3 blocks a day for 6 days: 3 * 6 = 18.\n#### 18") == "18"


@pytest.mark.parametrize("completion", [
    "So \\boxed{5} and \\boxed{7}.", "$\\boxed{5}$, $\\boxed{7}$", "$\\boxed{5}$, and $\\boxed{7}$",
    "\\[\\boxed{5}\\]\nand\n\\[\\boxed{7}\\]",
    "\\boxed{5} \\text{ and } \\boxed{7}", "\\(\\boxed{5}\\) AND \\(\\boxed{7}\\)",
])
def test_two_boxes_listed_with_and_are_no_gsm8k_answer(completion):
    """"\\boxed{5} and \\boxed{7}" read as its last box, 7: only "or" between boxes was a hedge. A gsm8k reference is
    one number, so two listed answers are none, rewarded for whichever came second (session 54's leftover). math reads
    the two as one answer (since math 2; until then the last box): right for a reference of two parts, "5, 7"."""
    assert extract_answer(completion) is None and not is_correct(completion, "7")
    assert extract_answer(completion, "math") == "5, 7"
    assert extract_answer(f"#### Answer\n5\n{completion}") == "5"  # no box below the heading: its own line stands
    # the same number twice, a correction on a new line, an intermediate the words after "and" set apart, and (words
    # before it, as before a hedge's "or") one quantity in two units, the last the unit asked for maybe
    for one in ("\\boxed{7} and \\boxed{7.0}", "\\boxed{5}\n\\boxed{7}", "\\boxed{5}, \\boxed{7}.\nRechecking: \\boxed{7}",
                "She keeps \\boxed{5}, and the total is \\boxed{7}.", "$\\boxed{420}$ minutes and $\\boxed{7}$ hours"):
        assert extract_answer(one) == "7", one


@pytest.mark.parametrize("completion, answer", [
    ("#### \u20ac18", "18"), ("#### 18\u20ac", "18"), ("#### \u00a318", "18"), ("#### \u00a518", "18"),
    ("#### \u20b9 1,500", "1500"), ("#### Rs.150", "150"), ("#### Rs 150", "150"), ("#### \u20ac18.50", "18.5"),
    ("\\boxed{\\pounds 18}", "18"), ("\\boxed{\\text{\u20ac}18}", "18"), ("\\boxed{\u20ac18}", "18"),
    ("The answer is \u20ac18.", "18"), ("The answer is Rs. 1,000.", "1000"), ("Therefore, the final answer is: \u00a360", "60"), ("#### 5\u00a2", "5"),
    ("#### ~\u20ac18", None), ("#### 18,50 \u20ac", None), ("#### \u20ac18 or \u20ac19", None),
    ("Each costs \u20ac3, about \u20ac4 with tax.\n6 * 3 = 18\n#### 18", "18"),
])
def test_a_currency_sign_is_read_as_a_dollar_sign(completion, answer):
    """"#### €18", "£18", "18€", "\\boxed{¥18}" were no answer (the sign no word before the number, glued after it),
    where "$18" was 18 (session 54's leftover): each is cleaned off as "$" is, and a "~" before it still hedges."""
    assert extract_answer(completion) == answer


# ---- a review of gsm8k 5 (s55r09): right answers its bound and approximation words refused ------------------------------
@pytest.mark.parametrize("completion, answer", [
    ("#### 18 (at most one per day)", "18"), ("#### 18 at least once", "18"), ("#### 1760 yards, roughly a mile", "1760"),
    ("The answer is 18 minutes, approximately a third of an hour.", "18"), ("#### 0.3 hours (approximately a third of an hour)", "0.3"),
    ("#### 18 (maximum number of cookies)", "18"), ("#### 4 (minimum number of buses)", "4"), ("#### 60 mph maximum speed", "60"),
    ("#### 18 maximum-size boxes", "18"), ("#### 18, the maximum", "18"), ("#### 18 dollars. At least that is what she earns.", "18"),
    # still bounds: nothing, punctuation or a bracket after the word, "roughly speaking", "give or take" and its tolerance
    ("#### 18 at most", None), ("#### 18 (approximately)", None), ("#### 18 hours max", None), ("#### 18 maximum", None),
    ("The answer is 18 at least.", None), ("#### 18 at most, probably fewer", None), ("#### 18 roughly speaking", None),
    ("#### 18 give or take a few", None), ("#### 18 give or take 2", None),
])
def test_a_bound_word_that_a_word_follows_bounds_that_word(completion, answer):
    """gsm8k 5 made a bound or approximation after the number no answer unless a number followed it: "#### 18 (at most one
    per day)", "(approximately a third of an hour)", "(maximum number of cookies)", "#### 18, the maximum" gave none (a
    review). A word after it is what it bounds or names; "give or take" bounds the answer whatever follows it."""
    assert extract_answer(completion) == answer


@pytest.mark.parametrize("completion, answer", [
    ("3 + 5 + 10 = 18\n#### It all adds up to 18", "18"), ("#### Rounded up to 5 buses", "5"),
    ("<answer>The price went up to $18</answer>", "18"), ("#### As computed above, 18", "18"), ("#### From the above, 18", "18"),
    ("#### She can invite up to 18 guests", None), ("#### above 18", None), ("#### approx. 18", None),
    ("The answer is approx. 18.", None), ("#### at least, 18", None),
])
def test_up_to_after_its_verb_or_a_bound_word_before_a_comma_is_no_bound(completion, answer):
    """gsm8k 5's "up to 18" and "above 18" refused "It all adds up to 18", "Rounded up to 5 buses" and "As computed
    above, 18" (a review): "up to" after a verb it completes, and an approximation word before a comma (which ends its
    clause), bound nothing. "approx." with its dot is "approx" (it read as 18); "at least" keeps gsm8k 4's reading."""
    assert extract_answer(completion) == answer


def test_rupees_before_a_new_sentence_end_it():
    """gsm8k 5 stopped splitting sentences at "Rs. " (for "The answer is Rs. 1,000."): "He pays 500 Rs. The answer is 500."
    became one sentence that does not start with the answer phrase, no answer (a review)."""
    for completion in ("He pays 10 * 50 = 500 Rs. The answer is 500.", "It costs 500 Rs. So the answer is Rs. 500.",
                       "The answer is Rs. 500.", "He pays 500 Rs. Therefore, the final answer is: 500"):
        assert extract_answer(completion) == "500", completion


@pytest.mark.parametrize("text", ["the answer is 1 " * 6250, "So " * 30000 + "the answer is 1",
                                  "The answer is " + "\\frac{1}{2}" * 9000, "**Answer:** " * 8000 + "1"],
                         ids=["repeat", "leads", "fracs", "labels"])
def test_a_degenerate_statement_is_no_answer_and_cheap(text):
    """A policy's degenerate repeat that starts with the answer phrase was one 100 KB sentence, cleaned whole as a
    #### line is: ~40 ms a completion ("\\frac{1}{2}" x 9,000: ~0.4 s) and read as 1. A statement's sentence over
    4,000 characters is no answer, and costs a scan (the bound only separates the two on a loaded box)."""
    import time

    t0 = time.perf_counter()
    assert extract_answer(text) is None
    assert time.perf_counter() - t0 < 0.25


@pytest.mark.parametrize("lead", ["In conclusion,", "In summary,", "Finally,", "Overall,"])
def test_a_summary_lead_states_the_answer(lead):
    """A summary's lead made the statement say another word, no answer ("In conclusion, the answer is 18."; a review)."""
    assert extract_answer(f"6 + 12 = 18.\n{lead} the answer is 18.") == "18"
    assert extract_answer("In the example, the answer is 5.") is None


def test_a_symlinked_reward_file_is_loaded_as_the_link(tmp_path, monkeypatch):
    """The file was loaded from its resolved path: ``__file__`` was the link's target, so a reward reading a file beside
    it looked in the target's folder (FileNotFoundError; until dc38ad5 it read beside the link). The same file named
    relative and absolute is still one module, run once; its source is the link, hashed as the target's text."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "lib" / "impl.py").write_text(textwrap.dedent(f"""
        from pathlib import Path
        with open({str(tmp_path / 'runs')!r}, "a") as log:
            log.write("x")
        def f(c, a):
            return float((Path(__file__).parent / "scale.txt").read_text())
    """))
    (tmp_path / "run" / "scale.txt").write_text("2")
    link = tmp_path / "run" / "r.py"
    link.symlink_to(tmp_path / "lib" / "impl.py")
    monkeypatch.chdir(tmp_path / "run")
    rs = RewardSet.from_specs([f"{link}:f", "r.py:f", "./r.py:f"])
    assert rs.score("x", None)[1] == 6.0
    assert (tmp_path / "runs").read_text() == "x"
    assert {s.reward.source for s in rs.specs} == {str(link)}


# ---- RULE_VERSION: a finished eval is scored again only where the version changed ----------------------------------
RULE_PINS = ["#### 3 hours (180 minutes)", "#### 90 minutes (or 1 hour 30 minutes)", "#### 72.50, to 2 decimal places",
             "#### She spent the most: $72", "#### at least **72**", "#### Answer\n72\n\\boxed{72} or \\boxed{73}",
             "#### 72", "\\boxed{\\frac{1}{2}}", "So \\boxed{3} or \\boxed{4}", "The answer is $\\boxed{x^2+1}$.",
             "#### 18 dollars and 9 eggs sold", "So the final answer is 18.", "#### The answer is >= 72",
             "The answer is 6 + 12 = 18. So 18 - 3 = 15.", "#### 18 at most", "#### about 18", "\\boxed{5} and \\boxed{7}",
             "#### \u20ac18", "The answer is 18. Actually, it is 19.", "\\boxed{2}; \\boxed{3}",
             "\\boxed{3}. Actually, it is 4.", "\\boxed{3}, not \\boxed{4}", "\\boxed{\\boxed{2}} \\boxed{\\boxed{3}}"]
RULE_READINGS = {  # (kind, version): extract_answer of each of RULE_PINS under that version's rule
    ("gsm8k", 1): [None, None, None, None, "72", "73", "72", "0.5", None, None, None, None, "72", None, "18", "18", "7", None,
                   None, "3", "3", "4", "3"],
    ("gsm8k", 2): ["3", "90", "72.5", "72", None, "72", "72", "0.5", None, None, "18", None, "72", None, "18", "18", "7", None,
                   None, "3", "3", "4", "3"],
    ("gsm8k", 3): ["3", "90", "72.5", "72", None, "72", "72", "0.5", None, None, "18", "18", "72", "15", "18", "18", "7", None,
                   "18", "3", "3", "4", "3"],
    ("gsm8k", 4): ["3", "90", "72.5", "72", None, "72", "72", "0.5", None, None, "18", "18", None, "18", "18", "18", "7", None,
                   "18", "3", "3", "4", "3"],
    ("gsm8k", 5): ["3", "90", "72.5", "72", None, "72", "72", "0.5", None, None, "18", "18", None, "18", None, None, None, "18",
                   "18", "3", "3", "4", "3"],
    ("gsm8k", 6): ["3", "90", "72.5", "72", None, "72", "72", "0.5", None, None, "18", "18", None, "18", None, None, None, "18",
                   None, None, None, "4", None],
    ("gsm8k", 7): ["3", "90", "72.5", "72", None, "72", "72", "0.5", None, None, "18", "18", None, "18", None, None, None, "18",
                   None, None, None, "3", None],
    ("math", 1): [None, None, None, None, None, None, None, "\\frac{1}{2}", None, "x^2+1", None, None, None, None, None, None, "7",
                  None, None, "3", "3", "4", "3"],
    ("math", 2): [None, None, None, None, None, "72, 73", None, "\\frac{1}{2}", "3, 4", "x^2+1", None, None, None, None, None,
                  None, "5, 7", None, None, "3", "3", "4", "3"],
    ("math", 3): [None, None, None, None, None, "72, 73", None, "\\frac{1}{2}", "3, 4", "x^2+1", None, None, None, None, None,
                  None, "5, 7", None, None, "2, 3", None, "4", "3"],
    ("math", 4): [None, None, None, None, None, "72, 73", None, "\\frac{1}{2}", "3, 4", "x^2+1", None, None, None, None, None,
                  None, "5, 7", None, None, "2, 3", None, "3", "2, 3"],
}


@pytest.mark.parametrize("kind", ["gsm8k", "math"])
def test_a_rule_that_reads_otherwise_has_another_version(kind):
    """4c76a7a changed the gsm8k rule's readings (the first five above) under RULE_VERSION 1, which 6557ca2 had just
    recorded in metrics.json: an eval finished between them stayed "already done" with the old verdicts. A change of
    reading fails here until the kind's version is bumped and its readings added."""
    from qerl_cli.answers import RULE_VERSION

    assert [extract_answer(c, kind) for c in RULE_PINS] == RULE_READINGS[kind, RULE_VERSION[kind]]


TRL_REWARDS = '''\
calls = []


def length(completions, **kwargs):
    calls.append({"completions": completions, **kwargs})
    return [float(len(c)) for c in completions]


def chat_length(completions, prompts, **kwargs):
    prompts[0].append({"role": "assistant", "content": "mutated"})  # a copy: the record's prompt stays
    return [float(len(c[0]["content"])) if c[0]["role"] == "assistant" else -1.0 for c in completions]


def exact(completions, answer):  # no **kwargs: passed only what it names
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]


def short(completions, **kwargs):
    return [1.0]


def scalar(completions, **kwargs):
    return 1.0


def some_none(completions, **kwargs):
    return [None if c == "skip" else 2.0 for c in completions]


def nan_second(completions, **kwargs):
    return [0.0, float("nan")]


def boom(completions, **kwargs):
    return {}["missing"]


def solution(completions, solution, **kwargs):
    return [0.0] * len(completions)


def state(completions, *, trainer_state, **kwargs):
    return [0.0] * len(completions)


def accuracy(completions, solution, **kwargs):  # open-r1's accuracy_reward's form: the dataset's `solution` column
    calls.append({"completions": completions, "solution": solution, **kwargs})
    return [1.0 if c == s else 0.0 for c, s in zip(completions, solution)]


def named(completions, answer, tests, level=None):  # no **kwargs: passed the columns it names
    tests[0].append("mutated")  # a copy: the next completion's and the row's tests stay
    return [float(len(t) + (level is None)) for t in tests]  # no `level` column: its default
'''


def test_a_trl_reward_is_called_once_per_group_with_trls_keywords(tmp_path):
    # A reward written for TRL's GRPOTrainer, fn(completions, **kwargs) -> list: refused when loaded ("too many
    # positional arguments"), or, naming a second parameter (answer, prompts), loaded and refused after the first
    # batch's generation ("returned list")
    f = tmp_path / "trl_r.py"
    f.write_text(TRL_REWARDS)
    rs = RewardSet.from_specs([f"{f}:length", "gsm8k=0.5"])
    got = rs.score_group(["#### 4", "no"], "4", "2+2?", completion_ids=[[1, 2], [3]], where=" for p.jsonl:1")
    assert got == [({f"{f}:length": 6.0, "gsm8k": 1.0}, 6.5), ({f"{f}:length": 2.0, "gsm8k": 0.0}, 2.0)]
    calls = rs.specs[0].reward.fn.__globals__["calls"]
    assert calls == [{"completions": ["#### 4", "no"], "prompts": ["2+2?", "2+2?"], "answer": ["4", "4"],
                      "completion_ids": [[1, 2], [3]]}]  # no trainer_state
    assert rs.score("#### 4", "4", "2+2?") == ({f"{f}:length": 6.0, "gsm8k": 1.0}, 6.5)  # one completion, no ids
    assert RewardSet.from_specs([f"{f}:exact"]).score_group(["4", "5"], "4", "q") == [({f"{f}:exact": 1.0}, 1.0),
                                                                                      ({f"{f}:exact": 0.0}, 0.0)]


def test_a_trl_reward_of_a_chat_prompt_gets_trls_conversational_form(tmp_path):
    f = tmp_path / "trl_r.py"
    f.write_text(TRL_REWARDS)
    prompt = [{"role": "user", "content": "2+2?"}]
    got = RewardSet.from_specs([f"{f}:chat_length"]).score_group(["4", "four"], "4", prompt)
    assert got == [({f"{f}:chat_length": 1.0}, 1.0), ({f"{f}:chat_length": 4.0}, 4.0)]
    assert prompt == [{"role": "user", "content": "2+2?"}]
    rs = RewardSet.from_specs([f"{f}:length"])
    rs.score_group(["4"], "4", prompt)
    assert rs.specs[0].reward.fn.__globals__["calls"][-1]["completions"] == [[{"role": "assistant", "content": "4"}]]


def test_a_trl_reward_returning_none_does_not_apply_and_a_wrong_list_is_refused(tmp_path):
    f = tmp_path / "trl_r.py"
    f.write_text(TRL_REWARDS)
    rs = RewardSet.from_specs([f"{f}:some_none", "format=0.5"])
    assert rs.score_group(["skip", "x"], None, "q") == [({"format": 0.0}, 0.0), ({f"{f}:some_none": 2.0, "format": 0.0}, 2.0)]
    with pytest.raises(BadInputError, match="no reward applies to completion 1 of 2 for p.jsonl:1: every reward returned None"):
        RewardSet.from_specs([f"{f}:some_none"]).score_group(["skip", "x"], None, "q", where=" for p.jsonl:1")
    for fn, n, msg in (("short", 2, "returned 1 rewards for the 2 completions for p.jsonl:1"),
                       ("scalar", 2, "returned float '1.0' for p.jsonl:1, not a list of 2 rewards"),
                       ("nan_second", 2, "returned nan for p.jsonl:1 (completion 2 of 2)"),
                       ("boom", 1, f"raised KeyError: 'missing' for p.jsonl:1 (at {f}:35, in boom)")):
        with pytest.raises(BadInputError) as e:
            RewardSet.from_specs([f"{f}:{fn}"]).score_group(["a"] * n, "4", "q", where=" for p.jsonl:1")
        assert msg in str(e.value) and "\n" not in str(e.value), e.value


def test_a_trl_reward_needing_what_qerl_does_not_pass_is_refused_when_loaded(tmp_path):
    f = tmp_path / "trl_r.py"
    f.write_text(TRL_REWARDS)
    with pytest.raises(BadInputError, match="read as a TRL reward, but cannot be called with qerl's keywords .*"
                                            "missing a required argument: 'trainer_state'") as e:
        RewardSet.from_specs([f"{f}:state"])
    assert "give the parameter a default" in e.value.hint
    assert RewardSet.from_specs([f"{f}:solution"]).specs[0].reward.needs_columns == ("solution",)  # a column now


def test_a_trl_reward_is_passed_the_rows_other_columns(tmp_path):
    # TRL's GRPOTrainer passes a reward every dataset column but the prompt, one value per completion: a reward taking
    # `solution` (open-r1's accuracy_reward) was refused when loaded ("no other column"), one reading it from **kwargs
    # failed on a KeyError after the first batch's generation
    f = tmp_path / "trl_r.py"
    f.write_text(TRL_REWARDS)
    rs = RewardSet.from_specs([f"{f}:accuracy", f"{f}:named", f"{f}:exact", "format"])
    columns = {"solution": "4", "tests": [1, 2], "id": 7, "completions": "a column of a reserved name"}
    got = rs.score_group(["4", "5"], "4", "q", columns=columns, where=" for p.jsonl:1")
    assert [vals for vals, _ in got] == [{f"{f}:accuracy": 1.0, f"{f}:named": 4.0, f"{f}:exact": 1.0, "format": 0.0},
                                         {f"{f}:accuracy": 0.0, f"{f}:named": 3.0, f"{f}:exact": 0.0, "format": 0.0}]
    calls = rs.specs[0].reward.fn.__globals__["calls"]
    assert calls == [{"completions": ["4", "5"], "solution": ["4", "4"], "prompts": ["q", "q"], "answer": ["4", "4"],
                      "tests": [[1, 2], [1, 2]], "id": [7, 7]}]  # every other column, each G times; no `completions` column
    assert columns["tests"] == [1, 2]  # `named` appended to its copy
    assert rs.specs[1].reward.columns == ("tests", "level") and rs.specs[2].reward.columns == ()


def test_columns_without_one_a_trl_reward_requires_are_one_line_naming_it(tmp_path):
    f = tmp_path / "trl_r.py"
    f.write_text(TRL_REWARDS)
    rs = RewardSet.from_specs([f"{f}:accuracy"])
    with pytest.raises(BadInputError) as e:
        rs.score_group(["4"], "4", "q", columns={"task": "x"}, where=" for p.jsonl:3")
    assert str(e.value).startswith(f"reward '{f}:accuracy' takes the dataset column `solution` (a parameter without "
                                   "a default), which is not among the columns for p.jsonl:3") and "\n" not in str(e.value)
    assert e.value.hint.startswith("they are `task`; the reference is passed as `answer`")
    with pytest.raises(BadInputError) as e:
        rs.check_columns(["task", "id"], " of p.jsonl")
    assert "which is not among the columns of p.jsonl" in str(e.value) and "`task`, `id`" in e.value.hint
    rs.check_columns(["solution"], " of p.jsonl")
    assert rs.score_group(["4"], "4", "q", columns={"solution": None}) == [({f"{f}:accuracy": 0.0}, 0.0)]  # a null


def test_trl_rewards_score_a_real_rollout_once_per_group(tmp_path):
    # `python -m qerl_cli rollout` of the bundled tiny model: a TRL reward on text prompts gets strings and the
    # completions' token ids; on `messages` rows (a chat template given) TRL's conversational form
    import json
    import subprocess
    import sys

    from qerl_cli.assets import tiny_model_dir, tiny_task_file
    from qerl_cli.shards import read_records
    from tests.reliability_fixtures import cli_env

    f = tmp_path / "trl_r.py"
    f.write_text("from pathlib import Path\n\n\n"
                 "def ids(completions, completion_ids, prompts, answer, **kwargs):\n"
                 "    assert 'trainer_state' not in kwargs and len(set(prompts)) == len(set(answer)) == 1\n"
                 "    with open(Path(__file__).with_name('calls.txt'), 'a') as log:\n"
                 "        log.write(f'{len(completions)}\\n')\n"
                 "    return [float(len(i)) for i in completion_ids]\n\n\n"
                 "def chat(completions, prompts, **kwargs):\n"
                 "    assert prompts[0] == [{'role': 'user', 'content': '2+2?'}]\n"
                 "    return [float(len(c[0]['content'])) for c in completions]\n")
    chat_rows = tmp_path / "chat.jsonl"
    chat_rows.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}) + "\n")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}A:")
    base = [sys.executable, "-m", "qerl_cli", "rollout", "--model", str(tiny_model_dir()), "-G", "3",
            "--max-new-tokens", "6", "--device", "cpu", "-q"]
    for prompts, reward, extra in ((tiny_task_file("train"), "ids", ["--max-prompts", "2"]),
                                   (chat_rows, "chat", ["--chat-template-file", str(template)])):
        out = tmp_path / reward
        r = subprocess.run([*base, "--prompts", str(prompts), "--out", str(out), "--reward", f"{f}:{reward}", *extra],
                           env=cli_env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        for rec in read_records(out):
            want = len(rec["completion_token_ids"]) if reward == "ids" else len(rec["completion"])
            assert rec["rewards"] == {f"{f}:{reward}": float(want)} and rec["reward"] == want
    assert (tmp_path / "calls.txt").read_text() == "3\n3\n"  # once per prompt group of G


def test_a_trl_reward_taking_a_dataset_column_scores_a_real_rollout(tmp_path):
    # `python -m qerl_cli rollout` of the bundled tiny model with open-r1's accuracy_reward's form, f(completions,
    # solution, **kwargs): refused when loaded ("qerl passes ... no other column"); now passed the row's `solution`,
    # its JSON list column `tests` as read, and None for a column another row has; a dataset without `solution` is
    # one line naming the file, before generating
    import json
    import subprocess
    import sys

    from qerl_cli.assets import tiny_model_dir, tiny_task_file
    from qerl_cli.shards import read_records
    from tests.reliability_fixtures import cli_env

    f = tmp_path / "acc.py"
    f.write_text("def accuracy(completions, solution, **kwargs):\n"
                 "    assert len(set(solution)) == 1 and 'trainer_state' not in kwargs\n"
                 "    tests = kwargs['tests'][0]\n"
                 "    return [float(len(tests) if tests is not None else -1) + (s in c) for c, s in zip(completions, solution)]\n")
    rows = [json.loads(line) for line in tiny_task_file("train").read_text().splitlines()[:2]]
    data = tmp_path / "solution.jsonl"
    data.write_text(json.dumps({"prompt": rows[0]["prompt"], "solution": rows[0]["answer"], "tests": [1, [2, 3]]}) + "\n"
                    + json.dumps({"prompt": rows[1]["prompt"], "solution": rows[1]["answer"]}) + "\n")
    base = [sys.executable, "-m", "qerl_cli", "rollout", "--model", str(tiny_model_dir()), "-G", "2",
            "--max-new-tokens", "6", "--device", "cpu", "-q", "--reward", f"{f}:accuracy"]
    r = subprocess.run([*base, "--prompts", str(data), "--out", str(tmp_path / "out")], env=cli_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    recs = read_records(tmp_path / "out")
    assert len(recs) == 4 and all("solution" not in rec for rec in recs)  # the shard's record is as it was
    for rec in recs:
        tests, sol = (2, rows[0]["answer"]) if rec["prompt"] == rows[0]["prompt"] else (-1, rows[1]["answer"])
        assert rec["reward"] == tests + (sol in rec["completion"]), rec
    r = subprocess.run([*base, "--prompts", str(tiny_task_file("train")), "--out", str(tmp_path / "o2")],
                       env=cli_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and f"reward '{f}:accuracy' takes the dataset column `solution`" in r.stderr, r.stderr
    assert "not among the columns of " in r.stderr and "train.jsonl" in r.stderr and len(r.stderr.splitlines()) == 1
    assert not (tmp_path / "o2").exists()


TRL_MORE = '''\
import asyncio

loops = []


def repetition(completion_ids, **kwargs):  # TRL's get_repetition_penalty_reward's form: no `completions`
    return [-float(len(ids) - len(set(ids))) for ids in completion_ids]


async def judged(completions, answer, **kwargs):  # TRL awaits an async reward
    await asyncio.sleep(0)
    loops.append(asyncio.get_running_loop())
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]


class Judge:
    async def __call__(self, completions, **kwargs):
        return [float(len(c)) for c in completions]


judge = Judge()


def one(c):
    return {"a": 1.0}[c]


def mapped(completions, **kwargs):
    return map(one, completions)


def lazy_type_error(completions, **kwargs):
    return (len(c) + "x" for c in completions)


def positional(completions, /, **kwargs):
    return [0.0] * len(completions)


def solution(completions, solution, **kwargs):
    return [0.0] * len(completions)


def per_completion(completion, answer, completion_ids=None):  # not TRL's: it names `completion`
    return 1.0


def shared(text, answer, completion_ids=None):  # not TRL's: it takes (completion, answer), its ids by default
    return float(len(text))


def ids_by_default(completion_ids=None, **kwargs):  # TRL's: it cannot take (completion, answer)
    return [float(len(ids)) for ids in completion_ids]


async def raises(completions, **kwargs):
    await asyncio.sleep(0)
    raise KeyError("gone")


async def exits(completions, **kwargs):
    await asyncio.sleep(0)
    raise SystemExit("no judge")  # sys.exit()


def ids_and_answer(completion_ids=None, answer=None, **kwargs):  # TRL's: (completion, answer) would fill its ids
    return [float(len(ids)) for ids in completion_ids]


def builtin_mapped(completions, **kwargs):  # float raises, in no frame of this file's
    return map(float, completions)


def logs(completions, log_metric, **kwargs):  # TRL 1.x passes its trainer's logger
    log_metric("length", 1.0)
    return [1.0] * len(completions)


def keys(completions, **kwargs):
    return [float(len(kwargs))] * len(completions)


def same_text(completions, text, **kwargs):
    return [float(t is text[0]) for t in text]


def env_reward(completions, environments, **kwargs):  # TRL's tool-calling runs: its environment_factory's objects
    return [e.reward for e in environments]
'''


def test_a_trl_reward_of_token_ids_alone_is_trls(tmp_path):
    # TRL's own get_repetition_penalty_reward and get_soft_overlong_punishment take (completion_ids, **kwargs): they
    # were refused when loaded as "cannot be called as f(completion, answer...)", the refusal TRL rewards had before
    f = tmp_path / "trl_m.py"
    f.write_text(TRL_MORE)
    rs = RewardSet.from_specs([f"{f}:repetition", f"{f}:per_completion"])
    assert rs.score_group(["a", "b"], None, "q", completion_ids=[[1, 1, 2], [3]]) == [
        ({f"{f}:repetition": -1.0, f"{f}:per_completion": 1.0}, 0.0), ({f"{f}:repetition": 0.0, f"{f}:per_completion": 1.0}, 1.0)]
    assert rs.specs[1].reward.batched is None


def test_an_async_trl_reward_is_awaited_on_one_loop(tmp_path):
    # TRL awaits an async reward (a function or a callable instance's __call__); it was refused when loaded, with a
    # hint to wrap it as f(completion, answer)
    f = tmp_path / "trl_m.py"
    f.write_text(TRL_MORE)
    rs = RewardSet.from_specs([f"{f}:judged", f"{f}:judge"])
    for _ in range(2):
        assert rs.score_group(["4", "five"], "4", "q") == [({f"{f}:judged": 1.0, f"{f}:judge": 1.0}, 2.0),
                                                          ({f"{f}:judged": 0.0, f"{f}:judge": 4.0}, 4.0)]
    loops = rs.specs[0].reward.fn.__globals__["loops"]
    assert len(loops) == 2 and loops[0] is loops[1]  # one loop: a client made at the first call stays usable


def test_a_lazy_trl_return_that_raises_is_the_users_error(tmp_path):
    # a map or generator returned is iterated by qerl: its KeyError was a traceback (a bug of qerl's, exit 1), its
    # TypeError read as "returned generator ..., not a list"
    f = tmp_path / "trl_m.py"
    f.write_text(TRL_MORE)
    for fn, msg in (("mapped", f"raised KeyError: 'b' for p.jsonl:1 (at {f}:25, in one)"),
                    ("lazy_type_error", "raised TypeError: unsupported operand type(s) for +: 'int' and 'str' for p.jsonl:1")):
        with pytest.raises(BadInputError) as e:
            RewardSet.from_specs([f"{f}:{fn}"]).score_group(["a", "b"], None, "q", where=" for p.jsonl:1")
        assert msg in str(e.value), e.value


def test_a_lazy_trl_return_raising_outside_the_users_file_names_no_line_of_qerls(tmp_path):
    # TRL's calling convention moved to qerl_cli/trl_rewards.py: the map it runs was named as where the reward raised,
    # "(at .../qerl_cli/trl_rewards.py:135, in call_trl)", as rewards.py's own lines never are
    f = tmp_path / "trl_m.py"
    f.write_text(TRL_MORE)
    with pytest.raises(BadInputError) as e:
        RewardSet.from_specs([f"{f}:builtin_mapped"]).score_group(["a"], None, "q", where=" for p.jsonl:1")
    assert str(e.value).endswith("raised ValueError: could not convert string to float: 'a' for p.jsonl:1"), e.value


def test_a_trl_reward_requiring_trls_loggers_is_refused_when_loaded_naming_them(tmp_path):
    # TRL 1.x passes `log_extra` and `log_metric` callables: one requiring `log_metric` was read as taking a dataset
    # column of that name, refused as "takes the dataset column `log_metric` ... no row has it"; and a column so
    # named was passed to a **kwargs reward, where TRL passes its own
    f = tmp_path / "trl_m.py"
    f.write_text(TRL_MORE)
    with pytest.raises(BadInputError, match="missing a required argument: 'log_metric'") as e:
        RewardSet.from_specs([f"{f}:logs"])
    assert e.value.hint == "qerl has no TRL trainer to pass as `log_metric`: give the parameter a default (None)"
    rs = RewardSet.from_specs([f"{f}:keys"])
    assert rs.score_group(["a"], None, "q", columns={"log_extra": 1, "log_metric": 2, "id": 3}) == [({f"{f}:keys": 3.0}, 3.0)]  # prompts, answer, id


def test_a_trl_reward_requiring_trls_environments_is_refused_when_loaded_and_no_column_is_passed_as_them(tmp_path):
    # TRL passes `environments` (its environment_factory's objects, one per completion) as it passes `log_metric`: a
    # reward requiring it was read as taking a dataset column of that name, refused as "not among the columns" (or,
    # where the file had one, passed its values to read `env.reward` from), and a **kwargs reward got that column
    f = tmp_path / "trl_m.py"
    f.write_text(TRL_MORE)
    with pytest.raises(BadInputError, match="missing a required argument: 'environments'") as e:
        RewardSet.from_specs([f"{f}:env_reward"])
    assert e.value.hint.startswith("qerl has no TRL environments (GRPOTrainer's environment_factory)")
    rs = RewardSet.from_specs([f"{f}:keys"])
    assert rs.score_group(["a"], None, "q", columns={"environments": ["x"], "id": 3}) == [({f"{f}:keys": 3.0}, 3.0)]


def test_a_messages_column_beside_a_text_prompt_is_passed_as_trl_passes_it(tmp_path):
    # TRL passes every column but `prompt`: a `messages` column beside the text `prompt` (an SFT set's conversation,
    # a reference reply) was left out as if it were the prompt, and a reward requiring it refused when loaded ("a name
    # qerl passes nothing under"); where `messages` is the prompt (no `prompt`, or --prompt-key messages) it is not
    import json

    from qerl_cli.data import load_prompts

    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "2+2?", "messages": chat, "answer": "4", "level": 1}) + "\n"
                 + json.dumps({"question": "3+3?", "messages": chat[:1], "answer": "6"}) + "\n")
    rows = load_prompts(p)
    assert rows[0].prompt_field == "2+2?" and rows[0].columns == {"messages": chat, "level": 1}
    assert rows[1].prompt_field == chat[:1] and rows[1].columns == {"question": "3+3?"}  # `messages` is its prompt
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"question": "3+3?", "messages": chat[:1]}) + "\n")
    assert load_prompts(q, prompt_key="question")[0].columns == {"question": "3+3?", "messages": chat[:1]}
    assert load_prompts(q, prompt_key="messages")[0].columns == {"question": "3+3?"}
    f = tmp_path / "turns.py"
    f.write_text("def turns(completions, messages, **kwargs):\n    return [float(len(m)) for m in messages]\n")
    rs = RewardSet.from_specs([f"{f}:turns"])
    assert rs.specs[0].reward.needs_columns == ("messages",)
    assert rs.score_group(["4"], "4", rows[0].prompt_field, columns=rows[0].columns) == [({f"{f}:turns": 2.0}, 2.0)]


def test_a_reward_requiring_messages_where_it_is_the_prompt_is_told_it_is_passed_as_prompts(tmp_path):
    # `messages` left the reserved names (a column beside a text `prompt`): a reward requiring it on a chat file, whose
    # `messages` is the prompt, was told "not among the columns of p.jsonl (they are `id`; the reference is passed as
    # `answer`...)" of a file plainly holding `messages`, naming neither why nor `prompts`, where it is passed (a review)
    import json

    from qerl_cli.data import column_names, load_prompts

    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": 1, "messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}) + "\n")
    f = tmp_path / "turns.py"
    f.write_text("def turns(completions, messages, **kwargs):\n    return [float(len(m)) for m in messages]\n")
    rs = RewardSet.from_specs([f"{f}:turns"])
    with pytest.raises(BadInputError, match=r"takes the dataset column `messages`.*not among the columns of p.jsonl") as e:
        rs.check_columns(column_names(load_prompts(p)), " of p.jsonl")
    assert e.value.hint.startswith("they are `id`; `messages`, where it is a row's prompt (no text `prompt` beside it, "
                                   "or --prompt-key messages), is no column: it is passed as `prompts`")
    g = tmp_path / "acc.py"
    g.write_text("def acc(completions, solution, **kwargs):\n    return [0.0 for _ in completions]\n")
    with pytest.raises(BadInputError) as e:  # another column's refusal keeps its hint
        RewardSet.from_specs([f"{g}:acc"]).check_columns(["id"], " of p.jsonl")
    assert e.value.hint == "they are `id`; the reference is passed as `answer`, read from --answer-key's column"


def test_a_trl_rewards_nan_is_refused_with_a_hint_naming_none(tmp_path):
    # TRL reads a NaN as it reads None ("does not apply": nansum, nanmean); qerl refuses it, as a bug (0/0) returns one
    # too, but the refusal said only "rewards must be finite", naming no way to say "does not apply"
    f = tmp_path / "nan_r.py"
    f.write_text("def nan_trl(completions, **kwargs):\n    return [float('nan')] * len(completions)\n\n\n"
                 "def nan_one(completion, answer):\n    return float('nan')\n")
    with pytest.raises(BadInputError, match=r"returned nan for p.jsonl:1 \(completion 1 of 2\)") as e:
        RewardSet.from_specs([f"{f}:nan_trl"]).score_group(["a", "b"], None, "q", where=" for p.jsonl:1")
    assert e.value.hint.startswith("rewards must be finite; a TRL-style reward returns None for a completion")
    with pytest.raises(BadInputError, match="returned nan") as e:
        RewardSet.from_specs([f"{f}:nan_one"]).score_group(["a"], None, "q")
    assert e.value.hint == "rewards must be finite"  # qerl's own form has no None to return


class Serialized:
    """A column value that counts how often it is copied (deepcopy and pickle alike call __reduce_ex__)."""

    count = 0

    def __reduce_ex__(self, protocol):
        Serialized.count += 1
        return Serialized, ()


def test_a_column_is_serialized_once_per_group_not_once_per_completion(tmp_path):
    # each completion's value was a deepcopy of the column's: 3 ms for a 1 MB list of dicts, ~72 s of CPU a step at
    # 16 completions x 512 groups with the GPU idle; now pickled once and loaded per completion (4-6x faster). A
    # text is passed as is, as deepcopy passes it (pickling a 1 MB one per completion cost 18 s a step), and what
    # cannot be pickled is still deep-copied
    f = tmp_path / "trl_m.py"
    f.write_text(TRL_MORE)
    Serialized.count = 0
    rs = RewardSet.from_specs([f"{f}:keys", f"{f}:same_text"])
    columns = {"tests": [Serialized()], "text": "x" * 1000, "check": lambda: 1}
    assert rs.score_group(["a"] * 4, None, "q", columns=columns) == [({f"{f}:keys": 5.0, f"{f}:same_text": 1.0},
                                                                      6.0)] * 4
    assert Serialized.count == 2  # once per group for each of the two rewards


def test_a_long_text_inside_a_column_is_shared_by_the_copies_as_deepcopy_shares_it():
    # pickled once a group, each completion's copy held its own copy of every text in the column's list or object,
    # where deepcopy shared them (immutable): a list of ten 100 KB documents took 29 ms a group against 0.1 (15 s of
    # CPU a step at 512 groups), a 10 MB text in a dict 2 minutes a step. The containers are still each completion's
    from qerl_cli.trl_rewards import trl_kwargs

    doc, blob = "x" * 100_000, b"y" * 100_000
    columns = {"docs": [doc, "short"], "meta": {"text": doc, "raw": blob}}
    kw = trl_kwargs(("completions",), None, ["a", "b", "c"], None, columns=columns)
    assert all(d[0] is doc and m["text"] is doc and m["raw"] is blob for d, m in zip(kw["docs"], kw["meta"]))
    assert len({id(d) for d in kw["docs"]}) == len({id(m) for m in kw["meta"]}) == 3  # one list and dict a completion
    kw["docs"][0].append("mine")
    kw["meta"][0]["text"] = "mine"
    assert kw["docs"][1] == ["x" * 100_000, "short"] and kw["meta"][1]["text"] == doc and columns["docs"] == [doc, "short"]


def test_a_trl_reward_refused_when_loaded_is_told_what_to_change(tmp_path):
    # the hint said to rename a parameter `answer` whatever the cause: for a positional-only `completions` (TRL too
    # passes keywords only), and for a library function (trl.rewards.accuracy_reward's `solution`) that cannot be renamed
    f = tmp_path / "trl_m.py"
    f.write_text(TRL_MORE)
    with pytest.raises(BadInputError) as e:
        RewardSet.from_specs([f"{f}:positional"])
    assert "keywords" in e.value.hint and "`/`" in e.value.hint and "answer" not in e.value.hint
    RewardSet.from_specs([f"{f}:solution"])  # trl.rewards.accuracy_reward's `solution`: a dataset column now


def test_a_per_completion_reward_whose_completion_ids_has_a_default_is_not_trls(tmp_path):
    # f(text, answer, completion_ids=None) loaded as a per-completion reward until completion_ids alone made a reward
    # TRL-style: it was refused as a TRL reward missing `text`, told to "rename `text` to `answer`"
    f = tmp_path / "trl_m.py"
    f.write_text(TRL_MORE)
    rs = RewardSet.from_specs([f"{f}:shared", f"{f}:ids_by_default"])
    assert rs.specs[0].reward.batched is None and rs.specs[1].reward.batched is not None
    assert rs.score_group(["ab", "c"], None, "q", completion_ids=[[1, 2, 3], [4]]) == [
        ({f"{f}:shared": 2.0, f"{f}:ids_by_default": 3.0}, 5.0), ({f"{f}:shared": 1.0, f"{f}:ids_by_default": 1.0}, 2.0)]


def test_an_async_trl_reward_is_awaited_where_a_loop_already_runs(tmp_path):
    # rollout(cfg) from a Jupyter notebook (or any async caller): the reward's coroutine was run on the caller's thread,
    # where a loop already runs: "reward ... raised RuntimeError: Cannot run the event loop while another loop is running"
    import asyncio

    f = tmp_path / "trl_m.py"
    f.write_text(TRL_MORE)
    rs = RewardSet.from_specs([f"{f}:judged"])

    async def caller():
        return [rs.score_group(["4", "five"], "4", "q") for _ in range(2)]

    assert asyncio.run(caller()) == [[({f"{f}:judged": 1.0}, 1.0), ({f"{f}:judged": 0.0}, 0.0)]] * 2
    assert rs.score_group(["4"], "4", "q") == [({f"{f}:judged": 1.0}, 1.0)]
    loops = rs.specs[0].reward.fn.__globals__["loops"]
    assert len(loops) == 3 and loops[0] is loops[1] is loops[2]  # still one loop
    bad = RewardSet.from_specs([f"{f}:raises"])

    async def bad_caller():
        return bad.score_group(["a"], None, "q", where=" for p.jsonl:1")

    with pytest.raises(BadInputError) as e:  # what it raises is the user's, named where it raised
        asyncio.run(bad_caller())
    assert f"raised KeyError: 'gone' for p.jsonl:1 (at {f}:" in str(e.value) and ", in raises)" in str(e.value)


def test_a_trl_reward_whose_completion_ids_would_take_the_completion_is_trls(tmp_path):
    # f(completion_ids=None, answer=None, **kwargs) binds (completion, answer) with the text as its ids: it was loaded
    # as a per-completion reward and failed with "returned list '[...]', not a number"
    f = tmp_path / "trl_m.py"
    f.write_text(TRL_MORE)
    rs = RewardSet.from_specs([f"{f}:ids_and_answer"])
    assert rs.score_group(["ab", "c"], "4", "q", completion_ids=[[1, 2, 3], [4]]) == [
        ({f"{f}:ids_and_answer": 3.0}, 3.0), ({f"{f}:ids_and_answer": 1.0}, 1.0)]


def test_an_async_reward_that_exits_is_its_error_not_a_hang(tmp_path):
    # asyncio lets SystemExit out of the loop's run_forever: the loop's thread ended and the run waited forever
    import threading

    f = tmp_path / "trl_m.py"
    f.write_text(TRL_MORE)
    rs = RewardSet.from_specs([f"{f}:exits"])
    done = []
    t = threading.Thread(target=lambda: done.append(_outcome(lambda: rs.score_group(["a"], None, "q"))), daemon=True)
    t.start()
    t.join(10)
    assert done, "the reward's sys.exit() hung the call"
    assert isinstance(done[0], BadInputError) and "raised SystemExit: no judge" in str(done[0])
    assert f"(at {f}:" in str(done[0]) and ", in exits)" in str(done[0])
    judged = RewardSet.from_specs([f"{f}:judged"])  # the loop still serves the next reward
    assert judged.score_group(["4"], "4", "q") == [({f"{f}:judged": 1.0}, 1.0)]


def _outcome(call):
    try:
        return call()
    except BaseException as e:  # noqa: BLE001 - the test looks at it
        return e
