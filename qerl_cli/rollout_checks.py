"""The checks of ``qerl rollout``'s flags, stop strings and prompt rows, made before it loads a model or generates.

What a rollout is handed wrong (a flag out of range, a stop string that cuts a tag a reward reads, a row without the
reference its reward needs, another shard's ``--out``) is found here, while nothing of the run exists: a refusal writes
no partial directory and no shard, costs seconds rather than a model load, and never throws away generated groups (a
Slurm array of shards fails at once, each task alike). What only costs some completions their score (a stop that cuts
an ``<answer>``, a column a TRL-style reward is passed None for) is warned of here too, before the progress bar.

``qerl_cli.rollout.rollout`` calls these in a fixed order: the flags first, the stops that need the rendered prompts
(``check_stops_leave_the_format_its_think`` and the two after it) once ``_encode`` has them. Each raises
``BadInputError`` (exit 2) or ``OutputExistsError`` (exit 4), or warns with a ``QerlWarning`` at stacklevel 3: the
line that called ``rollout``. The checks that need what the stage computes stay with it: the adapter's lineage and
the output's fingerprint in ``rollout``, the prompts' lengths against the context in ``_encode``.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from qerl_cli.data import (
    LONG_PROMPT_POLICIES,
    PromptRow,
    encode_prompts,
    no_answer,
    read_chat_template,
    set_chat_template,
    template_file,
)
from qerl_cli.engine.sampling_params import MIN_TEMPERATURE
from qerl_cli.errors import BadInputError, OutputExistsError, QerlWarning
from qerl_cli.outputs import check_out_apart
from qerl_cli.rewards import RewardSet
from qerl_cli.runtime import context_limit, load_tokenizer
from qerl_cli.stops import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    blank_stop,
    every_stopped,
    stop_takes_tag,
    stop_taking,
    think_stop,
)

if TYPE_CHECKING:  # rollout imports this module: its config is only named in annotations here
    from qerl_cli.rollout import RolloutConfig

ENGINES = ("native", "vllm")
DTYPES = ("auto", "bf16", "fp16", "fp32")
DEVICES = ("auto", "cpu", "cuda")


def check_flags(cfg: RolloutConfig) -> None:
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


def warn_of_skipped_aqn_stages(cfg: RolloutConfig) -> None:
    # The schedule splits the run into K + 1 intervals; fewer steps than that skip some of them.
    if cfg.aqn_sigma_start > 0 and cfg.total_steps < cfg.aqn_stages + 1:
        warnings.warn(QerlWarning(
            f"--total-steps {cfg.total_steps} < --aqn-stages {cfg.aqn_stages} + 1: the AQN schedule skips stages "
            "(the noise may never reach --aqn-sigma-start or end at --aqn-sigma-end)"), stacklevel=3)


# The tags a completion passing the `format` reward holds (an opening <think> aside: the prompt may open it, so
# `check_stops_leave_the_format_its_think` judges a stop that takes it once the prompts are rendered).
FORMAT_CLOSED_TAGS = ("</think>", "<answer>", "</answer>")


def check_stops_leave_the_rewards_their_tags(cfg: RolloutConfig, reward_set: RewardSet) -> None:
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


def check_stops_leave_the_think_closed(cfg: RolloutConfig, reward_set: RewardSet, prompts) -> None:
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


def check_stops_leave_the_format_its_think(cfg: RolloutConfig, reward_set: RewardSet, prompts) -> None:
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


def check_stops_leave_the_thought_whole(cfg: RolloutConfig, reward_set: RewardSet, prompts) -> None:
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


def refuse_another_shards_out(cfg: RolloutConfig) -> None:
    """--out holding another shard of the same split: --force (the generic hint) would delete that
    shard's finished work. Each shard writes its own directory; train-step reads them all."""
    from qerl_cli.outputs import read_manifest
    from qerl_cli.rollout import STAGE  # here, not at the top: rollout imports this module

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


def check_answers(cfg: RolloutConfig, reward_set: RewardSet, rows: Sequence[PromptRow], template) -> None:
    """A row without the reference a reward needs (gsm8k, math), refused before generating, of every row the run takes
    (``run_rows``), at every step, as the columns are (``check_columns``): only this step's --prompts-per-step slice
    was checked, so a long run stopped at the step whose slice held such a row. A row --long-prompts skip drops is
    never scored: not refused (it was, where the slice held it)."""
    if not reward_set.needs_answer:
        return
    lacking = [r for r in rows if r.answer is None]
    first = _first_kept(cfg, lacking, template) if cfg.long_prompts == "skip" else next(iter(lacking), None)
    if first is not None:
        lacks, key_hint = no_answer(cfg.prompts, first, cfg.answer_key)
        raise BadInputError(
            f"{first.where}: row {lacks}, but reward {reward_set.needs_answer[0]!r} needs one"
            + (f" ({len(lacking)} rows of {cfg.prompts} have none)" if len(lacking) > 1 else ""),
            hint="; ".join(filter(None, (key_hint, "add answers, or use rewards that need none (format, module:function)"))),
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


def warn_of_unset_columns(reward_set: RewardSet, rows: Sequence[PromptRow]) -> None:
    """Rows passing None for a column a TRL-style reward requires (a parameter without a default): a JSON row without
    it, or its null (a Parquet row's too). Said before generating, of every row, but not refused: ``datasets``, and so
    TRL, pass None for both, as qerl does. A row lacking it was refused, and only where this step's slice held it: a
    run stopped at a later step, or for a row --long-prompts skip never generates (a review). ``rows``: those the run
    takes (``run_rows``): rows past --max-prompts were counted too, a warning where no row it takes lacked one.
    Called at --step 0 only: each of a recipe's steps is a process of its own, and the rows are the same at every step."""
    for s in reward_set.specs:
        for k in s.reward.needs_columns:
            unset = [r.where for r in rows if r.columns.get(k) is None]
            if unset:
                warnings.warn(QerlWarning(
                    f"reward {s.name!r} takes the dataset column `{k}` (a parameter without a default), which "
                    f"{len(unset)} of the {len(rows)} rows hold no value for (first: {unset[0]}): it is passed None "
                    "for them, as TRL passes it; a default (None) in the signature says that is expected (said at "
                    "--step 0 only, of every step's rows)"), stacklevel=3)
