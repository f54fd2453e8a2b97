"""Programmatic dependent launch (PDL) for the one pair of launches where it pays: ``permute_x`` and the
GEMM that reads its output.

A GEMM over natural-order activations by TMA runs two kernels: ``permute_x`` puts X into the MMA's K
order, then the GEMM streams the weight and that copy. Launched plainly, the GEMM's programs start
only after the copy's last program has ended, and each then waits a DRAM round trip for its first
codes. With PDL (sm_90+) the copy lets its successor launch as soon as all its programs run
(``griddepcontrol.launch_dependents``), and the GEMM, launched with the programmatic-serialization
attribute, loads its first ring stages of codes and scales (constants: nothing earlier writes them)
before ``griddepcontrol.wait``, which returns once the copy has completed and its writes are visible.
So the GEMM's launch and first weight loads overlap the copy.

Why only there: the rollout engine's kernels write X in K order themselves and a whole decode step
under PDL measured within +-1% (docs/benchmarks.md, kernels, eleventh pass), while PDL binds a kernel
to touch nothing its predecessor writes before the wait. In this pair that rule is easy to keep: the
copy is launched plainly (everything before it has completed when it starts), it writes only its own
fresh buffer, and the GEMM reads that buffer only after the wait; its other writes (Y, the split-K
workspace and counters) go to memory the copy never touches.

Measured (docs/benchmarks.md, kernels, twenty-third pass, ``benchmarks/probe_pdl.py``, on and off in one
run): a small gain at M = 256 and 1024, about 0.7% (median over the eight X-by-TMA points of 7B and 32B q/k/v
with the timing order rotated, -0.5% to +1.4% by point, H100; two runs timing PDL first read 1.1% with a 0.5%
order bias), and a loss at M = 32-128 (H100: 7B o at M = 64 13.6 -> 14.1 us; letting the GEMM start only
once the copy's programs have stored, instead of at their start, lost more). So only launches of at least
``PDL_MIN_ROWS`` rows use it.

Off by default: ``QERL_PDL=1`` turns it on, and even then never for a launch captured into a CUDA graph.
Replayed from a graph, the pair hung the GPU whenever the GEMM's grid filled every SM (a persistent grid
of one program per SM, or more tiles than SMs): 32B q/k/v at M = 512 and 1024, 7B and 32B gate/up at
M = 1024, even a graph of one pair, with a fresh compile cache; the same launches ran eagerly, and with
PDL off, as always (H100, 2026-11-26, ``benchmarks/probe_hang.py``; docs/benchmarks.md, kernels,
twenty-fourth pass). Why was not found: the GEMM's programs, each a whole SM, may be placed before the
copy's last programs are, which would leave the copy nowhere to run while they wait for it. A hang for
under 1% is not a trade worth making, so nothing uses PDL unless asked. The interpreter and pre-Hopper
GPUs never use it.
"""

from __future__ import annotations

import os

import torch

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - Triton without grid dependency control
    gdc_wait = gdc_launch_dependents = None

_capable: dict[int, bool] = {}
PDL_MIN_ROWS = 129  # fewer rows: no PDL (see above)


def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` may use PDL: only with ``QERL_PDL=1``, on CUDA sm_90+, outside the
    interpreter and outside CUDA-graph capture (where it hung, see above)."""
    if device.type != "cuda" or gdc_wait is None or os.environ.get("QERL_PDL", "0") != "1":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or torch.cuda.is_current_stream_capturing():
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _capable:
        _capable[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _capable[idx]


def launch_kwargs(on: bool) -> dict:
    """Launch options of the dependent kernel (``launch_pdl``: a Triton launch option on CUDA)."""
    return {"launch_pdl": True} if on else {}


try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def griddep_wait():
        """Block until the predecessor grid has completed and its writes are visible (a no-op without PDL)."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
    pass
