"""TRL's calling convention for reward functions, which qerl mirrors.

TRL's ``GRPOTrainer`` (``_calculate_rewards``) calls each reward function once per batch, with keywords only:
``prompts``, ``completions`` and ``completion_ids``, one per completion; every other dataset column of the row
(all but ``prompt``, ``completion`` and ``completion_ids``) under its own name, repeated for each completion; and
what the trainer itself holds (``trainer_state``, ``log_extra``, ``log_metric``; ``environments`` where its
``environment_factory`` made some). An async reward is awaited on an event loop in a thread of its own, and a ``None``
returned for a completion means "this reward does not apply".

qerl calls a reward written for TRL (``fn(completions, **kwargs) -> list[float | None]``: open-r1's,
``trl.rewards``') the same way, once per prompt group, so that it runs unchanged in a rollout; the reference is passed
as ``answer``. There is no trainer, so a reward that requires one of the trainer's keywords is refused when loaded.
``qerl_cli.rewards`` holds the registry and the weighted set that call these.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import io
import pickle
import threading
from collections.abc import Callable, Iterator, Sequence

from qerl_cli.data import ROW_FIELDS
from qerl_cli.errors import BadInputError

# What TRL's GRPOTrainer passes a reward function that qerl passes too: the prompts, the completions, their token ids
# and the reference (`answer`, as read: GSM8K's number after ####). The row's other dataset columns are passed as well,
# each under its name (TRL passes every column but the prompt).
TRL_KWARGS = ("prompts", "completions", "completion_ids", "answer")
# What TRL's trainer passes of its own (TRL 1.x: `log_extra(column, values)` adds a column to its completions table,
# `log_metric(name, value)` a scalar to its logs; `environments`, the objects its `environment_factory` made, one per
# completion, where it was given one), which qerl, with no trainer, has not: a reward that requires one is refused when
# loaded (`log_metric` was read as a dataset column, and refused as "no row has it"; `environments` was, until a
# review, and a column of that name passed to a function reading `env.reward` from it).
TRAINER_KWARGS = ("trainer_state", "log_extra", "log_metric", "environments")
# Names no dataset column is passed under: the row's prompt and reference (`ROW_FIELDS` but `messages`, which is a
# column where a text `prompt` is the prompt, as TRL passes it; `row_columns` leaves it out where it is the prompt),
# what qerl passes itself, and TRL's `completion` and TRAINER_KWARGS (TRL too leaves its dataset's `prompt`,
# `completion` and `completion_ids` columns out, and sets TRAINER_KWARGS itself). A column so named is not passed.
RESERVED_COLUMNS = frozenset((*(ROW_FIELDS - {"messages"}), *TRL_KWARGS, "completion", *TRAINER_KWARGS))


def written_for_trl(sig: inspect.Signature) -> bool:
    """A reward written for TRL: it takes ``completions``, or ``completion_ids`` and no ``completion`` (TRL's own
    get_repetition_penalty_reward and get_soft_overlong_punishment take the ids alone, and were refused when loaded as
    "cannot be called as f(completion, answer)"). Not one whose ``completion_ids`` has a default and that takes
    (completion, answer) in other parameters: a per-completion reward, ``f(text, answer, completion_ids=None)``, was
    refused as a TRL reward missing `text` (a review); ``f(completion_ids=None, answer=None, **kwargs)`` is TRL's."""
    params = sig.parameters
    if "completions" in params:
        return True
    ids = params.get("completion_ids")
    if ids is None or "completion" in params:
        return False
    if ids.default is ids.empty:
        return True
    try:  # (completion, answer) into other parameters: f(completion_ids=None, answer=None, **kwargs) is TRL's
        return "completion_ids" in sig.bind("", None).arguments
    except TypeError:
        return True


def trl_keywords(name: str, sig: inspect.Signature, what: str) -> tuple[str, ...]:
    """The keywords of TRL_KWARGS a TRL-style reward is passed: all where it takes ``**kwargs`` (as TRL's must), else
    those it names. Any other name it takes is a dataset column (``trl_columns``); one it requires that is neither
    (TRAINER_KWARGS) is refused here, before any generation."""
    params = sig.parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        keys = TRL_KWARGS
    else:
        keys = tuple(k for k in TRL_KWARGS if k in params)
    try:
        sig.bind(**dict.fromkeys((*keys, *_named_columns(sig))))
    except TypeError as e:
        takes = "completions" if "completions" in sig.parameters else "completion_ids"
        raise BadInputError(f"reward {name!r}: {what}{sig} takes `{takes}`, so it is read as a TRL reward, but "
                            f"cannot be called with qerl's keywords ({', '.join(TRL_KWARGS)} and the row's other "
                            f"dataset columns) ({e})", hint=_trl_refusal_hint(sig, keys)) from None
    return keys


def _named_columns(sig: inspect.Signature) -> tuple[str, ...]:
    """The parameters of a TRL-style reward that name dataset columns: any it may be passed by keyword, but the
    reserved names."""
    return tuple(p.name for p in sig.parameters.values()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in RESERVED_COLUMNS)


def trl_columns(sig: inspect.Signature) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """(The dataset columns a TRL-style reward is passed: every one where it takes ``**kwargs``, None, as TRL passes
    them all; else those it names), and those it names without a default, which every row it scores must have."""
    params = sig.parameters
    named = _named_columns(sig)
    needs = tuple(k for k in named if params[k].default is params[k].empty)
    return (None if any(p.kind is p.VAR_KEYWORD for p in params.values()) else named), needs


def _trl_refusal_hint(sig: inspect.Signature, keys: tuple[str, ...]) -> str:
    """What to change in a TRL reward qerl cannot call. It told every one to rename a parameter `answer`: one whose
    ``completions`` is positional-only was not helped (a review)."""
    params = sig.parameters.values()
    if any(p.kind is p.POSITIONAL_ONLY for p in params):
        return "TRL, and qerl, pass a reward's arguments as keywords: drop the `/` from its parameters"
    # one at least: with no positional-only parameter (above), only a required reserved name (no column is passed
    # under it) fails to bind
    missing = [p.name for p in params if p.default is p.empty and p.name not in keys
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing[0] == "environments":  # a reward of TRL's tool-calling runs: it reads what its environments hold
        return ("qerl has no TRL environments (GRPOTrainer's environment_factory) to pass as `environments`: score "
                "the completions themselves, or give the parameter a default (None)")
    if missing[0] in TRAINER_KWARGS:
        return f"qerl has no TRL trainer to pass as `{missing[0]}`: give the parameter a default (None)"
    return (f"`{missing[0]}` is a name qerl passes nothing under (TRL's are `prompts` and `completions`, the reference "
            f"is `answer`, any other dataset column its own name): rename it, or give it a default")


def trl_kwargs(batched: tuple[str, ...], taken: tuple[str, ...] | None, completions: Sequence[str], answer: str | None,
               prompt=None, completion_ids=None, columns: dict | None = None) -> dict:
    """The keywords a TRL-style reward taking ``batched`` (of TRL_KWARGS) and the dataset columns ``taken`` (None:
    every one) is called with on one prompt's completions, one list each. A chat prompt (``messages``) gets TRL's
    conversational form, each completion a one-message list ``[{"role": "assistant", "content": text}]``: the form a
    function written for that dataset indexes. ``columns``: the row's other dataset columns, each passed under its
    name where the function takes it."""
    n = len(completions)
    chat = isinstance(prompt, list)
    given = {"completions": [[{"role": "assistant", "content": c}] for c in completions] if chat else list(completions),
             "prompts": [copy.deepcopy(prompt) for _ in range(n)],  # copies: one it appends to changes nothing
             "answer": [answer] * n}
    if completion_ids is not None:
        given["completion_ids"] = [list(ids) for ids in completion_ids]
    kwargs = {k: given[k] for k in batched if k in given}
    for k, v in (columns or {}).items():  # copies: a list one completion's call changes is not the next one's
        if k not in RESERVED_COLUMNS and (taken is None or k in taken):
            kwargs[k] = _copies(v, n)
    return kwargs


_IMMUTABLE = (str, bytes, int, float, bool, type(None))
# A text this long inside a column's list or object is shared by the copies, as deepcopy shares it: pickled, each copy
# held its own (a list of ten 100 KB documents: 29 ms a group against deepcopy's 0.1, 15 s of CPU a step; one 10 MB
# text in a dict: 2 minutes a step). Shorter ones are copied with their container: a lookup costs more than the copy.
_SHARED_TEXT = 1024


def _copies(v, n: int) -> list:
    """``n`` copies of a column's value ``v``, one per completion. A text or number is passed as is, as deepcopy
    passes it (pickling a 1 MB text costs 2 ms a copy). Else pickled once and loaded ``n`` times, its long texts shared
    (``_SHARED_TEXT``): as isolated as ``n`` deepcopies of what JSON and Parquet hold, 4-6x faster (a 1 MB list of
    dicts, 16 completions a group, 512 groups a step: 72 s of CPU a step, the GPU idle, against 17 s); deepcopy where
    it cannot be pickled (a library caller's own object)."""
    if isinstance(v, _IMMUTABLE):
        return [v] * n
    texts: list = []
    try:
        data = _pickled(v, texts)
    except Exception:  # noqa: BLE001 - whatever refuses pickling (a lambda, a lock) may still deep-copy
        return [copy.deepcopy(v) for _ in range(n)]
    return [_unpickled(data, texts) for _ in range(n)]


def _pickled(v, texts: list) -> bytes:
    """``v`` pickled, each text of ``_SHARED_TEXT`` characters or more put in ``texts`` and pickled as its index."""
    def shared(obj):
        if type(obj) in (str, bytes) and len(obj) >= _SHARED_TEXT:
            texts.append(obj)
            return len(texts) - 1
        return None

    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.persistent_id = shared
    pickler.dump(v)
    return buf.getvalue()


def _unpickled(data: bytes, texts: list):
    """A copy of what ``_pickled`` pickled, its long texts the very objects ``texts`` holds."""
    unpickler = pickle.Unpickler(io.BytesIO(data))
    unpickler.persistent_load = texts.__getitem__
    return unpickler.load()


def call_trl(fn: Callable, kwargs: dict):
    """``fn(**kwargs)``, as GRPOTrainer calls a reward: awaited if async."""
    got = fn(**kwargs)
    if inspect.isawaitable(got):  # an async reward, awaited as TRL awaits it
        got = _awaited(got)
    # a map or generator is run here, within the call: what it raises is the user's, one line naming where (it
    # was a traceback, or for a TypeError "returned generator, not a list")
    return list(got) if isinstance(got, Iterator) else got


def as_list(name: str, got, n: int, where: str) -> list:
    """A TRL-style reward's returned rewards, one per completion: a list, tuple, array or 1-d tensor."""
    try:
        if isinstance(got, (str, bytes, dict)):
            raise TypeError
        got = list(got)
    except TypeError:  # a float, a 0-d tensor: not one per completion
        raise BadInputError(f"reward {name!r} returned {type(got).__name__} {str(got)[:80]!r}{where}, not a list of "
                            f"{n} rewards", hint="a TRL-style reward (it takes `completions`) returns one value "
                                                 "(or None) per completion") from None
    if len(got) != n:
        raise BadInputError(f"reward {name!r} returned {len(got)} rewards for the {n} completions{where}",
                            hint="a TRL-style reward (it takes `completions`) returns one value (or None) per completion")
    return got


_LOOP: tuple[asyncio.AbstractEventLoop, threading.Thread] | None = None


def _awaited(awaitable):
    """What an async reward's ``awaitable`` gives, awaited on ``_event_loop()``'s thread, as TRL awaits its rewards on
    a loop of its own thread. Run on the caller's thread it failed wherever a loop already runs there (the library's
    ``rollout(cfg)`` from a Jupyter notebook, or any async caller: "Cannot run the event loop while another loop is
    running", blamed on the reward; a review)."""
    async def wait():
        try:
            return await awaitable, None
        except (KeyboardInterrupt, SystemExit) as e:  # asyncio lets these out of run_forever: the loop's thread
            return None, e  # ended with the result unset, and a reward's sys.exit() hung the run (a review)

    done = asyncio.run_coroutine_threadsafe(wait(), _event_loop())
    try:
        got, stopped = done.result()
    except BaseException:  # a Ctrl-C while it waits: the reward is not left running on
        done.cancel()
        raise
    if stopped is not None:
        raise stopped  # the reward's own: its traceback still names the reward's line
    return got


def _event_loop() -> asyncio.AbstractEventLoop:
    """The one event loop async rewards run on, in a daemon thread, as TRL keeps one: a client (an HTTP session) an
    async reward made at its first call is bound to the loop it was made on. A new one where its thread is gone (a
    forked child has none)."""
    global _LOOP
    if _LOOP is None or not _LOOP[1].is_alive():
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="qerl-async-rewards", daemon=True)
        thread.start()
        _LOOP = (loop, thread)
    return _LOOP[0]
