"""The ``train-step`` stage's checks of its flags and inputs, each a refusal with one line that names what to change.

They run in ``train_step``'s order, everything that needs no model before anything is loaded (a wrong input fails in
seconds): ``_check_flags`` (the flags alone, with ``_check_numeric_flags`` and ``_check_memory_flags``), then against
the shards read (``_check_apart_from_shards``), the model's config (``_check_fits_model``,
``_check_memory_fits_model``), the adapter's layout (``_check_covers_every_layer``) and the run's lineage
(``_check_lineage``). ``_check_memory_flags`` and ``_check_keep_fits`` are also ``apply_memory_options``'s, for a
library caller (``benchmarks/bench_train.py``).
"""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qerl_cli.adapters import NORMS, norms_input
from qerl_cli.errors import BadInputError, LineageError
from qerl_cli.outputs import check_out_apart, file_in_the_way
from qerl_cli.train.advantages import SCALES
from qerl_cli.train.losses import LossConfig

if TYPE_CHECKING:
    from qerl_cli.train.inputs import StepData
    from qerl_cli.train.state import TrainerState
    from qerl_cli.train_step import TrainStepConfig


def _check_flags(cfg: TrainStepConfig) -> None:
    """The flags alone (and that --model, --adapter are directories, --out and --metrics-file apart from them)."""
    LossConfig(cfg.loss, cfg.clip_eps, cfg.clip_eps_high, cfg.beta, cfg.tis_cap).validate()
    if cfg.scale_rewards not in SCALES:
        raise BadInputError(f"--scale-rewards must be one of {', '.join(SCALES)}, got {cfg.scale_rewards!r}")
    if cfg.epochs < 1:
        raise BadInputError(f"--epochs must be >= 1, got {cfg.epochs}")
    if cfg.lr < 0 or not math.isfinite(cfg.lr):
        raise BadInputError(f"--lr must be a finite number >= 0, got {cfg.lr}")
    _check_numeric_flags(cfg)
    _check_memory_flags(cfg)
    if cfg.baseline not in (None, "bf16"):
        raise BadInputError(f"--baseline must be bf16 (or omitted), got {cfg.baseline!r}")
    if cfg.adapter is not None and not Path(cfg.adapter).is_dir():
        raise BadInputError(f"--adapter {cfg.adapter} is not a directory")
    if not Path(cfg.model).is_dir():
        raise BadInputError(f"--model {cfg.model} is not a directory")
    if cfg.adapter is not None and Path(cfg.out).resolve() == Path(cfg.adapter).resolve():
        # Overwriting the input adapter would make the step impossible to rerun or resume.
        raise BadInputError(f"--out {cfg.out} is the --adapter directory", hint="write each step to a new directory")
    # --metrics-file is the whole run's record: inside --out, a --force redo of the step deleted it
    check_out_apart(cfg.out, model=cfg.model, adapter=cfg.adapter, metrics_file=cfg.metrics_file)
    if cfg.metrics_file is not None and (Path(cfg.metrics_file).is_dir()
                                         or file_in_the_way(Path(cfg.metrics_file).parent) is not None):
        # found only after the step's output was in place, the traceback stopped a `set -e` recipe there
        raise BadInputError(f"--metrics-file {cfg.metrics_file} is a directory or inside a file",
                            hint="name a .jsonl file (one for the whole run), e.g. run/metrics.jsonl")


def _check_numeric_flags(cfg: TrainStepConfig) -> None:
    """Flags whose out-of-range values would otherwise train something other than what was asked, silently
    (a zero alpha never learns, a min-LR ratio over 1 raises the LR)."""
    def need(ok: bool, flag: str, what: str, v) -> None:
        if not ok:
            raise BadInputError(f"{flag} must be {what}, got {v}")

    if cfg.lora_rank is not None:
        need(cfg.lora_rank >= 1, "--lora-rank", ">= 1", cfg.lora_rank)
    if cfg.lora_alpha is not None:
        need(cfg.lora_alpha > 0 and math.isfinite(cfg.lora_alpha), "--lora-alpha", "a finite number > 0", cfg.lora_alpha)
    if cfg.lora_dropout is not None:
        need(0 <= cfg.lora_dropout < 1, "--lora-dropout", "in [0, 1)", cfg.lora_dropout)
    need(cfg.warmup_steps >= 0, "--warmup-steps", ">= 0", cfg.warmup_steps)
    if cfg.total_steps is not None:
        need(cfg.total_steps >= 1, "--total-steps", ">= 1 (omit it for a constant LR after warmup)", cfg.total_steps)
        # The cosine runs from the end of warmup to --total-steps; with no room for it the schedule
        # silently stayed at the peak (and dropped --min-lr-ratio).
        need(cfg.total_steps > cfg.warmup_steps, "--total-steps", f"> --warmup-steps ({cfg.warmup_steps}): the cosine "
             "decay runs between them", cfg.total_steps)
    if cfg.max_completion_length is not None:  # 0 read as unset, a negative one recorded (audit)
        need(cfg.max_completion_length >= 1, "--max-completion-length", ">= 1", cfg.max_completion_length)
    need(0 <= cfg.min_lr_ratio <= 1, "--min-lr-ratio", "in [0, 1]", cfg.min_lr_ratio)
    need(cfg.max_grad_norm >= 0 and math.isfinite(cfg.max_grad_norm), "--max-grad-norm",
         "a finite number >= 0 (0 turns clipping off)", cfg.max_grad_norm)
    need(cfg.weight_decay >= 0 and math.isfinite(cfg.weight_decay), "--weight-decay", "a finite number >= 0",
         cfg.weight_decay)
    need(0 <= cfg.adam_beta1 < 1 and 0 <= cfg.adam_beta2 < 1, "--adam-beta1/--adam-beta2", "in [0, 1)",
         (cfg.adam_beta1, cfg.adam_beta2))
    need(cfg.adam_eps > 0, "adam_eps (no flag; TrainStepConfig)", "> 0", cfg.adam_eps)
    # AdamW makes fp32 scalars of lr / (1 - beta1^t) and 1 - lr * weight_decay: past fp32's range (--lr 1e38) the
    # update raised "value cannot be converted to type float without overflow" after the whole step (exit 1)
    big = torch.finfo(torch.float32).max
    need(cfg.lr / (1.0 - cfg.adam_beta1) < big and cfg.lr * cfg.weight_decay < big, "--lr/--weight-decay",
         f"small enough for AdamW's fp32 step (lr / (1 - --adam-beta1) and lr x --weight-decay below {big:.3g})", (cfg.lr, cfg.weight_decay))
    need(cfg.micro_batch_tokens >= 1, "--micro-batch-tokens", ">= 1", cfg.micro_batch_tokens)
    need(cfg.logits_chunk_tokens >= 1, "--logits-chunk-tokens", ">= 1", cfg.logits_chunk_tokens)


def _check_memory_flags(cfg: TrainStepConfig) -> None:
    keep = cfg.keep_activations
    if isinstance(keep, numbers.Integral) and not isinstance(keep, bool) and type(keep).__name__ != "bool_":
        keep = cfg.keep_activations = int(keep)  # numpy integers, as check_field_types takes them for int fields
    if isinstance(keep, bool) or not (keep == "auto" or (isinstance(keep, int) and keep >= 0)):
        raise BadInputError(f"--keep-activations must be a whole number >= 0 or auto, got {keep!r}")
    if cfg.keep_activations and not cfg.gradient_checkpointing:
        raise BadInputError("--keep-activations chooses which layers gradient checkpointing leaves out, and "
                            "--no-checkpointing leaves out all of them", hint="drop one of the two")
    if cfg.offload_activations and not cfg.gradient_checkpointing:
        raise BadInputError("--offload-activations moves the checkpointed layer inputs to CPU memory, so it needs "
                            "gradient checkpointing", hint="drop --no-checkpointing or --offload-activations")


def _check_keep_fits(keep: int, n_layers: int, model: str) -> None:
    """Refuse a --keep-activations count above the model's layer count (before loading, and in
    ``apply_memory_options`` for a library caller)."""
    if keep > n_layers:
        raise BadInputError(f"--keep-activations {keep}: {model} has {n_layers} decoder layers",
                            hint=f"at most {n_layers} (every layer kept)")


def _check_apart_from_shards(cfg: TrainStepConfig, data: StepData) -> None:
    """--out and --metrics-file against the shard files read."""
    for d in {f.parent for f in data.files}:  # --force replaces --out: never a directory the shards are read from
        check_out_apart(cfg.out, shards=d)
    if cfg.metrics_file is not None and Path(cfg.metrics_file).resolve() in {f.resolve() for f in data.files}:
        # its records carry a "step" too: the append dropped every record of this step from the shard
        raise BadInputError(f"--metrics-file {cfg.metrics_file} is one of the --shards files",
                            hint="name a .jsonl file of its own for the run's metrics, e.g. run/metrics.jsonl")


def _check_fits_model(cfg: TrainStepConfig, data: StepData) -> None:
    """Token ids inside the vocabulary and sequences inside the position range, named per record
    (otherwise an embedding index error or a rotary-cache error deep in the forward)."""
    from qerl_cli.models import ModelConfig

    mcfg = ModelConfig.from_dir(Path(cfg.model))
    limit, what = mcfg.max_position_embeddings, "positions"
    if mcfg.sliding_window and mcfg.sliding_window < limit:  # windowed attention is not implemented: the
        limit, what = mcfg.sliding_window, "tokens of the sliding window"  # forward refused it after loading
    for i, (n_p, n_c, (lo, hi)) in enumerate(zip(data.prompt_lengths, data.completion_lengths, data.id_ranges)):
        rec = data.records[i]
        # by file:line: "first file: record i" counted i over every file given, and named the first file whatever held it
        where = "{}:{}".format(*data.origins[i]) if data.origins else f"{data.files[0]}: record {i}"
        who = f"{where}: record of group {rec['group_id']!r} (prompt {rec['prompt_id']!r})"
        if n_p + n_c > limit:
            raise BadInputError(f"{who} has {n_p + n_c} tokens, more than the {limit} "
                                f"{what} of --model {cfg.model}")
        if not 0 <= lo <= hi < mcfg.vocab_size:  # the ids themselves (under torchrun, maybe read again) name it
            p, c = data.token_ids(i)
            bad = next(t for t in p + c if not 0 <= t < mcfg.vocab_size)
            raise BadInputError(f"{who} has token id {bad}, outside --model {cfg.model}'s vocabulary "
                                f"of {mcfg.vocab_size}", hint="were the shards made with another model's tokenizer?")


def _check_memory_fits_model(cfg: TrainStepConfig) -> None:
    """--keep-activations and --embeddings-on-cpu against --model's config, before it is loaded."""
    if cfg.embeddings_on_cpu or cfg.keep_activations:
        from qerl_cli.models import ModelConfig

        mcfg = ModelConfig.from_dir(Path(cfg.model))
        if cfg.keep_activations != "auto":
            _check_keep_fits(cfg.keep_activations, mcfg.num_layers, f"--model {cfg.model}")
        if cfg.embeddings_on_cpu and mcfg.tie_word_embeddings:
            raise BadInputError(f"--embeddings-on-cpu: --model {cfg.model} ties its input embedding to the lm_head "
                                "(tie_word_embeddings), which needs the table on the GPU",
                                hint="drop --embeddings-on-cpu (it only helps untied models)")


def _check_lineage(cfg: TrainStepConfig, data: StepData, base_hash: str, adapter_hash: str | None,
                   state: TrainerState) -> None:
    src = data.files[0]
    if data.base_hash != base_hash:
        raise LineageError(
            f"{src}: shards were sampled from base model {data.base_hash!s:.12}, but --model {cfg.model} "
            f"has hash {base_hash:.12}", hint="roll out and train with the same --model")
    if state.base_model_hash and state.base_model_hash != base_hash:
        raise LineageError(
            f"--adapter {cfg.adapter} was trained on base model {state.base_model_hash:.12}, but --model "
            f"{cfg.model} has hash {base_hash:.12}")
    if data.adapter_hash != adapter_hash:
        got = "no adapter (a fresh start)" if adapter_hash is None else f"adapter {adapter_hash:.12} ({cfg.adapter})"
        was = "no adapter" if data.adapter_hash is None else f"adapter {data.adapter_hash:.12}"
        where = _rollout_adapter_path(src)
        was += f" ({where} when it ran)" if where else ""
        raise LineageError(f"{src}: shards were sampled with {was}, but this step continues from {got}",
                           hint="pass the --adapter the rollout used")
    # The PEFT files' hash leaves out the trained norm weights (norms.safetensors): records since
    # 2026-11-26 carry their hash (null: none); older records do not say, and are taken as they are.
    policy = data.records[0]["policy"]
    mine = norms_input(cfg.adapter).get("adapter_norms") if cfg.adapter is not None else None
    if "norms" in policy and policy["norms"] != mine:
        was = "no trained norm weights" if policy["norms"] is None else f"trained norm weights {policy['norms']:.12}"
        has = "none" if mine is None else f"others ({mine:.12})"
        raise LineageError(f"{src}: shards were sampled with {was}, but --adapter {cfg.adapter} has {has} in {NORMS}",
                           hint="pass the --adapter the rollout used")


def _rollout_adapter_path(shard: Path) -> str | None:
    """The --adapter path the rollout that wrote ``shard`` was given, from its manifest (a hint only)."""
    from qerl_cli.outputs import read_manifest

    m = read_manifest(Path(shard).parent) or {}
    return (m.get("summary") or {}).get("adapter_path") if m.get("stage") == "rollout" else None


def _check_covers_every_layer(cfg: TrainStepConfig, spec, adapter_cfg: dict) -> None:
    """Refuse to continue an adapter PEFT applies to only some layers (``layers_to_transform``, ``exclude_modules``, a
    ``target_modules`` regex). Rollout and eval apply it as PEFT does (LoRA kept at zero where PEFT puts none), but a
    step trains LoRA on every layer of its targets and writes an adapter_config.json without those fields: the next
    adapter would adapt the layers this one leaves out, another layout, without a word."""
    from qerl_cli.adapters import CONFIG, adapter_leaves_out
    from qerl_cli.models.loader import lora_module_names

    left = adapter_leaves_out(adapter_cfg, lora_module_names(cfg.model, spec.targets))
    if left:
        module, why = left[0]
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        raise BadInputError(f"--adapter {cfg.adapter}: its {CONFIG} {why} {module!r}{more}, and train-step trains LoRA "
                            "on every layer and saves no such field, so training on would change the adapter's layout",
                            hint="rollout and eval apply it as it is; to train on it, `qerl merge` it into the base "
                                 f"(--dtype {_merge_dtype(cfg.model)}) and start a fresh adapter on the merged model")


def _merge_dtype(model_dir) -> str:
    """The ``qerl merge --dtype`` that keeps --model's format: nvfp4 for a QDIR, bf16 for a plain HF dir (the 16-bit
    baseline: an NVFP4 merge of it is another experiment, and --baseline bf16 refuses it)."""
    return "nvfp4" if json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config") else "bf16"
