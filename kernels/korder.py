"""The MMA's K order of activation columns, and whether the sm_90 decode applies, in torch alone.

Kept apart from ``decode`` (Triton kernels) so CPU stages run where Triton is not installed (it is a
Linux-only dependency): loading an NVFP4 model and attaching LoRA only need these.
"""

from __future__ import annotations


def k_order_index(k: int, device=None):
    """``k_order`` in torch for columns 0 .. k - 1 (k % 128 == 0): natural = permuted[..., index]."""
    import torch

    if k % 128:
        raise ValueError(f"the MMA's K order permutes whole 128-column steps; K = {k} is not a multiple of 128")

    n = torch.arange(k, device=device)
    m = n % 128
    return (n - m + ((m >> 4) & 1) * 64 + ((m >> 2) & 1) * 32 + ((m >> 1) & 1) * 16 + (m & 1) * 8 + (m >> 5) * 2
            + ((m >> 3) & 1))


def to_k_order(x):
    """x [..., k] -> the same values with the last dimension in the MMA's K order (torch; the fallback of
    the kernels that write K order)."""
    import torch

    out = torch.empty_like(x)
    out[..., k_order_index(x.shape[-1], x.device)] = x
    return out


def from_k_order(x):
    """Inverse of ``to_k_order``: x [..., k] in the MMA's K order -> natural order."""
    return x[..., k_order_index(x.shape[-1], x.device)]


def fast_decode_supported(device) -> bool:
    """The PTX path needs sm_90 (``mul.rn.bf16x2``) and a real GPU (the interpreter has no asm)."""
    import os

    import torch

    if os.environ.get("TRITON_INTERPRET") == "1" or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)
