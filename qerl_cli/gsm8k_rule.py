"""The ``gsm8k`` answer rule (qerl_cli/answers.py dispatches to it): 1 if the final number equals the reference.

Why by hand: a GSM8K-style final number ("#### 72", "The answer is $72.", a hedge, a range, a unit) is a convention of
the dataset, not of LaTeX; a reward that takes "the last number in the text" rewards rambling that ends on the right
number. The number is the one of the first ``####`` line that starts with its number or names the answer before it
("#### 72", "#### The answer is 72", "#### Final Answer: 72", or a heading "#### Final Answer" with the number on the
next line, "- 72" there a list item, not -72; a base model that runs on past its answer and starts another "Q: ... ####"
is still judged on the answer it gave), else the last ``\\boxed{}``, else the last ``<answer>...</answer>``, else a
``####`` line's number after other words (the first such line that is no heading label "#### Step 1:", "#### Part 2":
"#### Add the 3 eggs" does not outrank the box), else a numbered heading's number ("#### 1. Understand the problem" is 1
only where nothing else gives an answer; "#### 18. She makes $18" says its number twice and is 18), which must each *be*
a number (words allowed): ``\\boxed{2\\sqrt{2}}``, ``\\boxed{2^{10}}`` and ``2x`` do not pass for 2, a reward-hacking
door otherwise. Numbers are normalised (``$`` and other currency signs as it, ``€18``, ``18€``, ``£18``, thousands
commas in groups of three, units, ``%``, degrees, trailing ``.0``, ``\\frac`` incl. mixed and nested, unicode minus) and
compared as exact fractions, so ``0.5 == 1/2`` and ``1,000 == 1000.00``; over 100 digits is no answer. A ``####`` line's
number that an operand or another number follows (``10 - 2``, ``1 000 000``, ``3:30``), a number with a word that
changes or denies it (``2 dozen``, ``minus 5``, ``not 5``, ``at least 5``, ``>= 5``, ``~5``), an approximation or a
bound on either side of it (``about 5``, ``over 5``, ``5 at most``, ``5 (approximately)``), an operator in words
(``5 times 2``, ``5 plus 2``), a hedge (``72 or 73``, ``72 or so``, ``72 apples or 73 apples``; not the number restated,
``72 (or 72.0)``, nor the same quantity in another unit, ``90 (or 1.5 hours)``, ``3 hours (180 minutes)``,
``90 minutes (1 hour 30 minutes)``), a range or a second number (``72 to 73``, ``72 and 3/4``, ``3 hours 30 minutes``;
not a rounding note, ``72.5, to 1 decimal place``, nor a number of another thing after "and",
``18 dollars and 9 eggs sold``), a hedge across two boxes (``\\boxed{72} or \\boxed{73}``) and two different boxes
listed by "and" or a comma (``\\boxed{72} and \\boxed{73}``, ``\\boxed{72}, \\boxed{73}``: gsm8k's reference is one
number) are no answer. A bare ``\\boxed`` before a word or punctuation is prose ("I put it in \\boxed as asked"), not a
box. Last of all, a plain-prose answer statement, an instruct model's default without a "####"/box instruction: the last
sentence that starts with the answer phrase ("The answer is 72.", "**Final Answer:** 72", "Therefore, the final answer
is: $72", a "So"/"No," lead allowed) and gives the number right after it, read as a ``####`` line's (the same cleaning
and refusals); one that denies, bounds or hedges ("The answer is not 72", "between 72 and 73", "72 or 73"), asks ("Is
the answer 72?", "What is the answer? 72"), or comes before a later box, ``<answer>`` tag, ``####`` line or a run-on's
next question ("Question:", "Problem:", "**Question 2:**", "Q.") is no answer, as is one later words take back ("The
answer is 18. Actually, it is 19."), and so is a ``####`` line, box or tag so taken back ("#### 18\nWait, no, it is 19"),
a box with another number offered beside it in prose ("\\boxed{18} or 19", "19 or \\boxed{18}") or two boxes with TeX or
punctuation between as the math rule reads them ("\\boxed{18} \\text{ or } \\boxed{19}", "\\boxed{18} | \\boxed{19}"), while
a box the words before it deny is none of the answer ("\\boxed{18}, not \\boxed{19}" is 18, "\\boxed{18} dollars (not
\\boxed{19})" too; "\\boxed{18} \\neq \\boxed{19}" and "is not" are none) and a box around a box
only dresses it ("\\boxed{\\boxed{18}}" is 18); a
statement is read to its sentence's end ("The
answer is 6 + 12 = 18. So 18 - 3 = 15." is 18). Deliberately *no* "last number in the text" fallback: it rewards
rambling that happens to end on the right number and teaches nothing about answering. What a completion holds after
its closed ``</think>`` is what this rule reads (``answers.extract_answer`` cuts it, for both rules).

The number reading (normalising, exact fractions, the refusals) is qerl_cli/gsm8k_numbers.py's.
"""

from __future__ import annotations

import itertools
import re

from qerl_cli.boxes import _BOX_HEDGE, _BOX_LIST, _answer_tag, _boxes_from_last, final_box, last_boxed
from qerl_cli.gsm8k_numbers import _DIGIT, _PLAIN_INT, _clean_number_text, _cleaned_span_number, span_number
from qerl_cli.math_rule import (
    _AFTER_BOX_HEDGE,
    _BEFORE_BOX_HEDGE,
    _BOX_INEQUALITY,
    _SIDE_BY_SIDE,
    _TAKE_BACK,
    _UNIT_AFTER,
    _dressed_boxes,
    _plain_separator,
    _without_denied_boxes,
)

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


HashAnswer = tuple[str, str, int] | None  # (the span, its number, where its line ends: words after it may take it back)


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
            span, stop = below, line[1]
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
            return (span, num, stop), words, numbered
        if kind == "words" and words is None:
            words = span, num, stop
        elif kind == "numbered" and numbered is None:
            numbered = span, num, stop
    return None, words, numbered


def _after_hashes(text: str) -> str | None:
    """What follows the first ``####`` that starts with a number (or names the answer before it), else the first one
    with a number after words (no heading label), else the first numbered heading, up to the line end (a GSM8K
    reference: "... #### 72")."""
    found = next((f for f in _hash_spans(text) if f is not None), None)
    return None if found is None else found[0]


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
    answer is between 18 and 20", "The answer is that she has 18") is no answer, not a way back to an earlier one; nor is
    one its own words take back ("The answer is 18. Actually, it is 19.": _taken_back)."""
    lines = text.splitlines(keepends=True)
    ends = list(itertools.accumulate(len(line) for line in lines))
    for i in reversed(range(len(lines))):
        line = lines[i].rstrip("\r\n\v\f\x1c\x1d\x1e\x85\u2028\u2029")  # its break: splitlines() as before
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
            num = _cleaned_span_number(s, span, whole=False)
            after = text[ends[i] - len(lines[i]) + starts[k] + _ANSWER_WORD.search(span).end() :]
            return None if _taken_back(after, num) else num
    return None


# A number or a chain of arithmetic ending in one ("19", "$19", "6 + 12 = 18"): what words after a take-back say.
_NUMBER_CHAIN = re.compile(r"[$€£]?\d+(?:,\d{3})*(?:\.\d+)?(?:[ \t]*[-+*/×÷=][ \t]*[$€£]?\d+(?:,\d{3})*(?:\.\d+)?){0,20}")


def _taken_back(after: str, num: str | None) -> bool:
    """Whether the words after an answer statement's phrase take its number back before another number, as the math
    rule reads a tag's ("The answer is 18. Actually, it is 19.", "Wait, no: 19", "I mean 19", "On second thought, 19":
    each read as 18 until review s59r09, right for the answer taken back). No answer, not the number after it, which
    need not be the answer ("Actually, 19 is wrong"); a check that ends on the number ("Wait, let me check: 6 + 12 =
    18") takes nothing back, nor does a statement that names the answer again (the last one is read)."""
    word = _TAKE_BACK.search(after)
    if word is None:
        return False
    chains = itertools.islice(_NUMBER_CHAIN.finditer(after, word.end()), 16)  # a few: a degenerate run costs nothing
    return any(span_number(m.group(0)) != num for m in chains)


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


def gsm8k_answer(text: str) -> str | None:
    """The gsm8k rule's answer in ``text`` (a completion past its thought: extract_answer), normalised, or None."""
    # a #### line that starts with its number (or names the answer), else the box, else the tag, else a #### line
    # with other words before its number, else a numbered heading: a Markdown heading "#### Step 1: ..." or "####
    # 1. Understand the problem" must not outrank the final \boxed{72}
    lead, words, numbered = _hash_spans(text)
    if lead is not None:
        return _kept(text, lead[2] - len(lead[0]), lead[1])  # its own line too: "#### 18. Hmm, 19?"
    boxed = _without_denied_boxes(text)  # "\boxed{18}, not \boxed{19}" is 18 (19 until review s60r02)
    box = _final_box(boxed)
    num = None if box is None else span_number(box[0], whole=True)
    if num is not None:
        return None if _hedged_box(boxed, box[1], box[2], num) else _kept(boxed, box[2], num)
    tag = _answer_tag(text)
    num = None if tag is None else span_number(tag, whole=True)
    if num is not None:
        return _kept(text, text.rfind("</answer>"), num)
    found = next((f for f in (words, numbered) if f is not None), None)
    if found is not None:
        return _kept(text, found[2] - len(found[0]), found[1])
    # last, a plain-prose statement "The answer is 18." (no ####, box or tag): instruct models' default
    return _answer_statement(_after_answer_markers(_before_a_run_on(text)))


def _kept(text: str, end: int, num: str) -> str | None:
    """``num``, the answer a ``####`` line (from its number's line), box or tag ending at ``end`` gives, unless the words after it take it back
    before another number ("#### 18\nWait, no, it is 19", "\\boxed{18}. Actually, it is 19.": each read as 18 until
    review s59r14, as a statement's was until review s59r09): then None. Up to a run-on's next question only."""
    after = text[end:]
    run_on = _RUN_ON_QUESTION.search(after)
    return None if _taken_back(after if run_on is None else after[: run_on.start()], num) else num


def _final_box(text: str) -> tuple[str, int, int] | None:
    """The last box (its content, start, end), dressed as the math rule reads it (_dressed_boxes: "\\textbf{\\boxed{18}}"),
    or None where the box before it is offered beside it and gives another number: by a hedge or a list (final_box's,
    with the TeX spacing and text groups between taken off, "\\boxed{18} \\text{ or } \\boxed{19}"), or side by side
    ("\\boxed{18} \\boxed{19}", "\\boxed{18} | \\boxed{19}"): each read as 19 until review s59r14."""
    boxes = _dressed_boxes(text)
    last, before = next(boxes, None), next(boxes, None)
    if last is None or before is None:
        return last
    between = _plain_separator(text[before[2] : last[1]])
    offered = _BOX_HEDGE.fullmatch(between) or _BOX_LIST.fullmatch(between) or _SIDE_BY_SIDE.fullmatch(between) \
        or _BOX_INEQUALITY.fullmatch(between)  # "\boxed{18} \neq \boxed{19}": 19 until review s60r13
    return None if offered and not _same_number(before[0], last[0]) else last


def _hedged_box(text: str, start: int, end: int, num: str) -> bool:
    """Whether a number is offered beside the box's ``num`` in prose on its line: after it ("\\boxed{18} or 19",
    "\\boxed{18} (or maybe 19)": not a quantity restated in a unit, "(or 1.5 hours)") or right before it ("19 or
    \\boxed{18}"), as the math rule reads them (each read as 18 until review s59r14)."""
    hedge = _AFTER_BOX_HEDGE.match(_plain_separator(text[end:].split("\n", 1)[0]))
    if hedge is not None and any(_UNIT_AFTER.match(hedge.group(1), m.end()) is None and span_number(m.group(0)) != num
                                 for m in _NUMBER_CHAIN.finditer(hedge.group(1))):
        return True
    before = _BEFORE_BOX_HEDGE.search(_plain_separator(text[text.rfind("\n", max(0, start - 80), start) + 1 : start]))
    return before is not None and span_number((before.group(1) or before.group(2)).strip()) != num


def gsm8k_reference(reference: str) -> str | None:
    """A dataset's reference as the gsm8k rule reads it (reference_answer): a worked solution's ``#### 72``, else its
    last box, else all of it, which must be a number."""
    span = _after_hashes(reference)
    if span is None:
        span = last_boxed(reference) or reference
    return span_number(span)
