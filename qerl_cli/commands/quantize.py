"""`qerl quantize`: flags -> QuantizeConfig -> qerl_cli.quantize.quantize."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

SHORT = "Quantize a Hugging Face safetensors checkpoint to NVFP4 (compressed-tensors)."
HELP = (
    SHORT
    + "\n\nEvery decoder Linear (q/k/v/o, gate/up/down) becomes NVFP4 weight-only (E2M1 values, one e4m3 "
    "scale per 16 inputs, one fp32 global scale; q/k/v and gate/up share their global). Embeddings, "
    "lm_head, norms and biases stay in the source dtype; Linears whose input size is not a multiple of "
    "16 are kept and listed. The tensors are bit-identical to what compressed-tensors/llm-compressor "
    "write (two documented corner cases aside: docs/quantize.md, Exactness), in the format vLLM reads; "
    "transformers loads the output (from an fp16/fp32 source pass it dtype=torch.bfloat16). Streams "
    "tensor by tensor: host memory stays below three times the largest layer, whatever the model size.\n\n"
    "Rerun with the same inputs: 'already done' (exit 0). Output written to a temp dir and renamed, so "
    "an interrupt leaves nothing behind.\n\n"
    "Example:\n\n"
    "  qerl quantize ./Qwen2.5-7B-Instruct --out ./qwen7b-nvfp4\n\n"
    "  qerl quantize ./Qwen2.5-7B-Instruct --out ./qwen7b-modelopt --format modelopt --device cpu"
)


def command(
    src: Path = typer.Argument(
        ...,
        metavar="SRC_HF_DIR",
        help="Source Hugging Face model directory: config.json + *.safetensors (+ index), tokenizer files. "
        "Pickle .bin checkpoints are refused. Example: ./Qwen2.5-0.5B-Instruct",
        show_default=False,
    ),
    out: Path = typer.Option(
        ...,
        "--out",
        "-o",
        help="Output directory (QDIR) to create. Example: --out ./qwen-nvfp4",
        show_default=False,
    ),
    format: str = typer.Option(
        "compressed-tensors",
        "--format",
        help="On-disk format: 'compressed-tensors' (nvfp4-pack-quantized; vLLM/transformers/llm-compressor) "
        "or 'modelopt' (weight/weight_scale/weight_scale_2 + hf_quant_config.json; for serving elsewhere: of qerl's "
        "stages only merge reads it). Example: --format modelopt",
    ),
    device: str = typer.Option(
        "auto",
        "--device",
        help="Where to quantize: 'auto' (CUDA if present), 'cpu', 'cuda' or 'cuda:N'. Same bytes either way. "
        "Example: --device cpu",
    ),
    max_shard_size: str = typer.Option(
        "5GB", "--max-shard-size", help="Largest output shard file. Example: --max-shard-size 2GB"
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace an existing --out even if it was made from other inputs."
    ),
    progress: bool = typer.Option(
        True, "--progress/--no-progress", help="Show the progress bar and summary table."
    ),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="No progress bar or table; print only the result line (as --no-progress)."
    ),
) -> None:
    from qerl_cli.quantize import QuantizeConfig, quantize, render_summary, return_freed_memory_to_os

    progress = progress and not quiet
    cfg = QuantizeConfig(
        src=src,
        out=out,
        format=format,
        device=device,
        max_shard_size=max_shard_size,
        force=force,
        progress=progress,
    )
    console = Console(file=sys.stderr)
    return_freed_memory_to_os()  # for the rest of the process, which ends with the stage
    result = quantize(cfg, console=console)
    if result.already_done:
        print(f"already done: {result.out} holds a quantize output of these inputs (pass --force to redo)")
        return
    if progress:
        render_summary(result, console)
    print(f"wrote {result.out}")
