"""Where an eval was generated, and what that makes of other devices' runs of it.

A finished eval's samples are the eval's on any device: the device's kind is in the fingerprint (``cuda``, not
``cuda:1``: a node's GPUs alike, as rollout's; a stopped eval resumes only on that kind, or its new samples would carry
another device's numerics beside the kept ones, and only on the GPU model its partial directory records:
``check_made_on_this_gpu``), but a rerun on a CPU node of an eval a GPU node finished prints or rescores it rather
than exit 4 (``made_elsewhere``; also how an output older qerl made, whose fingerprint named the GPU's index, is done).
The dtype decides: the same dtype, or under --dtype auto the one auto gives on the device that made it (``counts_as_made``). Once --out
holds the eval finished, the partial directories of the same eval stopped on other devices are obsolete: each records
the device, dtype and --dtype flag that made it (``MADE_ON``), and ``sweep_other_devices_partials`` removes those the
finished eval stands for, judged again under their writer locks.
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

from qerl_cli.errors import BadInputError, OtherGpuModelError, QerlWarning
from qerl_cli.outputs import StageOutput, WriterLock, partial_dir_of, read_manifest, sweep_partial_of


def made_elsewhere(cfg, config: dict, stage: str) -> tuple[str, str] | None:
    """(device, dtype) of the finished eval at --out where they are not this run's and it is still this run's eval
    (the other flags and inputs are StageOutput's to compare): the device never decides (the samples a GPU node
    generated are the eval's on a CPU node too, where a rerun prints or scores them again: it exited 4 as "made from
    different arguments"), the dtype where it is this run's or, under --dtype auto, the one auto gives on that device
    (bf16 on a GPU). Not with --force (the eval generated here), nor for a stopped eval's partial directory, which is
    named by the device's kind: resumed on another, its new samples would carry that device's numerics beside the kept
    ones. Also an older qerl's output of this eval on ``cuda:1`` (its fingerprint named the index until 2026-11-28)."""
    if cfg.force:
        return None
    m = read_manifest(cfg.out) or {}
    old = m.get("config") if m.get("stage") == stage else None
    if not isinstance(old, dict) or not isinstance(old.get("device"), str) or not isinstance(old.get("dtype"), str):
        return None
    device, dtype = old["device"], old["dtype"]
    if (device, dtype) == (config["device"], config["dtype"]):
        return None
    return (device, dtype) if counts_as_made(cfg.dtype, config["dtype"], device, dtype) else None


def counts_as_made(dtype_flag: str, dtype: str, made_device: str, made_dtype: str) -> bool:
    """Whether an eval finished on ``made_device`` in ``made_dtype`` is the eval of a command of ``--dtype dtype_flag``
    (resolved to ``dtype`` where it runs): the same dtype, or under --dtype auto the one auto gives on that device."""
    from qerl_cli.runtime import resolve_dtype

    return made_dtype == dtype or (dtype_flag == "auto" and made_dtype == resolve_dtype("auto", made_device)[0])


# What --device may resolve to (runtime.resolve_device), which qerl before 2026-11-28 named its partial directories by:
# the devices one that records none may have been made on, found by trying each (named by its run's fingerprint alone).
DEVICES = ("cpu", "cuda", *(f"cuda:{i}" for i in range(64)))
# In a partial directory only (removed before the manifest): the device, dtype and --dtype flag of the run writing it.
# The fingerprint holds the dtype --dtype resolved to, not the flag: a GPU's bf16 eval of --dtype auto is obsolete
# once a CPU's fp32 one is finished at --out (that command finds it done there), one of --dtype bf16 is not.
MADE_ON = ".made_on.json"


def record_made_on(work: Path, dtype_flag: str, config: dict, gpu: str | None = None) -> None:
    """Record in the partial directory where and by which --dtype its samples are generated (``MADE_ON``), and the
    model of the GPU generating them (``runtime.gpu_model``; None on a CPU): what a resume must match
    (``check_made_on_this_gpu``)."""
    (work / MADE_ON).write_text(json.dumps({"device": config["device"], "dtype": config["dtype"],
                                            "dtype_flag": dtype_flag, "gpu": gpu}) + "\n")


def check_made_on_this_gpu(so: StageOutput, model: str | None) -> None:
    """Refuse to resume this eval's partial directory where it records another GPU model than this run's ``model``
    (an A100 node resuming an H100's over a shared file system: two kernels' roundings in one eval); with --force it
    starts afresh, said. One that records none (a CPU's, an older qerl's), or a GPU CUDA cannot name, resumes."""
    part = so.partial_dir()
    made = _recorded_gpu(part) if model is not None else None
    if made is None or made == model:
        return
    if not so.force:
        raise OtherGpuModelError(f"{part} holds this eval stopped on {made!r}, another GPU model than this {model!r} "
                                "(other numerics): its kept problems are not resumed here",
                                hint="rerun it on a GPU of that model to resume it, or pass --force to start it afresh here")
    warnings.warn(QerlWarning(f"{part} held this eval stopped on {made!r}: started afresh on this {model!r} (--force)"),
                  stacklevel=3)
    shutil.rmtree(part)


def adopt_indexed_partial(so: StageOutput, device: str, model: str | None) -> None:
    """Take over this eval's partial directory that qerl before 2026-11-28 left named by the GPU's index (``cuda:1``),
    by renaming it to this eval's (named by ``cuda``), under both writer locks: the one left on ``device``, as it
    resumed there; else one of another index that records this run's GPU ``model``, which that qerl resumed under
    --device cuda or auto too (from cc4cca7: started afresh here, it was removed once finished, its problems generated
    twice). Not beside this eval's own (resumed instead), nor one that records no model (a node's GPUs may be of two
    models). A run of that qerl still writing it refuses this one, exit 8."""
    if so.partial_dir().exists() or not so.partial_dirs():
        return
    for d in dict.fromkeys((device, *DEVICES)):
        old = StageOutput(so.out, so.stage, config=dict(so.config, device=d), inputs=so.inputs, resumable=True)
        part = old.partial_dir()
        if old.fingerprint == so.fingerprint or not part.is_dir():
            continue
        if d != device and (model is None or _recorded_gpu(part) != model):
            continue
        with WriterLock(old):
            if part.is_dir():  # not renamed into --out meanwhile by the run that held it
                part.rename(so.partial_dir())
                return


def _recorded_gpu(part: Path) -> str | None:
    """The GPU model a partial directory records (``record_made_on``), or None (a CPU's, an older qerl's)."""
    try:
        gpu = json.loads((part / MADE_ON).read_text()).get("gpu")
    except (OSError, ValueError, AttributeError):  # none there, or not one qerl wrote
        return None
    return gpu if isinstance(gpu, str) else None


def _recorded_made_on(part: Path) -> tuple[str, str, str] | None:
    """(device, dtype, --dtype flag) a partial directory records, or None (made by qerl before 2026-11-28, or
    unreadable)."""
    from qerl_cli.runtime import resolve_dtype

    try:
        made = json.loads((part / MADE_ON).read_text())
        device, dtype, flag = made["device"], made["dtype"], made["dtype_flag"]
        if not all(isinstance(v, str) for v in (device, dtype, flag)) or resolve_dtype(flag, device)[0] != dtype:
            return None
    except (OSError, ValueError, TypeError, KeyError, BadInputError):
        return None
    return device, dtype, flag


def sweep_other_devices_partials(so: StageOutput) -> None:
    """Remove the partial directories of this eval stopped on other devices, once --out holds it finished: the command
    that made one, run there, would find --out done (``made_elsewhere``) and never resume it, so it stayed for good
    beside it (disk, and a warning of an "unfinished run" on every new eval there). Judged by the --dtype that run was
    given, which its directory records (``MADE_ON``): this command's --dtype guessed it, and a CPU's --dtype auto
    eval removed a GPU's stopped --dtype bf16 one, which --force there still resumes. A directory that records none
    (an older qerl's) only where its dtype is --out's, obsolete whatever --dtype made it; never one a live run is
    writing (its writer lock), under which each is judged again before it is removed."""
    made = so.config["device"], so.config["dtype"]  # where the finished eval at --out was generated
    unrecorded: dict[str, str] = {}  # partial directory name -> device, for this eval in --out's dtype on each device

    def obsolete(part: Path) -> dict | None:
        """The config of the stopped run of this eval that ``part`` holds, where --out stands for it, or None."""
        where = _recorded_made_on(part)
        if where is None:
            if not unrecorded:
                unrecorded.update({partial_dir_of(so, dict(so.config, device=d)).name: d for d in DEVICES})
            if part.name not in unrecorded:
                return None  # another eval's, or this one's in another dtype (made by auto, or by that dtype named?)
            where = unrecorded[part.name], made[1], made[1]  # as if named: --out's dtype is its eval whatever made it
        device, dtype, flag = where
        if not counts_as_made(flag, dtype, *made):
            return None  # there, --out is another eval (exit 4): the stopped one may still be resumed with --force
        config = dict(so.config, device=device, dtype=dtype)
        return config if partial_dir_of(so, config) == part else None  # else another eval's (other flags or inputs)

    for part in so.partial_dirs():
        config = obsolete(part)
        if config is None:
            continue
        # Judged again under its writer lock: a run that took it since (--dtype bf16 --force resuming a --dtype auto
        # one) rewrote its record, and a stale verdict removed the problems it saved before it stopped.
        if sweep_partial_of(so, config, still=lambda part=part, config=config: obsolete(part) == config) is not None:
            # said, --quiet or not: one the user may have meant to resume
            print(f"note: removed {part}, this eval stopped on {config['device']} ({config['dtype']}): {so.out} holds "
                  "it finished", file=sys.stderr)
