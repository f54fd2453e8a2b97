"""Rollout shards: versioned JSONL records, one completion per line.

A shard is the hand-over between ``qerl rollout`` and ``qerl train-step`` (record fields:
docs/rollout.md, "Record"). JSONL was chosen over Parquet because it can be *appended* a
group at a time and survives a crash with at most the last line damaged: the writer appends
the G lines of one group and flushes, so a killed process loses at most the group in flight (fsyncs,
which a machine crash needs, come at most once a second: ``ShardWriter``). The price is size and parse speed (a few MB per thousand completions, negligible next to
generation time).

Reading validates every line: not JSON, a missing field, a wrong type or a ragged
``logprobs``/``completion_token_ids`` pair is a ``BadInputError`` naming ``file:line``, unless
``skip_bad_lines`` (then bad lines are counted in the ``ReadReport``). Records of different
``schema_version`` in one read are refused: a trainer must not silently mix layouts.

Resume (``load_complete_groups``) is more forgiving on purpose: a torn last line (no newline)
or a group with fewer than G lines is what a crash leaves, so it is cut off and regenerated,
and the file is rewritten atomically to hold only complete groups.
"""

from __future__ import annotations

import glob as _glob
import hashlib
import json
import math
import os
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_cli.errors import BadInputError
from qerl_cli.outputs import MANIFEST, crash_point, damaged_output, read_manifest

SCHEMA_VERSION = 1

# field -> accepted JSON types. ``None`` inside a tuple means the field may be null.
FIELDS: dict[str, tuple] = {
    "schema_version": (int,),
    "prompt_id": (str,),
    "group_id": (str,),
    "prompt": (str, list),
    "prompt_token_ids": (list,),
    "completion_token_ids": (list,),
    "completion": (str,),
    "logprobs": (list,),
    "finish_reason": (str,),
    "rewards": (dict,),
    "reward": (int, float),
    "answer": (str, type(None)),
    "step": (int,),
    "policy": (dict,),
    "sampling": (dict,),
    "noise": (dict,),
    "engine": (str,),
}
# The stages contract's "answer (reference, if any)": a writer may leave it out; read as null.
OPTIONAL_FIELDS = ("answer",)
FINISH_REASONS = ("stop", "length")
SHARD_GLOB = "shard-*-of-*.jsonl"


def shard_name(index: int, num_shards: int) -> str:
    """``shard-00003-of-00008.jsonl``: zero-based index, total count (the Hugging Face convention)."""
    if not (0 <= index < num_shards):
        raise BadInputError(f"shard index {index} is outside 0..{num_shards - 1}", hint="check --shard-index/--num-shards")
    return f"shard-{index:05d}-of-{num_shards:05d}.jsonl"


def make_record(
    *,
    prompt_id: str,
    group_id: str,
    prompt: str | list,
    prompt_token_ids: Sequence[int],
    completion_token_ids: Sequence[int],
    completion: str,
    logprobs: Sequence[float],
    finish_reason: str,
    rewards: dict[str, float],
    reward: float,
    answer: str | None,
    step: int,
    policy: dict,
    sampling: dict,
    noise: dict,
    engine: str,
    **extra: Any,
) -> dict:
    """One record with every field of the schema, in the documented order (extra keys appended)."""
    rec = {
        "schema_version": SCHEMA_VERSION,
        "prompt_id": str(prompt_id),
        "group_id": str(group_id),
        "prompt": prompt,
        "prompt_token_ids": [int(t) for t in prompt_token_ids],
        "completion_token_ids": [int(t) for t in completion_token_ids],
        "completion": completion,
        "logprobs": [float(x) for x in logprobs],
        "finish_reason": finish_reason,
        "rewards": {k: float(v) for k, v in rewards.items()},
        "reward": float(reward),
        "answer": answer,
        "step": int(step),
        "policy": policy,
        "sampling": sampling,
        "noise": noise,
        "engine": engine,
    }
    rec.update(extra)
    return rec


def _number(v) -> bool:
    return type(v) in (int, float) and _finite(v)


def _finite(v) -> bool:
    """``math.isfinite`` of a JSON number. JSON reads a 1 and 400 zeros as an int no float holds: isfinite raised
    OverflowError there, a traceback where a bad line is named (and --skip-bad-lines could not skip it)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _noise_problem(noise: dict) -> str | None:
    """train-step rebuilds the AQN vectors from these: a record without them would train without noise
    (``{}`` read as AQN off) or fail with a KeyError."""
    sigma = noise.get("sigma")
    if not _number(sigma) or sigma < 0:
        return f"noise.sigma should be a number >= 0, got {sigma!r}"
    if sigma > 0 and type(noise.get("seed")) is not int:
        return f"noise.seed should be an integer when noise.sigma > 0, got {noise.get('seed')!r}"
    if "step" in noise and type(noise["step"]) is not int:  # absent: the record's step (the contract's form)
        return f"noise.step should be an integer, got {noise['step']!r}"
    return None


def _sampling_problem(sampling: dict) -> str | None:
    """train-step scales log-probs by the temperature the tokens were drawn at."""
    t = sampling.get("temperature")
    if not _number(t) or t < 0:
        return f"sampling.temperature should be a number >= 0, got {t!r}"
    return None


def validate_record(rec: Any) -> str | None:
    """Why ``rec`` is not a valid record, or None when it is."""
    if not isinstance(rec, dict):
        return f"expected a JSON object, got {type(rec).__name__}"
    missing = [k for k in FIELDS if k not in rec and k not in OPTIONAL_FIELDS]
    if missing:
        return f"missing field(s) {', '.join(missing)}"
    for k, types in FIELDS.items():
        v = rec.get(k)
        # bool is an int subclass in Python; a boolean reward or step is a bug upstream.
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            return f"field {k!r} should be {want}, got {type(v).__name__}"
    if rec["schema_version"] > SCHEMA_VERSION:
        return f"schema_version {rec['schema_version']} is newer than this qerl reads ({SCHEMA_VERSION}); upgrade qerl"
    if rec["schema_version"] < 1:
        return f"schema_version {rec['schema_version']} is not a version (they start at 1)"
    if rec["step"] < 0:  # train-step wrote its adapter as the step after it: a trainer_state of step 0 from "step -1"
        return f"step {rec['step']} is not a rollout step (they start at 0)"
    why = _noise_problem(rec["noise"]) or _sampling_problem(rec["sampling"])
    if why:
        return why
    if rec["finish_reason"] not in FINISH_REASONS:
        return f"finish_reason {rec['finish_reason']!r} is not one of {', '.join(FINISH_REASONS)}"
    if len(rec["logprobs"]) != len(rec["completion_token_ids"]):
        return (
            f"{len(rec['logprobs'])} logprobs for {len(rec['completion_token_ids'])} completion tokens "
            "(one logprob per sampled token expected)"
        )
    # Per-element checks run on every record read or written, so they use the cheapest exact test
    # (``type(x) is int`` also excludes bool); ~50 us per 1k tokens.
    if not all(type(t) is int for t in rec["completion_token_ids"]):
        return "completion_token_ids must be integers"
    if not all(type(t) is int for t in rec["prompt_token_ids"]):
        return "prompt_token_ids must be integers"
    lps = rec["logprobs"]
    if not all(type(x) is float or type(x) is int for x in lps):
        return "logprobs must be numbers"
    # Python's json reads NaN/Infinity. One bad value makes the sum non-finite; only then (or on a
    # freak overflow of huge values) is the exact per-element test paid.
    if not _finite(rec["reward"]) or (
            not _finite(_sum(lps)) and not all(_finite(x) for x in lps)):
        return "logprobs and reward must be finite (found NaN or Inf, or a number past float's range)"
    if abs(rec["reward"]) > REWARD_LIMIT:
        return f"reward {rec['reward']!r} is beyond +-{REWARD_LIMIT:g} (group statistics would overflow)"
    if lps and max(lps) > LOGPROB_SLACK:  # a probability above 1: a wrong field or a sampler fault
        return f"logprob {max(lps)!r} is above 0 (a log-probability is at most 0)"
    for k in ("base", "adapter"):
        if k not in rec["policy"]:
            return f"policy lacks {k!r}"
    return None


def _sum(xs: list) -> float:
    """``sum`` of JSON numbers, inf where an int past float's range makes it raise (adding it to a float)."""
    try:
        return sum(xs)
    except OverflowError:
        return math.inf


LOGPROB_SLACK = 1e-3  # rounding room above 0 for a log-probability computed in low precision
# Rewards beyond this break a step's statistics: a rollout's mean of 1e308s overflowed (a traceback, exit 1)
# and train-step's group std squares them. No scoring scheme needs more.
REWARD_LIMIT = 1e15


def _dumps(rec: dict, ascii: bool = False) -> str:
    # allow_nan=False: a NaN logprob or reward would be written as bare NaN, which is not JSON.
    try:
        return json.dumps(rec, ensure_ascii=ascii, separators=(",", ":"), allow_nan=False)
    except ValueError as e:
        raise BadInputError(
            f"record {rec.get('prompt_id')!r}/{rec.get('group_id')!r} holds NaN or Inf ({e})",
            hint="a reward function or the sampler produced a non-finite value",
        ) from None


def _line(rec: dict) -> bytes:
    """One JSONL line as UTF-8. Text stays readable (no \\u escapes) unless it holds a lone
    surrogate (possible from a prompt file's JSON escapes), which UTF-8 cannot carry: then
    that record is written ASCII-escaped, which reads back to the identical string."""
    try:
        return _dumps(rec).encode("utf-8") + b"\n"
    except UnicodeEncodeError:
        return _dumps(rec, ascii=True).encode("ascii") + b"\n"


class ShardWriter:
    """Appends groups of records to one shard file; each group is flushed, and fsynced at most every
    ``fsync_every_s`` seconds (and on close).

    Why not fsync every group: a killed process loses nothing that was flushed (the kernel holds it);
    only a machine crash loses what was not fsynced, here at most the last ``fsync_every_s`` seconds of
    groups, which a rerun regenerates. One fsync per group cost 1.1 of 11 s of a small CPU rollout on a
    local disk (200 groups), and an fsync on a network filesystem can take tens of milliseconds.

    >>> with ShardWriter(work / shard_name(0, 1)) as w:
    ...     w.write_group(records_of_one_prompt)
    """

    def __init__(self, path: Path | str, fsync_every_s: float = 1.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab")
        self.groups_written = 0
        self.records_written = 0
        self.fsync_every_s = fsync_every_s
        self.fsyncs = 0
        self._synced_at = time.monotonic()

    def write_group(self, records: Sequence[dict]) -> None:
        for rec in records:
            err = validate_record(rec)
            if err:
                raise ValueError(f"refusing to write an invalid record: {err}")
        # One write call per group: with the fsync below, a crash leaves whole groups plus at
        # most one torn group at the end, which resume cuts off.
        self._f.write(b"".join(_line(r) for r in records))
        self._f.flush()
        if time.monotonic() - self._synced_at >= self.fsync_every_s:
            self._fsync()
        self.groups_written += 1
        self.records_written += len(records)
        crash_point("shard-group")

    def _fsync(self) -> None:
        os.fsync(self._f.fileno())
        self.fsyncs += 1
        self._synced_at = time.monotonic()

    def close(self) -> None:
        if not self._f.closed:
            try:
                self._f.flush()
                self._fsync()
            finally:
                self._f.close()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_records(path: Path | str, records: Iterable[dict]) -> int:
    """Append ``records`` to ``path`` one group (consecutive equal ``group_id``) at a time."""
    n = 0
    with ShardWriter(path) as w:
        group: list[dict] = []
        for rec in records:
            if group and rec.get("group_id") != group[-1].get("group_id"):
                w.write_group(group)
                group = []
            group.append(rec)
            n += 1
        if group:
            w.write_group(group)
    return n


# ---- reading ---------------------------------------------------------------------------------
@dataclass
class ReadReport:
    """What a read saw: files, good records, and the bad lines skipped (``file:line: why``)."""

    files: list[Path] = field(default_factory=list)
    records: int = 0
    bad_lines: list[str] = field(default_factory=list)
    origins: list[tuple[Path, int]] = field(default_factory=list)  # (file, line) of each record yielded
    # sha256 of each file read to its end, of the bytes parsed: train-step's fingerprint hashes what it trained on
    hashes: list[str] = field(default_factory=list)


def resolve_shard_files(sources: str | Path | Iterable[str | Path]) -> list[Path]:
    """Shard files named by a directory (its ``shard-*.jsonl``), a file, or a glob; several allowed."""
    if isinstance(sources, (str, Path)):
        sources = [sources]
    files: list[Path] = []
    for src in sources:
        s = os.path.expanduser(str(src))  # --shards=~/r: the shell expands no ~ after = (nor in quotes)
        # A path that exists is itself, even with glob characters in it ("run [v1]/step-0").
        globbed = any(c in s for c in "*?[") and not Path(s).exists()
        if globbed:
            # A stage's manifest.json is no shard: "step-3/*" read it as 100 bad lines, and the hint to pass
            # --skip-bad-lines then trained "around" it.
            matched = [m for m in sorted(_glob.glob(s)) if not (Path(m).name == MANIFEST and Path(m).is_file())]
            if not matched:
                raise BadInputError(f"no files match the shard glob {s!r}")
            paths = [Path(m) for m in matched]
        else:
            paths = [Path(s)]
        for p in paths:
            if p.is_dir():
                if (p / "adapter_config.json").is_file():  # --adapter and --shards swapped: its metrics.jsonl is no shard
                    raise BadInputError(f"{p} is a LoRA adapter directory, not rollout shards",
                                        hint="pass it as --adapter, and the rollout output as --shards")
                manifest = read_manifest(p) or {}
                stage = manifest.get("stage")
                if stage not in (None, "rollout"):  # its *.jsonl (eval's samples, metrics) are no shards
                    raise BadInputError(f"{p} is the output of `qerl {stage}`, not rollout shards",
                                        hint=f"narrow the glob {s!r}" if globbed else "pass a rollout output as --shards")
                # A finished rollout whose shard was deleted or cut since: it was called no rollout output ("narrow
                # the glob", "is it a rollout output dir?"), a torn line "a crash mid-write", and a cut at a line
                # end trained on what was left without a word.
                if stage == "rollout" and (damage := damaged_output(p, manifest)):
                    raise BadInputError(f"{p} holds a rollout output damaged after it was written ({damage})",
                                        hint="rerun that rollout with --force into it, or restore the file")
                if globbed and not any(p.glob(SHARD_GLOB)):  # a directory a glob swept in: only rollout's files
                    raise BadInputError(f"{p} (matched by {s!r}) holds no rollout shards ({SHARD_GLOB})",
                                        hint="narrow the glob to rollout output directories")
                found = sorted(p.glob(SHARD_GLOB)) or sorted(p.glob("*.jsonl"))
                if not found:
                    raise BadInputError(f"{p} holds no shard files ({SHARD_GLOB})", hint="is it a rollout output dir?")
                files.extend(found)
            elif p.is_file():
                files.append(p)
            else:
                raise BadInputError(f"shard path {p} does not exist")
    # The same file named twice (a dir and a glob inside it) would double its records.
    seen: set[Path] = set()
    unique = []
    for f in files:
        r = f.resolve()
        if r not in seen:
            seen.add(r)
            unique.append(f)
    return unique


def missing_shards(files: Iterable[Path]) -> list[str]:
    """Names of the ``shard-i-of-N`` files that ``files`` lack for the N their names announce (a job of a
    sharded rollout that never finished, or one not named)."""
    have: dict[int, set[int]] = {}
    for f in files:
        m = re.fullmatch(r"shard-(\d+)-of-(\d+)\.jsonl", Path(f).name)
        if m:
            have.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    return [shard_name(i, n) for n, idx in sorted(have.items()) for i in range(n) if i not in idx]


def open_shard(path: Path, hint: str | None = None):
    """``path`` opened for reading bytes, or the one-line "cannot read shard" error."""
    try:
        return open(path, "rb")
    except OSError as e:
        raise BadInputError(f"cannot read shard {path}: {e.strerror}", hint=hint) from None


def _iter_file(path: Path, skip_bad_lines: bool, report: ReadReport) -> Iterator[dict]:
    # Streamed line by line: a large step's shards need not fit in memory twice.
    h = hashlib.sha256()
    with open_shard(path) as f:
        for i, raw in enumerate(f, start=1):
            h.update(raw)
            if not raw.strip():
                continue
            rec, msg = parse_line(path, i, raw)
            if msg is not None:
                if not skip_bad_lines:
                    raise bad_line_error(msg)
                report.bad_lines.append(msg)
                continue
            report.records += 1
            report.origins.append((path, i))
            yield rec
    report.hashes.append(h.hexdigest())


def parse_line(path: Path, i: int, raw: bytes) -> tuple[dict | None, str | None]:
    """Line ``i`` of ``path`` (its bytes, newline included) as (record, None), or (None, "path:i: why") when it
    is no valid record. Shared by the whole-file reader and train-step's ranks, which parse a part each."""
    torn = not raw.endswith(b"\n")  # only the last line can lack its newline: a crash mid-write
    try:
        rec = json.loads(raw)
        err = validate_record(rec)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: arrays nested ~100k deep
        rec, err = None, f"not valid JSON ({e.__class__.__name__}: {str(e).splitlines()[0][:80]})"
    if err is not None and torn:
        err = f"truncated last line, probably a crash mid-write ({err})"
    if err is not None:
        return None, f"{path}:{i}: {err}"
    for k in OPTIONAL_FIELDS:
        rec.setdefault(k, None)
    return rec, None


def bad_line_error(msg: str) -> BadInputError:
    return BadInputError(msg, hint="pass --skip-bad-lines to skip such lines")


def iter_records(
    sources: str | Path | Iterable[str | Path], *, skip_bad_lines: bool = False, report: ReadReport | None = None
) -> Iterator[dict]:
    """Validated records of every shard named by ``sources`` (see ``resolve_shard_files``)."""
    report = report if report is not None else ReadReport()
    report.files = resolve_shard_files(sources)
    version: tuple[int, str] | None = None
    for path in report.files:
        for rec in _iter_file(path, skip_bad_lines, report):
            version = one_schema(rec, path, version)
            yield rec


def one_schema(rec: dict, path: Path, version: tuple[int, str] | None) -> tuple[int, str]:
    """The (schema_version, first file) of a read so far, with ``rec`` of ``path`` read next; refuses a mix."""
    v = rec["schema_version"]
    if version is None:
        return v, f"{path}"
    if v != version[0]:
        raise BadInputError(
            f"{path}: schema_version {v} mixed with schema_version {version[0]} from {version[1]}",
            hint="regenerate the older shards with this qerl version",
        )
    return version


def check_groups_whole(records: list[dict], origins: list[tuple[Path, int]]) -> None:
    """Each group's records must lie in one file. A group found in two files (a retried job's second
    output dir, a copied shard, two prompt files whose default ids collide) would silently merge two
    samplings into one group's advantages. Within one file the lines of a group need not be adjacent:
    the stages contract asks only for a shared group_id, and a writer that emits completions as they
    finish interleaves groups. qerl's rollout writes each group as one run of lines, so in its
    records a group that comes back (a shard concatenated with itself, two retries appended to one
    file) is the same group twice."""
    first: dict[str, int] = {}
    for j, r in enumerate(records):
        g = r["group_id"]
        if g not in first:
            first[g] = j
            continue
        if r["prompt_id"] != records[first[g]]["prompt_id"]:  # advantages would compare different prompts
            (fa, la), (fb, lb) = origins[first[g]], origins[j]
            raise BadInputError(f"group {g!r} holds prompt {records[first[g]]['prompt_id']!r} at {fa}:{la} and "
                                f"prompt {r['prompt_id']!r} at {fb}:{lb}",
                                hint="a group is one prompt's G completions: give each prompt its own group_id")
        # qerl's own records (their policy names the trained norms, a key the contract's {base, adapter} lacks; the
        # contract's engine names, native and vllm, are any writer's) are one run of lines per group
        comes_back = records[j - 1]["group_id"] != g and "norms" in r["policy"]
        if origins[first[g]][0] != origins[j][0] or comes_back:
            (fa, la), (fb, lb) = origins[first[g]], origins[j]
            raise BadInputError(f"group {g!r} appears at {fa}:{la} and again at {fb}:{lb}",
                                hint="train on each group once: name each rollout output of the step once")


def read_records(
    sources: str | Path | Iterable[str | Path], *, skip_bad_lines: bool = False, report: ReadReport | None = None
) -> list[dict]:
    """All validated records (in file order) of a shard dir, file or glob, or several of them."""
    return list(iter_records(sources, skip_bad_lines=skip_bad_lines, report=report))


# ---- resume ----------------------------------------------------------------------------------
def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def load_complete_groups(path: Path, group_size: int) -> tuple[dict[str, list[dict]], int]:
    """Complete groups already in a partial shard, and how many lines were dropped.

    Keeps only groups with exactly ``group_size`` valid records; a torn last line, an
    unparseable line or an incomplete group is dropped, and the file is rewritten (atomically)
    to hold exactly the kept groups in their original order, so appending can continue.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".repair")
    # A run killed while repairing left it: removed, or the next run that needed no repair published it in --out
    tmp.unlink(missing_ok=True)
    if not path.exists():
        return {}, 0
    report = ReadReport()
    recs = list(_iter_file(path, True, report))
    counts = Counter(r["group_id"] for r in recs)
    groups: dict[str, list[dict]] = {}
    for r in recs:
        if counts[r["group_id"]] == group_size:
            groups.setdefault(r["group_id"], []).append(r)
    kept = sum(len(g) for g in groups.values())
    dropped = len(report.bad_lines) + (len(recs) - kept)
    # A crash can also tear off just the last newline: the line still parses, but appending would
    # glue the next record onto it. Rewriting ends the file on a whole line.
    torn = path.stat().st_size > 0 and not _ends_with_newline(path)
    if dropped or torn:
        with open(tmp, "wb") as f:
            for g in groups.values():
                f.write(b"".join(_line(r) for r in g))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return groups, dropped
