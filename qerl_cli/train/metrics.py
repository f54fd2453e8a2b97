"""Per-step statistics: accumulated per token on each rank, reduced once, written as JSON lines.

``Accumulator`` keeps named sums, minima and maxima; ``reduce`` all-reduces each kind in one
collective (three in all), so multi-GPU metrics cost nothing per micro-batch. ``append_jsonl``
writes one line per step with ``O_APPEND`` in a single write, so another writer's line never lands
inside it, and fsyncs it (where it can be). ``--metrics-file`` is one run's file all the same: train-step replaces a step's earlier
line (``_append_metrics``), so a second run logging there replaces the first's lines of
the same step numbers.

The train-step stage's record: ``_metrics`` makes it from the step's data and the reduced ``Accumulator`` (the line
of the output's ``metrics.jsonl``, the manifest's ``metrics``); ``_append_metrics`` adds it to ``--metrics-file``
once the step's output is in place, and ``_ensure_metrics_line`` on an "already done" rerun where a kill lost it.
"""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qerl_cli.errors import OutputWriteError
from qerl_cli.outputs import _fsync_dir, copy_beside

if TYPE_CHECKING:
    from qerl_cli.train.inputs import StepData
    from qerl_cli.train_step import TrainStepConfig


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
    """Append ``record`` as one line and fsync it (the file's name too, where this append made it): a step's line
    after its output (fsynced before its rename) was lost by a machine crash while the output stayed, and a resumed
    run reruns only its last finished step (``_ensure_metrics_line``), so an earlier step's line was gone for good.
    One fsync a step (ms; a step takes seconds to hours)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    made = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        n = os.write(fd, line)
        if n != len(line):
            # A short write is how a full disk answers an append that fits only in part (no error): the
            # torn line stayed and the step ended with exit 0. Take the part back and fail as ENOSPC would.
            os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR) - n)
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (wrote {n} of {len(line)} bytes)", str(path))
        _fsync_if_it_can(fd)
    finally:
        os.close(fd)
    if made:
        _fsync_dir(path.parent)


def _fsync_if_it_can(fd: int) -> None:
    """``os.fsync(fd)``, where the file can be synced at all: ``--metrics-file /dev/null`` (a device), a pipe and a file
    system without fsync say EINVAL (or ENOTSUP): the line is written, there is nothing to sync, and the step stays
    done (the fsync added on 2026-11-28 failed every step, "already done" reruns too, exit 7: a review). A failed
    sync (EIO, ENOSPC) is still an error."""
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
            raise


def _metrics(cfg, data: StepData, adv, groups, live_tokens, acc, losses, grad_norms, lrs, step_time, peak, step) -> dict:
    """The step's metrics record, from ``acc`` once reduced over the ranks."""
    rewards = torch.tensor(data.rewards, dtype=torch.float64)
    clen = torch.tensor(data.completion_lengths, dtype=torch.float64)  # every record's: the others' arrays are gone
    total_tokens = (sum(data.prompt_lengths) + int(clen.sum())) * cfg.epochs
    n = acc.sums.get("tokens", 0.0)
    mean = (lambda k: acc.sums.get(k, 0.0) / n if n else None)  # noqa: E731
    rec = {
        "step": step,
        "loss": losses[0],
        "loss_last_epoch": losses[-1],
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "zero_variance_groups": adv.zero_variance_fraction,
        "groups": adv.num_groups,
        "completions": len(data.records),
        "skipped_bad_lines": len(data.bad_lines),
        "advantage_abs_mean": float(adv.values.abs().mean()),
        "entropy": mean("entropy"),
        "clip_ratio_low": acc.mean("clip_low", "clip_tokens"),
        "clip_ratio_high": acc.mean("clip_high", "clip_tokens"),
        "is_ratio_mean": mean("is_ratio"),
        "is_ratio_min": acc.mins.get("is_ratio"),
        "is_ratio_max": acc.maxs.get("is_ratio"),
        "is_capped_fraction": mean("is_capped") if cfg.tis_cap else None,
        "logprob_abs_diff_mean": mean("lp_abs_diff"),
        "logprob_abs_diff_max": acc.maxs.get("lp_abs_diff"),
        "kl": mean("kl") if cfg.beta > 0 else None,
        "completion_length_mean": float(clen.mean()),
        "completion_length_min": int(clen.min()),
        "completion_length_max": int(clen.max()),
        "truncated_fraction": float(sum(data.truncated) / len(data.truncated)),
        "trained_tokens": int(sum(live_tokens)),
        "grad_norm": grad_norms[0],  # epoch 1's, like loss and lr
        "grad_norm_per_epoch": grad_norms if len(grad_norms) > 1 else None,
        "lr": lrs[0],
        "lr_per_epoch": lrs if len(lrs) > 1 else None,
        "micro_batches": len(groups),
        "tokens_per_s": total_tokens / step_time if step_time > 0 else None,
        "step_time_s": step_time,  # the optimisation loop (model loading is load_time_s)
        "peak_gpu_memory_gib": peak,
        "aqn_sigma": float(data.noise["sigma"]) if data.noise else 0.0,
    }
    return clean({k: v for k, v in rec.items() if v is not None or k in ("kl", "peak_gpu_memory_gib")})


def _append_metrics(path: Path, metrics: dict) -> None:
    """--metrics-file after the step is in place, one line per step: a redone step (--force, or its
    output removed and run again) replaces its earlier line, which a reader of "one line per step"
    took for a second run (a trial's FORCE=1 rerun left 6 lines for 3 steps). The file system refusing
    it is exit 7, one line."""
    try:
        _drop_step_lines(path, metrics["step"])
        append_jsonl(path, metrics)
    except OSError as e:
        raise OutputWriteError(f"cannot append to --metrics-file {path}: {e.strerror or e} (the step's output at "
                               "--out is complete; a rerun adds the line)", hint="fix the path, then rerun") from None


def _drop_step_lines(path: Path, step: int) -> None:
    """Rewrite ``path`` (atomically) without its lines for ``step``, ending on a newline; torn or foreign
    lines stay."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)

    def of_step(line: str) -> bool:
        try:
            rec = json.loads(line)
        except ValueError:
            return False
        # a train-step metrics line (not another tool's JSON line that also has a "step")
        return isinstance(rec, dict) and rec.get("step") == step and "loss" in rec and "group_id" not in rec

    kept = [x for x in lines if not of_step(x)]
    torn = bool(kept) and not kept[-1].endswith("\n")
    if torn:
        kept[-1] += "\n"  # a torn last line (a kill mid-append) stays a line of its own, not glued to ours
    if len(kept) == len(lines) and not torn:
        return
    tmp = copy_beside(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(kept))
            f.flush()
            _fsync_if_it_can(f.fileno())  # a machine crash after the rename must not leave an empty file
        os.replace(tmp, path)
        _fsync_dir(path.parent)  # the rename too: lost, the line appended next went to the file it replaced
    except BaseException:  # a full disk, or a SIGTERM (Slurm) here, left the half-written copy beside the file
        tmp.unlink(missing_ok=True)
        raise


def _ensure_metrics_line(cfg: TrainStepConfig, manifest: dict) -> None:
    """A run killed after its output was in place, before the --metrics-file append, left the step's
    line out for good (every rerun is "already done"): the rerun appends it from the manifest."""
    metrics = manifest.get("metrics")
    if cfg.metrics_file is None or not metrics or int(os.environ.get("RANK", "0")) != 0:  # torchrun: rank 0 writes
        return
    path = Path(cfg.metrics_file)
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line) == metrics:
                    return
            except ValueError:
                continue  # a torn line of another step: not this one
    _append_metrics(path, metrics)
