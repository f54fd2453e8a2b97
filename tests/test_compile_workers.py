"""qerl_kernels.compile_workers: a kernel compiled in a worker process lands in Triton's on-disk cache under
the key this process computes, so its launch here only loads it; a worker's failure or hang fails its
job and nothing else. No GPU needed: the worker compiles for an sm_90 ``GPUTarget`` ahead of time."""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")
compile_workers = pytest.importorskip("qerl_kernels.compile_workers")



def _wait_for_file(path, patience: float = 120) -> None:
    """Wait until ``path`` exists (a job in a worker made it: the job has reached the worker). A fixed `sleep 0.5`
    for that found no worker yet on a loaded machine (CI's 2 cores shared with other jobs)."""
    import time

    end = time.monotonic() + patience
    while not path.exists():
        assert time.monotonic() < end, f"no {path.name} after {patience} s"
        time.sleep(0.05)

def _dequant_job():
    """A real qerl kernel's compile request, as ``JITFunction._do_compile`` would hold it."""
    from qerl_kernels.dequant import _nvfp4_dequant_kernel as k
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    sig = {"PW": "*i64", "S": "*u8", "G": "*fp32", "W": "*bf16", "N": "i32", "KW": "i32", "stride_pw": "i32",
           "stride_sn": "i32", "stride_wn": "i32"}
    consts = {"BN": 32, "BKW": 8, "FAST": True, "EPI": 0, "TWIDDLED": False, "BLOCKED": False}
    sig.update(dict.fromkeys(consts, "constexpr"))
    constexprs = {(k.arg_names.index(n),): v for n, v in consts.items()}
    options = make_backend(target).parse_options({"num_warps": 4}).__dict__
    return k, (*compile_workers.shippable(k), sig, constexprs, dict(options), {}, target)


def test_a_kernel_a_worker_compiles_is_a_disk_cache_hit_here(tmp_path, monkeypatch):
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    k, job = _dequant_job()
    _, _, sig, constexprs, options, attrs, target = job
    assert not compile_workers.cached_on_disk(k, sig, constexprs, options, attrs, target)
    pool = compile_workers.WorkerPool(2)
    try:
        assert pool.submit(job).result(timeout=300) is True  # compiled: missed the cache
        assert pool.submit(job).result(timeout=300) is False  # the second time it was there
    finally:
        pool.close()
    assert compile_workers.cached_on_disk(k, sig, constexprs, options, attrs, target)
    heard = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: heard.append(kw["cache_hit"]))
    triton.compile(ASTSource(k, sig, constexprs, attrs), target=target, options=options)
    assert heard == [True]


def test_a_failed_job_fails_alone_and_the_next_one_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    _, job = _dequant_job()
    pool = compile_workers.WorkerPool(1)
    try:
        bad = pool.submit(("qerl_kernels.no_such_module", "kernel", *job[2:]))
        good = pool.submit(job)
        with pytest.raises(RuntimeError, match="no_such_module"):
            bad.result(timeout=300)
        assert good.result(timeout=300) is True
    finally:
        pool.close()


def test_a_hung_worker_is_killed_at_close_and_its_job_fails(tmp_path, monkeypatch):
    import time

    started = tmp_path / "started"
    monkeypatch.setattr(compile_workers, "_compile", lambda *job: started.touch() or time.sleep(120))  # the fork inherits it
    pool = compile_workers.WorkerPool(1)
    future = pool.submit(("m", "f", {}, {}, {}, {}, None))
    _wait_for_file(started)  # it forked and took the job
    t0 = time.monotonic()
    pool.close(timeout=1.0)
    assert time.monotonic() - t0 < 30
    with pytest.raises(Exception):  # noqa: B017 - killed: the pipe closes, whatever the error's class
        future.result(timeout=0)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(("m", "f", {}, {}, {}, {}, None))
    _assert_reaped(pool)


def _assert_reaped(pool):
    import os

    for w in pool.workers:
        with pytest.raises(ChildProcessError):
            os.waitpid(w.pid, os.WNOHANG)


def test_workers_exit_when_closed_and_hold_no_pipe_of_each_other(monkeypatch):
    """Each worker must close its siblings' pipe ends, or closing a pipe would never end its worker."""
    import os
    import time

    monkeypatch.setattr(compile_workers, "_compile", lambda *job: time.sleep(0.3) or os.getpid())
    pool = compile_workers.WorkerPool(3)
    futures = [pool.submit(("m", "f", {}, {}, {}, {}, None)) for _ in range(6)]
    pids = {f.result(timeout=60) for f in futures}
    assert len(pids) >= 2 and os.getpid() not in pids  # ran side by side, elsewhere
    t0 = time.monotonic()
    pool.close(timeout=60)
    assert time.monotonic() - t0 < 10
    _assert_reaped(pool)


def test_only_kernels_importable_by_name_are_shipped():
    from qerl_kernels.dequant import _nvfp4_dequant_kernel

    assert compile_workers.shippable(_nvfp4_dequant_kernel) == ("qerl_kernels.dequant", "_nvfp4_dequant_kernel")

    def factory():
        @triton.jit
        def local(X):
            pass
        return local

    assert compile_workers.shippable(factory()) is None
    assert compile_workers.shippable(object()) is None


def test_a_value_that_does_not_pickle_is_refused_in_the_callers_thread():
    import threading

    pool = compile_workers.WorkerPool(1)
    with pytest.raises(Exception):  # noqa: B017 - pickle's error class varies with the value
        pool.submit(("m", "f", {}, {(0,): threading.Lock()}, {}, {}, None))
    assert not pool.threads  # nothing started
    pool.close()


def test_a_function_being_hashed_by_another_thread_at_the_fork_still_compiles_under_the_parents_key(
        tmp_path, monkeypatch):
    """The parent hashes each function (under its ``_hash_lock``) as it first checks the disk cache, while the
    feeders fork: a worker forked then inherited the lock held by a thread it does not have, and hung for
    good on its next job for that function (until close's timeout, 600 s by default)."""
    import threading
    import time

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    k, job = _dequant_job()
    _, _, sig, constexprs, options, attrs, target = job
    real = k.cache_key
    holding, release = threading.Event(), threading.Event()

    def hashing():  # as the parent's cache_key does, caught half-way by the fork
        with k._hash_lock:
            k.hash = "recursion:half-made"
            holding.set()
            release.wait()
            k.hash = real

    t = threading.Thread(target=hashing)
    t.start()
    holding.wait()
    pool = compile_workers.WorkerPool(1)
    try:
        future = pool.submit(job)
        time.sleep(1.0)  # the feeder forks meanwhile
        release.set()
        t.join()
        assert future.result(timeout=120) is True
    finally:
        pool.close(timeout=5)
    assert compile_workers.cached_on_disk(k, sig, constexprs, options, attrs, target)  # the parent's own key


def test_an_interrupt_while_close_waits_stops_the_workers(monkeypatch):
    """Ctrl-C while ``compile_only``'s exit waits in ``close`` (where the compile time is spent): the workers,
    which ignore SIGINT, went on through every queued job."""
    import signal
    import threading
    import time

    class Interrupt(BaseException):
        pass

    def interrupt(*_):
        raise Interrupt

    monkeypatch.setattr(compile_workers, "_compile", lambda *job: time.sleep(0.5) or True)
    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        pool = compile_workers.WorkerPool(1)
        futures = [pool.submit(("m", "f", {}, {}, {}, {}, None)) for _ in range(40)]
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        with pytest.raises(Interrupt):
            pool.close(timeout=60)
        timer.join()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    time.sleep(1.0)
    assert sum(f.done() for f in futures) == 40  # failed at once, not compiled one by one
    _assert_reaped(pool)


def test_a_timed_out_close_signals_no_pid_it_reaped_already(tmp_path, monkeypatch):
    import time

    started = tmp_path / "started"
    monkeypatch.setattr(compile_workers, "_compile",
                        lambda *job: os._exit(3) if job[0] == "crash" else started.touch() or time.sleep(120))
    pool = compile_workers.WorkerPool(2)
    crashed = pool.submit(("crash", "f", {}, {}, {}, {}, None))
    with pytest.raises(RuntimeError, match="exited"):
        crashed.result(timeout=60)
    hung = pool.submit(("m", "f", {}, {}, {}, {}, None))
    _wait_for_file(started)
    reaped = [w.pid for w in pool.workers if w.reaped]
    assert reaped
    signalled = []
    real_kill = os.kill
    monkeypatch.setattr(os, "kill", lambda pid, sig: signalled.append(pid) or real_kill(pid, sig))
    pool.close(timeout=1.0)
    assert hung.exception(timeout=0) is not None
    assert not set(signalled) & set(reaped)  # that pid may belong to another process by now


def test_the_parents_signal_handlers_do_not_run_in_a_worker(tmp_path, monkeypatch):
    """A SIGTERM reaching the workers (Slurm signals every process of the step) ran the parent's Python handler
    there (a trainer's checkpoint save, in a fork that may not touch CUDA); now it ends the worker, whose job
    then fails and is compiled by the caller."""
    import signal
    import time

    log, started = tmp_path / "handler.log", tmp_path / "started"
    # The job marks that the worker runs it (its signal handling set up): a `sleep 0.5` found no worker yet, or the
    # fork before it had reset the parent's handler, on a loaded machine.
    monkeypatch.setattr(compile_workers, "_compile", lambda *job: started.touch() or time.sleep(120))
    previous = signal.signal(signal.SIGTERM, lambda *_: log.open("a").write(f"{os.getpid()}\n"))
    try:
        pool = compile_workers.WorkerPool(1)
        future = pool.submit(("m", "f", {}, {}, {}, {}, None))
        _wait_for_file(started)
        (worker,) = pool.workers
        os.kill(worker.pid, signal.SIGTERM)
        with pytest.raises(RuntimeError, match="exited"):
            future.result(timeout=30)
        pool.close(timeout=30)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not log.exists()
