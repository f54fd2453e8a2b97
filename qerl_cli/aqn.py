"""Adaptive Quantization Noise: the sigma schedule and seeded per-norm noise vectors.

The noise of norm (layer i, name n) at step k is drawn on the CPU in fp32 from
``torch.Generator().manual_seed(seed_for(run_seed, k, i, n))``: CPU generation is bit-identical on
every machine and device, so ``rollout`` (which samples with the noise) and ``train-step`` (which
recomputes log-probabilities with it) rebuild the same vectors from the shard's ``noise`` record
alone. Vectors are written into each norm's ``noise`` buffer with ``copy_`` (``w_clean + Z`` at
forward time), never added to the weight, so applying twice cannot accumulate. The cost is one CPU
randn of ``hidden`` floats per norm per step: microseconds.
"""

from __future__ import annotations

import hashlib

import torch

from qerl_cli.errors import BadInputError

NOISED_NORMS = ("input_layernorm", "post_attention_layernorm")


def sigma_at(step: int, total_steps: int, sigma_start: float, sigma_end: float, stages: int) -> float:
    """Exponential schedule: ``total_steps`` split into ``stages + 1`` equal intervals; interval 0 is
    noise-free and interval k (1..stages) uses ``sigma_start * (sigma_end/sigma_start) ** ((k-1)/(stages-1))``."""
    if total_steps <= 0 or stages <= 0:
        raise ValueError(f"total_steps and stages must be positive, got {total_steps} and {stages}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if sigma_start < 0 or sigma_end < 0:
        raise ValueError(f"sigmas must be >= 0, got {sigma_start} and {sigma_end}")
    k = min(step * (stages + 1) // total_steps, stages)
    if k == 0 or sigma_start == 0:
        return 0.0
    if stages == 1:
        return float(sigma_start)
    if sigma_end == 0:
        raise ValueError("sigma_end must be > 0 when sigma_start > 0 (the schedule is geometric)")
    return float(sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (stages - 1)))


def seed_for(run_seed: int, step: int, layer: int, norm: str) -> int:
    """A 63-bit seed from (run seed, step, layer, norm name): stable across processes and versions."""
    key = f"qerl-aqn:{int(run_seed)}:{int(step)}:{int(layer)}:{norm}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


def noise_vector(dim: int, sigma: float, run_seed: int, step: int, layer: int, norm: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed_for(run_seed, step, layer, norm))
    return torch.randn(dim, generator=g, dtype=torch.float32) * float(sigma)


def _noised_norms(model):
    for i, layer in enumerate(model.model.layers):
        for name in NOISED_NORMS:
            yield i, name, getattr(layer, name)


def rounded_noise(z: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The Z that reaches a forward which stores ``w + Z`` in ``dtype`` (vLLM's bf16 norm weights):
    ``dtype(w + Z) - w``, computed as vLLM's worker computes it (``engine_vllm.set_norm_noise``)."""
    w_clean = w.detach().to(device="cpu", dtype=dtype).float()
    return (w_clean + z).to(dtype).float() - w_clean


def apply_noise(model, sigma: float, run_seed: int, step: int, rounded_to: str | None = None) -> dict:
    """Set every noised norm's buffer to its seeded vector; returns the shard's ``noise`` record.
    ``rounded_to``: the rollout stored ``w + Z`` in this dtype (the record's ``rounded_to``, --engine
    vllm), so the same rounded vector is used here: training recomputes the policy that sampled."""
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    round_dtype = None
    if rounded_to is not None:
        round_dtype = getattr(torch, str(rounded_to), None)
        if not isinstance(round_dtype, torch.dtype) or not round_dtype.is_floating_point:
            raise BadInputError(f"noise record: rounded_to {rounded_to!r} is not a torch floating dtype")
    if sigma == 0:
        clear_noise(model)
    else:
        n = 0
        for i, name, norm in _noised_norms(model):
            z = noise_vector(norm.noise.shape[0], sigma, run_seed, step, i, name)
            if round_dtype is not None:
                z = rounded_noise(z, norm.weight, round_dtype)
            norm.noise.copy_(z)  # in place: CUDA graphs captured earlier read the same buffer
            # No silent no-op: the weight the forward uses (fp32 w + Z) must differ from w.
            w = norm.weight.detach().float()
            if round_dtype is None and torch.equal(w + norm.noise.to(w.device), w):
                raise BadInputError(f"AQN sigma {sigma:g} does not change layer {i} {name} (below fp32 resolution "
                                    f"of its weights)", hint="raise --aqn-sigma-start/--aqn-sigma-end")
            n += 1
        if n == 0:
            raise BadInputError("AQN sigma > 0 but the model has no noised RMSNorm to apply it to")
    rec = {"sigma": float(sigma), "seed": int(run_seed), "step": int(step), "norms": list(NOISED_NORMS)}
    return rec if rounded_to is None else {**rec, "rounded_to": str(rounded_to)}


def clear_noise(model) -> None:
    for _, _, norm in _noised_norms(model):
        norm.noise.zero_()
