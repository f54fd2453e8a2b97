"""Per-step statistics: accumulated per token on each rank, reduced once, written as JSON lines.

``Accumulator`` keeps named sums, minima and maxima; ``reduce`` all-reduces each kind in one
collective (three in all), so multi-GPU metrics cost nothing per micro-batch. ``append_jsonl``
writes one line per step with ``O_APPEND`` in a single write, so another writer's line never lands
inside it. ``--metrics-file`` is one run's file all the same: train-step replaces a step's earlier
line (``train_step._append_metrics``), so a second run logging there replaces the first's lines of
the same step numbers.
"""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import torch


class Accumulator:
    def __init__(self):
        self.sums: dict[str, float] = {}
        self.mins: dict[str, float] = {}
        self.maxs: dict[str, float] = {}

    def add(self, **values: float) -> None:
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)

    def min(self, **values: float) -> None:
        for k, v in values.items():
            self.mins[k] = min(self.mins.get(k, math.inf), float(v))

    def max(self, **values: float) -> None:
        for k, v in values.items():
            self.maxs[k] = max(self.maxs.get(k, -math.inf), float(v))

    def reduce(self, dist, keys: dict[str, list[str]] | None = None) -> None:
        """All-reduce in place. Every rank must hold the same key sets: pass ``keys`` (kind ->
        names) when some ranks may have seen no data for a key."""
        if not dist.enabled:
            return
        for kind, store, op, empty in (("sum", self.sums, "sum", 0.0), ("min", self.mins, "min", math.inf),
                                       ("max", self.maxs, "max", -math.inf)):
            names = sorted(set(store) | set((keys or {}).get(kind, [])))
            if not names:
                continue
            t = torch.tensor([store.get(n, empty) for n in names], dtype=torch.float64)
            dev = "cuda" if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl" else "cpu"
            t = dist.all_reduce_(t.to(dev), op).cpu()
            store.clear()
            store.update({n: float(v) for n, v in zip(names, t)})

    def mean(self, key: str, count_key: str) -> float | None:
        c = self.sums.get(count_key, 0.0)
        return self.sums.get(key, 0.0) / c if c else None


def clean(record: dict) -> dict:
    """Round floats for readability and turn inf/nan into None (JSON has neither)."""
    out = {}
    for k, v in record.items():
        if isinstance(v, float):
            v = None if not math.isfinite(v) else float(f"{v:.6g}")
        out[k] = v
    return out


def append_jsonl(path: Path, record: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        n = os.write(fd, line)
        if n != len(line):
            # A short write is how a full disk answers an append that fits only in part (no error): the
            # torn line stayed and the step ended with exit 0. Take the part back and fail as ENOSPC would.
            os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR) - n)
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (wrote {n} of {len(line)} bytes)", str(path))
    finally:
        os.close(fd)
