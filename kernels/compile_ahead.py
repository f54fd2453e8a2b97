"""Compile the Triton kernels a piece of host code would launch, side by side, before it launches them.

A machine's first rollout used to compile its engine's kernels one after the other as the warm-up reached
each (36-43 variants for a 7B engine of 256 sequences: decode steps for every captured batch size, prefill
buckets, LoRA paths), and building that engine took 39-42 s on an H100 host instead of 6-7 s with the
kernels cached (docs/benchmarks.md, "Compiling ahead"). Inside ``compile_only()`` every Triton launch of
this thread becomes a compile request for Triton's own asynchronous compile mode
(``triton.runtime._async_compile``, the hook PyTorch's inductor uses) on a thread pool, and nothing is
launched; leaving the block waits for every compile, and each finished kernel lands in its function's
in-memory cache (and Triton's on-disk one), so the real run that follows only looks them up. The
compiles overlap about 3x on 16 CPUs, not 16x: Triton's compiler passes hold Python's lock, and only
ptxas, a subprocess, runs truly in parallel. That halved the engine build (20-23 s).

The trade-off: host code run inside the block still executes its torch operations, on what the skipped
kernels would have written. So that this is never garbage (an index from uninitialised memory is a
device-side assert, which ends the process's CUDA context: the engine's fp32 test models hit one through
the torch cache write), every tensor ``torch.empty`` and its relatives allocate inside the block comes
zero-filled: skipped kernels leave zeros, and a zero index is in range (the engine's block 0 is its scratch
block). Values read back to the host inside the block are then zeros too, not the real ones; the engine's
steps read none. ``available()`` is False where the installed Triton lacks the asynchronous mode; callers
then run as before.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

try:
    import triton
    from triton.runtime import _async_compile
    from triton.runtime import jit as _jit
except ImportError:  # pragma: no cover - Triton missing or too old
    triton = _async_compile = _jit = None


def available() -> bool:
    """Whether this Triton has the asynchronous compile mode ``compile_only`` builds on."""
    return (_async_compile is not None and hasattr(_async_compile, "AsyncCompileMode")
            and hasattr(_jit.JITFunction, "_do_compile"))


def default_workers() -> int:
    """Compile threads: ``QERL_COMPILE_THREADS`` (a whole number >= 1), else the CPUs this process may use,
    at most 32."""
    env = os.environ.get("QERL_COMPILE_THREADS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"QERL_COMPILE_THREADS must be a whole number >= 1, got {env!r}")
        return int(env)
    return max(1, min(32, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


_ACTIVE = threading.Lock()  # the patches below are process-wide: one block at a time


@dataclass
class CompileStats:
    """What a ``compile_only`` block did: the launched functions' names in launch order (repeats included),
    and how many compiles missed Triton's on-disk cache (None where this Triton has no compilation
    listener to tell), complete once the block has exited."""

    launched: list[str] = field(default_factory=list)
    compiled: int | None = None


@contextlib.contextmanager
def compile_only(workers: int | None = None):
    """Within the block, Triton launches made by this thread compile (on ``workers`` threads) instead of
    running; on exit, every compile has finished and its kernel sits in its function's cache. A compile
    that failed is not raised here: the kernel is left uncompiled, so its first real launch compiles it
    again and raises there. Yields a ``CompileStats``. Another thread's launches run as usual; a second
    block at the same time, from any thread, is refused (RuntimeError)."""
    if not available():
        raise RuntimeError("this Triton has no asynchronous compile mode (triton.runtime._async_compile)")
    if not _ACTIVE.acquire(blocking=False):
        raise RuntimeError("compile_only is already active (one block at a time per process)")
    try:
        stats = CompileStats()
        original = _jit.JITFunction.run
        with ThreadPoolExecutor(max_workers=workers or default_workers(), thread_name_prefix="qerl-compile") as pool:
            mode = _async_compile.AsyncCompileMode(pool, **_quiet_failures())

            def compile_instead(self, *args, grid, warmup, **kwargs):
                if _async_compile.active_mode.get() is not mode:  # another thread: launch as usual
                    return original(self, *args, grid=grid, warmup=warmup, **kwargs)
                stats.launched.append(getattr(self, "__name__", repr(self)))
                return original(self, *args, grid=grid, warmup=True, **kwargs)

            _jit.JITFunction.run = compile_instead
            try:
                with _counting_cache_misses(stats), mode, _zero_filled_allocations():
                    yield stats
            finally:
                _jit.JITFunction.run = original
                # Triton 3.5/3.6's __exit__ raises a failed compile before it clears the mode, which would
                # leave this thread compiling into a shut-down pool for good.
                if _async_compile.active_mode.get() is mode:
                    _async_compile.active_mode.set(None)
    finally:
        _ACTIVE.release()


def _quiet_failures() -> dict:
    """``ignore_errors=True`` where this Triton's AsyncCompileMode takes it (3.6 on; 3.5 has none, and there a
    failed compile raises on exit, after which the mode is still cleared)."""
    params = inspect.signature(_async_compile.AsyncCompileMode.__init__).parameters
    return {"ignore_errors": True} if "ignore_errors" in params else {}


@contextlib.contextmanager
def _counting_cache_misses(stats: CompileStats):
    """Count into ``stats.compiled`` the compiles that miss Triton's on-disk cache (its compilation listener,
    called with ``cache_hit``; any listener already set is still called)."""
    compilation = getattr(getattr(triton, "knobs", None), "compilation", None)
    if compilation is None or not hasattr(compilation, "listener"):
        yield
        return
    previous, lock = compilation.listener, threading.Lock()
    stats.compiled = 0

    def listen(*args, **kwargs):
        if not kwargs.get("cache_hit", False):
            with lock:
                stats.compiled += 1
        if previous is not None:
            previous(*args, **kwargs)

    compilation.listener = listen
    try:
        yield
    finally:
        compilation.listener = previous


_ALLOCATORS = ((torch, "empty"), (torch, "empty_like"), (torch, "empty_strided"), (torch.Tensor, "new_empty"))


@contextlib.contextmanager
def _zero_filled_allocations():
    """``torch.empty`` & co. return zero-filled tensors inside the block (what a skipped kernel leaves)."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in _ALLOCATORS]

    def zeroing(allocate):
        @functools.wraps(allocate)
        def allocate_zeros(*args, **kwargs):
            t = allocate(*args, **kwargs)
            with torch.no_grad():  # a requires_grad leaf refuses an in-place zero_ under autograd
                return t.zero_()
        return allocate_zeros

    try:
        for owner, name, allocate in saved:
            setattr(owner, name, zeroing(allocate))
        yield
    finally:
        for owner, name, allocate in saved:
            setattr(owner, name, allocate)

