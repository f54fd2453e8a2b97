"""QLinear: a frozen base Linear whose weight is either NVFP4 (packed) or dense.

Trade-off: one class for both bases keeps the decoder free of branches and lets the 16-bit LoRA
baseline and QeRL share every line of model code; the cost is a type switch per call. NVFP4
weights live as buffers under their compressed-tensors names (``weight_packed``, ``weight_scale``,
``weight_global_scale``) so ``state_dict()`` matches the on-disk checkpoint (codes rewritten into the
sm_90 kernels' layout at load are converted back when a state dict is taken); the matmul goes through
``qerl_kernels.ops.nvfp4_linear`` (Triton on CUDA, the torch reference on CPU), which never
materialises a dequantized weight and is differentiable with respect to the input only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from qerl_kernels.ops import NVFP4Weight, nvfp4_linear, nvfp4_qkv_rope, nvfp4_swiglu, takes_korder_x
from torch import nn


class QLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, quantized: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.quantized = in_features, out_features, quantized
        if quantized and in_features % 16:
            raise ValueError(f"an NVFP4 Linear needs in_features divisible by 16 (one scale per 16 weights), got {in_features}")
        if quantized:
            self.register_buffer("weight_packed", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
            self.register_buffer("weight_scale", torch.empty(out_features, in_features // 16, dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer("weight_global_scale", torch.empty(1, dtype=torch.float32, device=device))
            self.weight = None
        else:
            # A Parameter (frozen) rather than a buffer so it is tied/shared the usual torch way.
            self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False) if bias else None
        self._nvfp4: NVFP4Weight | None = None
        self.keep_dense = False  # NVFP4 on the reference path: keep the dequantized weight (keep_dense_weights)
        # True once ``twiddle_codes_`` rewrote weight_packed into the sm_90 decode's layout (in place),
        # ``blocked`` when it also stored the codes in 1 KB tiles (qerl_kernels.twiddle.block).
        self.twiddled = False
        self.blocked = False
        if quantized:
            self._register_state_dict_hook(_ondisk_codes_hook)
            self.register_load_state_dict_pre_hook(_kernel_codes_pre_hook)

    def _apply(self, fn, recurse=True):
        # ``.to(dtype)`` / ``.half()`` on a model must move the NVFP4 buffers, never cast them: torch counts
        # float8 as floating point, so it cast the block scales (and rounded the fp32 global scale) to
        # bf16, and the next forward failed far from the cause.
        if not self.quantized:
            return super()._apply(fn, recurse)
        own = {id(self._buffers[n]) for n in _NVFP4_BUFFERS if self._buffers.get(n) is not None}

        def device_only(t):
            new = fn(t)
            return t.to(new.device) if id(t) in own and new.dtype != t.dtype else new

        return super()._apply(device_only, recurse)

    def nvfp4_weight(self) -> NVFP4Weight:
        # Kernels may cache a repacked copy on the NVFP4Weight object, so keep one per set of buffers
        # and rebuild it only when .to()/load replaced the tensors.
        w = self._nvfp4
        if w is None or w.packed is not self.weight_packed or w.scale is not self.weight_scale \
                or w.global_scale is not self.weight_global_scale or w.twiddled != self.twiddled \
                or w.blocked != self.blocked:
            w = self._nvfp4 = NVFP4Weight(self.weight_packed, self.weight_scale, self.weight_global_scale, self.twiddled,
                                          self.blocked)
        w.keep_dense = self.keep_dense
        return w

    def dense_weight(self, dtype=None) -> torch.Tensor:
        """The base weight as a dense tensor (dequantized for NVFP4)."""
        if self.quantized:
            return self.nvfp4_weight().dequantize(dtype or torch.float32)
        return self.weight if dtype is None else self.weight.to(dtype)

    def forward(self, x: torch.Tensor, x_korder: bool = False) -> torch.Tensor:
        """``x_korder``: x's columns are in the MMA's K order, written so for this GEMM (``takes_korder_x``)."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.quantized:
            return nvfp4_linear(x, self.nvfp4_weight(), bias, x_korder=x_korder)
        if x_korder:
            raise ValueError("a dense Linear reads its input in natural order")
        return F.linear(x, self.weight, bias)

    def takes_korder_x(self, x: torch.Tensor) -> bool:
        """Whether this GEMM on x's rows runs a TMA-fed tile, whose X permutation pass is saved when the
        kernel producing x writes its columns in the MMA's K order (``qerl_kernels.decode.k_order``):
        the norm, SwiGLU and decode attention kernels can (``korder=``). NVFP4 on sm_90 only; inference
        only; ``QERL_KORDER_X=0`` turns it off."""
        if not self.quantized or not x.is_cuda or x.dtype != torch.bfloat16 or (torch.is_grad_enabled() and x.requires_grad):
            return False
        return takes_korder_x(self.nvfp4_weight(), x.numel() // x.shape[-1], x.device)

    def swiglu(self, x: torch.Tensor, x_korder: bool = False, y_korder: bool = False) -> torch.Tensor | None:
        """``silu(gate) * up`` where this module is a fused gate/up GEMM (gate rows over up rows), in one
        kernel (``qerl_kernels.ops.nvfp4_swiglu``), or None where it cannot (dense or biased weight, CPU,
        autograd, a tile that cannot pair): the caller then runs ``forward`` and its SwiGLU."""
        if not self.quantized or self.bias is not None:
            return None
        return nvfp4_swiglu(x, self.nvfp4_weight(), x_korder=x_korder, y_korder=y_korder)

    def qkv_rope(self, x: torch.Tensor, rope, x_korder: bool = False) -> torch.Tensor | None:
        """This fused q/k/v GEMM's output with q and k rotated and k, v written to the paged caches, in one
        kernel (``qerl_kernels.ops.nvfp4_qkv_rope``; ``rope`` a ``RopeEpilogue``), or None where it
        cannot: the caller then runs ``forward`` and the rotary + cache write kernel."""
        if not self.quantized:
            return None
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nvfp4_qkv_rope(x, self.nvfp4_weight(), bias, rope, x_korder=x_korder)

    def extra_repr(self) -> str:
        kind = "nvfp4" if self.quantized else "dense"
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, {kind}"


_NVFP4_BUFFERS = ("weight_packed", "weight_scale", "weight_global_scale")


def _kernel_codes_pre_hook(module: QLinear, state: dict, prefix: str, *args) -> None:
    # The mirror of ``_ondisk_codes_hook``: a state dict holds the file's codes, and copying them over
    # twiddled codes unconverted gave outputs off by ~65 on a unit-scale layer, with no error.
    key = prefix + "weight_packed"
    t = state.get(key)
    if module.twiddled and isinstance(t, torch.Tensor) and t.shape == module.weight_packed.shape:
        from qerl_kernels.twiddle import to_kernel_layout

        state[key] = to_kernel_layout(t.to(module.weight_packed.device), module.blocked)


def _ondisk_codes_hook(module: QLinear, state: dict, prefix: str, local_metadata) -> None:
    # A state dict is the checkpoint's view: never hand out the kernels' load-time code layout.
    key = prefix + "weight_packed"
    if module.twiddled and key in state:
        state[key] = module.nvfp4_weight().ondisk_packed()


def fuse_linears(parts: list[QLinear]) -> QLinear | None:
    """One QLinear computing ``cat([p(x) for p in parts], -1)``, or None when the parts cannot fuse.

    Used for q/k/v and gate/up at inference: one GEMM instead of three reads the same bytes but
    fills the GPU far better at decode sizes (k/v alone are 512-row matrices on a 7B model). The
    parts' tensors are re-pointed at slices of the fused tensors, so memory is not duplicated and the
    per-projection modules (LoRA, PEFT names, training) keep working unchanged. NVFP4 parts fuse only
    when they share one global scale (qerl and llm-compressor write them that way for vLLM).
    """
    first = parts[0]
    if any(p.quantized != first.quantized or p.in_features != first.in_features or (p.bias is None) != (first.bias is None)
           or p.twiddled != first.twiddled or p.blocked != first.blocked for p in parts):
        return None
    sizes = [p.out_features for p in parts]
    if first.quantized:
        if any(not torch.equal(p.weight_global_scale, first.weight_global_scale) for p in parts):
            return None
        ref = first.weight_packed
    else:
        ref = first.weight
    fused = QLinear(first.in_features, sum(sizes), bias=first.bias is not None, quantized=first.quantized,
                    device="meta", dtype=first.bias.dtype if first.bias is not None else (None if first.quantized else ref.dtype))
    offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]

    def share(name: str, frozen_param: bool) -> None:
        whole = torch.cat([getattr(p, name) for p in parts], dim=0)
        setattr(fused, name, nn.Parameter(whole, requires_grad=False) if frozen_param else whole)
        for p, a, b in zip(parts, offsets, offsets[1:]):
            view = whole[a:b]
            setattr(p, name, nn.Parameter(view, requires_grad=False) if frozen_param else view)

    if first.quantized:
        share("weight_packed", False)
        share("weight_scale", False)
        fused.weight_global_scale = first.weight_global_scale
        # Twiddling is row-local and blocks are 16-row tiles of parts whose rows are multiples of 16,
        # so the stacked rows keep the layout.
        fused.twiddled, fused.blocked = first.twiddled, first.blocked
        fused.keep_dense = all(p.keep_dense for p in parts)
    else:
        share("weight", True)
    if first.bias is not None:
        share("bias", True)
    return fused


def twiddle_codes_(model: nn.Module, chunk_bytes: int = 32 << 20) -> int:
    """Rewrite every NVFP4 QLinear's codes in place into the sm_90 kernels' layout; returns how many.

    Why: ``qerl_kernels.twiddle`` (~1.9 instead of ~3.2 decode instructions per weight, and 1 KB
    reads per K step). Same bytes, same memory; buffers shared between fused and per-projection
    modules are rewritten once (through the largest tensor on each storage), and blocked only when
    every module reading them has whole 16-row blocks. On a GPU the twiddle is one Triton pass in place
    (``qerl_kernels.twiddle_triton``); the torch reference, on CPU, is chunked by rows, ``chunk_bytes`` of
    codes at a time, so its int64 temporaries stay bounded (on an H100 it took 0.711 s for a 7B model in the
    4096-row chunks of before, 0.505 s in 32 MB ones: `benchmarks/probe_twiddle_chunks.py`, docs/benchmarks.md,
    RL loop, fourth pass). Blocking copies one weight at a time; the allocator's cache is emptied after, so
    the KV cache, sized from free memory, gets it back. Everything that reads the codes
    back (``dense_weight``, the kernels, the reference path) honours the flags; the checkpoint on
    disk is untouched.
    """
    from qerl_kernels.twiddle import block, can_block, twiddle
    from qerl_kernels.twiddle_triton import twiddle_

    mods = [m for m in _all_qlinears(model) if m.quantized and not m.twiddled]
    # Fused modules' tensors contain their parts' rows: rewrite each byte range exactly once.
    regions = sorted({(m.weight_packed.data_ptr(), m.weight_packed.numel()): m.weight_packed for m in mods}.items(),
                     key=lambda kv: (kv[0][0], -kv[0][1]))
    kept: list[tuple[int, int, torch.Tensor]] = []
    for (start, size), t in regions:
        if kept and start + size <= kept[-1][0] + kept[-1][1]:
            continue  # inside a larger tensor
        if kept and start < kept[-1][0] + kept[-1][1] or not t.is_contiguous():
            raise ValueError("NVFP4 code tensors overlap partially; cannot twiddle in place")
        kept.append((start, size, t))
    for start, size, t in kept:
        readers = [m for m in mods if start <= m.weight_packed.data_ptr() < start + size]
        blocked = all(can_block(m.out_features, m.in_features) for m in readers) and all(
            (m.weight_packed.data_ptr() - start) % (16 * t.shape[1]) == 0 for m in readers)
        if t.is_cuda:  # one Triton pass in place (qerl_kernels.twiddle_triton)
            twiddle_(t)
        else:
            rows = max(1, chunk_bytes // t.shape[1])
            for a in range(0, t.shape[0], rows):
                t[a:a + rows].copy_(twiddle(t[a:a + rows]))
        if blocked:
            t.copy_(block(t))
        for m in readers:
            m.twiddled, m.blocked = True, blocked
    if any(t.is_cuda for _, _, t in kept):
        torch.cuda.empty_cache()  # blocking's copies: free memory is what the KV cache is sized from
    return len(mods)


def keep_dense_weights(model: nn.Module, dtype: torch.dtype, max_bytes: int) -> bool:
    """Let every NVFP4 QLinear keep its dequantized weight between calls on the reference path, when
    the dense copies of them all fit ``max_bytes``; returns whether they do.

    Why: on CPU the reference path decoded every weight on every call, 0.8 of 11 s of a small CPU
    rollout. A copy is made on a module's first call (so the per-projection modules that fused ones
    replace at inference never make one); the numbers are the reference path's, bit for bit, except for a
    non-contiguous N-D x with a bias (torch then adds the bias after the matmul, not in it: last-bit
    differences), which the decoder never passes.
    """
    mods = [m for m in model.modules() if isinstance(m, QLinear) and m.quantized]
    elem = torch.empty(0, dtype=dtype).element_size()
    fits = sum(m.in_features * m.out_features for m in mods) * elem <= max_bytes
    for m in _all_qlinears(model):
        m.keep_dense = fits and m.quantized
    return fits


def _all_qlinears(model: nn.Module) -> list[QLinear]:
    """Registered QLinears plus the inference-only fused ones kept in plain lists (not submodules)."""
    seen: dict[int, QLinear] = {}
    for mod in model.modules():
        held = [x for attr in vars(mod).values() if isinstance(attr, list) for x in attr]
        for cand in [mod, *held]:
            if isinstance(cand, QLinear):
                seen.setdefault(id(cand), cand)
    return list(seen.values())
