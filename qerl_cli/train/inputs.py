"""The ``train-step`` stage's inputs: the rollout shards read into one step (``read_step`` -> ``StepData``), and
what the stage takes from them and from the input adapter before anything is loaded.

``read_step`` streams the shards in path order (``_in_path_order``: the order changes float sums, not the step),
packs each record's token ids and sampling log-probs as it comes (``_compact``), and refuses shards that are not one
step: mixed base models, policies (``_policy_name``), rollout steps or AQN noise records (``_noise_key``), or a
sampling cut it cannot read (``_sampling_cut``). From what it read: Dr. GRPO's divisor (``dr_grpo_length``) and the
input hashes of the step's fingerprint (``_shards_hash``, of the bytes the read parsed: no second read of the files
that a rewrite in between could make describe other bytes; the input adapter's files, ``_adapter_inputs_hash``).
Under torchrun, where the ranks' shards hold the same bytes, each rank parses a byte-balanced run of the lines and
the ranks exchange what they found (``_read_shared``: records without their arrays, lengths, bad lines); once the
micro-batches are split, ``_keep_owned`` reads the token arrays of this rank's own, and only those.
The checks of the step against the flags, the model and the lineage are ``train.checks``'s.
"""

from __future__ import annotations

import array
import hashlib
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qerl_cli.adapters import NORMS
from qerl_cli.errors import BadInputError, LineageError
from qerl_cli.hashing import sha256_file
from qerl_cli.train.optim import OPTIMIZER_FILE
from qerl_cli.train.state import STATE_FILE

if TYPE_CHECKING:
    from qerl_cli.train_step import TrainStepConfig


@dataclass
class StepData:
    """Everything the step needs from the shards, in record order."""

    records: list[dict]
    files: list[Path]
    prompts: list[list[int]]
    completions: list[list[int]]
    sampling_logprobs: list[list[float]]
    temperatures: list[float]
    truncated: list[bool]
    rewards: list[float]
    group_ids: list[str]
    base_hash: str
    adapter_hash: str | None
    step: int
    noise: dict | None
    bad_lines: tuple[str, ...] = ()  # "file:line: why" of shard lines skipped by --skip-bad-lines
    cuts: list[tuple[float, int, float]] | None = None  # (top_p, top_k, min_p) per record; None: no record was cut
    files_as_named: tuple[Path, ...] = ()  # ``files`` in --shards' order (older qerl read and hashed them so)
    origins: tuple[tuple[Path, int], ...] = ()  # (file, line) of each record, for messages that name one

    # Every record's, kept when the token arrays are only this rank's micro-batches' (``_keep_owned``):
    prompt_lengths: list[int] | None = None
    completion_lengths: list[int] | None = None
    id_ranges: list[tuple[int, int]] | None = None  # (lowest, highest) token id of each record
    line_offsets: tuple[int, ...] = ()  # byte offset of each record's line: its arrays are read by ``_keep_owned``
    line_digests: tuple[int, ...] = ()  # crc32 of each record's line as parsed: ``_reread`` refuses other bytes
    file_hashes: tuple[str, ...] = ()  # sha256 of each of ``files`` as read: the fingerprint's (``_shards_hash``)

    def __post_init__(self):
        if self.prompt_lengths is None:
            self.prompt_lengths = [len(p) for p in self.prompts]
        if self.completion_lengths is None:
            self.completion_lengths = [len(c) for c in self.completions]
        if self.id_ranges is None:
            self.id_ranges = [_id_range(p, c) for p, c in zip(self.prompts, self.completions)]

    def token_ids(self, i: int) -> tuple:
        """Record ``i``'s prompt and completion token ids, read again from its line if this rank does not hold them."""
        if self.prompts[i] is not None:
            return self.prompts[i], self.completions[i]
        return next(_reread(self, [i]))[1][:2]


def read_step(cfg: TrainStepConfig, dist=None) -> StepData:
    """Read the shards and check that they form one consistent step. Under torchrun (``dist``), where every rank's
    shards hold the same bytes, each rank parses a part and they share what the checks and the packing need; the
    token arrays then come with ``_keep_owned``, each rank's own only."""
    from qerl_cli.shards import ReadReport, check_groups_whole, resolve_shard_files

    report = ReadReport()
    named = resolve_shard_files(cfg.shards)
    # In path order, whatever order --shards named them in: the order changes float sums, so `--shards b a`
    # was another step than `--shards a b` (exit 4 over the finished one)
    files = _in_path_order(named)
    shared = _read_shared(files, cfg.skip_bad_lines, report, dist) if dist is not None and dist.enabled else None
    recs, prompts, completions, sampling_lps, sizes = shared or _read_whole(files, cfg.skip_bad_lines, report)
    where = ", ".join(str(f) for f in report.files[:3]) + (" ..." if len(report.files) > 3 else "")
    if not recs:
        skipped = (f" (--skip-bad-lines skipped all {len(report.bad_lines)} lines; first: {report.bad_lines[0]})"
                   if report.bad_lines else "")
        raise BadInputError(f"{where}: no rollout records to train on{skipped}")
    check_groups_whole(recs, report.origins)
    for r, (p, _, _), (f, line) in zip(recs, sizes.lengths, report.origins):
        # Caught here, by every rank alike (the ranks have joined, but none has loaded anything): found later by the
        # one rank that collates it, the other ranks died in gloo (or would wait in NCCL) and torchrun could blame them.
        if not p:
            raise BadInputError(f"{f}:{line}: record of group {r['group_id']!r} has no prompt tokens")
    first = recs[0]
    f0, l0 = report.origins[0]

    def at(i: int) -> str:  # by file:line (a record's index counts over every file given: "record 32345" found nothing)
        f, line = report.origins[i]
        return f"{f}:{line} (group {recs[i]['group_id']!r}) and {f0}:{l0}"

    for i, r in enumerate(recs):
        if r["policy"].get("base") != first["policy"].get("base"):
            raise LineageError(
                f"shards mix base models: {at(i)} were sampled from base {r['policy'].get('base')!s:.12} and "
                f"{first['policy'].get('base')!s:.12}")
        if (r["policy"].get("adapter"), r["policy"].get("norms")) != (first["policy"].get("adapter"),
                                                                       first["policy"].get("norms")):
            steps = f" at rollout steps {r['step']} and {first['step']}" if r["step"] != first["step"] else ""
            raise LineageError(
                f"shards mix policies: {at(i)} were sampled with {_policy_name(r['policy'])} and "
                f"{_policy_name(first['policy'])}{steps}", hint="train on the shards of one step at a time")
        if r["step"] != first["step"]:
            raise BadInputError(f"shards mix rollout steps {first['step']} and {r['step']} ({at(i)})",
                                hint="train on the shards of one step at a time")
        if _noise_key(r["noise"], r["step"]) != _noise_key(first["noise"], first["step"]):
            raise BadInputError(f"shards mix AQN noise records: {r['noise']} vs {first['noise']} ({at(i)})")
    temps, cuts = [], []
    for r, (f, line) in zip(recs, report.origins):
        t = r["sampling"].get("temperature", 1.0)
        t = 1.0 if t is None else float(t)
        # Greedy (t = 0) records carry the untempered log-prob of the argmax (engine contract).
        temps.append(t if t > 0 else 1.0)
        try:
            cuts.append(_sampling_cut(r["sampling"]) if t > 0 else (1.0, 0, 0.0))
        except BadInputError as e:
            raise BadInputError(f"{f}:{line}: {e}") from None
    noise = first["noise"] or None
    if noise is not None and not float(noise.get("sigma", 0.0) or 0.0):
        noise = None
    if noise is not None and "step" not in noise:  # the contract's {sigma, seed}: drawn for the record's step
        noise = dict(noise, step=first["step"])
    return StepData(
        records=recs,
        files=report.files,
        prompts=prompts,
        completions=completions,
        sampling_logprobs=sampling_lps,
        temperatures=temps,
        truncated=[r["finish_reason"] == "length" for r in recs],
        rewards=[float(r["reward"]) for r in recs],
        group_ids=[r["group_id"] for r in recs],
        base_hash=first["policy"].get("base"),
        adapter_hash=first["policy"].get("adapter"),
        step=int(first["step"]),
        noise=noise,
        bad_lines=tuple(report.bad_lines),
        cuts=cuts if any(c != (1.0, 0, 0.0) for c in cuts) else None,
        files_as_named=tuple(named),
        origins=tuple(report.origins),
        prompt_lengths=[p for p, _, _ in sizes.lengths],
        completion_lengths=[c for _, c, _ in sizes.lengths],
        id_ranges=[r for _, _, r in sizes.lengths],
        line_offsets=tuple(sizes.offsets),
        line_digests=tuple(sizes.digests),
        file_hashes=tuple(report.hashes),
    )


@dataclass
class _Sizes:
    """What the checks and the packing take from each record's token arrays: (prompt length, completion length,
    (lowest, highest) token id); and where its line starts in its file, and its crc32, when the arrays are read later."""

    lengths: list[tuple[int, int, tuple[int, int]]]
    offsets: list[int]
    digests: list[int] = field(default_factory=list)


def _read_whole(files: list[Path], skip_bad_lines: bool, report) -> tuple:
    """Every record of ``files`` with its token arrays: one process, or a rank whose shards are not the others'."""
    from qerl_cli.shards import iter_records

    recs, prompts, completions, sampling_lps, sizes = [], [], [], [], _Sizes([], [])
    for r in iter_records(files, skip_bad_lines=skip_bad_lines, report=report):
        # Streamed, each record's token arrays packed as it comes: the parsed JSON lists of a whole step were
        # the bulk of every rank's memory (~800 MiB for 512 x 16 completions of 1024 tokens; docs/train-step.md)
        p, c, lp = _compact(r)
        prompts.append(p)
        completions.append(c)
        sampling_lps.append(lp)
        sizes.lengths.append((len(p), len(c), _id_range(p, c)))
        recs.append(r)
    return recs, prompts, completions, sampling_lps, sizes


def _read_shared(files: list[Path], skip_bad_lines: bool, report, dist) -> tuple | None:
    """Under torchrun: the step's records, each rank having parsed about 1/N of the lines (a byte-balanced run of
    them) and the ranks exchanging what they found, bad lines included, so that every rank holds the same records,
    origins and errors as a whole read; the token arrays of its own run only (the others None). Parsing was the read's cost (~1 s of
    CPU per 25 MB of JSON lines), and every rank parsed every line (docs/benchmarks.md, "Reading a step under
    torchrun"). None when the ranks' files do not hold the same bytes (node-local copies that differ): each rank
    then reads its own whole, and the fingerprints tell them apart later, as before."""
    from qerl_cli.shards import one_schema

    index = [_index_file(f) for f in files]
    if len(set(map(json.dumps, dist.all_gather_object([h for h, _ in index])))) > 1:
        return None
    parts = _parts([(k, *line) for k, (_, ls) in enumerate(index) for line in ls], dist.world_size)
    mine, held = _parse_part(files, parts[dist.rank], skip_bad_lines)
    held = iter(held)
    report.files, report.hashes = list(files), [h for h, _ in index]
    recs, sizes, version, arrays = [], _Sizes([], []), None, []
    for r, (lines, parsed) in enumerate(zip(parts, dist.all_gather_object(mine))):
        for (k, i, off, _, _), (rec, msg, size, digest) in zip(lines, parsed):
            if size == _CHANGED:  # on every rank, skipped or not: the hash of the step is of the indexed bytes
                raise BadInputError(msg, hint="do not rewrite the shards while train-step runs")
            if msg is not None:
                if not skip_bad_lines:
                    from qerl_cli.shards import bad_line_error

                    raise bad_line_error(msg)
                report.bad_lines.append(msg)
                continue
            version = one_schema(rec, files[k], version)
            report.records += 1
            report.origins.append((files[k], i))
            recs.append(rec)
            sizes.lengths.append(size)
            sizes.offsets.append(off)
            sizes.digests.append(digest)
            arrays.append(next(held) if r == dist.rank else (None, None, None))
    prompts, completions, sampling_lps = (list(x) for x in zip(*arrays)) if arrays else ([], [], [])
    return recs, prompts, completions, sampling_lps, sizes


def _index_file(path: Path) -> tuple[str, list[tuple[int, int, int, int]]]:
    """A shard's sha256 and its non-blank lines: (line number, byte offset, size, crc32), as ``iter_records``
    numbers them. The sha256 is the fingerprint's; the crc32s make the lines parsed later these bytes."""
    from qerl_cli.shards import open_shard

    h, lines, off = hashlib.sha256(), [], 0
    with open_shard(path) as f:
        for i, raw in enumerate(f, start=1):
            h.update(raw)
            if raw.strip():
                lines.append((i, off, len(raw), zlib.crc32(raw)))
            off += len(raw)
    return h.hexdigest(), lines


def _parts(lines: list, world: int) -> list[list]:
    """``lines`` in ``world`` runs, one a rank: each line goes to the rank whose 1/``world`` of the bytes it starts in."""
    total = sum(line[3] for line in lines)  # (file index, line number, offset, size, crc32)
    parts, at = [[] for _ in range(world)], 0
    for line in lines:
        parts[at * world // total].append(line)
        at += line[3]
    return parts


_CHANGED = "changed"  # ``_parse_part``'s sizes of a line that is no longer the bytes indexed (and hashed)


def _parse_part(files: list[Path], part: list, skip_bad_lines: bool) -> tuple[list[tuple], list[tuple]]:
    """(record without its arrays, None, sizes, crc32 of the line) or (None, "file:line: why", None, None) for each
    line of ``part``, up to its first bad one unless ``skip_bad_lines``, or its first changed one ((None, "file:line:
    why", ``_CHANGED``, None)): what the other ranks need of them; and the token arrays of its records, held until the
    micro-batches are split (those this rank owns need no second parse)."""
    from qerl_cli.shards import parse_line

    out, held = [], []
    for (k, i, _, _, crc), raw in zip(part, _lines_at(files, [(k, off) for k, _, off, *_ in part])):
        if zlib.crc32(raw) != crc:  # rewritten since ``_index_file`` hashed it: the fingerprint would not be of it
            out.append((None, f"{files[k]}:{i}: the line changed while the step was read (other bytes)", _CHANGED, None))
            break
        rec, msg = parse_line(files[k], i, raw)
        if msg is not None:
            out.append((None, msg, None, None))
            if not skip_bad_lines:
                break
            continue
        p, c, lp = _compact(rec)
        out.append((rec, None, (len(p), len(c), _id_range(p, c)), zlib.crc32(raw)))
        held.append((p, c, lp))
    return out, held


def _lines_at(files: list[Path], where: list[tuple[int, int]]):
    """The lines that start at (file index, byte offset) ``where``, each file opened once for a run of its lines."""
    from qerl_cli.shards import open_shard

    f, k_open = None, None
    try:
        for k, off in where:
            if k != k_open:
                if f is not None:
                    f.close()
                # gone since it was indexed (a rollout --force redo swapped its directory)
                f, k_open = open_shard(files[k], hint="do not move or rewrite the shards while train-step runs"), k
            f.seek(off)
            yield f.readline()
    finally:
        if f is not None:
            f.close()


def _id_range(p, c) -> tuple[int, int]:
    """The lowest and highest token id of a record: ``_check_fits_model`` looks at the ids themselves only when
    these fall outside the vocabulary (its loop over every id took ~0.5 s of CPU per 8M tokens; numpy's, ~0.03)."""
    import numpy as np

    both = [x for x in (p, c) if len(x)]
    if not both:
        return 0, 0
    if all(isinstance(x, array.array) for x in both):  # ids past int64 stay lists (``_compact``)
        both = [np.frombuffer(x, dtype=x.typecode) for x in both]
        return int(min(x.min() for x in both)), int(max(x.max() for x in both))
    return min(min(x) for x in both), max(max(x) for x in both)


def _compact(rec: dict) -> tuple:
    """Take ``rec``'s prompt and completion token ids and sampling log-probs out of it as compact arrays (4 or 8
    bytes an entry instead of a Python object each): the same values, so the step computes the same bits. The
    texts go too (the step never reads them). Ids past int64 stay lists, for ``_check_fits_model`` to name."""
    ids = rec.pop("prompt_token_ids"), rec.pop("completion_token_ids")
    rec.pop("prompt", None), rec.pop("completion", None)
    for code in ("i", "q"):  # one type for both, so that prompt + completion concatenates
        try:
            ids = tuple(array.array(code, x) for x in ids)
            break
        except OverflowError:
            continue
    return (*ids, array.array("d", rec.pop("logprobs")))


def _keep_owned(data: StepData, groups: list[list[int]], dist) -> None:
    """Under torchrun, the token arrays of the sequences in this rank's micro-batches only: those of other ranks'
    dropped (None) and, when the ranks read the step in parts (``_read_shared``), those of its own that another
    rank parsed read from their lines. The lengths, advantages and metrics of every record were computed before."""
    if not dist.enabled:
        return
    owned = [s for j, g in enumerate(groups) if dist.owns(j) for s in g]
    mine = set(owned)
    for s in range(len(data.records)):
        if s not in mine:
            data.prompts[s] = data.completions[s] = data.sampling_logprobs[s] = None
    if data.line_offsets:  # read in parts: the records of its own that other ranks parsed
        for s, arrays in _reread(data, [s for s in owned if data.prompts[s] is None]):
            data.prompts[s], data.completions[s], data.sampling_logprobs[s] = arrays


def _reread(data: StepData, seqs: list[int]):
    """(s, token arrays) of records ``seqs``, parsed again from their lines (another rank may have checked them)."""
    from qerl_cli.shards import parse_line

    files = list(dict.fromkeys(f for f, _ in data.origins))
    k_of = {f: k for k, f in enumerate(files)}
    seqs = sorted(seqs, key=lambda s: (k_of[data.origins[s][0]], data.line_offsets[s]))  # file by file, in order
    where = [(k_of[data.origins[s][0]], data.line_offsets[s]) for s in seqs]
    for s, raw in zip(seqs, _lines_at(files, where)):
        f, line = data.origins[s]
        rec, msg = parse_line(f, line, raw)
        # its bytes, not only its token counts: a line rewritten to other ids of the same counts (or another reward)
        # passed, and the rank trained on ids the vocabulary check never saw beside the records' advantages
        if msg is not None or zlib.crc32(raw) != data.line_digests[s]:
            raise BadInputError(f"{f}:{line}: the line changed while the step was read ({msg or 'other bytes'})",
                                hint="do not rewrite the shards while train-step runs")
        yield s, _compact(rec)


def _policy_name(policy: dict) -> str:
    a = policy.get("adapter")
    name = "no adapter" if a is None else f"adapter {a!s:.12}"
    return name + (f" + norms {policy['norms']!s:.12}" if policy.get("norms") else "")


def _sampling_cut(sampling: dict) -> tuple[float, int, float]:
    """(top_p, top_k, min_p) a record was sampled with: its log-probs are over what that cut kept.
    A top_k <= 0 is no cut (qerl writes 0; vLLM before 0.10 and other tools wrote -1 for "off"): a
    negative one reached ``torch.topk`` and ended the step in a traceback."""
    from qerl_cli.shards import _number  # an int past float's range is none (math.isfinite raised on it)

    top_p, top_k, min_p = sampling.get("top_p"), sampling.get("top_k"), sampling.get("min_p")
    for key, v in (("top_p", top_p), ("top_k", top_k), ("min_p", min_p)):
        if v is not None and not _number(v):
            raise BadInputError(f"sampling.{key} should be a number or null, got {v!r}")
    return (1.0 if top_p is None else float(top_p), 0 if top_k is None else max(int(top_k), 0),
            0.0 if min_p is None else float(min_p))


def dr_grpo_length(cfg: TrainStepConfig, data: StepData) -> int | None:
    """Dr. GRPO's constant L_max: --max-completion-length, else the generation budget the rollout
    recorded (``sampling.max_new_tokens``, as TRL divides by its max_completion_length), else the
    longest completion in the step. Never the longest *trained* completion: --mask-truncated drops
    exactly the longest ones, and the divisor would shrink with them."""
    if cfg.loss != "dr_grpo" or cfg.max_completion_length:
        return cfg.max_completion_length
    longest = max(data.completion_lengths, default=0)
    budgets = [r["sampling"].get("max_new_tokens") for r in data.records]
    if budgets and all(isinstance(b, int) and b > 0 for b in budgets):
        return max(max(budgets), longest)
    return max(longest, 1)


def _noise_key(noise: dict | None, step: int):
    """What decides a record's noise vectors. Without ``step`` (the contract's ``{sigma, seed}``) they are
    drawn for the record's own step, as ``read_step`` applies them: the same noise as qerl's form names."""
    if not noise or not float(noise.get("sigma", 0.0) or 0.0):
        return None
    return (float(noise["sigma"]), int(noise.get("seed", 0)), int(noise.get("step", step)), noise.get("rounded_to"))


def _in_path_order(files: list[Path]) -> list[Path]:
    return sorted(files, key=lambda f: str(f.resolve()))


def _shards_hash(file_hashes: list[str]) -> str:
    """The fingerprint's hash of a step's shards, from each file's sha256 as read (``StepData.file_hashes``): the value
    that hashing the files again gave (``sha256_file`` of each, in order), without reading them twice."""
    h = hashlib.sha256()
    for digest in file_hashes:
        h.update(digest.encode())
    return h.hexdigest()


def _adapter_inputs_hash(adapter: Path) -> str:
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors", OPTIMIZER_FILE, STATE_FILE, NORMS):
        p = Path(adapter) / name
        if p.exists():
            h.update(name.encode())
            h.update(sha256_file(p).encode())
    return h.hexdigest()
