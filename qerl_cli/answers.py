"""Reading a completion's final answer, and judging it against a reference: the rules the ``gsm8k`` and ``math``
rewards score with and ``qerl eval`` counts as right (``extract_answer(text, kind)``, ``is_correct(completion,
reference, kind)``), one logic for both, so a training reward and an eval accuracy never disagree on what is right.

Why by hand: math-verify reads LaTeX answers and does the ``math`` kind's comparison, but a GSM8K-style final number
("#### 72", "The answer is $72.", a hedge, a range, a unit) is a convention of the dataset, not of LaTeX; a reward
that takes "the last number in the text" rewards rambling that ends on the right number. The kinds:

- ``gsm8k``: 1 if the final number equals the reference. The number is the one of the first
  ``####`` line that starts with its number or names the answer before it ("#### 72", "#### The answer is 72",
  "#### Final Answer: 72", or a heading "#### Final Answer" with the number on the next line, "- 72" there a list
  item, not -72; a base model that runs on past its answer and starts another "Q: ... ####" is still judged on the
  answer it gave), else the last
  ``\\boxed{}``, else the last ``<answer>...</answer>``, else a ``####`` line's number after other words (the first
  such line that is no heading label "#### Step 1:", "#### Part 2": "#### Add the 3 eggs" does not outrank the box),
  else a numbered heading's number ("#### 1. Understand the problem" is 1 only where nothing else gives an answer;
  "#### 18. She makes $18" says its number twice and is 18), which must each *be* a number (words allowed):
  ``\\boxed{2\\sqrt{2}}``, ``\\boxed{2^{10}}`` and ``2x`` do not pass for 2, a reward-hacking
  door otherwise. Numbers are normalised (``$`` and other currency signs as it, ``€18``, ``18€``, ``£18``, thousands
  commas in groups of three, units, ``%``, degrees, trailing ``.0``, ``\\frac`` incl. mixed and nested, unicode minus)
  and compared as exact fractions, so ``0.5 == 1/2`` and ``1,000 == 1000.00``; over 100 digits is no answer. A ``####``
  line's number that an operand or another number follows (``10 - 2``, ``1 000 000``, ``3:30``), a number with a
  word that changes or denies it (``2 dozen``, ``minus 5``, ``not 5``, ``at least 5``, ``>= 5``, ``~5``), an
  approximation or a bound on either side of it (``about 5``, ``over 5``, ``5 at most``, ``5 (approximately)``), an
  operator in words (``5 times 2``, ``5 plus 2``), a hedge (``72 or 73``, ``72 or
  so``, ``72 apples or 73 apples``; not the number restated, ``72 (or 72.0)``, nor the same quantity in another unit,
  ``90 (or 1.5 hours)``, ``3 hours (180 minutes)``, ``90 minutes (1 hour 30 minutes)``), a range or a second number
  (``72 to 73``, ``72 and 3/4``, ``3 hours 30 minutes``; not a rounding note, ``72.5, to 1 decimal place``, nor a
  number of another thing after "and", ``18 dollars and 9 eggs sold``), a hedge
  across two boxes (``\\boxed{72} or \\boxed{73}``) and two different boxes listed by "and" or a
  comma (``\\boxed{72} and \\boxed{73}``, ``\\boxed{72}, \\boxed{73}``: gsm8k's reference is one number) are no answer. A bare ``\\boxed`` before a word or punctuation is prose ("I put it in \\boxed as asked"), not a box.
  Last of all, a plain-prose answer statement, an instruct model's default without a "####"/box instruction:
  the last sentence that starts with the answer phrase ("The answer is 72.", "**Final Answer:** 72", "Therefore, the
  final answer is: $72", a "So"/"No," lead allowed) and gives the number right after it, read as a ``####`` line's
  (the same cleaning and refusals); one that denies, bounds or hedges ("The answer is not 72", "between 72 and 73",
  "72 or 73"), asks ("Is the answer 72?", "What is the answer? 72"), or comes before a later box, ``<answer>`` tag,
  ``####`` line or a run-on's next question ("Question:", "Problem:", "**Question 2:**", "Q.") is no answer; it is
  read to its sentence's end ("The answer is 6 + 12 = 18. So 18 - 3 = 15." is 18).
  Deliberately *no* "last number in the text" fallback: it rewards rambling that happens to end
  on the right number and teaches nothing about answering. After a closed ``</think>`` only what follows it is
  read (here and in ``math``): a draft answer inside ``<think>`` does not outrank the final one, and one inside a
  ``<think>`` never closed (a completion cut short mid-thought) is no answer.
- ``math``: 1 if math-verify judges the last ``\\boxed{}`` equivalent to the reference (symbolic:
  ``\\frac{1}{2}`` vs ``0.5``, intervals, sets), with the boxes listed or offered beside it as one answer
  (``\\boxed{-2} and \\boxed{1}``, ``$x = \\boxed{-2}$, $x = \\boxed{1}$``, ``\\boxed{72} or \\boxed{73}``
  read as ``-2, 1``, a set: right for a reference of two solutions, wrong for one of either); TeX math-verify misreads
  is put in the form it reads: a thin space or space between digit groups (``10\\,000``, read as 10 * 000 = 0),
  ``30°`` and ``30\\degree`` (no answer), a full stop inside the box (``\\boxed{5.}``, ``\\boxed{(1, 2).}``). Boxes
  naming two unknowns (``$x = \\boxed{2}$ and $y = \\boxed{3}$``, ``$3x = \\boxed{12}$, $x = \\boxed{4}$``) are no list:
  the last box (a hedge, ``$x = \\boxed{3}$ or $y = \\boxed{4}$``, still is one answer). Without a box, the last closed ``<answer>`` tag is read (R1-Zero's layout, as gsm8k reads it): its
  content as a box's (``5``, ``\\frac{1}{2}``, ``$\\frac12$``), or, words around math (``The answer is $\\frac12$.``),
  what math-verify's LaTeX extraction reads from it (two spans offered as a hedge, ``$3$ or maybe $4$``, as two
  boxes: ``3, 4``; a lone ``$18`` is currency); words alone (``The answer is 5``) are no answer. Slower (sympy,
  ~10 ms a verdict), so verdicts are cached per (reference, answer): the G completions of a group mostly repeat a
  few answers. Each parse and
  comparison is cut at 5 s (scored 0) on the main thread only: math-verify's timeout is SIGALRM, so scored
  from another thread a verdict has no time limit (a ``QerlWarning`` says so, once).

A prompt that ends inside a ``<think>`` it opened (QwQ's and DeepSeek-R1's chat templates end the generation prompt
with ``<think>\n``) gets completions without the opening tag: rollout and eval score ``"<think>" + completion``
(``judged_completion``), so every reward judges the turn the model wrote (a draft answer before a ``</think>`` that
never came is no answer; ``format`` finds its opening tag). The stored completion is never changed.
Each kind's verdicts have a version (``RULE_VERSION``): a finished eval scored under another is scored again, as one
scored by ``math`` under other versions of the packages its verdicts come from (``rule_packages``).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import warnings
from collections.abc import Callable, Iterator
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from qerl_cli.errors import BadInputError, QerlWarning

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
# An answer or reference over 1,000 characters is no answer (MAX_MATH_ANSWER_CHARS).
# TeX spacing around the "or"/"and" between two boxes is a space ("\(x = \boxed{2}\) or \(x = \boxed{3}\)" was 3).
RULE_VERSION = {"gsm8k": 5, "math": 2}
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


# ---- a prompt that opens <think> ----------------------------------------------------------------
THINK_OPEN = "<think>"


def prompt_opens_think(prompt_text: str) -> bool:
    """Whether a rendered prompt ends (whitespace aside) with an opening ``<think>``: its completion starts inside
    that block and holds no opening tag of its own. The end only: a ``<think>`` a user message mentions is not one."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


def judged_completion(completion: str, opens_think: bool) -> str:
    """The text rewards judge: the completion, after the ``<think>`` its prompt opened (``prompt_opens_think``)."""
    return THINK_OPEN + completion if opens_think else completion


THINK_CLOSE = "</think>"
# A stop that takes the opening tag cuts a completion's answer inside it away (every rule loses it); one that takes
# only the closing tag leaves the content, where the gsm8k rule reads a tag's number only when closed.
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"


def stop_takes_tag(stop: str, tag: str) -> bool:
    """Whether a stop string takes ``tag`` out of the text it cuts (the text ends where the stop first appears): one
    inside the tag fires at it, if not earlier ("answer" at the word in prose), one holding it (``"</answer>\n"``) cuts
    it wherever it fires, and one that overlaps the tag's start or end with only whitespace beyond it (``"\n<answer"``,
    ``">\n"``) fires at it wherever a completion spaces its tags so (``"</think>\n<answer>"``, R1-style), cutting it
    (missed until 2026-11-28). An overlap with other text beyond (``">>>"``) fires at a tag only where a completion
    writes that text beside it, so it is left alone."""
    if stop in tag or tag in stop:
        return True
    return any((stop.endswith(tag[:k]) and not stop[:-k].strip()) or (stop.startswith(tag[-k:]) and not stop[k:].strip())
               for k in range(1, len(tag)))


def stop_taking(stops, tags) -> tuple[str, str] | None:
    """(the first of ``stops`` that takes one of ``tags`` out of the text it cuts, that tag), or None."""
    return next(((x, t) for x in stops for t in tags if stop_takes_tag(x, t)), None)


def every_stopped(stop: str, tag: str, noun: str = "completion") -> str:
    """Which completions a stop that takes ``tag`` costs it: every one where the stop lies inside the tag (it fires
    there if not earlier), else every one it stops (one holding or overlapping the tag may fire elsewhere only)."""
    return f"every {noun}" if stop in tag else f"every {noun} it stops"


def think_stop(stops, prompts) -> tuple[str, str, object | None] | None:
    """A stop that leaves the answer rules (gsm8k and math read nothing after a ``<think>`` left open) nothing to read
    in the text it cuts, as (stop, tag, prompt), the prompts rendered (``EncodedPrompt.opens_think``):

    - (stop, ``</think>``, a prompt that opens ``<think>``): every completion of it is judged inside it, all 0;
    - (stop, ``</think>``, None): no prompt opens one, so only a completion that opens its own is left inside it;
    - (stop, ``<think>``, a prompt that does not open it): a completion of it that opens its own ``<think>`` is cut
      there, before its answer (a prompt that opens it has completions without the tag: harmless).

    None: no such stop. One stop that takes both tags (``"think>"``) is judged by ``</think>`` (one finding, the
    graver)."""
    closing = stop_taking(stops, (THINK_CLOSE,))
    if closing is not None:
        return (*closing, next((p for p in prompts if p.opens_think), None))
    opening = stop_taking(stops, (THINK_OPEN,))
    unopened = next((p for p in prompts if not p.opens_think), None)
    return (*opening, unopened) if opening is not None and unopened is not None else None


def blank_stop(stops, prompts) -> tuple[str, object] | None:
    """A stop made only of whitespace (``$'\\n\\n'``, ``$'\\n'``: a base model's few-shot stop) and a prompt that
    opens ``<think>`` (``EncodedPrompt.opens_think``), as (stop, prompt), or None. Such a stop fires at the first
    line break or blank line of a completion of that prompt, which lies in its thought, so the text judged is left
    inside the ``<think>``, where the answer rules read nothing and the format reward finds no ``</think>``: a score
    of 0 (unsaid until 2026-11-28). A thought without such a break escapes it, so the score can be nonzero: a
    warning, not a refusal. Where no prompt opens ``<think>``, a completion that writes none is not cut in one."""
    x = next((x for x in stops if not x.strip()), None)
    prompt = next((p for p in prompts if p.opens_think), None) if x is not None else None
    return (x, prompt) if prompt is not None else None


# ---- extraction ------------------------------------------------------------------------------
_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_BARE_TOKEN = re.compile(r"[^\s$]+")
# What follows a bare \boxed in prose, not an argument: a word ("I put it in \boxed as asked") or punctuation ("in
# \boxed."). Read as the last box, it hid the answer boxed before it. A letter ("\boxed x"), a number or a command
# ("\boxed\pi") stays an argument.
_PROSE_TOKEN = re.compile(r"[A-Za-z]{2,}[^\w\\]*|[^\w\\]+")


def _closing_braces(text: str) -> dict[int, int]:
    """Index of each ``{`` -> index of its matching ``}`` (unclosed ones absent), in one pass. An escaped brace
    ``\\{`` is a literal one, no group: ``\\boxed{\\left\\{ ... \\right.}`` (a piecewise answer) closed on its
    ``\\{`` and was no box; ``\\\\{`` (a TeX line break, then a group) still opens one."""
    stack, pairs = [], {}
    escaped = False
    for j, ch in enumerate(text):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == "{":
            stack.append(j)
        elif ch == "}" and stack:
            pairs[stack.pop()] = j
    return pairs


def _boxes_from_last(text: str) -> Iterator[tuple[str, int, int]]:
    """(content, start, end) of each closed ``\\boxed{...}`` (or ``\\fbox{...}``, or a bare ``\\boxed 5``) with content,
    the last first, braces matched (see last_boxed)."""
    pairs = None
    for m in reversed(list(_BOX.finditer(text))):
        i = m.end()
        if i < len(text) and text[i] == "{":
            if pairs is None:
                pairs = _closing_braces(text)
            j = pairs.get(i)
            if j is not None and text[i + 1 : j].strip():  # an empty box is the prompt's "within \boxed{}" echoed
                yield text[i + 1 : j].strip(), m.start(), j + 1
        else:  # "\\boxed 5": TeX allows a single token without braces
            tok = _BARE_TOKEN.match(text, i)
            if tok and _PROSE_TOKEN.fullmatch(tok.group(0)) is None:
                yield tok.group(0).strip(), m.start(), tok.end()


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched; None if absent.

    Linear time: a degenerate completion repeating ``\\boxed{`` thousands of times must not cost
    seconds per reward (a naive scan per match is quadratic). An unclosed box (generation cut
    off) is not an answer, nor is an empty one (a base model running on echoes the prompt's "put your final
    answer within \\boxed{}"); the last closed one with content counts.
    """
    return next((box for box, _, _ in _boxes_from_last(text)), None)


# What between two boxes offers the second as an alternative to the first: "\boxed{72} or \boxed{73}", "$\boxed{72}$,
# or maybe $\boxed{73}$" (a hedge on one line). The last box alone read as the answer: 73 was rewarded.
# A new line, or "or rather", is a correction ("\boxed{72}.\nOr rather, rechecking: \boxed{73}"), not a hedge.
_BOX_HEDGE = re.compile(r"[ \t$.,;:)\]*]*(?:and/)?or\b(?!\s+rather\b)[^\n]{0,40}", re.IGNORECASE)


# What between two boxes lists them as two answers: "\boxed{5} and \boxed{7}", "$\boxed{5}$, $\boxed{7}$",
# "\[\boxed{5}\]\nand\n\[\boxed{7}\]". A gsm8k reference is one number: the last of two answers read as the answer
# rewarded whichever the model listed second (7 here). Words around the "and", as around a hedge's "or", leave the last
# box the answer: an intermediate boxed on the way ("\boxed{5} left, and the total is \boxed{7}"), or one quantity in
# two units ("\boxed{90} minutes and \boxed{1.5} hours"); a new line alone is a correction.
_BOX_LIST = re.compile(r"[\s$)\]*\\]*(?:,(?:\s*and\b)?|and\b|\\text\{\s*and\s*\})[\s$(\[*\\]*", re.IGNORECASE)


def final_box(text: str, same: Callable[[str, str], bool], lists: bool = False) -> str | None:
    """last_boxed, unless the box before it was offered as the other answer of a hedge ("\\boxed{72} or
    \\boxed{73}"), or with ``lists`` listed beside it ("\\boxed{5} and \\boxed{7}": gsm8k's one-number answers), and
    is not ``same`` as it ("\\boxed{72} or \\boxed{72.0}" still answers 72): then None."""
    boxes = _boxes_from_last(text)
    last, before = next(boxes, None), next(boxes, None)
    if last is None:
        return None
    if before is None:
        return last[0]
    hedged = _BOX_HEDGE.fullmatch(text, before[2], last[1]) or (lists and _BOX_LIST.fullmatch(text, before[2], last[1]))
    if hedged and not same(before[0], last[0]):
        return None
    return last[0]


# More boxes listed than any answer holds ("\boxed{1}, \boxed{2}, ..." repeated): no answer.
MAX_LISTED_BOXES = 16
# What names a box, before its "=": "$x = \boxed{-2}$", "\(x_1=\boxed{1}\)", "$3x = \boxed{12}$", "$f(2) = \boxed{5}$".
_BOX_NAME = re.compile(r"([^\s$=,;:(\[]+)\s*=\s*[$(\[\\]*$")
# The unknown a name gives a value of: one letter or a Greek letter's command, with its subscript ("x_1" and "x_2" are two
# solutions for x; "$\theta = \boxed{30^\circ}$, $\theta = \boxed{150^\circ}$" two for theta, read as the last alone).
_UNKNOWN = re.compile(r"(?<![\w\\])(?:[A-Za-z]|\\(?:var)?(?:alpha|beta|gamma|delta|epsilon|zeta|eta|theta|iota|kappa|lambda|mu|nu|"
                      r"xi|rho|sigma|tau|upsilon|phi|chi|psi|omega|Gamma|Delta|Theta|Lambda|Xi|Sigma|Phi|Psi|Omega))"
                      r"(?=(?:_\{?\w+\}?)?$)")
# A name is a variable's only when it is the whole left side, bold aside ("**x"): "a+b" is no "b", nor, across a space
# (which ends _BOX_NAME's name), "\tan \theta" a "\theta", "\sin x", "2 x" or "x + y" an "x" or "y". Read as the unknown,
# "$\tan \theta = \boxed{1}$, $\theta = \boxed{\frac{\pi}{4}}$" was one unknown's two values, "1, \frac{\pi}{4}",
# and a right answer scored 0 (a review). What glues: a function or a product's command, a number (a subscript's too,
# "\log_2 x", "\log_{10} x") or an operator; not words, a spacing or a relation ("\quad x_2", "\implies x", "so x").
# Nor are they when nothing spaces them off, so they lead the name, not start it: "**x", "\text{so}~x", "}x" (of
# "\text{so }x": the space splits the group), "答：x". Only "**" led until a review: "\text{so }x = \boxed{2} and
# x = \boxed{3}" named "}x" and "x", two unknowns, and the list of one unknown's two values read as the last alone.
_NAME_LEAD = re.compile(r"(?:\*|~|\}|\\(?:text|textrm|textbf|textit|mbox)\s*\{[^{}]*\}|[^\x00-\x7f])*")
_NAME_GLUED = re.compile(r"(?:\\(?:(?:arc)?(?:sin|cos|tan|cot|sec|csc)h?|log|ln|lg|exp|det|cdot|times|div|pm|mp|pi)"
                         r"|_\{\w+\}|[\d+\-/^])[ \t]+$")


def _box_name(text: str, box_start: int) -> tuple[int, str] | None:
    """(where it starts, its unknown) of the name given to the box at ``box_start``: the unknown is the letter of a
    variable's name ("x", "**x", "x_2"), else the whole name ("3x", "2)" of "f(2)", "a+b"), with what it is glued to
    across a space ("\\tan \\theta", "2 x": _NAME_GLUED). A name is short: searched near the box."""
    m = _BOX_NAME.search(text, max(0, box_start - 40), box_start)
    if m is None:
        return None
    glued = _NAME_GLUED.search(text, max(0, m.start(1) - 40), m.start(1))
    if glued is not None:  # "\tan \theta": the whole left side is the name
        return glued.start(), text[glued.start() : m.end(1)]
    unknown = _UNKNOWN.match(m.group(1), _NAME_LEAD.match(m.group(1)).end())
    return (m.start(1), m.group(1)) if unknown is None else (m.start(1) + unknown.start(), unknown.group(0))


def _is_unknown(name: str) -> bool:
    """Whether a box's name (_box_name's) is a variable's, not a whole expression's ("3x", "2)", "4")."""
    return _UNKNOWN.fullmatch(name) is not None


# TeX that only spaces or delimits the words between two boxes: "\(x = \boxed{2}\) or \(x = \boxed{3}\)",
# "x = \boxed{2} \quad\text{or}\quad x = \boxed{3}", "\boxed{2}~\text{and}~\boxed{3}". Left in, the "or"/"and" read
# as words around the boxes, no hedge or list: the last box alone, a hedge rewarded for its second value (a review).
_SEPARATOR_TEX_SPACE = re.compile(r"\\q?quad(?![A-Za-z])|\\[,;:! ()\[\]]|~")
# Any text group: "\quad\mathrm{or}\quad" and "\textbf{or}" hedge as "\text{or}" does (only \text{} read until a review:
# their hedge was the last box alone, rewarded for its second value).
# A TeX text group of one of these commands, its content captured (the gsm8k rule's `_LATEX_TEXT` too).
_TEXT_GROUP = r"\\(?:{})\s*\{{([^{{}}]*)\}}"
_SEPARATOR_TEX_TEXT = re.compile(_TEXT_GROUP.format("text|textrm|textnormal|textbf|textit|mathrm|mbox"))


def _plain_separator(between: str) -> str:
    """The words between two boxes with their TeX spacing and ``\\text{}`` groups taken off (the math rule's only:
    the gsm8k rule's verdicts are released as they stand)."""
    return _SEPARATOR_TEX_SPACE.sub(" ", _SEPARATOR_TEX_TEXT.sub(r" \1 ", between))  # "\quad\text{or}": not "\quador"


def math_boxes(text: str) -> str | None:
    """The math rule's answer: the last box, with the boxes listed or offered beside it ("\\boxed{-2} and \\boxed{1}",
    "$x = \\boxed{-2}$, $x = \\boxed{1}$", "\\boxed{72} or \\boxed{73}") joined into one ("-2, 1"), as math-verify joins
    them: a reference of two solutions, "1, -2", was scored against the last box alone (0), and a one-value
    reference, "1", rewarded the second of two answers listed. A list of one answer restated ("\\boxed{\\frac12} or
    \\boxed{0.5}") is that answer; a correction on a new line or after other words is not a list, nor are boxes named
    as values of two unknowns ("$x = \\boxed{2}$ and $y = \\boxed{3}$": one of them may be what the question asks,
    "$3x = \\boxed{12}$, $x = \\boxed{4}$": a step and the answer)."""
    boxes = _boxes_from_last(text)
    last = next(boxes, None)
    if last is None:
        return None
    listed, start = [last[0]], last[1]
    name = _box_name(text, start)
    for box, box_start, end in boxes:
        if len(listed) > MAX_LISTED_BOXES:  # a degenerate run of boxes: one verdict each below would cost seconds
            return None
        named = name is not None and name[0] >= end and _is_unknown(name[1])  # a variable's name between the two
        between = _plain_separator(text[end : name[0] if named else start])
        hedged = _BOX_HEDGE.fullmatch(between)
        if not (hedged or _BOX_LIST.fullmatch(between)):
            break
        earlier = _box_name(text, box_start)
        if named and not hedged and earlier is not None and earlier[1] != name[1]:
            # "$x = \boxed{2}$ and $y = \boxed{3}$", "$3x = \boxed{12}$, $x = \boxed{4}$": values of two unknowns. A
            # list only: "$x = \boxed{3}$ or $y = \boxed{4}$" is a hedge (read as 4 until a review, though math 1
            # refused it), one answer "3, 4", wrong for either
            break
        listed.append(box)
        start, name = box_start, earlier
    if all(_math_verify_equal(box, last[0]) for box in set(listed) - {last[0]}):
        return last[0]
    return ", ".join(reversed(listed))


_DIGIT = re.compile(r"\d")
# A number longer than this is degenerate output, not an answer (and int() refuses 4300+ digits).
MAX_NUMBER_DIGITS = 100
# \frac arguments that are numbers: {1}, {-2.5}, {1/2} (an inner \frac already evaluated), or one
# digit without braces (\frac12, \frac{1}2: TeX takes a single token).
_FRAC_ARG = r"(?:\{\s*(-?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?)\s*\}|(\d))"
# A whole number glued before it makes a mixed number (1\frac{1}{2}, 3\frac12 = 3.5), matched in the same left-to-right
# scan: a separate pass for mixed numbers took the digits of a braceless \frac12 before it for a whole part.
_LATEX_FRAC = re.compile(rf"(?:(?<![\d.])(-?)(\d+)\s*)?\\[dt]?frac\s*{_FRAC_ARG}\s*{_FRAC_ARG}")
_LATEX_TEXT = re.compile(_TEXT_GROUP.format("text|textbf|textrm|textnormal|mathrm|mathbf|mbox"))
# "(?:\{\s*)?", not "\{?\s*": two \s* around an optional brace split one run of spaces every way, O(n^2) on a
# "^" followed by n spaces (80,000 on a #### line held one reward for 18 s)
_DEGREES = re.compile(r"\^\s*(?:\{\s*)?\\circ\s*\}?|\u00b0|\\degree")
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\s*/\s*-?\d+(?:\.\d+)?)?")  # not glued: "x1", "a.1"
# Words around a number in an answer span: "The answer is 72 apples." Checked token by token, not by
# one regex: nested optional whitespace backtracked for seconds on a reference of 1,500 spaces.
# Units count as words: "km/h", "ft^2", "cm^{3}" (a power only on a word: "10 ^{2}" is no 10).
_WORD = re.compile(r"[A-Za-z][A-Za-z'./-]*(?:\^\{?\d\}?)?")
# Names an equation assigns: "x = 5, y = 18" (two answers) against "n^2 = 25, n = 5" (one).
_ASSIGNED = re.compile(r"(?:^|[,;]|(?<=[\d}])\s|\band\b)\s*([A-Za-z]\w*)(?:\^\{?\d+\}?)?\s*=")  # "x=5 \quad y=18" too
# TeX spacing between a number and its unit: "18\ \text{dollars}", "18\;", "18\quad", "18~km".
_TEX_SPACE = re.compile(r"\\(?:[ ;:>]|q?quad\b)|~")
# A "~" with a space or nothing before it and a number after it is "approximately": "The answer is ~18" read as 18, where
# "about 18", "\approx 18" and "\sim 18" are no answer (a review). Made a "\u2248", which no rule reads as a word.
_APPROX_TILDE = re.compile(r"(?:^|(?<=\s))~(?=[ \t]*[-$.\d])")
_TEX_MATH_DELIM = re.compile(r"\\[()\[\]]")
# Currency signs other than "$", read as "$" is: "#### €18", "£18", "18€", "\boxed{¥18}" were no answer (a
# word-less sign before the number, a glued one after it), where "$18" was 18 (a review). "¢" is "cents", as the word.
_CURRENCY = re.compile(r"[\u00a2\u00a3\u00a5\u20a9\u20ac\u20b1\u20b9\u20bd]|\\(?:euro|pounds|textsterling|yen)(?![A-Za-z])"
                       r"|(?<![A-Za-z])Rs\.?(?=[ \t]*\d)")  # "Rs.150": the "." glued to the number hid it
_TEX_STYLE = re.compile(r"\\(?:display|text|script)style\b")
_BRACED_NUMBER = re.compile(r"\{\s*(-?[\d.,]+)\s*\}")
_WORD_GAP = re.compile(r"[\s,;:]+")
_GLUE_OK = frozenset(" \t\r\n,;:.%)<*")  # what may follow a #### line's number ("2x", "2^10", "5!" may not)
# After a span's number: an operator and an operand, or (after a space or a colon) another number. Spaced, such a
# line passed the glue check above and read as its first number ("#### 10 - 2" as 10, "#### 1 000 000" as 1).
# Whitespace stripped in code, not by "\s*...\s*" in the pattern: adjacent optional runs backtrack in O(n^2).
# An operator in words, an en dash or a "~" too: "18 times 2", "18 plus 2", "18 – 20", "18 ~ 20" read as 18 (a review of
# the statement fallback, "The answer is 18 times 2"; a careful reader takes 36, or no single number).
_WORD_OPERATOR = r"[\u2013\u2248]|(?i:times|plus|minus|(?:multiplied|divided)\s+by)\b"
_AN_OPERATOR = re.compile(r"[-+*/^\u00d7\u00b7]|\\times|\\cdot|\\div|[xX](?=\s)|" + _WORD_OPERATOR)
_AN_OPERAND = re.compile(r"\(?-?\.?\d")
_A_NUMBER_START = re.compile(r"\.?\d")


def _next_operand(rest: str) -> bool:
    if rest[:1] == ":":  # "3:30", "3:2": a time or a ratio
        return rest[1:2].isdigit()
    r = rest.lstrip()
    op = _AN_OPERATOR.match(r)
    if op is None:  # another number after a space ("1 000", "1 1/2"); a note in brackets ("72 (48 + 24)") is none
        return len(r) < len(rest) and _A_NUMBER_START.match(r) is not None
    return _AN_OPERAND.match(r[op.end():].lstrip()) is not None


# Words that make the number another one ("minus 5" is -5, "2 dozen" is 24) or deny it ("not 5"), right before or
# after it: the span is no answer. A denial counts before the number only: "#### 72 not counting tax" still answers 72.
_CHANGES_BEFORE = frozenset("negative minus not no half".split())
# Bounds right before the number: "more than 72", "at least 72" are no answer. Not before a label's colon: "#### She
# spent the most: $72" is 72 (a review: it read as a bound, no answer).
_BOUNDS_BEFORE = frozenset("than least most".split())
# An approximation or a bound right before the number: "#### about 18", "approximately 18", "over 18", "up to 18" read
# as 18, where "~18", "\approx 18" and "at least 18" were no answer (a review). Checked as the bounds above are.
# Not after a comma, which ends the word's clause: "#### As computed above, 18" (no answer until a review).
_APPROX_BEFORE = frozenset("about approximately approx approx. around roughly nearly almost circa over under above below"
                           .split())
# "up to" is no bound after a verb it completes: "#### It all adds up to 18", "#### Rounded up to 5 buses", "the price
# went up to $18" (each no answer until a review); "She can invite up to 18" is one.
_UP_TO_VERBS = frozenset("add adds added adding sum sums summed come comes came round rounds rounded rounding went rose"
                         .split())
# ... and right after it (or after its unit word): "#### 18 at most", "#### 18 (approximately)", "#### 18 dollars
# maximum" read as 18, where "at most 18" was no answer. Not one that a number follows: "#### 18 (approximately 17.6
# unrounded)" notes another value, as "18 (or 18.0)" restates one. Nor one that a word follows: it bounds that word,
# another quantity or the answer's name ("#### 18 (at most one per day)", "0.3 hours (approximately a third of an
# hour)", "#### 18 (maximum number of cookies)", "#### 18 minimum-wage hours"; each no answer until a review), nor after
# "the", which makes it a name: "#### 18, the maximum". "Roughly speaking" is still one; "give or take" bounds the answer
# whatever follows it: its tolerance ("give or take 2", "give or take a few").
# ("max" in lower case only: "#### 18 Max's toys" names Max; no "tops": "#### 18 tops" may count spinning tops.)
_BOUND_AFTER = re.compile(r"[\s,;(*]*(?:(?:at\s+(?:the\s+)?(?:most|least)|approx(?:imately)?|roughly|(?-i:max)|maximum"
                          r"|minimum)\b(?!\.?[\s(*]*[-.]?\d|[ \t]+(?!speaking\b)[A-Za-z]|-[A-Za-z])|give\s+or\s+take\b)",
                          re.IGNORECASE)
_CHANGES_AFTER = frozenset("""halves dozen dozens hundred hundreds thousand thousands million millions billion billions
    trillion trillions squared cubed""".split())

# A hedge right after the number (or its unit word): "#### 72 or 73" (or "72 or so", "72 and/or 73", "72 apples or 73
# apples", "72 dollars, or 73") offers more than one answer, and an answer that hedges must not be rewarded for the
# alternative that happens to be right.
_HEDGE = re.compile(r"[\s,;(*]*(?:and/)?or\b", re.IGNORECASE)
# A range or a second number after the number (or its unit word): "#### 72 to 73", "between 72 and 73", "72 and 3/4",
# "3 hours and 30 minutes", "2 and a half": the first number is not the answer (each read as it). A rounding note is
# no second number: "#### 72.5, to 1 decimal place", "#### 3.75 rounded to 2 significant figures" (a review: no answer).
_RANGE = re.compile(r"[\s,;*]*(?:(?:to|through|and)\s+(?=\(?[-$]?\.?\d)"
                    r"(?!\d+\s*(?:decimal|significant|sig\b|d\.?p\b|s\.?f\b))|and\s+a\s+(?:half|third|quarter)\b)",
                    re.IGNORECASE)
# The word after a span's number, a unit maybe ("72 apples or 73"); "or", "and", "to" are the connectors above, no unit.
_UNIT_WORD = re.compile(r"[\s*]*(?!(?:or|and|to|through)\b)([A-Za-z][A-Za-z.]*)", re.IGNORECASE)
# The alternative after a hedge's "or": a restatement of the same number ("#### 18 (or 18.0)", "#### 0.5 (or 1/2)",
# "#### $18 (or 18 dollars)") offers one answer, not two. The span is cleaned already ($, \frac, commas).
_ALTERNATIVE = re.compile(r"[\s(*]*(" + _NUMBER.pattern + ")")
# Units a quantity is restated in ("#### 90 (or 1.5 hours)", "#### 1.5 hours (or 90 minutes)") or written in two of
# ("3 hours 30 minutes", which is neither 3 nor 30): each its size in the smallest unit of its kind.
_UNITS = {w: (kind, size) for kind, sizes in {
    "time": {1: "s sec secs second seconds", 60: "min mins minute minutes", 3600: "h hr hrs hour hours",
             86400: "day days", 604800: "week weeks"},
    "money": {1: "cent cents", 100: "dollar dollars"},
    "length": {1: "inch inches", 12: "ft foot feet", 36: "yd yds yard yards", 63360: "mile miles"},
    "metric length": {1: "mm millimeter millimeters", 10: "cm centimeter centimeters", 1000: "m meter meters metre metres",
                      1000000: "km kilometer kilometers"},
    "mass": {1: "g gram grams", 1000: "kg kilogram kilograms"},
    "weight": {1: "oz ounce ounces", 16: "lb lbs pound pounds"},
    "volume": {1: "ml milliliter milliliters", 1000: "l liter liters litre litres"},
}.items() for size, words in sizes.items() for w in words.split()}


def _unit(word: str | None) -> tuple[str, int] | None:
    return None if word is None else _UNITS.get(word.lower().rstrip("."))


def _same_quantity(number: str, unit: str | None, alt: Fraction, alt_unit: str | None) -> bool:
    """Whether ``alt alt_unit`` is ``number unit`` again: the same number, or the same quantity in another unit of its
    kind ("90 minutes" = "1.5 hours"; a bare "90" = "1.5 hours" where 90 of some unit of that kind is 1.5 hours)."""
    a, b = _to_fraction(number), alt
    if a is None:
        return False
    u, v = _unit(unit), _unit(alt_unit)
    if u is not None and v is not None:  # "3 hours (180 minutes)" is one quantity, "3 hours 3 minutes" two
        return u[0] == v[0] and a * u[1] == b * v[1]
    if a == b:
        return True
    if v is None or (unit is not None and (u is None or u[0] != v[0])):
        return False
    sizes = [u[1]] if u is not None else [s for w, (k, s) in _UNITS.items() if k == v[0] and s != v[1]]
    return any(a * s == b * v[1] for s in sizes)


# A further part of a quantity in two units: "1 hour 30 minutes", "1 hour and 30 minutes", "2 hours, 30 minutes".
_MORE_OF_UNIT = re.compile(r"[\s,]*(?:and\s+)?(" + _NUMBER.pattern + r")\s*([A-Za-z][A-Za-z.]*)", re.IGNORECASE)


def _quantity_at(rest: str, start: int) -> tuple[Fraction, str | None, int] | None:
    """The number at ``rest[start:]``, the word after it (a unit maybe) and where they end; a quantity in two units of
    one kind is one quantity, in the first one's unit ("1 hour 30 minutes" is 1.5 hour): "90 minutes (1 hour 30
    minutes)" restates 90 minutes (it read as a second answer, no answer; a review)."""
    alt = _ALTERNATIVE.match(rest, start)
    value = None if alt is None else _to_fraction(alt.group(1))
    if value is None:
        return None
    word = _UNIT_WORD.match(rest, alt.end())
    unit = _unit(word and word.group(1))
    end = word.end() if word else alt.end()
    for _ in range(3) if unit is not None else ():  # "1 day 2 hours 30 minutes" at most
        part = _MORE_OF_UNIT.match(rest, end)
        more, more_unit = (None, None) if part is None else (_to_fraction(part.group(1)), _unit(part.group(2)))
        if more is None or more_unit is None or more_unit[0] != unit[0]:
            break
        value, end = value + more * more_unit[1] / unit[1], part.end()
    return value, word and word.group(1), end


def _restates(rest: str, start: int, number: str, unit: str | None = None) -> bool:
    """Whether the alternative at ``rest[start:]`` (after a hedge's "or") is ``number`` (of ``unit``) again: "18 (or
    18.0)" is 18, as it read before hedges were refused (a review); "90 (or 1.5 hours)" is 90."""
    alt = _quantity_at(rest, start)
    if alt is None:
        return False
    if _HEDGE.match(rest[alt[2]:].lstrip(")")):  # "18 or 18 or 19": a hedge still
        return False
    return _same_quantity(number, unit, alt[0], alt[1])


# "and" then a number of another thing, after the answer's own word: "#### 18 dollars and 9 eggs sold", "#### 72 apples,
# and 8 are left over" answer 18 and 72 (read as a second number, no answer, until this review: 18 and 72 before 1d5624a).
# Not a part of the same quantity ("3 hours and 30 minutes", "72 apples and 8 apples"), nor one that adds to it ("and 9
# more"), nor after a bare number ("72 and 8 apples" may be the range "between 72 and 8 apples").
_AND = re.compile(r"[\s,;*]*and\s+", re.IGNORECASE)
_ADDS_TO = frozenset("more less fewer extra additional".split())


def _counts_another_thing(tail: str, word: str) -> bool:
    """Whether ``tail``, after the answer's number and its ``word``, is "and" then a number of something else."""
    conj = _AND.match(tail)
    other = None if conj is None else _quantity_at(tail, conj.end())
    if other is None or other[1] is None:
        return False
    a, b = word.lower().rstrip("."), other[1].lower().rstrip(".")
    if b in _ADDS_TO or a.rstrip("s") == b.rstrip("s"):
        return False
    return _unit(a) is None or _unit(b) is None or _unit(a)[0] != _unit(b)[0]


def _second_answer(rest: str, number: str) -> bool:
    """Whether what follows a span's number offers another answer beside it: a hedge ("72 or 73", "72 apples, or 73",
    "72 or so"; not the same quantity restated, "72 (or 72.0)", "90 minutes (or 1.5 hours)"), a range ("72 to 73")
    or a second number ("72 and 73", "72 and 3/4", "3 hours and 30 minutes", "5 feet 6 inches")."""
    unit = _UNIT_WORD.match(rest)
    for tail, word in [(rest, None)] + ([(rest[unit.end():], unit.group(1))] if unit else []):
        hedge = _HEDGE.match(tail)
        if hedge is not None:
            return not _restates(tail, hedge.end(), number, word)
        if _RANGE.match(tail):
            return word is None or not _counts_another_thing(tail, word)
        if _BOUND_AFTER.match(tail) and (word or "").lower() != "the":  # "18 at most", "18 dollars maximum": a bound
            return True
    kind = _unit(unit.group(1)) if unit else None
    if kind is None:
        return False
    second = _quantity_at(rest.replace(",", " "), unit.end())  # "3 hours 30 minutes", "1 hour, 30 minutes"
    second_unit = _unit(second and second[1])
    # the same quantity again is no second answer: "3 hours (180 minutes)", "18 dollars (1800 cents)" (it read as one)
    return (second_unit is not None and second_unit[0] == kind[0]
            and not _same_quantity(number, unit.group(1), second[0], second[1]))


def _words_only(text: str) -> bool:
    return all(_WORD.fullmatch(w) for w in _WORD_GAP.split(text) if w)


# What may not touch a \frac's value: it would merge with it into another number ("(2)\frac12" read as 20.5,
# "\frac12\frac13" as 0.51/3 = 0.17, "\frac{1}{2}3" as 0.53). Such a \frac stays as written: no number.
_GLUED_BEFORE_FRAC = frozenset("0123456789.)}")
_GLUED_AFTER_FRAC = re.compile(r"\.?\d|\\[dt]?frac(?![A-Za-z])")


def _frac_value(m: re.Match) -> str:
    a, b = (_to_fraction(m.group(i) or m.group(i + 1)) for i in (3, 5))
    if a is None or b is None or b == 0:
        return m.group(0)
    s, start = m.string, m.start()
    if (m.group(2) is None and start and s[start - 1] in _GLUED_BEFORE_FRAC) or _GLUED_AFTER_FRAC.match(s, m.end()):
        return m.group(0)
    if m.group(2) is None:
        return _exact_str(a / b)
    # a mixed number: _to_fraction, not int(), so a whole part of 4300+ digits is no answer rather than a ValueError
    whole = _to_fraction(m.group(2))
    if whole is None or a < 0 or b < 0:  # "3\frac{-1}{2}" is no mixed number
        return m.group(0)
    return _exact_str((-1 if m.group(1) else 1) * (whole + a / b))


def _clean_number_text(s: str, strip_plus: bool = True) -> str:
    # {,} and a thin space \, between digits separate thousands ("1{,}000", "1\,000"): a comma, so the groups-of-three
    # check applies ("0{,}5" is a European 0.5 and "2\,3" two numbers, not 5 and 23)
    s = s.replace("\u2212", "-").replace("{,}", ",").replace("\\!", "")
    s = re.sub(r"(?<=\d)\\,(?=\d)", ",", s).replace("\\,", "")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\$", "$").replace("\\%", "%")
    s = _CURRENCY.sub("$", s)  # before the "~": "~€18" is "about 18" as "~$18" is
    s = _TEX_MATH_DELIM.sub(" ", s)  # inline/display math \(72\), \[72\]: as $72$
    s = _APPROX_TILDE.sub("\u2248", s)  # "is ~18": "about 18", no TeX tie (a tie is glued: "18~km", "is~18")
    s = _TEX_SPACE.sub(" ", _TEX_STYLE.sub(" ", s))
    s = _LATEX_TEXT.sub(r" \1 ", s)  # \text{72}, units: \text{ dollars}
    s = re.sub(r"([A-Za-z])\s+(?=\^)", r"\1", s)  # \text{ ft}^2 -> "ft^2"
    s = _DEGREES.sub(" ", s)  # 18^\circ F: a space, not "18F"
    for _ in range(4):  # innermost first: \frac{\frac{1}{2}}{3} = 1/6; 1\frac{1}{2} = 1.5, not 11/2
        s, n = _LATEX_FRAC.subn(_frac_value, s)
        if not n:
            break
    s = _BRACED_NUMBER.sub(r"\1", s)  # {18} -> 18 (fractions are values by now)
    # (3) -> 3, but 2(3) is a product, not 23, and (1,500) a point (or an accountant's -1500), not 1500
    s = re.sub(r"(?<![\d)])\((-?[\d.]+)\)", r"\1", s)
    s = s.replace("$", "")
    if strip_plus:
        s = re.sub(r"(^|[\s(=])\+\s*(?=[\d.])", r"\1", s)  # "+5" -> "5"
    # "- 5" -> "-5" only when the minus is not between two numbers
    s = re.sub(r"(^|[^\d\s])\s*-\s+(?=\d)", r"\1-", s)
    return s


def _decimal_value(s: str) -> Fraction | None:
    """``-1,234.5`` -> Fraction. Commas only as thousands separators (groups of 3; Indian 2s inside):
    ``3,5``, ``12,50`` or ``1,2,3`` are not one number, so they are none."""
    neg = s.startswith("-")
    whole, _, frac = s.lstrip("-").partition(".")
    if "," in whole:
        groups = whole.split(",")
        if not (1 <= len(groups[0]) <= 3 and len(groups[-1]) == 3 and all(len(g) in (2, 3) for g in groups[1:-1])):
            return None
        whole = "".join(groups)
    if sum(map(len, (whole, frac))) > MAX_NUMBER_DIGITS:
        return None
    try:
        f = Fraction(Decimal(f"{whole or '0'}.{frac or '0'}"))
    except (InvalidOperation, ValueError):
        return None
    return -f if neg else f


def _to_fraction(num: str) -> Fraction | None:
    num = num.replace(" ", "").rstrip(",")
    if "/" in num:
        a, b = (_decimal_value(x) for x in num.split("/", 1))
        return None if a is None or b is None or b == 0 else a / b
    return _decimal_value(num)


def _exact_str(f: Fraction) -> str:
    """Canonical text of a value: an integer, a terminating decimal written out exactly (0.5, never
    rounded), else p/q."""
    if f.denominator == 1:
        return str(f.numerator)
    d = f.denominator
    twos = (d & -d).bit_length() - 1
    d >>= twos
    fives = 0
    while d % 5 == 0:
        d //= 5
        fives += 1
    if d != 1:
        return f"{f.numerator}/{f.denominator}"
    places = max(twos, fives)
    scaled = abs(f.numerator) * 10**places // f.denominator  # exact: the denominator divides 10**places
    digits = str(scaled).rjust(places + 1, "0")
    text = f"{digits[:-places]}.{digits[-places:]}".rstrip("0").rstrip(".")
    return ("-" if f < 0 else "") + text


# A span that is only an ASCII integer, as nearly every GSM8K "#### 72" line is: its value without the parse below
# (which cost ~70 us a row: a million-row dataset spent 72 s of its load there). Same result by construction, and
# tests/test_rewards.py holds the two paths equal. Only the whitespace _GLUE_OK lets follow a number.
_PLAIN_INT = re.compile(rf"[ \t\r\n]*(-?)([0-9]{{1,{MAX_NUMBER_DIGITS}}})[ \t\r\n]*", re.ASCII)


def span_number(text: str, whole: bool = True) -> str | None:
    """The number an answer span gives, normalised (``'$1,234.50 dollars'`` -> ``'1234.5'``), or None.

    ``whole``: the span must be a number (words around it allowed: "The answer is 72 apples."), as
    a ``\\boxed{}`` or ``<answer>`` must; else it only has to start with one, as a ``####`` line. An
    equation gives its right-hand side (``x = 5``, ``48 + 24 = 72``).
    """
    plain = _PLAIN_INT.fullmatch(text)
    if plain is not None:
        digits = plain.group(2).lstrip("0") or "0"
        return digits if digits == "0" else plain.group(1) + digits
    return _parsed_span_number(text, whole)


def _parsed_span_number(text: str, whole: bool) -> str | None:
    """span_number for any span: TeX, units, thousands commas, fractions, equations."""
    if _DIGIT.search(text) is None:  # fast path: most spans a degenerate completion offers hold none
        return None
    return _cleaned_span_number(_clean_number_text(text), text, whole)


def _cleaned_span_number(s: str, text: str, whole: bool) -> str | None:
    """_parsed_span_number on ``s``, the span ``text`` already through _clean_number_text (a #### line is cleaned
    once, for its number and for the kind of line it is)."""
    if "=" in s and (whole or _starts_an_expression(_clean_number_text(text, strip_plus=False))):
        if s.count("=") > 1 and len(set(_ASSIGNED.findall(s))) > 1:
            return None  # "x = 5, y = 18" (in a box or on a #### line): several answers, none of them the answer
        left, s = s.rsplit("=", 1)
        if left[-1:] in ("<", ">", "!"):
            return None  # "x >= 18", "x <= 18", "x != 18": a bound or a denial, as "\geq 18" is (each read as 18)
    m = _NUMBER.search(s)
    # bold anywhere in the words: "The answer is **72**", "**Final Answer:** 72" (its leading ** made it no answer)
    if m is None or not _words_only(s[: m.start()].replace("*", " ")):
        return None
    rest = s[m.end():]
    if rest and rest[0] not in _GLUE_OK:  # "2x", "2^{10}", "2\\sqrt{2}", "5!": not the number 2 or 5
        return None
    if _next_operand(rest):  # "10 - 2", "2 x 3", "2 ^ 3", "1 000 000", "1 1/2", "3:30": not the number 10, 2, 1 or 3
        return None
    # the word right before the number and the one right after it: a word further away belongs to the sentence
    # ("After giving away half, she has 36 marbles", "There are no cookies left, so 0", "24 eggs, two dozen")
    # ("**" is no word: "at least **72**", "**72** dozen" read as 72)
    before_three = [w.lower() for w in _WORD_GAP.split(s[: m.start()].replace("*", " ")) if w][-3:]  # "adds up to 18"
    before = before_three[-1:]
    after = _WORD_GAP.split(rest.replace("*", " ").strip(), maxsplit=1)[:1]
    if (_CHANGES_BEFORE.intersection(before)
            or _CHANGES_AFTER.intersection(w.lower() for w in after)):
        return None  # "minus 5", "not 5", "2 dozen", "5 million": another number than the one written
    gap = s[: m.start()].rstrip(" \t*")
    if _BOUNDS_BEFORE.intersection(before) and not gap.endswith(":"):
        return None  # "more than 72", "at least 72": a bound, not the answer ("the most: 72" is a label)
    up_to = before_three[-2:] == ["up", "to"] and not _UP_TO_VERBS.intersection(before_three[:-2])
    if (_APPROX_BEFORE.intersection(before) or up_to) and not gap.endswith((":", ",")):
        return None  # "about 72", "up to 72": an approximation or a bound ("above, 72" ends a clause)
    if _second_answer(rest, m.group(0)):
        return None  # "72 or 73", "72, or so", "72 (or 73)", "72 to 73", "3 hours 30 minutes": no answer (read as 72, 3)
    if whole:
        rest = rest.lstrip().lstrip("*").lstrip().removeprefix("%").lstrip("*").strip().removesuffix(".")
        if not _words_only(rest):  # "72 apples" yes; "2 \\cdot 3", "3 and 4" no
            return None
    f = _to_fraction(m.group(0))
    return None if f is None else _exact_str(f)


# What makes a #### line's first number an operand: an operator after it, a bracket glued to it ("5(2) = 10";
# "3 (t = 180 min)" is an answer and a note), or a spaced letter x between numbers ("2 x 3 = 6").
_OPERATOR = re.compile(r"\s*(?:[-+*/^\u00d7\u00b7]|\\times|\\cdot|\\div)|\((?=[-\d.])|\s+[xX]\s+(?=[\d(.])"
                       rf"|\s*(?:{_WORD_OPERATOR})\s*(?=[\d(.])")  # "18 times 2 = 36" is 36, not 18


def _starts_an_expression(s: str) -> bool:
    """Whether a ``####`` line's leading number is the first operand of an expression ("48 + 24 = 72":
    its value is the right side) rather than the answer itself ("72 = 48 + 24", "3 hours (t = 180
    minutes)": the number the line starts with)."""
    m = _NUMBER.search(s)
    return m is None or not _words_only(s[: m.start()].rstrip().rstrip("*")) or _OPERATOR.match(s, m.end()) is not None


def normalize_number(text: str) -> str | None:
    """Canonical form of a number written as text (``'-3.50'`` -> ``'-3.5'``, ``'\\frac{6}{8}'`` -> ``'0.75'``)."""
    return span_number(text)


# A Markdown heading's label ("#### Step 1: Add", "#### **Part 2**"): its number is no answer. Skipped rather than
# taking the *last* words-first line, which read a note or check after the answer ("#### Note: 7 eggs were broken")
# and a base model's run-on ("#### The answer is 72\n\nQuestion: ... #### The answer is 5") instead of the answer.
_HEADING_LABEL = re.compile(r"\s*\**\s*(?:step|part|case|method|stage|phase|section)\s*\d", re.IGNORECASE)
# A heading that only names the answer, which follows on the next line: "#### Final Answer\n72" (also "**Answer:**",
# "3. Final Answer", "The final answer is"). Its line has no number, so the answer under it was never read.
_ANSWER_HEADING = re.compile(r"[\s*]*(?:\d+\.\s+)?(?:the\s+)?(?:final\s+)?(?:answer|result)s?(?:\s+is)?[\s*:.]*",
                             re.IGNORECASE)
# A Markdown list marker before the answer under a heading ("#### Final Answer\n- 18"): no minus sign ("-18" is one).
_BULLET = re.compile(r"[ \t]*[-*+][ \t]+(?=\S)")
# A numbered Markdown heading "#### 1. Understand the problem": the number of a list item, not an answer (no letter
# may follow it: "#### 18." and "#### 1.5" stay numbers).
_NUMBERED_HEADING = re.compile(r"(\d+)\.\s+(?=[A-Za-z*])")
_A_WORD = re.compile(r"[A-Za-z]+")


# The words an answer line may say before "answer": "Therefore, the final answer is 72". Any other ("#### Double-check
# the answer: 18 eggs * $2 = $36") makes the line a note that mentions the answer, not one that gives it: it outranked
# the final \boxed{36} (a review).
_ANSWER_LEAD_WORDS = frozenset("so thus therefore hence then the final my our correct answer answers is was".split())


def _names_the_answer(words: str) -> bool:
    """Whether the words before a #### line's number name the answer ("#### The answer is 72", "#### **Final
    Answer:** 72", "#### Answer = 72", "#### So the final answer is 72"): they end on "answer" (then "is"), and say
    nothing else; a heading that happens to hold a number ("#### Add the 3 eggs") or a note ("#### Check the
    answer: 18 eggs ...") does not."""
    found = [w.lower() for w in _A_WORD.findall(words)]
    last = found[:-1] if found[-1:] in (["is"], ["was"]) else found
    return last[-1:] in (["answer"], ["answers"]) and _ANSWER_LEAD_WORDS.issuperset(found)


def _read_hash_span(span: str, need_words: bool = True) -> tuple[str, str | None]:
    """(kind, number) of a #### span with a digit, cleaned once. Kinds: "lead" (the line starts with its number,
    "#### 72", "#### $72", "#### **72**"; or names the answer before it, "#### The answer is 72"), "words" (words
    come first, "#### Add the 3 eggs", "#### She has 72 left"), "numbered" (a numbered heading "#### 1. Understand
    the problem": its number is the last resort). ``need_words`` False: a "words" line's number is not parsed (one
    was found before; a degenerate run of such lines stays at one clean each)."""
    if _PLAIN_INT.fullmatch(span):  # "#### 72", nearly every GSM8K line
        return "lead", span_number(span)
    s = _clean_number_text(span)
    head = s.lstrip().lstrip("*").lstrip()
    item = _NUMBERED_HEADING.match(head)
    if item is not None:
        rest = head[item.end():]
        num = _cleaned_span_number(rest, rest, whole=False) if _DIGIT.search(rest) else None
        if num is None:  # "#### 1. Understand the problem"
            return "numbered", span_number(item.group(1))
        if num == span_number(item.group(1)):  # "#### 18. She makes $18": the number, said twice
            return "lead", num
        # "#### 3. Answer: 18", "#### 2. Add the 3 eggs": the item's own words
        return ("lead" if _names_the_answer(rest[: _DIGIT.search(rest).start()]) else "words"), num
    if head.removeprefix("-").lstrip().removeprefix(".")[:1].isdigit():
        return "lead", _cleaned_span_number(s, span, whole=False)
    first = _DIGIT.search(s)
    if first is None:  # cleaning left no digit (none seen so far; a guard, not a case)
        return "words", None
    kind = "lead" if _names_the_answer(s[: first.start()]) else "words"
    return kind, (_cleaned_span_number(s, span, whole=False) if kind == "lead" or need_words else None)


def _line_after(text: str, start: int, bound: int) -> tuple[str, int] | None:
    """The first line with content in text[start:bound] (the answer under a heading) and where it ends, or None."""
    for _ in range(8):  # a few blank lines at most: the answer right below
        end = text.find("\n", start, bound)
        end = bound if end < 0 else end
        if text[start:end].strip():
            return text[start:end], end
        if end == bound:
            return None
        start = end + 1
    return None


def _box_below(text: str, start: int, bound: int) -> str | None:
    """The number of a box on the next line with content after ``start`` ("#### Final Answer\n2 hours\n\\boxed{120}":
    the answer in the form the question asked for, 120 minutes; the line above it read as 2), or None."""
    line = _line_after(text, start, bound)
    box = None if line is None else final_box(line[0], _same_number, lists=True)  # "\boxed{72} or \boxed{73}": none
    return None if box is None else span_number(box)


def _same_number(a: str, b: str) -> bool:
    """Whether two boxes give one number (a hedge between them is none: final_box)."""
    return span_number(a) == span_number(b)


HashAnswer = tuple[str, str] | None  # (the span, its number)


def _hash_spans(text: str) -> tuple[HashAnswer, HashAnswer, HashAnswer]:
    """What follows a ``####``, up to the line end (or the next ``####``: each span is then read once, so the cost
    stays linear in the text), with its number: (the first line that starts with its number or names the answer
    before it, "#### 72", "#### The answer is 72", or the line under a heading "#### Final Answer"; the first line
    with its number after other words that is no heading label "#### Step 1: ..."; the first numbered heading
    "#### 1. Understand the problem"), each None where there is none: a heading label alone gives no answer."""
    starts = [m.start() for m in re.finditer("####", text)]
    words = numbered = None
    for k, pos in enumerate(starts):
        bound = starts[k + 1] if k + 1 < len(starts) else len(text)
        stop = text.find("\n", pos + 4, bound)  # bounded: a search to the text's end per #### was O(n^2)
        stop = bound if stop < 0 else stop
        span = text[pos + 4 : stop]
        if _ANSWER_HEADING.fullmatch(span):  # the answer is on the line below: read it as if after a ####
            line = _line_after(text, stop, bound)
            below = None if line is None else _BULLET.sub("", line[0], count=1)  # "- 18" read as -18, above \boxed{18}
            num = None if below is None else span_number(below)  # all of it a number: "72", "$72$", "72 apples."
            if num is None:
                continue
            # a line that starts with its number ("72", "$72$") leads; a sentence ("She needs 5 more boxes.") is
            # only words-first: prose under "#### Answer" must not outrank the final box
            kind = _read_hash_span(below)[0]
            span = below
            boxed = _box_below(text, line[1], bound)
            if boxed is not None:  # the box right under it is the answer it gives
                kind, num = "lead", boxed
        elif _DIGIT.search(span) is None or _HEADING_LABEL.match(span):
            continue  # no number (a degenerate "####" run: not worth the cleaning below), or a heading's label
        else:
            kind, num = _read_hash_span(span, need_words=words is None)
        if num is None:
            continue
        if kind == "lead":
            return (span, num), words, numbered
        if kind == "words" and words is None:
            words = span, num
        elif kind == "numbered" and numbered is None:
            numbered = span, num
    return None, words, numbered


def _after_hashes(text: str) -> str | None:
    """What follows the first ``####`` that starts with a number (or names the answer before it), else the first one
    with a number after words (no heading label), else the first numbered heading, up to the line end (a GSM8K
    reference: "... #### 72")."""
    found = next((f for f in _hash_spans(text) if f is not None), None)
    return None if found is None else found[0]


def _answer_tag(text: str) -> str | None:
    """Content of the last closed ``<answer>...</answer>`` (rfind: linear even for unclosed tags)."""
    end = text.rfind("</answer>")
    if end < 0:
        return None
    start = text.rfind("<answer>", 0, end)
    return None if start < 0 else text[start + len("<answer>") : end]


# An instruct model's plain-prose final statement, without "####" or a box: "The answer is 18.", "**Final Answer:** 18",
# Llama-3's "The final answer is 18", "Therefore, the final answer is: $18" (30 of 223 realistic Qwen2.5/Llama-3
# completions a review collected: an eval without a "####"/box instruction scored near 0). Read narrowly, never as
# "the last number": a sentence that *starts* with the answer phrase (a "So"/"Therefore," lead, Markdown aside) and
# gives the number right after it. A sentence ends at a stop and a space ("18.5" goes on); one that asks ("Is the
# answer 18?") states nothing.
_ANSWER_WORD = re.compile(r"\banswers?\b", re.IGNORECASE)
# one stop: "[.!?]+" backtracked in O(n^2) on a run of dots; "Rs. 1,000" is rupees ("The answer is Rs. 1,000." gave none),
# but "Rs." before a word ends a sentence ("He pays 500 Rs. The answer is 500." gave none until a review)
_SENTENCE_END = re.compile(r"(?:[!?]|(?<!\bRs)\.|\.(?![ \t]*\d))\s+")
# What a statement may say before "answer": an answer line's lead words ("So", "Therefore,", "the final"), not "is" ("Is
# the answer 18" asks), and a correction's ("No, the answer is 19"; so "No, the answer is not 18" denies the one before),
# and a summary's ("In conclusion,", "In summary,", "Finally,", "Overall,": no answer until a review; "In the example,
# the answer is 5" still says another word)
_STATEMENT_LEAD_WORDS = ((_ANSWER_LEAD_WORDS - {"is", "was", "answer", "answers"})
                         | {"no", "wait", "actually", "in", "conclusion", "summary", "finally", "overall"})
_LEAD_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]+")  # not a TeX command's name: "\textbf{Final Answer:} 18"
_MAX_STATEMENT = 4000  # characters in a statement's sentence; a longer one is a policy's degenerate repeat


def _states_the_answer(sentence: str) -> bool:
    """Whether a sentence is an answer statement: it starts with the answer phrase ("The answer is", "So the final
    answer is", "**Final Answer:**"), holds a number after it, and asks nothing ("What is the answer? 18" does not
    start with it, "Is the answer 18?" asks)."""
    phrase = _ANSWER_WORD.search(sentence)
    if phrase is None or _DIGIT.search(sentence, phrase.end()) is None or sentence.rstrip().endswith("?"):
        return False
    lead = sentence[: phrase.start()]
    return _DIGIT.search(lead) is None and _STATEMENT_LEAD_WORDS.issuperset(
        w.lower() for w in _LEAD_WORD.findall(lead))


def _answer_statement(text: str) -> str | None:
    """The number of the last answer statement (_states_the_answer) in ``text``, read to its sentence's end as a ####
    line's is (the same cleaning and refusals: "The answer is 18 or 19" is no answer), or None. Only the last one
    counts, a model correcting itself; one that gives no number right after its phrase ("The answer is not 18", "The
    answer is between 18 and 20", "The answer is that she has 18") is no answer, not a way back to an earlier one."""
    for line in reversed(text.splitlines()):
        if _DIGIT.search(line) is None or _ANSWER_WORD.search(line) is None:
            continue
        starts = [0] + [m.end() for m in _SENTENCE_END.finditer(line)]
        for k in reversed(range(len(starts))):
            end = starts[k + 1] if k + 1 < len(starts) else len(line)
            if not _states_the_answer(line[starts[k]:end]):
                continue
            if end - starts[k] > _MAX_STATEMENT:
                return None  # a degenerate run ("the answer is 1 " x 6,000), no answer: not cleaned whole (~40 ms)
            span = line[starts[k]:end]  # its sentence: "The answer is 6 + 12 = 18. So 18 - 3 = 15." is 18, not 15
            s = _clean_number_text(span)
            phrase = _ANSWER_WORD.search(s)  # read from "answer" on: its lead ("No,", "So") is checked
            s = "" if phrase is None else s[phrase.start():]  # (None: a guard, cleaning keeps the words)
            first = _DIGIT.search(s)
            if first is None or not _names_the_answer(s[: first.start()]):  # words between phrase and number
                return None
            return _cleaned_span_number(s, span, whole=False)
    return None


# A base model's run-on into the next question ("... The answer is 18.\n\nQuestion: Tom has 40 marbles ...\nAnswer: 40 -
# 5 = 35"): the statements after it answer that question (the last one read 35). Not on the first line: a completion
# may restate the question it answers. Also a few-shot prompt's other labels: Minerva's "Problem:" (its run-on's "Final
# Answer: The final answer is 35" read as 35), "Question 2:", "**Question:**", "### Question:", "Q.", a chat turn's
# "User:"/"Human:" (each read the run-on's answer: a review).
# (No two optional runs of spaces side by side: "[ \t]*\**[ \t]*" split a run of spaces every way, O(n^2).)
_RUN_ON_QUESTION = re.compile(r"\n[ \t]*(?:[#>*][ \t]*){0,4}(?:(?:Question|Problem|Human|User)|(Q))[ \t]*(?:\d+[ \t]*)?"
                              r"(?:\*{1,2}[ \t]*)?(?(1)[:.]|:)", re.IGNORECASE)


def _before_a_run_on(text: str) -> str:
    """``text`` up to a line that starts another question (after its first line), else all of it."""
    first = text.lstrip()
    run_on = _RUN_ON_QUESTION.search(first)
    return first if run_on is None else first[: run_on.start()]


def _after_answer_markers(text: str) -> str:
    """The text after the last closed box, ``</answer>`` and ``####`` line: an answer statement before one of them (a
    box refused as a hedge, "\\boxed{18} or \\boxed{19}", or as no number) is not the final answer."""
    box = next(_boxes_from_last(text), None)
    tag = text.rfind("</answer>")
    start = max(box[2] if box else 0, tag + len("</answer>") if tag >= 0 else 0)
    hashes = text.rfind("####")
    if hashes >= 0:
        line_end = text.find("\n", hashes)
        start = max(start, len(text) if line_end < 0 else line_end)
    return text[start:]


def extract_answer(text: str, kind: str = "gsm8k") -> str | None:
    """The answer a completion gives, or None when it gives none.

    ``gsm8k``: normalised number of the first ``####`` line that starts with it or names the answer before it ("####
    The answer is 72", or the line under "#### Final Answer"), else in the last ``\\boxed{}``, else in the last
    ``<answer>`` tag, else after words on the first ``####`` line that is no heading label ("#### Step 1:"), else of
    the first numbered heading ("#### 1. Understand the problem"), else of the last plain answer statement ("The
    answer is 72.", "**Final Answer:** 72") after them.
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
        # a #### line that starts with its number (or names the answer), else the box, else the tag, else a #### line
        # with other words before its number, else a numbered heading: a Markdown heading "#### Step 1: ..." or "####
        # 1. Understand the problem" must not outrank the final \boxed{72}
        lead, words, numbered = _hash_spans(text)
        if lead is not None:
            return lead[1]
        for find in (lambda t: final_box(t, _same_number, lists=True), _answer_tag):
            span = find(text)
            if span is not None:
                num = span_number(span, whole=True)
                if num is not None:
                    return num
        found = next((f[1] for f in (words, numbered) if f is not None), None)
        # last, a plain-prose statement "The answer is 18." (no ####, box or tag): instruct models' default
        return found if found is not None else _answer_statement(_after_answer_markers(_before_a_run_on(text)))
    if kind == "math":
        # "\boxed{-2} and \boxed{1}" is "-2, 1"; "\boxed{\frac12} or \boxed{0.5}" is one answer; else the <answer> tag
        found = math_boxes(text)
        return found if found is not None else _math_tag(text)
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
        span = _after_hashes(reference)
        if span is None:
            span = last_boxed(reference) or reference
        return span_number(span)
    if kind == "math":
        return last_boxed(reference) or reference.strip()
    raise BadInputError(f"unknown answer kind {kind!r} (known: {', '.join(ANSWER_KINDS)})")


class _ShortLogLines(logging.Filter):
    """math-verify logs a parse timeout with the whole text it parsed: a degenerate completion's 40 KB box (or
    1 MB) went to stderr, through the progress display, once per completion."""

    LIMIT = 300

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if len(msg) > self.LIMIT:
            record.msg, record.args = f"{msg[: self.LIMIT]}... ({len(msg):,} characters)", None
        return True


def _not_timeout_disabled(record: logging.LogRecord) -> bool:
    # math-verify's "Timeout is disabled ..., you must provide the logic for timeout interuption yourself": qerl's
    # own warning (_warn_no_timeout) says what that means for a reward scored off the main thread
    return not str(record.msg).startswith("Timeout is disabled")


@functools.cache
def _quiet_math_verify() -> None:
    for name in ("math_verify.parser", "math_verify.grader", "math_verify.metric"):
        logger = logging.getLogger(name)  # a parent logger's filter misses its children's records
        logger.addFilter(_ShortLogLines())
        logger.addFilter(_not_timeout_disabled)


@functools.cache
def _warn_no_timeout() -> None:
    warnings.warn("the math reward is scored off the main thread: math-verify's 5 s timeout needs SIGALRM, which "
                  "only the main thread gets, so its verdicts run without a time limit there (a degenerate answer "
                  "such as 10^{10^{10^{10}}} can hold the process for good); score from the main thread to keep it",
                  QerlWarning, stacklevel=2)


# TeX spacing between digit groups, "10\,000", "1\ 000\ 000", "10~000", "10 000" (TeX's math mode drops the plain
# space): latex2sympy reads each as a product, 10 * 000 = 0, so the right answer scored 0 and 0 was taken for it.
# Three at most between two groups ("10 \, 000").
_DIGIT_GROUP_SPACE = re.compile(r"(?<=\d)(?:\\[,;: ]|~|\s){1,3}(?=\d{3}(?!\d))")
# A degree sign latex2sympy does not read ("30°", "30\degree": no answer), as the "^\circ" it does. Its leading spaces
# are matched from a run's start only: tried from each space, a box of 100,000 spaces took minutes.
_DEGREE_SIGN = re.compile(r"(?<!\s)\s*(?:\^\s*)?(?:\{\s*(?:°|\\degree|\\textdegree)\s*\}|°|\\degree\b|\\textdegree\b)")
# A sentence's full stop inside the box, "\boxed{5.}", "\boxed{\frac{1}{2}.}", "\boxed{(1, 2).}", "\boxed{\pi.}",
# "\boxed{x = 1 .}": no answer. Not a dot after a dot ("1..."), nor TeX's "\." (an accent).
_BOX_FULL_STOP = re.compile(r"(?<=[\w})\]|])\s*\.\s*$")


def _for_math_verify(tex: str) -> str:
    """An answer's TeX in the forms math-verify reads (see each pattern)."""
    tex = _DIGIT_GROUP_SPACE.sub("", tex.strip())
    tex = _DEGREE_SIGN.sub(r"^\\circ", tex)
    return _BOX_FULL_STOP.sub("", tex)


def _math_verify_timeout() -> int:
    """math-verify's timeouts use SIGALRM, which only works on the main thread (signal.signal raises elsewhere):
    off it, no timeout (0 is math-verify's own switch for that), and one warning that says so."""
    _quiet_math_verify()
    if threading.current_thread() is threading.main_thread():
        return 5
    _warn_no_timeout()
    return 0


# The whole of an <answer> tag's content in one math span: "$\frac12$", "$$x = 5$$", "\(5\)", "\[5\]".
_ONE_MATH_SPAN = re.compile(r"\$\$([^$]*)\$\$|\$([^$]*)\$|\\\(((?:(?!\\[()]).)*)\\\)|\\\[((?:(?!\\[\[\]]).)*)\\\]", re.DOTALL)
_MATH_SPAN_OPEN = re.compile(r"(?<!\\)\$|\\[(\[]")  # not an escaped dollar, "\$18"
# A dollar sign before an amount, the only one in the tag ("$18", "$18.50", "She pays $18."): a currency sign, as "\$18",
# not a math span left open (no answer to math-verify, so a right answer scored 0).
_CURRENCY_DOLLAR = re.compile(r"^([^$]*?)(?<!\\)\$(?=\s*\d)([^$]*)$")
# A tag's bare content (no math span) is read as TeX: one longer than any answer is prose or a policy's degenerate repeat,
# words with no answer in them, but latex2sympy's parse of it cost seconds a verdict (3 s at 2 KB, cut at 5 s on the main
# thread, over a minute at 30 KB off it; R1-Zero-style policies write their whole solution in the tag).
_MAX_BARE_TAG = 500


def _math_tag(text: str) -> str | None:
    """The math rule's answer where no box holds one: the last closed ``<answer>`` tag's (R1-Zero's prompt asks for
    "<answer> ... </answer>"; it scored 0 under ``math`` however right, beside gsm8k, which reads the tag). Its
    content is the answer's TeX, as a box's ("5", "\\frac{1}{2}", "x = 5", "-2, 1"), or in one math span ("$\\frac12$");
    where words stand around math ("The answer is $\\frac12$.", "$x = -2$ or $x = 1$"), math-verify's own extraction
    reads it (as it reads a completion: an "answer is" statement first, spans joined by "and"/"or"). Words without
    math ("The answer is 5") are read as TeX, so no answer in effect: no "last number" is taken."""
    tag = _answer_tag(text)
    tex = None if tag is None else tag.strip()
    if not tex:
        return None
    tex = _CURRENCY_DOLLAR.sub(r"\1\\$\2", tex)
    if _MATH_SPAN_OPEN.search(tex) is None:
        return tex if len(tex) <= _MAX_BARE_TAG else None
    one = _ONE_MATH_SPAN.fullmatch(tex)
    if one is not None:
        return next(g for g in one.groups() if g is not None).strip() or None
    return _tag_hedge(tex, _math_verify_extraction(tex))


def _tag_hedge(tex: str, found: str | None) -> str | None:
    """``found``, math-verify's reading of a tag's prose, unless it is the last of two math spans offered as a hedge,
    as two boxes are (_BOX_HEDGE): then the two as one answer, as math_boxes reads "\\boxed{3} or maybe \\boxed{4}".
    math-verify joins spans by a bare "or" only: "$3$ or maybe $4$" read as 4, a hedge scored right."""
    spans = list(_ONE_MATH_SPAN.finditer(tex))
    if found is None or len(spans) < 2:
        return found
    before, last = ([g for g in m.groups() if g is not None][0].strip() for m in spans[-2:])
    if (found == last and _BOX_HEDGE.fullmatch(tex, spans[-2].end(), spans[-1].start())
            and not _math_verify_equal(before, last)):
        return f"{before}, {last}"
    return found


@functools.lru_cache(maxsize=1 << 12)
def _math_verify_extraction(text: str) -> str | None:
    """The TeX math-verify's LaTeX extraction reads from prose, or None (cached as the verdicts are: ~10 ms)."""
    from math_verify import LatexExtractionConfig, parse

    found = parse(text, extraction_config=[LatexExtractionConfig()], parsing_timeout=_math_verify_timeout())
    tex = found[-1].strip() if found and isinstance(found[-1], str) else ""  # [sympy value, its TeX], or []
    return tex or None


# A box (or tag) longer than any answer is a degenerate repeat: latex2sympy's parse of one took ~0.5 s at 1,000
# characters and ~3 s at 3,000 (cut at 5 s on the main thread only), a verdict per distinct one: no answer.
MAX_MATH_ANSWER_CHARS = 1000


def long_math_reference(rows, noun: str = "completion") -> str | None:
    """A warning for the rows (``.answer``, ``.where``) whose reference the math rule reads as no answer, being over
    MAX_MATH_ANSWER_CHARS once its box is taken, or None. Every completion of such a problem scores 0, however right:
    silent until a review (a dataset's answer column holding a whole solution without a box is one)."""
    long = [r for r in rows if r.answer is not None and len(reference_answer(r.answer, "math")) > MAX_MATH_ANSWER_CHARS]
    if not long:
        return None
    more = f" (and {len(long) - 1} more row{'s' if len(long) > 2 else ''})" if len(long) > 1 else ""
    return (f"{long[0].where}: the reference is over {MAX_MATH_ANSWER_CHARS:,} characters{more}, which the math rule "
            f"reads as no answer: every {noun} of its problem scores 0 (an answer column holding a whole "
            f"solution? give the final answer, or box it: its last \\boxed{{}} is the reference)")


@functools.lru_cache(maxsize=1 << 16)
def _math_verify_equal(gold: str, pred: str) -> bool:
    # Cached: sympy parsing costs ~10 ms, and the G completions of a group mostly repeat a few answers.
    if max(len(gold), len(pred)) > MAX_MATH_ANSWER_CHARS:  # before the import: math-verify's (sympy's) costs ~1 s
        return False
    from math_verify import LatexExtractionConfig, parse, verify

    timeout = _math_verify_timeout()
    cfg = [LatexExtractionConfig(boxed_match_priority=0)]
    gold, pred = _for_math_verify(gold), _for_math_verify(pred)
    g = parse(f"$\\boxed{{{gold}}}$", extraction_config=cfg, parsing_timeout=timeout)
    p = parse(f"$\\boxed{{{pred}}}$", extraction_config=cfg, parsing_timeout=timeout)
    if not g or not p:
        return gold.strip() == pred.strip()
    return bool(verify(g, p, timeout_seconds=timeout))


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
