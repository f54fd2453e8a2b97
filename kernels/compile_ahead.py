"""Compile the Triton kernels a piece of host code would launch, side by side, before it launches them.

A machine's first rollout used to compile ~100 kernel variants one after the other as the engine's warm-up
reached each (decode steps for every captured batch size, prefill buckets, LoRA paths): ~35-40 s on an
H100 host (docs/benchmarks.md, "RL loop"), most of it ptxas, which runs as a subprocess and so needs no
Python lock. Inside ``compile_only()`` every Triton launch is turned into a compile request for Triton's
own asynchronous compile mode (``triton.runtime._async_compile``, the hook PyTorch's inductor uses) on a
thread pool, and nothing is launched; leaving the block waits for every compile and puts the finished
kernels in each function's in-memory cache (and Triton's on-disk one), so the real run that follows only
looks them up.

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
import os
from concurrent.futures import ThreadPoolExecutor

import torch

try:
    from triton.runtime import _async_compile
    from triton.runtime import jit as _jit
except ImportError:  # pragma: no cover - Triton missing or too old
    _async_compile = _jit = None


def available() -> bool:
    """Whether this Triton has the asynchronous compile mode ``compile_only`` builds on."""
    return (_async_compile is not None and hasattr(_async_compile, "AsyncCompileMode")
            and hasattr(_jit.JITFunction, "_do_compile"))


def default_workers() -> int:
    """Compile threads: ``QERL_COMPILE_THREADS``, else the CPUs this process may use, at most 32."""
    env = os.environ.get("QERL_COMPILE_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(32, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


@contextlib.contextmanager
def compile_only(workers: int | None = None):
    """Within the block, Triton launches compile (on ``workers`` threads) instead of running; on exit,
    every compile has finished and its kernel is cached. Yields a list that collects the launched
    functions' names, in launch order (repeats included)."""
    if not available():
        raise RuntimeError("this Triton has no asynchronous compile mode (triton.runtime._async_compile)")
    launched: list[str] = []
    functions: dict[int, object] = {}
    original = _jit.JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        launched.append(getattr(self, "__name__", repr(self)))
        functions[id(self)] = self
        return original(self, *args, grid=grid, warmup=True, **kwargs)

    with ThreadPoolExecutor(max_workers=workers or default_workers(), thread_name_prefix="qerl-compile") as pool:
        _jit.JITFunction.run = compile_instead
        try:
            with _async_compile.AsyncCompileMode(pool), _zero_filled_allocations():
                yield launched
        finally:
            _jit.JITFunction.run = original
            _unwrap_futures(functions.values())


_ALLOCATORS = ((torch, "empty"), (torch, "empty_like"), (torch, "empty_strided"), (torch.Tensor, "new_empty"))


@contextlib.contextmanager
def _zero_filled_allocations():
    """``torch.empty`` & co. return zero-filled tensors inside the block (what a skipped kernel leaves)."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in _ALLOCATORS]

    def zeroing(allocate):
        @functools.wraps(allocate)
        def allocate_zeros(*args, **kwargs):
            return allocate(*args, **kwargs).zero_()
        return allocate_zeros

    try:
        for owner, name, allocate in saved:
            setattr(owner, name, zeroing(allocate))
        yield
    finally:
        for owner, name, allocate in saved:
            setattr(owner, name, allocate)


def _unwrap_futures(functions) -> None:
    """Replace each cached placeholder (FutureKernel) by its finished kernel: later launches then skip the
    placeholder's attribute forwarding; a compile that failed leaves no entry, so a later launch retries
    it and raises its error where the kernel runs."""
    for fn in functions:
        for caches in getattr(fn, "device_caches", {}).values():
            cache = caches[0]
            for key, kernel in list(cache.items()):
                if isinstance(kernel, _async_compile.FutureKernel):
                    done = kernel.result(ignore_errors=True)
                    if done is None:
                        cache.pop(key, None)
                    else:
                        cache[key] = done
