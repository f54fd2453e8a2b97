"""Atomic, idempotent stage outputs.

Every stage writes into a temporary sibling of its output directory and renames it into
place last, with ``manifest.json`` written just before the rename. So a crash at any moment
leaves either the previous output or the complete new one, never half a directory, and a
directory without a valid manifest is never treated as done.

A *fingerprint* (hash of the stage name, its result-affecting arguments and its input
hashes) decides reruns: same fingerprint -> "already done"; different -> error unless
``force``. Resumable stages (rollout, eval) keep their work directory under a name derived from
the fingerprint, so a rerun after a crash continues where the last one stopped; a ``WriterLock``
beside it refuses a second writer.

Replacing an existing output (``force``) swaps the two directories in one atomic
``renameat2(RENAME_EXCHANGE)`` where the kernel and file system support it; elsewhere (NFS) it takes
two renames, the old output to ``.OUT.old-ID`` for the new one's ``.OUT.tmp-ID``: a signal between
them finishes the swap, and a kill between them is finished by the next run (the new output found
by that name). ``force`` never deletes a non-empty directory that holds no qerl manifest: that is data
qerl did not write.

A temp name records its process as pid, start time and host: a dead run's is removed by the next run,
also where the pid is a live unrelated process's by then (pids repeat in a restarted container).

``crash_point(name)`` is the test hook of tests/test_kill.py (see docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import json
import os
import re
import shutil
import signal
import socket
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_cli import __version__
from qerl_cli.errors import BadInputError, OutputBusyError, OutputExistsError, OutputWriteError, QerlWarning
from qerl_cli.hashing import sha256_files, sha256_json

# Outputs this process found done or put in place: a signal after that point leaves them whole, which the
# CLI's interrupt line says instead of "--out was not written" (a review: that line followed a finished run).
_COMPLETE: list[Path] = []


def completed_outputs() -> list[Path]:
    return list(_COMPLETE)


def forget_completed(out: Path | None = None) -> None:
    """Forget every output (a new CLI invocation), or just ``out``: a stage's own inner output, such as merge
    --dtype nvfp4's quantize into its temp dir, which is not the --out a signal's line may call complete."""
    if out is None:
        _COMPLETE.clear()
    else:
        _COMPLETE[:] = [p for p in _COMPLETE if p != Path(out)]


MANIFEST = "manifest.json"
KEPT_FOR_RERUN = {"rollout": "prompt groups", "eval": "problems"}  # what a resumable stage keeps for its rerun
# The file system refusing a write: a one-line error (exit 7), not a traceback. Other OSErrors stay bugs.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EFBIG, errno.ENOTDIR,
                 errno.EEXIST, errno.EBUSY}
_UNSEEN = object()
_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "localhost"
KILL_ENV = "QERL_TEST_KILL_AT"
_kill_hits: dict[str, int] = {}


def check_out_apart(out: Path, **inputs: Path | None) -> None:
    """--out must not be an input, hold one, or (for a directory input) lie inside one: --force would
    replace the input being read. A file input only conflicts when --out is the file or holds it."""
    o = Path(out).resolve()
    for flag, p in inputs.items():
        if p is None:
            continue
        p = Path(p).resolve()
        if o == p or o in p.parents or (not p.is_file() and p in o.parents):
            raise BadInputError(f"--out {out} overlaps --{flag.replace('_', '-')} {p}",
                                hint="write the output to a separate directory")


def crash_point(name: str) -> None:
    """Test hook: SIGKILL this process at the named point when ``QERL_TEST_KILL_AT=name[:N]``.

    The N-th time (default: the first) the process reaches ``crash_point(name)`` it kills itself
    with SIGKILL, which no handler can intercept: exactly what an OOM killer or a pre-empted node
    does. Named points: ``stage-start`` (temp dir just created), ``before-manifest`` (every
    output file written), ``before-rename`` (manifest written, not yet renamed), ``mid-swap``
    (replacing an output: between the swap and the removal of the old one), ``shard-group``
    (a rollout group appended and flushed), ``eval-problem`` (an eval problem's samples appended and
    flushed), ``tensor`` (a safetensors tensor written). Unset, as
    always outside the tests, it costs one environment lookup.
    """
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    _kill_hits[name] = _kill_hits.get(name, 0) + 1
    if _kill_hits[name] >= int(nth or 1):
        # QERL_TEST_KILL_SIGNAL=TERM|INT: what Slurm pre-emption / Ctrl-C send instead.
        os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get("QERL_TEST_KILL_SIGNAL", "KILL")))


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


def damaged_output(out: Path, manifest: dict) -> str | None:
    """Why a finished output no longer matches its manifest (a listed file missing or resized), or None.

    Sizes only: re-hashing a 60 GB model on every "already done" would cost minutes.
    """
    sizes = manifest.get("output_bytes") or {}
    for rel in manifest.get("outputs") or {}:
        p = Path(out) / rel
        if not p.is_file():
            return f"{rel} is missing"
        if rel in sizes and p.stat().st_size != sizes[rel]:
            return f"{rel} has {p.stat().st_size} bytes, the manifest says {sizes[rel]}"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _started(pid: int) -> str | None:
    """When process ``pid`` started, as ``TICKS.BOOT`` (its start in clock ticks since boot, Linux's /proc/PID/stat,
    and the boot's id), or None where that cannot be read (another system, the process gone). With the pid it names
    one process for good; a pid alone is reused, by a container's next start above all, whose first processes get the
    same small pids again: a killed run's temp dir whose pid a live unrelated process held was kept for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:8]
        ticks = stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name before it may hold ')' and spaces
    except (OSError, IndexError):
        return None
    return f"{ticks}.{boot}" if ticks.isdigit() and boot else None


_OWN: dict[int, str] = {}


def _own_id() -> str:
    """This process as a temp name records it: ``PID.TICKS.BOOT`` (``_started``), ``PID`` where its start cannot be
    read (no /proc, or one of another pid namespace). Cached per pid (a forked child is another process)."""
    pid = os.getpid()
    if pid not in _OWN:
        try:  # a /proc of another pid namespace (not this process's) would record another process's start
            mine = os.readlink("/proc/self") == str(pid)
        except OSError:
            mine = False
        started = _started(pid) if mine else None
        _OWN[pid] = f"{pid}.{started}" if started else str(pid)
    return _OWN[pid]


def _gone(owner: str) -> bool:
    """Whether the process a temp name records (``_own_id``; ``PID`` alone in a name made before 2026-11-28) is gone
    from this host: dead, or its pid now another process's (another start). False where ``owner`` is no such record,
    and where the pid's start cannot be read (a live process stays safe)."""
    pid, _, started = owner.partition(".")
    if not pid.isdigit():
        return False
    if not _pid_alive(int(pid)):
        return True
    now = _started(int(pid)) if started else None
    return now is not None and now != started


def _differences(m: dict, stage: str, config: dict, inputs: dict, most: int = 3) -> str:
    """What differs from an output's manifest, as ``name: old -> new`` / ``input NAME changed`` (the first
    ``most``), or "" where the manifest cannot say (another stage's; only the fingerprint differs)."""
    if m.get("stage") != stage:
        return ""
    new = _as_recorded(config, inputs)
    found = []
    for part in ("config", "inputs"):
        old, cur = m.get(part) or {}, new[part]
        for key in sorted(set(old) | set(cur), key=str):
            if _numbers_as_floats(old.get(key)) != _numbers_as_floats(cur.get(key)):  # 32 -> 32.0: the same run
                found.append(f"input {key} changed" if part == "inputs"
                             else f"{key}: {_short(old.get(key))} -> {_short(cur.get(key))}")
    more = f" and {len(found) - most} more" if len(found) > most else ""
    return "; ".join(found[:most]) + more


def _as_recorded(config: dict, inputs: dict) -> dict:
    """``config`` and ``inputs`` as a manifest records them (through JSON, unknown types as strings)."""
    return json.loads(json.dumps({"config": config, "inputs": inputs}, default=str))


def _numbers_as_floats(obj):
    """``obj`` (parsed JSON) with every int as a float, so that 32 and 32.0 compare equal; a bool becomes a
    tuple, which parsed JSON never holds, as True == 1 == 1.0 in Python."""
    if isinstance(obj, bool):
        return ("bool", obj)
    if isinstance(obj, int):
        return float(obj)
    if isinstance(obj, dict):
        return {k: _numbers_as_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_numbers_as_floats(v) for v in obj]
    return obj


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _missing_before_dotdot(out: Path) -> Path | None:
    """The first directory an ``--out`` goes up out of ('..') that does not exist, else None."""
    parts = out.parts
    for i in range(1, len(parts)):
        if parts[i] == ".." and not Path(*parts[:i]).exists():
            return Path(*parts[:i])
    return None


# The command line that started this process, for manifest.json's ``command``: set by the CLI (cli.main), None where a
# library caller writes the output. A user rerunning one stage of a recipe's loop to debug it had to rebuild its ~20
# flags from recipes/lib.sh (session 60): `jq -r .command OUT/manifest.json` now prints it, to edit and run.
_INVOCATION: dict[str, Any] | None = None


def record_invocation(argv: list[str], cwd: str | None = None) -> None:
    """Record ``qerl ARGV...`` (shell-quoted) and the directory it ran in, as a stage's manifest will show them; under
    torchrun, the ranks (its launch line is torchrun's, outside this process)."""
    import shlex

    global _INVOCATION
    _INVOCATION = {"command": shlex.join(["qerl", *argv])}
    try:
        _INVOCATION["cwd"] = cwd if cwd is not None else os.getcwd()
    except OSError:  # the directory deleted under the shell: every command, --version too, was a traceback (s60r10)
        pass
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > 1:
        _INVOCATION["world_size"] = int(world)


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
    # Configs an older qerl fingerprinted the same run by (a stage that stopped counting an argument
    # that does not change its result): their outputs still read as "already done".
    legacy_configs: tuple[dict[str, Any], ...] = ()
    # Inputs an older qerl fingerprinted the same run by (before it counted another input file).
    legacy_inputs: tuple[dict[str, str], ...] = ()
    # When the stage began (time.time()): the manifest's ``timings.total_s`` counts from here, so it is
    # never less than the stage's own parts (it counted from entering the temp dir, after prepare_s).
    started: float | None = None

    def __post_init__(self):
        self.out = Path(self.out)
        if self.out.is_symlink() and self.out.is_dir():
            # Followed, as cp and rsync follow it: a --force replace swapped the link itself, so the new output
            # landed beside the link (another file system, maybe), the link was gone and the old output stayed
            # at the target; a link to an empty directory (scratch space made ready) was refused as foreign.
            self.out = self.out.resolve()
        if self.out.name in ("", ".", ".."):  # the temp dir beside it landed inside it: a false "written by another run"
            raise BadInputError(f"--out {str(self.out)!r} names no directory of its own (the output is written beside "
                                "it, then renamed into place)", hint="name the directory to create, e.g. --out runs/x")
        missing = _missing_before_dotdot(self.out)
        if missing is not None:  # the existence checks failed through it, then mkdir made it: a false "written by another run"
            raise BadInputError(f"--out {str(self.out)!r} goes up ('..') out of {str(missing)!r}, which does not exist",
                                hint="name --out without '..', or create that directory first")
        self.fingerprint = sha256_json({"stage": self.stage, "config": self.config, "inputs": self.inputs})
        self._same_run = {sha256_json({"stage": self.stage, "config": c, "inputs": i})
                          for c in (self.config, *self.legacy_configs) for i in (self.inputs, *self.legacy_inputs)}
        self.manifest: dict | None = None
        self.work: Path | None = None
        self._t0 = self.started if self.started is not None else time.time()
        self._seen = _UNSEEN  # the fingerprint at `out` when this run decided to write (None: nothing)
        self._manifest_id: tuple[int, int] | None = None  # the manifest this run wrote (_in_place)
        self._old: Path | None = None  # where a replace by two renames parks the old output (_finish_stopped_swap)

    # ---- rerun logic -------------------------------------------------------------------
    def already_done(self, check_first=None) -> bool:
        """True when ``out`` holds a finished run of the same stage with the same inputs.

        Raises OutputExistsError when ``out`` exists otherwise and ``force`` is not set; ``check_first()``
        runs before that error, so a flag bad in itself is bad input (exit 2) there as into a fresh --out,
        not "made from other inputs" (exit 4), while an "already done" rerun never pays for the check.
        """
        try:
            return self._already_done()
        except OutputExistsError:
            if check_first is not None:
                check_first()
            raise

    def _already_done(self) -> bool:
        if self.out.is_symlink() and not self.out.exists():  # found only after all the work (a review)
            raise BadInputError(f"--out {self.out} is a symlink to {os.readlink(self.out)}, which does not exist",
                                hint="point --out at a directory that can be made, or remove the link")
        self._recover_interrupted_swap()
        self._seen = None
        if not self.out.exists():
            return False
        # A run killed after swapping its output in, before deleting the old one, left that old one
        # in a temp dir (GBs for a checkpoint): an "already done" rerun sweeps it too, not only a new run.
        self._clean_stale()
        m = read_manifest(self.out)
        if not self.out.is_dir():
            raise OutputExistsError(f"{self.out} is a file, not a qerl output directory",
                                    hint="choose another --out, or move that file away")
        if m is None and not _is_empty_dir(self.out):
            # Never replaced, even with --force: a directory without a manifest is not qerl's
            # (qerl's outputs appear only complete, manifest included).
            raise OutputExistsError(
                f"{self.out} exists but holds no valid qerl manifest, so it is not a finished qerl output",
                hint="choose another --out, or delete it yourself if it is disposable",
            )
        self._seen = m["fingerprint"] if m is not None else None
        damage = damaged_output(self.out, m) if m is not None else None
        if m is not None and self._same_run_as(m) and not self.force and damage is None:
            self.manifest = m
            _COMPLETE.append(self.out)
            return True
        if os.path.ismount(self.out):  # found at the final rename, after all the work: EBUSY, a traceback
            raise BadInputError(f"--out {self.out} is a mount point, which qerl cannot replace (it writes the output "
                                "beside --out, then renames it into place)",
                                hint=f"name a directory inside it, e.g. --out {self.out / 'run'}")
        if m is not None and self._same_run_as(m) and not self.force:
            raise OutputExistsError(
                f"{self.out} holds this {self.stage} output but it was damaged after it was written ({damage})",
                hint="pass --force to redo it",
            )
        if self.force:
            return False
        if m is None:
            raise OutputExistsError(f"{self.out} exists but holds no valid qerl manifest (it is empty)",
                                    hint="choose another --out or pass --force")
        fp = f"fingerprint {m['fingerprint'][:12]} != {self.fingerprint[:12]}"
        changed = _differences(m, self.stage, self.config, self.inputs)
        what = f"{changed}; {fp}" if changed else fp
        stage = m["stage"]
        article = "an" if stage[:1] in tuple("aeiou") else "a"  # "holds a eval output" read as a typo (a review)
        if stage != self.stage:  # a slip of the path ("quantize --out" a rollout's dir): "pass --force" deleted that
            mine = "an" if self.stage[:1] in tuple("aeiou") else "a"  # "not a eval one"
            raise OutputExistsError(f"{self.out} holds {article} {stage} output, not {mine} {self.stage} one",
                                    hint=f"choose another --out (--force would delete that {stage} output)")
        raise OutputExistsError(
            f"{self.out} holds {article} {stage} output made from different inputs or arguments ({what})",
            hint="pass --force to replace it, or choose another --out",
        )

    def finished_meanwhile(self) -> bool:
        """Whether ``out`` now holds a finished, undamaged output of this same run that was not there
        when this run decided to write (``already_done``): a concurrent run's. A ``--force`` rerun over
        its own earlier output is not that."""
        m = None if self._seen is _UNSEEN else read_manifest(self.out)
        return m is not None and self._same_run_as(m) and m["fingerprint"] != self._seen \
            and damaged_output(self.out, m) is None

    def _same_run_as(self, m: dict) -> bool:
        """Whether manifest ``m`` records this run: its fingerprint is this run's (or a legacy one's), or its
        config and inputs differ from them only in number types. A library call before 2026-11-26 recorded an
        int given for a float field (``lora_alpha=32``) as an int, where the CLI and now the library record
        32.0: the same run, which read as changed and needed --force."""
        if m["stage"] != self.stage:
            return False
        if m["fingerprint"] in self._same_run:
            return True
        recorded = _numbers_as_floats({"config": m.get("config"), "inputs": m.get("inputs")})
        return any(recorded == _numbers_as_floats(_as_recorded(c, i))
                   for c in (self.config, *self.legacy_configs) for i in (self.inputs, *self.legacy_inputs))

    # ---- work directory ----------------------------------------------------------------
    def writer_lock_path(self) -> Path:
        """A resumable run's writer lock: beside its partial directory, not inside it, so the lock
        stays held (and findable) until the directory has been renamed into ``out``."""
        part = self._partial_name()
        return part.with_name(part.name + ".lock")

    def partial_dir(self) -> Path:
        """Where a resumable run of these arguments keeps its work until it is renamed into ``out``."""
        return self._partial_name()

    def _partial_name(self) -> Path:
        if self.resumable:
            return self.out.parent / f".{self.out.name}.partial-{self.fingerprint[:16]}"
        return self._tmp_name()

    def _tmp_name(self) -> Path:
        # pid + host: a stale temp dir is one whose process is dead *on this host*; on a shared
        # file system another node's live run must not be swept away.
        # and the process's start (_own_id): its pid alone may be a live unrelated process's by the next run
        return self.out.parent / f".{self.out.name}.tmp-{_own_id()}-{uuid.uuid4().hex[:8]}-{_HOST}"

    def partial_dirs(self) -> list[Path]:
        """The partial directories beside ``out`` of resumable runs into it, whatever their arguments."""
        return sorted(p for p in self.out.parent.glob(self._sibling_glob("partial")) if p.is_dir())

    def _warn_of_other_partials(self) -> None:
        """A resumable run that starts afresh beside partial directories of other arguments says so: a
        user who changed a flag after an interrupt took the start-over for a resume (trial, session 42)."""
        others = [p.name for p in self.partial_dirs() if p != self.work]
        if others:
            warnings.warn(QerlWarning(
                f"{', '.join(others)} beside {self.out} hold{'s' if len(others) == 1 else ''} an unfinished run "
                "made with other arguments; this run starts afresh (rerun that run's command to resume it, "
                "or delete the directory)"), stacklevel=4)

    def _sibling_glob(self, kind: str) -> str:
        """The pattern of this output's own ``.<name>.<kind>-*`` siblings: the name escaped, or an --out named
        "run [1]" or "q?" missed its own stale temp dirs and swept up (deleted, or renamed into itself) another
        output's (.run 1.old-*, .qa.old-*)."""
        return f".{glob.escape(self.out.name)}.{kind}-*"

    def _old_name(self, work: Path) -> Path:
        """Where a replace by two renames puts the old output: ``.<name>.old-ID`` for the new one's ``.<name>.tmp-ID``,
        so a run killed between the renames is finished by the next, which finds the new output by that name."""
        prefix = f".{self.out.name}.tmp-"
        ident = work.name[len(prefix):] if work.name.startswith(prefix) else uuid.uuid4().hex[:8]
        return self.out.parent / f".{self.out.name}.old-{ident}"

    def _swapped_in_by(self, old: Path) -> Path | None:
        """The finished new output a replace killed between its renames left beside ``old`` (``_old_name``), or None
        (an older qerl's ``.<name>.old-RANDOM``; a new one damaged since)."""
        new = self.out.parent / f".{self.out.name}.tmp-{old.name[len(f'.{self.out.name}.old-'):]}"
        m = read_manifest(new)
        return new if m is not None and damaged_output(new, m) is None else None

    def _recover_interrupted_swap(self) -> None:
        """A kill between the two renames of a non-atomic replace leaves ``out`` missing, the old output under
        ``.<name>.old-ID`` and the finished new one under ``.<name>.tmp-ID``: finish the swap (until 2026-11-28 the
        old output was put back and the finished redo deleted as a dead run's temp dir). Without a new one (an older
        qerl's swap, named otherwise) the old output is put back. Under the lock the swap itself holds."""
        if self.out.exists() or not self.out.parent.is_dir():
            return
        olds = list(self.out.parent.glob(self._sibling_glob("old")))
        if not olds:
            return
        with _DirLock(self.out.parent):
            if self.out.exists():  # another rank (torchrun's check one --out together) did it meanwhile
                return
            news = [n for n in map(self._swapped_in_by, olds) if n is not None]
            found = news or [p for p in olds if read_manifest(p) is not None]
            if not found:
                return
            try:
                os.replace(max(found, key=lambda p: p.stat().st_mtime), self.out)
            except OSError:
                # torchrun's ranks check one --out together: another rank put it back first (this one died in
                # os.replace, a traceback, and torchrun stopped the rest; a review)
                if not self.out.exists():
                    raise
        _fsync_dir(self.out.parent)

    def _clean_stale(self) -> None:
        if next(self.out.parent.glob(self._sibling_glob("old")), None) is not None:
            # Under the lock the swap holds: a live replace by two renames parks the old output here between them,
            # and puts it back if the second fails (this sweep deleted it there: --out left missing; review s60r10)
            with _DirLock(self.out.parent):
                for p in self.out.parent.glob(self._sibling_glob("old")):
                    shutil.rmtree(p, ignore_errors=True)
        for p in self.out.parent.glob(self._sibling_glob("tmp")):
            parts = p.name[len(f".{self.out.name}.tmp-"):].split("-", 2)  # not at a '.tmp-' in --out's own name
            host = parts[2] if len(parts) > 2 else _HOST
            if host == _HOST and _gone(parts[0]) and not self._resume_staged(p):
                shutil.rmtree(p, ignore_errors=True)

    def _resume_staged(self, tmp: Path) -> bool:
        """Put back at the partial name a dead run's ``tmp`` that holds this resumable run finished, staged for a
        --force swap that a kill cut short (``_swap_locked``): the sweep deleted it, and the rerun generated every
        group (problem) again (kill hunt, session 59). Not the output a swap replaced, which the exchange leaves at
        that temp name until it is deleted: of this same run where a --force redid its own arguments, and the next
        --force resumed it and put it back over the finished redo (review s59r12). A staged redo is newer than --out.
        Returns whether it did."""
        part = self.partial_dir()
        if not self.resumable or part.exists() or (read_manifest(tmp) or {}).get("fingerprint") != self.fingerprint:
            return False
        if _written_after(self.out / MANIFEST, tmp / MANIFEST):  # --out is the redo that replaced it
            return False
        try:
            os.rename(tmp, part)
        except OSError:
            return False
        return True

    def __enter__(self) -> Path:
        try:
            _make_dirs(self.out.parent)
            self._recover_interrupted_swap()
            self._clean_stale()
            if self._seen is _UNSEEN:  # a caller that did not ask already_done(): what is there now
                m = read_manifest(self.out)
                self._seen = m["fingerprint"] if m is not None else None
            self.work = self._partial_name()
            if self.resumable and not self.work.exists():
                self._warn_of_other_partials()
            self.work.mkdir(parents=True, exist_ok=self.resumable)
        except OSError as e:
            raise self.write_error(e) from None
        crash_point("stage-start")
        return self.work

    def __exit__(self, exc_type, exc, tb) -> bool:
        assert self.work is not None
        if exc_type is None:
            self.timings.setdefault("total_s", round(time.time() - self._t0, 3))
            crash_point("before-manifest")
            try:
                self.manifest = self._write_manifest(self.work)
                crash_point("before-rename")
                self._swap_into_place(self.work)
                _COMPLETE.append(self.out)
                crash_point("after-rename")
                return False
            except BaseException as e:  # noqa: BLE001 - cleaned up, then re-raised (or made one line)
                exc = e
                if self._in_place():
                    if self.out not in _COMPLETE:
                        # A SIGTERM during the rename (or the exchange) into --out is raised as the call returns, before
                        # _swap_locked notes the output: the CLI said "--out was not written" of a complete output, and
                        # a rollout or eval named its partial directory, gone (kill hunt, session 60). After an exchange
                        # the work dir holds the old output, which the clean-up below deletes as the swap would have.
                        _COMPLETE.append(self.out)
                    self._finish_stopped_swap()
        if not self.resumable:
            shutil.rmtree(self.work, ignore_errors=True)
        if _is_write_error(exc):
            raise self.write_error(exc) from None
        if exc_type is None:
            raise exc
        return False

    def _finish_stopped_swap(self) -> None:
        """What a swap stopped after its rename still owes: the fsync of --out's parent that makes the rename durable,
        and, after the two renames of the NFS path (a signal held over them is raised as they end), deleting the old
        output parked at .OUT.old-ID (left there, GBs, until a next run into that --out; review s60r10)."""
        _fsync_dir(self.out.parent)
        if self._old is not None and (self._old.exists() or self._old.is_symlink()):
            if self._old.is_dir() and not self._old.is_symlink():
                shutil.rmtree(self._old, ignore_errors=True)
            else:
                self._old.unlink(missing_ok=True)
            _fsync_dir(self.out.parent)

    def _in_place(self) -> bool:
        """Whether ``out`` holds this run's output, whatever cut the swap short after its rename: the manifest this
        run wrote is there (the same file, its device and inode, which the renames keep; an equal dict could be an
        earlier run's of the same arguments)."""
        if self._manifest_id is None:
            return False
        try:
            st = os.stat(self.out / MANIFEST)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._manifest_id

    def drop_work_if_nothing_kept(self, pattern: str) -> None:
        """A resumable run stopped (an error, Ctrl-C) before it saved anything its rerun could resume (no file
        matching ``pattern`` with bytes in its partial directory) leaves nothing behind; otherwise the directory
        stays for that rerun."""
        if self.work is not None and self.work.is_dir() and not any(p.stat().st_size for p in self.work.glob(pattern)):
            shutil.rmtree(self.work, ignore_errors=True)

    def write_error(self, e: BaseException) -> OutputWriteError:
        where = getattr(e, "filename", None) or self.out
        kept = f" (its finished {KEPT_FOR_RERUN.get(self.stage, 'groups')} are kept for a rerun)" if self.resumable else ""
        blocker = file_in_the_way(Path(where)) if getattr(e, "errno", None) in (errno.EEXIST, errno.ENOTDIR) else None
        if blocker is not None:  # was "File exists", with a hint about space and permissions
            return OutputWriteError(f"cannot write {self.out}: {blocker} is a file, not a directory; nothing was "
                                    f"left at --out{kept}", hint="choose another --out, or move that file away")
        if getattr(e, "errno", None) == errno.EBUSY:  # the rename into a mount point already_done could not tell
            # (a bind mount of the same file system): a traceback after all the work
            return OutputWriteError(f"cannot replace {self.out}: it is busy, a mount point (or in use); nothing was "
                                    f"written there{kept}", hint="name a directory inside it as --out")
        return OutputWriteError(f"cannot write {self.out}: {getattr(e, 'strerror', None) or e} ({where}); nothing was "
                                f"left at --out{kept}", hint="free space or fix the permissions, then rerun")

    def _write_manifest(self, work: Path) -> dict:
        # not a manifest.json.tmp that a run killed while writing it left in a rollout's partial directory
        # (listed, then renamed away: every later rerun called the output damaged, exit 4)
        files = sorted(p for p in work.rglob("*") if p.is_file() and p.name not in (MANIFEST, MANIFEST + ".tmp"))
        digests = sha256_files(files)
        # Every output file on disk before the manifest that vouches for it and the rename that publishes it:
        # fsyncing the manifest and the directory alone let a machine crash (power, kernel panic) leave a
        # renamed-in output whose weights were never written (empty or zero-filled) behind a valid manifest.
        for p in files:
            _fsync_file(p)
        for d in {p.parent for p in files} - {work}:  # a file's name in a subdirectory (work's own: _swap_into_place)
            _fsync_dir(d)
        manifest = {
            "stage": self.stage,
            "qerl_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "fingerprint": self.fingerprint,
            "config": self.config,
            "inputs": self.inputs,
            "outputs": {str(p.relative_to(work)): d for p, d in zip(files, digests)},
            "output_bytes": {str(p.relative_to(work)): p.stat().st_size for p in files},
            "timings": self.timings,
            **(_INVOCATION or {}),
            **self.extra,
        }
        tmp = work / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False, default=str) + "\n")
        _fsync_file(tmp)
        os.replace(tmp, work / MANIFEST)
        st = os.stat(work / MANIFEST)
        self._manifest_id = (st.st_dev, st.st_ino)
        return manifest

    def _swap_into_place(self, work: Path) -> None:
        _fsync_dir(work)
        with _DirLock(self.out.parent):
            self._refuse_a_concurrent_output(work)
            self._swap_locked(work)

    def _refuse_a_concurrent_output(self, work: Path) -> None:
        """Another run may have written ``out`` since this one checked it (two runs with different
        flags into one --out both finished, the later silently replacing the other: audit). Only an
        output of this same run, or what was there when this run decided to write, may be replaced."""
        m = read_manifest(self.out)
        if m is None:
            if not (self.out.exists() or self.out.is_symlink()) or _is_empty_dir(self.out):
                return
            now = None  # something that is not a qerl output appeared there: never replaced
        else:
            now = m["fingerprint"]
            if now == self._seen or now in self._same_run:
                return
        raise OutputBusyError(
            f"{self.out} was written by another run while this one ran ({m['stage'] if m else 'no manifest'}, "
            f"fingerprint {str(now)[:12]}); this run's output was not put in its place",
            hint="give each run its own --out" + (f"; this run's finished {KEPT_FOR_RERUN.get(self.stage, 'groups')} stay in {work}, which only a run into "
                                                  f"{self.out} resumes (one with --force, replacing what is there): "
                                                  "delete it otherwise" if self.resumable else ""))

    def _swap_locked(self, work: Path) -> None:
        if self.out.exists() or self.out.is_symlink():
            if self.resumable:
                # The exchange leaves the old output at the temp name: never at the resumable
                # partial name, where a later run would resume from it.
                staged = self._tmp_name()
                try:
                    # in the try: a signal raised as this rename returns moves it back too (review s60r10)
                    os.replace(work, staged)
                    self._replace(staged)
                except BaseException:
                    if staged.is_dir() and read_manifest(staged) == self.manifest:
                        os.replace(staged, work)  # not swapped in: a rerun finds it all done at the partial name
                    elif self._in_place():  # a signal as the exchange returned: staged holds the replaced output
                        shutil.rmtree(staged, ignore_errors=True)
                    raise
                return
            self._replace(work)
        else:
            os.replace(work, self.out)
            # In place from here: a SIGTERM during the fsync below (ms on a network file system) said "--out was
            # not written" of a complete output (a review, session 58)
            _COMPLETE.append(self.out)
        _fsync_dir(self.out.parent)

    def _replace(self, work: Path) -> None:
        """Put the finished ``work`` at the existing ``out`` and delete what was there."""
        if _exchange(work, self.out):
            old = work  # after the exchange the temp name holds the old output
        else:
            old = self._old = self._old_name(work)
            with _signals_held():  # a second Ctrl-C raised inside the handler below undid the swap (review s59r10)
                try:
                    os.replace(self.out, old)
                    crash_point("mid-swap")
                    os.replace(work, self.out)
                except OSError:
                    if not self.out.exists():
                        os.replace(old, self.out)  # the old output back where it was
                    raise
                except BaseException:
                    # A SIGTERM or Ctrl-C between the renames finishes the swap: it was undone by deleting the finished
                    # redo (--out missing until the next run put the old output back). A kill here: the next run does it.
                    if not self.out.exists():
                        os.replace(work, self.out)
                    if not work.exists():
                        _COMPLETE.append(self.out)
                    raise
                _COMPLETE.append(self.out)  # before a signal held meanwhile is raised, as the swap ends
        # The new output is in place: a stop while the old one is deleted (seconds for a large checkpoint), or during
        # the fsync, says --out is complete, not "--out was not written" (nor a resumable stage's partial directory,
        # now gone)
        _COMPLETE.append(self.out)
        _fsync_dir(self.out.parent)
        crash_point("mid-swap")
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
        _fsync_dir(self.out.parent)


@contextlib.contextmanager
def _signals_held():
    """A SIGINT or SIGTERM that comes meanwhile raised as this ends (by the handler it finds there): a swap by two
    renames is not cut between them, nor its repair by a second signal (Ctrl-C twice, a Ctrl-C on Slurm's SIGTERM: the
    second was raised in the handler of _replace before its rename, and the stage's clean-up deleted the finished redo;
    review s59r10). Python's handlers, not a signal mask: a mask holds for its own thread only, and another thread (torch's,
    faulthandler's watchdog) took the signal. The main thread only (Python runs handlers there); a handler set outside
    Python is left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    if None in old.values():
        yield
        return
    for s, handler in old.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if got:
            signal.raise_signal(got[0])


class _DirLock:
    """An exclusive ``flock`` on a directory, held for the final check and swap only (milliseconds).
    Where the file system has no flock (some network mounts) it is skipped: the check still runs."""

    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def __enter__(self):
        try:
            import fcntl  # POSIX only
        except ImportError:
            return self
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError:
            if self.fd is not None:
                os.close(self.fd)
            self.fd = None
        return self

    def __exit__(self, *exc) -> bool:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
        return False


def file_in_the_way(path: Path) -> Path | None:
    """The nearest of ``path`` and its parents that exists as something other than a directory."""
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)


def _is_write_error(e: BaseException | None) -> bool:
    if isinstance(e, OSError):
        return e.errno in _WRITE_ERRNOS
    # safetensors reports the OS error in its own exception type: "... (os error 28)"
    return type(e).__name__ == "SafetensorError" and any(f"(os error {n})" in str(e) for n in _WRITE_ERRNOS)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_renameat2 = None


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    global _renameat2
    if _renameat2 is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2 = fn
        except (OSError, AttributeError):
            _renameat2 = False
    if not _renameat2:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False  # kernel or file system without RENAME_EXCHANGE: fall back to two renames
    raise OSError(err, os.strerror(err), str(b))


def copy_beside(path: Path) -> Path:
    """The name of a rewritten copy of the file ``path``, written beside it and renamed over it: this process's
    and host's, after the copies dead processes of this host left there are removed (a run killed between
    writing its copy and the rename left ``.metrics.jsonl.tmp-PID`` beside the run's metrics for good; session 58).
    Another host's copy may be a live run's on a shared file system: it stays. Best effort, as ``_clean_stale``: a copy
    this user may not remove (another user's, in a shared sticky directory) failed the rewrite, exit 7, at every rerun."""
    for p in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):
        owner, _, host = p.name.rsplit(".tmp-", 1)[1].partition("-")  # host: none in a copy made before 2026-11-28
        if (host or _HOST) == _HOST and _gone(owner) and p.is_file():
            try:
                p.unlink(missing_ok=True)
            except OSError:
                pass
    return path.with_name(f".{path.name}.tmp-{_own_id()}-{_HOST}")


def _written_after(a: Path, b: Path) -> bool:
    """Whether file ``a`` was last written after file ``b`` (False where either cannot be read)."""
    try:
        return a.stat().st_mtime_ns > b.stat().st_mtime_ns
    except OSError:
        return False


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and next(path.iterdir(), None) is None


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _make_dirs(path: Path) -> None:
    """``mkdir -p``, each new directory's name fsynced in its parent: the rename into place is fsynced in the output's
    parent only, so a machine crash could lose a new run/step-000012 from run/ with the finished output in it."""
    new = []
    while not path.exists() and path != path.parent:
        new.append(path)
        path = path.parent
    if new:
        new[0].mkdir(parents=True, exist_ok=True)
    for d in reversed(new):
        _fsync_dir(d.parent)


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


class WriterLock:
    """An exclusive lock a resumable run (rollout, eval) holds from before its partial directory is
    opened until after it is renamed into ``--out``, so a second writer (a Slurm job requeued while the
    old one still runs, the same command started twice) is refused (exit 8) instead of interleaving
    its records.

    The lock file sits beside the partial directory. Inside it, it had to be deleted before the
    manifest was hashed, and from then to the rename (seconds for a large shard) a second run
    opened a new lock file, was admitted, and wrote into the same directory (audit, 2026-11-26).
    ``flock`` is released by the kernel however the holder dies, so a crashed run never blocks its
    resume. A run admitted after another finished this very output stops with exit 8, too.
    """

    def __init__(self, out: StageOutput):
        self.out, self.path, self.f = out, out.writer_lock_path(), None
        self.held = False  # an exclusive flock taken (not on a file system without flock, nor without fcntl)

    def __enter__(self):
        try:
            import fcntl  # POSIX only: elsewhere the final swap's own check is what remains
        except ImportError:
            return self
        busy = OutputBusyError(f"another qerl {self.out.stage} is writing {self.out.out} right now",
                               hint="wait for it, or stop it; this run resumes where it stops")
        for _ in range(8):
            try:
                _make_dirs(self.path.parent)
                self.f = open(self.path, "a+")
            except OSError as e:
                raise self.out.write_error(e) from None
            try:
                fcntl.flock(self.f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):  # no flock on this file system
                    return self
                self.f.close()
                self.f = None
                raise busy from None
            if self._still_the_file():
                self.held = True
                break
            self.f.close()  # locked a file its holder deleted on the way out: take the one at the path now
            self.f = None
        else:
            raise busy
        if self.out.finished_meanwhile():  # finished by a run that held the lock before this one took it
            self._release()
            raise OutputBusyError(f"{self.out.out} was finished by another qerl {self.out.stage} while this one "
                                  "started", hint="nothing to do: a rerun reports it done")
        return self

    def _still_the_file(self) -> bool:
        """Whether the locked descriptor is still the file at the path (not one deleted since it was opened)."""
        try:
            return os.stat(self.path).st_ino == os.fstat(self.f.fileno()).st_ino
        except FileNotFoundError:
            return False

    def _release(self) -> None:
        if self.f is None:
            return
        # Deleted while held: a run that had opened it finds it gone once it gets the lock and retries
        # (``_still_the_file``); one that opens a new file then finds --out done, or resumes.
        self.path.unlink(missing_ok=True)
        self.f.close()
        self.f = None

    def __exit__(self, *exc) -> bool:
        self._release()
        return False


def sweep_leftover_partial(out: StageOutput, still=None) -> bool:
    """Remove this run's partial directory beside an ``--out`` that already holds the run: an interrupted
    ``--force`` redo left it there, and no later run without --force would ever resume or remove it (a
    review). Only under the writer lock: a redo still running keeps its directory. ``still()``, where given, judges
    it again under the lock (what it holds may have changed since the caller looked). Returns whether it removed one."""
    part = out.partial_dir()
    if not part.exists() and not out.writer_lock_path().exists():
        return False
    try:
        # the lock alone too: a run killed after its rename, before removing its lock file, left it for good (session 59)
        with WriterLock(out) as lock:
            # without flock (NFS without lockd) a live redo's directory cannot be told apart; gone meanwhile (a run
            # that held the lock finished it): nothing removed
            if lock.held and part.is_dir() and (still is None or still()):
                shutil.rmtree(part, ignore_errors=True)
                return True
    except OutputExistsError:
        pass  # another run of this stage holds it: leave it alone
    except OutputWriteError:
        # a lock file this user may not open (another user's, a read-only mount): a tidy-up, as the stale temp dirs'
        # sweep; since the lock alone is swept, an "already done" rerun there failed, exit 7 (review s59r12)
        pass
    return False


def partial_dir_of(out: StageOutput, config: dict[str, Any]) -> Path:
    """The partial directory beside ``out`` of a resumable run of ``config`` (same stage and inputs)."""
    return StageOutput(out.out, out.stage, config=config, inputs=out.inputs, resumable=True).partial_dir()


def sweep_partial_of(out: StageOutput, config: dict[str, Any], still=None) -> Path | None:
    """Remove the partial directory beside ``out`` of a run of ``config`` (same stage and inputs) that the finished
    ``out`` made obsolete (eval: the same eval stopped on another device, whose partial directory is named by that
    device), as ``sweep_leftover_partial`` does: under that run's writer lock, never while a live run writes it, and
    only where ``still()`` (if given) says so under that lock. Returns the directory removed, or None."""
    other = StageOutput(out.out, out.stage, config=config, inputs=out.inputs, resumable=True)
    if other.fingerprint == out.fingerprint or not other.partial_dir().is_dir():
        return None
    return other.partial_dir() if sweep_leftover_partial(other, still) else None
