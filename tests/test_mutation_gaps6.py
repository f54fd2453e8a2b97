"""Tests that kill mutants of the gsm8k answer rule which survived tests/test_rewards.py and tests/test_eval.py
(manual mutation testing, round 8: qerl_cli/rewards.py as changed on 2026-11-27 -- the plain-integer fast path,
_next_operand, the value-changing words, heading labels, _hash_spans, the </think> cut, empty boxes, {,} / \\, and
math delimiters, _ASSIGNED).

Each pins a verdict a user would see (a reward of 1 or 0); each docstring names the mutant it kills."""

import pytest

from qerl_cli.answers import extract_answer, is_correct
from qerl_cli.gsm8k_numbers import _BOUNDS_BEFORE, _CHANGES_AFTER, _CHANGES_BEFORE


# ---- _next_operand: an operator and an operand after a #### line's number ----------------------
@pytest.mark.parametrize("line", ["#### 2 \\times 3", "#### 2 \\cdot 3", "#### 6 \\div 3", "#### 2 \u00b7 3",
                                  "#### 8 / (2 + 2)", "#### 10 - (2 + 3)"])
def test_a_hash_line_with_a_tex_or_bracketed_operation_is_no_answer(line):
    """Mutants: `\\times`, `\\cdot`, `\\div`, the middle dot or `/` dropped from _AN_OPERATOR, or the optional `(`
    dropped from _AN_OPERAND: the line then read as its first number (2, 6, 8, 10), so "#### 2 \\times 3" scored
    the reference 2 as right."""
    assert extract_answer(line) is None
    assert not is_correct(line, line.split()[1])
    assert extract_answer(line + "\n#### 7") == "7"  # a later plain line is the answer


def test_a_second_number_after_a_space_that_starts_with_a_point_is_no_answer():
    """Mutant: _A_NUMBER_START without its optional point (`\\d`): "#### 1 .5" read as 1."""
    assert extract_answer("#### 1 .5") is None


# ---- value-changing words -----------------------------------------------------------------------
@pytest.mark.parametrize("word", sorted(_CHANGES_BEFORE | _BOUNDS_BEFORE))
def test_each_word_that_changes_or_denies_the_number_before_it_makes_no_answer(word):
    """Mutants: any one word dropped from _CHANGES_BEFORE ("negative", "no", "half", ...), or the check made
    case-sensitive (`w` for `w.lower()`): "#### negative 5" / "\\boxed{\\text{No } 5}" then scored 5 right."""
    assert extract_answer(f"#### {word} 5") is None
    assert extract_answer(f"#### The answer is {word.upper()} 5") is None
    assert not is_correct(f"\\boxed{{\\text{{{word.capitalize()} }}5}}", "5")


@pytest.mark.parametrize("word", sorted(_CHANGES_AFTER))
def test_each_word_that_changes_the_number_after_it_makes_no_answer(word):
    """Mutants: any one word dropped from _CHANGES_AFTER ("halves", "dozens", "hundred", "million", "billion",
    "squared", "cubed", ...), or the check made case-sensitive: "#### 5 hundred" / "\\boxed{5 \\text{ squared}}"
    then scored 5 right."""
    assert extract_answer(f"#### 5 {word}") is None
    assert extract_answer(f"#### 5 {word.capitalize()} more") is None
    assert not is_correct(f"\\boxed{{5 \\text{{ {word}}}}}", "5")


def test_the_value_words_are_the_documented_ones():
    """Guards the sets themselves against a silently dropped word (a mutant of the literal)."""
    assert _CHANGES_BEFORE == {"negative", "minus", "not", "no", "half"}
    assert _BOUNDS_BEFORE == {"than", "least", "most"}
    assert {"halves", "dozen", "dozens", "hundred", "hundreds", "thousand", "thousands", "million", "millions",
            "billion", "billions", "trillion", "trillions", "squared", "cubed"} == _CHANGES_AFTER


# ---- heading labels --------------------------------------------------------------------------------
@pytest.mark.parametrize("label", ["Step", "Part", "Case", "Method", "Stage", "Phase", "Section", "step", "CASE"])
def test_each_heading_label_is_skipped_for_a_later_words_first_answer(label):
    """Mutants: any one word dropped from _HEADING_LABEL (case, method, stage, phase, section) or its IGNORECASE:
    "#### Case 2: ...\\n#### The answer is 18" then read 2."""
    text = f"#### {label} 2: split the eggs\nShe sells 9 at $2.\n#### The answer is 18"
    assert extract_answer(text) == "18"
    assert not is_correct(text, "2")


def test_a_heading_label_needs_its_number():
    """Mutant: _HEADING_LABEL without `\\s*\\d` (any line opening with "Step", "Section", ... skipped): "#### Section
    total: 18" then lost to a later note "#### Note: 7 eggs were broken"."""
    assert extract_answer("#### Section total: 18\n#### Note: 7 eggs were broken") == "18"


# ---- _leads_with_number / _hash_spans / reference_answer --------------------------------------------
@pytest.mark.parametrize(("text", "want"), [("#### .5\n\\boxed{7}", "0.5"), ("#### -.5\n\\boxed{7}", "-0.5")])
def test_a_hash_line_opening_with_a_point_number_leads_and_outranks_the_box(text, want):
    """Mutant: _leads_with_number without `.removeprefix(".")`: "#### .5" then counted as words-first and lost to a
    later box (7)."""
    assert extract_answer(text) == want


def test_a_reference_whose_hash_line_has_words_before_its_number():
    """Mutant: _after_hashes returning only the number-first line (`lead`, not `lead or words`): a reference
    "... #### Total: 72" then gave no number and was compared as text, so the right "#### 72" scored 0."""
    assert is_correct("#### 72", "Janet's total.\n#### Total: 72")


# ---- the </think> cut ---------------------------------------------------------------------------------
def test_only_what_follows_the_last_closed_think_counts():
    """Mutant: `text.find("</think>")` for `rfind`: with a second thinking block, its draft "#### 4" outranked the
    final "#### 5"."""
    text = "<think>draft #### 3</think> hmm <think>recheck #### 4</think>#### 5"
    assert extract_answer(text) == "5"
    assert not is_correct(text, "4")


# ---- the extraction chain --------------------------------------------------------------------------------
def test_the_box_outranks_the_answer_tag():
    """Mutant: (_answer_tag, last_boxed) swapped in extract_answer's chain: the documented order is box, then tag."""
    assert extract_answer("\\boxed{7} <answer>5</answer>") == "7"


@pytest.mark.parametrize("text", ["\\boxed{3 and 4}", "<answer>3 and 4</answer>", "<answer>3, 4 and 5</answer>"])
def test_a_box_or_tag_must_be_a_number_as_a_whole(text):
    """Mutants: the box's or the tag's `whole` True -> False: "\\boxed{3 and 4}" then read as 3."""
    assert extract_answer(text) is None
    assert not is_correct(text, "3")


def test_a_words_first_hash_line_only_has_to_start_with_its_number():
    """Mutant: the last link (words-first #### line) with `whole=True`: "#### The answer is 72 (48 + 24)" and
    "#### Total: 72 eggs, 3 of them broken" then gave no answer."""
    assert extract_answer("#### The answer is 72 (48 + 24)") == "72"
    assert extract_answer("#### Total: 72 eggs, 3 of them broken") == "72"


def test_a_box_that_is_no_number_falls_through_to_the_tag():
    """Mutant: the chain returning the first span's verdict even when it is None: "\\boxed{x} <answer>18</answer>"
    then scored 0 against 18."""
    assert is_correct("\\boxed{x} <answer>18</answer>", "18")


# ---- _clean_number_text ---------------------------------------------------------------------------------
def test_a_negative_thin_space_in_thousands_is_dropped():
    """Mutant: `.replace("\\\\!", "")` dropped: "1,\\!000" (MATH's own way to write 1000) then gave no answer."""
    assert is_correct("\\boxed{1,\\!000}", "1000")
    assert is_correct("#### 12,\\!500", "12500")


def test_math_delimiters_read_as_a_space_not_as_nothing():
    """Mutant: \\( \\) \\[ \\] replaced by "" rather than " ": "\\(2\\)\\(3\\)" then read as 23."""
    assert extract_answer("#### \\(2\\)\\(3\\)") is None
    assert not is_correct("\\boxed{\\(2\\)\\(3\\)}", "23")


def test_a_bracketed_number_after_a_bracket_is_a_product_not_unwrapped():
    """Mutant: the "(3) -> 3" unwrap without `)` in its lookbehind: "(2)(3)" then read as 23."""
    assert extract_answer("\\boxed{(2)(3)}") is None
    assert not is_correct("\\boxed{(2)(3)}", "23")


# ---- _ASSIGNED: several names assigned is no answer ---------------------------------------------------------
@pytest.mark.parametrize("box", ["\\boxed{x = 5; y = 18}", "\\boxed{x = \\sqrt{a} \\quad y = 18}",
                                 "\\boxed{x^2 = 4, y = 18}", "#### x = 5; y = 18"])
def test_several_assigned_names_are_no_answer(box):
    """Mutants: `;` dropped from _ASSIGNED's separators, `}` from its spaced-separator lookbehind, or the optional
    power after a name: "x = 5; y = 18", "x = \\sqrt{a} \\quad y = 18", "x^2 = 4, y = 18" then read as 18."""
    assert extract_answer(box) is None
    assert not is_correct(box, "18")


# ---- what may follow a #### line's number -----------------------------------------------------------------
@pytest.mark.parametrize("text", ["(so #### 72)", "#### 72: that is the total"])
def test_a_closing_bracket_or_a_colon_may_follow_the_number(text):
    """Mutants: `)` or `:` dropped from _GLUE_OK: "#### 72)" / "#### 72: ..." then gave no answer."""
    assert is_correct(text, "72")


def test_a_heading_label_alone_gives_no_answer():
    """Mutant (kept as the fix): _hash_spans returning `words` without the `or first` fallback. With the fallback a
    completion whose only #### line is a heading ("#### Step 3: add them", the answer in prose) was read as 3, so
    the reference 3 scored 1, against docs/merge-eval.md ("a Markdown heading `#### Step 1: ...` or `#### Part 2`
    gives no answer")."""
    text = "#### Step 3: add them\nJanet earns 18 dollars."
    assert extract_answer(text) is None
    assert not is_correct(text, "3")
    assert extract_answer("#### Part 2\n#### Section 4") is None
    assert extract_answer("#### Step 3: add them\n\\boxed{18}") == "18"
