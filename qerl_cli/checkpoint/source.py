"""Open a Hugging Face model directory for streaming: validate it and list its tensors, reading no weights.

Everything that can be wrong with a source is checked here, before any output exists, and
reported as one line naming the file: a missing directory, no config.json, pickle-only
checkpoints (``.bin``/``.pt``: refused and never unpickled, since unpickling runs code), an
index naming a shard that is not there or a tensor its shard does not hold, a truncated
shard, or a tensor name listed twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from qerl_cli.checkpoint.safetensors_io import TensorInfo, read_header
from qerl_cli.errors import BadInputError

INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass
class SourceModel:
    path: Path
    config: dict
    tensors: dict[str, TensorInfo]  # in file order: (shard, byte offset)
    shard_files: list[Path]
    index_file: Path | None = None
    weight_files: set[str] = field(default_factory=set)  # names of files that are weights/index

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise BadInputError(f"{path}: cannot read {what} ({e.strerror})") from None
    except ValueError as e:
        raise BadInputError(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise BadInputError(f"{path}: {what} is not a JSON object")
    return data


def unindexed_shards(model_dir: Path) -> list[Path]:
    """The ``*.safetensors`` of a directory without an index. Mistral repos ship the original-format
    ``consolidated.safetensors`` beside the HF weights: the same model under other names, left out
    where HF-named shards exist (quantize and the loader read the same files)."""
    shards = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    return [p for p in shards if not p.name.startswith("consolidated")] or shards


def open_source(src: Path) -> SourceModel:
    """Validate ``src`` as a safetensors HF model directory and index its tensors."""
    src = Path(src)
    if not src.exists():
        raise BadInputError(f"source {src} does not exist")
    if not src.is_dir():
        raise BadInputError(f"source {src} is not a directory (expected a Hugging Face model directory)")
    cfg_path = src / "config.json"
    if not cfg_path.is_file():  # quantize's source, merge's --model: an adapter there is named so, as in every stage
        from qerl_cli.models.config import adapter_as_model_hint

        raise BadInputError(f"source {src} is not a model directory: no config.json", hint=adapter_as_model_hint(src))
    config = read_json(cfg_path, "config.json")

    index_path = src / INDEX_NAME
    weight_files = set()
    if index_path.is_file():
        index = read_json(index_path, "safetensors index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise BadInputError(f"{index_path}: no 'weight_map' object")
        for name, shard_name in weight_map.items():
            if not isinstance(shard_name, str):
                raise BadInputError(f"{index_path}: maps tensor {name!r} to {shard_name!r}, not a shard file name")
        shard_names = sorted(
            set(weight_map.values())
        )  # file order, so reads go through the shards in sequence
        single = src / "model.safetensors"
        if single.is_file() and single.name not in shard_names:
            # Two checkpoints in one directory (save_pretrained into a used directory leaves the other
            # behind): transformers loads model.safetensors, vLLM and qerl the index's shards.
            raise BadInputError(
                f"{src} holds two checkpoints: model.safetensors and the shards {INDEX_NAME} names "
                "(transformers loads the first, vLLM and qerl the second)",
                hint=f"delete the stale one: model.safetensors, or {INDEX_NAME} and its shards",
            )
        shards = []
        for name in shard_names:
            p = src / name
            if "/" in name or not p.is_file():
                raise BadInputError(f"{index_path}: names shard {name!r}, which is not in {src}")
            shards.append(p)
        weight_files = {INDEX_NAME, *shard_names}
    else:
        shards = unindexed_shards(src)
        if not shards:
            pickles = sorted(p.name for p in src.iterdir() if p.suffix in PICKLE_SUFFIXES)
            if pickles:
                raise BadInputError(
                    f"source {src} has only pickle checkpoints ({', '.join(pickles[:3])}); "
                    "qerl reads safetensors only and never unpickles files",
                    hint="convert with transformers: AutoModelForCausalLM.from_pretrained(src).save_pretrained(dst)",
                )
            raise BadInputError(f"source {src} has no *.safetensors weights")
        weight_files = {p.name for p in shards}
        weight_map = None

    tensors: dict[str, TensorInfo] = {}
    for shard in shards:
        for info in sorted(read_header(shard), key=lambda t: t.start):
            if info.name in tensors:
                raise BadInputError(
                    f"{shard}: tensor {info.name!r} also appears in {tensors[info.name].file.name}"
                )
            if weight_map is not None and weight_map.get(info.name) != shard.name:
                continue  # stray tensor the index does not point to: ignored, as transformers does
            tensors[info.name] = info
    if weight_map is not None:
        for name, shard_name in weight_map.items():
            if name not in tensors:
                raise BadInputError(f"{index_path}: tensor {name!r} is not in its shard {shard_name}")
    if not tensors:
        raise BadInputError(f"source {src} has safetensors files but no tensors in them")
    return SourceModel(
        src, config, tensors, shards, index_path if weight_map is not None else None, weight_files
    )


EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def check_tied_head(tied: bool, files: dict[str, Path], config_path: Path) -> None:
    """A tied config whose checkpoint also stores an ``lm_head.weight`` that is not the embedding is
    refused: transformers 4 ties (the stored head is ignored), transformers 5 keeps the stored head, so
    the same directory is two different models (qerl tied it: log-probs 1.5-2.9 off transformers 5,
    silently; audit, 2026-11-26). A stored copy equal to the embedding is fine."""
    if not tied or LM_HEAD not in files or EMBED not in files:
        return
    from safetensors import safe_open

    with safe_open(str(files[LM_HEAD]), framework="pt") as f:
        head = f.get_tensor(LM_HEAD)
    with safe_open(str(files[EMBED]), framework="pt") as f:
        emb = f.get_tensor(EMBED)
    if head.shape != emb.shape or not bool((head == emb).all()):
        raise BadInputError(f"{config_path}: tie_word_embeddings is true, but the checkpoint stores an lm_head.weight "
                            "that differs from the embedding (transformers 5 uses the stored head, 4.x the embedding)",
                            hint="set tie_word_embeddings to false to use the stored head, or delete lm_head.weight")
