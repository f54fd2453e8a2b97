"""What an answer is written in, read alike by both answer rules (qerl_cli/answers.py): the last closed ``\\boxed{}``
(``last_boxed``; two boxes offered as a hedge or listed, ``final_box``), the last closed ``<answer>`` tag
(``_answer_tag``), and the TeX text-group pattern each rule reads words in (``_TEXT_GROUP``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_BARE_TOKEN = re.compile(r"[^\s$]+")
# What follows a bare \boxed in prose, not an argument: a word ("I put it in \boxed as asked") or punctuation ("in
# \boxed."). Read as the last box, it hid the answer boxed before it. A letter ("\boxed x"), a number or a command
# ("\boxed\pi") stays an argument.
_PROSE_TOKEN = re.compile(r"[A-Za-z]{2,}[^\w\\]*|[^\w\\]+")
_CONTENT = re.compile(r"\S")


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


def _box_spans(text: str) -> Iterator[tuple[int, int, int, int]]:
    """(start, content start, content end, end) of each closed ``\\boxed{...}`` (or ``\\fbox{...}``, or a bare
    ``\\boxed 5``) with content, the last first, braces matched (see last_boxed). Spans only: the content of each box
    of a run nested in one another, cut out, is quadratic (the math rule reads the outermost, _outer_boxes)."""
    pairs = None
    for m in reversed(list(_BOX.finditer(text))):
        i = m.end()
        if i < len(text) and text[i] == "{":
            if pairs is None:
                pairs = _closing_braces(text)
            j = pairs.get(i)
            if j is not None and _CONTENT.search(text, i + 1, j):  # an empty box is the prompt's "within \boxed{}" echoed
                yield m.start(), i + 1, j, j + 1
        else:  # "\\boxed 5": TeX allows a single token without braces
            tok = _BARE_TOKEN.match(text, i)
            if tok and _PROSE_TOKEN.fullmatch(tok.group(0)) is None:
                yield m.start(), i, tok.end(), tok.end()


def _boxes_from_last(text: str) -> Iterator[tuple[str, int, int]]:
    """(content, start, end) of each closed box with content, the last first (_box_spans)."""
    return ((text[inner : inner_end].strip(), start, end) for start, inner, inner_end, end in _box_spans(text))


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


# A TeX text group of one of these commands, its content captured (the gsm8k rule's `_LATEX_TEXT` too).
_TEXT_GROUP = r"\\(?:{})\s*\{{([^{{}}]*)\}}"


def _answer_tag(text: str) -> str | None:
    """Content of the last closed ``<answer>...</answer>`` (rfind: linear even for unclosed tags)."""
    end = text.rfind("</answer>")
    if end < 0:
        return None
    start = text.rfind("<answer>", 0, end)
    return None if start < 0 else text[start + len("<answer>") : end]
