"""`qerl merge`: flags -> MergeConfig -> qerl_cli.merge.merge."""

from __future__ import annotations

from pathlib import Path

import typer

SHORT = "Merge a LoRA adapter into the base: a servable bf16 or NVFP4 checkpoint."
HELP = (
    SHORT + "\n\n"
    "Dequantizes the base (NVFP4 or plain bf16/fp32 HF dir), adds the LoRA update B@A*alpha/r in fp32 and "
    "copies trained norm weights (PEFT modules_to_save), streaming one tensor at a time. The output is a plain "
    "Hugging Face checkpoint (config without quantization_config, tokenizer copied) that transformers and vLLM "
    "load, or with --dtype nvfp4 a compressed-tensors NVFP4 checkpoint (re-quantization error reported).\n\n"
    "An adapter trained by `qerl train-step` is refused on any other base (hash in trainer_state.json).\n\n"
    "Example:\n\n"
    "  qerl merge --model runs/q/qwen-nvfp4 --adapter runs/step-0100 --out runs/merged-bf16\n\n"
    "  qerl merge --model runs/q/qwen-nvfp4 --adapter runs/step-0100 --out runs/merged-fp4 --dtype nvfp4"
)

def command(
    model: Path = typer.Option(..., "--model", help="Base model dir: a qerl/compressed-tensors NVFP4 QDIR or a plain "
                               "bf16/fp32 Hugging Face dir. Example: --model runs/q/qwen-nvfp4"),
    adapter: Path = typer.Option(..., "--adapter", help="PEFT LoRA adapter dir (adapter_config.json + "
                                 "adapter_model.safetensors), e.g. a `qerl train-step` output. Example: --adapter runs/step-0100"),
    out: Path = typer.Option(..., "--out", help="Output model directory, written atomically. Example: --out runs/merged"),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16: plain HF bf16 checkpoint (serving, further SFT). "
                              "nvfp4: re-quantized compressed-tensors NVFP4 (next RL phase, FP4 serving). Example: --dtype nvfp4"),
    max_shard_size: str = typer.Option("4GB", "--max-shard-size", help="Largest safetensors shard. Example: --max-shard-size 2GB"),
    device: str = typer.Option("auto", "--device", help="Where to dequantize, add and re-quantize: auto (cuda if "
                               "available), cpu, cuda or cuda:N (results agree up to fp32 summation order). Example: --device cpu"),
    requantize_from: Path = typer.Option(None, "--requantize-from", help="With --dtype nvfp4: the bf16 checkpoint "
                                         "--model was quantized from (checked against --model's manifest). The update "
                                         "is added to it before quantizing, which keeps small updates that "
                                         "re-quantizing the dequantized base rounds away. Example: "
                                         "--requantize-from models/Qwen2.5-7B-Instruct", show_default=False),
    chat_template_file: Path = typer.Option(None, "--chat-template-file", help="The Jinja chat template the rollouts "
                                            "rendered with (their --chat-template-file), written into the output as "
                                            "chat_template.jinja: the base's tokenizer files lack it, and without it "
                                            "transformers' apply_chat_template on the merged model fails or prompts "
                                            "otherwise (merge warns when the adapter's rollouts used another). "
                                            "Example: --chat-template-file chatml.jinja", show_default=False),
    allow_base_mismatch: bool = typer.Option(False, "--allow-base-mismatch", help="Apply an adapter whose "
                                             "trainer_state.json names another base (e.g. trained on the NVFP4 base, "
                                             "applied to the bf16 original); the manifest records it."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out made from other inputs or flags."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar; print only the result line."),
) -> None:
    from rich.console import Console

    from qerl_cli.merge import MergeConfig, merge, retained_percent
    from qerl_cli.quantize import parse_size

    cfg = MergeConfig(model=model, adapter=adapter, out=out, dtype=dtype,
                      max_shard_size=parse_size(max_shard_size), device=device,
                      requantize_from=requantize_from, chat_template_file=chat_template_file,
                      allow_base_mismatch=allow_base_mismatch, force=force)
    m = merge(cfg, progress=not quiet)
    console = Console(stderr=False, highlight=False)
    s = m.get("summary", {})
    if m.get("already_done"):
        console.print(f"already done: {out} holds this merge (pass --force to redo)", soft_wrap=True, markup=False)
        return
    line = (f"merged {s.get('merged_modules', 0)} LoRA modules"
            f" (+{s.get('replaced_tensors', 0)} trained tensors) into {out} as {s.get('dtype')} "
            f"in {m['timings'].get('total_s', 0):.1f}s; lineage {s.get('lineage')}")
    rq = s.get("requantization")
    if rq:
        line += f"; re-quantization rel. error mean {rq['rel_err_mean']:.4f}, max {rq['rel_err_max']:.4f}"
        if rq.get("update_retained") is not None:
            line += f"; LoRA update retained {retained_percent(rq['update_retained'])}%"
    console.print(line, soft_wrap=True, markup=False)  # one line for grep, also when piped (80 columns)
