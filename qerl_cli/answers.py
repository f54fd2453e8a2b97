"""Reading a completion's final answer, and judging it against a reference: the rules the ``gsm8k`` and ``math``
rewards score with and ``qerl eval`` counts as right (``extract_answer(text, kind)``, ``is_correct(completion,
reference, kind)``), one logic for both, so a training reward and an eval accuracy never disagree on what is right.

Why by hand: math-verify reads LaTeX answers and does the ``math`` kind's comparison, but GSM8K's final number is a
convention of the dataset, not of LaTeX (gsm8k_rule.py says why), and math-verify misreads some of what a policy writes
around a box (math_rule.py lists what is put in the form it reads).

This module is the rules' public face: the kinds, their versions, and the dispatch. Each kind's reading is its own
module's, whose docstring says what it reads and refuses:

- ``gsm8k`` (qerl_cli/gsm8k_rule.py): 1 if the final number equals the reference: the first ``####`` line that gives
  it, else the last ``\\boxed{}``, else the last ``<answer>`` tag, else a plain answer statement ("The answer is
  72."), each of which must *be* a number; hedges, ranges and bounds are no answer, and there is no "last number in
  the text" fallback. Its numbers (normalised, compared as exact fractions) are qerl_cli/gsm8k_numbers.py's.
- ``math`` (qerl_cli/math_rule.py): 1 if math-verify judges the last ``\\boxed{}`` (with the boxes listed or offered
  beside it), else the last ``<answer>`` tag, equivalent to the reference; verdicts cached, cut at 5 s.

Both read boxes and tags alike (qerl_cli/boxes.py). After a closed ``</think>`` only what follows it is read: a draft
answer inside ``<think>`` does not outrank the final one, and one inside a ``<think>`` never closed (a completion cut
short mid-thought) is no answer. A prompt that opens ``<think>`` and the stop strings that cut a tag are
qerl_cli/stops.py's.
Each kind's verdicts have a version (``RULE_VERSION``): a finished eval scored under another is scored again, as one
scored by ``math`` under other versions of the packages its verdicts come from (``rule_packages``).
"""

from __future__ import annotations

from qerl_cli.errors import BadInputError
from qerl_cli.gsm8k_numbers import _to_fraction
from qerl_cli.gsm8k_rule import gsm8k_answer, gsm8k_reference
from qerl_cli.math_rule import _math_verify_equal, math_answer, math_reference

ANSWER_KINDS = ("gsm8k", "math")
# The version of each answer rule's verdicts. Bump a kind's number with any change that can turn a verdict (an
# answer read that was missed, or one refused that was taken; not a speed-up or a refactor): a finished `qerl eval`
# records these in metrics.json, and a rerun of it under other numbers scores its samples again with today's rule
# (no generation) rather than print the old rule's score as "already done". tests/test_rewards.py pins each version's
# readings of a few completions. gsm8k 2 (2026-11-27): a quantity restated in another unit is one answer, a rounding
# note no range (4c76a7a), "18 dollars and 9 eggs sold" is 18; gsm8k 3: "The answer is 18." is 18; gsm8k 4: ">= 18",
# "~18", "18 times 2" are no answer, a statement is read to its sentence's end and not after a run-on's "Problem:";
# gsm8k 5: "about 18", "18 at most", "18 (approximately)" and "\boxed{5} and \boxed{7}" are no answer, "€18" is 18.
# math 2: boxes listed or offered together ("\boxed{-2} and \boxed{1}", "\boxed{72} or \boxed{73}") are one answer,
# "-2, 1" (was the last box, or none), unless they name two unknowns ("$x = \boxed{2}$ and $y = \boxed{3}$": the last
# box); "10\,000" is 10000 (was 0), "30°" and "\boxed{5.}" are read; without a box, the last <answer> tag (was none).
# An answer or reference over 1,000 characters is no answer (math_rule.MAX_MATH_ANSWER_CHARS).
# TeX spacing around the "or"/"and" between two boxes is a space ("\(x = \boxed{2}\) or \(x = \boxed{3}\)" was 3), and
# "\hspace{}" is (s57r08); boxes or tag spans side by side ("\boxed{3} \boxed{4}", "<answer>$3$ $4$</answer>") are
# "3, 4" (was 4); "\boxed{3 = 4}" is no answer (was 4); "\text{5 cm}", "0.\overline{3}", "1.5e3", "\textbf{(C)}\ 12"
# (the letter or the value, as the reference gives) and "x > 2" against "(2, \infty)" are read (were 0).
# s57r14: an answer math-verify would cut as its unit past a second value or a hedge ("5\text{ cm}, 6\text{ cm}",
# "5\text{ or 6}", was 5) is none, as is a false equation of arithmetic or in a chain ("2 + 1 = 4", "x = 3 = 4", was 4);
# TeX spacing and text groups between two tag spans read as between two boxes ("$3$ \quad $4$" is "3, 4", was 4).
# s58r05: a run of tag spans is one answer ("<answer>$1$ $2$ $3$</answer>" was "2, 3", "The answer is $3$ or maybe $4$"
# was 3); a slash, "\enspace"/"\hfill" or bold between boxes lists them (was the last); "5\text{ thousand}" is 5000 and
# "\text{5 squared}", "5\text{ pi}", "\text{5 is wrong}" no answer (were 5); "\frac13 = 0.333" is 1/3 or 0.333 (was
# none), "\sqrt{2} = 1.5" none (was 1.5).
# s58r08: the decimal beside an exact value answers a decimal reference only ("\frac13 = 0.3" was right against
# \frac{3}{10}); an equation of exact numbers that differ is none ("\sqrt{2} = 5" was 5); degrees in an equation are
# radians ("\sin 30^\circ = 0.5", none since s58r05); "5\text{ hundreds}" is 500, "5\text{ twelfths}" none (were 5).
# s59r03: a semicolon, bar, "vs", "\kern" or underline between boxes lists them ("\boxed{2}; \boxed{3}" was 3);
# "1,000\text{ thousand}" is a million (was none); "5\text{ dozen}" is 5 or 60 (was 5); "\frac13 = 0.333\ldots" is
# 1/3 (was none); "\text{A, C}" is the letters (was one symbol); "<answer>The answer is $3$. Actually, it is $4$."
# is none (was 3).
# s59r09 (review of s59r03): "\textit{A, C}" against "\text{A, C}" is right again; "5\text{ dozen plus one}" is none
# (was 5 or 60); "\frac23 = 0.66\ldots" is 2/3 only (was 0.66 too), "1 + 0.5 + 0.25..." none (was 1.75); a tag's
# "$3$ rather than $4$" is 3 (was none), "On second thought, it is $4$" none (was 3), "$x = 3$; $y = 4$" is "y = 4"
# (was both); gsm8k: "The answer is 18. Actually, it is 19." is none (was 18).
# s59r14: punctuation between boxes lists them ("\boxed{2} \mid \boxed{3}", "||", a dash, "(or)": was 3), as
# does a colour, overline or size around each ("\textcolor{red}{\boxed{2}} \textcolor{red}{\boxed{3}}": was 3); a take-
# back or a value offered after the last box ("\boxed{3}. Actually, it is 4.", "\boxed{3} or 4", "4 or \boxed{3}") is
# none (was 3); gsm8k: a take-back after a #### line, box or tag ("#### 18\nWait, no, it is 19") is none (was 18), as are
# "\boxed{18} or 19" and two boxes with TeX or punctuation between ("\boxed{2}; \boxed{3}", "\text{ or }": was the last).
# math 3 and gsm8k 6 (2026-11-28): s59r03, s59r09 and s59r14 above, one version since none of them landed apart.
# math 2 had taken several sessions' landed changes unbumped ("unreleased"), which left an eval finished in between
# "already done" with old verdicts: each kind is bumped now with any landed change of verdict, as this comment says.
# math 4 and gsm8k 7 (review s60r02): words between two boxes that deny the later one ("\boxed{3}, not \boxed{4}",
# "(not \boxed{4})", "rather than") give the box before, 3 (was 4); a box that only dresses another
# ("\boxed{\boxed{2}} \boxed{\boxed{3}}") is that one's: math "2, 3" (was 3); gsm8k "\boxed{\boxed{18}}" is 18 (none in 6).
# Review s60r07, before math 4 / gsm8k 7 were released, so in them: a denied box's name is no words ("$x = \boxed{3}$, not
# $x = \boxed{4}$" is 3, was 4), nor is a run of denials cut at 16; a box inside a box holding more is part of it, the
# box around the answer ("\boxed{\boxed{2} + 1}" is "2 + 1", was 2 under math 3).
# Review s60r13, still in math 4 / gsm8k 7: a unit or "is the answer" between the box and the denial, "- not -",
# "(_not_ ...)", "though not" and "which is not" deny too ("\boxed{18} dollars, not \boxed{19}" is 18, was 19); two
# boxes said to differ ("\boxed{3} \neq \boxed{4}", "is not") are none (was 4); math: a denied box is none of the list
# before it ("\boxed{-5}, \boxed{5} (rejecting \boxed{-5})" is 5, was "-5, 5"), and boxes listed after a denial are
# none ("\boxed{18}, not \boxed{19}, \boxed{20}", was "19, 20"). Review s60r16, still in them: a box whose value a
# denial only repeats ("\boxed{25}, not \boxed{25}\%") is the answer again (none from s60r13), and a verb rejecting the
# box ("\boxed{3} failed, not \boxed{4}") is no unit (3 from s60r13, 4 again).
RULE_VERSION = {"gsm8k": 7, "math": 4}
# The math rule's verdicts are math-verify's, which reads LaTeX with latex2sympy2_extended and compares in sympy: a
# release of any of them may turn a verdict (how a set, an interval or 0.333333 compares) that RULE_VERSION, qerl's own
# changes, does not count. Their versions are recorded beside it (metrics.json's ``scorer_packages``).
MATH_RULE_PACKAGES = ("math-verify", "latex2sympy2_extended", "sympy")


def rule_packages() -> dict[str, str | None]:
    """The installed version of each package the math rule's verdicts come from (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in MATH_RULE_PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def extract_answer(text: str, kind: str = "gsm8k") -> str | None:
    """The answer a completion gives, or None when it gives none.

    ``gsm8k``: normalised number of the first ``####`` line that starts with it or names the answer before it ("####
    The answer is 72", or the line under "#### Final Answer"), else in the last ``\\boxed{}``, else in the last
    ``<answer>`` tag, else after words on the first ``####`` line that is no heading label ("#### Step 1:"), else of
    the first numbered heading ("#### 1. Understand the problem"), else of the last plain answer statement ("The
    answer is 72.", "**Final Answer:** 72") after them (gsm8k_answer).
    ``math``: the raw content of the last ``\\boxed{}``, joined by ", " with the boxes listed or offered beside it
    (math_boxes); without a box, the last closed ``<answer>`` tag's (_math_tag). After a closed ``</think>`` only what
    follows it counts, and
    nothing after a ``<think>`` left open.
    """
    think_end = text.rfind("</think>")
    if think_end >= 0:  # the format reward's layout: a draft "\boxed{70}" or "#### 70" inside <think> is no answer
        text = text[think_end + len("</think>"):]
    think_open = text.find("<think>")
    if think_open >= 0:  # a <think> never closed (cut short mid-thought): a draft inside it is no answer either
        text = text[:think_open]
    if kind == "gsm8k":
        return gsm8k_answer(text)
    if kind == "math":
        return math_answer(text)
    raise BadInputError(f"unknown answer kind {kind!r} (known: {', '.join(ANSWER_KINDS)})")


def reference_answer(reference: str, kind: str = "gsm8k") -> str | None:
    """Normalise a dataset's reference: a GSM8K solution (``... #### 72``) gives ``72``.

    For ``gsm8k`` a bare reference must *be* a number (units after a space allowed: ``18 dollars``);
    ``x^2`` or ``2x`` give None, so they are compared as text instead of as the number 2.
    """
    if reference is None:
        return None
    reference = str(reference)
    if kind == "gsm8k":
        return gsm8k_reference(reference)
    if kind == "math":
        return math_reference(reference)
    raise BadInputError(f"unknown answer kind {kind!r} (known: {', '.join(ANSWER_KINDS)})")


def is_correct(completion: str, reference: str | None, kind: str = "gsm8k") -> bool:
    """Whether ``completion``'s extracted answer equals ``reference`` (see ``extract_answer``)."""
    if reference is None:
        return False
    pred = extract_answer(completion, kind)
    if pred is None:
        return False
    if kind == "gsm8k":
        gold = reference_answer(reference, "gsm8k")
        if gold is None:  # a non-numeric reference: compare text
            return pred.strip() == str(reference).strip()
        a, b = _to_fraction(pred), _to_fraction(gold)
        return a is not None and a == b
    gold = reference_answer(reference, "math")
    return _math_verify_equal(gold, pred)
