"""``train-step --deterministic``: a rerun of one step writes the same bytes on the same GPU and software.

Why it is a switch: a step's inputs fix everything qerl computes (seeds, micro-batch packing, dropout
masks; qerl's Triton kernels are not autotuned and sum split-K partials in a fixed order), but on an H100
PyTorch runs training's attention backward in cuDNN, whose gradients vary in the last bits from run to
run at some shapes (`benchmarks/probe_sdpa_determinism.py`: Qwen2.5-32B heads, 3 x 2560 tokens), so
two runs of one step can write different adapters (measured at the 7B and 32B shapes). The deterministic
choice costs time (flash attention's deterministic backward takes 2.3-2.6x cuDNN's; the step 8-14% more on
an H100, docs/train-step.md), so it is off by default.

How: ``torch.use_deterministic_algorithms(True)`` for the optimisation loop. PyTorch then refuses cuDNN
attention and runs flash attention with its deterministic backward (or another deterministic kernel),
and raises on any op that has no deterministic kernel instead of letting it vary: the step stops with
that op's name (``NondeterministicOpError``). cuBLAS is deterministic only with a fixed workspace,
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (PyTorch refuses matmuls in this mode without it), which is set for
the process before CUDA starts unless the user set ``:16:8``, the other deterministic value; another value
is refused (on a CUDA device only: the CPU never reads it).
"""

from __future__ import annotations

import contextlib
import os

import torch

from qerl_cli.errors import BadInputError

CUBLAS_VAR = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")  # the two values cuBLAS documents as reproducible


class NondeterministicOpError(BadInputError):
    """An op of the step has no deterministic kernel: ``--deterministic`` cannot be honoured (exit 2)."""


def prepare_environment() -> None:
    """Before any CUDA work: the cuBLAS workspace setting the deterministic mode needs."""
    value = os.environ.get(CUBLAS_VAR)
    if value is None:
        os.environ[CUBLAS_VAR] = CUBLAS_DETERMINISTIC[0]
    elif value not in CUBLAS_DETERMINISTIC:
        raise BadInputError(f"--deterministic: {CUBLAS_VAR}={value!r} lets cuBLAS results vary between runs",
                            hint=f"unset it (qerl sets {CUBLAS_DETERMINISTIC[0]}) or set one of "
                                 f"{' / '.join(CUBLAS_DETERMINISTIC)}")


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool):
    """PyTorch's deterministic mode inside the block (nothing when not ``enabled``); the caller's after."""
    if not enabled:
        yield
        return
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    except RuntimeError as e:
        if "deterministic" not in str(e):
            raise
        op = str(e).splitlines()[0].split(", but you set")[0]  # PyTorch's advice after it is for its own API
        raise NondeterministicOpError(f"--deterministic: {op}",
                                      hint="rerun without --deterministic (the results then may differ in the "
                                           "last bits from run to run), and report the op to qerl") from e
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
