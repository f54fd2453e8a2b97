"""Atomic, idempotent stage outputs.

Every stage writes into a temporary sibling of its output directory and renames it into
place last, with ``manifest.json`` written just before the rename. So a crash at any moment
leaves either the previous output or the complete new one, never half a directory, and a
directory without a valid manifest is never treated as done.

A *fingerprint* (hash of the stage name, its result-affecting arguments and its input
hashes) decides reruns: same fingerprint -> "already done"; different -> error unless
``force``. Resumable stages (rollout) keep their work directory under a name derived from
the fingerprint, so a rerun after a crash continues where the last one stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_cli import __version__
from qerl_cli.errors import OutputExistsError
from qerl_cli.hashing import sha256_file, sha256_json

MANIFEST = "manifest.json"


def read_manifest(out: Path) -> dict | None:
    """The manifest of a finished output directory, or None if it is absent or unreadable."""
    path = Path(out) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "fingerprint" not in data or "stage" not in data:
        return None
    return data


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class StageOutput:
    """Context manager owning one stage's output directory.

    >>> out = StageOutput(Path("q"), "quantize", config={...}, inputs={"src": h})
    >>> if out.already_done(): return out.manifest
    >>> with out as work:               # work: temp dir to fill
    ...     write(work / "model.safetensors")
    ...     out.extra["summary"] = {...}   # lands in manifest.json
    """

    out: Path
    stage: str
    config: dict[str, Any]
    inputs: dict[str, str]
    force: bool = False
    resumable: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        self.out = Path(self.out)
        self.fingerprint = sha256_json({"stage": self.stage, "config": self.config, "inputs": self.inputs})
        self.manifest: dict | None = None
        self.work: Path | None = None
        self._t0 = 0.0

    # ---- rerun logic -------------------------------------------------------------------
    def already_done(self) -> bool:
        """True when ``out`` holds a finished run of the same stage with the same inputs.

        Raises OutputExistsError when ``out`` exists otherwise and ``force`` is not set.
        """
        if not self.out.exists():
            return False
        m = read_manifest(self.out)
        if m is not None and m["stage"] == self.stage and m["fingerprint"] == self.fingerprint and not self.force:
            self.manifest = m
            return True
        if self.force:
            return False
        if m is None:
            raise OutputExistsError(
                f"{self.out} exists but holds no valid qerl manifest", hint="choose another --out or pass --force"
            )
        raise OutputExistsError(
            f"{self.out} holds a {m['stage']} output made from different inputs or arguments "
            f"(fingerprint {m['fingerprint'][:12]} != {self.fingerprint[:12]})",
            hint="pass --force to replace it",
        )

    # ---- work directory ----------------------------------------------------------------
    def _partial_name(self) -> Path:
        if self.resumable:
            return self.out.parent / f".{self.out.name}.partial-{self.fingerprint[:16]}"
        return self.out.parent / f".{self.out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def _clean_stale(self) -> None:
        for p in self.out.parent.glob(f".{self.out.name}.tmp-*"):
            try:
                pid = int(p.name.split(".tmp-")[1].split("-")[0])
            except (IndexError, ValueError):
                continue
            if not _pid_alive(pid):
                shutil.rmtree(p, ignore_errors=True)

    def __enter__(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._clean_stale()
        self.work = self._partial_name()
        self.work.mkdir(parents=True, exist_ok=self.resumable)
        self._t0 = time.time()
        return self.work

    def __exit__(self, exc_type, exc, tb) -> bool:
        assert self.work is not None
        if exc_type is not None:
            if not self.resumable:
                shutil.rmtree(self.work, ignore_errors=True)
            return False
        self.timings.setdefault("total_s", round(time.time() - self._t0, 3))
        self.manifest = self._write_manifest(self.work)
        self._swap_into_place(self.work)
        return False

    def _write_manifest(self, work: Path) -> dict:
        files = sorted(p for p in work.rglob("*") if p.is_file() and p.name != MANIFEST)
        manifest = {
            "stage": self.stage,
            "qerl_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "fingerprint": self.fingerprint,
            "config": self.config,
            "inputs": self.inputs,
            "outputs": {str(p.relative_to(work)): sha256_file(p) for p in files},
            "timings": self.timings,
            **self.extra,
        }
        tmp = work / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False, default=str) + "\n")
        _fsync_file(tmp)
        os.replace(tmp, work / MANIFEST)
        return manifest

    def _swap_into_place(self, work: Path) -> None:
        _fsync_dir(work)
        if self.out.exists():
            trash = self.out.parent / f".{self.out.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(self.out, trash)
            os.replace(work, self.out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(work, self.out)
        _fsync_dir(self.out.parent)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
