"""The ``math`` answer rule (qerl_cli/answers.py dispatches to it): 1 if math-verify judges the last ``\\boxed{}``
equivalent to the reference (symbolic: ``\\frac{1}{2}`` vs ``0.5``, intervals, sets), with the boxes listed or offered
beside it as one answer (``\\boxed{-2} and \\boxed{1}``, ``$x = \\boxed{-2}$, $x = \\boxed{1}$``, ``\\boxed{72} or
\\boxed{73}`` read as ``-2, 1``, a set: right for a reference of two solutions, wrong for one of either); TeX
math-verify misreads is put in the form it reads: a thin space or space between digit groups (``10\\,000``, read as 10 *
000 = 0), ``30°`` and ``30\\degree`` (no answer), a full stop inside the box (``\\boxed{5.}``, ``\\boxed{(1, 2).}``), a
number and its unit in one text group (``\\text{5 cm}``), a repeating decimal (``0.\\overline{3}``, read as 0) and
e-notation (``1.5e3``, read as 1.5 * e * 3); a choice with its value (``\\textbf{(C)}\\ 12``) is its letter against a
letter reference, else its value; an inequality (``x > 2``) is compared with an interval reference (``(2, \\infty)``) as
math-verify compares it the other way round; an equation of two numbers that differ (``\\boxed{3 = 4}``, read as its
right side) is no answer, as are one of arithmetic (``2 + 1 = 4``) or a chain holding one (``x = 3 = 4``), and an
answer math-verify would cut as its unit past a second value or a hedge (``5\\text{ cm}, 6\\text{ cm}``,
``5\\text{ or 6}``: it drops all from the first text group, so read as 5), or a word there that is no unit (``\\text{5
squared}``, ``5\\text{ pi}``, ``\\text{5 is wrong}``); a scale word is its power of ten (``5\\text{ thousand}``: 5000);
an exact number beside the decimal it rounds to (``\\frac13 = 0.333``) is one answer, right against either (the decimal
against a decimal reference only), with an ellipsis after the decimal too (``\\frac13 = 0.333\\ldots``, ``0.666...`` of
2/3); a dozen is a unit or 12 (``5\\text{ dozen}``: 5 or 60), ``1,000\\text{ thousand}`` a million, ``\\text{A, C}``
the letters. Two boxes side by side with only spacing between (``\\boxed{3} \\boxed{4}``, ``\\hspace{1em}``,
``\\enspace``, ``\\kern``, a slash, a semicolon, a bar, a "vs", any punctuation, ``\\mid``, ``\\lor``, markdown or TeX
bold, an underline, a colour or a size around each) are listed; words after the last box that take it back or offer
another value (``\\boxed{3}. Actually, it is 4.``, ``\\boxed{3} or 4``, ``4 or \\boxed{3}``) make it no answer; words that
deny it leave the box before (``\\boxed{3}, not \\boxed{4}`` is 3, ``$x = \\boxed{3}$, not $x = \\boxed{4}$``, ``\\boxed{3}
dollars, not \\boxed{4}`` and ``\\boxed{3} (_not_ \\boxed{4})`` too; ``\\boxed{-5}, \\boxed{5} (rejecting \\boxed{-5})``
is 5; boxes listed after a denial, ``\\boxed{3}, not \\boxed{4}, \\boxed{5}``, or said to differ, ``\\boxed{3} \\neq
\\boxed{4}``, ``is not``, are no answer), and a
box around a box only dresses it (``\\boxed{\\boxed{2}} \\boxed{\\boxed{3}}`` is ``2, 3``); a box inside a box holding more is
part of it (``\\boxed{\\boxed{2} + 1}`` is ``2 + 1``). Boxes naming two unknowns (``$x = \\boxed{2}$ and $y = \\boxed{3}$``, ``$3x = \\boxed{12}$, $x = \\boxed{4}$``)
are no list: the last box (a hedge, ``$x = \\boxed{3}$ or $y = \\boxed{4}$``, still is
one answer). Without a box, the last closed ``<answer>`` tag is read (R1-Zero's layout, as gsm8k reads it): its content
as a box's (``5``, ``\\frac{1}{2}``, ``$\\frac12$``), or, words around math (``The answer is $\\frac12$.``), what
math-verify's LaTeX extraction reads from it (two spans offered as a hedge, ``$3$ or maybe $4$``, as two boxes: ``3,
4``, as are spans side by side, ``$3$ $4$``, ``$1$ \\quad $2$ \\quad $3$``, the whole run; a span its words take back,
``The answer is $3$. Actually, it is $4$.``, is none; a lone ``$18`` is currency); words alone (``The answer is 5``) are no
answer.
Slower (sympy, ~10 ms a verdict), so verdicts are cached per (reference, answer): the G completions of a group mostly
repeat a few answers. Each parse and comparison is cut at 5 s (scored 0) on the main thread only: math-verify's timeout
is SIGALRM, so scored from another thread a verdict has no time limit (a ``QerlWarning`` says so, once).
"""

from __future__ import annotations

import functools
import itertools
import logging
import re
import threading
import warnings
from collections.abc import Iterator

from qerl_cli.boxes import _BOX_HEDGE, _BOX_LIST, _TEXT_GROUP, _answer_tag, _box_spans, last_boxed
from qerl_cli.errors import QerlWarning

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
# A "\hspace{1em}" leads as a "~" does.
_NAME_LEAD = re.compile(r"(?:\*|~|\}|\\(?:text|textrm|textbf|textit|mbox|hspace\*?)\s*\{[^{}]*\}|[^\x00-\x7f])*")
_NAME_GLUED = re.compile(r"(?:\\(?:(?:arc)?(?:sin|cos|tan|cot|sec|csc)h?|log|ln|lg|exp|det|cdot|times|div|pm|mp|pi)"
                         r"|_\{\w+\}|[\d+\-/^])[ \t]+$")


def _box_name(text: str, box_start: int, after: int = 0) -> tuple[int, str] | None:
    """(where it starts, its unknown) of the name given to the box at ``box_start``: the unknown is the letter of a
    variable's name ("x", "**x", "x_2"), else the whole name ("3x", "2)" of "f(2)", "a+b"), with what it is glued to
    across a space ("\\tan \\theta", "2 x": _NAME_GLUED). A name is short: searched near the box, from ``after``
    (the end of the box before it: "x = \\boxed{2}~\\text{and}~x = " named "\\boxed{2}~\\text{and}~x", no unknown)."""
    m = _BOX_NAME.search(text, max(after, box_start - 40), box_start)
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
# "\hspace{1em}" too: "\boxed{2}\hspace{1em}\text{or}\hspace{1em}\boxed{3}" read as 3 until s57r08.
# "\\enspace", "\\hfill" and their kin too: "\\boxed{3}\\enspace\\boxed{4}" read as 4 until s58r05.
# "\\kern1em", "\\mkern{18mu}", "\\hskip 1em" too: "\\boxed{3}\\kern1em\\boxed{4}" read as 4 until s59r03.
# "\\phantom{x}" and an empty box (no answer: _boxes_from_last skips it) too: each read as 4 until review s59r14.
_SEPARATOR_TEX_SPACE = re.compile(r"\\(?:q?quad|enspace|enskip|hfill?|thinspace|medspace|thickspace|space)(?![A-Za-z])"
                                  r"|\\hspace\*?\s*\{[^{}]*\}|\\[,;:! ()\[\]]|~"
                                  r"|\\[hv]?phantom\s*\{[^{}]{0,40}\}|\\(?:boxed|fbox)\s*\{\s*\}"
                                  r"|\\(?:m?kern|hskip)\s*(?:\{\s*-?[\d.]{1,8}\s*[a-z]{2}\s*\}|-?[\d.]{1,8}\s*[a-z]{2}(?![A-Za-z]))")
# Any text group: "\quad\mathrm{or}\quad" and "\textbf{or}" hedge as "\text{or}" does (only \text{} read until a review:
# their hedge was the last box alone, rewarded for its second value).
_SEPARATOR_TEX_TEXT = re.compile(_TEXT_GROUP.format("text|textrm|textnormal|textbf|textit|mathrm|mbox"))


def _plain_separator(between: str) -> str:
    """The words between two boxes with their TeX spacing and ``\\text{}`` groups taken off (the math rule's only:
    the gsm8k rule's verdicts are released as they stand)."""
    return _SEPARATOR_TEX_SPACE.sub(" ", _SEPARATOR_TEX_TEXT.sub(r" \1 ", between))  # "\quad\text{or}": not "\quador"


# Nothing but spacing between two boxes on a line: "\boxed{3} \boxed{4}", "$\boxed{3}$ $\boxed{4}$",
# "\boxed{3}\hspace{1em}\boxed{4}" offer two answers, as a list does (read as the last, 4, until s57r08: a human
# grader marks two answers wrong for either). Markdown bold around each ("**\\boxed{3}** **\\boxed{4}**") and a slash
# between ("\\boxed{3} / \\boxed{4}", "3 or 4") too: each read as the last box, right for 4, until s58r05. A semicolon, a
# bar or a "vs" between ("\\boxed{3}; \\boxed{4}", "\\boxed{3} | \\boxed{4}", "\\boxed{3} \\text{ vs } \\boxed{4}") lists
# them as a comma does: each read as 4 until s59r03 (a "\\quad \\text{vs} \\quad" too: _plain_separator's spacing).
# Review s59r14: the bar's TeX and its doubles ("\\mid", "\\vert", "\\|", "||", "\\parallel"), a logical or ("\\lor",
# "\\vee"), a dash, a colon, a question mark, a full stop, brackets ("\\boxed{3} (\\boxed{4})"), an ellipsis, an "&",
# a hedge's word ("maybe", "perhaps", "alternatively", "otherwise", an "or" in brackets: "\\text{ (or) }") and a run of
# them ("\\boxed{3}, maybe \\boxed{4}"):
# punctuation is no words, so no correction; each read as 4 until then. Not an operator or a relation ("+", "=",
# "\\to"): "\\boxed{2} + \\boxed{3} = \\boxed{5}" is a sum, its last box the answer.
_SEPARATOR_TOKEN = (r"[/;|:?.,()\[\]&\-–—∣│‖⎮∨]|\.\.\.|\^\{?\*\}?|\\(?:mid|[lr]?[vV]ert|\||parallel|lor|vee|slash|colon|&|\{|\}|[lc]?dots|"
                    r"left|right|[bB]ig{1,2}[lr]?)(?![A-Za-z])"
                    r"|(?i:vs\.?|versus|or|maybe|perhaps|possibly|alternatively|otherwise|else)(?![A-Za-z])")
_SIDE_BY_SIDE = re.compile(rf"[ \t$*]*(?:(?:{_SEPARATOR_TOKEN})[ \t$*]*){{0,6}}")
# A box in bold, "\\textbf{\\boxed{3}}", "$\\mathbf{\\boxed{3}}$": the box is the bold group's, whose braces stood
# between two such boxes as words (read as the last box, right for 4, until s58r05). Searched near the box.
# An underline is one ("\\underline{\\boxed{2}}, \\underline{\\boxed{3}}" read as 3 until s59r03).
# Review s59r14: any group that only dresses it, a colour ("\\textcolor{red}{\\boxed{2}}", "{\\color{red}\\boxed{2}}"),
# an overline, italics, roman or text, a size, a bare group: each read as the last box, right for 3, until then. A
# declaration ("\\color{red}", "\\large", "\\displaystyle") has no group of its own to close: the box's start only.
# A box around the box ("\\boxed{\\boxed{2}}", "\\fbox{\\boxed{2}}") dresses it too: _dressed_boxes reads the one around.
_BOLD_OPEN = re.compile(r"(?:\\(?:textbf|mathbf|boldsymbol|bm|underline|overline|textit|mathit|emph|textrm|mathrm|text|mbox"
                        r"|large|Large|LARGE|huge|Huge)\s*|\\(?:textcolor|colorbox)\s*(?:\[[^\[\]{}]{0,20}\])?\s*\{[^{}]{0,30}\}\s*"
                        r"|(?<![\w}\]^_\\]))\{\s*$")
_BOLD_CLOSE = re.compile(r"\s*\}")
_DECLARATIONS = re.compile(r"(?:\\(?:color\s*(?:\[[^\[\]{}]{0,20}\])?\s*\{[^{}]{0,30}\}|large|Large|LARGE|huge|Huge|"
                           r"displaystyle|textstyle|bf|bfseries|boldmath)(?![A-Za-z])\s*)+$")


def _bold_widened(text: str, box: tuple[str, int, int]) -> tuple[str, int, int]:
    """A box (_boxes_from_last's) with the bold groups (and the dress: _BOLD_OPEN, _DECLARATIONS) it alone fills taken
    as its own start and end."""
    content, start, end = box
    for _ in range(4):  # "\\textbf{$\\mathbf{...}$}" at most: nesting deeper is no answer's layout
        declared = _DECLARATIONS.search(text, max(0, start - 60), start)
        start = start if declared is None else declared.start()
        opened = _BOLD_OPEN.search(text, max(0, start - 60), start)
        closed = _BOLD_CLOSE.match(text, end)
        if opened is None or closed is None:
            break
        start, end = opened.start(), closed.end()
    return content, start, end


def _outer_boxes(text: str) -> Iterator[tuple[str, int, int]]:
    """The boxes (_box_spans) less those inside another, that one read with them unwrapped (_unboxed): the box
    around is the answer ("\\boxed{\\boxed{2}, 3}" is "2, 3", "\\boxed{\\boxed{2} + 1}" is "2 + 1", "\\boxed{\\boxed{2}}"
    is 2). Review s60r07: the box inside was read as the last, and math-verify reads a box inside a box too: each was 2,
    a wrong answer scored 1, and a hedge ("\\boxed{3 \\text{ or } \\boxed{2}}") rewarded for its second value."""
    held: list[tuple[tuple[int, int, int, int], list[tuple[int, int, int, int]]]] = []  # each with the boxes inside it
    for span in reversed(list(_box_spans(text))):  # first to last: a box that starts inside the one before is in it
        if held and span[0] < held[-1][0][3]:
            held[-1][1].append(span)
        else:
            held.append((span, []))
    for (start, inner, inner_end, end), inside in reversed(held):
        yield _unboxed(text, inner, inner_end, inside), start, end


def _unboxed(text: str, inner: int, inner_end: int, inside: list[tuple[int, int, int, int]]) -> str:
    """The content ``text[inner:inner_end]`` of a box with the boxes ``inside`` it (_box_spans') unwrapped: their
    "\\boxed{" and "}" taken off."""
    cuts = sorted([(start, content) for start, content, _, _ in inside] + [(content_end, end) for _, _, content_end, end in inside])
    pieces, at = [], inner
    for cut, cut_end in cuts:
        pieces.append(text[at:cut])
        at = max(at, cut_end)  # a bare box's token may hold the closing brace of the box around it: "\\boxed{\\boxed 2}"
    return ("".join(pieces) + text[at:inner_end]).strip()


def _dressed_boxes(text: str) -> Iterator[tuple[str, int, int]]:
    """The boxes no box holds (_outer_boxes), each with its dress (_bold_widened). A box around a box only dresses it
    ("\\boxed{\\boxed{2}}" is 2): yielded beside it, the box around stood between two such boxes as words
    ("\\boxed{\\boxed{2}} \\boxed{\\boxed{3}}" read as 3, right for the second of two answers offered) and, under gsm8k,
    as another answer beside its own ("\\boxed{\\boxed{18}}" was none from review s59r14 to review s60r02)."""
    return (_bold_widened(text, box) for box in _outer_boxes(text))


# Words between two boxes that deny the later one: "\\boxed{3}, not \\boxed{4}", "\\boxed{3} (not \\boxed{4})",
# "\\boxed{3} rather than \\boxed{4}", "$x = \\boxed{5}$ (rejecting \\boxed{-5})": the answer is the box before. Read as
# words, a correction, they gave the denied box, 4: a wrong answer scored 1 (and the right one 0) until review s60r02.
# A dash or Markdown emphasis around the word too, "\\boxed{3} - not - \\boxed{4}", "(_not_ \\boxed{4})" (4 until review
# s60r13: "_" is a word's, so "\\b" found no end to "not"), "though not" and the answer's pronoun, "\\boxed{3}, which is
# not \\boxed{4}", "\\boxed{18} dollars. It is not \\boxed{19}" (4 and 19 until then).
_BOX_DENIAL = re.compile(r"[ \t$.,;:)\]*_(—–-]*(?:(?:and|but|(?:al)?though|yet)[ \t]+|(?:which|that|it|this)[ \t]+is[ \t]+)?"
                         r"(?:not|rather[ \t]+than|instead[ \t]+of|rejecting|discarding|excluding)(?![A-Za-z0-9])[ \t$(\[*_—–-]*",
                         re.IGNORECASE)
# The box's unit between it and the denial: "\\boxed{18} dollars, not \\boxed{19}", "$\\boxed{5}$ cm (not $\\boxed{6}$)",
# "\\boxed{18}\\text{ dollars}, not" (read as words, a correction, 19 until review s60r13: a wrong answer scored 1).
# Words right after the box, as _UNIT_AFTER reads a word after a number: in lower case, three at most ("square feet",
# "miles per hour"), then the denial's punctuation or "and"/"but"; or words that say the box is the answer
# ("\\boxed{3} is the answer, not \\boxed{4}", "is correct": 4 until then too). Not a question ("\\boxed{3}? Why not
# \\boxed{4}", "why not", "if not"), nor words that say the box is wrong ("\\boxed{3} is wrong, not \\boxed{4}", "fails"),
# nor a take-back (_denies): each still a correction, 4. A verb that says so in any form, "failed", "failing",
# "miscounted", "contradicts", "violates" (3, a wrong answer scored 1, from review s60r13 to review s60r16: "fails" only).
_UNIT_WORD = (r"(?!(?:is|are|was|were|be|why|how|what|if|or|nor|and|but|so|then|maybe|perhaps|fail\w*|wrong|incorrect|false"
              r"|invalid|reject\w*|extraneous|impossible|eliminat\w*|exclud\w*|discard\w*|ruled|not|rather|instead"
              r"|mis(?:count|calculat|read)\w*|(?:over|under|double)count\w*|contradict\w*|violat\w*)(?![A-Za-z]))"
              r"[a-z][\w^{}/]*")
_UNIT_BEFORE_DENIAL = re.compile(rf"[ \t$*]*(?:{_UNIT_WORD}(?:[ \t]+{_UNIT_WORD}){{0,2}}|(?:is|was)[ \t]+(?:correct|right"
                                 r"|the[ \t]+(?:(?:final|correct|right)[ \t]+)?answer))"
                                 r"(?=[ \t$*]*(?:[.,;:(\[—–-]|(?:and|but)[ \t]+not\b))")
# Two boxes said to differ, "\\boxed{3} \\neq \\boxed{4}", "\\boxed{3} is not \\boxed{4}": which is the answer the words do
# not say (read as the last, 4, until review s60r13): no answer.
_BOX_INEQUALITY = re.compile(r"[ \t$]*(?:\\neq?(?![A-Za-z])|\\not[ \t]*="
                             r"|≠|is[ \t]+not(?:[ \t]+equal[ \t]+to)?|isn't|does[ \t]+not[ \t]+equal|doesn't[ \t]+equal)[ \t$]*",
                             re.IGNORECASE)


def _denies(between: str) -> bool:
    """Whether the words between two boxes (_plain_separator's) deny the later one: a denial (_BOX_DENIAL), after the
    box's unit at most (_UNIT_BEFORE_DENIAL)."""
    unit = _UNIT_BEFORE_DENIAL.match(between)
    back = None if unit is None else _TAKE_BACK.search(between)  # in all of it: "no", "oh" are one before a comma
    start = 0 if unit is None or (back is not None and back.start() < unit.end()) else unit.end()
    return _BOX_DENIAL.fullmatch(between, start) is not None


def _without_denied_boxes(text: str) -> str:
    """``text`` less each last box its words deny (_denied_boxes)."""
    return _denied_boxes(text)[0]


def _denied_boxes(text: str) -> tuple[str, frozenset[str]]:
    """(``text`` less each last box its words deny (_denies) with those words, the denied boxes' contents, spaces
    taken out): "\\boxed{3}, not \\boxed{4}." is "\\boxed{3}.", whose box and the words after it are then read as ever.
    Its unknown's name is no words ("$x = \\boxed{3}$, not $x = \\boxed{4}$": 4 until review s60r07, as math_boxes reads
    a list of named boxes). All of a run ("\\boxed{2}, not \\boxed{3}, not \\boxed{4}"): cut at 16, the 17th box from
    the last, denied, was the answer."""
    boxes = _dressed_boxes(text)
    last = kept = next(boxes, None)
    denied = set()
    for before in boxes:
        name = _box_name(text, kept[1], before[2])
        named = name is not None and _is_unknown(name[1])
        if not _denies(_plain_separator(text[before[2] : name[0] if named else kept[1]])):
            break
        denied.add("".join(kept[0].split()))
        kept = before
    return (text if kept is last else text[: kept[2]] + text[last[2] :]), frozenset(denied)


def _with_end_before(boxes: Iterator[tuple[str, int, int]]) -> Iterator[tuple[str, int, int, int]]:
    """_boxes_from_last's boxes, each with the end of the box before it in the text (0: none), which its name may not
    reach back past (a box nested in another: past its own start, so no name)."""
    box = next(boxes, None)
    for before in boxes:
        yield (*box, before[2])
        box = before
    if box is not None:
        yield (*box, 0)


def math_boxes(text: str) -> str | None:
    """The math rule's answer: the last box, with the boxes listed or offered beside it ("\\boxed{-2} and \\boxed{1}",
    "$x = \\boxed{-2}$, $x = \\boxed{1}$", "\\boxed{72} or \\boxed{73}") joined into one ("-2, 1"), as math-verify joins
    them: a reference of two solutions, "1, -2", was scored against the last box alone (0), and a one-value
    reference, "1", rewarded the second of two answers listed. A list of one answer restated ("\\boxed{\\frac12} or
    \\boxed{0.5}") is that answer; a correction on a new line or after other words is not a list, nor are boxes named
    as values of two unknowns ("$x = \\boxed{2}$ and $y = \\boxed{3}$": one of them may be what the question asks,
    "$3x = \\boxed{12}$, $x = \\boxed{4}$": a step and the answer). A box its words deny is none of the list ("\\boxed{-5},
    \\boxed{5} (rejecting \\boxed{-5})" is 5), and boxes said to differ (_BOX_INEQUALITY) or listed after a denial
    ("\\boxed{18}, not \\boxed{19}, \\boxed{20}": is 20 denied too?) are no answer."""
    text, denied = _denied_boxes(text)
    boxes = _with_end_before(_dressed_boxes(text))
    last = next(boxes, None)
    if last is None:
        return None
    listed, start = [last[0]], last[1]
    name = _box_name(text, start, last[3])
    for box, box_start, end, end_before in boxes:
        if len(listed) > MAX_LISTED_BOXES:  # a degenerate run of boxes: one verdict each below would cost seconds
            return None
        named = name is not None and name[0] >= end and _is_unknown(name[1])  # a variable's name between the two
        between = _plain_separator(text[end : name[0] if named else start])
        hedged = _BOX_HEDGE.fullmatch(between)
        if not (hedged or _BOX_LIST.fullmatch(between) or _SIDE_BY_SIDE.fullmatch(between)):
            if _BOX_INEQUALITY.fullmatch(between) or (len(listed) > 1 and _denies(between)):
                return None  # each read as the last boxes, "4", "19, 20", until review s60r13
            break
        earlier = _box_name(text, box_start, end_before)
        if named and not hedged and earlier is not None and earlier[1] != name[1]:
            # "$x = \boxed{2}$ and $y = \boxed{3}$", "$3x = \boxed{12}$, $x = \boxed{4}$": values of two unknowns. A
            # list only: "$x = \boxed{3}$ or $y = \boxed{4}$" is a hedge (read as 4 until a review, though math 1
            # refused it), one answer "3, 4", wrong for either
            break
        listed.append(box)
        start, name = box_start, earlier
    # a box denied after the list: "-5, 5" until review s60r13, right against a reference of both; not the list's
    # all, whose value then is no denied one's: "\\boxed{25}, not \\boxed{25}\\%", "\\boxed{6} cm, not \\boxed{6} mm" deny
    # the unit (none from review s60r13 to review s60r16, a right answer scored 0; 25 and 6 before, as gsm8k reads them)
    listed = [box for box in listed if "".join(box.split()) not in denied] or listed
    found = listed[0] if all(_math_verify_equal(box, listed[0]) for box in set(listed) - {listed[0]}) else \
        ", ".join(reversed(listed))
    before = _plain_separator(text[text.rfind("\n", max(0, start - 80), start) + 1 : start])  # its line, near it
    return None if _hedged_after_box(text[last[2]:], found) or _hedged_before_box(before, found) else found


# What after the last box offers another value or takes it back: a hedge's "or" on its line ("\\boxed{3} or 4",
# "\\boxed{3} (or maybe $4$)", "\\boxed{3}. Or 4."), or a take-back word anywhere after it ("\\boxed{3}. Actually, it is
# 4.", "Hmm, I think it's 4"): each read as the box, right for 3, until review s59r14 (a take-back in a tag was none
# from s59r03). The values it names: a math span, or a number outside one (an arithmetic chain, "1 + 2 = 3", read as
# its last side, as math-verify reads an equation; a percent, "50\\%", as a half).
_AFTER_BOX_HEDGE = re.compile(r"[ \t$.,;:)\]*(]*(?:and/)?or\b(?!\s+rather\b)([^\n]{0,40})", re.IGNORECASE)
_PROSE_VALUE = re.compile(r"\$\$([^$]*)\$\$|\$([^$]*)\$|\\\(((?:(?!\\[()]).)*)\\\)|\\\[((?:(?!\\[\[\]]).)*)\\\]"
                          r"|(?<![\w.{^_\\])(-?\d+(?:,\d{3})*(?:\.\d+)?(?:[ \t]*[-+*/=×÷][ \t]*-?\d+(?:,\d{3})*(?:\.\d+)?){0,20}"
                          r"(?:\\?%)?)(?!\w)", re.DOTALL)
# A number a word follows in a hedge: the quantity restated in another unit ("\\boxed{1.5} (or 90 minutes)"), not a value.
_UNIT_AFTER = re.compile(r"[ \t]*[A-Za-z]{2}")


def _prose_values(text: str, start: int = 0, units: bool = True) -> Iterator[str]:
    """The values _PROSE_VALUE finds in ``text`` from ``start`` (a few: a degenerate run costs nothing), with or without
    the numbers a unit follows."""
    for m in itertools.islice(_PROSE_VALUE.finditer(text, start), MAX_LISTED_BOXES):
        number = m.group(5)
        if number is None:
            yield next(g for g in m.groups() if g is not None).strip()
        elif units or _UNIT_AFTER.match(text, m.end()) is None:
            yield number.replace(",", "")


# A value offered right before the (first listed) box, "4 or \\boxed{3}", "$4$ or $\\boxed{3}$": read as 3 until review
# s59r14. Not one named ("$x = -4$ or $x = \\boxed{3}$": the box's name stands between, the solution it picks).
_BEFORE_BOX_HEDGE = re.compile(r"(?:(?<![\w.{^_\\])(-?\d+(?:\.\d+)?)|\$([^$]{1,40})\$)[ \t$.,;:)\]*]*\bor[ \t$(\[*]*$",
                               re.IGNORECASE)


def _hedged_before_box(before: str, found: str) -> bool:
    """Whether the words ``before`` the box on its line end by offering another value than its answer ``found``."""
    m = _BEFORE_BOX_HEDGE.search(before)
    return m is not None and not _math_verify_equal(found, (m.group(1) or m.group(2)).strip())


def _hedged_after_box(after: str, found: str) -> bool:
    """Whether the words ``after`` the last box offer another value beside its answer ``found``, or take it back before
    one (a check that restates it, "Wait, let me check: 1 + 2 = 3", takes nothing back): no answer, as a tag's span
    its words take back (_taken_back) is none."""
    line = _plain_separator(after.split("\n", 1)[0])
    hedge = _AFTER_BOX_HEDGE.match(line)
    offered = [] if hedge is None else list(_prose_values(hedge.group(1), units=False))
    word = _TAKE_BACK.search(after)
    later = [] if word is None else list(_prose_values(after, word.end()))
    return any(not _math_verify_equal(found, value) for value in offered + later)


def math_answer(text: str) -> str | None:
    """The math rule's answer in ``text`` (a completion past its thought: extract_answer), raw TeX, or None."""
    # "\boxed{-2} and \boxed{1}" is "-2, 1"; "\boxed{\frac12} or \boxed{0.5}" is one answer; else the <answer> tag
    found = math_boxes(text)
    return found if found is not None else _math_tag(text)


def math_reference(reference: str) -> str:
    """A dataset's reference as the math rule reads it (reference_answer): its last box, else all of it."""
    return last_boxed(reference) or reference.strip()


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
# A number with its unit inside one text group, "\text{5 cm}", "\text{4 square units}", "\text{5.}": latex2sympy read
# the group as one symbol (0 however right), where "5\text{ cm}" is 5. The unit is words, a power at most ("cm^2"):
# no other number ("\text{3 apples and 4 pears}"), nor a hedge or bound ("\text{5 or more}", "\text{5 to 6}").
# A hedge or bound word in any case ("\text{5 OR SIX}" was read as 5 until s57r14).
_HEDGE_WORD = r"(?i:\b(?:or|and|to|than|more|less|least|most|about|approximately)\b)"
_TEXT_NUMBER = re.compile(r"\\(?:text|textrm|textnormal|mathrm|mbox)\s*\{\s*(-?\d+(?:\.\d+)?)"
                          rf"(?:\s{{1,3}}(?![^{{}}]*{_HEDGE_WORD})"
                          r"([A-Za-z][A-Za-z /.]{0,40}(?:\^\d)?))?\s{0,3}\.?\s{0,3}\}")  # bounded: linear on a run of spaces
# A repeating decimal, "0.\overline{3}", "0.1\overline{6}", "1.\bar{3}": latex2sympy read the bar as a product with a
# symbol, 0.\overline{3} as 0 (a reference of 1/3 was right for "\boxed{0}"). Its exact fraction (3/9, 15/90).
_REPEATING_DECIMAL = re.compile(r"(?<![\d.])(\d{0,50})\.(\d{0,50})\\(?:overline|bar)\s*(?:\{(\d{1,50})\}|(\d))")
# A number in e-notation, "1.5e3", "2E6": latex2sympy read it as 1.5 * e * 3. Unsigned exponents only: "2e-1" and
# "2e+1" may be 2e - 1 and 2e + 1.
# An ellipsis after a decimal, ending the answer or an equation's side: "0.333...", "0.333\\dots", "0.333\\cdots",
# "0.333…". math-verify reads "0.333\\ldots" as 0.333 but "0.333..." and "0.333\\dots" as no answer and "0.333\\cdots"
# as 0.333 * s; each is written "\\ldots" (no answer, or "\\frac13 = 0.333 s", until s59r03: _approximation reads it).
# The decimal a whole side (after the start, "=" or "\\approx"): after a sum's last term, "1 + 0.5 + 0.25...", the
# ellipsis is the sum going on, not the term's digits (read as 1.75 from s59r03 to review s59r09; none again).
_DECIMAL_ELLIPSIS = re.compile(r"(?:^|(?<==)|(?<=\\approx))(\s{0,3}-?\s{0,3}\d*\.\d{1,50})\s{0,3}"
                               r"(?:\\(?:[lc]?dots[cb]?|ldotp\\ldotp\\ldotp)|\.{3}|…)(?![A-Za-z])(?=\s{0,3}(?:=|$))")
_E_NOTATION = re.compile(r"(?<![\w.\\])(\d+(?:\.\d+)?)[eE](\d{1,3})(?![\w.])")


def _text_number(m: re.Match) -> str:
    return m.group(1) if m.group(2) is None else f"{m.group(1)}\\text{{ {m.group(2).strip()}}}"


def _repeating_decimal(m: re.Match) -> str:
    whole, fixed, repeat = m.group(1), m.group(2), m.group(3) or m.group(4)
    den = 10 ** len(fixed) * (10 ** len(repeat) - 1)
    return f"\\frac{{{int(whole or 0) * den + int(fixed + repeat) - int(fixed or 0)}}}{{{den}}}"


# math-verify drops a unit as all from an answer's first text group to its end, where that ends in a group
# (latex2sympy2_extended's "(\\(?:text|mbox){.*?})(\^\d|\{\^\d\})?$", after \mathrm and \textbf become \text and
# "\text{ or }" a comma): "5\text{ cm}, 6\text{ cm}", "\boxed{5\text{ cm}} or \boxed{6\text{ cm}}" and "5\text{ or 6}" read
# as 5, a list or hedge right for its first value (s57r14).
_TEXT_OR = re.compile(r",?\s*\\(?:text(?:normal|bf|it|rm)?|math(?:rm|it|bf))\{\s*(?:and|or)\s*\}")
_TEXT_COMMAND = r"\\(?:text(?:normal|bf|it|rm)?|math(?:rm|it|bf)|mbox)"
_FIRST_TEXT = re.compile(_TEXT_COMMAND + r"\{")
# Words math-verify drops as a unit that are none: a scale of or an operation on the number before them
# ("5\\text{ squared}", "\\text{5 thousandths}", "5\\text{ pi}"), or the answer's own denial ("\\text{5 is wrong}"):
# each read as 5 until s58r05. The first word only for the former ("5\\text{ cm squared}" is 5 square centimetres).
# A scale in the plural too, and any fraction's name ("5\\text{ hundreds}", "5\\text{ twelfths}" read as 5 until s58r08),
# not "months".
# "plus"/"minus" anywhere (review s59r09): "5\\text{ plus one}", "5\\text{ dozen minus one}" read as 5 (and as 60).
_NOT_A_UNIT = re.compile(r"^\W*(?:(?:hundred|thousand|million|billion|trillion)s?|squared|cubed|factorial|pi|halves|thirds|"
                         r"quarters|(?:four|fif|six|seven|eigh|nin|ten|eleven|twelf|\w+teen|\w+tie|hundred|thousand|million)ths)\b"
                         r"|\b(?:not|wrong|incorrect|false|isn't|plus|minus)\b", re.IGNORECASE)
_TEX_COMMAND_OR_BRACE = re.compile(r"\\[A-Za-z]+|[{}]")
# A number's scale in a text group after it, "5\\text{ thousand}", "\\text{2.5 million dollars}" (made "2.5\\text{
# million dollars}" by _TEXT_NUMBER): 5 thousand read as 5, right against 5 and wrong against 5000, until s58r05. Its
# power of ten, the rest of the group left as the unit.
_SCALES = {"hundred": 2, "thousand": 3, "million": 6, "billion": 9, "trillion": 12}
# A number with a thousands comma too, "1,000\\text{ thousand}", "1{,}500\\text{ million}" (no answer until s59r03); not
# "1,5" (a decimal comma, or a list) nor the "5" of "2, 5".
_SCALE_WORD = re.compile(r"(?<![\w.,])((?:\d{1,3}(?:(?:,|\{,\})\d{3})+(?!\d)|\d+)(?:\.\d+)?)(?:\\[,;: ]|~|\s){0,3}" + _TEXT_COMMAND
                         + r"\{\s{0,3}(hundred|thousand|million|billion|trillion)s?\b([^{}]{0,60})\}", re.IGNORECASE)


def _scale_word(m: re.Match) -> str:
    rest = m.group(3).strip()
    number = m.group(1).replace("{,}", "").replace(",", "")
    return f"{number} \\times 10^{{{_SCALES[m.group(2).lower()]}}}" + (f"\\text{{ {rest}}}" if rest else "")
# A count of dozens, "5\\text{ dozen}", "\\text{5 dozen eggs}" (made "5\\text{ dozen eggs}" by _TEXT_NUMBER): the dozen is
# a unit (right against 5, where the question counts dozens) and a scale, 60 (0 against 60 until s59r03): either. The
# whole answer, a few words after it at most, none a hedge's ("5\\text{ dozen or more}" stays none), nor another dozen
# or a scale ("5\\text{ dozen dozen}", "5\\text{ dozen thousand}": read as 60 until review s59r09, _NOT_A_UNIT's).
_DOZENS = re.compile(r"\s*(\d+(?:\.\d+)?)(?:\\[,;: ]|~|\s){0,3}" + _TEXT_COMMAND
                     + rf"\{{\s{{0,3}}dozens?\b(?![^{{}}]*(?:{_HEDGE_WORD}|(?i:\bdozen)))((?:\s{{1,3}}[A-Za-z]+){{0,3}})"
                     r"\s{0,3}\}\s*", re.IGNORECASE)
_UNIT_POWER = re.compile(r"\}(?:\^\{?-?\d\}?|\{\^\d\})?\s*$")


def _unit_cut_drops_answer(tex: str) -> bool:
    """Whether what math-verify would drop from ``tex`` as its unit holds more than a unit: a number past the unit's
    own power, a hedge or bound word ("\\text{ or more}"), or a word that is no unit (_NOT_A_UNIT). Such an answer is
    none."""
    tex = _TEXT_OR.sub(",", tex)
    first = _FIRST_TEXT.search(tex)
    power = _UNIT_POWER.search(tex)
    if first is None or power is None or not tex[: first.start()].strip():
        return False
    dropped = tex[first.start() : power.start()]
    words = _TEX_COMMAND_OR_BRACE.sub(" ", dropped)
    return re.search(rf"\d|{_HEDGE_WORD}", dropped) is not None or _NOT_A_UNIT.search(words) is not None


# Letters listed in one text group, the whole answer: "\\text{A, C}" (MATH's "which of these" references). latex2sympy
# read the group as one symbol, so "\\boxed{A, C}" (a set of two letters) was wrong against it until s59r03: the letters.
# A second reading, beside the text's (_math_verify_equal): math-verify compares text groups as text, which took
# "\\textit{A, C}", "\\text{(A), (C)}", "\\text{A and C}" and "\\text{A, C}." for "\\text{A, C}"; read as letters in
# their stead (s59r03), each against a reference turned into letters, they were wrong (review s59r09).
_TEXT_LETTERS = re.compile(r"\\(?:text|textrm|textbf|mathrm)\s*\{\s*([A-Z](?:\s{0,3},\s{0,3}[A-Z]){1,25})\s*\}")


def _letters(tex: str) -> str:
    """``tex``, or the letters of a text group that lists only letters (_TEXT_LETTERS): "\\text{A, C}" is "A, C"."""
    m = _TEXT_LETTERS.fullmatch(tex.strip())
    return tex if m is None else m.group(1)


def _for_math_verify(tex: str) -> str:
    """An answer's TeX in the forms math-verify reads (see each pattern)."""
    tex = _TEXT_NUMBER.sub(_text_number, tex.strip())
    tex = _SCALE_WORD.sub(_scale_word, tex)
    tex = _DIGIT_GROUP_SPACE.sub("", tex)
    tex = _DEGREE_SIGN.sub(r"^\\circ", tex)
    tex = _REPEATING_DECIMAL.sub(_repeating_decimal, tex)
    tex = _E_NOTATION.sub(r"\1 \\times 10^{\2}", tex)
    tex = _DECIMAL_ELLIPSIS.sub(r"\1\\ldots", tex)
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
    """``found``, math-verify's reading of a tag's prose, unless the math span it reads is one of a run offered as a
    hedge, as boxes are (_BOX_HEDGE), or side by side (_SIDE_BY_SIDE): then the run as one answer, as math_boxes
    reads "\\boxed{3} or maybe \\boxed{4}" and "\\boxed{1} \\boxed{2} \\boxed{3}". math-verify joins spans by a bare
    "or" only: "$3$ or maybe $4$" read as 4, a hedge scored right, and "$3$ $4$" as 4 ("The answer is $3$ $4$" as 3).
    The whole run: only the last two spans were looked at until s58r05, so "$1$ $2$ $3$" read "2, 3" and "The answer
    is $3$ or maybe $4$" (math-verify's "answer is" span, the hedge's first) 3, each right for a reference it hedged."""
    spans = list(_ONE_MATH_SPAN.finditer(tex))
    if found is None or len(spans) < 2:
        return found
    values = [[g for g in m.groups() if g is not None][0].strip() for m in spans]
    read = _span_read(found, values)
    if read is None:
        return found
    first = last = read
    while first > 0 and _spans_join(tex, spans[first - 1], spans[first]):
        first -= 1
    while last + 1 < len(spans) and _spans_join(tex, spans[last], spans[last + 1]):
        last += 1
    run = values[first : last + 1]
    if len(run) > MAX_LISTED_BOXES or _taken_back(tex, spans[last].end(), spans, values, found):
        return None  # a degenerate run, as of boxes; or a reading its own words take back
    if all(_math_verify_equal(value, run[-1]) for value in set(run) - {run[-1]}):
        return found
    return ", ".join(run)


# Words that take back what was said before them: "Actually, it is $4$", "Wait, no: $4$", "I mean $4$", "Sorry, $4$".
# Review s59r09: a contrast or a noun is none ("$3$ rather than $4$", "instead of $4$", "A common mistake is $4$", "the
# wrong answer $4$": right answers no answer from s59r03), a mistake only owned ("That was wrong: $4$"); and the
# take-backs the list missed ("On second thought, it is $4$", "Scratch that", "Hmm", "Nope", "Oh,", "My bad", "Let me
# redo this: $4$", "Hmm, no — $4$": each read as the answer taken back, right for it).
_TAKE_BACK = re.compile(r"\b(?:actually|wait|(?:no|oh|err)(?=\s*[,.:;!—–-])|nope|sorry|oops|hmm+|I mean|my bad|correct(?:ion|ing|ed)|"
                        r"rather(?!\s+than)|instead(?!\s+of)|(?:mistake|wrong|incorrect)(?=\s*(?:[,.:;!)—–-]|$))|mistaken|"
                        r"second thought|scratch that|hold on|not quite|re(?:do|calculat\w*|comput\w*|consider\w*|think\w*))\b",
                        re.IGNORECASE)


def _taken_back(tex: str, end: int, spans: list[re.Match], values: list[str], found: str) -> bool:
    """Whether words after math-verify's reading (its run ends at ``end``) take it back before a span of another value:
    "The answer is $3$. Actually, it is $4$." (math-verify reads its "answer is" span, 3) corrects 3 to 4, as
    "\\boxed{3}. Actually, it is \\boxed{4}." does (read as 4), but read as 3 until s59r03, right for the answer
    taken back. No answer: what follows a take-back need not be the answer ("Actually, $4$ is wrong"). A check that
    restates the value ("Wait, let me check: $1 + 2 = 3$") takes nothing back."""
    word = _TAKE_BACK.search(tex, end)
    if word is None:
        return False
    later = [value for m, value in zip(spans, values) if m.start() >= word.end()][:MAX_LISTED_BOXES]
    return any(not _math_verify_equal(found, value) for value in later)


def _span_read(found: str, values: list[str]) -> int | None:
    """The index of the (last) span math-verify's reading ``found`` is: by text first, then by value (its reading is
    its normal form, "6" of "$6\\text{ cm}$"), the latter on the last MAX_LISTED_BOXES spans and the first (an "answer
    is" span) only: a verdict each costs ~10 ms."""
    same = [i for i, value in enumerate(values) if value == found]
    if same:
        return same[-1]
    near = sorted({0, *range(max(0, len(values) - MAX_LISTED_BOXES), len(values))}, reverse=True)
    return next((i for i in near if _math_verify_equal(values[i], found)), None)


def _spans_join(tex: str, before: re.Match, after: re.Match) -> bool:
    """Whether two math spans in a tag are offered together: nothing but spacing between, or a hedge's "or" (TeX
    spacing and text groups as between two boxes: "$3$ \\quad $4$", "$3$ \\text{or} $4$" read as 4 until s57r14); not
    side by side as values of two unknowns, as boxes are not (math_boxes)."""
    between = _plain_separator(tex[before.end() : after.start()])
    if _BOX_HEDGE.fullmatch(between):
        return True
    return bool(_SIDE_BY_SIDE.fullmatch(between)) and not _two_unknowns(before, after)


# A span's name, the left side of its "=": "x" of "$x = 3$", "3x" of "$3x = 12$".
_SPAN_NAME = re.compile(r"\s*([^=<>]{1,40}?)\s*=(?!=)")


def _two_unknowns(before: re.Match, after: re.Match) -> bool:
    """Whether two spans give values of two unknowns, "$x = 3$; $y = 4$", "$3x = 12$; $x = 4$" (a step and the answer):
    the later named by a variable, the earlier by another name. A list of them ("x = 3, y = 4") was wrong against 4 once
    a semicolon, a bar or a "vs" joined spans (s59r03; right before, as boxes so named still are: review s59r09)."""
    later, earlier = (_SPAN_NAME.match(next(g for g in m.groups() if g is not None)) for m in (after, before))
    return (later is not None and _is_unknown(later.group(1)) and earlier is not None
            and earlier.group(1) != later.group(1))


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
    long = [r for r in rows if r.answer is not None and len(math_reference(r.answer)) > MAX_MATH_ANSWER_CHARS]
    if not long:
        return None
    more = f" (and {len(long) - 1} more row{'s' if len(long) > 2 else ''})" if len(long) > 1 else ""
    return (f"{long[0].where}: the reference is over {MAX_MATH_ANSWER_CHARS:,} characters{more}, which the math rule "
            f"reads as no answer: every {noun} of its problem scores 0 (an answer column holding a whole "
            f"solution? give the final answer, or box it: its last \\boxed{{}} is the reference)")


# A choice's letter given with its value, "\textbf{(C)}\ 12", "\text{(C) } 12", "(C) 12": latex2sympy read the product
# C * 12, wrong against the letter and the value alike. No second choice nor an "and"/"or" after it ("\text{(C)} and
# (D)" is two choices, a hedge). Its spacing is bounded: the lookahead, tried after each, made a run of it quadratic.
_CHOICE_WITH_VALUE = re.compile(r"(?:\\(?:text|textbf|textrm|mathrm|mathbf)\s*\{\s*\(([A-E])\)\s*\}|\(([A-E])\))"
                                r"(?:\\[ ,;:!]|\\q?quad|~|\s){0,4}(?!.*\([A-E]\)|.*\b(?:and|or)\b)(\S.*)", re.DOTALL)
# A reference that is a choice's letter: "\text{(C)}", "(C)", "C".
_CHOICE_LETTER = re.compile(r"(?:\\(?:text|textbf|textrm|mathrm|mathbf)\s*\{\s*)?\(?([A-E])\)?(?:\s*\})?")


def _choice_part(gold: str, pred: str) -> str:
    """``pred``, or of a choice given with its value the part ``gold`` names: the letter against a reference that is a
    letter (MATH's "\\text{(C)}"), else the value (a reference that gives the choice's value, "12")."""
    m = _CHOICE_WITH_VALUE.fullmatch(pred.strip())
    if m is None:
        return pred
    return f"\\text{{({m.group(1) or m.group(2)})}}" if _CHOICE_LETTER.fullmatch(gold.strip()) else m.group(3)


def _false_equation(parsed, timeout: int) -> bool:
    """Whether an answer is an equation of two numbers that differ, "\\boxed{3 = 4}", "\\boxed{2 + 1 = 4}", or holds
    one in a chain, "\\boxed{x = 3 = 4}": math-verify reads an equation as its right side ("x = 4", "48 + 24 = 72"), so
    each was right against 4 ("2 + 1 = 4" and "x = 3 = 4" until s57r14, and "3 = 1e3" against 1000 once 1e3 was a
    number). A false statement, two values offered: none. A side is a number, an exact one included ("\\sqrt{2} = 5",
    "\\pi = \\frac{22}{7}": rational ones only until s58r08; an exact number beside a decimal, "\\sqrt{2} = 1.414", is
    _approximation's); the two are compared by math-verify, within its timeout (2^{9e9} is not worked out)."""
    from math_verify import verify
    from sympy import And, Eq

    def number(side) -> bool:  # an exact one too: "\\sqrt{2} = 5", "\\pi = \\frac{22}{7}" read as 5, 22/7 until s58r08
        return bool(side.is_Number or (not side.free_symbols and side.is_number))

    equations = parsed.args if isinstance(parsed, And) else (parsed,)
    return any(isinstance(eq, Eq) and number(eq.lhs) and number(eq.rhs)
               and not verify([eq.lhs], [eq.rhs], timeout_seconds=timeout) for eq in equations)


# An exact value beside the decimal it rounds to, "\\frac13 = 0.333", "0.333 = \\frac{1}{3}", "\\sqrt{2} = 1.414": what a
# policy writes for one answer, the decimal a note. math-verify reads an equation as its right side: "\\frac13 = 0.333"
# was a false equation (no answer) and "\\sqrt{2} = 1.414" wrong against \\sqrt{2}, until s58r05 (_approximation).
# The decimal's digits, on the right or the left.
# An ellipsis after the decimal (_for_math_verify writes each as "\\ldots", which math-verify drops) says its digits go
# on: "\\frac13 = 0.333\\ldots" is the exact side too (a false equation, no answer, until s59r03), and a cut is no
# rounding then but the digits shown ("\\frac23 = 0.666\\ldots").
_EXACT_THEN_DECIMAL = re.compile(r"[^=]+=\s*(-?\d*\.(\d+))\s*(\\ldots)?\s*")
_DECIMAL_THEN_EXACT = re.compile(r"\s*(-?\d*\.(\d+))\s*(\\ldots)?\s*=[^=]+")


def _approximation(pred: str, parsed, timeout: int) -> tuple | None:
    """(exact side, decimal side) of an answer, parsed (math-verify's), that is an equation of an exact number and the
    decimal it rounds to at the digits shown (math-verify's own float rounding): one answer, right against either.
    (exact side,) where the decimal, an ellipsis after it, is a cut of it only ("\\frac23 = 0.666\\ldots"). () where the decimal is no rounding of it ("\\frac13 = 0.34", "\\sqrt{2} = 1.5", a cut "\\frac23 = 0.66"): a false
    equation, no answer (one compare: a degenerate side costs math-verify's timeout once). None for an equation of
    other sides (a variable, two decimals: "0.3 = 0.33"), left to _false_equation."""
    from math_verify import verify
    from sympy import Eq, Float

    tex = pred.strip()
    m = _EXACT_THEN_DECIMAL.fullmatch(tex) or _DECIMAL_THEN_EXACT.fullmatch(tex)
    if m is None or not isinstance(parsed, Eq):
        return None
    exact, decimal = (parsed.lhs, parsed.rhs) if m.re is _EXACT_THEN_DECIMAL else (parsed.rhs, parsed.lhs)
    if not (decimal.is_Float and exact.is_number) or exact.atoms(Float):
        return None
    if verify([decimal], [exact], float_rounding=len(m.group(2)), timeout_seconds=timeout):
        return exact, decimal
    # a cut before an ellipsis ("\\frac23 = 0.66\\ldots") shows the exact side's digits but is no rounding of it: the
    # exact side alone (its decimal was right against 0.66 from s59r03 to review s59r09)
    return (exact,) if m.group(3) and _truncates(exact, m.group(1)) else ()


def _truncates(exact, decimal: str) -> bool:
    """Whether ``decimal``'s digits are ``exact``'s first ones (a decimal followed by an ellipsis: "0.666..." of 2/3)."""
    from sympy import Rational, floor

    if not exact.is_real:
        return False
    scale = 10 ** len(decimal.partition(".")[2])
    shown = Rational(decimal)
    return floor(abs(exact) * scale) == abs(shown) * scale and (shown == 0 or (exact < 0) == (shown < 0))


# A number written with a decimal point, "0.333", ".5", "1.41".
_DECIMAL_NUMBER = re.compile(r"\.\d")


def _decimal(gold: str) -> bool:
    """Whether a reference's TeX holds a decimal ("0.333", "1.41"): the only kind an approximation's decimal side
    answers. Against an exact one the decimal only notes the exact side, which alone is the answer: "\\frac13 = 0.3" was
    right against \\frac{3}{10} and "\\frac{355}{113} = 3.141593" against \\pi (each its decimal) until s58r08. The TeX,
    not math-verify's parse: it reads "0.5" as 1/2."""
    return _DECIMAL_NUMBER.search(gold) is not None


# A number's degree sign (as _DEGREE_SIGN writes it): math-verify reads "30^\\circ" as 30, so an equation of an angle's
# value, "\\sin 30^\\circ = 0.5" (sin of 30 radians), "\\frac{\\pi}{2} = 90^\\circ", was false to the equation checks
# (the first none since s58r05, right before; the second once exact sides are compared). They compare it in radians.
_DEGREES = re.compile(r"(\d+(?:\.\d+)?)\s*\^\s*(?:\{\s*\\circ\s*\}|\\circ)")


def _as_equation(pred: str, parsed, cfg, timeout: int):
    """An answer as the equation checks (_approximation, _false_equation) compare it: ``parsed``, math-verify's, or its
    parse with each degree in radians."""
    from math_verify import parse

    if "=" not in pred or _DEGREES.search(pred) is None:  # no equation: a degree answer's parse is math-verify's
        return parsed
    tex = _DEGREES.sub(r"\\left(\\frac{\1\\pi}{180}\\right)", pred)
    radians = parse(f"$\\boxed{{{tex}}}$", extraction_config=cfg, parsing_timeout=timeout)
    return radians[0] if radians else parsed


def _inequality_against_interval(gold, pred) -> bool:
    """Whether an answer is an inequality and its reference an interval ("x > 2", "-2 \\le x \\le 7", "x \\neq -2"
    against "(2, \\infty)", "[-2, 7]", a union): math-verify compares the two only with the inequality as the
    reference, so a right "x > 2" scored 0 against "(2, \\infty)" (and 1 the other way round). Compared that way."""
    from sympy import And, FiniteSet, Or, Set
    from sympy.core.relational import Equality, Relational

    inequality = isinstance(pred, (Relational, And, Or)) and not isinstance(pred, Equality)
    return inequality and isinstance(gold, Set) and not isinstance(gold, FiniteSet)


@functools.lru_cache(maxsize=1 << 16)
def _math_verify_equal(gold: str, pred: str) -> bool:
    # Cached: sympy parsing costs ~10 ms, and the G completions of a group mostly repeat a few answers.
    if max(len(gold), len(pred)) > MAX_MATH_ANSWER_CHARS:  # before the import: math-verify's (sympy's) costs ~1 s
        return False
    from math_verify import LatexExtractionConfig, parse, verify

    timeout = _math_verify_timeout()
    cfg = [LatexExtractionConfig(boxed_match_priority=0)]
    letters = _letters(gold), _letters(pred)
    if letters != (gold, pred) and _math_verify_equal(*letters):
        return True  # listed letters as a set, "\\text{A, C}" against "C, A"; else as the text they are, below
    gold, pred = _for_math_verify(gold), _for_math_verify(_choice_part(gold, pred))
    if _unit_cut_drops_answer(pred):
        return False
    dozens = _DOZENS.fullmatch(pred)
    if dozens is not None and _NOT_A_UNIT.search(dozens.group(2)) is None \
            and _math_verify_equal(gold, f"{dozens.group(1)} \\times 12"):
        return True  # and against its count of dozens, as a unit below
    g = parse(f"$\\boxed{{{gold}}}$", extraction_config=cfg, parsing_timeout=timeout)
    p = parse(f"$\\boxed{{{pred}}}$", extraction_config=cfg, parsing_timeout=timeout)
    if not g or not p:
        return gold.strip() == pred.strip()
    equation = _as_equation(pred, p[0], cfg, timeout)
    sides = _approximation(pred, equation, timeout)
    if sides is not None:  # (): a decimal that is no rounding of its exact side, a false equation
        return any(verify(g, [side], timeout_seconds=timeout) for side in sides[: 2 if _decimal(gold) else 1])
    if _false_equation(equation, timeout):
        return False
    if _inequality_against_interval(g[0], p[0]):
        return bool(verify(p, g, timeout_seconds=timeout))
    return bool(verify(g, p, timeout_seconds=timeout))
