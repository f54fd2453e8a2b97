"""torchrun support: process group setup, micro-batch ownership, gradient and stats all-reduce.

``torchrun --nproc-per-node N -m qerl_cli train-step ...`` starts N copies of the same step.
Every rank reads the same shards, each parsing about 1/N of their lines and sharing what it found
(``train.inputs.read_step``), builds the same micro-batch list (packing is deterministic), and takes
micro-batches ``rank, rank + N, ...`` (longest-first order, so the load is roughly even), reading only
those micro-batches' token arrays (``train.inputs._keep_owned``). Losses are
pre-normalized for the whole step (see ``qerl_cli.train.losses``), so the gradients of all ranks
are *summed*, not averaged, and each rank then takes the same optimizer step on identical
gradients: the result equals a single-process run up to float summation order.

This is hand-rolled rather than DDP because only a few MB of LoRA gradients move, once per
optimizer step (one flat bucket), and ranks may own different numbers of micro-batches, which
DDP's per-backward hooks do not allow. Backend: NCCL on CUDA, gloo on CPU. Rank 0 alone writes
the output; the others wait for its outcome (``main_outcome``), so nobody exits before the directory
is in place, and a failure there ends every rank with rank 0's exit code.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialized_here: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def owns(self, microbatch_index: int) -> bool:
        return microbatch_index % self.world_size == self.rank

    def all_reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.enabled:
            with self._collective():
                dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return t

    @contextlib.contextmanager
    def _collective(self):
        """A collective that fails because another rank stopped (its error, an out-of-memory or a bad shard line
        that only it saw, went to stderr): gloo raised "Connection closed by peer" here, a traceback with exit 1,
        usually before the failed rank had exited, so torchrun named this rank, exit 1, as the root cause and the
        real exit code was lost (a review). This rank now waits a moment for torchrun to see the failed rank and
        stop this one (SIGTERM: exit 143), then ends with one line."""
        try:
            yield
        except RuntimeError as e:
            from qerl_cli.errors import QerlError

            time.sleep(PEER_WAIT_S)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            err = QerlError(f"rank {self.rank}: another torchrun rank stopped mid-step (its error is in the log); "
                            f"nothing was written by this rank ({first})")
            err.exit_code = 1
            raise err from None

    def all_reduce_grads_(self, params: list[torch.Tensor]) -> None:
        """Sum the gradients of ``params`` over ranks in one flat fp32 bucket."""
        if not self.enabled:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        with self._collective():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        off = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[off : off + n].view_as(p).to(p.dtype)
            off += n

    def main_outcome(self, failure: BaseException | None, device: str) -> None:
        """Every rank learns whether rank 0's write succeeded (it writes alone). The others waited in a
        bare barrier, and when rank 0 failed they died in gloo with a traceback (exit 1), which torchrun
        could name as the failure (audit, 2026-11-26). Rank 0 re-raises its own error; the others raise a
        one-line error carrying its exit code."""
        if not self.enabled:
            if failure is not None:
                raise failure
            return
        from qerl_cli.errors import QerlError

        code = 0 if failure is None else getattr(failure, "exit_code", _interrupt_code(failure))
        t = torch.tensor([code], dtype=torch.int64, device=device if device.startswith("cuda") else "cpu")
        try:
            code = int(self.all_reduce_(t, "max"))
        except QerlError:
            if failure is not None:  # this rank's own error, not the lost peer's
                raise failure from None
            raise
        if failure is not None:
            raise failure
        if code:
            err = QerlError(f"rank 0 could not finish the step's output (exit {code}); see rank 0's error")
            err.exit_code = code
            raise err

    def agree(self, settings: dict) -> None:
        """Refuse a step whose ranks were started with different flags or inputs (``settings``: JSON values).
        Each rank ran its own: with --micro-batch-tokens 200 on one and 2000 on the other, the ranks summed
        gradients of different micro-batch plans and wrote a wrong adapter with exit 0, which a rerun with
        the right flags then called "already done" (the flag is not in the fingerprint; a review)."""
        if not self.enabled:
            return
        mine = json.dumps(settings, sort_keys=True, default=str)
        why = disagreement([json.loads(v) for v in self.all_gather_object(mine)])
        if why:
            from qerl_cli.errors import BadInputError

            raise BadInputError(f"torchrun ranks disagree: {why}", hint="start every rank with the same flags and inputs")

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order."""
        if not self.enabled:
            return [obj]
        every: list = [None] * self.world_size
        with self._collective():
            dist.all_gather_object(every, obj)
        return every

    def barrier(self) -> None:
        if self.enabled:
            with self._collective():
                dist.barrier()

    def close(self) -> None:
        if self.initialized_here and dist.is_initialized():
            dist.destroy_process_group()


PEER_WAIT_S = 5.0  # torchrun looks at its ranks every 0.1 s by default (--monitor-interval)

DERIVED = ("fingerprint", "micro_batches")  # named after the flags: a flag that differs changes them too


def disagreement(per_rank: list[dict]) -> str | None:
    """The first setting whose value differs between ranks (flags before ``DERIVED``), with every rank's value;
    None when all agree."""
    keys = sorted(set().union(*per_rank), key=lambda k: (k in DERIVED, k))
    diff = [k for k in keys if len({json.dumps(d.get(k), sort_keys=True) for d in per_rank}) > 1]
    if not diff:
        return None
    k = diff[0]
    values = ", ".join(f"rank {r} {d.get(k)!r}" for r, d in enumerate(per_rank))
    more = f" (and {len(diff) - 1} more: {', '.join(diff[1:4])})" if len(diff) > 1 else ""
    return f"{k}: {values}{more}"


def main_by_environment() -> bool:
    """Whether this process is rank 0 of what ``setup`` joins (alone when WORLD_SIZE <= 1, whatever RANK says)."""
    return int(os.environ.get("WORLD_SIZE", "1")) <= 1 or int(os.environ.get("RANK", "0")) == 0


def _env_int(name: str, default: str | None = None) -> int:
    from qerl_cli.errors import BadInputError

    value = os.environ.get(name, default)
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise BadInputError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')} asks for a torchrun process group, but "
                            f"{name} is {'not set' if value is None else repr(value)}",
                            hint="start several ranks with torchrun, or unset WORLD_SIZE for one process") from None


def setup(device: str) -> Dist:
    """Join the torchrun process group if the environment asks for one (WORLD_SIZE > 1)."""
    world = _env_int("WORLD_SIZE", "1")
    if world <= 1:
        return Dist()
    rank = _env_int("RANK")
    local = _env_int("LOCAL_RANK", str(rank))
    if dist.is_initialized():
        return Dist(dist.get_rank(), dist.get_world_size(), local, False)
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # torch's ValueError was a traceback (a review)
        if not os.environ.get(name):
            _env_int(name)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(local)
    with _default_signals():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    return Dist(rank, world, local, True)


@contextlib.contextmanager
def _default_signals():
    """SIGTERM and Ctrl-C end the process while it waits for the other ranks to join: the stage's Python handlers
    never ran inside that C++ wait, so a rank whose peers never came (WORLD_SIZE set by hand) outlived `timeout`'s
    SIGTERM and Ctrl-C for the process group's 30 minutes (a review). Nothing is written yet to clean up."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_DFL) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _interrupt_code(failure: BaseException) -> int:
    """Exit code of an error without one: 143 for SIGTERM (``cli.Terminated``), 130 for Ctrl-C, else 1."""
    from qerl_cli.cli import interrupt_outcome

    return interrupt_outcome(failure)[1] if isinstance(failure, KeyboardInterrupt) else 1
