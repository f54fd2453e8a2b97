"""Programmatic dependent launch (PDL) and L2 prefetch: start reading the next GEMM's weights early.

Trade-off: in a decode step every kernel waits for the one before it to finish, so between two
GEMMs the HBM sits idle while a norm, rotary or attention kernel runs (a few microseconds each,
latency-bound), and each GEMM starts its weight stream cold. With PDL (Hopper's
``griddepcontrol``) a kernel launched with ``launch_pdl=True`` may start while its predecessor
still runs: the GEMM issues bulk L2 prefetches of the weight bytes it will read first (weights
never depend on the previous kernel), then waits (``gdc_wait``) before it touches anything the
predecessor may write or read: activations, outputs, the split-K workspace and counters. Every
kernel that takes part signals ``gdc_launch_dependents`` at its start, so the next one is
launched as soon as all of its own programs are running.

Correctness rule, which the GPU tests check with chains of dependent calls in a CUDA graph: a
PDL kernel loads nothing but its frozen weights before ``gdc_wait`` and stores nothing before it.
Because every PDL kernel waits on its predecessor before finishing, ordering stays transitive.

``QERL_PDL=0`` turns it off; it is off on CPU, in Triton's interpreter and before sm_90.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off (see enabled)
    gdc_launch_dependents = gdc_wait = None


@functools.lru_cache(maxsize=None)
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` are launched with PDL (and so may prefetch before waiting)."""
    if gdc_wait is None or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("QERL_PDL", "1") == "0":
        return False
    return _device_ok(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """Let the next kernel launch now (it waits for us in its own ``pdl_wait``)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Block until the previous kernel has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def prefetch_l2(ptr, nbytes, pred):
    """Bulk-prefetch ``nbytes`` (a multiple of 16) at ``ptr`` (16-byte aligned) into L2, per element
    where ``pred`` is nonzero. One instruction per chunk: the copy engine fetches the lines."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r,r", [ptr, nbytes, pred], dtype=tl.int32, is_pure=False, pack=1)
