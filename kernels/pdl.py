"""Programmatic dependent launch (PDL): a kernel starts while the one before it on the stream finishes.

Trade-off: a decode step is ~260 dependent kernels of 2-40 us, and each one's start costs its grid's
launch plus the first loads' DRAM round trip, paid after its predecessor's last program has ended.
With PDL (sm_90+) every qerl kernel is launched with the programmatic-serialization attribute, lets
its successor launch as soon as its own programs are running (``griddepcontrol.launch_dependents``)
and waits for its predecessor only where it first needs that kernel's results
(``griddepcontrol.wait``, which returns once the predecessor grid has completed and its writes are
visible). Work that depends on nothing earlier (the GEMMs' weight codes and scales: constants) goes
before the wait, so it overlaps the predecessor's tail. The price is discipline, not speed: a kernel
launched this way must not read anything a predecessor writes, nor write anything, before its wait
(the wait is transitive: the predecessor waited for its own predecessor before completing). Kernels
launched without the attribute (cuBLAS, torch) are ordered as usual. CUDA graphs keep the
dependency as a programmatic edge.

``QERL_PDL=0`` turns it off; the interpreter and pre-Hopper GPUs never use it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - Triton without grid dependency control
    gdc_wait = gdc_launch_dependents = None

_capable: dict[int, bool] = {}


def pdl_enabled(device: torch.device) -> bool:
    """True where kernels on ``device`` should be launched with PDL (CUDA sm_90+, not the
    interpreter, not ``QERL_PDL=0``)."""
    if device.type != "cuda" or gdc_wait is None or os.environ.get("QERL_PDL", "1") == "0":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _capable:
        _capable[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _capable[idx]


def launch_kwargs(on: bool) -> dict:
    """Extra launch options for a kernel taking the ``PDL`` constexpr (``launch_pdl`` is a Triton
    launch option on CUDA only)."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def wait_and_release(PDL: tl.constexpr):
    """Wait for the predecessor's results, then let the successor launch (Triton kernels)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


HAVE_GLUON_PDL = False
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def gluon_wait_and_release(PDL: gl.constexpr):
        """``wait_and_release`` for Gluon kernels."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    HAVE_GLUON_PDL = True
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
    pass
