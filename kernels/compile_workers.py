"""Compile Triton kernels in worker processes, from exactly what a launch would have compiled in this one.

``compile_ahead`` first compiled on a pool of threads, and 16 CPUs overlapped the compiles only 2-3x:
Triton's front end and its MLIR passes hold Python's lock, so only ptxas, a subprocess, ran in parallel
(docs/benchmarks.md, "Compiling ahead"). Here each compile goes to a worker process instead, which writes
the kernel into Triton's on-disk cache; the launch that follows in the parent finds it there and only
loads it. The request is what the launch's ``JITFunction._do_compile`` holds (signature, constexprs,
options, attributes, target), sent by pickle with the kernel's module and name, and the worker rebuilds
the same ``ASTSource`` and calls ``triton.compile`` as the parent would have: the same cache key, so a
mismatch can only cost a compile in the parent, never a wrong kernel.

Trade-offs, and how they are kept small:
- Workers are forks of this process, made when the first kernel turns out to be missing from the disk
  cache (``cached_on_disk`` checks first, as ``compile`` does): a machine whose cache is warm forks none.
  A fork starts at once with every module already imported; a fresh interpreter spent 6 s importing torch,
  Triton and the kernel modules on the H100 host, more than the compiles it then ran (docs/benchmarks.md).
- A fork of a process that holds a CUDA context and other threads is safe only for a child that never
  touches CUDA and avoids the locks other threads may have held at the fork (Python re-creates its
  import lock in the child; stdio's are replaced here): the child compiles for an explicit target
  (Triton then needs no driver, so it makes no CUDA call and takes no GPU memory), writes to fresh
  devnull files, ignores Ctrl-C (the parent decides), closes every descriptor but its two pipe ends (a
  sibling's pipe held open would never see its end) and leaves by ``os._exit``.
- A kernel that cannot be shipped (defined inside a function, a constexpr that does not pickle), a
  worker that fails, or a platform without ``os.fork`` leaves the kernel to the caller to compile in
  process, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import pickle
import queue
import signal
import struct
import sys
import threading
import time
import warnings
from concurrent.futures import Future


def shippable(fn) -> tuple[str, str] | None:
    """(module, name) a worker can import ``fn`` (a JITFunction) by, or None."""
    inner = getattr(fn, "fn", None)
    module, name = getattr(inner, "__module__", None), getattr(inner, "__qualname__", "")
    if not module or "<" in name or module == "__main__":
        return None
    try:
        return (module, name) if _resolve(module, name) is fn else None
    except (ImportError, AttributeError):
        return None


def _resolve(module: str, name: str):
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _source(fn, signature, constexprs, attrs):
    from triton.compiler import ASTSource

    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource

        return GluonASTSource(fn, signature, constexprs, attrs)
    return ASTSource(fn, signature, constexprs, attrs)


def cached_on_disk(fn, signature, constexprs, options: dict, attrs, target) -> bool:
    """Whether ``triton.compile`` would find this kernel in the on-disk cache (its own first steps)."""
    from triton.compiler.compiler import (
        get_cache_invalidating_env_vars,
        get_cache_key,
        get_cache_manager,
        make_backend,
    )

    src = _source(fn, signature, constexprs, attrs)
    backend = make_backend(target)
    parsed = backend.parse_options(dict(options, **src.parse_options()))
    key = get_cache_key(src, backend, parsed, env_vars=get_cache_invalidating_env_vars())
    name = f"{src.name[:150]}.json"
    group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(name) or {}
    return group.get(name) is not None


def _compile(module, name, signature, constexprs, options, attrs, target) -> bool:
    """In a worker: compile into the on-disk cache; True where it missed the cache (a real compile)."""
    import triton

    fn = _resolve(module, name)
    missed = []
    compilation = getattr(getattr(triton, "knobs", None), "compilation", None)
    if compilation is not None and hasattr(compilation, "listener"):
        compilation.listener = lambda *a, **k: missed.append(not k.get("cache_hit", False))
    triton.compile(_source(fn, signature, constexprs, attrs), target=target, options=options)
    return any(missed)


def _read(stream):
    head = stream.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(n))


def _write(stream, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _serve(requests, answers) -> None:
    """A worker's loop: a request in, ``(ok, missed or error text)`` out, until the pipe closes."""
    while (job := _read(requests)) is not None:
        try:
            _write(answers, (True, _compile(*job)))
        except Exception as e:  # noqa: BLE001 - the caller compiles it again and raises there
            _write(answers, (False, f"{type(e).__name__}: {e}"))


def _child(requests: int, answers: int) -> None:
    """The forked worker: keep only its two pipe ends (a sibling's or the parent's pipe held open here
    would never see its end), write nothing where the parent writes, stop only when told."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the parent decides
        for sig in signal.valid_signals():  # the parent's Python handlers (a trainer's SIGTERM checkpoint) are not
            with contextlib.suppress(OSError, ValueError):  # the worker's: their signals act as by default here
                if sig != signal.SIGINT and callable(signal.getsignal(sig)):
                    signal.signal(sig, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        for fd in _open_fds():
            if fd > 2 and fd not in (requests, answers):
                with contextlib.suppress(OSError):
                    os.close(fd)
        sys.stdout = sys.stderr = open(os.devnull, "w")  # fresh objects: a parent thread may hold the old locks
        warnings.simplefilter("ignore")
        _own_hash_locks()
        _serve(os.fdopen(requests, "rb"), os.fdopen(answers, "wb"))
        code = 0
    finally:
        os._exit(code)


def _own_hash_locks() -> None:
    """In the child: a Triton function's ``_hash_lock`` may have been held at the fork by a parent thread that
    does not exist here (the parent hashes each function as it first checks the disk cache), and would then
    block its compile here for good. Each function gets a lock of the child's own on first use; one whose
    lock was held also drops its hash, which may have been caught half-made, and hashes it again."""
    try:
        from triton.runtime.jit import JITCallable
    except ImportError:  # an older Triton: no lock
        return

    def own(self):
        d = self.__dict__
        if "_child_hash_lock" not in d:
            inherited = d.get("_hash_lock")
            if inherited is not None and not inherited.acquire(blocking=False):
                self.hash = None
            d["_child_hash_lock"] = threading.RLock()
        return d["_child_hash_lock"]

    JITCallable._hash_lock = property(own, lambda self, lock: self.__dict__.__setitem__("_hash_lock", lock))


def _open_fds() -> list[int]:
    try:
        return [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:  # not Linux: the usual range
        return list(range(3, 1024))


_FORK = threading.Lock()  # one fork at a time, so that each child knows every pipe it must close


class WorkerPool:
    """At most ``size`` worker processes, started on the first request and stopped by ``close``.
    ``submit`` returns a Future of True (compiled), False (was cached) or an exception."""

    def __init__(self, size: int):
        self.size = size
        self.jobs: queue.Queue = queue.Queue()
        self.threads: list[threading.Thread] = []
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()
        self.closed = self.dead = False

    def submit(self, job: tuple) -> Future:
        pickle.dumps(job)  # a value that does not pickle is refused here, in the caller's thread
        future: Future = Future()
        with self.lock:
            if self.closed:
                raise RuntimeError("the compile workers are closed")
            self.jobs.put((job, future))
            if len(self.threads) < self.size:
                t = threading.Thread(target=self._feed, name=f"qerl-compile-proc-{len(self.threads)}", daemon=True)
                self.threads.append(t)
                t.start()
        return future

    def _start(self) -> _Worker:
        with _FORK:
            if self.dead:
                raise TimeoutError("compile workers timed out")
            req_r, req_w = os.pipe()
            ans_r, ans_w = os.pipe()
            with warnings.catch_warnings():  # 3.12 warns of fork beside threads; the child runs no CUDA, no lock
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                _child(req_r, ans_w)
            os.close(req_r)
            os.close(ans_w)
            worker = _Worker(pid, os.fdopen(req_w, "wb"), os.fdopen(ans_r, "rb"))
            self.workers.append(worker)
        return worker

    def _feed(self) -> None:
        worker = None
        while (item := self.jobs.get()) is not None:
            job, future = item
            if self.dead:
                future.set_exception(TimeoutError("compile workers timed out"))
                continue
            try:
                worker = worker or self._start()
                _write(worker.requests, job)
                answer = _read(worker.answers)
                if answer is None:
                    raise RuntimeError("compile worker exited")
                ok, value = answer
                future.set_result(value) if ok else future.set_exception(RuntimeError(value))
            except Exception as e:  # noqa: BLE001 - a dead worker fails its job; the next job starts another
                future.set_exception(e)
                if worker is not None:
                    worker.stop(kill=True)
                    worker = None
        if worker is not None:
            worker.stop()

    def close(self, timeout: float = 600.0) -> None:
        """Stop the workers once the queued jobs are done; past ``timeout`` seconds (a compiler that
        hangs), kill them: their unfinished jobs fail, and the caller compiles those itself."""
        with self.lock:
            self.closed = True
            threads = list(self.threads)
        for _ in threads:
            self.jobs.put(None)
        deadline = time.monotonic() + timeout
        try:
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            if not any(t.is_alive() for t in threads):
                return
        except BaseException:  # Ctrl-C while waiting: the workers stop now too (and the join it broke may
            self._kill(threads)  # have marked a running feeder stopped, Python 3.11: no is_alive test here)
            raise
        self._kill(threads)

    def _kill(self, threads) -> None:
        with _FORK:
            self.dead = True  # the feeders fail what is left instead of starting workers again
        for w in list(self.workers):
            if not w.reaped:  # a reaped worker's pid may be another process's by now
                w.kill()
        for t in threads:
            t.join()


class _Worker:
    """A forked worker's pid and the parent's ends of its two pipes."""

    def __init__(self, pid: int, requests, answers):
        self.pid, self.requests, self.answers = pid, requests, answers
        self.reaped = False

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def stop(self, kill: bool = False) -> None:
        """Close its pipes (it then exits) and reap it."""
        if kill:
            self.kill()
        for f in (self.requests, self.answers):
            with contextlib.suppress(OSError):
                f.close()
        if not self.reaped:
            self.reaped = True
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
