"""Programmatic dependent launch between ``permute_x`` and the X-by-TMA GEMM that reads its output
(kernels/pdl.py): the GEMM loads its first weight stages before waiting for the copy, so a wait in the
wrong place would read stale or half-written X. Same bits with PDL on and off, on every kind of launch
that takes it. PDL is opt-in (QERL_PDL=1) and never used under CUDA-graph capture: replayed, a pair whose
GEMM filled every SM hung the GPU, which the last test guards against from a subprocess."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu

K = 1280  # 5 ring stages of 256


def _case(m: int, n: int, seed: int):
    from qerl_kernels.testing import random_nvfp4, reference_fwd
    from qerl_kernels.twiddle import to_kernel_layout

    p, s, g = random_nvfp4(n, K, seed=seed, device="cuda")
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    return to_kernel_layout(p, True), s, g, x, bias, reference_fwd(x, p, s, g, bias)


def _configs():
    """(config, SMs to pretend) for each launch kind that takes PDL: warp-specialised X-by-TMA tiles in
    one partition (split-K 1 and 2, halved last wave) and duo, persistent duo tiles walking several tiles,
    stored by TMA, tail-split (a tail after whole waves, and a launch that is all tail), and the TMA-fed
    kernel's split-K grid."""
    from qerl_kernels.tile_configs import FwdConfig

    ws = FwdConfig(64, 64, 16, warps=4, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=128, pregs=48,
                   half=2)
    duo = FwdConfig(128, 128, 16, warps=8, stages=2, swap=True, gluon=True, ws=True, xtma=True, maxnreg=168,
                    pregs=40, half=2, duo=True, xstages=6)
    tma = FwdConfig(64, 64, 16, split_k=1, warps=4, stages=3, swap=True, gluon=True, xtma=True, inflight=True)
    return [(ws, None), (replace(ws, split_k=2), None), (replace(ws, halves=True), 5), (replace(ws, stages=4), None),
            (duo, None), (replace(duo, persist=1), 2), (replace(duo, persist=1, tstore=True), 3),
            (replace(duo, persist=1, tstore=True, tail=True), 3), (replace(duo, persist=1, tstore=True, tail=True), 6),
            (tma, None), (replace(tma, split_k=2), None)]


@pytest.mark.parametrize("m", [100, 300])
def test_pdl_gives_the_same_bits(m, monkeypatch):
    # Every launch kind at 100 rows too: the row threshold (pdl.PDL_MIN_ROWS, a speed rule) lowered.
    from qerl_kernels import gemm_gluon, gemm_gluon_ws, pdl
    from qerl_kernels.gemm_fwd import nvfp4_matmul
    from qerl_kernels.testing import TOL, rel_err

    monkeypatch.setenv("QERL_PDL", "1")
    assert pdl.pdl_enabled(torch.device("cuda"))
    tp, s, g, x, bias, ref = _case(m, 400, seed=m)
    for cfg, sms in _configs():
        monkeypatch.setattr(pdl, "PDL_MIN_ROWS", 1)
        if sms:
            monkeypatch.setattr(gemm_gluon_ws, "num_sms", lambda device, n=sms: n)
            monkeypatch.setattr(gemm_gluon, "num_sms", lambda device, n=sms: n)
        monkeypatch.setenv("QERL_PDL", "0")
        y0 = nvfp4_matmul(x, tp, s, g, bias=bias, config=cfg, twiddled=True, blocked=True)
        monkeypatch.setenv("QERL_PDL", "1")
        y1 = nvfp4_matmul(x, tp, s, g, bias=bias, config=cfg, twiddled=True, blocked=True)
        assert rel_err(y1, ref) < TOL[torch.bfloat16], (cfg, rel_err(y1, ref))
        assert torch.equal(y1, y0), (cfg, sms)
        monkeypatch.undo()


def captured(run):
    """(CUDA graph of ``run()``, its outputs): warmed up eagerly and on a side stream first, as torch asks."""
    run()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    return graph, outs


def test_a_graph_captured_with_pdl_asked_reads_each_replays_x(monkeypatch):
    # QERL_PDL=1, but capture launches plainly (pdl.pdl_enabled). Replays with new X copied in before each:
    # a GEMM that read X before the copy's end would return the last replay's rows (or a mix). Every
    # launch kind of _configs back to back in one graph.
    from qerl_kernels.gemm_fwd import nvfp4_matmul

    monkeypatch.setenv("QERL_PDL", "1")

    tp, s, g, x, bias, _ = _case(300, 400, seed=5)
    cfgs = [c for c, sms in _configs() if sms is None or c.persist]
    run = lambda: [nvfp4_matmul(x, tp, s, g, bias=bias, config=c, twiddled=True, blocked=True) for c in cfgs]  # noqa: E731
    graph, outs = captured(run)
    for seed in range(6):
        torch.manual_seed(seed)
        x.copy_(torch.randn_like(x))
        graph.replay()
        want = run()  # eager, after the replay on the same stream
        for c, y, w in zip(cfgs, outs, want):
            assert torch.equal(y, w), (seed, c)


GRAPH_FILLING_EVERY_SM = """
import os, torch
os.environ["QERL_PDL"] = "1"
from qerl_kernels.gemm_fwd import nvfp4_matmul
from qerl_kernels.testing import random_nvfp4
from qerl_kernels.twiddle import to_kernel_layout
# 32B q/k/v at M = 1024 with the table's tile: a persistent grid of one program per SM behind a copy of
# 64 x 40 programs, the first launch seen to hang (a graph of one pair was enough).
p, s, g = random_nvfp4(7168, 5120, seed=1, device="cuda")
tp = to_kernel_layout(p, True)
x = torch.randn(1024, 5120, device="cuda", dtype=torch.bfloat16)
run = lambda: nvfp4_matmul(x, tp, s, g, twiddled=True, blocked=True)
want = run()  # then the side-stream warm-up and the capture, as the kernel benchmark's harness does (the hang
stream = torch.cuda.Stream()  # did not show every time with one more eager call first)
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    run()
torch.cuda.current_stream().wait_stream(stream)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    y = run()
for _ in range(20):
    graph.replay()
torch.cuda.synchronize()
assert torch.equal(y, want)
print("replayed")
"""


def test_a_graph_of_a_grid_filling_every_sm_replays_with_pdl_asked(tmp_path):
    # The hang of 2026-11-26 (docs/benchmarks.md, kernels, twenty-fourth pass): with PDL under capture this
    # replay never returned. In a subprocess, so a regression fails by timeout instead of hanging the suite.
    import os
    import subprocess
    import sys

    script = tmp_path / "graph.py"
    script.write_text(GRAPH_FILLING_EVERY_SM)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0 and "replayed" in r.stdout, r.stderr[-2000:]

