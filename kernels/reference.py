"""NVFP4 reference math in pure torch: the source of truth for every qerl kernel.

Format (compressed-tensors ``nvfp4-pack-quantized``, weight-only): E2M1 codes (bit 3 sign,
bits 2..0 index ``E2M1_VALUES``), one float8_e4m3fn scale per 16 consecutive input
elements, one float32 global scale per tensor that DIVIDES on dequantize:
``w = e2m1(code) * float(scale) / global``. Element 2j of a row sits in the low nibble of
byte j, element 2j+1 in the high nibble.

Quantization follows compressed-tensors' arithmetic exactly (including computing amax-based
ratios in the weight's own dtype), so checkpoints written by qerl are bit-identical to what
llm-compressor would write; ``tests/test_reference_nvfp4.py`` checks that against the
installed ``compressed_tensors`` package.
"""

from __future__ import annotations

import torch

GROUP = 16
FP8_MAX = 448.0
FP4_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Decision thresholds between neighbouring E2M1 magnitudes, with round-half-to-even ties: (threshold,
# whether a value exactly on it goes up), up where the upper neighbour's code is even (lower bit 0).
_TIES_UP = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_table(device=None, dtype=torch.float32) -> torch.Tensor:
    """The 16 code values (codes 8..15 are the negatives; code 8 is -0)."""
    pos = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return torch.cat([pos, -pos])


# ---- packing ---------------------------------------------------------------------------
def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (values 0..15) -> packed uint8 [..., K/2] (even index in low nibble)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"last dim must be even to pack, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., K/2] -> codes uint8 [..., K]."""
    lo = packed & 0xF
    hi = (packed >> 4) & 0xF
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def decode_codes(codes: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """E2M1 codes -> their real values (code 8, -0, decodes to -0.0 which equals 0)."""
    return e2m1_table(codes.device, dtype)[codes.long()]


# ---- dequantize ------------------------------------------------------------------------
def check_nvfp4_dtypes(packed: torch.Tensor, scale: torch.Tensor) -> None:
    """Codes as bytes, block scales as float8 e4m3. Other dtypes were read two ways: the reference
    took the values of fp32 or uint8 scales as numbers, the Triton kernels reinterpreted their bytes as
    e4m3 (errors of 6-17 on a unit weight, no error raised)."""
    if packed.dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    if scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"block scales must be float8_e4m3fn, got {scale.dtype}")


def check_weight(packed: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """-> (N, K) of codes [N, K/2] and scales [N, K/16], or a ValueError naming what does not fit."""
    check_nvfp4_dtypes(packed, scale)
    if packed.ndim != 2:
        raise ValueError(f"packed codes must be [N, K/2], got shape {tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if k % GROUP:
        raise ValueError(f"the weight holds K={k} columns; NVFP4 needs a multiple of {GROUP}")
    if scale.shape != (n, k // GROUP):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not fit weight [{n}, {k}] (want [{n}, {k // GROUP}])")
    return n, k


ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 dtypes: tuple = (*ACTIVATION_DTYPES, torch.float64)) -> tuple[int, int]:
    """The checks every path of ``x @ dequant(W)^T + bias`` shares (the reference's matmul would
    otherwise fail deep inside, or, for a bias of the wrong shape, only in backward); -> (N, K)."""
    n, k = check_weight(packed, scale)
    if x.dim() == 0:
        raise ValueError(f"x must be [..., {k}] (its last dimension the input features), got a 0-dim tensor")
    if x.device != packed.device or scale.device != packed.device:
        # torch's F.linear with a meta weight (a QLinear never loaded) and a CPU x returned uninitialised memory
        raise ValueError(f"x is on {x.device}, the NVFP4 weight on {packed.device} (scales on {scale.device})")
    if x.dtype not in dtypes:
        raise ValueError(f"activations must be one of {', '.join(str(d) for d in dtypes)}, got {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the NVFP4 weight expects {k}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"bias must be [{n}] {x.dtype} on {x.device}, got {tuple(bias.shape)} {bias.dtype} "
                         f"on {bias.device}")
    return n, k


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """[N, K/2] uint8 + [N, K/16] e4m3 + global -> [N, K] weight in ``dtype``.

    Computed in float32 and rounded once at the end, as compressed-tensors does.
    """
    n, k = check_weight(packed, scale)
    vals = decode_codes(unpack_codes(packed)).view(n, k // GROUP, GROUP)
    g = global_scale if isinstance(global_scale, torch.Tensor) else torch.tensor(float(global_scale))
    s = scale.to(torch.float32) / g.to(torch.float32).reshape(())
    return (vals * s.unsqueeze(-1)).reshape(n, k).to(dtype)


# ---- quantize --------------------------------------------------------------------------
def global_scale_for(amax: torch.Tensor) -> torch.Tensor:
    """global = 448*6/amax computed in amax's dtype (as compressed-tensors), returned as fp32 [1]."""
    amax = amax.abs()
    amax = torch.clamp(amax, min=torch.finfo(amax.dtype).tiny)
    g = (FP8_MAX * FP4_MAX) / amax
    g = torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0)
    return g.to(torch.float32).reshape(1)


def block_scales(w: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Per-16 e4m3 scales for weight ``w`` [N, K] given the fp32 global scale."""
    n, k = w.shape
    g = w.reshape(n, k // GROUP, GROUP)
    mx = torch.clamp(g.amax(dim=-1), min=0)
    mn = torch.clamp(g.amin(dim=-1), max=0)
    block_amax = torch.maximum(mn.abs(), mx)
    s = block_amax / FP4_MAX  # in w's dtype, as compressed-tensors
    s = global_scale.to(torch.float32) * s  # promotes to fp32
    s = torch.clamp(s, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    eps = torch.tensor(torch.finfo(torch.float8_e4m3fn).eps, dtype=torch.float8_e4m3fn)
    return torch.where(s.to(torch.float32) == 0, eps, s)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already scaled into [-6, 6]) -> E2M1 codes, round-half-to-even.

    The code index counts the decision thresholds a magnitude passes. A tie goes to the even
    code: thresholds whose lower neighbour is even (0.25, 1.25, 2.5, 5) must be exceeded (``>``),
    those whose upper neighbour is even (0.75, 1.75, 3.5) only reached (``>=``). Seven compares
    per value gave the same codes as ``torch.bucketize`` and were 2.6x faster on one CPU thread
    (median 150 vs 391 ms for a 4864x896 weight, 2026-11-22, 2-core dev machine).
    The sign bit is set for every x < 0, including values that round to zero (code 8, -0), and
    not for -0.0 itself: compressed-tensors does the same (it multiplies by ``sign(x)``).
    """
    x = torch.clamp(x, -FP4_MAX, FP4_MAX)
    mag = x.abs()
    idx = torch.zeros(mag.shape, dtype=torch.uint8, device=mag.device)
    for bound, tie_goes_up in _TIES_UP:  # bool -> uint8 by view: no conversion pass
        idx.add_((mag >= bound if tie_goes_up else mag > bound).view(torch.uint8))
    idx.bitwise_or_((x < 0).view(torch.uint8) << 3)
    return idx


def quantize(w: torch.Tensor, global_scale: torch.Tensor | None = None):
    """Weight [N, K] (K % 16 == 0) -> (packed uint8 [N, K/2], scale e4m3 [N, K/16], global fp32 [1])."""
    if w.ndim != 2 or w.shape[1] % GROUP:
        raise ValueError(f"NVFP4 needs a 2-D weight with K % {GROUP} == 0, got {tuple(w.shape)}")
    if global_scale is None:
        global_scale = global_scale_for(w.abs().amax())
    scale = block_scales(w, global_scale)
    n, k = w.shape
    denom = scale.to(torch.float32) / global_scale.to(torch.float32)
    x = w.to(torch.float32).reshape(n, k // GROUP, GROUP) / denom.unsqueeze(-1)
    codes = round_to_e2m1(x.reshape(n, k))
    return pack_codes(codes), scale, global_scale.reshape(1).to(torch.float32)


def linear(x: torch.Tensor, packed, scale, global_scale, bias=None) -> torch.Tensor:
    """Reference W4A16 linear: x @ dequant(W)^T (+ bias), in x's dtype."""
    w = dequantize(packed, scale, global_scale, dtype=x.dtype)
    return torch.nn.functional.linear(x, w, bias)
