"""Reward functions for rollouts and the answer extractors that eval scores with.

A reward is ``fn(completion, answer, *, prompt=None) -> float``. Several run at once, each with a
weight: ``--reward gsm8k --reward format=0.1`` gives ``reward = 1.0*gsm8k + 0.1*format``, and every
unweighted value is kept in the record's ``rewards`` so training can re-weight without
regenerating. Built-ins:

- ``gsm8k``: 1 if the final number equals the reference. The number is the first one after the
  first ``####`` (a base model that runs on past its answer and starts another "Q: ... ####"
  is still judged on the answer it gave), else in the last ``\\boxed{}``, else in the last
  ``<answer>...</answer>``.
  Numbers are normalised (``$``, thousands commas, units, ``%``, trailing ``.0``, ``\\frac``,
  unicode minus) and compared as exact fractions, so ``0.5 == 1/2`` and ``1,000 == 1000.00``.
  Deliberately *no* "last number in the text" fallback: it rewards rambling that happens to end
  on the right number and teaches nothing about answering.
- ``math``: 1 if math-verify judges the last ``\\boxed{}`` equivalent to the reference (symbolic:
  ``\\frac{1}{2}`` vs ``0.5``, intervals, sets). Slower (sympy, ~10 ms a verdict), so verdicts are
  cached per (reference, answer): the G completions of a group mostly repeat a few answers.
- ``format``: 1 if the completion is ``<think>...</think>`` then ``<answer>...</answer>`` and
  nothing else (the opening ``<think>`` may come from the chat template, so it is optional).
- ``module:function`` or ``path/to/file.py:function``: a user function, imported only when named.

``extract_answer(text, kind)`` and ``is_correct(completion, reference, kind)`` are the same logic
exposed for ``qerl eval`` (kinds: ``gsm8k``, ``math``), so training reward and eval accuracy can
never disagree on what counts as right.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import re
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path

from qerl_cli.errors import BadInputError

ANSWER_KINDS = ("gsm8k", "math")


# ---- extraction ------------------------------------------------------------------------------
_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_BARE_TOKEN = re.compile(r"[^\s$]+")


def _closing_braces(text: str) -> dict[int, int]:
    """Index of each ``{`` -> index of its matching ``}`` (unclosed ones absent), in one pass."""
    stack, pairs = [], {}
    for j, ch in enumerate(text):
        if ch == "{":
            stack.append(j)
        elif ch == "}" and stack:
            pairs[stack.pop()] = j
    return pairs


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched; None if absent.

    Linear time: a degenerate completion repeating ``\\boxed{`` thousands of times must not cost
    seconds per reward (a naive scan per match is quadratic). An unclosed box (generation cut
    off) is not an answer; the last *closed* one counts.
    """
    matches = list(_BOX.finditer(text))
    if not matches:
        return None
    pairs = None
    for m in reversed(matches):
        i = m.end()
        if i < len(text) and text[i] == "{":
            if pairs is None:
                pairs = _closing_braces(text)
            j = pairs.get(i)
            if j is not None:
                return text[i + 1 : j].strip()
        else:  # "\\boxed 5": TeX allows a single token without braces
            tok = _BARE_TOKEN.match(text, i)
            if tok:
                return tok.group(0).strip()
    return None


_DIGIT = re.compile(r"\d")
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{[^{}]*\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|-?\.\d+")


def _clean_number_text(s: str) -> str:
    s = s.replace("\u2212", "-").replace("{,}", "").replace("\\!", "").replace("\\,", "")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\$", "$").replace("\\%", "%")
    s = _LATEX_TEXT.sub(" ", s)  # units: \text{ dollars}
    for _ in range(3):  # nested \frac{\frac{..}{..}}{..} is not worth more than a few passes
        s = _LATEX_FRAC.sub(r"(\1)/(\2)", s)
    s = re.sub(r"\((-?[\d.,]+)\)", r"\1", s)  # (3)/(4) -> 3/4
    s = s.replace("$", "")
    # "- 5" -> "-5" only when the minus is not between two numbers
    s = re.sub(r"(^|[^\d\s])\s*-\s+(?=\d)", r"\1-", s)
    return s


def _to_fraction(num: str) -> Fraction | None:
    num = num.replace(",", "").replace(" ", "")
    try:
        if "/" in num:
            a, b = num.split("/", 1)
            den = Fraction(Decimal(b))
            return None if den == 0 else Fraction(Decimal(a)) / den
        return Fraction(Decimal(num))
    except (InvalidOperation, ValueError, ZeroDivisionError):
        return None


def _format_fraction(f: Fraction) -> str:
    if f.denominator == 1:
        return str(f.numerator)
    # terminating decimals print as decimals (0.5), the rest as a/b (1/3)
    d = f.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    if d == 1:
        return format(Decimal(f.numerator) / Decimal(f.denominator), "f").rstrip("0").rstrip(".")
    return f"{f.numerator}/{f.denominator}"


def first_number(text: str) -> str | None:
    """The first number in ``text``, normalised (``'$1,234.50'`` -> ``'1234.5'``), or None."""
    if _DIGIT.search(text) is None:  # fast path: most spans a degenerate completion offers hold none
        return None
    m = _NUMBER.search(_clean_number_text(text))
    if not m:
        return None
    f = _to_fraction(m.group(0))
    return None if f is None else _format_fraction(f)


def normalize_number(text: str) -> str | None:
    """Canonical form of a number written as text (``'-3.50'`` -> ``'-3.5'``, ``'\\frac{6}{8}'`` -> ``'0.75'``)."""
    return first_number(text)


def _after_hashes(text: str) -> str | None:
    """What follows the first ``####`` that is followed by a number, up to the line end (or the
    next ``####``: each span is then read once, so the cost stays linear in the text)."""
    starts = [m.start() for m in re.finditer("####", text)]
    first = None
    for k, pos in enumerate(starts):
        stop = text.find("\n", pos + 4)
        stop = len(text) if stop < 0 else stop
        if k + 1 < len(starts):
            stop = min(stop, starts[k + 1])
        span = text[pos + 4 : stop]
        if first is None:
            first = span
        if first_number(span) is not None:
            return span
    return first


def _answer_tag(text: str) -> str | None:
    """Content of the last closed ``<answer>...</answer>`` (rfind: linear even for unclosed tags)."""
    end = text.rfind("</answer>")
    if end < 0:
        return None
    start = text.rfind("<answer>", 0, end)
    return None if start < 0 else text[start + len("<answer>") : end]


def extract_answer(text: str, kind: str = "gsm8k") -> str | None:
    """The answer a completion gives, or None when it gives none.

    ``gsm8k``: normalised number after the first ``####``, else in the last ``\\boxed{}``, else in
    the last ``<answer>`` tag. ``math``: the raw content of the last ``\\boxed{}``.
    """
    if kind == "gsm8k":
        for span in (_after_hashes(text), last_boxed(text), _answer_tag(text)):
            if span is not None:
                num = first_number(span)
                if num is not None:
                    return num
        return None
    if kind == "math":
        return last_boxed(text)
    raise BadInputError(f"unknown answer kind {kind!r} (known: {', '.join(ANSWER_KINDS)})")


_WHOLE_NUMBER = re.compile(rf"^\s*({_NUMBER.pattern})(?:\s+[A-Za-z]+)*\s*\.?\s*$")


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
        m = _WHOLE_NUMBER.match(_clean_number_text(span).replace("%", ""))
        if m is None:
            return None
        f = _to_fraction(m.group(1))
        return None if f is None else _format_fraction(f)
    if kind == "math":
        return last_boxed(reference) or reference.strip()
    raise BadInputError(f"unknown answer kind {kind!r} (known: {', '.join(ANSWER_KINDS)})")


@functools.lru_cache(maxsize=1 << 16)
def _math_verify_equal(gold: str, pred: str) -> bool:
    # Cached: sympy parsing costs ~10 ms, and the G completions of a group mostly repeat a few answers.
    from math_verify import LatexExtractionConfig, parse, verify

    # math-verify's timeouts use SIGALRM, which only works on the main thread.
    main = threading.current_thread() is threading.main_thread()
    timeout = 5 if main else None
    cfg = [LatexExtractionConfig(boxed_match_priority=0)]
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


# ---- registry --------------------------------------------------------------------------------
RewardCallable = Callable[..., float]


@dataclass(frozen=True)
class Reward:
    """A named reward function. ``needs_answer``: rows without a reference cannot be scored."""

    name: str
    fn: RewardCallable
    description: str
    needs_answer: bool = False
    takes_prompt: bool = True
    source: str | None = None  # a user function's file: hashed into the rollout's inputs

    def __call__(self, completion: str, answer: str | None, prompt=None) -> float:
        if self.takes_prompt:
            return self.fn(completion, answer, prompt=prompt)
        return self.fn(completion, answer)


REWARDS: dict[str, Reward] = {}


def register_reward(name: str, description: str, *, needs_answer: bool = False):
    """Decorator adding a built-in reward to ``REWARDS``."""

    def deco(fn):
        REWARDS[name] = Reward(name, fn, description, needs_answer=needs_answer)
        return fn

    return deco


@register_reward("gsm8k", "1 if the number after ####, in \\boxed{} or <answer> equals the reference", needs_answer=True)
def gsm8k_reward(completion: str, answer: str | None, *, prompt=None) -> float:
    return 1.0 if is_correct(completion, answer, "gsm8k") else 0.0


@register_reward("math", "1 if math-verify finds the last \\boxed{} equivalent to the reference", needs_answer=True)
def math_reward(completion: str, answer: str | None, *, prompt=None) -> float:
    return 1.0 if is_correct(completion, answer, "math") else 0.0


@register_reward("format", "1 if the completion is <think>...</think><answer>...</answer> and nothing else")
def format_reward(completion: str, answer: str | None = None, *, prompt=None) -> float:
    """``[<think>] thinking </think> <answer> answer </answer>`` with non-empty parts, one of each,
    nothing around. String scanning instead of a backtracking regex: linear on any input."""
    s = completion.lstrip()
    if s.startswith("<think>"):  # optional: chat templates of reasoning models open it themselves
        s = s[len("<think>"):]
    end = s.find("</think>")
    if end <= 0 or "<think>" in s[:end] or not s[:end].strip():
        return 0.0
    rest = s[end + len("</think>"):].lstrip()
    if not rest.startswith("<answer>"):
        return 0.0
    rest = rest[len("<answer>"):]
    end = rest.find("</answer>")
    if end < 0 or "<answer>" in rest[:end] or not rest[:end].strip():
        return 0.0
    return 1.0 if not rest[end + len("</answer>"):].strip() else 0.0


def _known() -> str:
    return ", ".join(sorted(REWARDS)) + "; or module:function / file.py:function for your own"


def _load_user_function(name: str) -> Reward:
    target, _, attr = name.rpartition(":")
    if not target or not attr:
        raise BadInputError(f"reward {name!r}: expected module:function")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise BadInputError(f"reward {name!r}: file {path} does not exist")
            spec = importlib.util.spec_from_file_location(f"qerl_user_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            try:
                module = importlib.import_module(target)
            except ModuleNotFoundError as e:
                # The `qerl` console script does not put the working directory on sys.path,
                # but a user's my_rewards.py next to the data is the common case.
                if e.name != target.split(".")[0] or "" in sys.path:
                    raise
                sys.path.insert(0, "")
                try:
                    module = importlib.import_module(target)
                finally:
                    sys.path.remove("")
    except BadInputError:
        raise
    except Exception as e:  # noqa: BLE001 - any import failure of user code is the user's to fix
        raise BadInputError(f"reward {name!r}: cannot import {target} ({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise BadInputError(f"reward {name!r}: {target} has no attribute {attr!r}")
    if not callable(fn):
        raise BadInputError(f"reward {name!r}: {target}.{attr} is not callable")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): found out at the first call
        sig = None
    takes_prompt = sig is not None and ("prompt" in sig.parameters
                                         or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()))
    if sig is not None:
        try:  # before any generation: a reward that cannot take (completion, answer) fails here, not hours later
            sig.bind("", None, prompt=None) if takes_prompt else sig.bind("", None)
        except TypeError as e:
            raise BadInputError(f"reward {name!r}: {target}.{attr}{sig} cannot be called as "
                                f"f(completion, answer[, prompt=...]) ({e})") from None
    try:
        source = inspect.getsourcefile(fn)
    except TypeError:
        source = None
    return Reward(name, fn, f"user function {target}:{attr}", takes_prompt=takes_prompt, source=source)


def get_reward(name: str) -> Reward:
    """A registered reward by name, or a user ``module:function``; unknown -> one-line error."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        return _load_user_function(name)
    raise BadInputError(f"unknown reward {name!r} (known: {_known()})")


@dataclass(frozen=True)
class RewardSpec:
    name: str
    weight: float
    reward: Reward


def parse_reward_specs(specs: Iterable[str]) -> list[RewardSpec]:
    """``["gsm8k", "format=0.1"]`` (or ``["gsm8k,format=0.1"]``) -> weighted rewards; default weight 1."""
    out: list[RewardSpec] = []
    for raw in specs:
        for spec in str(raw).split(","):
            spec = spec.strip()
            if not spec:
                continue
            name, weight = spec, 1.0
            if "=" in spec:
                name, w = spec.rsplit("=", 1)
                name = name.strip()
                try:
                    weight = float(w)
                except ValueError:
                    raise BadInputError(f"--reward {spec!r}: weight {w!r} is not a number", hint="use NAME=WEIGHT, e.g. format=0.1") from None
                if not math.isfinite(weight):
                    raise BadInputError(f"--reward {spec!r}: weight must be finite")
            if any(s.name == name for s in out):
                raise BadInputError(f"--reward {name!r} named twice")
            out.append(RewardSpec(name, weight, get_reward(name)))
    if not out:
        raise BadInputError("no reward named", hint=f"pass --reward NAME (known: {_known()})")
    return out


class RewardSet:
    """Scores completions with several weighted rewards: ``(rewards by name, weighted total)``."""

    def __init__(self, specs: Sequence[RewardSpec]):
        self.specs = list(specs)

    @classmethod
    def from_specs(cls, specs: Iterable[str]) -> RewardSet:
        return cls(parse_reward_specs(specs))

    @property
    def needs_answer(self) -> list[str]:
        return [s.name for s in self.specs if s.reward.needs_answer]

    @property
    def weights(self) -> dict[str, float]:
        return {s.name: s.weight for s in self.specs}

    def score(self, completion: str, answer: str | None, prompt=None, *, where: str = "") -> tuple[dict[str, float], float]:
        values: dict[str, float] = {}
        total = 0.0
        for s in self.specs:
            try:
                v = s.reward(completion, answer, prompt)
            except Exception as e:  # noqa: BLE001 - a user function's failure is the user's to fix
                if s.reward.source is None and ":" not in s.name:
                    raise  # a built-in reward failing is qerl's bug: keep the traceback
                raise BadInputError(f"reward {s.name!r} raised {type(e).__name__}: {e}{where}") from None
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise BadInputError(f"reward {s.name!r} returned {type(v).__name__} {v!r}{where}, not a number") from None
            if not math.isfinite(v):
                raise BadInputError(f"reward {s.name!r} returned {v}{where}", hint="rewards must be finite")
            values[s.name] = v
            total += s.weight * v
        return values, total
