"""The ``qerl rollout`` stage: prompts -> G scored completions each -> JSONL rollout shards.

How it works
------------
1. Everything that can be wrong with the inputs is checked before any model is loaded: flags,
   reward names (user ``module:function`` rewards are imported here), the prompt file (file:line
   errors), whether rewards that need a reference have one (in every row the run takes, not only this
   step's), and adapter lineage (an adapter whose
   ``trainer_state.json`` names another base hash is refused, naming both).
2. Prompt selection is a pure function of the flags, so every shard of a Slurm array and every
   step of an RL loop agree on it without talking to each other: ``--max-prompts`` caps the
   dataset, ``--prompts-per-step P`` makes step k use rows ``[k*P, (k+1)*P)`` (wrapping around,
   optionally reshuffled every epoch), and ``--shard-index i --num-shards n`` keeps every n-th of
   those (round robin, so shards are balanced, disjoint, and cover the step).
3. The output is a resumable ``StageOutput``: records go to ``shard-I-of-N.jsonl`` in a partial
   directory named by the run's fingerprint. Prompts are generated in fixed *batches* (cut from
   the shard's prompt list, so a rerun cuts the same ones); each prompt's completions are sampled
   with a seed of its own derived from (``--seed``, step, prompt id), so they reproduce exactly and
   do not depend on the batch they came in (``--batch-prompts``, ``--max-num-seqs``, sharding)
   beyond the batched matmuls' rounding. Every group is
   appended and flushed as soon as its batch is done (fsynced at most once a second). A rerun after a crash keeps the complete
   groups, regenerates only batches with missing groups and appends only the missing ones,
   which yields the records of an uninterrupted run. The trade-off: a crash costs up to one
   batch of generation (``--batch-prompts``), not one group.
4. Noise: for ``--aqn-sigma-start > 0``, sigma(step) follows the AQN schedule and the seeded
   vectors (``qerl_cli.aqn``) are set on the model's RMSNorms before generation; every record
   carries ``noise {sigma, seed, step, norms}`` so ``train-step`` rebuilds the same vectors.
5. Rich progress (prompts, tokens/s, mean reward so far); the manifest's ``summary`` holds reward
   mean/std per function, completion lengths, the fraction of zero-variance groups (which carry
   no GRPO signal) and throughput.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qerl_cli.data import (
    LONG_PROMPT_POLICIES,
    EncodedPrompt,
    EncodeReport,
    PromptRow,
    column_names,
    encode_prompts,
    load_prompts,
    load_template,
    parse_chat_template_kwargs,
    read_chat_template,
    set_chat_template,
    template_file,
)
from qerl_cli.engine.sampling_params import MIN_TEMPERATURE
from qerl_cli.errors import (
    NONFINITE_LOGITS_HINT,
    BadInputError,
    NumericalError,
    OutputExistsError,
    QerlWarning,
)
from qerl_cli.hashing import dir_hash, model_hash, sha256_file, text_files_hash
from qerl_cli.lineage import check_lineage
from qerl_cli.math_rule import long_math_reference
from qerl_cli.outputs import StageOutput, WriterLock, check_out_apart, sweep_leftover_partial
from qerl_cli.rewards import RewardSet
from qerl_cli.runtime import (
    as_many,
    check_field_types,
    context_limit,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    split_stops,
)
from qerl_cli.shards import ShardWriter, load_complete_groups, make_record, shard_name
from qerl_cli.stops import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    blank_stop,
    every_stopped,
    judged_completion,
    stop_takes_tag,
    stop_taking,
    think_stop,
)

STAGE = "rollout"
ENGINES = ("native", "vllm")
DTYPES = ("auto", "bf16", "fp16", "fp32")
DEVICES = ("auto", "cpu", "cuda")
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]  # hashed as qerl_cli.adapters.adapter_hash does


@dataclass
class RolloutConfig:
    """Everything ``qerl rollout`` takes; field names follow the flags (``--num-generations`` ...)."""

    model: Path
    prompts: Path
    out: Path
    adapter: Path | None = None
    num_generations: int = 8
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    rewards: tuple[str, ...] = ("gsm8k",)
    step: int = 0
    aqn_sigma_start: float = 0.0
    aqn_sigma_end: float = 0.0
    aqn_stages: int = 10
    total_steps: int | None = None
    run_seed: int = 0
    shard_index: int = 0
    num_shards: int = 1
    engine: str = "native"
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    max_prompts: int | None = None
    prompts_per_step: int | None = None
    shuffle: bool = False
    skip_bad_lines: bool = False
    prompt_key: str | None = None
    answer_key: str | None = None
    prompt_template: str | None = None
    system_prompt: str | None = None
    chat_template: bool | None = None
    chat_template_file: Path | None = None  # a Jinja chat template replacing the tokenizer's (or giving it one)
    chat_template_kwargs: dict | str | None = None  # extra chat template variables: a dict, or its JSON text
    max_model_len: int | None = None
    long_prompts: str = "skip"
    max_num_seqs: int = 256
    batch_prompts: int | None = None
    force: bool = False
    progress: bool = True

    def __post_init__(self):
        check_field_types(self)
        if isinstance(self.rewards, dict):  # {"gsm8k": 1.0, "format": 0.1}: its weights were dropped
            self.rewards = tuple(f"{name}={weight}" for name, weight in self.rewards.items())
        self.stop, self.rewards = as_many(self.stop), as_many(self.rewards)
        if isinstance(self.prompt_template, os.PathLike):  # "a string or a file": a Path names the file
            self.prompt_template = str(self.prompt_template)
        self.chat_template_kwargs = parse_chat_template_kwargs(self.chat_template_kwargs)


# ---- validation ------------------------------------------------------------------------------
def _check_flags(cfg: RolloutConfig) -> None:
    def bad(msg: str, hint: str | None = None):
        raise BadInputError(msg, hint=hint)

    if cfg.num_generations < 1:
        bad(f"--num-generations must be >= 1, got {cfg.num_generations}")
    if cfg.num_generations == 1:  # train-step would refuse every group of its shard, after the whole rollout ran
        bad("--num-generations 1: a GRPO group needs >= 2 completions per prompt (one has no baseline to compare "
            "with, so train-step refuses the shard)", hint="pass -G 2 or more; to sample once per prompt, use qerl eval")
    if cfg.chat_template_file is not None and cfg.chat_template is False:
        bad("--chat-template-file with --no-chat-template: the file would not be used")
    if cfg.chat_template_kwargs and cfg.chat_template is False:
        bad("--chat-template-kwargs with --no-chat-template: no template would read them")
    if cfg.long_prompts not in LONG_PROMPT_POLICIES:  # here, not at encoding: before an existing --out answers exit 4
        bad(f"--long-prompts must be one of {', '.join(LONG_PROMPT_POLICIES)}, got {cfg.long_prompts!r}")
    if cfg.max_new_tokens < 1:
        bad(f"--max-new-tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.temperature < 0 or not math.isfinite(cfg.temperature):
        bad(f"--temperature must be >= 0 (0 = greedy), got {cfg.temperature}")
    if 0 < cfg.temperature < MIN_TEMPERATURE:
        bad(f"--temperature {cfg.temperature:g} is below {MIN_TEMPERATURE:g}, which vLLM treats as greedy",
            hint="pass --temperature 0 for greedy decoding")
    if cfg.engine == "vllm":
        from qerl_cli.engine_vllm import check_vllm_device, check_vllm_temperature

        check_vllm_temperature(cfg.temperature, cfg.num_generations)
        check_vllm_device(cfg.device)
    if cfg.engine == "native" and cfg.num_generations > cfg.max_num_seqs:
        bad(f"--num-generations {cfg.num_generations} exceeds --max-num-seqs {cfg.max_num_seqs}: a prompt's "
            "completions decode together", hint=f"pass --max-num-seqs {cfg.num_generations} or more")
    if not (0 < cfg.top_p <= 1):
        bad(f"--top-p must be in (0, 1], got {cfg.top_p}")
    if cfg.top_k < 0:
        bad(f"--top-k must be >= 0 (0 = off), got {cfg.top_k}")
    if not (0 <= cfg.min_p < 1):
        bad(f"--min-p must be in [0, 1), got {cfg.min_p}")
    if cfg.step < 0:
        bad(f"--step must be >= 0, got {cfg.step}")
    if cfg.num_shards < 1 or not (0 <= cfg.shard_index < cfg.num_shards):
        bad(f"--num-shards must be >= 1, got {cfg.num_shards}" if cfg.num_shards < 1 else
            f"--shard-index {cfg.shard_index} is outside 0..{cfg.num_shards - 1} (--num-shards {cfg.num_shards})")
    if cfg.engine not in ENGINES:
        bad(f"--engine must be one of {', '.join(ENGINES)}, got {cfg.engine!r}")
    if cfg.device not in DEVICES and not re.fullmatch(r"cuda:\d+", cfg.device):
        bad(f"--device must be auto, cpu, cuda or cuda:N, got {cfg.device!r}")
    if any(not s for s in cfg.stop):
        bad("--stop strings must be non-empty")
    if cfg.dtype not in DTYPES:
        bad(f"--dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    for flag, v in (("--max-prompts", cfg.max_prompts), ("--prompts-per-step", cfg.prompts_per_step),
                    ("--max-model-len", cfg.max_model_len), ("--batch-prompts", cfg.batch_prompts)):
        if v is not None and v < 1:
            bad(f"{flag} must be >= 1, got {v}")
    if cfg.shuffle and cfg.prompts_per_step is None:  # it changed nothing but the fingerprint
        bad("--shuffle reorders the epochs of --prompts-per-step; without it the rows are read in order",
            hint="pass --prompts-per-step P, or drop --shuffle")
    if cfg.max_num_seqs < 1:
        bad(f"--max-num-seqs must be >= 1, got {cfg.max_num_seqs}")
    if not all(math.isfinite(x) and x >= 0 for x in (cfg.aqn_sigma_start, cfg.aqn_sigma_end)):
        bad(f"--aqn-sigma-start/--aqn-sigma-end must be finite numbers >= 0, got {cfg.aqn_sigma_start} and "
            f"{cfg.aqn_sigma_end}")
    if cfg.aqn_sigma_start > 0:
        if cfg.total_steps is None:
            bad("--aqn-sigma-start needs --total-steps (the schedule spreads its stages over the run)")
        if cfg.total_steps < 1 or cfg.aqn_stages < 1:
            bad("--total-steps and --aqn-stages must be >= 1")
        if cfg.aqn_stages > 1 and cfg.aqn_sigma_end <= 0:
            bad("--aqn-sigma-end must be > 0 when --aqn-sigma-start > 0 (the schedule is geometric)",
                hint="e.g. --aqn-sigma-start 1e-2 --aqn-sigma-end 1e-4")
    if not Path(cfg.model).is_dir():
        bad(f"--model {cfg.model} is not a directory")
    if not (Path(cfg.model) / "config.json").is_file():
        from qerl_cli.models.config import adapter_as_model_hint

        bad(f"--model {cfg.model} has no config.json (not a Hugging Face model directory)",
            hint=adapter_as_model_hint(cfg.model))
    if cfg.adapter is not None and not (Path(cfg.adapter) / "adapter_config.json").is_file():
        from qerl_cli.adapters import model_not_adapter_hint

        bad(f"--adapter {cfg.adapter} has no adapter_config.json (not a PEFT adapter directory)",
            hint=model_not_adapter_hint(cfg.adapter))
    # --force replaces --out: never let that be the model, the adapter or the prompt file's directory, nor hold a
    # template this run reads (deleted with the old output, after the run read it: the rerun could not be made).
    check_out_apart(cfg.out, model=cfg.model, adapter=cfg.adapter, prompts=cfg.prompts,
                    chat_template_file=cfg.chat_template_file, prompt_template=template_file(cfg.prompt_template))


def _warn_of_skipped_aqn_stages(cfg: RolloutConfig) -> None:
    # The schedule splits the run into K + 1 intervals; fewer steps than that skip some of them.
    if cfg.aqn_sigma_start > 0 and cfg.total_steps < cfg.aqn_stages + 1:
        warnings.warn(QerlWarning(
            f"--total-steps {cfg.total_steps} < --aqn-stages {cfg.aqn_stages} + 1: the AQN schedule skips stages "
            "(the noise may never reach --aqn-sigma-start or end at --aqn-sigma-end)"), stacklevel=3)


# The tags a completion passing the `format` reward holds (an opening <think> aside: the prompt may open it, so
# `_check_stops_leave_the_format_its_think` judges a stop that takes it once the prompts are rendered).
FORMAT_CLOSED_TAGS = ("</think>", "<answer>", "</answer>")


def _check_stops_leave_the_rewards_their_tags(cfg: RolloutConfig, reward_set: RewardSet) -> None:
    """A stop string is cut from the text the rewards judge (as vLLM cuts it). One that takes a tag the `format`
    reward needs out of that text (`--stop '</answer>'`, how R1-style recipes end a completion at its answer,
    `'</answer>\\n'`, which holds it, or `'\\n<answer'`, which fires at it: `stop_takes_tag`) scored every completion
    it stops 0 there, silently: refused. One that takes the opening `<answer>` (`'<answer>'`, `'\\n<answer'`) cuts a
    completion that answers inside the tag before its answer, its `####` line or box too: gsm8k and math score it 0,
    warned of (math was told nothing, and gsm8k that its `####` lines and boxes still count, until a review). One that
    takes only `</answer>` leaves gsm8k and math no closed tag to read (boxes, and gsm8k's `####` lines, still count):
    warned of (for math since math 2, which reads the tag where no box answers)."""
    names = {s.name for s in reward_set.specs}
    kinds = sorted(names & {"gsm8k", "math"})
    for x in cfg.stop:
        cut = stop_taking((x,), FORMAT_CLOSED_TAGS)
        if "format" in names and cut:
            raise BadInputError(f"--stop {x!r} is cut from the completion text the rewards judge, so that text never "
                                f"holds {cut[1]} and the format reward scores {every_stopped(*cut)} 0",
                                hint="drop that --stop (EOS and --max-new-tokens still end completions), or score "
                                     "the format with your own reward")
        if kinds and stop_takes_tag(x, ANSWER_OPEN):
            warnings.warn(QerlWarning(
                f"--stop {x!r} is cut from the completion text the rewards judge, so a completion that answers inside "
                f"an <answer> tag is cut before its answer: {' and '.join(kinds)} "
                f"{'score' if len(kinds) > 1 else 'scores'} it 0 (an answer outside the tag still scores)"), stacklevel=3)
        elif kinds and stop_takes_tag(x, ANSWER_CLOSE):
            warnings.warn(QerlWarning(
                f"--stop {x!r} is cut from the completion text the rewards judge: {' and '.join(kinds)} "
                f"{'read' if len(kinds) > 1 else 'reads'} no <answer> tag's answer from a completion it stops "
                f"({'#### lines and ' if 'gsm8k' in kinds else ''}\\boxed{{}} still score)"), stacklevel=3)


def _check_stops_leave_the_think_closed(cfg: RolloutConfig, reward_set: RewardSet, prompts) -> None:
    """gsm8k and math read nothing after a `<think>` left open (a completion cut short mid-thought). A stop that
    takes `</think>` out of the judged text (`--stop '</think>'`) leaves it open in each completion it stops, one
    inside a `<think>` its prompt opened (R1's and QwQ's chat templates) or its own: that completion scores 0. Where
    a prompt opens one, every completion of it did (silently, until a review): refused; else warned of. One that
    takes the opening `<think>` (`--stop '<think>'`) cuts a completion that opens its own to the text before it, its
    answer gone: warned of where a prompt opens none (missed until 2026-11-28). `think_stop` judges, as in eval."""
    kinds = sorted({s.name for s in reward_set.specs} & {"gsm8k", "math"})
    found = think_stop(cfg.stop, prompts) if kinds else None
    if found is None:
        return
    x, tag, prompt = found
    score = f"{' and '.join(kinds)} {'score' if len(kinds) > 1 else 'scores'}"
    if tag == THINK_OPEN:
        warnings.warn(QerlWarning(
            f"--stop {x!r} is cut from the completion text the rewards judge, so a completion that opens its own "
            f"{THINK_OPEN} (its prompt opens none: {prompt.row.where}) is cut there, before its answer: {score} it 0"),
            stacklevel=3)
        return
    what = (f"--stop {x!r} is cut from the completion text the rewards judge, so that text never holds {THINK_CLOSE}, "
            f"and {' and '.join(kinds)} {'read' if len(kinds) > 1 else 'reads'} nothing after a <think> left open")
    if prompt is not None:
        raise BadInputError(f"{what}: the prompt opens one ({prompt.row.where}), so {every_stopped(x, tag)} scores 0",
                            hint="drop that --stop (EOS and --max-new-tokens still end completions)")
    warnings.warn(QerlWarning(f"{what}: a completion it stops that opened its own <think> scores 0"), stacklevel=3)


def _check_stops_leave_the_format_its_think(cfg: RolloutConfig, reward_set: RewardSet, prompts) -> None:
    """The `format` reward needs the judged text to open with `<think>`: a completion opens it where its prompt does
    not (a prompt that does, R1's and QwQ's templates, has it put back: `judged_completion`). A stop that takes
    `<think>` out of that text (`--stop '<think>'`, `'<think'`) cuts such a completion at its first tag, so format
    scored every completion of a prompt that opens no `<think>` 0, silently (a review): refused. Where every prompt
    opens one, the completions hold no opening tag of their own to cut: harmless."""
    if "format" not in {s.name for s in reward_set.specs}:
        return
    cut = stop_taking(cfg.stop, (THINK_OPEN,))
    unopened = next((p for p in prompts if not p.opens_think), None)
    if cut is None or unopened is None:
        return
    raise BadInputError(f"--stop {cut[0]!r} is cut from the completion text the rewards judge, so that text never "
                        f"holds {THINK_OPEN}, which a completion opens where its prompt does not ({unopened.row.where}): "
                        f"the format reward scores {every_stopped(*cut)} of such a prompt 0",
                        hint="drop that --stop (EOS and --max-new-tokens still end completions), or score the format "
                             "with your own reward")


def _check_stops_leave_the_thought_whole(cfg: RolloutConfig, reward_set: RewardSet, prompts) -> None:
    """A stop made only of whitespace (`--stop $'\\n\\n'`, a base model's few-shot stop) cuts a completion of a
    prompt that opens `<think>` at its thought's first line break or blank line, the `<think>` left open: gsm8k, math
    and format score it 0 (nearly every completion, unsaid until 2026-11-28). Warned of, not refused: a thought
    without such a break escapes it (`blank_stop`, as in eval)."""
    kinds = sorted({s.name for s in reward_set.specs} & {"gsm8k", "math", "format"})
    found = blank_stop(cfg.stop, prompts) if kinds else None
    if found is not None:
        warnings.warn(QerlWarning(
            f"--stop {found[0]!r} is only whitespace and the prompt opens a <think> ({found[1].row.where}): a "
            f"completion is cut at the first {found[0]!r} of its thought, the <think> left open, where "
            f"{' and '.join(kinds)} {'score' if len(kinds) > 1 else 'scores'} it 0"), stacklevel=3)


def aqn_sigma(cfg: RolloutConfig) -> float:
    """sigma for ``cfg.step`` under the AQN schedule (0 when AQN is off)."""
    if cfg.aqn_sigma_start <= 0:
        return 0.0
    from qerl_cli.aqn import sigma_at

    try:
        return sigma_at(cfg.step, cfg.total_steps, cfg.aqn_sigma_start, cfg.aqn_sigma_end, cfg.aqn_stages)
    except ValueError as e:
        raise BadInputError(f"AQN schedule: {e}") from None


# ---- prompt selection -------------------------------------------------------------------------
def run_rows(rows: Sequence[PromptRow], cfg: RolloutConfig) -> list[PromptRow]:
    """The rows the run's steps take theirs from: the file's, capped by --max-prompts."""
    return list(rows[: cfg.max_prompts] if cfg.max_prompts else rows)


def select_prompts(rows: Sequence[PromptRow], cfg: RolloutConfig) -> list[PromptRow]:
    """The rows this step and shard use (see the module docstring); deterministic in the flags."""
    capped = bool(cfg.max_prompts) and cfg.max_prompts < len(rows)
    rows = run_rows(rows, cfg)
    n = len(rows)
    if cfg.prompts_per_step:
        p = cfg.prompts_per_step
        if p > n:
            raise BadInputError(f"--prompts-per-step {p} is more than the {n} prompts "
                                + (f"--max-prompts {cfg.max_prompts} keeps of" if capped else "in") + f" {cfg.prompts}")
        start = cfg.step * p
        shuffled: dict[int, list[int]] = {}
        ordered: dict[int, list[int]] = {}  # order(epoch) once per epoch: per row it cost O(n), O(P * n) a step

        def raw(epoch: int) -> list[int]:
            if epoch not in shuffled:
                idx = list(range(n))
                if cfg.shuffle:
                    random.Random(f"qerl-rollout-shuffle:{cfg.run_seed}:{epoch}").shuffle(idx)
                shuffled[epoch] = idx
            return shuffled[epoch]

        def order(epoch: int) -> list[int]:
            """Epoch ``epoch``'s permutation. With --shuffle, the step that crosses into it takes its
            first rows from the end of the last epoch: those rows are moved out of this epoch's head
            (the first non-repeating rows go first), so the step holds P distinct rows and the epoch
            still uses every row once. The head takes rows from the first P positions only, so the
            last epoch's tail is its raw shuffle's wherever the dataset holds 2P rows or more; below
            that the tail may reach the last epoch's moved head, so that epoch is built first (back to
            one whose tail is untouched: at most P / gcd(N, P) epochs)."""
            if epoch in ordered:
                return ordered[epoch]
            first = epoch
            while cfg.shuffle and first > 0 and 0 < (first * n) % p and n - (first * n) % p < p:
                first -= 1  # order(first)'s head depends on the moved head of order(first - 1)
            for e in range(first, epoch + 1):
                if e in ordered:
                    continue
                idx = raw(e)
                a = (e * n) % p  # rows of the crossing step that come from the last epoch
                if cfg.shuffle and e > 0 and a > 0:
                    tail = set((ordered.get(e - 1) or raw(e - 1))[n - a:])
                    head = [i for i in idx if i not in tail][: p - a]
                    taken = set(head)
                    idx = head + [i for i in idx if i not in taken]
                ordered[e] = idx
            return ordered[epoch]

        picked, seen = [], set()
        for j in range(start, start + p):
            i = order(j // n)[j % n]
            if i in seen:  # cannot happen: the crossing step's head skips the rows of the last epoch's tail
                raise AssertionError(f"select_prompts: row {i} twice in step {cfg.step}")
            seen.add(i)
            picked.append(rows[i])
        rows = picked
    return rows[cfg.shard_index :: cfg.num_shards]


def group_id(step: int, prompt_id: str) -> str:
    return f"s{step}:{prompt_id}"


def derive_seed(*parts) -> int:
    """A 63-bit seed from any parts; stable across processes (unlike ``hash()``)."""
    key = ":".join(str(p) for p in ("qerl-rollout", *parts)).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


# ---- summary -----------------------------------------------------------------------------------
def _stats(xs: Sequence[float]) -> dict:
    if not xs:
        return {"mean": None, "std": None, "min": None, "max": None}
    return {
        "mean": statistics.fmean(xs),
        "std": statistics.pstdev(xs) if len(xs) > 1 else 0.0,
        "min": min(xs),
        "max": max(xs),
    }


def summarize(groups: Sequence[Sequence[dict]], reward_names: Sequence[str]) -> dict:
    """Reward mean/std per function, completion length stats, zero-variance groups."""
    recs = [r for g in groups for r in g]
    lengths = [len(r["completion_token_ids"]) for r in recs]
    totals = [r["reward"] for r in recs]
    per_fn = {name: _stats([r["rewards"][name] for r in recs if name in r["rewards"]]) for name in reward_names}
    zero_var = sum(1 for g in groups if len({r["reward"] for r in g}) <= 1)
    length_stats = _stats(lengths)
    if lengths:
        length_stats["p50"] = statistics.median(lengths)
    return {
        "groups": len(groups),
        "completions": len(recs),
        "reward": _stats(totals),
        "rewards": per_fn,
        "completion_tokens": length_stats,
        "truncated_fraction": (sum(r["finish_reason"] == "length" for r in recs) / len(recs)) if recs else None,
        "zero_variance_group_fraction": (zero_var / len(groups)) if groups else None,
    }


def summary_table(summary: dict):
    """A rich Table of a rollout summary (for the command's end-of-run print)."""
    from rich.table import Table

    def f(x, digits=3):
        return "-" if x is None else (f"{x:.{digits}f}" if isinstance(x, float) else str(x))

    t = Table(title=f"rollout {summary.get('shard', '')}".strip(), show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("prompts (groups)", f"{summary['groups']} ({summary.get('resumed_groups', 0)} resumed)")
    t.add_row("completions", str(summary["completions"]))
    if summary.get("skipped_long_prompts"):
        t.add_row("skipped: prompt too long", str(summary["skipped_long_prompts"]))
    if summary.get("skipped_bad_rows"):
        t.add_row("skipped: bad prompt rows", str(summary["skipped_bad_rows"]))
    r = summary["reward"]
    t.add_row("reward (weighted) mean ± std", f"{f(r['mean'])} ± {f(r['std'])}")
    for name, s in summary["rewards"].items():
        t.add_row(f"  {name} mean ± std", f"{f(s['mean'])} ± {f(s['std'])}")
    c = summary["completion_tokens"]
    t.add_row("completion tokens mean / p50 / min / max",
              f"{f(c['mean'], 1)} / {f(c.get('p50'), 1)} / {f(c['min'])} / {f(c['max'])}")
    t.add_row("truncated (--max-new-tokens or the context)", f(summary["truncated_fraction"]))
    t.add_row("zero-variance groups", f(summary["zero_variance_group_fraction"]))
    sigma = summary.get("sigma")  # %g: a fixed 6 decimals printed 0.000000 for a sigma under 5e-7 that was on
    t.add_row("AQN sigma", "-" if sigma is None else f"{sigma:.3g}")
    thr = summary.get("throughput", {})
    if thr.get("generated_tokens"):
        t.add_row("generated tokens / s", f"{thr['generated_tokens']} in {thr['generate_s']:.1f}s = {thr['tokens_per_s']:.1f} tok/s")
    return t


# ---- generation ----------------------------------------------------------------------------------






@dataclass
class _Generator:
    """Wraps one engine behind ``generate(prompt_ids, n, seeds) -> list[list[Completion]]``, one seed per prompt."""

    engine: object
    sampling: object  # the engine's sampling parameters (every prompt is seeded by ``seeds``)
    name: str
    progress: Callable | None = None
    timings: dict = field(default_factory=dict)  # seconds spent building it: load_s, engine_s
    noise_extra: dict = field(default_factory=dict)  # added to the noise record (vLLM: the dtype it rounded to)

    def __call__(self, prompt_ids: list[list[int]], n: int, seeds: list[int]):
        return self.engine.generate(prompt_ids, self.sampling, n=n, progress=self.progress, seeds=seeds)


def _native_generator(cfg: RolloutConfig, tokenizer, device: str, torch_dtype, sigma: float, max_model_len: int,
                      say=lambda text: None):
    from qerl_cli.aqn import apply_noise, clear_noise
    from qerl_cli.engine import LLMEngine, SamplingParams
    from qerl_cli.models import load_model

    t0 = time.time()
    model = load_model(cfg.model, device=device, dtype=torch_dtype, adapter_dir=cfg.adapter)
    if sigma > 0:
        apply_noise(model, sigma, cfg.run_seed, cfg.step)
    else:
        clear_noise(model)
    t1 = time.time()
    if device != "cpu":
        say(f"building the engine on {device}: CUDA graphs, and on a machine's first run its Triton kernels "
            "(~20 s for a 7B model on an H100)")
    engine = LLMEngine(model, tokenizer, max_num_seqs=cfg.max_num_seqs, max_model_len=max_model_len)
    timings = {"load_s": round(t1 - t0, 3), "engine_s": round(time.time() - t1, 3)}  # engine: graphs, kernels

    stops, stop_ids = split_stops(tokenizer, cfg.stop)
    sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
                              max_new_tokens=cfg.max_new_tokens, stop=stops, stop_token_ids=stop_ids)

    return _Generator(engine, sampling, "native", timings=timings), model


def _vllm_generator(cfg: RolloutConfig, tokenizer, device: str, dtype: str, sigma: float, max_model_len: int):
    from qerl_cli.engine_vllm import VLLMEngine, vllm_sampling_params

    engine = VLLMEngine(cfg.model, adapter_dir=cfg.adapter, dtype=dtype, max_num_seqs=cfg.max_num_seqs,
                        max_model_len=max_model_len, seed=cfg.seed)
    noise_extra = engine.set_noise(sigma, cfg.run_seed, cfg.step)

    stops, stop_ids = split_stops(tokenizer, cfg.stop)
    sampling = vllm_sampling_params(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
                                    max_new_tokens=cfg.max_new_tokens, stop=stops, stop_token_ids=stop_ids, seed=0)

    return _Generator(engine, sampling, "vllm", noise_extra=noise_extra), None


def _refuse_another_shards_out(cfg: RolloutConfig) -> None:
    """--out holding another shard of the same split: --force (the generic hint) would delete that
    shard's finished work. Each shard writes its own directory; train-step reads them all."""
    from qerl_cli.outputs import read_manifest

    m = read_manifest(Path(cfg.out)) if Path(cfg.out).is_dir() else None
    theirs = (m or {}).get("config", {}) if (m or {}).get("stage") == STAGE else {}
    if cfg.force or not theirs or theirs.get("num_shards", 1) == 1 == cfg.num_shards:
        return
    if (theirs.get("shard_index"), theirs.get("num_shards")) != (cfg.shard_index, cfg.num_shards):
        raise OutputExistsError(
            f"{cfg.out} holds shard {theirs.get('shard_index')} of {theirs.get('num_shards')} of a rollout; this is "
            f"shard {cfg.shard_index} of {cfg.num_shards}",
            hint="give each --shard-index its own --out (train-step --shards takes them all); --force would delete "
                 "that shard")


def _check_answers(cfg: RolloutConfig, reward_set: RewardSet, rows: Sequence[PromptRow], template) -> None:
    """A row without the reference a reward needs (gsm8k, math), refused before generating, of every row the run takes
    (``run_rows``), at every step, as the columns are (``check_columns``): only this step's --prompts-per-step slice
    was checked, so a long run stopped at the step whose slice held such a row. A row --long-prompts skip drops is
    never scored: not refused (it was, where the slice held it)."""
    if not reward_set.needs_answer:
        return
    lacking = [r for r in rows if r.answer is None]
    first = _first_kept(cfg, lacking, template) if cfg.long_prompts == "skip" else next(iter(lacking), None)
    if first is not None:
        raise BadInputError(
            f"{first.where}: row has no `answer`, but reward {reward_set.needs_answer[0]!r} needs one"
            + (f" ({len(lacking)} rows of {cfg.prompts} have none)" if len(lacking) > 1 else ""),
            hint="add answers, or use rewards that need none (format, module:function)",
        )


def _first_kept(cfg: RolloutConfig, rows: Sequence[PromptRow], template) -> PromptRow | None:
    """The first of ``rows`` whose prompt fits the context, which --long-prompts skip keeps; None where it drops them
    all. Encoded one at a time, and only these rows (those without an answer): a file whose rows all have one costs
    nothing here."""
    if not rows:
        return None
    tokenizer = load_tokenizer(cfg.model)
    if cfg.chat_template_file is not None:
        set_chat_template(tokenizer, read_chat_template(cfg.chat_template_file)[0], cfg.chat_template_file)
    limit = context_limit(cfg.model, cfg.max_model_len)[0] - 1
    return next((r for r in rows if encode_prompts(
        [r], tokenizer, template=template, system_prompt=cfg.system_prompt, chat_template=cfg.chat_template,
        chat_template_kwargs=cfg.chat_template_kwargs, max_prompt_tokens=limit, on_long="skip")), None)


def _warn_of_unset_columns(reward_set: RewardSet, rows: Sequence[PromptRow]) -> None:
    """Rows passing None for a column a TRL-style reward requires (a parameter without a default): a JSON row without
    it, or its null (a Parquet row's too). Said before generating, of every row, but not refused: ``datasets``, and so
    TRL, pass None for both, as qerl does. A row lacking it was refused, and only where this step's slice held it: a
    run stopped at a later step, or for a row --long-prompts skip never generates (a review). ``rows``: those the run
    takes (``run_rows``): rows past --max-prompts were counted too, a warning where no row it takes lacked one."""
    for s in reward_set.specs:
        for k in s.reward.needs_columns:
            unset = [r.where for r in rows if r.columns.get(k) is None]
            if unset:
                warnings.warn(QerlWarning(
                    f"reward {s.name!r} takes the dataset column `{k}` (a parameter without a default), which "
                    f"{len(unset)} of the {len(rows)} rows hold no value for (first: {unset[0]}): it is passed None "
                    "for them, as TRL passes it; a default (None) in the signature says that is expected (said at "
                    "--step 0 only, of every step's rows)"), stacklevel=3)


def _batches(prompts: Sequence[EncodedPrompt], size: int) -> list[list[EncodedPrompt]]:
    return [list(prompts[i : i + size]) for i in range(0, len(prompts), size)]


# ---- the stage -----------------------------------------------------------------------------------
def batch_size(cfg: RolloutConfig) -> int:
    """Prompts per generation batch: enough sequences to keep the engine's slots full past the
    batch's long tail (4 x --max-num-seqs), few enough that a crash loses little."""
    return cfg.batch_prompts or max(1, (4 * cfg.max_num_seqs) // cfg.num_generations)


def _fingerprint_config(cfg: RolloutConfig, device: str, dtype: str, reward_weights: dict,
                        template: str | None = None, every_row: bool = False) -> dict:
    """The arguments that change the records. The batching (--max-num-seqs, --batch-prompts) does not:
    every prompt is seeded by itself, so a run that went out of memory resumes with smaller batches."""
    d = asdict(cfg)
    if every_row:  # --max-prompts at or above the file's rows keeps them all, as leaving it out does (as eval's cap)
        d["max_prompts"] = None
    for k in ("model", "prompts", "out", "adapter", "force", "progress", "max_num_seqs", "rewards", "skip_bad_lines",
              "batch_prompts", "chat_template_file"):  # the file's text is an input (inputs["chat_template"])
        d.pop(k)
    # The device *type* changes numerics; which GPU of a node does not.
    d.update(device=device.split(":")[0], dtype=dtype, rewards=reward_weights, stop=list(cfg.stop))
    d["prompt_template"] = template  # the text, also when the flag named a file (its edits change the prompts)
    if d["chat_template_kwargs"] is None:  # unset, as outputs made before the flag recorded nothing
        d.pop("chat_template_kwargs")
    # The context the run has, not the flag as typed: unset, the model's limit and anything above it are one run
    # (it read as "changed", exit 4, and an interrupted run resumed with the flag added started over; a review).
    d["max_model_len"] = context_limit(cfg.model, cfg.max_model_len)[0]
    return d


def _legacy_fingerprint_configs(config: dict, cfg: RolloutConfig) -> tuple[dict, ...]:
    """How older qerl fingerprinted the same run, whose finished outputs still read as done: --max-model-len as
    typed (until 2026-11-27); before 2026-11-26 also the batch size (it seeded each batch) and
    --prompt-template as given, a file's name rather than its text."""
    typed = dict(config, max_model_len=cfg.max_model_len)
    olds = [typed, dict(typed, batch_prompts=batch_size(cfg), prompt_template=cfg.prompt_template)]
    if config["max_prompts"] != cfg.max_prompts:  # recorded as typed until 2026-11-27 (10 vs 20 of 4 rows: exit 4)
        olds += [dict(o, max_prompts=cfg.max_prompts) for o in (config, *olds)]
    return tuple(olds)


def rollout(cfg: RolloutConfig) -> dict:
    """Run the stage; returns ``{"out", "already_done", "summary", "manifest"}``."""
    t_start = time.time()
    cfg.model, cfg.prompts, cfg.out = Path(cfg.model), Path(cfg.prompts), Path(cfg.out)
    cfg.adapter = Path(cfg.adapter) if cfg.adapter is not None else None
    _check_flags(cfg)
    _warn_of_skipped_aqn_stages(cfg)
    reward_set = RewardSet.from_specs(cfg.rewards)
    _check_stops_leave_the_rewards_their_tags(cfg, reward_set)
    for spec in reward_set.specs:  # a user reward's file, as the templates (_check_flags)
        check_out_apart(cfg.out, reward=spec.reward.source and Path(spec.reward.source))
    template = load_template(cfg.prompt_template)
    bad_rows: list[str] = []
    rows = load_prompts(cfg.prompts, skip_bad_lines=cfg.skip_bad_lines, bad_lines=bad_rows,
                        prompt_key=cfg.prompt_key, answer_key=cfg.answer_key, columns=reward_set.takes_columns)
    selected = select_prompts(rows, cfg)
    if not selected and cfg.num_shards > 1:  # harmless for train-step, but a Slurm task (a GPU) spent on nothing
        warnings.warn(QerlWarning(
            f"shard {cfg.shard_index} of {cfg.num_shards} gets no prompts (fewer prompts this step than shards): "
            "it writes an empty shard; fewer --num-shards would do"), stacklevel=2)
    _check_answers(cfg, reward_set, run_rows(rows, cfg), template)
    columns = column_names(rows)  # the dataset's, of all rows: a reward taking **kwargs gets the same on every shard
    reward_set.check_columns(columns, f" of {cfg.prompts}")  # a column a TRL-style reward requires: before generating
    if cfg.step == 0:  # of every row the run takes: the same at every step, a line per step of a 500-step run
        _warn_of_unset_columns(reward_set, run_rows(rows, cfg))
    if "math" in {s.name for s in reward_set.specs}:  # a reference the math rule cannot read: said before generating
        long = long_math_reference(selected)
        if long is not None:
            warnings.warn(QerlWarning(long), stacklevel=2)
    sigma = aqn_sigma(cfg)
    device = resolve_device(cfg.device)
    dtype_name, torch_dtype = resolve_dtype(cfg.dtype, device)
    if cfg.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise BadInputError("--engine vllm needs vLLM, which is not installed", hint="pip install 'qerl[vllm]'")

    base_hash = model_hash(cfg.model)
    adapter_hash = dir_hash(cfg.adapter, names=ADAPTER_FILES) if cfg.adapter is not None else None
    lineage = (check_lineage(cfg.adapter, cfg.model, base_hash, override_flag=None,
                             hint="roll out with the base model the adapter was trained on")
               if cfg.adapter is not None else None)
    inputs = {"model": base_hash, "prompts": sha256_file(cfg.prompts)}
    if adapter_hash:
        from qerl_cli.adapters import norms_input

        inputs.update(adapter=adapter_hash, **norms_input(cfg.adapter))
    for spec in reward_set.specs:  # a user reward's code is an input too: editing it changes results
        src = getattr(spec.reward, "source", None)
        if src:
            inputs[f"reward:{spec.name}"] = sha256_file(Path(src))
    every_row = not cfg.max_prompts or cfg.max_prompts >= len(rows)
    config = _fingerprint_config(cfg, device, dtype_name, reward_set.weights, template, every_row)
    legacy_inputs = dict(inputs)  # qerl before 2026-11-26 did not count the tokenizer files
    # the named chat templates (additional_chat_templates/) are never rendered here: not an input
    inputs["text"] = text_files_hash(cfg.model, named_templates=False)
    chat_text = None
    if cfg.chat_template_file is not None:
        chat_text, inputs["chat_template"] = read_chat_template(cfg.chat_template_file)
    out = StageOutput(cfg.out, STAGE, config=config, inputs=inputs, force=cfg.force, resumable=True, started=t_start,
                      legacy_configs=_legacy_fingerprint_configs(config, cfg), legacy_inputs=(legacy_inputs,))
    _refuse_another_shards_out(cfg)
    if out.already_done(check_first=lambda: _encode(cfg, selected, template, chat_text, notes=False)):
        sweep_leftover_partial(out)
        return {"out": str(cfg.out), "already_done": True, "summary": out.manifest.get("summary"), "manifest": out.manifest}
    tokenizer, prompts, max_model_len, raise_hint, enc_report = _encode(cfg, selected, template, chat_text)
    _check_stops_leave_the_format_its_think(cfg, reward_set, prompts)  # its refusal before the other's warning
    _check_stops_leave_the_think_closed(cfg, reward_set, prompts)
    _check_stops_leave_the_thought_whole(cfg, reward_set, prompts)
    name = shard_name(cfg.shard_index, cfg.num_shards)
    # norms: the adapter's trained norm weights (--train-norms), which its hash leaves out; train-step checks them
    policy = {"base": base_hash, "adapter": adapter_hash, "norms": inputs.get("adapter_norms")}
    from qerl_cli.aqn import NOISED_NORMS

    # "norms" lets train-step check that it noises the same RMSNorms this rollout did.
    noise = {"sigma": sigma, "seed": cfg.run_seed, "step": cfg.step, "norms": list(NOISED_NORMS) if sigma > 0 else []}

    plan = _Plan(cfg, out, prompts, name, policy, noise, sigma, tokenizer, device, torch_dtype, dtype_name,
                 max_model_len, reward_set, enc_report, bad_rows, lineage, columns=tuple(columns))
    out.timings["prepare_s"] = round(time.time() - t_start, 3)  # checks, input hashes, tokenizer, encoding
    try:
        return _run(plan)
    except OutputExistsError:
        raise  # another process owns the partial directory: never touch it
    except BaseException:  # noqa: BLE001 - cleaned up, then re-raised
        # A bad input found late (an adapter that does not fit, a reward that returns junk), or a stop (Ctrl-C,
        # SIGTERM: Slurm's pre-emption while a large model loads), before any group was saved: leave nothing behind,
        # as eval does. With groups saved, keep them for the resume. (A stop left the partial directory with its
        # empty shard for good, and a later run of other flags warned of "an unfinished run" there to resume.)
        out.drop_work_if_nothing_kept("shard-*.jsonl")
        raise


def _encode(cfg: RolloutConfig, selected, template, chat_text, notes: bool = True):
    """The tokenizer and the selected rows encoded, with every check of the flags that need them (chat
    template, stops, context): (tokenizer, prompts, max_model_len, raise_hint, report)."""
    from qerl_cli.models.config import ModelConfig

    warn = notes  # warnings are shown with -q too (the CLI prints them); notes only with progress
    notes = notes and cfg.progress
    tokenizer = load_tokenizer(cfg.model)
    if chat_text is not None:
        set_chat_template(tokenizer, chat_text, cfg.chat_template_file)
    split_stops(tokenizer, cfg.stop)  # a stop that could never match is refused before any work
    max_model_len, raise_hint = context_limit(cfg.model, cfg.max_model_len)
    if cfg.max_model_len is not None and cfg.max_model_len > max_model_len and notes:
        print(f"note: --max-model-len {cfg.max_model_len} is beyond the model's limit; {raise_hint}", file=sys.stderr)
    enc_report = EncodeReport()
    prompts = encode_prompts(selected, tokenizer, template=template, system_prompt=cfg.system_prompt,
                             chat_template=cfg.chat_template, chat_template_kwargs=cfg.chat_template_kwargs,
                             max_prompt_tokens=max_model_len - 1,
                             on_long=cfg.long_prompts, report=enc_report,
                             long_hint=f"pass --long-prompts skip to skip such prompts; {raise_hint}",
                             vocab_size=ModelConfig.from_dir(cfg.model).vocab_size)
    if enc_report.own_system and notes:
        print(f"note: {len(enc_report.own_system)} rows have their own system message, which --system-prompt "
              f"does not replace (first: {enc_report.own_system[0]})", file=sys.stderr)
    short = sum(len(x.token_ids) + cfg.max_new_tokens > max_model_len for x in prompts)
    if short and notes:  # their completions stop at the context, counted as truncated like --max-new-tokens
        print(f"note: {short} of {len(prompts)} prompts leave fewer than --max-new-tokens {cfg.max_new_tokens} "
              f"tokens of the {max_model_len}-token context; their completions stop at the context", file=sys.stderr)
    if selected and not prompts and cfg.num_shards > 1:
        # One shard of a step whose other shards may hold prompts that fit: skipped as --long-prompts skip says,
        # an empty shard (as for more shards than prompts), not a failed Slurm task that stops the run.
        if warn:
            warnings.warn(QerlWarning(
                f"shard {cfg.shard_index} of {cfg.num_shards}: all {len(selected)} of its prompts are longer than the "
                f"{max_model_len - 1} tokens that fit the context (first: {enc_report.skipped_long[0]}); it writes an "
                "empty shard"), stacklevel=3)
    elif selected and not prompts:  # a step of nothing would pass for done here and fail only in train-step
        raise BadInputError(f"all {len(selected)} selected prompts are longer than the {max_model_len - 1} tokens "
                            f"that fit the context (first: {enc_report.skipped_long[0]})",
                            hint=f"shorten the prompts or the template; {raise_hint}")
    return tokenizer, prompts, max_model_len, raise_hint, enc_report


@dataclass
class _Plan:
    """Everything decided before generation starts (inputs checked, prompts encoded)."""

    cfg: RolloutConfig
    out: StageOutput
    prompts: list[EncodedPrompt]
    shard: str
    policy: dict
    noise: dict
    sigma: float
    tokenizer: object
    device: str
    torch_dtype: object
    dtype_name: str
    max_model_len: int
    reward_set: RewardSet
    enc_report: EncodeReport
    bad_rows: list[str]
    lineage: str | None
    columns: tuple[str, ...] = ()  # the dataset's columns (``column_names``), passed to TRL-style rewards
    generated: bool = False  # every selected group saved: a stop after it (manifest, rename) keeps them all

    def gid(self, p: EncodedPrompt) -> str:
        return group_id(self.cfg.step, p.row.id)


OLD_LOCK = ".lock"  # where qerl before 2026-11-26 kept the lock: inside the partial directory


def _run(plan: _Plan) -> dict:
    try:
        return _run_locked(plan)
    except KeyboardInterrupt as e:
        if not hasattr(e, "kept_groups") and plan.generated:  # stopped after the last group was saved (the summary,
            n = len(plan.prompts)                                # the manifest, the rename): the line said "before
            e.kept_groups = (n, n, plan.out.work)                # generating"
        raise


def _run_locked(plan: _Plan) -> dict:
    cfg, out = plan.cfg, plan.out
    with WriterLock(out), out as work:
        (work / OLD_LOCK).unlink(missing_ok=True)  # an older qerl's lock: not part of the output
        shard_path = work / plan.shard
        done, dropped = load_complete_groups(shard_path, cfg.num_generations)
        resumed = len(done)
        wanted = {plan.gid(p) for p in plan.prompts}
        stray = [g for g in done if g not in wanted]
        if stray:  # same fingerprint means same selection; anything else is a foreign file
            raise BadInputError(f"{shard_path}: holds group {stray[0]!r}, which this run does not select",
                                hint="delete the partial directory or pass --force")
        todo = [b for b in _batches(plan.prompts, batch_size(cfg)) if any(plan.gid(p) not in done for p in b)]
        t_gen, n_tokens = 0.0, 0
        if todo:
            try:
                t_gen, n_tokens = _generate_all(plan, todo, done, shard_path)
            except KeyboardInterrupt as e:
                e.kept_groups = (len(done), len(plan.prompts), work)  # for the stop line: what a rerun resumes
                raise
        elif not shard_path.exists():
            shard_path.touch()  # zero prompts selected (e.g. more shards than prompts): an empty shard
        plan.generated = True
        groups = [done[g] for g in map(plan.gid, plan.prompts) if g in done]
        summary = summarize(groups, [s.name for s in plan.reward_set.specs])
        summary.update(
            shard=plan.shard,
            resumed_groups=resumed,
            dropped_partial_lines=dropped,
            skipped_long_prompts=len(plan.enc_report.skipped_long),
            skipped_long=plan.enc_report.skipped_long[:20],
            skipped_bad_rows=len(plan.bad_rows),
            bad_rows=plan.bad_rows[:20],
            sigma=plan.sigma,
            adapter_lineage=plan.lineage,
            adapter_path=None if cfg.adapter is None else str(Path(cfg.adapter).resolve()),  # for people: not hashed
            engine=cfg.engine,
            device=plan.device,
            dtype=plan.dtype_name,
            throughput={"generated_tokens": n_tokens, "generate_s": round(t_gen, 3),
                        "tokens_per_s": (n_tokens / t_gen) if t_gen > 0 else None},
        )
        out.extra["summary"] = summary
        out.timings["generate_s"] = round(t_gen, 3)
    return {"out": str(cfg.out), "already_done": False, "summary": summary, "manifest": out.manifest}




@dataclass
class _Live:
    """Running totals for the progress line: tokens generated by this run; the mean reward of every saved
    completion, resumed ones included (the summary's mean is over the whole shard)."""

    tokens: int = 0
    reward_sum: float = 0.0
    completions: int = 0
    t0: float = field(default_factory=time.time)

    @classmethod
    def resuming(cls, done: dict[str, list[dict]]) -> _Live:
        records = [r for group in done.values() for r in group]
        return cls(reward_sum=sum(float(r["reward"]) for r in records), completions=len(records))

    def line(self, in_batch: int = 0) -> str:
        dt = max(time.time() - self.t0, 1e-9)
        mean = self.reward_sum / self.completions if self.completions else float("nan")
        pending = f"+{in_batch} generated, saved at the batch's end · " if in_batch else ""
        return f"{pending}{self.tokens / dt:,.0f} tok/s · mean reward {mean:.3f}"


def _generate_all(plan: _Plan, batches: list[list[EncodedPrompt]], done: dict[str, list[dict]],
                  shard_path: Path) -> tuple[float, int]:
    """Generate ``batches``, score, and append every group not in ``done``; returns (seconds, tokens)."""
    import contextlib

    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Column

    cfg = plan.cfg
    # Loading a large checkpoint takes minutes: say what is happening before the bar appears.
    # escape: Rich reads a path's "[x]" as markup (dropped), and "a[/b]" as a closing tag (MarkupError: no rollout)
    status = (Console(stderr=True).status(escape(f"loading {cfg.model}" + (f" + {cfg.adapter}" if cfg.adapter else "")
                                                 + f" on {plan.device} ({cfg.engine} engine)"))
              if cfg.progress else contextlib.nullcontext())
    t0 = time.time()
    with status:
        if cfg.engine == "vllm":
            gen, _ = _vllm_generator(cfg, plan.tokenizer, plan.device, plan.dtype_name, plan.sigma, plan.max_model_len)
        else:
            gen, _ = _native_generator(cfg, plan.tokenizer, plan.device, plan.torch_dtype, plan.sigma,
                                       plan.max_model_len, say=status.update if cfg.progress else lambda text: None)
    plan.out.timings.update(gen.timings or {"load_s": round(time.time() - t0, 3)})
    if gen.noise_extra:
        plan.noise.update(gen.noise_extra)
        if cfg.progress and "rounded_to" in gen.noise_extra:
            print(f"AQN: vLLM holds its norm weights in {gen.noise_extra['rounded_to']}, so w + Z is rounded there: "
                  f"{gen.noise_extra['survived']:.1%} of the weights changed (train-step applies the same rounding)",
                  file=sys.stderr)
    live = _Live.resuming(done)
    G, n_prompts = cfg.num_generations, len(plan.prompts)
    t_gen = 0.0
    from rich.console import Console

    # on stderr, as every stage's: stdout holds the result lines (a bar there vanished when stdout was a file)
    # The count and the time first, the long info last and cut alone: at 80 columns (a Slurm log) Rich shrank every
    # column alike, and "rol… pro… +5 generated" lost the count of saved groups (a review).
    progress = Progress(TextColumn("rollout"), BarColumn(bar_width=20), MofNCompleteColumn(), TextColumn("prompts"),
                        TimeElapsedColumn(),
                        TextColumn("{task.fields[info]}", table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)),
                        disable=not cfg.progress, transient=False, expand=True, console=Console(stderr=True))
    with progress, ShardWriter(shard_path) as writer:
        task = progress.add_task("rollout", total=n_prompts, completed=len(done), info="")
        for batch in batches:
            seeds = [derive_seed(cfg.seed, cfg.step, p.row.id) for p in batch]
            base_tokens = live.tokens

            def on_group(groups_done: int, tokens: int, base_tokens=base_tokens):
                # Called by the engine as groups finish inside the batch. Their records are scored and written
                # at the batch's end, so the bar counts saved groups only: an interrupt keeps exactly those.
                live.tokens = base_tokens + tokens
                progress.update(task, info=live.line(in_batch=groups_done))

            gen.progress = on_group
            t0 = time.time()
            groups = gen([p.token_ids for p in batch], G, seeds)
            t_gen += time.time() - t0
            live.tokens = base_tokens
            if len(groups) != len(batch):
                raise RuntimeError(f"engine returned {len(groups)} groups for {len(batch)} prompts")
            sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k, "min_p": cfg.min_p,
                        "max_new_tokens": cfg.max_new_tokens}
            for p, comps, seed in zip(batch, groups, seeds):
                live.tokens += sum(len(c.token_ids) for c in comps)
                gid = plan.gid(p)
                if gid in done:
                    continue  # regenerated only because its batch had a missing group
                if len(comps) != G:
                    raise RuntimeError(f"engine returned {len(comps)} completions for {p.row.where}, expected {G}")
                if not all(math.isfinite(x) for c in comps for x in c.logprobs):  # NaN/Inf logits: no record
                    raise NumericalError(f"{p.row.where}: a completion was sampled from NaN/Inf logits (groups "
                                         "finished before it are kept for a rerun)", hint=NONFINITE_LOGITS_HINT)
                # scored as a group (a TRL-style reward is called once for it), each judged after the <think> a
                # prompt opened (the record keeps the completion as generated)
                scores = plan.reward_set.score_group([judged_completion(c.text, p.opens_think) for c in comps],
                                                     p.row.answer, p.row.prompt_field,
                                                     completion_ids=[c.token_ids for c in comps],
                                                     columns={k: p.row.columns.get(k) for k in plan.columns},
                                                     where=f" for {p.row.where}")
                records = []
                for c, (vals, total) in zip(comps, scores):
                    records.append(make_record(
                        prompt_id=p.row.id, group_id=gid, prompt=p.row.prompt_field, prompt_token_ids=p.token_ids,
                        completion_token_ids=c.token_ids, completion=c.text, logprobs=c.logprobs,
                        finish_reason=c.finish_reason, rewards=vals, reward=total, answer=p.row.answer,
                        step=cfg.step, policy=plan.policy, sampling=dict(sampling, seed=seed), noise=plan.noise,
                        engine=gen.name,
                    ))
                    live.reward_sum += total
                    live.completions += 1
                writer.write_group(records)
                done[gid] = records
                progress.update(task, completed=len(done), info=live.line())
    return t_gen, live.tokens
