"""Streaming safetensors I/O: read one tensor at a time, write shards whose layout is planned upfront.

Why not ``safetensors.torch.save_file``: it needs every tensor of a shard in memory at once,
so a 5 GB shard costs 5 GB of RAM. A safetensors file is an 8-byte header length, a JSON
header (name -> dtype, shape, byte offsets) and the raw bytes back to back. Everything a
quantizer writes has a size known from the source headers alone, so :class:`ShardedWriter`
plans all shards and offsets first, writes each header when its shard is opened, and then
appends tensor bytes in planned order as they are produced: peak memory is the tensor being
written, and the files are valid safetensors the moment the last byte lands.

The reader parses headers itself (cheap: no tensor data is touched, so a 60 GB model is
listed in milliseconds) and reads each tensor with one ``readinto`` at its offset (one
copy out of the page cache, sequential when tensors are visited in file order).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from qerl_cli.errors import BadInputError
from qerl_cli.outputs import crash_point

DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library refuses larger headers too


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives on disk and what it is, from the header alone."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in ``file``
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def lfs_pointer_hint(path: Path) -> str | None:
    """The hint for a Git LFS pointer file in place of the weights (a model repo cloned without git-lfs): its
    first 8 bytes read as a safetensors header length of ~2e18, and "header length > file size" alone did not
    say what was wrong. None for any other file."""
    try:
        with open(path, "rb") as f:
            if f.read(len(LFS_POINTER)) != LFS_POINTER:
                return None
    except OSError:
        return None
    return "it is a Git LFS pointer, not the weights: run `git lfs pull` in the model directory"


def read_header(path: Path) -> list[TensorInfo]:
    """Parse one safetensors header; BadInputError naming the file if it is not one."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise BadInputError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise BadInputError(f"{path}: not a safetensors file (header length {n} > file size)",
                                    hint=lfs_pointer_hint(path))
            header = json.loads(f.read(n))
    except OSError as e:
        raise BadInputError(f"{path}: cannot read ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError):
        raise BadInputError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise BadInputError(f"{path}: not a safetensors file (header is not a JSON object)")
    data_start = 8 + n
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[meta["dtype"]]
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(x) for x in meta["data_offsets"])
        except KeyError as e:
            raise BadInputError(
                f"{path}: tensor {name!r} has unsupported dtype or missing field {e}"
            ) from None
        except (TypeError, ValueError):
            raise BadInputError(f"{path}: tensor {name!r} has a malformed header entry") from None
        if begin < 0 or end < begin or any(d < 0 for d in shape):
            raise BadInputError(f"{path}: tensor {name!r} has a negative shape or byte range")
        info = TensorInfo(name, path, dtype, shape, data_start + begin, end - begin)
        if end - begin != info.numel * element_size(dtype) or data_start + end > size:
            raise BadInputError(
                f"{path}: tensor {name!r} byte range does not match its shape (truncated file?)"
            )
        out.append(info)
    return out


def read_tensor(info: TensorInfo, f=None) -> torch.Tensor:
    """Load one tensor (CPU) with a single read at its offset. ``f``: an open handle to reuse."""
    buf = torch.empty(info.nbytes, dtype=torch.uint8)
    own = f is None
    if own:
        f = open(info.file, "rb")
    try:
        f.seek(info.start)
        got = f.readinto(buf.numpy()) if info.nbytes else 0
    finally:
        if own:
            f.close()
    if got != info.nbytes:
        raise BadInputError(f"{info.file}: tensor {info.name!r} is truncated ({got} of {info.nbytes} bytes)")
    return buf.view(info.dtype).reshape(info.shape)


class TensorReader:
    """Reads tensors by name from a set of shards, keeping one open handle per shard."""

    def __init__(self, infos: dict[str, TensorInfo]):
        self.infos = infos
        self._handles: dict[Path, object] = {}

    def get(self, name: str) -> torch.Tensor:
        info = self.infos[name]
        f = self._handles.get(info.file)
        if f is None:
            f = self._handles[info.file] = open(info.file, "rb")
        return read_tensor(info, f)

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- writing ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = element_size(self.dtype)
        for d in self.shape:
            n *= d
        return n


def shard_names(n: int, stem: str = "model") -> list[str]:
    """HF naming: one shard -> ``model.safetensors``; else ``model-0000i-of-0000n.safetensors``."""
    if n == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def plan_shards(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Split tensors (kept in order) into shards of at most ``max_shard_bytes`` (a bigger tensor gets its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _header_bytes(shard: list[PlannedTensor], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    off = 0
    for t in shard:
        header[t.name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [off, off + t.nbytes],
        }
        off += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


class ShardedWriter:
    """Writes planned tensors, in plan order, into ``out_dir``; the index is written on ``close``.

    ``write`` checks each tensor against the plan (name, dtype, shape), so a bug that would
    produce a corrupt file fails loudly instead.
    """

    def __init__(self, out_dir: Path, plan: list[PlannedTensor], max_shard_bytes: int, stem: str = "model"):
        self.out_dir = Path(out_dir)
        self.shards = plan_shards(plan, max_shard_bytes)
        self.files = shard_names(len(self.shards), stem)
        self.index_name = f"{stem}.safetensors.index.json"
        self._order = [(si, t) for si, shard in enumerate(self.shards) for t in shard]
        self._pos = 0
        self._shard = -1
        self._f = None

    def _open(self, si: int) -> None:
        if self._f is not None:
            self._f.close()
        self._shard = si
        self._f = open(self.out_dir / self.files[si], "wb")
        self._f.write(_header_bytes(self.shards[si], {"format": "pt"}))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._pos >= len(self._order):
            raise RuntimeError(f"tensor {name!r} written past the end of the plan")
        si, planned = self._order[self._pos]
        if (
            planned.name != name
            or planned.dtype != tensor.dtype
            or tuple(planned.shape) != tuple(tensor.shape)
        ):
            raise RuntimeError(
                f"write order broken: expected {planned.name} {planned.dtype} {planned.shape}, "
                f"got {name} {tensor.dtype} {tuple(tensor.shape)}"
            )
        if si != self._shard:
            self._open(si)
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._f.write(data.numpy())
        self._pos += 1
        crash_point("tensor")

    def close(self) -> dict:
        """Finish the last shard, write the index when there is more than one shard; return the weight map."""
        if self._pos != len(self._order):
            missing = self._order[self._pos][1].name
            raise RuntimeError(
                f"{len(self._order) - self._pos} planned tensors never written (first: {missing})"
            )
        if self._f is not None:
            self._f.close()
            self._f = None
        for si in range(len(self.shards)):  # empty plan or shards never opened: still valid files
            p = self.out_dir / self.files[si]
            if not p.exists():
                p.write_bytes(_header_bytes(self.shards[si], {"format": "pt"}))
        weight_map = {t.name: self.files[si] for si, t in self._order}
        if len(self.shards) > 1:
            total = sum(t.nbytes for _, t in self._order)
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out_dir / self.index_name).write_text(json.dumps(index, indent=2) + "\n")
        return weight_map

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def save_small(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``safetensors.torch.save_file`` for the small files (adapter, optimizer state, norms), with the mode
    any other file gets (0666 less the umask): safetensors 0.8 writes through a private temporary file, so
    they came out 0600, unreadable by a teammate or a vLLM server running as another user (docs audit)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, from /proc where it is there: setting it to read it (the portable way) leaves
    a moment in which another thread's new files are world-writable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)  # the moment's files: private, not world-writable
    os.umask(mask)
    return mask
