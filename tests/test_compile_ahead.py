"""qerl_kernels.compile_ahead: launches become side-by-side compiles, and the engine's captures then compile nothing.

The CPU tests check the patching (Triton's launch entry point is swapped for a compile-only call and put
back, also on an error); the GPU test builds an engine on an empty Triton cache in a fresh process, where
compiles are real, and checks that the warm-up and capture after the dry pass compile nothing and that
the samples equal those of an engine built without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

compile_ahead = pytest.importorskip("qerl_kernels.compile_ahead")
pytestmark = pytest.mark.skipif(not compile_ahead.available(), reason="this Triton has no asynchronous compile mode")


def test_launches_inside_compile_only_ask_for_a_compile_and_the_entry_point_is_restored(monkeypatch):
    from triton.runtime import _async_compile, jit

    calls = []

    def fake_run(self, *args, grid, warmup, **kwargs):
        calls.append((self.__name__, args, grid, warmup, kwargs, _async_compile.active_mode.get() is not None))
        return "kernel"

    monkeypatch.setattr(jit.JITFunction, "run", fake_run)
    fn = type("Fn", (), {"__name__": "k1", "device_caches": {}})()
    with compile_ahead.compile_only(workers=2) as stats:
        assert jit.JITFunction.run(fn, 1, 2, grid=(3,), warmup=False, BLOCK=16) == "kernel"
        jit.JITFunction.run(fn, grid=(1,), warmup=False)
    assert jit.JITFunction.run is fake_run
    assert stats.launched == ["k1", "k1"]
    assert calls[0] == ("k1", (1, 2), (3,), True, {"BLOCK": 16}, True)  # warmup forced, under the async mode
    assert _async_compile.active_mode.get() is None
    jit.JITFunction.run(fn, grid=(1,), warmup=False)
    assert calls[-1][3] is False and calls[-1][5] is False  # outside the block: a plain launch again


def test_an_error_inside_the_block_restores_the_entry_point(monkeypatch):
    from triton.runtime import _async_compile, jit

    original = jit.JITFunction.run
    with pytest.raises(ValueError, match="boom"):
        with compile_ahead.compile_only(workers=1):
            raise ValueError("boom")
    assert jit.JITFunction.run is original and _async_compile.active_mode.get() is None


def _submit(mode, key, compile_fn):
    """Submit one compile to Triton's mode, whatever its version's signature (3.9 adds a cleanup hook)."""
    import inspect

    args = [key, compile_fn, lambda kernel: None]
    if "cleanup_fn" in inspect.signature(mode.submit).parameters:
        args.append(lambda future_kernel: None)
    return mode.submit(*args)


def test_a_failed_compile_is_not_raised_and_leaves_no_mode_behind(monkeypatch):
    """Triton 3.5/3.6 raise a failed compile on leaving the mode before clearing it: every later compile
    of the thread then went to a shut-down pool (review, session 45)."""
    from triton.runtime import _async_compile, jit

    monkeypatch.setattr(jit.JITFunction, "run", lambda self, *a, grid, warmup, **k: None)

    def broken():
        raise RuntimeError("ptxas died")

    with compile_ahead.compile_only(workers=1):
        _submit(_async_compile.active_mode.get(), "k", broken)
        _submit(_async_compile.active_mode.get(), "ok", lambda: "compiled")
    assert _async_compile.active_mode.get() is None
    with compile_ahead.compile_only(workers=1):  # usable again
        assert _submit(_async_compile.active_mode.get(), "ok2", lambda: "kernel").result() == "kernel"


def test_other_threads_launch_as_usual_and_a_second_block_is_refused(monkeypatch):
    import threading

    from triton.runtime import jit

    calls = []
    monkeypatch.setattr(jit.JITFunction, "run", lambda self, *a, grid, warmup, **k: calls.append(warmup))
    fn = type("Fn", (), {"__name__": "k1"})()
    refused = []

    def elsewhere():
        jit.JITFunction.run(fn, grid=(1,), warmup=False)
        try:
            with compile_ahead.compile_only(workers=1):
                pass
        except RuntimeError as e:
            refused.append(str(e))

    with compile_ahead.compile_only(workers=1) as stats:
        jit.JITFunction.run(fn, grid=(1,), warmup=False)
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
    assert calls == [True, False] and stats.launched == ["k1"]
    assert refused and "already active" in refused[0]


def test_compiles_that_miss_the_disk_cache_are_counted_and_the_listener_restored(monkeypatch):
    """The engine skips its other dry passes when the largest step's kernels all came from Triton's cache."""
    import triton

    heard = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **k: heard.append(k["cache_hit"]))
    previous = triton.knobs.compilation.listener
    with compile_ahead.compile_only(workers=1) as stats:
        for hit in (True, False, True, False, False):
            triton.knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=None, cache_hit=hit)
    assert stats.compiled == 3 and heard == [True, False, True, False, False]  # chained to the listener set before
    assert triton.knobs.compilation.listener is previous
    with compile_ahead.compile_only(workers=1) as stats:
        pass
    assert stats.compiled == 0


def test_compile_threads_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("QERL_COMPILE_THREADS", "3")
    assert compile_ahead.default_workers() == 3
    for bad in ("0", "four", "-2"):
        monkeypatch.setenv("QERL_COMPILE_THREADS", bad)
        with pytest.raises(ValueError, match="QERL_COMPILE_THREADS"):
            compile_ahead.default_workers()
    monkeypatch.delenv("QERL_COMPILE_THREADS")
    assert 1 <= compile_ahead.default_workers() <= 32


class _FakePool:
    """compile_workers.WorkerPool's surface: records jobs, answers each with ``answer``."""

    def __init__(self, size, answer=True):
        self.size, self.jobs, self.closed, self.answer = size, [], False, answer

    def submit(self, job):
        from concurrent.futures import Future

        self.jobs.append(job)
        f = Future()
        f.set_exception(self.answer) if isinstance(self.answer, Exception) else f.set_result(self.answer)
        return f

    def close(self, timeout=600.0):
        self.closed, self.timeout = True, timeout


def _fake_kernel(name):
    return type("Fn", (), {"__name__": name, "device_caches": {0: (None, None, "sm90-target", None, None)}})()


def test_kernels_missing_from_the_disk_cache_go_to_the_workers_once_and_the_rest_compile_here(monkeypatch):
    from types import SimpleNamespace

    from qerl_kernels import compile_workers
    from triton.runtime import jit

    here = []
    monkeypatch.setattr(jit.JITFunction, "_do_compile", lambda self, key, *a: here.append((self.__name__, key)) or "k")
    pools = []
    monkeypatch.setattr(compile_workers, "WorkerPool", lambda size: pools.append(_FakePool(size)) or pools[-1])
    monkeypatch.setattr(compile_workers, "shippable", lambda fn: None if fn.__name__ == "local" else ("mod", fn.__name__))
    monkeypatch.setattr(compile_workers, "cached_on_disk", lambda fn, *a: fn.__name__ == "cached")
    missing, cached, local = _fake_kernel("missing"), _fake_kernel("cached"), _fake_kernel("local")
    options = SimpleNamespace(num_warps=4)
    with compile_ahead.compile_only(workers=1, processes=3) as stats:
        for fn in (missing, missing, cached, local, missing):
            assert jit.JITFunction._do_compile(fn, "key1", {"X": "*bf16"}, 0, {(1,): 16}, options, {}, True) in (None, "k")
        jit.JITFunction._do_compile(missing, "key2", {"X": "*fp16"}, 0, {(1,): 32}, options, {}, True)
        assert stats.sent == 2  # live inside the block: the engine's cold-cache test reads it
    (pool,) = pools
    assert pool.size == 3 and pool.closed
    assert pool.jobs == [("mod", "missing", {"X": "*bf16"}, {(1,): 16}, {"num_warps": 4}, {}, "sm90-target"),
                         ("mod", "missing", {"X": "*fp16"}, {(1,): 32}, {"num_warps": 4}, {}, "sm90-target")]
    # A cached kernel loads here and a local one compiles here, at once; the workers' kernels are loaded into
    # their functions' caches under the launches' own keys as the block ends (no launch after it looks at disk).
    assert here == [("cached", "key1"), ("local", "key1"), ("missing", "key1"), ("missing", "key2")]
    assert stats.compiled == 2  # the workers' real compiles (the listener heard none here)
    jit.JITFunction._do_compile(missing, "key3", {}, 0, {}, options, {}, True)  # after the block: as before
    assert here[-1] == ("missing", "key3")


def test_a_kernel_whose_worker_failed_compiles_here_before_the_block_ends(monkeypatch):
    from types import SimpleNamespace

    from qerl_kernels import compile_workers
    from triton.runtime import jit

    monkeypatch.setattr(compile_workers, "WorkerPool", lambda size: _FakePool(size, RuntimeError("ptxas died")))
    monkeypatch.setattr(compile_workers, "shippable", lambda fn: ("mod", fn.__name__))
    monkeypatch.setattr(compile_workers, "cached_on_disk", lambda fn, *a: False)
    here = []
    monkeypatch.setattr(jit.JITFunction, "_do_compile", lambda self, key, *a: here.append(key) or "k")
    with compile_ahead.compile_only(workers=1, processes=2) as stats:
        jit.JITFunction._do_compile(_fake_kernel("k1"), "key", {}, 0, {}, SimpleNamespace(), {}, True)
        assert here == []
    assert stats.sent == 1 and stats.compiled == 0
    assert here == ["key"]  # compiled here as the block ends, ahead of the launches that follow


def test_an_error_in_the_block_stops_the_workers_at_once_and_loads_nothing(monkeypatch):
    from types import SimpleNamespace

    from qerl_kernels import compile_workers
    from triton.runtime import jit

    here, pools = [], []
    monkeypatch.setattr(jit.JITFunction, "_do_compile", lambda self, key, *a: here.append(key) or "k")
    monkeypatch.setattr(compile_workers, "WorkerPool", lambda size: pools.append(_FakePool(size)) or pools[-1])
    monkeypatch.setattr(compile_workers, "shippable", lambda fn: ("mod", fn.__name__))
    monkeypatch.setattr(compile_workers, "cached_on_disk", lambda fn, *a: False)
    with pytest.raises(KeyboardInterrupt):
        with compile_ahead.compile_only(workers=1, processes=2):
            jit.JITFunction._do_compile(_fake_kernel("k1"), "key", {}, 0, {}, SimpleNamespace(), {}, True)
            raise KeyboardInterrupt
    assert pools[0].closed and pools[0].timeout == 0 and here == []


def test_no_worker_is_started_with_processes_zero(monkeypatch):
    from qerl_kernels import compile_workers
    from triton.runtime import jit

    monkeypatch.setattr(compile_workers, "WorkerPool", lambda size: pytest.fail("a pool was made"))
    monkeypatch.setattr(jit.JITFunction, "_do_compile", lambda self, *a: "k")
    with compile_ahead.compile_only(workers=1, processes=0) as stats:
        assert jit.JITFunction._do_compile(_fake_kernel("k1"), "key", {}, 0, {}, None, {}, True) == "k"
    assert stats.sent == 0
    monkeypatch.setenv("QERL_COMPILE_PROCESSES", "0")
    assert compile_ahead.default_processes() == 0
    monkeypatch.setenv("QERL_COMPILE_PROCESSES", "x")
    with pytest.raises(ValueError, match="QERL_COMPILE_PROCESSES"):
        compile_ahead.default_processes()


_ENGINE_RUN = r"""
import json, sys, torch, triton
from qerl_cli.engine import LLMEngine, SamplingParams
from qerl_cli.engine import model_runner
from qerl_cli.models import build_random_model
from qerl_cli.models.config import ModelConfig
from qerl_kernels import compile_ahead

phase = ["build"]
missed = {}  # phase -> compiles in this process that missed the disk cache
def listen(**k):
    if not k["cache_hit"]:
        missed[phase[0]] = missed.get(phase[0], 0) + 1
triton.knobs.compilation.listener = listen
blocks = []  # each compile_only block's stats
real_block = compile_ahead.compile_only
def recorded(*a, **k):
    cm = real_block(*a, **k)
    class Recording:
        def __enter__(self):
            blocks.append(cm.__enter__())
            return blocks[-1]
        def __exit__(self, *exc):
            return cm.__exit__(*exc)
    return Recording()
compile_ahead.compile_only = recorded
for name in ("_compile_ahead", "_capture", "_capture_prefill"):
    real = getattr(model_runner.ModelRunner, name)
    def wrapped(self, *a, _real=real, _name=name, **k):
        phase[0] = _name
        try:
            return _real(self, *a, **k)
        finally:
            phase[0] = "other"
    setattr(model_runner.ModelRunner, name, wrapped)
cfg = ModelConfig(arch="qwen2", vocab_size=1024, hidden_size=512, intermediate_size=1536, num_layers=2, num_heads=8,
                  num_kv_heads=2, head_dim=64, rope_theta=1e6, max_position_embeddings=4096, qkv_bias=True)
model = build_random_model(cfg, device="cuda", dtype=torch.bfloat16, quantized=True, max_positions=512)
engine = LLMEngine(model, None, max_num_seqs=8, max_model_len=200)
phase[0] = "generate"
out = engine.generate([list(range(5, 40)), list(range(50, 120))], SamplingParams(temperature=1.0, max_new_tokens=24,
                      ignore_eos=True, seed=3), n=4)
print(json.dumps({"missed": missed, "blocks": [[len(b.launched), b.sent, b.compiled] for b in blocks],
                  "tokens": [c.token_ids for g in out for c in g]}))
"""


@pytest.mark.gpu
def test_engine_captures_compile_nothing_after_the_dry_pass_and_sample_the_same(tmp_path):
    runs = {}
    for name, flag, procs, cache in (("workers", "1", "", "w"), ("threads", "1", "0", "t"), ("plain", "0", "", "p"),
                                     ("warm", "1", "", "w")):  # warm: the workers' cache again
        env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / cache), QERL_COMPILE_AHEAD=flag,
                   QERL_COMPILE_PROCESSES=procs)
        r = subprocess.run([sys.executable, "-c", _ENGINE_RUN], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = json.loads(r.stdout.strip().splitlines()[-1])
    captures = ("_capture", "_capture_prefill")
    workers, threads, plain, warm = (runs[k] for k in ("workers", "threads", "plain", "warm"))
    # Worker processes: one block, its kernels compiled elsewhere; the captures then only load them.
    (launched, sent, compiled), = workers["blocks"]
    assert sent > 0 and compiled > 0 and not any(workers["missed"].get(p) for p in captures), workers
    # Threads only: the largest step's block, then the rest's; the captures compile nothing either.
    assert len(threads["blocks"]) == 2 and threads["missed"].get("_compile_ahead", 0) > 0, threads
    assert not any(threads["missed"].get(p) for p in captures), threads
    assert plain["missed"].get("_capture", 0) > 0 and not plain["blocks"], plain  # the same work, one by one
    # A warm cache: only the largest step's dry pass ran, no worker started, nothing compiled anywhere.
    (w_launched, w_sent, w_compiled), = warm["blocks"]
    assert w_sent == 0 and w_compiled == 0 and 0 < w_launched < launched, (warm, workers)
    assert not any(warm["missed"].values()), warm
    assert workers["tokens"] == threads["tokens"] == plain["tokens"] == warm["tokens"]


def test_allocations_inside_the_block_are_zero_filled_and_restored_after(monkeypatch):
    import torch
    from triton.runtime import jit

    monkeypatch.setattr(jit.JITFunction, "run", lambda self, *a, grid, warmup, **k: None)
    for owner, name in compile_ahead._ALLOCATORS:  # allocators that hand out non-zero memory, visibly
        allocate = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _f=allocate, **k: _f(*a, **k).detach().fill_(7).requires_grad_(
            bool(k.get("requires_grad"))))
    real = torch.empty
    assert int(torch.empty(3).count_nonzero()) == 3
    with compile_ahead.compile_only(workers=1):
        tensors = [torch.empty(257, dtype=torch.int64), torch.empty_like(torch.ones(3, 5)),
                   torch.empty_strided((4, 4), (1, 4), dtype=torch.float16), torch.ones(2).new_empty(9, dtype=torch.int32)]
        assert all(int(t.count_nonzero()) == 0 for t in tensors)
        assert int(torch.empty(4, requires_grad=True).count_nonzero()) == 0  # a leaf that wants gradients too
    assert torch.empty is real and int(torch.ones(2).new_empty(4).count_nonzero()) == 4
