"""`qerl train-step`: flags -> TrainStepConfig -> qerl_cli.train_step.train_step."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

SHORT = "One GRPO/DAPO step: rollout shards -> next LoRA adapter + optimizer state."
HELP = SHORT + """

Reads one step's rollout shards, computes group advantages, recomputes the completion log-probs
on the frozen NVFP4 base (+ LoRA, + the rollout's AQN noise), and takes one AdamW step per epoch
on the LoRA weights with a PPO-clipped, importance-corrected (TIS) policy-gradient loss. Writes a
PEFT adapter (adapter_config.json + adapter_model.safetensors), optimizer.safetensors,
trainer_state.json and metrics.jsonl atomically to --out.

Example (first step, fresh adapter):

  qerl train-step --model qwen-nvfp4 --shards rollouts/step-0 --out adapters/step-1

Next step, 2 GPUs:

  torchrun --nproc-per-node 2 -m qerl_cli train-step --model qwen-nvfp4 --adapter adapters/step-1 \\
      --shards rollouts/step-1 --out adapters/step-2 --metrics-file run/metrics.jsonl

16-bit LoRA baseline: pass a plain bf16 Hugging Face directory as --model (add --baseline bf16 to
make qerl check that it is not quantized).
"""


def command(
    model: Annotated[Path, typer.Option("--model", help="Base model dir: qerl NVFP4 QDIR, or a plain HF dir (16-bit baseline). Example: --model qwen-nvfp4")],
    shards: Annotated[list[str], typer.Option("--shards", metavar="DIR|FILE|GLOB", help="Rollout shard dir, file or glob; repeat for several. Example: --shards rollouts/step-3")],
    out: Annotated[Path, typer.Option("--out", help="Output adapter dir (written atomically). Example: --out adapters/step-4")],
    adapter: Annotated[Path | None, typer.Option("--adapter", help="Adapter dir to continue (the one the rollout used); omit at step 0 for a fresh adapter (seeded init, B = 0). Example: --adapter runs/x/step-000003/adapter")] = None,
    loss: Annotated[str, typer.Option("--loss", rich_help_panel="Algorithm", help="grpo (per-sequence mean) | dapo (token mean over the step) | dr_grpo (divide by max completion length; Dr. GRPO also wants --scale-rewards none) | bnpo (token mean per micro-batch). Example: --loss grpo")] = "dapo",
    scale_rewards: Annotated[str, typer.Option("--scale-rewards", rich_help_panel="Algorithm", help="Divide reward - group mean by the group's std (group), the step's std (batch) or nothing (none). Example: --scale-rewards batch")] = "group",
    clip_eps: Annotated[float, typer.Option("--clip-eps", rich_help_panel="Algorithm", help="PPO clip range below 1: ratio >= 1 - eps. Example: --clip-eps 0.2")] = 0.2,
    clip_eps_high: Annotated[float, typer.Option("--clip-eps-high", rich_help_panel="Algorithm", help="PPO clip range above 1 (DAPO clip-higher): ratio <= 1 + eps_high. Example: --clip-eps-high 0.28")] = 0.28,
    beta: Annotated[float, typer.Option("--beta", rich_help_panel="Algorithm", help="KL penalty to the base policy (the same model with LoRA off; k3 estimator). 0 disables. Example: --beta 0.04")] = 0.0,
    tis_cap: Annotated[float, typer.Option("--tis-cap", rich_help_panel="Algorithm", help="Cap of the truncated importance weight exp(train logprob - sampling logprob); 0 disables TIS. Example: --tis-cap 2.0")] = 2.0,
    mask_truncated: Annotated[bool, typer.Option("--mask-truncated", rich_help_panel="Algorithm", help="Drop completions that hit the length limit (finish_reason=length) from the loss.")] = False,
    max_completion_length: Annotated[int | None, typer.Option("--max-completion-length", rich_help_panel="Algorithm", help="dr_grpo's constant divisor; default: the rollout's --max-new-tokens (recorded in the shards). Example: --max-completion-length 2048")] = None,
    epochs: Annotated[int, typer.Option("--epochs", rich_help_panel="Algorithm", help="Optimizer steps over the same shards (PPO mu); epochs > 1 use epoch 1's log-probs as the old policy. Example: --epochs 2")] = 1,
    lr: Annotated[float, typer.Option("--lr", rich_help_panel="Optimizer", help="Peak learning rate (the paper: 1e-5 for NVFP4, ~5e-6 for bf16 LoRA). Example: --lr 3e-5")] = 1e-5,
    warmup_steps: Annotated[int, typer.Option("--warmup-steps", rich_help_panel="Optimizer", help="Linear warmup length in RL steps (the paper: 10% of --total-steps). Example: --warmup-steps 10")] = 0,
    total_steps: Annotated[int | None, typer.Option("--total-steps", rich_help_panel="Optimizer", help="Run length in RL steps for the cosine decay; omit for a constant LR after warmup. Example: --total-steps 500")] = None,
    min_lr_ratio: Annotated[float, typer.Option("--min-lr-ratio", rich_help_panel="Optimizer", help="LR at the end of the cosine, as a fraction of --lr. Example: --min-lr-ratio 0.1")] = 0.0,
    weight_decay: Annotated[float, typer.Option("--weight-decay", rich_help_panel="Optimizer", help="AdamW weight decay on the LoRA matrices. Example: --weight-decay 0.0")] = 0.1,
    adam_beta1: Annotated[float, typer.Option("--adam-beta1", rich_help_panel="Optimizer", help="AdamW beta1. Example: --adam-beta1 0.9")] = 0.9,
    adam_beta2: Annotated[float, typer.Option("--adam-beta2", rich_help_panel="Optimizer", help="AdamW beta2. Example: --adam-beta2 0.999")] = 0.99,
    max_grad_norm: Annotated[float, typer.Option("--max-grad-norm", rich_help_panel="Optimizer", help="Clip the global grad norm to this (0 disables; the paper: 0.2). Example: --max-grad-norm 1.0")] = 0.2,
    lora_rank: Annotated[int | None, typer.Option("--lora-rank", rich_help_panel="LoRA", help="LoRA rank r for a fresh adapter (default 16); must match --adapter if given. Example: --lora-rank 32")] = None,
    lora_alpha: Annotated[float | None, typer.Option("--lora-alpha", rich_help_panel="LoRA", help="LoRA alpha (scaling alpha/r) for a fresh adapter (default 16). Example: --lora-alpha 64")] = None,
    lora_dropout: Annotated[float | None, typer.Option("--lora-dropout", rich_help_panel="LoRA", help="Dropout on the LoRA input (default 0, or the adapter's). Example: --lora-dropout 0.05")] = None,
    lora_targets: Annotated[list[str] | None, typer.Option("--lora-targets", metavar="NAMES", rich_help_panel="LoRA", help="Linear names to adapt, comma-separated or repeated (default: all seven, q_proj k_proj v_proj o_proj gate_proj up_proj down_proj). Example: --lora-targets q_proj,v_proj")] = None,
    train_norms: Annotated[bool, typer.Option("--train-norms", rich_help_panel="LoRA", help="Also train the RMSNorm weights (fp32 master, no weight decay; saved as norms.safetensors, which rollout, eval and merge apply with the adapter; --engine vllm cannot).")] = False,
    micro_batch_tokens: Annotated[int, typer.Option("--micro-batch-tokens", rich_help_panel="Memory and devices", help="Padded tokens (rows x longest) per micro-batch; lower it on out-of-memory. Example: --micro-batch-tokens 8192")] = 16384,
    logits_chunk_tokens: Annotated[int, typer.Option("--logits-chunk-tokens", rich_help_panel="Memory and devices", help="Tokens per fp32 logits chunk (memory: one chunk x vocab x 4 bytes buffer, with the lm_head's bf16 output beside it while it is made). Example: --logits-chunk-tokens 1024")] = 2048,
    no_checkpointing: Annotated[bool, typer.Option("--no-checkpointing", rich_help_panel="Memory and devices", help="Turn off gradient checkpointing (on by default: each decoder layer is recomputed in backward, much less activation memory for one extra forward of time).")] = False,
    keep_activations: Annotated[str, typer.Option("--keep-activations", metavar="N|auto", rich_help_panel="Memory and devices", help="Under gradient checkpointing, the last N decoder layers keep their activations for the backward instead of recomputing them: each saves one layer's forward per micro-batch and costs that layer's activations in GPU memory (7B at 8192 tokens: ~1.1 GiB a layer; all 28 kept made the step 1.4x faster). auto: as many as fit, measured on the first micro-batch (a micro-batch that runs out of memory runs again with half as many; no effect on CPU). Needs gradient checkpointing. Same gradients bit for bit. Default 0 recomputes every layer. Example: --keep-activations auto")] = "0",
    offload_activations: Annotated[bool, typer.Option("--offload-activations", rich_help_panel="Memory and devices", help="Keep each decoder layer's checkpointed input (one \\[tokens, hidden] tensor per layer) in pinned CPU memory until the backward needs it: copied out and back on a side CUDA stream, the next one prefetched, so it mostly overlaps compute. Same gradients bit for bit, less GPU memory; needs gradient checkpointing; no effect on CPU.")] = False,
    embeddings_on_cpu: Annotated[bool, typer.Option("--embeddings-on-cpu", rich_help_panel="Memory and devices", help="Keep the frozen input embedding table in CPU memory (vocab x hidden x 2 bytes: 1.1 GB on a 7B model) and copy only each micro-batch's gathered rows to the GPU; the lm_head stays on the GPU. Same results bit for bit. Refused (exit 2) for models with tied embeddings, whose lm_head needs the table on the GPU; no effect on CPU.")] = False,
    deterministic: Annotated[bool, typer.Option("--deterministic", rich_help_panel="Run", help="Same bytes from a rerun of the step on the same GPU and software: runs the loop under PyTorch's deterministic algorithms (attention's backward then uses flash attention's deterministic kernel instead of cuDNN's, whose gradients can vary in the last bits between runs). Costs 8-14% more step time on an H100 (docs/train-step.md). An op without a deterministic kernel stops the step (exit 2) with its name. On a GPU it sets CUBLAS_WORKSPACE_CONFIG=:4096:8 unless that is :4096:8 or :16:8 already (another value is refused). On CPU, runs are reproducible without it.")] = False,
    device: Annotated[str, typer.Option("--device", rich_help_panel="Memory and devices", help="auto | cpu | cuda[:N] (under torchrun each rank uses cuda:LOCAL_RANK). Example: --device cuda:1")] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", rich_help_panel="Memory and devices", help="Compute dtype: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp16 | fp32. LoRA masters and AdamW states are fp32 regardless. Example: --dtype fp32")] = "auto",
    baseline: Annotated[str | None, typer.Option("--baseline", rich_help_panel="Run", help="bf16: check --model is a plain 16-bit HF dir (the 16-bit LoRA comparison run). Example: --baseline bf16")] = None,
    seed: Annotated[int, typer.Option("--seed", rich_help_panel="Run", help="Seeds the fresh adapter's init and the LoRA dropout masks. Example: --seed 1")] = 0,
    skip_bad_lines: Annotated[bool, typer.Option("--skip-bad-lines", rich_help_panel="Run", help="Skip unparseable shard lines instead of stopping.")] = False,
    metrics_file: Annotated[Path | None, typer.Option("--metrics-file", rich_help_panel="Run", help="Also append this step's metrics line here (one file for the whole run, one line per step: a redone step replaces its line). Example: --metrics-file run/metrics.jsonl")] = None,
    force: Annotated[bool, typer.Option("--force", rich_help_panel="Run", help="Redo the step even if --out already holds it / holds something else.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", rich_help_panel="Run", help="No progress bar or notes; print only the result line (and warnings, on stderr).")] = False,
) -> None:
    from qerl_cli.train.distributed import main_by_environment
    from qerl_cli.train_step import TrainStepConfig, result_line, train_step

    targets = None
    if lora_targets is not None:  # repeated and comma-joined alike; "" or "," names nothing: refused
        targets = tuple(t.strip() for spec in lora_targets for t in spec.split(",") if t.strip())
        if not targets:
            from qerl_cli.errors import BadInputError

            raise BadInputError(f"--lora-targets {','.join(lora_targets)!r} names no Linear",
                                hint="omit it for all seven")
    keep = keep_activations.strip().lower()
    if keep != "auto":
        try:
            keep = int(keep)
        except ValueError:
            from qerl_cli.errors import BadInputError

            raise BadInputError(f"--keep-activations must be a whole number >= 0 or auto, got {keep_activations!r}") from None
    cfg = TrainStepConfig(
        model=model, shards=list(shards), out=out, adapter=adapter, loss=loss, scale_rewards=scale_rewards,
        clip_eps=clip_eps, clip_eps_high=clip_eps_high, beta=beta, tis_cap=tis_cap, mask_truncated=mask_truncated,
        max_completion_length=max_completion_length, epochs=epochs, lr=lr, warmup_steps=warmup_steps,
        total_steps=total_steps, min_lr_ratio=min_lr_ratio, weight_decay=weight_decay, adam_beta1=adam_beta1,
        adam_beta2=adam_beta2, max_grad_norm=max_grad_norm, lora_rank=lora_rank, lora_alpha=lora_alpha,
        lora_dropout=lora_dropout, lora_targets=targets, train_norms=train_norms,
        micro_batch_tokens=micro_batch_tokens, logits_chunk_tokens=logits_chunk_tokens,
        gradient_checkpointing=not no_checkpointing, keep_activations=keep,
        offload_activations=offload_activations,
        embeddings_on_cpu=embeddings_on_cpu, deterministic=deterministic, device=device,
        dtype=dtype, baseline=baseline, seed=seed, skip_bad_lines=skip_bad_lines, metrics_file=metrics_file, force=force, progress=not quiet,
    )
    res = train_step(cfg)
    if quiet and main_by_environment() and (res.get("already_done") or "stage" in res):
        # -q drops the progress bar and notes, not the result (train_step prints it itself otherwise)
        print(result_line(out, res, already_done=res.get("already_done", False)))
