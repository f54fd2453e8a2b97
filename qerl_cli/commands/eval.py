"""`qerl eval`: flags -> EvalConfig -> qerl_cli.evaluate.evaluate; `--compare` prints a table of runs."""

from __future__ import annotations

from pathlib import Path

import typer

from qerl_cli.errors import BadInputError

SHORT = "Score a model (+ adapter) on a benchmark: pass@1 / pass@k."
HELP = (
    SHORT + "\n\n"
    "Reads a local dataset (GSM8K rows: question + answer '... #### N'; MATH-500 rows: problem + answer; or "
    "prompt + answer; JSONL or Parquet), wraps each problem in --prompt-template and the tokenizer's chat "
    "template, generates with the rollout engine and scores with the training reward's rules: the GSM8K "
    "final-number rule for numeric answers, math-verify for LaTeX ones (--scorer auto). Greedy pass@1 by "
    "default; --k K samples K completions per problem and reports pass@1..pass@K (unbiased estimator). "
    "Writes metrics.json (scores with 95% Wilson CI, counts, lengths, time) and samples.jsonl.\n\n"
    "Examples:\n\n"
    "  qerl eval --model runs/q/qwen-nvfp4 --adapter runs/step-0100 --dataset data/gsm8k_test.jsonl --out runs/eval-100\n\n"
    "  qerl eval --model runs/merged --dataset data/math500.parquet --out runs/eval-m --k 8 --temperature 0.6\n\n"
    "  qerl eval --compare runs/eval-base runs/eval-100"
)


def command(
    runs: list[Path] = typer.Argument(None, help="With --compare: finished eval output dirs to tabulate.",
                                      metavar="EVAL_DIR", show_default=False),
    model: Path = typer.Option(None, "--model", help="Model dir: NVFP4 QDIR, merged or plain HF bf16 dir. "
                               "Example: --model runs/q/qwen-nvfp4", show_default=False),
    adapter: Path = typer.Option(None, "--adapter", help="PEFT LoRA adapter applied on top of --model (refused if "
                                 "trained on another base). Example: --adapter runs/step-0100", show_default=False),
    dataset: Path = typer.Option(None, "--dataset", help="JSONL/JSON/Parquet benchmark file with reference answers. "
                                 "Example: --dataset data/gsm8k_test.jsonl", show_default=False),
    out: Path = typer.Option(None, "--out", help="Output dir for metrics.json + samples.jsonl (atomic; an "
                             "interrupted run's finished problems are kept, and the same command resumes them). "
                             "Example: --out runs/eval-100", show_default=False),
    k: int = typer.Option(1, "--k", help="Report pass@1..pass@K; K > 1 samples at --temperature. Example: --k 8"),
    num_samples: int = typer.Option(None, "--num-samples", help="Samples per problem (>= K; more samples give a "
                                    "lower-variance pass@k). Default: K. Example: --num-samples 16", show_default=False),
    temperature: float = typer.Option(None, "--temperature", help="Sampling temperature. Default: 0 (greedy) for "
                                      "one sample, 1.0 otherwise. Example: --temperature 0.6", show_default=False),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling threshold. Example: --top-p 0.95"),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", help="Completion length cap (longer ones count as "
                                       "truncated). Default: 1024, or half the model's context if that is less. "
                                       "Example: --max-new-tokens 2048", show_default=False),
    stop: list[str] = typer.Option([], "--stop", metavar="TEXT", help="Stop string (repeatable); EOS always stops. For base models "
                                   "that run on into the next question (a newline needs the shell's $'...' quoting). Example: --stop $'\\nQ:'"),
    prompt_template: str = typer.Option(None, "--prompt-template", help="Instruction around each problem: a string "
                                        "or file containing {prompt}. Default: the row's prompt as it is, exactly as `qerl rollout` "
                                        "uses it (score the policy on the prompts it was trained on). Example: "
                                        "--prompt-template $'{prompt}\\nEnd with #### <number>.'", show_default=False),
    system_prompt: str = typer.Option(None, "--system-prompt", help="System message for chat templates. "
                                      "Example: --system-prompt 'You are a careful mathematician.'", show_default=False),
    no_chat_template: bool = typer.Option(False, "--no-chat-template", help="Prompt with the raw text even if the "
                                          "tokenizer has a chat template (base models)."),
    chat_template_file: Path = typer.Option(None, "--chat-template-file", help="A Jinja chat template to use instead of the tokenizer's (a base model often has none, and `messages` rows need one); its text is part of the eval's inputs. Example: --chat-template-file chatml.jinja"),
    chat_template_kwargs: str = typer.Option(None, "--chat-template-kwargs", metavar="JSON", help="Extra variables for the chat template, a JSON object passed to it as vLLM's chat_template_kwargs are; each must be a variable the template reads (a misspelt one is an error, not ignored), and they are part of the eval's fingerprint. Example: --chat-template-kwargs '{\"enable_thinking\": false}' (Qwen3 without thinking)", show_default=False),
    scorer: str = typer.Option("auto", "--scorer", help="auto: gsm8k rule for numeric references, math-verify "
                               "otherwise; gsm8k: final number (####, \\boxed{}, <answer>, else 'The answer is N.'); "
                               "math: math-verify on the last \\boxed{}. Example: --scorer math"),
    prompt_key: str = typer.Option(None, "--prompt-key", help="Column holding the problem (text or chat list) when it "
                                   "is not `prompt`, `messages`, `question` or `problem`; dotted for nested fields, as "
                                   "`qerl rollout --prompt-key`. Example: --prompt-key input", show_default=False),
    answer_key: str = typer.Option(None, "--answer-key", help="Column holding the reference when it is not `answer`; "
                                   "dotted for nested fields, as `qerl rollout --answer-key`. Example: --answer-key "
                                   "reward_model.ground_truth", show_default=False),
    max_problems: int = typer.Option(None, "--max-problems", help="Score only the first N problems (smoke runs). "
                                     "Example: --max-problems 50", show_default=False),
    engine: str = typer.Option("native", "--engine", help="native (qerl's engine) or vllm (needs `qerl\\[vllm]`). "
                               "Example: --engine vllm"),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N (an eval another device finished "
                               "is already done here; a stopped one resumes only on its kind of device: cpu, or any "
                               "GPU of the model it began on). "
                               "Example: --device cpu"),
    dtype: str = typer.Option("auto", "--dtype", help="Activation dtype: auto (bf16 on GPU, fp32 on CPU), bf16, "
                              "fp16, fp32. Example: --dtype bf16"),
    seed: int = typer.Option(0, "--seed", help="Sampling seed (pass@k runs are reproducible). Example: --seed 1"),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", help="Sequences generated at once (memory vs speed). "
                                     "Example: --max-num-seqs 256"),
    max_model_len: int = typer.Option(None, "--max-model-len", help="Context length (prompt + completion). "
                                      "Default and at most: the model's max_position_embeddings - 1, what the engine serves. "
                                      "Example: --max-model-len 4096",
                                      show_default=False),
    compare: bool = typer.Option(False, "--compare", help="Print a side-by-side table of finished eval dirs "
                                 "given as arguments; runs no eval (flags that would run one, --model, --k, ..., are refused). "
                                 "Example: qerl eval --compare runs/e1 runs/e2"),
    allow_base_mismatch: bool = typer.Option(False, "--allow-base-mismatch", help="Apply an adapter whose "
                                             "trainer_state.json names another base (e.g. trained on the NVFP4 base, "
                                             "applied to the bf16 original); the manifest records it."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out made from other inputs or flags."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or table: only the result line (printed after the table without it)."),
) -> None:
    from rich.console import Console

    console = Console(highlight=False)
    if compare or runs:
        if not compare:
            from qerl_cli.cli import current_context, repeated_flag

            ctx = current_context()  # `--stop a b`: b is no eval dir, --stop is given twice
            named = repeated_flag(ctx.command, ctx.meta.get("qerl.args", [])) if ctx is not None else None
            raise BadInputError(f"unexpected argument {runs[0]}",
                                hint=f"{named} takes one value, repeated for several ({named} A {named} B)" if named
                                else "to tabulate eval dirs pass --compare DIR...")
        if not runs:
            raise BadInputError("--compare needs at least one eval output directory")
        _refuse_run_flags_with_compare()
        from qerl_cli.eval_metrics import compare_table

        console.print(compare_table(runs))
        return
    for flag, value in (("--model", model), ("--dataset", dataset), ("--out", out)):
        if value is None:
            raise BadInputError(f"{flag} is required (or use --compare DIR... to tabulate finished runs)")

    from qerl_cli.evaluate import EvalConfig, evaluate, render_metrics, result_line

    cfg = EvalConfig(
        model=model, dataset=dataset, out=out, adapter=adapter, k=k, num_samples=num_samples,
        temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, stop=tuple(stop),
        prompt_template=prompt_template,
        system_prompt=system_prompt, chat_template=False if no_chat_template else None, chat_template_file=chat_template_file,
        chat_template_kwargs=chat_template_kwargs, scorer=scorer,
        prompt_key=prompt_key, answer_key=answer_key, max_problems=max_problems, engine=engine, device=device, dtype=dtype, seed=seed,
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, allow_base_mismatch=allow_base_mismatch,
        force=force, progress=not quiet,
    )
    try:
        res = evaluate(cfg, console=Console(stderr=True, highlight=False))  # the progress, on stderr as every stage's
    except KeyboardInterrupt as e:  # as a rollout's, an eval's finished problems stay: say so, and where
        from qerl_cli.cli import exit_on_resumable_stop

        exit_on_resumable_stop(e, getattr(e, "kept_problems", None), "problem", "problems")
    if res["already_done"]:
        console.print(f"already done: {out} holds this eval (pass --force to redo)", soft_wrap=True, markup=False)
    if not quiet:
        render_metrics(res["metrics"], console)
    # One line for grep, after the table too: as every other stage's last line, it names --out, so a log holding
    # several evals (grpo.sh's EVAL_EVERY) ties each score to its run (a review).
    console.print(result_line(res["metrics"], out, res["already_done"]), soft_wrap=True, markup=False)


def _refuse_run_flags_with_compare() -> None:
    """`qerl eval --compare A B --model X --dataset D`: the table is of finished runs, so flags that would run an
    eval do nothing there; said, rather than ignored (a user expecting X scored and added to the table)."""
    from qerl_cli.cli import current_context

    ctx = current_context()
    if ctx is None:
        return
    given = [p.opts[0] for p in ctx.command.params if p.name not in ("runs", "compare", "quiet")
             and getattr(ctx.get_parameter_source(p.name), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")]
    if given:
        raise BadInputError(f"--compare tabulates finished eval dirs; {', '.join(given)} would run an eval",
                            hint="run the eval first (with --out), then pass its dir to --compare")
