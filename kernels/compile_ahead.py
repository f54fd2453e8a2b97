"""Compile the Triton kernels a piece of host code would launch, side by side, before it launches them.

A machine's first rollout used to compile its engine's kernels one after the other as the warm-up reached
each (36-43 variants for a 7B engine of 256 sequences: decode steps for every captured batch size, prefill
buckets, LoRA paths), and building that engine took 39-42 s on an H100 host instead of 6-7 s with the
kernels cached (docs/benchmarks.md, "Compiling ahead"). Inside ``compile_only()`` every Triton launch of
this thread becomes a compile request instead, and nothing is launched. A kernel missing from Triton's
on-disk cache goes to a forked worker process (``compile_workers``), which compiles it into that cache;
leaving the block waits for the workers and loads each kernel into its function's in-memory cache, so the
real run that follows only looks them up. Everything else (kernels already on disk, any a worker cannot
take) goes to Triton's own asynchronous compile mode (``triton.runtime._async_compile``, the hook
PyTorch's inductor uses) on a thread pool, which was the whole mechanism at first: threads overlapped the
compiles only ~3x on 16 CPUs, as Triton's compiler passes hold Python's lock, and halved the engine build
to 20-23 s; the worker processes took it to 11-14 s on an empty cache (H100, 2026-11-27).

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
try:
    from . import compile_workers
except ImportError:  # pragma: no cover - imported under another name (tests' kernels.*)
    compile_workers = None


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
    """What a ``compile_only`` block did: the launched functions' names in launch order (repeats included);
    how many kernels went to worker processes, live inside the block (each was missing from the on-disk
    cache); and how many compiles missed that cache (None where this Triton has no compilation listener
    to tell), complete once the block has exited."""

    launched: list[str] = field(default_factory=list)
    sent: int = 0
    compiled: int | None = None


@contextlib.contextmanager
def compile_only(workers: int | None = None, processes: int | None = None):
    """Within the block, Triton launches made by this thread compile instead of running; on exit, every
    compile has finished and its kernel sits in its function's cache. Kernels missing from the on-disk
    cache compile in up to ``processes`` forked worker processes (``compile_workers``; default
    ``default_processes()``, 0 for none) and are loaded from that cache as the block ends; the rest, and
    any a worker cannot take or failed, compile on ``workers`` threads. A compile that failed there too
    is not raised here: the kernel is left uncompiled, so its first real launch compiles it again and
    raises there. Yields a ``CompileStats``. Another thread's launches run as usual; a second block at the same
    time, from any thread, is refused (RuntimeError)."""
    if not available():
        raise RuntimeError("this Triton has no asynchronous compile mode (triton.runtime._async_compile)")
    if not _ACTIVE.acquire(blocking=False):
        raise RuntimeError("compile_only is already active (one block at a time per process)")
    try:
        stats = CompileStats()
        original_run, original_compile = _jit.JITFunction.run, _jit.JITFunction._do_compile
        processes = default_processes() if processes is None else processes
        can_fork = compile_workers is not None and hasattr(os, "fork")
        pool = compile_workers.WorkerPool(processes) if processes > 0 and can_fork else None
        sent: dict = {}  # (function, in-memory key) -> (the worker's Future, the rest of _do_compile's arguments)
        with ThreadPoolExecutor(max_workers=workers or default_workers(), thread_name_prefix="qerl-compile") as threads:
            mode = _async_compile.AsyncCompileMode(threads, **_quiet_failures())

            def compile_instead(self, *args, grid, warmup, **kwargs):
                if _async_compile.active_mode.get() is not mode:  # another thread: launch as usual
                    return original_run(self, *args, grid=grid, warmup=warmup, **kwargs)
                stats.launched.append(getattr(self, "__name__", repr(self)))
                return original_run(self, *args, grid=grid, warmup=True, **kwargs)

            def compile_elsewhere(self, key, signature, device, constexprs, options, attrs, warmup):
                if pool is not None and _async_compile.active_mode.get() is mode:
                    if (self, key) in sent:
                        return None
                    future = _to_worker(pool, self, device, signature, constexprs, options, attrs)
                    if future is not None:
                        sent[self, key] = future, (signature, device, constexprs, options, attrs, warmup)
                        stats.sent += 1
                        return None
                return original_compile(self, key, signature, device, constexprs, options, attrs, warmup)

            _jit.JITFunction.run, _jit.JITFunction._do_compile = compile_instead, compile_elsewhere
            try:
                with _counting_cache_misses(stats), mode, _zero_filled_allocations():
                    try:
                        yield stats
                    except BaseException:
                        if pool is not None:
                            pool.close(timeout=0)  # the caller is leaving: stop the workers now
                        raise
                    if pool is not None:
                        pool.close()
                        stats.compiled = _count_worker_compiles([f for f, _ in sent.values()], stats.compiled)
                        # Load each into its function's in-memory cache under the launch's own key, as the
                        # thread path leaves it: the launches that follow then never look at the disk (a
                        # kernel that missed there, or failed in its worker, compiles on the threads now).
                        for (fn, key), (_, (signature, device, constexprs, options, attrs, warmup)) in sent.items():
                            original_compile(fn, key, signature, device, constexprs, options, attrs, warmup)
            finally:
                _jit.JITFunction.run, _jit.JITFunction._do_compile = original_run, original_compile
                # Triton 3.5/3.6's __exit__ raises a failed compile before it clears the mode, which would
                # leave this thread compiling into a shut-down pool for good.
                if _async_compile.active_mode.get() is mode:
                    _async_compile.active_mode.set(None)
    finally:
        _ACTIVE.release()


def default_processes() -> int:
    """Compile worker processes: ``QERL_COMPILE_PROCESSES`` (a whole number >= 0; 0 compiles on threads
    only), else the CPUs this process may use, at most 16 (forks of this process: each copies only the
    memory pages it writes)."""
    env = os.environ.get("QERL_COMPILE_PROCESSES", "").strip()
    if env:
        if not env.isdigit():
            raise ValueError(f"QERL_COMPILE_PROCESSES must be a whole number >= 0, got {env!r}")
        return int(env)
    return min(16, default_workers())


def _to_worker(pool, fn, device, signature, constexprs, options, attrs):
    """Send one compile to the workers: its Future, or None where the kernel is in the on-disk cache
    already (loading it here is cheap) or cannot be shipped (the thread path compiles it)."""
    name = compile_workers.shippable(fn)
    if name is None:
        return None
    try:
        target = fn.device_caches[device][2]
        if compile_workers.cached_on_disk(fn, signature, constexprs, options.__dict__, attrs, target):
            return None
        return pool.submit((*name, signature, constexprs, dict(options.__dict__), attrs, target))
    except Exception:  # noqa: BLE001 - whatever this Triton does differently, the thread path still works
        return None


def _count_worker_compiles(futures, compiled: int | None) -> int | None:
    """``compiled`` plus the workers' real compiles (a failed one is compiled again on the threads)."""
    done = sum(1 for f in futures if f.exception() is None and f.result())
    return done if compiled is None else compiled + done


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

