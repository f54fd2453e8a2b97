"""Where and in what precision a stage runs, and the model-directory facts every stage needs.

One copy of the `--device` / `--dtype` rules for rollout, train-step and eval: `auto` picks CUDA
when visible, and bf16 there (the paper's compute dtype) but fp32 on CPU, where bf16 matmuls are
emulated (slow) and the tests compare against fp32 references.
"""

from __future__ import annotations

from pathlib import Path

from qerl_cli.errors import BadInputError

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}
_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def as_many(value, kind=tuple):
    """A config field of several strings given one string (``stop="####"`` from Python): that one, not
    its characters, which ``tuple(value)`` made of it (a stop at every '#')."""
    import os

    return kind([value]) if isinstance(value, (str, os.PathLike)) else value


def check_field_types(cfg) -> None:
    """A stage config's numbers and switches as the CLI gives them, for a caller from Python.

    An int where the field is a float becomes that float: ``lora_alpha=32`` and ``--lora-alpha 32`` are one
    run, yet their fingerprints and records differed (32 against 32.0), and the CLI refused the library's
    output as made from other arguments. Numpy scalars become Python numbers (a ``np.int64`` step passed
    every check and failed after generation, writing its record). A float, string or bool where a whole
    number is wanted, a string where a number is, and anything but a bool for a switch are bad input, named,
    before any work (a library trial, session 44). Fields of other or mixed types are left to their checks.
    """
    import dataclasses
    import numbers
    import typing

    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        kinds = set(typing.get_args(hints.get(f.name))) or {hints.get(f.name)}
        optional = type(None) in kinds
        kinds.discard(type(None))
        if len(kinds) != 1 or kinds & {bool, int, float} == set():
            continue
        if v is None:
            if not optional:  # seed=None was recorded as such and sampled unseeded
                raise BadInputError(f"{f.name} must not be None")
            continue
        kind = kinds.pop()
        is_bool = isinstance(v, bool) or (type(v).__module__ == "numpy" and type(v).__name__ in ("bool", "bool_"))
        if kind is bool:
            if not is_bool:
                raise BadInputError(f"{f.name} must be True or False, got {v!r}")
            setattr(cfg, f.name, bool(v))
        elif kind is int:
            if is_bool or not isinstance(v, numbers.Integral):
                raise BadInputError(f"{f.name} must be a whole number, got {v!r}")
            setattr(cfg, f.name, int(v))
        elif kind is float:
            if is_bool or not isinstance(v, numbers.Real):
                raise BadInputError(f"{f.name} must be a number, got {v!r}")
            setattr(cfg, f.name, float(v))


def resolve_device(device: str) -> str:
    """`auto` -> cuda if visible else cpu; `cuda[:N]` checked against the visible GPUs."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and not device.startswith("cuda"):
        raise BadInputError(f"--device must be auto, cpu or cuda[:N], got {device!r}")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise BadInputError(f"--device {device}: no CUDA device is visible", hint="use --device cpu")
        index = device.split(":", 1)[1] if ":" in device else "0"
        if not index.isdigit() or int(index) >= torch.cuda.device_count():
            raise BadInputError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return device


def device_kind(device: str) -> str:
    """``cuda:1`` -> ``cuda``: the GPUs of one node, alike in numerics (the index says which one ran, not how)."""
    return device.split(":", 1)[0]


def gpu_model(device: str) -> str | None:
    """The model of the GPU ``device`` names (torch.cuda.get_device_name: "NVIDIA H100 80GB HBM3"), or None for the CPU
    or where CUDA cannot say. With the dtype, what decides a GPU's numerics: the index does not (``device_kind``), but
    one node may hold two models (an A100 beside an H100), whose kernels round otherwise."""
    if device_kind(device) != "cuda":
        return None
    try:
        import torch

        return torch.cuda.get_device_name(device)
    except Exception:  # noqa: BLE001 - no CUDA build or driver (torch raises several types): unknown
        return None


def resolve_dtype(dtype: str, device: str):
    """(short name, torch dtype) for `--dtype auto|bf16|fp16|fp32` on ``device``."""
    import torch

    if dtype == "auto":
        dtype = "bf16" if device.startswith("cuda") else "fp32"
    if dtype not in DTYPES:
        raise BadInputError(f"--dtype must be auto, bf16, fp16 or fp32, got {dtype!r}")
    full = DTYPES[dtype]
    return _SHORT[full], getattr(torch, full)


# The JSON files a tokenizer loads from: one that is not JSON is named, not transformers' bare JSONDecodeError.
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    from qerl_cli.models.config import adapter_as_model_hint

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file() and (hint := adapter_as_model_hint(model_dir)):
        raise BadInputError(f"--model {model_dir} is a PEFT adapter directory (adapter_config.json, no config.json)",
                            hint=hint)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a missing tokenizer
        raise BadInputError(_unreadable_json(model_dir) or f"--model {model_dir}: cannot load its tokenizer "
                            f"({type(e).__name__}: {str(e).splitlines()[0]})") from None
    # transformers 5 builds an empty tokenizer (of the class config.json's model_type names) from a directory
    # without tokenizer files: every prompt encoded to its chat template's special tokens alone, or to nothing.
    if not tokenizer("a 1", add_special_tokens=False)["input_ids"]:
        raise BadInputError(f"--model {model_dir}: its tokenizer has no vocabulary (text encodes to no tokens): no "
                            "tokenizer.json, nor tokenizer.model or vocab.json + merges.txt",
                            hint="copy the tokenizer files of the model it was made from into it")
    return tokenizer


def _unreadable_json(model_dir: Path) -> str | None:
    """'file: not valid JSON (why)' for the first of the tokenizer's JSON files that is not JSON, else None."""
    import json

    for name in TOKENIZER_JSON:
        try:
            json.loads((model_dir / name).read_bytes())
        except OSError:  # absent (most are optional), or unreadable: transformers' own error stands
            continue
        except ValueError as e:
            return f"{model_dir / name}: not valid JSON ({e})"
    return None


def special_tokens(tokenizer) -> dict[str, int]:
    """{text: id} of the tokens the recorded text does not show (special, dropped by decode)."""
    out = {}
    for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(t, "special", False) and tokenizer.decode([i], skip_special_tokens=True) == "":
            out[getattr(t, "content", str(t))] = i
    return out


def split_stops(tokenizer, stops) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """--stop strings -> (strings matched on the completion's text, token ids that stop).

    Both engines match stop strings on the text as recorded, where special tokens are not shown (vLLM's
    rule), so "<|im_end|>" as a string would never match: a stop that is exactly one special token
    stops as that token instead. One that holds a special token among other text cannot match at all,
    and is refused."""
    specials = special_tokens(tokenizer)
    strings, ids = [], []
    for x in stops:
        if x in specials:
            ids.append(specials[x])
        elif inside := [t for t in specials if t in x]:
            raise BadInputError(f"--stop {x!r} holds the special token {inside[0]}, which the completion's text "
                                "never shows, so it could never match",
                                hint=f"pass --stop {inside[0]!r} alone: a stop that is one special token stops as that token")
        else:
            strings.append(x)
    return tuple(strings), tuple(ids)


def context_limit(model_dir: Path, asked: int | None) -> tuple[int, str]:
    """(the context a stage runs with, the hint for a prompt or a --max-new-tokens that does not fit).
    Where the model's own limit binds (a sliding window, or max positions), raising --max-model-len
    cannot help, and the hint says so (it told the user to raise it; audit)."""
    from qerl_cli.models.config import ModelConfig

    c = ModelConfig.from_dir(Path(model_dir))
    limit = _engine_limit(c)
    if asked is not None and asked < limit:
        return asked, "raise --max-model-len"
    why = (f"its sliding window of {c.sliding_window} tokens: windowed attention is not implemented"
           if c.sliding_window and c.sliding_window <= c.max_position_embeddings - 1
           else f"max_position_embeddings {c.max_position_embeddings} less one")
    return limit, f"the model's context is {limit} tokens ({why}); --max-model-len cannot raise it"


def context_length(model_dir: Path) -> int:
    """The longest sequence the native engine serves, exactly as ``LLMEngine`` computes it: max
    positions less one (its pipelined decode may compute one position past a finished sequence),
    capped by a sliding window (windowed attention is not implemented, so it stays inside the window).
    A stage that let a prompt of max positions - 1 tokens through had the engine refuse it mid-run."""
    from qerl_cli.models.config import ModelConfig

    return _engine_limit(ModelConfig.from_dir(Path(model_dir)))


def _engine_limit(c) -> int:
    limit = c.max_position_embeddings - 1
    return min(limit, c.sliding_window) if c.sliding_window else limit
