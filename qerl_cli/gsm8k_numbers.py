"""The number an answer span gives, normalised (``span_number``, ``normalize_number``): the gsm8k rule's numbers
(qerl_cli/gsm8k_rule.py finds the span: a ``####`` line, a box, a tag, an answer statement). TeX, currency signs, units,
thousands commas, ``\\frac``, an equation's right side are read; a number another operand, a word that changes,
denies, bounds or approximates it, a hedge, a range or a second number follows is no answer (see the rule's docstring
for the list). Values are compared as exact fractions (``_to_fraction``)."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from qerl_cli.boxes import _TEXT_GROUP

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
