"""LoRA around a frozen base Linear (torchtune style: the adapter is a wrapper, the base stays put).

``y = base(x) + dropout(x) @ A^T @ B^T * alpha / r``, with fp32 master ``lora_A`` [r, in] and
``lora_B`` [out, r]; the two small matmuls run in x's dtype (the fp32 masters are cast per call,
which costs r*(in+out) elements, nothing next to the base weight read). B starts at zero so a fresh
adapter is the base policy; A uses PEFT's kaiming-uniform(a=sqrt(5)) init, seeded per module so two
runs with the same seed build identical adapters. The adapter is never merged into the base, so the
NVFP4 weight stays packed and the same LoRA tensors serve rollout and training.

In the engine each adapter also keeps A with its columns in the sm_90 GEMMs' K order (``korder_copy``),
so the kernel that produces a LoRA projection's input (norm, SwiGLU, decode attention) can write it in
that order for the base GEMM's TMA-fed tile, and the shrink reads the same tensor: ``x_k @ A_k^T`` is
``x @ A^T`` with the K sum in another order. Without it a LoRA run paid a ``permute_x`` launch before
every such GEMM (112 per 7B decode step at 64 sequences, 167 us of kernel time). Measured (H100, 7B +
LoRA r=16, docs/benchmarks.md, rollout, twenty-first pass): with the one-launch shrink
(``qerl_kernels.lora_shrink``) 3.672 / 4.137 / 5.239 ms per step at 16 / 32 / 64 sequences against
3.688 / 4.229 / 5.251 in natural order; with cuBLAS's shrink pair, whose second launch then waited
behind the GEMM, K order was 3.5% slower above 16 rows.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from qerl_cli.layers.context import get_context
from qerl_cli.layers.lora_train import lora_train, trains_through_fn

# Batch rows up to which the norm kernel computes the q/k/v and gate/up LoRA shrink. Each row's programs
# read all of A, so its cost grows with the rows, while past a few rows the separate shrink hides beside
# the base GEMM on the side stream (base_and_shrink). H100, 7B + LoRA r=16, QERL_NORM_SHRINK=1 / 0
# (docs/benchmarks.md, rollout, twentieth pass): NVFP4 16 rows 3.80 / 3.83 ms, 32 rows 4.44 / 4.25,
# 64 rows 5.51 / 5.30; bf16 6.53 / 6.49, 6.90 / 6.77, 7.71 / 7.54. So 16: the quantized bases gain there,
# the dense ones lose 0.6%, too little for a second rule.
NORM_SHRINK_MAX_ROWS = 16
# Batch rows up to which an NVFP4 gate/up GEMM's LoRA expand stays an addmm_ into its output after it, not
# a deferred term computed beside it and added by SwiGLU (GroupedLoRA.run_deferred). H100, 7B + LoRA
# r=16, deferred / not (docs/benchmarks.md, rollout, twenty-first pass): 16 rows 3.684-3.691 / 3.663 ms,
# 32 rows 4.026-4.043 / 4.172, 64 rows 5.093-5.094 / 5.231. Dense bases always defer.
NVFP4_GATE_UP_DEFER_ROWS = 16
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    r: int = 16
    alpha: float = 16
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    use_rslora: bool = False
    seed: int = 0

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.0, *, scaling: float | None = None,
                 generator: torch.Generator | None = None):
        super().__init__()
        if r <= 0:
            raise ValueError(f"LoRA rank must be positive, got {r}")
        self.base, self.r, self.alpha = base, r, alpha
        self.scaling = alpha / r if scaling is None else scaling
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        dev = _device_of(base)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)
        self.lora_A.data = self.lora_A.data.to(dev)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, dtype=torch.float32, device=dev))
        self.enabled = True
        # The wrapped Linear's mode, not nn.Module's default (training): wrapping an eval model must
        # not switch LoRA dropout on where nothing trains (rollout, eval).
        self.train(base.training)
        # (A, B*scaling, A in K order or None: korder_copy) in the activation dtype
        self._cast: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def _inference_copies(self, x: torch.Tensor):
        """(A, B * scaling, A in K order or None) in x's dtype when the engine is running this forward, else None."""
        c = self._cast
        if c is None or c[0].dtype != x.dtype or get_context() is None:
            return None
        if self.training and not isinstance(self.dropout, nn.Identity):
            return None
        return c

    def _factors(self, x: torch.Tensor):
        """(dropout(x) @ A^T, B * scaling) in x's dtype, through autograd: the scaling multiplies the
        [out, r] factor, not the [tokens, out] product."""
        a, bs = self.lora_A.to(x.dtype), (self.lora_B * self.scaling).to(x.dtype)
        return self.dropout(x) @ a.t(), bs

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The LoRA term alone: dropout(x) @ A^T @ B^T * scaling, in x's dtype."""
        c = self._inference_copies(x)
        if c is not None:
            return (x @ c[0].t()) @ c[1].t()
        t, b = self._factors(x)
        return t @ b.t()

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + the LoRA term: x @ A^T, then one addmm of it with the scaled B into y (cuBLAS adds y in its
        epilogue). In the engine B is pre-scaled and pre-cast, with no per-step casts; 7 LoRA projections x
        64 layers add up on a 32B model. In training the same two matmuls run through autograd: a 7B step
        had spent 5% of its GPU time scaling [tokens, out] products and another ~4% adding them into y."""
        c = self._inference_copies(x)
        if c is None:
            # In place where y is a plain tensor: the frozen base's output is saved by no backward
            # (its autograd keeps x and W), so adding into it spares one [tokens, out] tensor at
            # training's memory peak. Views (chunks of a fused GEMM's output) stay out of place.
            t, b = self._factors(x)
            if y.dtype != t.dtype or b.dtype != t.dtype:  # autocast: the matmuls' dtype is not x's
                return y + t @ b.t().to(t.dtype)
            if y._is_view():  # NVFP4's output is a reshape: one addmm, y added in its epilogue
                return expand(y, t.reshape(-1, t.shape[-1]), b)
            if y.dim() == 2:
                return y.addmm_(t, b.t())
            if y.dim() == 3:  # [B, L, out], as training runs: batched, y added in the GEMM's epilogue
                return y.baddbmm_(t, b.t().expand(y.shape[0], *b.t().shape))
            return y.add_(t @ b.t())
        return expand(y, shrink(x, c[0]), c[1])

    def refresh_inference_copies(self, dtype: torch.dtype) -> None:
        """(Re)write the activation-dtype copies of A and B * scaling *in place*, so CUDA graphs that
        captured them see new adapter values; call after every change to the fp32 masters or alpha."""
        with torch.no_grad():
            if self._cast is None or self._cast[0].dtype != dtype:
                a = self.lora_A.detach().to(dtype).clone()
                self._cast = (a, (self.lora_B.detach() * self.scaling).to(dtype), korder_copy(a))
            else:
                self._cast[0].copy_(self.lora_A)
                self._cast[1].copy_(self.lora_B * self.scaling)
                if self._cast[2] is not None:
                    self._cast[2].copy_(korder_copy(self._cast[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self._inference_copies(x) if self.enabled else None
        if c is not None and overlap_enabled(x):
            y, t = base_and_shrink(self.base, x, c[0])
            return expand(y, t, c[1])
        if self.enabled and c is None and trains_through_fn(self, x):
            return lora_train(self, x)
        y = self.base(x)
        return self.add_delta(x, y) if self.enabled else y

    def forward_deferred(self, x: torch.Tensor, x_korder: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(base(x), the LoRA term or None) for a consumer that adds the term itself (the next RMSNorm,
        ``fused.rmsnorm(delta=)``). In the engine on CUDA both LoRA matmuls run on the side stream beside
        the base GEMM, so the step's critical path keeps no LoRA launch; elsewhere ``(forward(x), None)``.
        ``x_korder``: x's columns are in the MMA's K order (only where ``takes_korder`` said yes)."""
        c = self._inference_copies(x) if self.enabled else None
        if x_korder:
            if not self.takes_korder(x):
                raise ValueError("x in K order needs the engine's K-order A and the side stream (takes_korder)")
            y, d = base_and_shrink(self.base, x, c[2], c[1], x_korder=True)
            return y, d.view(y.shape)
        if c is None or not defer_enabled(x):
            return self(x), None
        y, d = base_and_shrink(self.base, x, c[0], c[1])
        return y, d.view(y.shape)

    def takes_korder(self, x: torch.Tensor) -> bool:
        """Whether ``forward_deferred`` can take x in the MMA's K order: the engine runs this adapter with
        its K-order A, the terms go beside the base GEMM, and that GEMM reads K order at x's rows."""
        c = self._inference_copies(x) if self.enabled else None
        return c is not None and c[2] is not None and defer_enabled(x) and self.base.takes_korder_x(x)

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}, scaling={self.scaling:g}"


class GroupedLoRA:
    """The LoRA terms of one fused GEMM's parts (q/k/v or gate/up) in two kernels instead of two per part.

    For parts i with LoRA, ``y[:, rows_i] += (x @ A_i^T) @ (B_i s_i)^T`` is one ``x @ A_cat^T`` (the
    parts' A stacked: [sum r, in]) and one addmm with a block-diagonal ``B_blk`` [sum out, sum r]
    (zero off each part's block and on the rows of parts without LoRA). Why: at decode sizes each
    small matmul is a ~3-5 us launch, not a read; a 7B decode step with LoRA on all seven
    projections ran 14 of them per layer, now 8. The zeros cost little: for q/k/v at r = 16,
    B_blk is 48 x 4608 bf16 (442 KB read per call, 147 KB without the zeros) and the extra
    multiply-adds by zero leave each part's sum unchanged up to summation order.

    The parts' inference copies become views into A_cat and B_blk, so their in-place refresh
    (``LoRALinear.refresh_inference_copies``) updates the grouped tensors and captured CUDA graphs
    see new adapter values. ``active`` falls back to the per-part path whenever that sharing or the
    set of enabled parts no longer holds (dtype change, ``lora_disabled``, training with dropout).
    """

    def __init__(self, parts: list, dtype: torch.dtype):
        self.parts = parts
        self.flags = tuple(isinstance(p, LoRALinear) and p.enabled for p in parts)
        loras = [p for p, f in zip(parts, self.flags) if f]
        dev = loras[0]._cast[0].device
        rank = sum(p.r for p in loras)
        self.a = torch.zeros(rank, parts[0].in_features, dtype=dtype, device=dev)
        self.b = torch.zeros(sum(p.out_features for p in parts), rank, dtype=dtype, device=dev)
        # A_cat in K order: the parts' K-order copies stacked (None unless every part has one).
        self.a_k = torch.zeros_like(self.a) if all(p._cast[2] is not None for p in loras) else None
        row = col = 0
        self.views = []
        for p, f in zip(parts, self.flags):
            if f:
                a, b = self.a[col:col + p.r], self.b[row:row + p.out_features, col:col + p.r]
                a.copy_(p._cast[0])
                b.copy_(p._cast[1])
                ak = None
                if self.a_k is not None:
                    ak = self.a_k[col:col + p.r]
                    ak.copy_(p._cast[2])
                p._cast = (a, b, ak)
                self.views.append(p._cast)
                col += p.r
            row += p.out_features

    @classmethod
    def build(cls, parts: list, dtype: torch.dtype) -> GroupedLoRA | None:
        """None when no part has an enabled LoRA with inference copies in ``dtype``."""
        loras = [p for p in parts if isinstance(p, LoRALinear) and p.enabled]
        if not loras or any(p._cast is None or p._cast[0].dtype != dtype for p in loras):
            return None
        return cls(parts, dtype)

    def valid(self) -> bool:
        """The parts still read their copies through this group's tensors, with the same LoRAs enabled."""
        flags = tuple(isinstance(p, LoRALinear) and p.enabled for p in self.parts)
        loras = [p for p, f in zip(self.parts, flags) if f]
        return flags == self.flags and all(p._cast is v for p, v in zip(loras, self.views))

    def active(self, x: torch.Tensor) -> bool:
        """True when ``add`` computes what the per-part path would, up to summation order (the engine runs)."""
        if x.dtype != self.a.dtype or not self.valid():
            return False
        return all(p._inference_copies(x) is not None for p, f in zip(self.parts, self.flags) if f)

    def takes_korder(self, x: torch.Tensor) -> bool:
        """Whether ``run``/``run_deferred`` can take x in the MMA's K order (the group has A in K order and
        is active); the base GEMM's own tile decides the rest (``QLinear.takes_korder_x``)."""
        return self.a_k is not None and self.active(x)

    def shrink_a(self, x_korder: bool) -> torch.Tensor:
        if x_korder and self.a_k is None:
            raise ValueError("x in K order needs the group's K-order A (every part's korder_copy)")
        return self.a_k if x_korder else self.a

    def add(self, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor | None = None, x_korder: bool = False) -> torch.Tensor:
        """y (the fused GEMM's output) plus every part's LoRA term; ``t``: ``x @ a^T`` when already computed
        (by the norm kernel that produced x, ``RMSNorm.with_shrink``). ``x_korder``: x's columns are in the
        MMA's K order (the shrink then reads ``a_k``)."""
        t = shrink(x, self.shrink_a(x_korder)) if t is None else t.reshape(-1, t.shape[-1])
        return expand(y, t, self.b)

    def run(self, base, x: torch.Tensor, t: torch.Tensor | None = None, x_korder: bool = False) -> torch.Tensor:
        """base(x) (the fused GEMM) plus every part's LoRA term; the shrink, when ``t`` is not given, beside
        the GEMM on a side stream (``base_and_shrink``). ``x_korder`` as in ``add``."""
        if t is None and overlap_enabled(x):
            y, t = base_and_shrink(base, x, self.shrink_a(x_korder), x_korder=x_korder)
            return expand(y, t, self.b)
        return self.add(x, base(x, x_korder=True) if x_korder else base(x), t, x_korder)

    def run_deferred(self, base, x: torch.Tensor, t: torch.Tensor | None = None, x_korder: bool = False):
        """(base(x), every part's LoRA term [..., sum out], rounded to x's dtype) for a consumer that adds the
        terms itself (SwiGLU, the rotary + cache write); both LoRA matmuls (only the expand when ``t``, the
        norm's shrink, is given) beside the GEMM on the side stream, so none is on the critical path.
        None instead of the pair where that does not apply (``QERL_LORA_OVERLAP=0``/``QERL_LORA_DEFER=0``).
        The engine uses it for q/k/v, and for gate/up over dense (bf16) bases and over NVFP4 ones above
        ``NVFP4_GATE_UP_DEFER_ROWS``: beside the NVFP4 gate/up tiles of 16 rows the expand made the 7B
        decode step slower (H100: 4.02 -> 4.48 ms; docs/benchmarks.md, rollout, fourteenth pass; 0.6%
        in the twenty-first), at 32-64 rows 2.6-3.3% faster (twenty-first pass)."""
        if not defer_enabled(x):
            return None
        y, d = base_and_shrink(base, x, self.shrink_a(x_korder), self.b, t, x_korder)
        return y, d.view(y.shape)

    def shrink_source(self, x: torch.Tensor) -> torch.Tensor | None:
        """``a`` when the norm that produces x may compute this group's shrink (``active`` and a decode-sized
        batch, where the separate shrink is launch-bound), else None. ``QERL_NORM_SHRINK=0``: never."""
        rows = x.numel() // x.shape[-1]
        if rows > NORM_SHRINK_MAX_ROWS or os.environ.get("QERL_NORM_SHRINK", "1") == "0" or not self.active(x):
            return None
        return self.a


_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def overlap_enabled(x: torch.Tensor) -> bool:
    """Whether the engine's LoRA shrinks run on a side stream beside their base GEMM (CUDA only;
    ``QERL_LORA_OVERLAP=0`` turns it off)."""
    return x.is_cuda and os.environ.get("QERL_LORA_OVERLAP", "1") != "0"


def defer_enabled(x: torch.Tensor) -> bool:
    """Whether whole LoRA terms are computed beside their GEMMs and added by the consumer (needs the side
    stream; ``QERL_LORA_DEFER=0`` turns it off)."""
    return overlap_enabled(x) and os.environ.get("QERL_LORA_DEFER", "1") != "0"


def base_and_shrink(base, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None = None,
                    t: torch.Tensor | None = None, x_korder: bool = False):
    """(base(x), x @ a^T) with the shrink on a side stream that forks from and joins the current one;
    with ``b``, (base(x), x @ a^T @ b^T): the expand too, rounded to x's dtype; with ``t`` (x @ a^T,
    already computed), only the expand. ``x_korder``: x's columns are in the MMA's K order, for the base
    GEMM (``base(x, x_korder=True)``) and for ``a`` (a K-order copy, ``korder_copy``).

    Why: at decode sizes the shrink is a launch-bound few microseconds (``shrink``: 4-7 us in one launch,
    cuBLAS's split-K pair 6.6-7.8 us) that needs only x, while the base GEMM leaves most of the SMs' issue
    slots idle waiting on its weight; side by side, the shrink mostly hides under the GEMM (run before it
    on the same stream, the 7B + LoRA step was 0.3-0.65 ms longer: docs/benchmarks.md, rollout, twenty-first
    pass). Inside a CUDA-graph capture the fork and join become graph edges.
    What the side stream allocates (``t``, or the deferred term) is used on the current stream after
    the join; the caching allocator hands a freed side-stream block only to the side stream again,
    after its next fork, which waits for everything enqueued on the current stream by then (the uses
    included). And the current stream's own tensors read on the side (x, a given ``t``) are ordered
    before any reuse by the join. So no ``record_stream`` is needed.
    """
    main = torch.cuda.current_stream(x.device)
    side = _SIDE.get(x.device)
    if side is None:
        side = _SIDE[x.device] = torch.cuda.Stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        t = shrink(x, a) if t is None else t.reshape(-1, t.shape[-1])
        if b is not None:
            t = t @ b.t()
    y = base(x, x_korder=True) if x_korder else base(x)
    main.wait_stream(side)
    return y, t


def korder_copy(a: torch.Tensor) -> torch.Tensor | None:
    """A [r, in] with its columns in the sm_90 GEMMs' K order (``qerl_kernels.korder.to_k_order``), or None
    where no GEMM reads K order (in_features % 128 != 0). A copy for every adapter, also on CPU where it
    goes unused: r x in elements, 36 MB for r = 16 on all seven projections of a 7B model in bf16."""
    if a.shape[-1] % 128:
        return None
    from qerl_kernels.korder import to_k_order

    return to_k_order(a)


def shrink(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``x @ a^T`` over x's rows ([tokens, r]): at decode sizes on CUDA one launch of
    ``qerl_kernels.lora_shrink`` instead of cuBLAS's split-K pair (``QERL_LORA_SHRINK_KERNEL=0``: cuBLAS)."""
    x2 = x.reshape(-1, x.shape[-1])
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return x2 @ a.t()  # what lora_shrink runs off CUDA, without importing Triton (absent off Linux)
    from qerl_kernels.lora_shrink import lora_shrink

    return lora_shrink(x2, a)


def expand(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``y + t @ b^T`` (t [tokens, r], b [out, r]; y [..., out]), into y in place where y is contiguous
    and outside autograd: out of place, addmm first copies y, one more launch per LoRA projection
    at decode. Called on a base GEMM's fresh output that nothing else reads (the engine's, and a view
    of one in ``LoRALinear.add_delta``)."""
    y2 = y.reshape(-1, y.shape[-1])
    if y.is_contiguous() and not (torch.is_grad_enabled() and y.requires_grad):
        y2.addmm_(t, b.t())
        return y
    return torch.addmm(y2, t, b.t()).view(y.shape)


def _device_of(m: nn.Module) -> torch.device:
    for t in list(m.parameters()) + list(m.buffers()):
        return t.device
    return torch.device("cpu")


def _module_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def apply_lora(model: nn.Module, spec: LoraSpec) -> list[str]:
    """Wrap every Linear whose last name component is in ``spec.targets``; returns the wrapped names.

    Only decoder-layer projections are candidates (never ``lm_head``), matching PEFT's target
    matching on module-name suffixes. Raises ValueError if a target matches nothing.
    """
    wrapped, linears = [], set()
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if _layer_linear(name, module):
            linears.add(leaf)
        if leaf in spec.targets and _layer_linear(name, module):
            parent = model.get_submodule(name.rsplit(".", 1)[0])
            g = torch.Generator().manual_seed(_module_seed(spec.seed, name))
            setattr(parent, leaf, LoRALinear(module, spec.r, spec.alpha, spec.dropout, scaling=spec.scaling, generator=g))
            wrapped.append(name)
    missing = set(spec.targets) - {n.rsplit(".", 1)[-1] for n in wrapped}
    if missing:
        raise ValueError(f"LoRA targets {sorted(missing)} match no Linear in the model (its decoder layers' Linears: "
                         f"{', '.join(sorted(linears))})")
    return wrapped


def _layer_linear(name: str, module: nn.Module) -> bool:
    """A decoder layer's Linear: what ``apply_lora`` wraps when its last name component is a target."""
    from qerl_cli.layers.linear import QLinear

    return isinstance(module, QLinear) and ".layers." in f".{name}"


def lora_target_names(model: nn.Module, targets) -> list[str]:
    """The names of the Linears ``apply_lora`` wraps for ``targets`` (on a meta-device model too: nothing is built)."""
    return [n for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in targets and _layer_linear(n, m)]


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            yield name, m


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable LoRA tensors (A and B of every wrapped Linear), in module order."""
    out = []
    for _, m in lora_modules(model):
        out += [m.lora_A, m.lora_B]
    return out


@contextmanager
def lora_disabled(model: nn.Module):
    """Run the base policy: every LoRALinear returns base(x) inside the block."""
    mods = [m for _, m in lora_modules(model)]
    old = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m, e in zip(mods, old):
            m.enabled = e
