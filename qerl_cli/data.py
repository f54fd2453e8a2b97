"""Prompt datasets for rollout and eval: JSONL, JSON or Parquet rows -> token ids.

A ``.json`` file is one JSON array, or JSON Lines (``datasets``' ``to_json`` writes those under any name); a
``datasets`` directory (``save_to_disk``) or Arrow file is refused with the conversion to a file qerl reads.

Accepted row shapes (first match wins), each with an optional ``id`` (or ``unique_id`` /
``prompt_id``; default: the row's index, which is stable as long as the file is):

- ``{"prompt": "...", "answer": "..."}``: plain text prompt;
- ``{"messages": [{"role": "user", "content": "..."}, ...], "answer": ...}``: a chat, ending with the turn the model
  answers (one ending with an assistant turn, an SFT row's reply, is refused: the prompt would show it; also under
  Gemma's ``model`` or ShareGPT's ``gpt``); a ``content`` may be a list of text parts (``[{"type": "text", "text":
  ...}]``, ``input_text`` / ``output_text`` parts or plain strings), joined by newlines as vLLM joins them;
- GSM8K rows ``{"question": ..., "answer": "...#### 72"}``: the reference becomes ``72``;
- MATH / MATH-500 rows ``{"problem": ..., "answer": ...}`` (or only ``solution``: its last ``\\boxed{}``);
- TRL / verl conversational rows: ``prompt`` as a chat list, the reference in ``answer`` or
  ``reward_model.ground_truth``.

An ``answer`` holding ``####`` anywhere is treated as a worked solution and reduced to the number
after it, so a reward never compares against a whole paragraph.

A row's other columns (``solution``, ``task``, ``id``, ...) are kept as read, in ``PromptRow.columns``: a TRL-style
reward is passed them by name, as TRL's GRPOTrainer passes its dataset's columns (kept only where one takes them:
``load_prompts(columns=)``). The shard does not hold them.

Rendering: an optional ``--prompt-template`` (must contain ``{prompt}``; substituted by plain
replacement, so braces in LaTeX prompts are safe; a file's final newline is dropped, as Jinja does)
wraps the prompt text; then, when the tokenizer has a chat template (and it is not turned off), the
prompt becomes a user message (plus an optional system prompt) rendered with
``add_generation_prompt=True`` and ``--chat-template-kwargs`` (extra template variables, such as Qwen3's
``enable_thinking``). Without a chat template the text is tokenized as is; a ``messages``
row then is an error, since there is no faithful way to flatten a chat for a model that was never
taught one. A rendered prompt may end inside a ``<think>`` block it opened (QwQ's and DeepSeek-R1's chat
templates do): ``EncodedPrompt.opens_think`` says so, and the rewards then judge its completions as
starting inside that block.

Every error names ``file:line`` (``file:row N`` for Parquet). Rows are loaded whole: prompt sets
are MBs, and knowing the row count up front is what lets ``--prompts-per-step`` and
``--shard-index`` slice deterministically.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from qerl_cli.answers import reference_answer
from qerl_cli.boxes import last_boxed
from qerl_cli.errors import BadInputError
from qerl_cli.hashing import sha256_bytes
from qerl_cli.stops import prompt_opens_think

ID_FIELDS = ("id", "prompt_id", "unique_id")
LONG_PROMPT_POLICIES = ("skip", "error")


@dataclass
class PromptRow:
    """One dataset row: ``prompt`` text or ``messages``, optional reference ``answer``."""

    id: str
    prompt: str | None = None
    messages: list[dict] | None = None
    answer: str | None = None
    where: str = ""  # "file:line", for error messages
    # the row's other columns as read (``row_columns``), which a TRL-style reward is passed by name; not in the shard
    columns: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_field(self) -> str | list[dict]:
        """What the shard record stores as ``prompt``: the text, or the chat messages."""
        return self.messages if self.messages is not None else self.prompt


@dataclass
class EncodedPrompt:
    row: PromptRow
    text: str
    token_ids: list[int]

    @functools.cached_property  # asked once per completion scored: the prompt's rstrip copied it each time
    def opens_think(self) -> bool:
        """Whether the prompt ends inside a ``<think>`` it opened: its completions start mid-thought."""
        return prompt_opens_think(self.text)


@dataclass
class EncodeReport:
    skipped_long: list[str] = field(default_factory=list)  # "file:line (N tokens)"
    max_prompt_tokens: int | None = None
    own_system: list[str] = field(default_factory=list)  # rows whose own system message kept --system-prompt out


# ---- loading -------------------------------------------------------------------------------
def _read_rows(path: Path, bad_lines: list[str] | None = None,
               stored: list[dict] | None = None) -> list[tuple[str, Any]]:
    """(location, parsed row) pairs; JSON syntax errors name file:line (collected in ``bad_lines`` if given).
    ``stored``: where given, a Parquet file's columns that are read as text here (``_float32_as_text``) are appended
    to it as the file holds them, one dict a row (none for a file without such columns): a reward is passed those."""
    suffix = path.suffix.lower()
    with open(path, "rb") as f:
        head = f.read(8)
    if suffix in (".arrow", ".feather") or head.startswith(_ARROW_MAGIC):  # read as JSONL: "not UTF-8 text (byte 0)"
        whole = _datasets_dir(path.parent)  # one shard of a save_to_disk directory: the whole dataset is the parent
        raise BadInputError(f"{path}: is an Arrow file (as Hugging Face datasets stores its data); qerl reads JSONL, "
                            "JSON or Parquet", hint=_convert_hint(whole, path.parent) if whole else
                            _convert_hint(f"datasets.Dataset.from_file('{path}')", path))
    if suffix not in (".parquet", ".pq") and head.startswith(b"PAR1"):
        raise BadInputError(f"{path}: is a Parquet file without the .parquet suffix, read as JSON Lines by its name",
                            hint=f"rename it: mv {path} {path.with_suffix('.parquet')}")
    if suffix in (".parquet", ".pq"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise BadInputError(f"{path}: reading Parquet needs pyarrow", hint="pip install 'qerl[parquet]'") from None
        try:
            table = pq.read_table(path)
            if stored is not None:
                stored.extend(_float_columns(table))
            table = _float16_columns_as_text(table)
            rows = table.cast(_float32_as_text(table.schema)).to_pylist()
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise BadInputError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        return [(f"{path}:row {i + 1}", r) for i, r in enumerate(rows)]
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a leading BOM (Windows editors) is not JSON
    except UnicodeDecodeError as e:
        raw = path.read_bytes()
        packed = next((name for magic, name in _COMPRESSED if raw.startswith(magic)), None)
        if packed is not None:  # it read as "not UTF-8 text (byte 1)"
            raise BadInputError(f"{path}: is {packed}-compressed; qerl reads plain JSONL, JSON or Parquet",
                                hint="decompress it first, e.g. `zcat F.gz > F.jsonl`") from None
        line = raw[: e.start].count(b"\n") + 1
        raise BadInputError(f"{path}:{line}: not UTF-8 text (byte {e.start})") from None
    if suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise BadInputError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        except ValueError as e:  # int() refuses a number of 4300+ digits
            raise BadInputError(f"{path}: not valid JSON ({_json_value_error(e)})") from None
        return [(f"{path}:item {i + 1}", r) for i, r in enumerate(rows)]
    out = []
    # JSON Lines ends records at "\n" only: str.splitlines() would also split inside a JSON string
    # holding a raw U+2028, U+2029 or U+0085 (json.dumps(ensure_ascii=False) writes them raw).
    for i, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        try:
            out.append((f"{path}:{i}", json.loads(line)))
        except ValueError as e:  # a JSONDecodeError, or int() refusing a number of 4300+ digits
            if not out:
                _refuse_one_json_value(path, text)
            detail = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else _json_value_error(e)
            msg = f"{path}:{i}: not valid JSON ({detail})"
            if bad_lines is None:
                raise BadInputError(msg, hint="pass --skip-bad-lines to skip such rows") from None
            bad_lines.append(msg)
            out.append((f"{path}:{i}", _UNREADABLE))  # keeps its row index, as a readable bad row does
    return out


def _refuse_one_json_value(path: Path, text: str) -> None:
    """A file that is one JSON value written over several lines (``json.dump(rows, f, indent=2)``) is valid JSON, yet
    each of its lines is not: "line 1: not valid JSON", with --skip-bad-lines offered, misled. Say what it is."""
    try:
        value = json.loads(text)
    except ValueError:
        return  # not JSON as a whole either: a bad line of JSON Lines
    if isinstance(value, list):
        raise BadInputError(f"{path}: is one JSON array over several lines, not JSON Lines (one row object a line)",
                            hint="name it .json to read it as an array, or write one object a line: "
                                 "jq -c '.[]' F > F.jsonl")
    raise BadInputError(f"{path}: is one JSON object over several lines, not JSON Lines (one row object a line)",
                        hint=_rows_under_a_key(value) or "write each row as one line: jq -c . F > F.jsonl")


_ROW_KEYS = ("prompt", "messages", "question", "problem")


def _rows_under_a_key(value) -> str | None:
    """The hint for an object that is no row but holds the rows as a list under a key ({"rows": [...]}), else None.
    Rows are objects with a row key: any list was taken, and a ShareGPT row's `conversations` (turns), a `tags`
    column or a list of strings was called the rows (parse_row asks this of every row that has no prompt)."""
    if not isinstance(value, dict) or any(k in value for k in _ROW_KEYS):
        return None
    lists = [k for k, v in value.items()
             if isinstance(v, list) and any(isinstance(r, dict) and any(f in r for f in _ROW_KEYS) for r in v)]
    return f"its rows are a list under a key: write one a line, jq -c '.{lists[0]}[]' F > F.jsonl" if lists else None


# Arrow's IPC file format opens with ARROW1; its stream format, which datasets' save_to_disk and cache write, with
# a continuation marker before the schema message
_ARROW_MAGIC = (b"ARROW1", b"\xff\xff\xff\xff")


def _convert_hint(load: str, path: Path) -> str:
    """How to write a Hugging Face ``datasets`` dataset (``load``: the Python that loads it) as a file qerl reads."""
    stem = path.with_suffix("") if path.suffix else path
    return (f"convert it: python -c \"import datasets; {load}.to_json('{stem}.jsonl')\" (JSON Lines), or "
            f".to_parquet('{stem}.parquet')")


def _datasets_dir(path: Path) -> str | None:
    """The load call of a directory ``datasets``' save_to_disk wrote (a Dataset, or a DatasetDict of splits), else None."""
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits") or ["train"]
        except (OSError, ValueError, AttributeError):
            splits = ["train"]
        return f"datasets.load_from_disk('{path}')['{splits[0]}']"
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():  # a Dataset's, beside its shards
        return f"datasets.load_from_disk('{path}')"
    return None


_COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"BZh", "bzip2"), (b"\xfd7zXZ", "xz"))


def _json_value_error(e: ValueError) -> str:
    """json.loads' non-syntax error in words: Python's int() limit (sys.set_int_max_str_digits)."""
    return "an integer longer than Python reads (4300 digits)" if "integer string conversion" in str(e) else str(e)


_UNREADABLE = object()  # a line --skip-bad-lines skips that is not even JSON


def _float16_columns_as_text(table):
    """Top-level float16 columns as their shortest decimal text ("0.1"; integers as "3"): pyarrow's string
    cast of float16 writes the widened double ("0.0999755859375"), which no answer equals."""
    import numpy as np
    import pyarrow as pa

    def text(v):
        if v is None:
            return None
        if np.isfinite(v) and float(v).is_integer():
            return "-0" if v == 0 and np.signbit(v) else str(int(v))  # as the float32 cast writes -0
        return np.format_float_positional(np.float16(v), unique=True, trim="-")

    for i, f in enumerate(table.schema):
        if pa.types.is_float16(f.type):
            col = pa.array([text(v) for v in table.column(i).to_pylist()], pa.string())
            table = table.set_column(i, pa.field(f.name, pa.string(), f.nullable), col)
    return table


def _float_columns(table) -> list[dict]:
    """Each row's values of the columns holding float32 or float16 (nested too), as pyarrow's to_pylist (and so
    ``datasets``, and TRL's rewards) reads them: floats. qerl reads those columns as text to read a reference from
    them (``_float32_as_text``), and a reward was passed a Parquet `weight` column's 0.5 as "0.5" (a review)."""
    columns = [i for i, f in enumerate(table.schema) if _holds_float32(f.type)]
    return table.select(columns).to_pylist() if columns else []


def _holds_float32(t) -> bool:
    """Whether a column of Arrow type ``t`` holds float32 or float16 values (in a struct or list too)."""
    import pyarrow as pa

    if pa.types.is_float32(t) or pa.types.is_float16(t):
        return True
    if pa.types.is_struct(t):
        return any(_holds_float32(f.type) for f in t)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _holds_float32(t.value_type)
    return False


def _float32_as_text(schema):
    """The schema with float32 columns (nested too) as text: pyarrow's cast writes their shortest
    decimal ("0.1"), while to_pylist widens them to 0.10000000149011612, which no answer equals. float16:
    top-level columns are text already (``_float16_columns_as_text``); a nested one reads as the widened
    value ("0.0999755859375"). Null-typed fields (a field that is null in every row: ``name`` or ``tool_calls`` of
    a ``messages`` column) become string too, all null still: pyarrow (26) fails to cast a list of structs holding
    one to its own type, which refused such a file as "not a readable Parquet file"."""
    import pyarrow as pa

    def conv(t):
        if pa.types.is_float32(t) or pa.types.is_float16(t) or pa.types.is_null(t):
            return pa.string()
        if pa.types.is_struct(t):
            return pa.struct([pa.field(f.name, conv(f.type), f.nullable) for f in t])
        if pa.types.is_list(t):
            return pa.list_(conv(t.value_type))
        if pa.types.is_large_list(t):
            return pa.large_list(conv(t.value_type))
        return t

    return pa.schema([pa.field(f.name, conv(f.type), f.nullable) for f in schema])


# The names a chat gives the model's own turn: transformers' and OpenAI's, Gemma's (its template writes the assistant as
# `model`, and its datasets often do), ShareGPT's `gpt` (written as role/content by converters that keep the names),
# Cohere's `chatbot`. A chat ending with one shows the model that reply; "Assistant" on a ChatML template too.
ASSISTANT_ROLES = frozenset(("assistant", "model", "gpt", "chatbot"))


def _check_messages(msgs: Any, where: str, column: str = "messages") -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise BadInputError(f"{where}: `messages` must be a non-empty list of {{role, content}} objects")
    out = []
    for j, m in enumerate(msgs):
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            m = {**m, "content": _text_parts(m["content"], f"{where}: messages[{j}]")}
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadInputError(f"{where}: messages[{j}] needs string `role` and `content`")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"].lower() in ASSISTANT_ROLES:  # an SFT row's reference reply: rendered whole, then a new turn
        # TRL's GRPOTrainer continues a `prompt` ending so (continue_final_message) as a prefill of the reply; verl
        # renders it whole before a new turn, as qerl did. A continued reference reply leaks the answer all the same.
        raise BadInputError(f"{where}: `{column}` ends with an assistant turn (role `{out[-1]['role']}`), which the "
                            "prompt would show the model (its reply, the answer), before a new assistant turn to generate",
                            hint="a prompt ends with the turn the model answers: drop the final assistant message; "
                                 "a reference belongs in `answer`, and a start of the reply every prompt shares "
                                 "(a prefill such as '<think>\\n') at the end of the generation prompt of a "
                                 "--chat-template-file")
    return out


# Text part types (vLLM reads these three as text): Chat Completions' `text`, the Responses API's `input_text` (a
# user's) and `output_text` (an assistant's).
TEXT_PART_TYPES = ("text", "input_text", "output_text")


def _text_parts(parts: list, where: str) -> str:
    """A content given as parts (``[{"type": "text", "text": ...}]``, OpenAI's and newer datasets' form) as the one
    string a text model's chat template reads, the text parts joined by newlines as vLLM joins them: passed as a list,
    Qwen3's template renders it as nothing and Qwen2.5's as the list's repr. A plain string part is text too, as vLLM
    reads it."""
    texts = []
    for k, p in enumerate(parts):
        if isinstance(p, str):
            texts.append(p)
            continue
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in TEXT_PART_TYPES and not isinstance(p.get("text"), str):  # not "is a `text` part: text only"
            raise BadInputError(f"{where}.content[{k}] is a `{kind}` part without a string `text`")
        if kind not in TEXT_PART_TYPES:
            what = f"a `{kind}` part" if isinstance(kind, str) else "no {type: text, text} part"
            raise BadInputError(f"{where}.content[{k}] is {what}: prompts are text only")
        texts.append(p["text"])
    return "\n".join(texts)


def _answer(raw: Any, where: str, name: str = "answer") -> str | None:
    """The reference in column ``name`` as text, None where there is none (null or blank)."""
    if raw is None:
        return None
    if isinstance(raw, Decimal):  # a Parquet decimal column
        if not raw.is_finite():
            raise BadInputError(f"{where}: `{name}` is {raw}, not a number an answer can equal")
        return format(raw, "f")
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
        raise BadInputError(f"{where}: `{name}` must be a string or number, got {type(raw).__name__}")
    if isinstance(raw, float):
        if not math.isfinite(raw):
            raise BadInputError(f"{where}: `{name}` is {raw}, not a number an answer can equal")
        # Plain decimals: str(1e16) is "1e+16", which no scorer reads as the number 10000000000000000.
        s = format(Decimal(repr(raw)), "f")
        return s[:-2] if s.endswith(".0") else s
    s = str(raw).strip()
    if not s:
        return None  # a blank reference is no reference (every answer would "equal" it)
    if "####" in s:  # a GSM8K worked solution: the reference is the number after ####
        num = reference_answer(s, "gsm8k")
        if num is None:
            raise BadInputError(f"{where}: `{name}` has #### but no number after it")
        return num
    return s


def parse_row(raw: Any, where: str, index: int) -> PromptRow:
    """One dataset row -> PromptRow (see the module docstring for the accepted shapes)."""
    if not isinstance(raw, dict):
        raise BadInputError(f"{where}: expected a JSON object per row, got {type(raw).__name__}")
    rid = next((raw[k] for k in ID_FIELDS if raw.get(k) is not None), index)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise BadInputError(f"{where}: `id` must be a string or integer")
    answer = _answer(raw.get("answer"), where)  # a blank one is none: the fallbacks below apply
    if answer is None and isinstance(raw.get("reward_model"), dict):  # verl-format rows
        answer = _answer(raw["reward_model"].get("ground_truth"), where, "reward_model.ground_truth")
    if isinstance(raw.get("prompt"), list):  # TRL / verl conversational rows: `prompt` is the chat
        return PromptRow(str(rid), messages=_check_messages(raw["prompt"], where, "prompt"), answer=answer,
                         where=where)
    if raw.get("prompt") is not None:
        if not isinstance(raw["prompt"], str) or not raw["prompt"].strip():
            raise BadInputError(f"{where}: `prompt` must be a non-empty string")
        return PromptRow(str(rid), prompt=raw["prompt"], answer=answer, where=where)
    if raw.get("messages") is not None:
        return PromptRow(str(rid), messages=_check_messages(raw["messages"], where), answer=answer, where=where)
    for key in ("question", "problem"):  # GSM8K, MATH / MATH-500
        if isinstance(raw.get(key), str) and raw[key].strip():
            if answer is None and isinstance(raw.get("solution"), str):
                answer = _answer(last_boxed(raw["solution"]), where)  # an empty \boxed{} is no reference
            return PromptRow(str(rid), prompt=raw[key], answer=answer, where=where)
    keys = keys_of(raw)
    # A Parquet column (or a JSON key) that is there but null: "keys: answer, prompt" said the row had a prompt.
    nulls = [f"`{k}`" for k in _ROW_KEYS if k in raw and raw[k] is None]
    raise BadInputError(
        f"{where}: row has neither `prompt` nor `messages` ("
        + (f"{' and '.join(nulls)} {'is' if len(nulls) == 1 else 'are'} null; " if nulls else "") + f"keys: {keys})",
        hint=_rows_under_a_key(raw)
        or "each row needs `prompt` (text) or `messages` (chat list); GSM8K `question` and MATH `problem` also work",
    )


def keys_of(raw: dict, most: int = 20) -> str:
    """A row's keys for a one-line message: sorted, the first ``most`` (then how many more), each cut at 40 characters
    and with its line breaks escaped. All of them made the line as long as a wide Parquet file's hundreds of columns,
    and a JSON key holding a newline broke it in two (review s59r12)."""
    names = sorted(map(str, raw))
    shown = [_short_key(k) for k in names[:most]]
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(shown) + more or "none"


def _short_key(key: str) -> str:
    key = repr(key)[1:-1]  # \n, \t and other unprintables escaped; text in any script kept
    return key if len(key) <= 40 else key[:37] + "..."


# What a PromptRow holds itself: the prompt (``prompt`` or ``messages``) and the reference (``answer``).
ROW_FIELDS = frozenset(("prompt", "messages", "answer"))


def row_columns(raw: Any, stored: dict | None = None, prompt_key: str | None = None) -> dict[str, Any]:
    """A row's columns other than ``ROW_FIELDS`` (``messages`` only where it is the prompt: ``_messages_is_prompt``),
    as read (before ``--prompt-key`` / ``--answer-key`` rename any): TRL's GRPOTrainer passes a reward every column but
    the prompt (open-r1's accuracy reward reads ``solution``), and a reward written for it failed here, "missing a
    required argument", or had to be rewritten. Values as the file holds them: JSON lists and objects pass through;
    Parquet columns as pyarrow reads them, ``stored`` (``_read_rows``) holding those qerl reads as text."""
    if not isinstance(raw, dict):
        return {}
    own = ROW_FIELDS if _messages_is_prompt(raw, prompt_key) else ROW_FIELDS - {"messages"}
    return {k: v for k, v in {**raw, **(stored or {})}.items() if k not in own}


def _messages_is_prompt(raw: dict, prompt_key: str | None) -> bool:
    """Whether a row's ``messages`` column is its prompt (``parse_row``): it is, without a ``prompt``, or named by
    ``--prompt-key``. Beside a text ``prompt`` (a dataset's reference conversation, an SFT set's ``messages``) it is
    another column, which TRL passes a reward: it was left out, as if it were the prompt (a review)."""
    if prompt_key is not None:
        return prompt_key == "messages"
    return raw.get("prompt") is None


def column_names(rows: Sequence[PromptRow]) -> list[str]:
    """Every column any row has, in the order first seen: the dataset's columns, as ``datasets`` makes one schema of a
    JSON file's rows (a row without a column reads None there)."""
    return list(dict.fromkeys(k for r in rows for k in r.columns))


def _dotted(raw: dict, key: str, where: str, flag: str):
    """``raw["a"]["b"]`` for key ``a.b``; a missing key is an error naming the row and the flag."""
    v: Any = raw
    for part in key.split("."):
        if not isinstance(v, dict) or part not in v:
            raise BadInputError(f"{where}: row has no `{key}` (named by {flag}; keys: {keys_of(raw)})")
        v = v[part]
    return v


def remap_row(raw: Any, where: str, prompt_key: str | None, answer_key: str | None) -> Any:
    """Rename a dataset's own columns to ``prompt`` / ``answer`` (``--prompt-key`` / ``--answer-key``)."""
    if not isinstance(raw, dict) or (prompt_key is None and answer_key is None):
        return raw
    raw = dict(raw)
    if prompt_key is not None:
        raw["prompt"] = _dotted(raw, prompt_key, where, "--prompt-key")
        if raw["prompt"] is None:  # not a fallback to `question` or `messages`: the named column is empty
            raise BadInputError(f"{where}: `{prompt_key}` (named by --prompt-key) is null")
        raw.pop("messages", None)
    if answer_key is not None:
        # read here, as the column it is: a list or a bool there was "`answer` must be a string or number", of a file
        # that may have no `answer` (review s59r12); the text it gives reads the same again in parse_row
        raw["answer"] = _answer(_dotted(raw, answer_key, where, "--answer-key"), where, answer_key)
        # The named column is the reference: a null there is none, not reward_model's or a solution's.
        raw.pop("reward_model", None)
        raw.pop("solution", None)
    return raw


def load_prompts(path: str | Path, *, skip_bad_lines: bool = False, bad_lines: list[str] | None = None,
                 prompt_key: str | None = None, answer_key: str | None = None, flag: str = "--prompts",
                 columns: bool = True) -> list[PromptRow]:
    """All rows of a JSONL / JSON / Parquet prompt file, validated; ids unique.

    ``skip_bad_lines``: a row that is not JSON or not a valid prompt row is skipped and its error
    appended to ``bad_lines`` instead of raised (a missing or empty file still raises).
    ``prompt_key`` / ``answer_key``: the dataset's own column names (dotted for nested fields,
    e.g. ``reward_model.ground_truth``); the prompt column may hold text or a chat list.
    ``columns``: keep each row's other columns (``PromptRow.columns``); without, none are kept (eval, and a rollout
    whose rewards take none): a dataset's test cases were held through the run for nothing, and a Parquet file's
    float columns read twice.
    """
    path = Path(path)
    if not path.exists():
        raise BadInputError(f"prompt file {path} does not exist", hint=f"check {flag}")
    if path.is_dir():
        if load := _datasets_dir(path):  # said "a directory" alone: how to get a file from it was the user's to find
            raise BadInputError(f"{flag} {path} is a Hugging Face datasets directory (save_to_disk); name a .jsonl, "
                                ".json or .parquet file", hint=_convert_hint(load, path))
        raise BadInputError(f"{flag} {path} is a directory; name a .jsonl, .json or .parquet file")
    if not path.is_file():  # a pipe (<(...), a FIFO) reads once: the stage's fingerprint then hashed nothing
        raise BadInputError(f"{flag} {path} is not a regular file (a pipe or device can be read only once, and the "
                            "output's fingerprint needs its content again)", hint="write it to a file first")
    bad_lines = bad_lines if bad_lines is not None else []
    stored: list[dict] = []  # a Parquet file's float columns as it holds them (``_read_rows``), for row_columns
    raw_rows = _read_rows(path, bad_lines if skip_bad_lines else None, stored if columns else None)
    if not raw_rows:
        raise BadInputError(f"prompt file {path} holds no rows")
    rows: list[PromptRow] = []
    seen: dict[str, str] = {}
    for i, (where, raw) in enumerate(raw_rows):
        if raw is _UNREADABLE:  # already in bad_lines; its index stays taken, so later default ids do not shift
            continue
        try:
            row = parse_row(remap_row(raw, where, prompt_key, answer_key), where, i)
            if columns:
                row.columns = row_columns(raw, stored[i] if stored else None, prompt_key)
            explicit = isinstance(raw, dict) and any(raw.get(k) is not None for k in ID_FIELDS)
            if row.id in seen:
                mine = "" if explicit else " (this row has no id and takes its row index)"
                raise BadInputError(f"{where}: id {row.id!r}{mine} already used at {seen[row.id]}", hint="ids must be unique")
        except BadInputError as e:
            if not skip_bad_lines:
                raise
            bad_lines.append(str(e))
            continue
        # A row without an id takes its index, which can be another row's explicit id: say so.
        seen[row.id] = where if explicit else f"{where} (a row without an id, which takes its row index)"
        rows.append(row)
    if not rows:
        raise BadInputError(f"prompt file {path} holds no valid rows ({len(bad_lines)} bad, first: {bad_lines[0]})")
    return rows


def no_answer(path: str | Path, row: PromptRow, answer_key: str | None) -> tuple[str, str | None]:
    """What a row without a reference lacks, in words after "row ", and, without --answer-key, a hint naming it with
    the row's keys. A chat set often keeps its reference under a name of its own (`final_answer`, `gold`): "row has
    no `answer`" sent the user to add answers the file held, and with --answer-key it named `answer`, not the user's
    empty column (a review). The keys are read from ``path`` again: an error path, and a row keeps none of them."""
    if answer_key is not None:
        return f"has no reference (its `{answer_key}`, named by --answer-key, is null or blank)", None
    raws = (raw for where, raw in _read_rows(Path(path), []) if where == row.where and isinstance(raw, dict))
    keys = keys_of(next(raws, {}))
    return "has no `answer`", f"if a column of another name holds the reference, name it: --answer-key COLUMN; the row's keys: {keys}"


# ---- rendering -----------------------------------------------------------------------------
def load_template(template: str | None) -> str | None:
    """A template string, or the text of a file of that name; must contain ``{prompt}``."""
    if template is None:
        return None
    if (path := template_file(template)) is not None:
        template = path.read_text(encoding="utf-8-sig")
        # the final newline an editor (or `echo`) ends a file with is no part of the prompt, as Jinja drops it from a
        # template file: "Q: {prompt}\nA:\n" prompted "A:\n", not the "A:" the same string as the flag gives
        template = template.removesuffix("\n")
    if "{prompt}" not in template:
        raise BadInputError("--prompt-template must contain {prompt} (or name a file that does)")
    return template


def template_file(template: str | None) -> Path | None:
    """The file ``--prompt-template`` names, or None where it is the template itself."""
    if template is None or "{prompt}" in template or not _is_file(os.path.expanduser(template)):
        return None
    return Path(os.path.expanduser(template))  # ~ after =: the shell left it


def _is_file(name: str) -> bool:
    try:
        return Path(name).is_file()
    except (OSError, ValueError):  # a long template is no file name (ENAMETOOLONG); nor one with NUL
        return False


def read_chat_template(path) -> tuple[str, str]:
    """(The Jinja text of ``--chat-template-file``, its sha256: an input of the run), for a tokenizer
    without a chat template of its own (e.g. a base model's), or to replace it."""
    p = Path(path)
    if not p.is_file():
        raise BadInputError(f"--chat-template-file {p} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BadInputError(f"--chat-template-file {p} is not UTF-8 text") from None
    if not text.strip():
        raise BadInputError(f"--chat-template-file {p} is empty")
    return text, sha256_bytes(text.encode())


def set_chat_template(tokenizer, text: str, path) -> None:
    """Give ``tokenizer`` the template ``text`` (from ``path``), checked by rendering one conversation."""
    tokenizer.chat_template = text
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja2 raises several types for a bad template
        raise BadInputError(f"--chat-template-file {path} does not render a conversation "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


# apply_chat_template's own arguments and the variables transformers fills itself: a kwarg of such a name is no
# variable of the template's to set (it clashed with qerl's own argument, or changed how qerl renders the prompt)
RESERVED_CHAT_TEMPLATE_KWARGS = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"))
_KWARGS_EXAMPLE = """--chat-template-kwargs '{"enable_thinking": false}'"""


def parse_chat_template_kwargs(value: Any) -> dict | None:
    """``--chat-template-kwargs``: a JSON object (its text, or a dict from Python) -> the chat template's extra
    variables, as plain JSON values (what the fingerprint records); None for none (``{}`` is the run without it)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            detail = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
            raise BadInputError(f"--chat-template-kwargs is not valid JSON ({detail})",
                                hint=f"pass a JSON object in single quotes, e.g. {_KWARGS_EXAMPLE}") from None
    if not isinstance(value, dict):
        raise BadInputError(f"--chat-template-kwargs must be a JSON object of template variables, got "
                            f"{type(value).__name__} {str(value)[:80]}", hint=f"e.g. {_KWARGS_EXAMPLE}")
    for key in value:
        if not isinstance(key, str) or not key.isidentifier():  # a template cannot read "enable-thinking"
            raise BadInputError(f"--chat-template-kwargs: {key!r} is no name a chat template can read")
        if key in RESERVED_CHAT_TEMPLATE_KWARGS:
            raise BadInputError(f"--chat-template-kwargs: `{key}` is set by qerl itself, not a template variable",
                                hint="system prompts go in --system-prompt, the template in --chat-template-file")
    try:  # plain JSON values: a tuple is recorded as the list the CLI gives; a set or an object is refused
        plain = json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise BadInputError(f"--chat-template-kwargs must hold JSON values only ({e})") from None
    return plain or None


def chat_template_variables(tokenizer) -> set[str] | None:
    """The variables the tokenizer's chat template reads from outside (None when it cannot be parsed here)."""
    import jinja2
    import jinja2.meta

    try:
        text = tokenizer.get_chat_template()
    except Exception:  # noqa: BLE001 - no template, or named ones without a default: rendering says so
        return None
    try:  # transformers' own environment: its extensions ({% generation %}, loop controls) parse
        from transformers.utils.chat_template_utils import _compile_jinja_template

        env = _compile_jinja_template(text).environment
    except Exception:  # noqa: BLE001 - a private helper of transformers; a bad template is rendering's to report
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return set(jinja2.meta.find_undeclared_variables(env.parse(text)))
    except jinja2.TemplateError:
        return None


def check_chat_template_kwargs(tokenizer, kwargs: dict) -> None:
    """Each ``--chat-template-kwargs`` name must be a variable the chat template reads: Jinja renders an unknown
    one as nothing, so a misspelt ``enable_thinkng`` changed nothing but the run's fingerprint, without a word."""
    names = chat_template_variables(tokenizer)
    unread = sorted(k for k in kwargs if names is not None and k not in names)
    if unread:
        offered = sorted(names - RESERVED_CHAT_TEMPLATE_KWARGS - {"raise_exception", "strftime_now"})
        raise BadInputError(f"--chat-template-kwargs: the chat template reads no variable `{unread[0]}`"
                            + (f" (it reads: {', '.join(offered)})" if offered else " (it reads none)"),
                            hint="check the name against the model's chat template (chat_template.jinja or "
                                 "tokenizer_config.json)")


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(
    row: PromptRow,
    tokenizer,
    *,
    template: str | None = None,
    system_prompt: str | None = None,
    chat_template: bool | None = None,
    chat_template_kwargs: dict | None = None,
) -> str:
    """The exact text the model is prompted with (see the module docstring)."""
    use_chat = has_chat_template(tokenizer) if chat_template is None else chat_template
    if use_chat and not has_chat_template(tokenizer):
        raise BadInputError("--chat-template was requested but the tokenizer has no chat template")
    if row.messages is not None:
        if not use_chat:
            raise BadInputError(
                f"{row.where}: row has `messages` but the tokenizer has no chat template (or it is turned off)",
                hint="give such rows a `prompt` string instead, or pass --chat-template-file with a Jinja template",
            )
        msgs = [dict(m) for m in row.messages]
        if template is not None:  # wrap the last user turn
            for m in reversed(msgs):
                if m["role"] == "user":
                    m["content"] = template.replace("{prompt}", m["content"])
                    break
            else:  # a chat of other roles ("human", ShareGPT's) was sent without the template, without a word
                roles = ", ".join(dict.fromkeys(m["role"] for m in msgs))
                raise BadInputError(f"{row.where}: --prompt-template wraps the last `user` message, and this row's "
                                    f"`messages` have none (roles: {roles})")
    else:
        text = row.prompt if template is None else template.replace("{prompt}", row.prompt)
        if not use_chat:
            return text
        msgs = [{"role": "user", "content": text}]
    if system_prompt and not any(m["role"] == "system" for m in msgs):
        msgs = [{"role": "system", "content": system_prompt}, *msgs]
    try:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                             **(chat_template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - jinja errors from a model's own template
        raise BadInputError(f"{row.where}: the tokenizer's chat template failed ({type(e).__name__}: {e})") from None


def encode_prompts(
    rows: Sequence[PromptRow],
    tokenizer,
    *,
    template: str | None = None,
    system_prompt: str | None = None,
    chat_template: bool | None = None,
    chat_template_kwargs: dict | None = None,
    max_prompt_tokens: int | None = None,
    on_long: str = "skip",
    report: EncodeReport | None = None,
    long_hint: str = "pass --long-prompts skip to skip such prompts, or raise --max-model-len",
    vocab_size: int | None = None,
) -> list[EncodedPrompt]:
    """Render and tokenize rows; prompts over ``max_prompt_tokens`` are skipped (counted) or an error
    (``long_hint``: what the calling stage's flags offer). ``vocab_size``: the model's; a prompt holding a
    token id at or past it (a tokenizer with tokens the model has no embedding for) is an error naming its row."""
    if on_long not in LONG_PROMPT_POLICIES:
        raise BadInputError(f"--long-prompts must be one of {', '.join(LONG_PROMPT_POLICIES)}, got {on_long!r}")
    report = report if report is not None else EncodeReport()
    report.max_prompt_tokens = max_prompt_tokens
    use_chat = has_chat_template(tokenizer) if chat_template is None else chat_template
    if system_prompt and not use_chat:  # it was dropped without a word
        raise BadInputError("--system-prompt needs a chat template: the tokenizer has none"
                            + (" in use (--no-chat-template)" if chat_template is False else ""),
                            hint="put the instruction in --prompt-template instead")
    if chat_template_kwargs:
        if not use_chat:  # they would be dropped without a word
            raise BadInputError("--chat-template-kwargs needs a chat template: the tokenizer has none"
                                + (" in use (--no-chat-template)" if chat_template is False else ""))
        check_chat_template_kwargs(tokenizer, chat_template_kwargs)
    out = []
    for row in rows:
        if system_prompt and row.messages is not None and any(m["role"] == "system" for m in row.messages):
            report.own_system.append(row.where)
        text = render_prompt(row, tokenizer, template=template, system_prompt=system_prompt, chat_template=chat_template,
                             chat_template_kwargs=chat_template_kwargs)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON may escape a lone surrogate ("\ud800"); no tokenizer takes it
            raise BadInputError(f"{row.where}: prompt holds an unpaired surrogate ({text[e.start]!a}), "
                                "which is not text") from None
        # A chat template writes its own BOS/special tokens; raw text gets the tokenizer's usual ones.
        ids = tokenizer(text, add_special_tokens=not use_chat)["input_ids"]
        if not ids:
            raise BadInputError(f"{row.where}: prompt encodes to zero tokens")
        if vocab_size is not None and max(ids) >= vocab_size:
            bad = max(ids)
            raise BadInputError(f"{row.where}: prompt holds token {bad} ({tokenizer.convert_ids_to_tokens(bad)!r}), "
                                f"outside the model's vocabulary of {vocab_size} (config.json vocab_size)",
                                hint="the tokenizer has tokens the model has no embedding for (added without resizing it)")
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            if on_long == "error":
                raise BadInputError(
                    f"{row.where}: prompt has {len(ids)} tokens, more than the {max_prompt_tokens} that fit the context",
                    hint=long_hint,
                )
            report.skipped_long.append(f"{row.where} ({len(ids)} tokens)")
            continue
        out.append(EncodedPrompt(row, text, list(ids)))
    return out
