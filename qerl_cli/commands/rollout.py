"""`qerl rollout`: flags -> RolloutConfig -> qerl_cli.rollout.rollout."""

from __future__ import annotations

from pathlib import Path

import typer

SHORT = "Generate G completions per prompt, score them, write JSONL rollout shards."
HELP = (
    SHORT + "\n\n"
    "Loads the NVFP4 (or bf16) base with an optional LoRA adapter, sets the AQN noise of this --step, samples "
    "--num-generations completions per prompt with per-token log-probabilities, scores them with the named "
    "rewards and writes shard-I-of-N.jsonl records (fields: docs/rollout.md) plus manifest.json to --out. "
    "Resumable: rerun the same command after a crash and it continues with the prompts whose groups are "
    "missing; rerun it after success and it says 'already done'.\n\n"
    "Examples:\n\n"
    "  qerl rollout --model runs/q/qwen-nvfp4 --prompts gsm8k_train.jsonl --out runs/r/step-0000 "
    "--num-generations 8 --reward gsm8k --reward format=0.1\n\n"
    "  # step 12 of a 100-step run, AQN on, shard 3 of an 8-job Slurm array (each shard into its own --out;\n"
    "  # train-step --shards 'runs/r/step-0012-shard-*' reads them all):\n\n"
    "  qerl rollout --model Q --adapter runs/a/step-0011 --prompts train.jsonl --out runs/r/step-0012-shard-3 "
    "--step 12 --prompts-per-step 64 --aqn-sigma-start 1e-2 --aqn-sigma-end 1e-4 --aqn-stages 10 "
    "--total-steps 100 --shard-index 3 --num-shards 8"
)


def command(
    model: Path = typer.Option(..., "--model", help="Base model dir: qerl/compressed-tensors NVFP4 QDIR or a plain "
                               "bf16 Hugging Face dir (16-bit LoRA baseline). Example: --model runs/q/qwen-nvfp4"),
    prompts: Path = typer.Option(..., "--prompts", help="Prompt file: .jsonl/.json/.parquet rows with `prompt` or "
                                 "`messages`, optional `answer`, `id` (GSM8K `question` and MATH `problem` rows work too). "
                                 "Example: --prompts data/gsm8k_train.jsonl"),
    out: Path = typer.Option(..., "--out", help="Output shard dir (shard-I-of-N.jsonl + manifest.json), written "
                             "atomically. Example: --out runs/r/step-0003"),
    adapter: Path | None = typer.Option(None, "--adapter", help="PEFT LoRA adapter dir to roll out with (none: the "
                                           "base policy). Refused if trained on another base. Example: --adapter runs/a/step-0002"),
    num_generations: int = typer.Option(8, "--num-generations", "-G", help="Completions per prompt (the GRPO group). Example: -G 16"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Most tokens per completion. Example: --max-new-tokens 1024"),
    temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature; 0 = greedy. Example: --temperature 0.7"),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]; 1 = off. Example: --top-p 0.95"),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens; 0 = off. Example: --top-k 50"),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min_p x the top probability; 0 = off. Example: --min-p 0.05"),
    stop: list[str] = typer.Option([], "--stop", metavar="TEXT", help="Stop string (repeatable); EOS always stops. A newline in it needs the shell's $'...' quoting. Example: --stop $'\\nQ:'"),
    reward: list[str] = typer.Option(["gsm8k"], "--reward", metavar="NAME[=WEIGHT]", help="Reward NAME[=WEIGHT], repeatable or comma separated; reward = weighted sum. "
                                     "Built-in: gsm8k, math, format; your own: module:function or file.py:function, "
                                     "f(completion, answer) -> float or TRL's f(completions, **kwargs) -> list (per prompt group; "
                                     "passed the row's other columns, e.g. solution, by name). "
                                     "A value that is one file.py:function[=WEIGHT] whose file exists is taken whole, "
                                     "commas in its path and all. Example: --reward gsm8k --reward format=0.1"),
    step: int = typer.Option(0, "--step", help="RL step k: selects the AQN sigma and, with --prompts-per-step, the prompt slice. Example: --step 12"),
    prompts_per_step: int | None = typer.Option(None, "--prompts-per-step", help="Prompts per step: step k uses rows "
                                                   "[k*P, (k+1)*P), wrapping around the dataset (default: all). Example: --prompts-per-step 64"),
    shuffle: bool = typer.Option(False, "--shuffle/--no-shuffle", help="With --prompts-per-step: reshuffle the dataset each epoch (seeded by --run-seed)."),
    max_prompts: int | None = typer.Option(None, "--max-prompts", help="Use only the first N rows of --prompts. Example: --max-prompts 32"),
    aqn_sigma_start: float = typer.Option(0.0, "--aqn-sigma-start", help="AQN noise std of the first noisy stage; 0 = AQN off. Example: --aqn-sigma-start 1e-2"),
    aqn_sigma_end: float = typer.Option(0.0, "--aqn-sigma-end", help="AQN noise std of the last stage. Example: --aqn-sigma-end 1e-4"),
    aqn_stages: int = typer.Option(10, "--aqn-stages", help="Noisy stages K (the run is split into K+1 intervals; the first is noise-free). Example: --aqn-stages 10"),
    total_steps: int | None = typer.Option(None, "--total-steps", help="Steps of the whole run (needed with AQN). Example: --total-steps 100"),
    run_seed: int = typer.Option(0, "--run-seed", help="Seed of the run's AQN noise vectors and --shuffle; recorded in each record's noise, from which train-step rebuilds the same vectors. Example: --run-seed 1"),
    seed: int = typer.Option(0, "--seed", help="Sampling seed; each prompt derives its own from it (recorded per record), so reruns and other batchings reproduce. Example: --seed 3"),
    shard_index: int = typer.Option(0, "--shard-index", help="Which shard this job writes, 0-based (e.g. $SLURM_ARRAY_TASK_ID). Example: --shard-index 3"),
    num_shards: int = typer.Option(1, "--num-shards", help="Number of parallel shards; prompts are dealt round robin. Example: --num-shards 8"),
    engine: str = typer.Option("native", "--engine", help="native (qerl's engine, same kernels and noise as training) or "
                               "vllm (needs the extra: pip install 'qerl\\[vllm]'). Example: --engine vllm"),
    device: str = typer.Option("auto", "--device", help="auto (cuda if present), cpu, cuda or cuda:N. Example: --device cuda:1"),
    dtype: str = typer.Option("auto", "--dtype", help="Activation dtype: auto (bf16 on cuda, fp32 on cpu), bf16, fp16, fp32. Example: --dtype bf16"),
    prompt_key: str | None = typer.Option(None, "--prompt-key", help="Column holding the prompt (text or chat list) when it "
                                          "is not `prompt`, `messages`, `question` or `problem`; dotted for nested fields. Example: --prompt-key input"),
    answer_key: str | None = typer.Option(None, "--answer-key", help="Column holding the reference when it is not `answer`; "
                                          "dotted for nested fields. Example: --answer-key reward_model.ground_truth"),
    prompt_template: str | None = typer.Option(None, "--prompt-template", help="Wrap each prompt: a string with "
                                                  "{prompt}, or a file holding one. Example: --prompt-template $'Solve: {prompt}\\nEnd with #### N.'"),
    system_prompt: str | None = typer.Option(None, "--system-prompt", help="System message added when the chat template is used. Example: --system-prompt 'Think step by step.'"),
    chat_template: bool | None = typer.Option(None, "--chat-template/--no-chat-template", help="Apply the tokenizer's chat template (default: when it has one)."),
    chat_template_file: Path = typer.Option(None, "--chat-template-file", help="A Jinja chat template to use instead of the tokenizer's (a base model often has none, and `messages` rows need one); its text is part of the run's inputs. Example: --chat-template-file chatml.jinja"),
    chat_template_kwargs: str | None = typer.Option(None, "--chat-template-kwargs", metavar="JSON", help="Extra variables for the chat template, a JSON object passed to it as vLLM's chat_template_kwargs are; each must be a variable the template reads (a misspelt one is an error, not ignored), and they are part of the run's fingerprint. Example: --chat-template-kwargs '{\"enable_thinking\": false}' (Qwen3 without thinking)", show_default=False),
    max_model_len: int | None = typer.Option(None, "--max-model-len", help="Context length (default and at most: the "
                                                "model's max_position_embeddings - 1, what the engine serves); prompts must "
                                                "fit in it. Example: --max-model-len 4096"),
    long_prompts: str = typer.Option("skip", "--long-prompts", help="Prompts longer than the context: skip (counted in the summary) or error. Example: --long-prompts error"),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", help="Sequences decoded concurrently (engine batch). Example: --max-num-seqs 64"),
    batch_prompts: int | None = typer.Option(None, "--batch-prompts", help="Prompts per generation batch, the unit a crash "
                                                "can lose (default 4*max-num-seqs/G). Each prompt is seeded by itself, so it changes no sample. Example: --batch-prompts 32"),
    skip_bad_lines: bool = typer.Option(False, "--skip-bad-lines", help="Skip (and count) malformed rows of --prompts instead of failing."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out made from other inputs or flags."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or table; print only the result line."),
) -> None:
    from rich.console import Console

    from qerl_cli.rollout import RolloutConfig, rollout, summary_table

    cfg = RolloutConfig(
        model=model, prompts=prompts, out=out, adapter=adapter, num_generations=num_generations,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        stop=tuple(stop), rewards=tuple(reward), step=step, aqn_sigma_start=aqn_sigma_start,
        aqn_sigma_end=aqn_sigma_end, aqn_stages=aqn_stages, total_steps=total_steps, run_seed=run_seed,
        shard_index=shard_index, num_shards=num_shards, engine=engine, seed=seed, device=device, dtype=dtype,
        max_prompts=max_prompts, prompts_per_step=prompts_per_step, shuffle=shuffle, skip_bad_lines=skip_bad_lines,
        prompt_key=prompt_key, answer_key=answer_key, prompt_template=prompt_template, system_prompt=system_prompt, chat_template=chat_template, chat_template_file=chat_template_file,
        chat_template_kwargs=chat_template_kwargs,
        max_model_len=max_model_len, long_prompts=long_prompts, max_num_seqs=max_num_seqs,
        batch_prompts=batch_prompts, force=force, progress=not quiet,
    )
    try:
        res = rollout(cfg)
    except KeyboardInterrupt as e:  # unlike most stages, rollout keeps its complete groups: say so, and where
        from qerl_cli.cli import exit_on_resumable_stop

        exit_on_resumable_stop(e, getattr(e, "kept_groups", None), "prompt group", "prompt groups",
                               note="a batch is saved when it ends")
    console = Console(highlight=False)  # its lines print with markup=False: a path "run [x]" lost "[x]" as Rich markup
    if res["already_done"]:
        console.print(f"already done: {out} holds this rollout (pass --force to redo)", soft_wrap=True, markup=False)
        return
    s = res["summary"]
    if not quiet:
        console.print(summary_table(s))
    else:  # the table carries these; without it they must still be seen
        skipped = [f"{s[k]} {what}" for k, what in (("skipped_long_prompts", "prompts too long for the context"),
                                                    ("skipped_bad_rows", "bad prompt rows")) if s.get(k)]
        if skipped:
            Console(stderr=True, highlight=False).print(f"warning: skipped {', '.join(skipped)}", soft_wrap=True, markup=False)
    mean = s["reward"]["mean"]
    console.print(f"wrote {s['completions']} completions for {s['groups']} prompts to {out / s['shard']}"
                  + (f"; mean reward {mean:.3f}" if mean is not None else ""), soft_wrap=True, markup=False)  # one line for grep
