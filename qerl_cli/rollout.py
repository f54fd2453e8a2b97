"""The ``qerl rollout`` stage: prompts -> G scored completions each -> JSONL rollout shards.

How it works
------------
1. Everything that can be wrong with the inputs is checked before any model is loaded: flags,
   reward names (user ``module:function`` rewards are imported here), the prompt file (file:line
   errors), whether rewards that need a reference have one (in every row the run takes, not only this
   step's), and adapter lineage (an adapter whose
   ``trainer_state.json`` names another base hash is refused, naming both). The checks of the flags, stops
   and rows live in ``qerl_cli.rollout_checks``.
2. Prompt selection is a pure function of the flags, so every shard of a Slurm array and every
   step of an RL loop agree on it without talking to each other: ``--max-prompts`` caps the
   dataset, ``--prompts-per-step P`` makes step k use rows ``[k*P, (k+1)*P)`` (wrapping around,
   optionally reshuffled every epoch), and ``--shard-index i --num-shards n`` keeps every n-th of
   those (round robin, so shards are balanced, disjoint, and cover the step): ``qerl_cli.rollout_selection``.
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
   no GRPO signal) and throughput (``qerl_cli.rollout_summary``).
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qerl_cli.data import (
    EncodedPrompt,
    EncodeReport,
    column_names,
    encode_prompts,
    load_prompts,
    load_template,
    parse_chat_template_kwargs,
    read_chat_template,
    set_chat_template,
)
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
from qerl_cli.rollout_checks import (
    check_answers,
    check_flags,
    check_stops_leave_the_format_its_think,
    check_stops_leave_the_rewards_their_tags,
    check_stops_leave_the_think_closed,
    check_stops_leave_the_thought_whole,
    refuse_another_shards_out,
    warn_of_skipped_aqn_stages,
    warn_of_unset_columns,
)
from qerl_cli.rollout_selection import run_rows, select_prompts
from qerl_cli.rollout_summary import summarize, summary_table  # noqa: F401 (summary_table re-exported)
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
from qerl_cli.stops import judged_completion

STAGE = "rollout"
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


# ---- noise and seeds -----------------------------------------------------------------------------
def aqn_sigma(cfg: RolloutConfig) -> float:
    """sigma for ``cfg.step`` under the AQN schedule (0 when AQN is off)."""
    if cfg.aqn_sigma_start <= 0:
        return 0.0
    from qerl_cli.aqn import sigma_at

    try:
        return sigma_at(cfg.step, cfg.total_steps, cfg.aqn_sigma_start, cfg.aqn_sigma_end, cfg.aqn_stages)
    except ValueError as e:
        raise BadInputError(f"AQN schedule: {e}") from None


def group_id(step: int, prompt_id: str) -> str:
    return f"s{step}:{prompt_id}"


def derive_seed(*parts) -> int:
    """A 63-bit seed from any parts; stable across processes (unlike ``hash()``)."""
    key = ":".join(str(p) for p in ("qerl-rollout", *parts)).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


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
    check_flags(cfg)
    warn_of_skipped_aqn_stages(cfg)
    reward_set = RewardSet.from_specs(cfg.rewards)
    check_stops_leave_the_rewards_their_tags(cfg, reward_set)
    for spec in reward_set.specs:  # a user reward's file, as the templates (check_flags)
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
    check_answers(cfg, reward_set, run_rows(rows, cfg), template)
    columns = column_names(rows)  # the dataset's, of all rows: a reward taking **kwargs gets the same on every shard
    reward_set.check_columns(columns, f" of {cfg.prompts}")  # a column a TRL-style reward requires: before generating
    if cfg.step == 0:  # of every row the run takes: the same at every step, a line per step of a 500-step run
        warn_of_unset_columns(reward_set, run_rows(rows, cfg))
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
    refuse_another_shards_out(cfg)
    if out.already_done(check_first=lambda: _encode(cfg, selected, template, chat_text, notes=False)):
        sweep_leftover_partial(out)
        return {"out": str(cfg.out), "already_done": True, "summary": out.manifest.get("summary"), "manifest": out.manifest}
    tokenizer, prompts, max_model_len, raise_hint, enc_report = _encode(cfg, selected, template, chat_text)
    check_stops_leave_the_format_its_think(cfg, reward_set, prompts)  # its refusal before the other's warning
    check_stops_leave_the_think_closed(cfg, reward_set, prompts)
    check_stops_leave_the_thought_whole(cfg, reward_set, prompts)
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
