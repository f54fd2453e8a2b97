"""Reward functions for rollouts: a registry of built-ins, the user's own, and a weighted set of them.

A reward is ``fn(completion, answer, *, prompt=None) -> float``. Several run at once, each with a
weight: ``--reward gsm8k --reward format=0.1`` gives ``reward = 1.0*gsm8k + 0.1*format``, and every
unweighted value is kept in the record's ``rewards`` so training can re-weight without
regenerating. Built-ins:

- ``gsm8k``: 1 if the completion's final number equals the reference's; ``math``: 1 if math-verify judges the
  last ``\\boxed{}`` (with the boxes listed beside it, ``\\boxed{-2} and \\boxed{1}``; without a box, the last
  ``<answer>`` tag) equivalent to it. How an answer is read (``####`` lines, boxes, hedges, ranges, units, a
  ``<think>`` block) is ``qerl_cli.answers``, which ``qerl eval`` scores with too (``extract_answer`` and
  ``is_correct``, also importable from here).
- ``format``: 1 if the completion is ``<think>...</think>`` then ``<answer>...</answer>`` and
  nothing else.
- ``module:function`` or ``path/to/file.py:function``: a user function, imported only when named. One written for
  TRL's GRPOTrainer, ``fn(completions, **kwargs) -> list[float | None]`` (it has a parameter named ``completions``,
  or ``completion_ids`` and no ``completion``), is called once per prompt group instead (``Reward.score_batch``),
  and awaited if async; it is passed the row's other dataset columns too, by name (``solution``), as TRL passes them.
  How TRL calls it, and qerl the same way, is ``qerl_cli.trl_rewards``.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from qerl_cli import trl_rewards

# extract_answer, is_correct and the rest: the rules the built-ins score with, importable from here as they were
from qerl_cli.answers import ANSWER_KINDS, RULE_VERSION, extract_answer, is_correct, reference_answer  # noqa: F401
from qerl_cli.boxes import last_boxed  # noqa: F401
from qerl_cli.errors import BadInputError
from qerl_cli.gsm8k_numbers import normalize_number  # noqa: F401
from qerl_cli.shards import REWARD_LIMIT
from qerl_cli.stops import judged_completion, prompt_opens_think  # noqa: F401
from qerl_cli.trl_rewards import as_list, call_trl, trl_columns, trl_keywords, trl_kwargs, written_for_trl

REWARD_LIMIT_HINT = "rewards (and their weighted total) must lie within +-1e15"

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
    batched: tuple[str, ...] | None = None  # a TRL-style reward: the keywords of trl_rewards.TRL_KWARGS it is passed
    columns: tuple[str, ...] | None = ()  # the dataset columns a TRL-style reward is passed; None: every one (**kwargs)
    needs_columns: tuple[str, ...] = ()  # of those, the ones it names without a default: the file must have them

    def __call__(self, completion: str, answer: str | None, prompt=None) -> float:
        if self.takes_prompt:
            return self.fn(completion, answer, prompt=prompt)
        return self.fn(completion, answer)

    def score_batch(self, completions: Sequence[str], answer: str | None, prompt=None, completion_ids=None,
                    columns: dict | None = None):
        """A TRL-style reward on one prompt's completions, as GRPOTrainer calls it (``qerl_cli.trl_rewards``)."""
        return call_trl(self.fn, trl_kwargs(self.batched, self.columns, completions, answer, prompt, completion_ids,
                                            columns))


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


@register_reward("math", "1 if math-verify finds the last \\boxed{} (else <answer>) equivalent to the reference",
                 needs_answer=True)
def math_reward(completion: str, answer: str | None, *, prompt=None) -> float:
    return 1.0 if is_correct(completion, answer, "math") else 0.0


@register_reward("format", "1 if the completion is <think>...</think><answer>...</answer> and nothing else")
def format_reward(completion: str, answer: str | None = None, *, prompt=None) -> float:
    """``<think> thinking </think> <answer> answer </answer>`` with non-empty parts, one of each,
    nothing around. String scanning instead of a backtracking regex: linear on any input. A chat template that opens
    the ``<think>`` itself is no exception: the stages judge such completions with the tag put back
    (``judged_completion``), so a completion that never opened one (or opened a second) is not the format."""
    s = completion.lstrip()
    if not s.startswith("<think>"):
        return 0.0
    s = s[len("<think>"):]
    end = s.find("</think>")
    if end <= 0 or _has_tag(s[:end]) or not s[:end].strip():
        return 0.0
    rest = s[end + len("</think>"):].lstrip()
    if not rest.startswith("<answer>"):
        return 0.0
    rest = rest[len("<answer>"):]
    end = rest.find("</answer>")
    if end < 0 or _has_tag(rest[:end]) or not rest[:end].strip():
        return 0.0
    return 1.0 if not rest[end + len("</answer>"):].strip() else 0.0


_FORMAT_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def _has_tag(part: str) -> bool:
    """A format tag inside the thinking or the answer: "<think>a<answer>3</answer></think>..." is not
    one of each."""
    return any(t in part for t in _FORMAT_TAGS)


def _known() -> str:
    return ", ".join(sorted(REWARDS)) + "; or module:function / file.py:function for your own"


def _load_reward_file(path: Path):
    """The module of a reward file, run once per file and content: ``--reward r.py:f --reward r.py:g`` runs r.py's top
    level (a verifier it loads, say) once; ``a/r.py`` and ``b/r.py`` are two modules, where one name for both had the
    second replace the first in sys.modules, which dataclasses and pickle look a module up in; and an edited file is
    run again by a process that loaded it before (a notebook calling rollout twice). The path is made absolute, not
    resolved: a symlinked file's ``__file__`` is the link, as Python's own import keeps it (a reward reading a file
    beside it, ``Path(__file__).parent / "answers.json"``, looked beside the link's target; a review)."""
    path = Path(os.path.abspath(path))  # r.py and /abs/r.py: one module
    key = hashlib.sha256(str(path).encode() + b"\0" + path.read_bytes()).hexdigest()[:16]
    name = f"qerl_user_reward_{path.stem}_{key}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # registered first, as importlib's recipe does
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _load_user_function(name: str) -> Reward:
    target, _, attr = name.rpartition(":")
    if not target or not attr:
        raise BadInputError(f"reward {name!r}: expected module:function")
    try:
        if target.endswith(".py"):
            path = Path(os.path.expanduser(target))  # --reward=~/r.py:f: the shell expands no ~ after =
            if not path.is_file():
                raise BadInputError(f"reward {name!r}: file {path} does not exist")
            module = _load_reward_file(path)
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
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any import failure of user code is the user's to fix
        # (SystemExit: a script-style module that parses its argv at import ended qerl with its code)
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
    trl = sig is not None and written_for_trl(sig)
    calls = (fn, type(fn).__call__)  # a callable instance's async __call__ too
    if any(inspect.isasyncgenfunction(f) or (inspect.iscoroutinefunction(f) and not trl) for f in calls):
        # (TRL awaits its async rewards: score_batch does too) a per-completion one's coroutine was refused as "not
        # a number" at the first completion scored, after the first batch's generation (a review)
        raise BadInputError(f"reward {name!r}: {target}.{attr} is async; a reward returns its number",
                            hint="wrap it: def f(completion, answer): return asyncio.run(g(completion, answer))")
    if any(inspect.isgeneratorfunction(f) for f in calls):
        raise BadInputError(f"reward {name!r}: {target}.{attr} is a generator (it yields); a reward returns its number")
    if trl:  # written for TRL: it was refused as "too many positional arguments", or, naming a second parameter,
        # loaded and was refused after the first batch's generation ("returned list")
        columns, needs = trl_columns(sig)
        return Reward(name, fn, f"user function {target}:{attr} (TRL-style)", takes_prompt=False,
                      source=_source_file(fn, module), batched=trl_keywords(name, sig, f"{target}.{attr}"),
                      columns=columns, needs_columns=needs)
    takes_prompt = sig is not None and ("prompt" in sig.parameters
                                         or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()))
    if sig is not None:
        try:  # before any generation: a reward that cannot take (completion, answer) fails here, not hours later
            sig.bind("", None, prompt=None) if takes_prompt else sig.bind("", None)
        except TypeError as e:
            raise BadInputError(f"reward {name!r}: {target}.{attr}{sig} cannot be called as "
                                f"f(completion, answer[, prompt=...]) ({e})") from None
    return Reward(name, fn, f"user function {target}:{attr}", takes_prompt=takes_prompt,
                  source=_source_file(fn, module))


def _source_file(fn, module) -> str | None:
    """The file hashed into the run's inputs for a user reward: its own source file, else the file its module
    was loaded from. A functools.partial or a callable instance has none of its own; nor has a function made by
    exec or eval in the reward file (a table of generated rewards), which names ``"<string>"`` (hashed as a
    path: a FileNotFoundError traceback) or nothing (the file went unhashed: edited, the rollout stayed "already
    done" with the old rewards; a review)."""
    try:
        source = inspect.getsourcefile(fn)
    except TypeError:
        source = None
    if source is None or not os.path.isfile(source):
        source = getattr(module, "__file__", None)
    if source and not os.path.isfile(source):  # a module zipimport loaded ("r.zip/mod.py"): its archive (it went
        source = getattr(getattr(module, "__loader__", None), "archive", None)  # unhashed, as exec's; a review)
    return source if source and os.path.isfile(source) else None


def _raised_at(e: BaseException, source: str | None) -> str:
    """Where in the user's code a reward raised: the one line was all a user got, "raised KeyError: 'x'", with no
    traceback to find which of the function's lookups it was (a review). The deepest line of the reward's own file,
    else the deepest line of the call. A module zipimport loaded has its archive for ``source``, and ``r.zip/mod.py``
    for its frames' file: a line in the archive is the reward's own (json's decoder line was named instead; a review)."""
    qerls = (__file__, trl_rewards.__file__)  # not score's, __call__'s, call_trl's (a map it runs: float's ValueError)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename not in qerls]
    own = [f for f in frames if source and (os.path.abspath(f.filename) + os.sep).startswith(os.path.abspath(source) + os.sep)]
    frame = (own or frames or [None])[-1]
    return f" (at {frame.filename}:{frame.lineno}, in {frame.name})" if frame is not None else ""


def _is_complex(v) -> bool:
    """A complex number, or a numpy scalar, array or tensor of a complex dtype: ``float()`` of numpy's kept the real
    part with only a warning (``np.emath.sqrt(-1)`` scored 0.0; a review)."""
    dtype = getattr(v, "dtype", None)
    return isinstance(v, complex) or getattr(dtype, "kind", None) == "c" or getattr(dtype, "is_complex", False) is True


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def get_reward(name: str) -> Reward:
    """A registered reward by name, or a user ``module:function``; unknown -> one-line error."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        target, _, attr = name.rpartition(":")
        # no function is named "1.0": a weight in NAME:WEIGHT form (it read "cannot import gsm8k"); "nan", "inf" and
        # "infinity", which float() reads too, may be (refused as weights, a review)
        if _is_number(attr) and not attr.isidentifier():
            raise BadInputError(f"reward {name!r}: a weight follows '=', not ':'",
                                hint=f"pass --reward {target}={attr}")
        return _load_user_function(name)
    raise BadInputError(f"unknown reward {name!r} (known: {_known()})")


@dataclass(frozen=True)
class RewardSpec:
    name: str
    weight: float
    reward: Reward


def _split_weight(spec: str) -> tuple[str, str | None]:
    """``NAME=WEIGHT`` -> (NAME, WEIGHT), a spec without one -> (spec, None). The last '=' splits, unless the text
    after it holds a ':', which no weight does: then that '=' is inside a user function's module or path (a
    Hydra-style run dir, ``outputs/lr=1e-5/r.py:fn``), which was read as the weight "1e-5/r.py:fn" (a review). A
    function's name holds no '=', so ``outputs/lr=1e-5/r.py:fn=0.5`` is still that function weighted 0.5."""
    name, eq, w = spec.rpartition("=")
    if not eq or ":" in w:
        return spec, None
    return name.strip(), w


def _file_spec_parts(spec: str) -> tuple[str, str, str | None] | None:
    """(file, function, weight) of a ``file.py:function[=WEIGHT]`` spec, else None."""
    name, w = _split_weight(spec.strip())
    target, colon, attr = name.rpartition(":")
    return (target, attr, w) if colon and target.endswith(".py") else None


_AROUND = ", \t\n\r"  # what may surround a --reward value's specs


def _specs_in(raw: str) -> list[str]:
    """The specs one ``--reward`` value holds: its comma-separated parts, unless the value is one
    ``file.py:function[=WEIGHT]`` whose file exists with the commas in its path (``runs/a,b/r.py:score=0.5``, a Hydra
    multirun's ``lr=1e-5,seed=1/`` dir), which was split into the unknown reward 'runs/a' and could not be named. The
    commas must all be in the path: ``r.py:f,gsm8k`` is still two rewards. Commas around the value separate nothing
    (``gsm8k,`` is gsm8k), so ``runs/a,b/r.py:score,`` (a list joined with a trailing comma) is that file's reward
    too: it was split, "unknown reward 'runs/a'", hinting to give the file the --reward it had (a review)."""
    core = raw.strip(_AROUND)
    parts = _file_spec_parts(core)
    if parts is not None and "," in parts[0] and "," not in parts[1] + (parts[2] or ""):
        if os.path.isfile(os.path.expanduser(parts[0])):
            return [core]
    return raw.split(",")


def _comma_hint(raw: str, spec: str) -> str | None:
    """Why ``spec``, a part of the comma-split ``raw``, names no reward, where ``raw`` reads otherwise: a weight with a
    decimal comma (``format=0,1`` was "unknown reward '1'"), or a reward file's path with a comma in it."""
    parts = _file_spec_parts(raw)
    # runs/a,b/r.py:fn=0,5: its first part, 'runs/a', fails first
    if _is_number(spec) or (parts is not None and "," in (parts[2] or "") and _is_number(parts[2].replace(",", "."))):
        return "',' separates rewards; a weight's decimal mark is '.', as in format=0.1"
    if ".py:" in raw and ":" not in spec:
        return ("',' separates rewards; a reward file whose path holds ',' is read whole only from a --reward of its "
                "own, PATH.py:FUNCTION[=WEIGHT], naming an existing file")
    return None


def parse_reward_specs(specs: Iterable[str]) -> list[RewardSpec]:
    """``["gsm8k", "format=0.1"]`` (or ``["gsm8k,format=0.1"]``) -> weighted rewards; default weight 1. A value naming
    an existing reward file whose path holds a ',' is that one reward (``_specs_in``)."""
    out: list[RewardSpec] = []
    for raw in specs:
        raw = str(raw)
        for spec in _specs_in(raw):
            spec = spec.strip()
            if not spec:
                continue
            weight = 1.0
            name, w = _split_weight(spec)
            if w is not None:
                try:
                    weight = float(w)
                except ValueError:
                    raise BadInputError(f"--reward {spec!r}: weight {w!r} is not a number", hint="use NAME=WEIGHT, e.g. format=0.1") from None
                if not math.isfinite(weight):
                    raise BadInputError(f"--reward {spec!r}: weight must be finite")
                if abs(weight) > REWARD_LIMIT:  # a reward of 1 puts the total past it: found after generating (a review)
                    raise BadInputError(f"--reward {spec!r}: weight {weight:g} is beyond the limit", hint=REWARD_LIMIT_HINT)
            if any(s.name == name for s in out):
                raise BadInputError(f"--reward {name!r} named twice")
            try:
                reward = get_reward(name)
            except BadInputError as e:
                if e.hint is None and spec != raw.strip():
                    e.hint = _comma_hint(raw, spec)
                raise
            out.append(RewardSpec(name, weight, reward))
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
    def takes_columns(self) -> bool:
        """Whether a reward is passed dataset columns: a TRL-style one taking ``**kwargs`` or naming one."""
        return any(s.reward.batched is not None and s.reward.columns != () for s in self.specs)

    @property
    def weights(self) -> dict[str, float]:
        return {s.name: s.weight for s in self.specs}

    def score(self, completion: str, answer: str | None, prompt=None, *, where: str = "") -> tuple[dict[str, float], float]:
        return self.score_group([completion], answer, prompt, where=where)[0]

    def check_columns(self, columns: Iterable[str], where: str) -> None:
        """``columns`` lacking one a TRL-style reward requires (a parameter without a default), one line naming both:
        the reward would fail on "missing a required argument", as TRL's does (it passes the columns its dataset has).
        ``where``: whose they are, " of p.jsonl" for a dataset's (``column_names``: of all its rows). A row without a
        column that another row has passes None for it, as a null does: ``datasets`` reads both as None, TRL passes
        that, and so does qerl (a row lacking it was refused, its null passed)."""
        columns = list(columns)
        for s in self.specs:
            missing = next((k for k in s.reward.needs_columns if k not in columns), None)
            if missing is not None:
                others = ", ".join(f"`{k}`" for k in columns) or "none"
                raise BadInputError(f"reward {s.name!r} takes the dataset column `{missing}` (a parameter without a "
                                    f"default), which is not among the columns{where}",
                                    hint=f"they are {others}; " + (_MESSAGES_PROMPT_HINT if missing == "messages" else
                                                                   "the reference is passed as `answer`, read from "
                                                                   "--answer-key's column"))

    def score_group(self, completions: Sequence[str], answer: str | None, prompt=None, *, completion_ids=None,
                    columns: dict | None = None, where: str = "") -> list[tuple[dict[str, float], float]]:
        """``(rewards by name, weighted total)`` of each of one prompt's completions. A TRL-style reward is called
        once for them all, with the row's other dataset ``columns`` it takes; a None it returns for a completion is
        TRL's "does not apply": that reward is left out of the completion's ``rewards`` and adds nothing to its total
        (TRL's nansum), and a completion no reward applies to is refused."""
        n = len(completions)
        columns = columns if columns is not None else {}
        self.check_columns(columns, where)
        values: list[dict[str, float]] = [{} for _ in range(n)]
        for s in self.specs:
            if s.reward.batched is not None:
                got = as_list(s.name, _called(s, lambda s=s: s.reward.score_batch(completions, answer, prompt,
                                                                                   completion_ids, columns),
                                               where), n, where)
            else:
                # a copy of a chat prompt: a function that appends to the list it gets (to build a judge's
                # conversation) must not change the record's `prompt` or what the next completion is scored on
                got = [_called(s, lambda s=s, c=c: s.reward(c, answer, copy.deepcopy(prompt) if isinstance(prompt, (list, dict))
                                                            else prompt), where) for c in completions]
            for i, v in enumerate(got):
                if v is None and s.reward.batched is not None:
                    continue
                values[i][s.name] = _checked(s.name, v, f"{where} (completion {i + 1} of {n})"
                                             if s.reward.batched is not None else where,
                                             trl=s.reward.batched is not None)
        out, weights = [], self.weights
        for i, vals in enumerate(values):
            if not vals:
                raise BadInputError(f"no reward applies to completion {i + 1} of {n}{where}: every reward returned None",
                                    # not scored 0: that biases its group's baseline (TRL 1.16 leaves such a
                                    # completion out of it, with no advantage; a shard has no such record)
                                    hint="a TRL-style reward's None means 'does not apply': fix or drop a row whose "
                                         "reference it cannot read, or add a reward that scores every completion")
            total = sum(weights[name] * v for name, v in vals.items())
            if abs(total) > REWARD_LIMIT:  # weights can push finite values past it (or to inf)
                raise BadInputError(f"the weighted reward total is {total}{where}", hint=REWARD_LIMIT_HINT)
            out.append((vals, total))
        return out


def _called(s: RewardSpec, call: Callable, where: str):
    """``call()``, a user reward's failure one line naming where it raised."""
    try:
        return call()
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a user function's failure is the user's to fix
        if s.reward.source is None and ":" not in s.name:
            raise  # a built-in reward failing is qerl's bug: keep the traceback
        what = " ".join(str(e).split())  # one line: an assert's message of several came out as several
        raise BadInputError(f"reward {s.name!r} raised {type(e).__name__}{': ' * bool(what)}{what}{where}"
                            f"{_raised_at(e, s.reward.source)}") from None


# `messages` is a chat row's prompt (no text `prompt` beside it, or --prompt-key messages), passed as `prompts`, not
# as a column: a reward requiring it on a chat file was told "they are `id`", of a file plainly holding `messages` (a
# review; before session 58 it was refused when loaded, "a name qerl passes nothing under")
_MESSAGES_PROMPT_HINT = ("`messages`, where it is a row's prompt (no text `prompt` beside it, or --prompt-key messages), "
                         "is no column: it is passed as `prompts` (TRL's conversational prompt), which the reward can "
                         "take instead")


# TRL reads a reward's NaN as its None (both are NaN in its tensor, left out by nansum and nanmean): a TRL reward
# returning NaN for "does not apply" was refused with "rewards must be finite" alone, naming no way out. Still refused:
# a NaN is as often a bug (0/0) as a choice, and None says which.
_TRL_NAN_HINT = ("rewards must be finite; a TRL-style reward returns None for a completion it does not apply to (TRL "
                 "reads a NaN so too, qerl refuses it)")


def _checked(name: str, v, where: str, trl: bool = False) -> float:
    """A reward's value as a finite float within the limit, else a one-line error. ``trl``: a TRL-style reward's,
    whose NaN's hint names None (``_TRL_NAN_HINT``)."""
    try:
        if isinstance(v, (str, bytes)) or _is_complex(v):  # float("1") would parse it; float() of a numpy
            raise TypeError  # complex kept its real part, with a warning (complex's own float() refuses)
        v = float(v)
    except OverflowError:  # an int past float's range (10**400), a Fraction's: a number, over the limit
        what = "an integer" if isinstance(v, int) else type(v).__name__  # not "an integer" for a Fraction
        raise BadInputError(f"reward {name!r} returned {what} beyond float's range{where}",
                            hint=REWARD_LIMIT_HINT) from None
    except (TypeError, ValueError):
        raise BadInputError(f"reward {name!r} returned {type(v).__name__} {str(v)[:80]!r}{where}, "
                            "not a number (a float)") from None
    except Exception as e:  # noqa: BLE001 - the returned object's own __float__ failing (a meta tensor's, one
        # whose CUDA kernel failed) is the user's: it was a traceback, exit 1, as a bug of qerl's (a review)
        what = " ".join(str(e).split())[:200]
        raise BadInputError(f"reward {name!r} returned {type(v).__name__}{where}, which float() refused "
                            f"({type(e).__name__}: {what})") from None
    if not math.isfinite(v):
        raise BadInputError(f"reward {name!r} returned {v}{where}",
                            hint=_TRL_NAN_HINT if trl and math.isnan(v) else "rewards must be finite")
    if abs(v) > REWARD_LIMIT:
        raise BadInputError(f"reward {name!r} returned {v}{where}", hint=REWARD_LIMIT_HINT)
    return v
