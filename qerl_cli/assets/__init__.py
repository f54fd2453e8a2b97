"""Package data: qerl's bundled tiny model and its synthetic task (nothing to download).

- ``tiny_model_dir()``: a Hugging Face model directory (Qwen2ForCausalLM, ~0.9M parameters,
  bf16 safetensors, byte-level BPE tokenizer, generation_config.json) pretrained by
  ``recipes/pretrain_tiny.py`` on the task below. ``transformers.AutoModelForCausalLM`` /
  ``AutoTokenizer.from_pretrained`` load it as it is.
- ``tiny_task_file("train" | "test")``: JSONL rows ``{"prompt": ..., "answer": "N"}`` of the
  multi-step arithmetic word-problem task (``qerl_cli.tasks.arith``); a completion is correct
  when the number after its first ``####`` equals ``answer``.

See docs/tiny-model.md for how they were made and what the model scores.
"""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
TINY_MODEL = ASSETS_DIR / "tiny_model"
TINY_TASK = ASSETS_DIR / "tiny_task"
SPLITS = ("train", "test")


def tiny_model_dir() -> Path:
    """Path of the bundled tiny model directory."""
    if not (TINY_MODEL / "config.json").is_file():
        raise FileNotFoundError(
            f"bundled tiny model missing at {TINY_MODEL}; rebuild it with `python recipes/pretrain_tiny.py`"
        )
    return TINY_MODEL


def tiny_task_file(split: str = "train") -> Path:
    """Path of the bundled task file of ``split`` (``train`` or ``test``)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = TINY_TASK / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"bundled task file missing at {path}; rebuild with `python recipes/pretrain_tiny.py`")
    return path


__all__ = ["ASSETS_DIR", "tiny_model_dir", "tiny_task_file"]
