"""The ``train-step`` stage: one step's rollout shards + the current adapter -> the next adapter.

How it works, in order:

1. Read and check the shards (one schema version, one base model, one adapter, one AQN noise
   record, >= 2 completions per group) and the input adapter's ``trainer_state.json``.
2. Group advantages (``train.advantages``); per-sequence loss weights for the whole step
   (``train.losses``); token-budget micro-batches, longest first (``train.batching``).
3. Load the base (NVFP4 QDIR, or a plain HF dir for the 16-bit LoRA baseline) through the one
   shared decoder; its Linears run ``qerl_kernels.ops.nvfp4_linear`` forward and backward, so no
   dequantized copy of the model ever exists. LoRA wraps q,k,v,o,gate,up,down; only LoRA (and with
   ``--train-norms`` the RMSNorm weights) require grad. The AQN noise vectors of the rollout are
   rebuilt from the shard's ``noise`` record (same seeds -> same vectors).
4. For each epoch: forward each owned micro-batch (gradient checkpointing per decoder layer),
   log-probs of the completion tokens in vocabulary chunks (never a [tokens, vocab] tensor for the
   whole micro-batch), the PPO/TIS/KL loss, backward; then all-reduce the LoRA grads, clip, AdamW.
   Epoch 1's log-probs (detached) are the "old" policy: the PPO ratio is exactly 1 there, and later
   epochs reuse them, as do the TIS weights ``min(exp(old - sampling), cap)``.
5. Rank 0 writes the adapter (PEFT), ``optimizer.safetensors``, ``trainer_state.json`` and
   ``metrics.jsonl`` through ``StageOutput`` (atomic; same inputs -> "already done").

Determinism: the adapter init, the micro-batch packing and the dropout masks (seeded per
(seed, step, epoch, micro-batch)) depend only on the inputs, so rerunning a step from the same
inputs reproduces the adapter bit for bit on the same machine: on a CPU always, on a GPU with
``--deterministic`` (without it PyTorch's cuDNN attention backward may vary in the last bits;
``train.determinism``). A multi-GPU run equals the single-process run up to float summation order.

Trade-offs: log-probs are recomputed at the training policy instead of trusting the rollout's
(costs one forward, which the backward needs anyway); the reference policy for ``--beta`` is the
same model with LoRA switched off (one more no-grad forward per micro-batch, no second model).

The stage's parts of its own: reading its inputs (the shards into one step, the input hashes of its fingerprint)
is ``train.inputs``'s, its flag and input checks are ``train.checks``'s, its metrics record and the
``--metrics-file`` lines ``train.metrics``'s, what it prints (progress bar, notes, warnings, the result line)
``train.report``'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from qerl_cli.adapters import NORMS, load_norms, trained_norms
from qerl_cli.errors import (
    BadInputError,
    NumericalError,
    OutOfMemoryError,
    QerlError,
    QerlWarning,
)
from qerl_cli.hashing import model_hash
from qerl_cli.layers.lora import DEFAULT_TARGETS
from qerl_cli.outputs import StageOutput
from qerl_cli.runtime import as_many, check_field_types, resolve_device, resolve_dtype
from qerl_cli.train import distributed
from qerl_cli.train.activation_budget import AutoKeep
from qerl_cli.train.advantages import group_advantages
from qerl_cli.train.batching import Microbatch, collate, pack_microbatches
from qerl_cli.train.checks import (
    _check_apart_from_shards,
    _check_covers_every_layer,
    _check_fits_model,
    _check_flags,
    _check_keep_fits,
    _check_lineage,
    _check_memory_fits_model,
    _check_memory_flags,
)
from qerl_cli.train.determinism import deterministic_algorithms, prepare_environment
from qerl_cli.train.inputs import (
    StepData,
    _adapter_inputs_hash,
    _keep_owned,
    _shards_hash,
    dr_grpo_length,
    read_step,
)
from qerl_cli.train.logprobs import token_logprobs
from qerl_cli.train.losses import LossConfig, policy_loss, sequence_weights, tis_weights
from qerl_cli.train.metrics import Accumulator, _append_metrics, _ensure_metrics_line, _metrics, append_jsonl
from qerl_cli.train.metrics import _drop_step_lines as _drop_step_lines  # imported from here by tests
from qerl_cli.train.optim import (
    OPTIMIZER_FILE,
    grad_norm_and_clip,
    load_optimizer,
    lr_at,
    make_optimizer,
    save_optimizer,
    set_lr,
)
from qerl_cli.train.report import _progress, _say, _warn, result_line
from qerl_cli.train.report import _result_numbers as _result_numbers  # imported from here by tests
from qerl_cli.train.state import STATE_FILE, TrainerState, capture_rng, foreign_state, restore_rng

STAGE = "train-step"
METRICS_FILE = "metrics.jsonl"


@dataclass
class TrainStepConfig:
    model: Path
    shards: list[str]
    out: Path
    adapter: Path | None = None
    # algorithm
    loss: str = "dapo"
    scale_rewards: str = "group"
    clip_eps: float = 0.2
    clip_eps_high: float = 0.28
    beta: float = 0.0
    tis_cap: float = 2.0
    mask_truncated: bool = False
    max_completion_length: int | None = None
    epochs: int = 1
    # optimizer / schedule
    lr: float = 1e-5
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    adam_eps: float = 1e-8
    max_grad_norm: float = 0.2
    # LoRA (None: 16/16/0.0/default targets for a fresh adapter, the adapter's own when resuming)
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float | None = None
    lora_targets: tuple[str, ...] | None = None
    train_norms: bool = False
    # machinery
    micro_batch_tokens: int = 16384
    logits_chunk_tokens: int = 2048
    gradient_checkpointing: bool = True
    keep_activations: int | str = 0    # under checkpointing, the last N decoder layers are not recomputed; "auto"
    offload_activations: bool = False  # checkpointed layer inputs to pinned CPU memory (CUDA only)
    embeddings_on_cpu: bool = False    # frozen input embedding table in CPU memory (CUDA only; not when tied)
    deterministic: bool = False        # PyTorch's deterministic algorithms for the loop (train.determinism)
    device: str = "auto"
    dtype: str = "auto"
    baseline: str | None = None
    seed: int = 0
    skip_bad_lines: bool = False
    metrics_file: Path | None = None
    force: bool = False
    progress: bool = True

    def __post_init__(self):
        check_field_types(self)
        self.shards, self.lora_targets = as_many(self.shards, list), as_many(self.lora_targets)
        if self.lora_targets is not None:  # "q_proj,v_proj", as the CLI's --lora-targets takes them
            self.lora_targets = tuple(t.strip() for x in self.lora_targets for t in str(x).split(",") if t.strip())
        if self.lora_targets is not None and not self.lora_targets:  # trained all seven, recorded as []
            raise BadInputError("lora_targets=() names no Linear", hint="None: all seven (or the adapter's own)")

    # arguments that do not change the result (where things go, how they are shown, where the
    # same bytes wait: the memory options are bit-identical, so toggling them is not a new step;
    # --deterministic only fixes the order of float sums, as --micro-batch-tokens changes it)
    _NOT_RESULT = ("model", "shards", "out", "adapter", "metrics_file", "force", "progress", "offload_activations",
                   "embeddings_on_cpu", "keep_activations", "deterministic")

    def fingerprint_config(self, lora_dropout: float | None = None) -> dict:
        """The arguments that make the step's result. The micro-batch and logits-chunk sizes only
        reorder float sums (the losses are summed over micro-batches with whole-step weights), so they
        are left out: after an out-of-memory, a smaller --micro-batch-tokens resumes a run instead of
        making its finished steps "different inputs". Except for bnpo, which normalises per micro-batch,
        and LoRA dropout > 0 (``lora_dropout``: the effective rate), whose masks are drawn per micro-batch."""
        d = asdict(self)
        d.pop("logits_chunk_tokens", None)
        if self.loss != "bnpo" and not (lora_dropout if lora_dropout is not None else self.lora_dropout or 0.0):
            d.pop("micro_batch_tokens", None)
        if d.get("lora_targets"):
            d["lora_targets"] = sorted(d["lora_targets"])  # their order changes nothing (_lora_spec sorts too)
        return self._result_args(d)

    def legacy_fingerprint_config(self) -> dict:
        """The config qerl <= 2026-11-25 fingerprinted (every size, targets as given): runs it finished stay done."""
        return self._result_args(asdict(self))

    def _result_args(self, d: dict) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items() if k not in self._NOT_RESULT}


# ---- model ---------------------------------------------------------------------------------------
def _lora_spec(cfg: TrainStepConfig):
    """The LoRA layout: the adapter's own when resuming (flags must agree), else from the flags."""
    from qerl_cli.adapters import read_adapter_config, read_adapter_spec, require_weights
    from qerl_cli.layers.lora import LoraSpec

    if cfg.adapter is not None:
        adapter_cfg = read_adapter_config(cfg.adapter)  # read once: the layout and the layers check see one file
        # the layout needs only the config; a half-copied adapter (no weights) failed the lineage check below with
        # "pass the --adapter the rollout used", the one passed
        require_weights(cfg.adapter)
        spec = read_adapter_spec(cfg.adapter, adapter_cfg, base_dir=cfg.model)
        _check_covers_every_layer(cfg, spec, adapter_cfg)
        for flag, mine, theirs in (("--lora-rank", cfg.lora_rank, spec.r), ("--lora-alpha", cfg.lora_alpha, spec.alpha),
                                   ("--lora-targets", tuple(sorted(cfg.lora_targets)) if cfg.lora_targets else None,
                                    tuple(sorted(spec.targets)))):
            if mine is not None and mine != theirs:
                raise BadInputError(f"{flag} {mine} does not fit --adapter {cfg.adapter} (trained with {theirs})",
                                    hint=f"drop {flag} to continue the adapter as it is")
        dropout = spec.dropout if cfg.lora_dropout is None else cfg.lora_dropout
        spec = LoraSpec(r=spec.r, alpha=spec.alpha, dropout=dropout, targets=spec.targets,
                        use_rslora=spec.use_rslora, seed=cfg.seed)
    else:
        spec = LoraSpec(r=16 if cfg.lora_rank is None else cfg.lora_rank,
                        alpha=cfg.lora_alpha if cfg.lora_alpha is not None else 16.0,
                        dropout=cfg.lora_dropout or 0.0, targets=tuple(cfg.lora_targets or DEFAULT_TARGETS),
                        seed=cfg.seed)
    return spec


def _load(cfg: TrainStepConfig, spec, device: str, dtype: torch.dtype):
    from qerl_cli.models import load_model

    model = load_model(cfg.model, device=device, dtype=dtype, lora=spec, adapter_dir=cfg.adapter)
    if cfg.baseline == "bf16" and model.is_quantized:
        raise BadInputError(f"--baseline bf16 expects a plain 16-bit HF model dir, but {cfg.model} is NVFP4-quantized")
    return model


def _trainable(model, train_norms: bool) -> list[tuple[str, torch.nn.Parameter]]:
    from qerl_cli.layers.norm import RMSNorm

    for p in model.parameters():
        p.requires_grad_(False)
    named = []
    for name, p in model.named_parameters():
        if ".lora_A" in name or ".lora_B" in name:
            p.requires_grad_(True)
            named.append((name, p))
    if train_norms:
        for mname, m in model.named_modules():
            if isinstance(m, RMSNorm):
                # Master copy in fp32: bf16 cannot hold lr-sized updates of a weight near 1.
                m.weight.data = m.weight.data.float()
                m.weight.requires_grad_(True)
                named.append((f"{mname}.weight", m.weight))
    return named


def apply_memory_options(cfg: TrainStepConfig, model, device) -> list[str]:
    """Gradient checkpointing, activation offload and the CPU embedding table on a loaded model;
    returns notes for the log.

    Shared with ``benchmarks/bench_train.py``. The options are no-ops on a CPU device (the tensors
    already live in CPU memory): a note says so.
    """
    _check_memory_flags(cfg)  # usable alone (bench_train.py): the same refusals as train_step
    notes = []
    model.gradient_checkpointing = cfg.gradient_checkpointing
    cuda = str(device).startswith("cuda")
    n_layers = len(model.model.layers)
    keep = cfg.keep_activations
    model.keep_activations = 0
    if keep == "auto":
        notes.append("--keep-activations auto: the count is chosen after the first micro-batch" if cuda else
                     f"--keep-activations auto: no effect on {device} (every layer is recomputed)")
    else:
        _check_keep_fits(keep, n_layers, "the model")
        if keep:
            model.keep_activations = keep
            notes.append(f"--keep-activations: the last {keep} of {n_layers} decoder layers keep their "
                         f"activations for the backward; the other {n_layers - keep} are recomputed")
    model.activation_offload = None
    if cfg.offload_activations:
        if cuda:
            from qerl_cli.train.offload import ActivationOffloader

            model.activation_offload = ActivationOffloader(device)
            notes.append(f"--offload-activations: {model.activation_offload.describe()}")
        else:
            notes.append(f"--offload-activations: no effect on {device} (activations are already in CPU memory)")
    if cfg.embeddings_on_cpu:
        if cuda:
            try:
                model.embeddings_to_cpu()
            except ValueError as e:
                raise BadInputError(f"--embeddings-on-cpu: {e}", hint="drop --embeddings-on-cpu") from None
            emb = model.model.embed_tokens.weight
            notes.append(f"--embeddings-on-cpu: the {tuple(emb.shape)} input embedding table stays in CPU memory "
                         f"({emb.numel() * emb.element_size() / 2**30:.2f} GiB off the GPU)")
        else:
            notes.append(f"--embeddings-on-cpu: no effect on {device} (the table is already in CPU memory)")
    return notes


# ---- log-probs -----------------------------------------------------------------------------------
def microbatch_logprobs(model, mb: Microbatch, inv_temp_seq: torch.Tensor, device, chunk: int,
                        cut_seq: torch.Tensor | None = None):
    """Completion-token log-probs [T] (and entropies) of one micro-batch under the current model, over
    what each sequence's sampling cut kept (``cut_seq`` [N, 3]: top_p, top_k, min_p; None: no cut)."""
    if getattr(model, "embeddings_on_cpu", False):
        # ids stay on the host for the gather there (and the mask check needs no device sync)
        ids, mask = mb.input_ids, mb.attention_mask
    else:
        ids, mask = mb.input_ids.to(device), mb.attention_mask.to(device)
    hidden = model.forward_train(ids, mask)
    sel = hidden[mb.rows.to(device), mb.cols.to(device)]
    inv_t = inv_temp_seq[mb.seq_of_token].to(device=device, dtype=torch.float32)
    cut = None if cut_seq is None else cut_seq[mb.seq_of_token].to(device)
    return token_logprobs(model, sel, mb.targets.to(device), inv_t, chunk, trunc=cut)


@contextlib.contextmanager
def base_policy(model):
    """The KL reference, the base model: LoRA off and, where the adapter carries trained norm
    weights (--train-norms), the checkpoint's norms swapped back in for the block."""
    from qerl_cli.layers.lora import lora_disabled

    params = dict(model.named_parameters())
    swapped = []
    try:
        for name, w in getattr(model, "base_norms", {}).items():
            p = params[name]
            swapped.append((p, p.data))
            p.data = w.to(device=p.device, dtype=p.dtype)
        with lora_disabled(model):
            yield
    finally:
        for p, data in swapped:
            p.data = data


def _dropout_seed(seed: int, step: int, epoch: int, mb: int) -> int:
    key = f"qerl-dropout:{seed}:{step}:{epoch}:{mb}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


# ---- the stage -----------------------------------------------------------------------------------
def train_step(cfg: TrainStepConfig) -> dict:
    """Run one training step; returns the output manifest (with ``metrics``) and ``already_done`` (True:
    ``cfg.out`` held this step, nothing was trained).

    Called from a caller's ``torch.no_grad()`` or ``inference_mode()`` block (an eval helper in a
    notebook), it still trains: without this, no loss had a graph, nothing moved and the untrained
    adapter was written as done. The step seeds torch's RNG for itself; the caller's is restored after.
    """
    with torch.inference_mode(False), torch.enable_grad(), _callers_rng_kept():
        return _train_step(cfg)


@contextlib.contextmanager
def _callers_rng_kept():
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    seed = torch.initial_seed()  # what CUDA's generators start from when first used after the step
    cpu_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if cuda else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        elif torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(seed)


def _train_step(cfg: TrainStepConfig) -> dict:
    t_start = time.time()
    _check_flags(cfg)
    device = resolve_device(cfg.device)
    if cfg.deterministic and device.startswith("cuda"):
        prepare_environment()  # before CUDA starts: cuBLAS reads its workspace setting once
    _, dtype = resolve_dtype(cfg.dtype, device)
    # Under torchrun every rank joins before anything can end one alone: a rank that found its output "already
    # done" (or a bad shard) and exited left the others waiting at the process group until its timeout. The ranks
    # then compare their flags, and later their fingerprints (_joined_step).
    dist = distributed.setup(device)
    try:
        dist.agree({k: v for k, v in asdict(cfg).items() if k not in _PATH_FLAGS})
        return _joined_step(cfg, dist, device, dtype, t_start)
    finally:
        dist.close()


def _joined_step(cfg: TrainStepConfig, dist: distributed.Dist, device: str, dtype, t_start: float) -> dict:
    """The step once every torchrun rank has joined (a single process: right away)."""
    data = read_step(cfg, dist)
    _check_apart_from_shards(cfg, data)
    from qerl_cli.shards import missing_shards

    # Warnings are QerlWarnings: shown with -q (one `warning:` line from the CLI), catchable by a library caller.
    # What a rank other than 0 read of its own --shards (node-local copies) is held: said only if the ranks then
    # disagree, where it tells why (rank 0 alone speaking, "fingerprint: rank 0 ..., rank 1 ..." came without it).
    held: list[str] = []
    if missing := missing_shards(data.files):
        _warn(f"the shards name {len(missing)} more shard file(s) of this step that --shards does not "
              f"reach (first: {missing[0]}); training on the {len(data.files)} given", held)
    if data.bad_lines:
        _warn(f"skipped {len(data.bad_lines)} bad shard line(s) (--skip-bad-lines); first: {data.bad_lines[0]}", held)
    base_hash = model_hash(Path(cfg.model))
    _check_fits_model(cfg, data)
    _check_memory_fits_model(cfg)
    # Every check that needs no model runs before anything is loaded: a wrong input fails in seconds.
    from qerl_cli.adapters import adapter_hash

    state = TrainerState()
    state_file = Path(cfg.adapter) / STATE_FILE if cfg.adapter is not None else None
    who = foreign_state(state_file) if state_file is not None and state_file.exists() else None
    if state_file is not None and state_file.exists() and who is None:
        state = TrainerState.load(state_file)
    elif cfg.adapter is not None:
        why = f": its {STATE_FILE} is {who}, not qerl's" if who else f" has no {STATE_FILE}"
        if not _state_lost(cfg):  # (a qerl adapter's lost state is warned of below, after the checks)
            _say(cfg, f"note: {cfg.adapter}{why}; starting the schedule at step {data.step}")
        state.global_step = data.step
    spec = _lora_spec(cfg)
    parent_hash = adapter_hash(cfg.adapter) if cfg.adapter is not None else None
    _check_lineage(cfg, data, base_hash, parent_hash, state)
    has_norms = cfg.adapter is not None and trained_norms(cfg.adapter) is not None
    if has_norms and not cfg.train_norms:
        raise BadInputError(f"--adapter {cfg.adapter} has trained norm weights ({NORMS}); pass --train-norms")
    # of the bytes read_step parsed, not of a second read: a shard rewritten in between was fingerprinted as the new bytes
    inputs = {"model": base_hash, "shards": _shards_hash(data.file_hashes)}
    if cfg.adapter is not None:
        inputs["adapter"] = _adapter_inputs_hash(Path(cfg.adapter))
    # until 2026-11-27 the files were read, and hashed, in the order --shards named them
    as_named = list(data.files_as_named)
    hash_of = dict(zip(data.files, data.file_hashes))
    legacy_inputs = ((dict(inputs, shards=_shards_hash([hash_of[f] for f in as_named])),)
                     if as_named and as_named != data.files else ())
    out = StageOutput(Path(cfg.out), STAGE, config=cfg.fingerprint_config(spec.dropout), inputs=inputs, force=cfg.force,
                      legacy_configs=(cfg.legacy_fingerprint_config(),), legacy_inputs=legacy_inputs, started=t_start)
    done = out.already_done()
    # compared before a rank returns alone: with a node-local --out done on one node only, the others read its
    # exit as "another torchrun rank stopped mid-step (its error is in the log)", with no error in the log
    try:
        dist.agree({"already_done": done, "fingerprint": out.fingerprint})
    except QerlError:
        for msg in held:
            warnings.warn(QerlWarning(msg), stacklevel=2)
        raise
    if done:
        if dist.is_main:  # one result line (each rank printed it) and one writer of the run's metrics file
            _say(cfg, result_line(cfg.out, out.manifest, already_done=True), result=True)
            _ensure_metrics_line(cfg, out.manifest)
        return dict(out.manifest, already_done=True)
    if data.step != state.global_step:  # after the checks: not a line above an error, nor on an "already done"
        _warn(f"shards are from rollout step {data.step} but the adapter is at step {state.global_step}")
    if cfg.total_steps and state.global_step >= cfg.total_steps:  # the schedule is over: without --min-lr-ratio,
        floor = cfg.lr * cfg.min_lr_ratio                          # LR 0 wrote the input adapter back unchanged
        _warn(f"the adapter is at step {state.global_step}, past --total-steps {cfg.total_steps}: this step trains at "
              f"the schedule's floor, --min-lr-ratio x --lr = {floor:g}"
              + ("" if floor else " (the weights will not change)"))

    if _optimizer_state_lost(cfg, state):  # was a note, gone under -q and from a library caller's warnings
        _warn(f"{cfg.adapter} has no {OPTIMIZER_FILE}, though its {STATE_FILE} counts {state.optimizer_steps} optimizer "
              "step(s): AdamW's moments start from zero, so this is not the step the run would take from it "
              "(restore the file from the step that wrote it, or rerun that step)")
    if _state_lost(cfg):  # was a note, gone under -q, though the adapter this step writes forgets the run's lineage
        moments = (f", and with no {OPTIMIZER_FILE} either AdamW's moments start from zero"
                   if not (Path(cfg.adapter) / OPTIMIZER_FILE).exists() else "")
        _warn(f"{cfg.adapter} has no {STATE_FILE}, though its manifest.json says qerl's {STAGE} wrote it: the schedule "
              f"goes on at the shards' step {data.step}, but the lineage of adapters and the count of optimizer steps "
              f"start over in the adapter this step writes{moments} (restore the file from the step that wrote it, or "
              "rerun that step)")

    adv = group_advantages(data.rewards, data.group_ids, scale=cfg.scale_rewards, where=str(data.files[0]))
    if adv.zero_variance_fraction == 1.0:  # said only by `zero_variance_groups: 1.0` in the metrics (a review)
        _warn(no_signal_message(data.rewards, adv.num_groups))
    lengths = [p + c for p, c in zip(data.prompt_lengths, data.completion_lengths)]
    groups = pack_microbatches(lengths, cfg.micro_batch_tokens)
    mb_of = [0] * len(lengths)
    for j, g in enumerate(groups):
        for s in g:
            mb_of[s] = j
    live_tokens = [0 if (cfg.mask_truncated and tr) else c for c, tr in zip(data.completion_lengths, data.truncated)]
    if cfg.mask_truncated and data.records and all(data.truncated):  # said only "no completion tokens left"
        raise BadInputError(f"--mask-truncated masks every completion of this step: all {len(data.records)} "
                            "stopped at the rollout's --max-new-tokens (or the context)",
                            hint="rerun this train-step without --mask-truncated, or the rollout with a larger "
                                 "--max-new-tokens")
    seq_w = sequence_weights(cfg.loss, live_tokens, mb_of, dr_grpo_length(cfg, data))

    # Paths may differ between nodes; what they hold is in the fingerprint's input hashes.
    dist.agree({"fingerprint": out.fingerprint, "micro_batches": len(groups)})
    _keep_owned(data, groups, dist)
    if dist.enabled and device.startswith("cuda"):
        device = f"cuda:{dist.local_rank}"
    out.timings["prepare_s"] = round(time.time() - t_start, 3)  # checks, shards, hashes, advantages
    return _run(cfg, out, data, adv, groups, seq_w, live_tokens, state, dist, device, dtype, base_hash, spec,
                parent_hash)


def no_signal_message(rewards: list[float], groups: int) -> str:
    """The warning of a step whose every group has equal rewards: every advantage is 0, so it prints "loss 0, grad
    norm 0" and writes an adapter the policy gradient did not move (a user's reward scoring nothing, a reference
    in a column the rollout did not read, or too few completions a prompt to differ)."""
    values = set(rewards)
    same = f"all {len(rewards)} rewards are {values.pop():g}" if len(values) == 1 else "each group's rewards are equal"
    return (f"no learning signal: in all {groups} groups of this step {same}, so every advantage is 0 and the "
            "step learns nothing from them; check the reward (does it score these completions?), rollout's "
            "--answer-key (the column holding the reference) and --num-generations (more completions a prompt differ more)")


_PATH_FLAGS = ("model", "shards", "out", "adapter", "metrics_file", "progress")


@dataclass
class StepBatch:
    """One step's sequences, ready for the loop: micro-batch groups and per-sequence tensors."""

    groups: list[list[int]]
    prompts: list[list[int]]
    completions: list[list[int]]
    sampling_logprobs: list[list[float]]
    inv_temp: torch.Tensor  # fp32 [N]: 1 / sampling temperature
    adv: torch.Tensor       # fp32 [N]
    weight: torch.Tensor    # fp32 [N]: per-token loss weight of each sequence (0 = masked)
    cuts: torch.Tensor | None = None  # fp64 [N, 3]: top_p, top_k, min_p each was sampled with; None: no cut


@dataclass
class LoopResult:
    acc: Accumulator
    losses: list[float]
    grad_norms: list[float]
    lrs: list[float]
    kept_layers: int = 0  # decoder layers that kept their activations at the end (--keep-activations)
    keep_retries: int = 0  # micro-batches --keep-activations auto ran again after running out of memory


def _one_microbatch(cfg: TrainStepConfig, model, mb: Microbatch, j: int, epoch: int, step: int, batch: StepBatch,
                    lcfg: LossConfig, device, auto, old_lp: dict, ref_lp: dict, isw: dict):
    """Forward, loss and backward of one micro-batch: (loss, loss stats, epoch-1 stats or None), or None for a
    non-finite loss. Nothing outside ``old_lp``/``ref_lp``/``isw`` (rewritten alike) and the gradients changes
    before it returns, so ``run_epochs`` can run it again after an out-of-memory error."""
    tok_seq = mb.seq_of_token
    torch.manual_seed(_dropout_seed(cfg.seed, step, epoch, j))
    measuring = auto is not None and auto.chosen is None
    if measuring:
        auto.before_first()
    logp, ent = microbatch_logprobs(model, mb, batch.inv_temp, device, cfg.logits_chunk_tokens, batch.cuts)
    first_stats = None
    if epoch == 0:
        old_lp[j] = logp.detach()
        samp = torch.tensor([x for s in mb.seqs for x in batch.sampling_logprobs[s]], dtype=torch.float32, device=device)
        w_is, raw = tis_weights(old_lp[j], samp, cfg.tis_cap)
        isw[j] = w_is if cfg.tis_cap else None
        if cfg.beta > 0:
            with torch.no_grad(), base_policy(model):
                ref_lp[j] = microbatch_logprobs(model, mb, batch.inv_temp, device, cfg.logits_chunk_tokens, batch.cuts)[0]
        live = (batch.weight[tok_seq] > 0).to(device)
        n_live = float(live.sum())
        if n_live:
            diff = (old_lp[j] - samp)[live].abs()
            r = raw[live]
            first_stats = (n_live, float(ent[live].sum()), (float(r.sum()), float(r.min()), float(r.max())),
                           float((r > cfg.tis_cap).sum()) if cfg.tis_cap else 0.0, (float(diff.sum()), float(diff.max())))
    adv_t = batch.adv[tok_seq].to(device)
    w_t = batch.weight[tok_seq].to(device)
    loss, _, st = policy_loss(logp, old_lp[j], adv_t, w_t, lcfg, is_weight=isw.get(j), ref_logp=ref_lp.get(j))
    if not torch.isfinite(loss):
        return None
    if loss.requires_grad:  # a micro-batch of empty completions only has no graph (nor gradient)
        loss.backward()
    if measuring and loss.requires_grad:  # a micro-batch without a backward has no peak to size by: the next one
        auto.after_first(mb.padded_tokens)
    return float(loss.detach()), st, first_stats


def run_epochs(cfg: TrainStepConfig, model, params: list[torch.Tensor], opt, batch: StepBatch, *, dist=None,
               device="cpu", step: int = 0) -> LoopResult:
    """The optimisation itself: ``cfg.epochs`` AdamW steps over the micro-batches this rank owns.

    Shared by the stage and ``benchmarks/bench_train.py`` (which feeds a random model), so the
    benchmark times exactly this code. Raises NumericalError / OutOfMemoryError (nothing written).
    """
    dist = dist or distributed.Dist()
    cuda = str(device).startswith("cuda")
    groups = batch.groups
    lcfg = LossConfig(cfg.loss, cfg.clip_eps, cfg.clip_eps_high, cfg.beta, cfg.tis_cap)
    owned = [j for j in range(len(groups)) if dist.owns(j)]
    mbs = {j: collate(j, groups[j], batch.prompts, batch.completions) for j in owned}
    old_lp: dict[int, torch.Tensor] = {}
    ref_lp: dict[int, torch.Tensor] = {}
    isw: dict[int, torch.Tensor] = {}
    acc = Accumulator()
    losses_per_epoch, grad_norms, lrs = [], [], []
    progress = _progress(cfg, dist, len(owned) * cfg.epochs)
    auto = None
    who = f"rank {dist.rank}: " if dist.enabled else ""  # each rank measures and chooses for itself
    if cfg.keep_activations == "auto" and cuda and model.gradient_checkpointing and owned:
        auto = AutoKeep(model, torch.device(device), max(mbs[j].padded_tokens for j in owned), params)
    try:
        for epoch in range(cfg.epochs):
            lr = lr_at(step + epoch / cfg.epochs, cfg.lr, cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio)
            set_lr(opt, lr)
            lrs.append(lr)
            opt.zero_grad()
            epoch_loss = torch.zeros((), dtype=torch.float64)
            bad_mb = -1
            for j in owned:
                while True:  # once, or again with fewer layers kept when auto's estimate ran out of memory
                    retry = auto is not None and (model.keep_activations or auto.chosen is None)
                    saved = auto.save_grads() if retry else None
                    try:
                        res = _one_microbatch(cfg, model, mbs[j], j, epoch, step, batch, lcfg, device, auto,
                                              old_lp, ref_lp, isw)
                        break
                    except torch.OutOfMemoryError:
                        if saved is None:
                            raise
                    # outside the except: the failed graph's tensors are freed with the traceback
                    _say(cfg, who + auto.retry_with_fewer(saved), every_rank=True)
                if res is None:  # non-finite loss
                    bad_mb = j
                    break
                loss_value, st, first_stats = res
                if first_stats is not None:
                    n_live, entropy, raw, is_capped, diff_abs = first_stats
                    acc.add(tokens=n_live, entropy=entropy, is_ratio=raw[0], is_capped=is_capped, lp_abs_diff=diff_abs[0])
                    acc.min(is_ratio=raw[1])
                    acc.max(is_ratio=raw[2], lp_abs_diff=diff_abs[1])
                if auto is not None and auto.note and not auto.said:
                    _say(cfg, who + auto.note, every_rank=True)
                    auto.said = True
                epoch_loss += loss_value
                # Clipping can only happen from epoch 2 on (epoch 1 is on-policy: ratio 1), so clip
                # fractions count every epoch's tokens; the KL is that of the pre-update policy.
                acc.add(clip_low=st.clip_low, clip_high=st.clip_high, clip_tokens=st.tokens)
                if epoch == 0:
                    acc.add(kl=st.kl)
                progress.advance()
            flag = torch.tensor([float(bad_mb)], dtype=torch.float64)
            flag = dist.all_reduce_(flag.to(device) if cuda and dist.enabled else flag, "max")
            if float(flag) >= 0:
                raise NumericalError(f"non-finite loss at step {step} (epoch {epoch + 1}), micro-batch {int(float(flag))}",
                                     hint="lower --lr or check the shard's rewards/log-probs; nothing was written")
            loss_t = epoch_loss.to(device) if cuda and dist.enabled else epoch_loss
            losses_per_epoch.append(float(dist.all_reduce_(loss_t)))
            dist.all_reduce_grads_(params)
            gn = grad_norm_and_clip(params, cfg.max_grad_norm)
            if not math.isfinite(gn):
                raise NumericalError(f"non-finite gradient norm at step {step} (epoch {epoch + 1})",
                                     hint="lower --lr; nothing was written")
            grad_norms.append(gn)
            opt.step()
    except torch.OutOfMemoryError:
        biggest = max((mbs[j].padded_tokens for j in owned), default=0)
        kept = model.keep_activations if model.gradient_checkpointing else 0
        layers = f"{kept} layer{'s' * (kept != 1)}"
        keep_hint = (f"--keep-activations N below the {layers} kept now (0 recomputes them all), " if kept else "")
        raise OutOfMemoryError(
            f"out of GPU memory in a training micro-batch on {device} (largest has {biggest} padded tokens"
            + (f"; {layers} kept {'their' if kept != 1 else 'its'} activations" if kept else "") + ")",
            hint=f"{keep_hint}lower --micro-batch-tokens (now {cfg.micro_batch_tokens}) or --logits-chunk-tokens, or pass "
                 "--offload-activations / --embeddings-on-cpu") from None
    finally:
        progress.stop()
    kept = getattr(model, "keep_activations", 0) if getattr(model, "gradient_checkpointing", False) else 0
    return LoopResult(acc, losses_per_epoch, grad_norms, lrs, kept, auto.retries if auto is not None else 0)


def _optimizer_state_lost(cfg: TrainStepConfig, state: TrainerState) -> bool:
    """Whether --adapter is qerl's, past an optimizer step, without its AdamW moments (pruned to free space, copied
    in part): a step from it is not the run's. An adapter from elsewhere (no qerl state) starts them at zero by design."""
    return cfg.adapter is not None and state.optimizer_steps > 0 and not (Path(cfg.adapter) / OPTIMIZER_FILE).exists()


def _state_lost(cfg: TrainStepConfig) -> bool:
    """Whether --adapter is a qerl train-step's output (its manifest.json says so) without its trainer_state.json
    (copied in part, pruned): the step trains to the same weights, but what the run recorded of its adapters (the
    lineage, the optimizer steps) starts over. An adapter from elsewhere has no such record to lose."""
    from qerl_cli.outputs import read_manifest

    return (cfg.adapter is not None and not (Path(cfg.adapter) / STATE_FILE).exists()
            and (read_manifest(Path(cfg.adapter)) or {}).get("stage") == STAGE)


def _run(cfg, out, data: StepData, adv, groups, seq_w, live_tokens, state: TrainerState, dist, device, dtype, base_hash,
         spec, parent_hash):
    from qerl_cli.aqn import apply_noise, clear_noise

    t_start = time.time()
    cuda = device.startswith("cuda")
    if cuda:
        # A fresh process (a torchrun rank) has no CUDA allocator yet: resetting its stats then
        # raises "Invalid device argument", so initialise CUDA first.
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        model = _load(cfg, spec, device, dtype)
    except torch.OutOfMemoryError:
        raise OutOfMemoryError(f"out of GPU memory loading {cfg.model} on {device}",
                               hint="the base model alone does not fit this GPU") from None
    named = _trainable(model, cfg.train_norms)  # an adapter's trained norms came with it (load_model)
    if cfg.train_norms and cfg.adapter is not None and (norms_file := trained_norms(cfg.adapter)):
        # load_model rounded them to the model dtype; the fp32 masters continue from the saved fp32 values
        # (in bf16 a step's lr-sized change was rounded away at every reload: the norms never trained).
        load_norms(model, norms_file)
    params = [p for _, p in named]
    if data.noise is not None:
        rec = apply_noise(model, float(data.noise["sigma"]), int(data.noise["seed"]), int(data.noise["step"]),
                          rounded_to=data.noise.get("rounded_to"))
        if data.noise.get("norms") and list(data.noise["norms"]) != list(rec["norms"]):
            raise BadInputError(f"{data.files[0]}: noise was applied to norms {data.noise['norms']}, this qerl noises {rec['norms']}")
    else:
        clear_noise(model)
    for note in apply_memory_options(cfg, model, device):
        _say(cfg, note)
    model.train()

    opt = make_optimizer(named, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                         weight_decay=cfg.weight_decay)
    if cfg.adapter is not None and (Path(cfg.adapter) / OPTIMIZER_FILE).exists():
        load_optimizer(opt, Path(cfg.adapter) / OPTIMIZER_FILE)
    elif cfg.adapter is not None and not _optimizer_state_lost(cfg, state) and not _state_lost(cfg):  # (lost: warned)
        _say(cfg, f"note: {cfg.adapter} has no {OPTIMIZER_FILE}; AdamW moments start from zero")
    if state.rng:
        restore_rng(state.rng)
    else:
        torch.manual_seed(cfg.seed)
    # Saved for the next step as it stands here, the same on every rank: after the step it is the state
    # of each rank's own last micro-batch (every micro-batch reseeds), so trainer_state.json, and the
    # next step's fingerprint, depended on the number of GPUs (audit, 2026-11-26).
    rng_state = capture_rng(cfg.seed)

    batch = StepBatch(
        groups=groups, prompts=data.prompts, completions=data.completions, sampling_logprobs=data.sampling_logprobs,
        inv_temp=torch.tensor([1.0 / t for t in data.temperatures], dtype=torch.float32),
        adv=adv.values, weight=seq_w.to(torch.float32),  # weight already 0 for masked sequences
        cuts=None if data.cuts is None else torch.tensor(data.cuts, dtype=torch.float64))
    step = state.global_step
    load_time = time.time() - t_start
    t_loop = time.time()
    with deterministic_algorithms(cfg.deterministic):
        res = run_epochs(cfg, model, params, opt, batch, dist=dist, device=device, step=step)
    acc, losses_per_epoch, grad_norms, lrs = res.acc, res.losses, res.grad_norms, res.lrs
    if cuda:
        torch.cuda.synchronize(device)
    step_time = time.time() - t_loop

    keys = {"sum": ["tokens", "entropy", "is_ratio", "is_capped", "lp_abs_diff", "clip_low", "clip_high", "clip_tokens",
                    "kl"],
            "min": ["is_ratio"], "max": ["is_ratio", "lp_abs_diff"]}
    acc.reduce(dist, keys)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    if dist.enabled and cuda:
        t = torch.tensor([peak], device=device)
        peak = float(dist.all_reduce_(t, "max"))
    metrics = _metrics(cfg, data, adv, groups, live_tokens, acc, losses_per_epoch, grad_norms, lrs, step_time, peak, step)
    metrics["load_time_s"] = round(load_time, 3)
    out.timings.update(load_s=round(load_time, 3), step_s=round(step_time, 3))

    new_state = TrainerState(
        global_step=step + 1,
        optimizer_steps=state.optimizer_steps + cfg.epochs,
        base_model_hash=base_hash,
        lineage=state.lineage + ([parent_hash] if parent_hash else []),
        schedule={"position": step + 1, "lr": cfg.lr, "last_lr": lrs[-1], "warmup_steps": cfg.warmup_steps,
                  "total_steps": cfg.total_steps, "min_lr_ratio": cfg.min_lr_ratio, "epochs": cfg.epochs},
        rng=rng_state,
        lora={"r": spec.r, "alpha": spec.alpha, "dropout": spec.dropout, "targets": list(spec.targets),
              "train_norms": cfg.train_norms},
        # resolved: as --shards spelled them (a relative path, another cwd), one step's redo wrote another
        # trainer_state.json, and the next step, whose input hash holds that file, said "input adapter changed"
        last_shards=[str(f.resolve()) for f in data.files],
    )
    manifest, failure = None, None
    if dist.is_main:
        try:
            out.extra["metrics"] = metrics
            # how this rank ran, not what it computed (the same bits for any count): next to the timings
            out.extra["keep_activations"] = {"asked": cfg.keep_activations, "kept": res.kept_layers,
                                             "retries": res.keep_retries}
            out.extra["deterministic"] = cfg.deterministic
            with out as work:
                _write_outputs(work, cfg, model, opt, new_state, named, metrics)
            manifest = out.manifest
            if cfg.metrics_file is not None:
                _append_metrics(Path(cfg.metrics_file), metrics)
            _say(cfg, result_line(cfg.out, manifest), result=True)
        except BaseException as e:  # noqa: BLE001 - re-raised by main_outcome, after the other ranks hear of it
            failure = e
    dist.main_outcome(failure, device)
    return dict(manifest if manifest is not None else {"metrics": metrics}, already_done=False)


def _write_outputs(work: Path, cfg, model, opt, state: TrainerState, named, metrics) -> None:
    from qerl_cli.adapters import save_adapter
    from qerl_cli.checkpoint.safetensors_io import save_small

    # Absolute: PEFT's AutoPeftModel resolves a relative base against its own working directory, so an
    # adapter trained as --model runs/x/base could not find its base from anywhere else (a trial).
    save_adapter(model, work, base_model_path=str(Path(cfg.model).resolve()))
    save_optimizer(opt, work / OPTIMIZER_FILE)
    if cfg.train_norms:
        norms = {n: p.detach().float().cpu().contiguous() for n, p in named if ".lora_" not in n}
        save_small(norms, work / NORMS)
    state.save(work / STATE_FILE)
    append_jsonl(work / METRICS_FILE, metrics)


