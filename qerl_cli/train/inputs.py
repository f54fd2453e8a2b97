"""The ``train-step`` stage's inputs: the rollout shards read into one step (``read_step`` -> ``StepData``), and
what the stage takes from them and from the input adapter before anything is loaded.

``read_step`` streams the shards in path order (``_in_path_order``: the order changes float sums, not the step),
packs each record's token ids and sampling log-probs as it comes (``_compact``), and refuses shards that are not one
step: mixed base models, policies (``_policy_name``), rollout steps or AQN noise records (``_noise_key``), or a
sampling cut it cannot read (``_sampling_cut``). From what it read: Dr. GRPO's divisor (``dr_grpo_length``) and the
input hashes of the step's fingerprint (``_shards_hash``; the input adapter's files, ``_adapter_inputs_hash``).
Under torchrun, once the micro-batches are split, ``_keep_owned`` drops the token arrays of those other ranks own.
The checks of the step against the flags, the model and the lineage are ``train.checks``'s.
"""

from __future__ import annotations

import array
import hashlib
import math
from dataclasses import dataclass
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

    def __post_init__(self):  # kept when ``_keep_owned`` drops the token arrays of other ranks' micro-batches
        self.prompt_lengths = [len(p) for p in self.prompts]
        self.completion_lengths = [len(c) for c in self.completions]


def read_step(cfg: TrainStepConfig) -> StepData:
    """Read the shards and check that they form one consistent step."""
    from qerl_cli.shards import ReadReport, check_groups_whole, iter_records, resolve_shard_files

    report = ReadReport()
    named = resolve_shard_files(cfg.shards)
    # In path order, whatever order --shards named them in: the order changes float sums, so `--shards b a`
    # was another step than `--shards a b` (exit 4 over the finished one)
    recs, prompts, completions, sampling_lps = [], [], [], []
    for r in iter_records(_in_path_order(named), skip_bad_lines=cfg.skip_bad_lines, report=report):
        # Streamed, each record's token arrays packed as it comes: the parsed JSON lists of a whole step were
        # the bulk of every rank's memory (~800 MiB for 512 x 16 completions of 1024 tokens; docs/train-step.md)
        p, c, lp = _compact(r)
        prompts.append(p)
        completions.append(c)
        sampling_lps.append(lp)
        recs.append(r)
    where = ", ".join(str(f) for f in report.files[:3]) + (" ..." if len(report.files) > 3 else "")
    if not recs:
        skipped = (f" (--skip-bad-lines skipped all {len(report.bad_lines)} lines; first: {report.bad_lines[0]})"
                   if report.bad_lines else "")
        raise BadInputError(f"{where}: no rollout records to train on{skipped}")
    check_groups_whole(recs, report.origins)
    for r, p, (f, line) in zip(recs, prompts, report.origins):
        # Caught here, before a process group starts: found later by the one rank that collates it, the
        # other ranks died in gloo (or would wait in NCCL) and torchrun could blame them.
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
    )


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
    """Under torchrun, drop the token arrays of the sequences in micro-batches other ranks own (None): every
    rank reads and checks the whole step, and the lengths, advantages and metrics are computed beforehand."""
    if not dist.enabled:
        return
    for j, g in enumerate(groups):
        if not dist.owns(j):
            for s in g:
                data.prompts[s] = data.completions[s] = data.sampling_logprobs[s] = None


def _policy_name(policy: dict) -> str:
    a = policy.get("adapter")
    name = "no adapter" if a is None else f"adapter {a!s:.12}"
    return name + (f" + norms {policy['norms']!s:.12}" if policy.get("norms") else "")


def _sampling_cut(sampling: dict) -> tuple[float, int, float]:
    """(top_p, top_k, min_p) a record was sampled with: its log-probs are over what that cut kept.
    A top_k <= 0 is no cut (qerl writes 0; vLLM before 0.10 and other tools wrote -1 for "off"): a
    negative one reached ``torch.topk`` and ended the step in a traceback."""
    top_p, top_k, min_p = sampling.get("top_p"), sampling.get("top_k"), sampling.get("min_p")
    for key, v in (("top_p", top_p), ("top_k", top_k), ("min_p", min_p)):
        if v is not None and (type(v) not in (int, float) or not math.isfinite(v)):
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
    longest = max((len(c) for c in data.completions), default=0)
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


def _shards_hash(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def _adapter_inputs_hash(adapter: Path) -> str:
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors", OPTIMIZER_FILE, STATE_FILE, NORMS):
        p = Path(adapter) / name
        if p.exists():
            h.update(name.encode())
            h.update(sha256_file(p).encode())
    return h.hexdigest()
