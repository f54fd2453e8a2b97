"""Content hashes for lineage checks and manifests.

Full sha256 of every weight byte would cost minutes on a 60 GB model at every stage, so a
*model* fingerprint hashes config.json, each safetensors header (names, dtypes, shapes,
offsets) and a 1 MiB sample from the start, middle and end of every shard's data.
Re-quantization, full retraining or truncation changes it; two byte-identical directories agree.
An in-place edit of a few tensors that keeps every shape (a LoRA merged into some layers) can
fall outside the windows: a fresh output directory, or ``--force``, is the way to redo after one.
Small files (adapters, shards, manifests) are hashed in full.

A stage's own outputs are hashed in full for its manifest, several files at once
(``sha256_files``): hashlib releases the GIL while it hashes, so threads scale with cores, and
a merged 7B checkpoint (four 4 GB shards) hashes in the time of its largest shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_SAMPLE = 1 << 20


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_files(paths: list[Path], workers: int | None = None) -> list[str]:
    """``sha256_file`` of each path, in order, hashed in parallel threads."""
    paths = list(paths)
    workers = workers or min(len(paths), os.cpu_count() or 1, 8)
    if workers <= 1 or len(paths) <= 1:
        return [sha256_file(p) for p in paths]
    # Largest first, so a big shard does not start last and set the wall time alone.
    order = sorted(range(len(paths)), key=lambda i: -paths[i].stat().st_size)
    with ThreadPoolExecutor(workers) as pool:
        digests = dict(zip(order, pool.map(sha256_file, [paths[i] for i in order])))
    return [digests[i] for i in range(len(paths))]


def sha256_json(obj) -> str:
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode())


def _safetensors_fingerprint(path: Path, h) -> None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            h.update(b"<truncated>")
            return
        # A header length past the end (not a safetensors file: a Git LFS pointer, say) is clamped: seeking
        # to 8 + 2e18 raised EINVAL, a traceback from rollout/eval/train-step before the loader could name
        # the file. A valid file's header length never exceeds its size, so its fingerprint is unchanged.
        n = min(struct.unpack("<Q", head)[0], size - 8)
        h.update(f.read(n))
        data_start = 8 + n
        data_len = max(size - data_start, 0)
        for off in sorted({0, max(data_len // 2 - _SAMPLE // 2, 0), max(data_len - _SAMPLE, 0)}):
            f.seek(data_start + off)
            h.update(f.read(_SAMPLE))
    h.update(str(size).encode())


def model_hash(model_dir: Path) -> str:
    """Fingerprint of a model directory's config and weights (see module docstring)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    cfg = model_dir / "config.json"
    if cfg.exists():
        h.update(cfg.read_bytes())
    for st in sorted(model_dir.glob("*.safetensors")):
        h.update(st.name.encode())
        _safetensors_fingerprint(st, h)
    return h.hexdigest()


def dir_hash(path: Path, names: list[str] | None = None) -> str:
    """Full hash of the files in a small directory (adapter, shard dir), manifest excluded."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != "manifest.json")
    if names is not None:
        files = [p for p in files if p.name in names]
    for p in files:
        h.update(str(p.relative_to(path)).encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


# The files besides config.json and the weights that change what rollout and eval sample: the
# prompts' token ids (tokenizer, chat template) and where generation stops (generation_config.json).
TEXT_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
              "generation_config.json"]
# transformers keeps a tokenizer's named chat templates ("tool_use", ...) beside chat_template.jinja, one
# .jinja file each in this folder (transformers.utils.hub.CHAT_TEMPLATE_DIR).
CHAT_TEMPLATE_DIR = "additional_chat_templates"


def text_files_hash(model_dir: Path, named_templates: bool = True) -> str:
    """Hash of ``TEXT_FILES`` present in a model directory (top level) and, with ``named_templates``, of
    its named chat templates (``CHAT_TEMPLATE_DIR``; a directory without them hashes as before). Rollout
    and eval pass False: they render with the default template only, and their outputs made before the
    named templates counted must stay done."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    for name in TEXT_FILES:
        p = model_dir / name
        if p.is_file():
            h.update(name.encode())
            h.update(sha256_file(p).encode())
    named = model_dir / CHAT_TEMPLATE_DIR
    for p in sorted(named.glob("*.jinja")) if named_templates and named.is_dir() else ():
        h.update(f"{CHAT_TEMPLATE_DIR}/{p.name}".encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()
