"""Activation offload: the checkpointed decoder-layer inputs wait in pinned CPU memory, not on the GPU.

Under gradient checkpointing each decoder layer keeps one tensor for its backward: its input, the
residual stream ``[tokens, hidden]`` (bf16 at 8192 tokens x 3584: 59 MB per layer, 1.6 GB for the
28 layers of a 7B model). ``CausalLM.forward`` runs each layer's ``checkpoint`` call inside
``ActivationOffloader.hooks()``, a ``torch.autograd.graph.saved_tensors_hooks`` pair. The checkpoint
saves its inputs through these hooks (the tensors saved *inside* the layer go through the
checkpoint's own hooks instead, which keep nothing), so:

- pack (forward): the side CUDA stream waits for the compute stream (which produced the tensor),
  copies it into a pinned CPU buffer, and ``record_stream`` keeps the GPU block from being reused
  before that copy is done; nothing else holds the GPU tensor, so it is freed then;
- unpack (backward, when the checkpoint recomputes the layer): the compute stream waits for the
  copy back to the GPU; and the copy back of the layer *before* (the next input the backward needs)
  is started at once on the side stream, so it overlaps this layer's recompute and backward.

Bytes are copied, never converted: the gradients are bit-identical to the non-offloaded run. The
price: two PCIe copies of every layer input per micro-batch (on the side stream, overlapping
compute), pinned host memory for one micro-batch's layer inputs, and one extra layer input on the
GPU during the backward (the prefetch). On a CPU model the same code runs with plain copies (used by
the CPU tests); train-step only installs an offloader on CUDA.
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch


class _Saved:
    """One offloaded tensor: its host copy and, once fetched back, the device copy."""

    __slots__ = ("host", "device", "fetched", "ready", "prev", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, prev):
        self.host = host
        self.device = device
        self.fetched: torch.Tensor | None = None
        self.ready = None  # CUDA event: the copy back is done
        self.prev = prev   # weakref to the tensor packed before this one in the same forward, or None


class ActivationOffloader:
    """Saved-tensor hooks that park large saved tensors in (pinned) CPU memory; see the module docstring.

    ``min_bytes``: smaller tensors stay where they are, as do non-float ones (the positions every
    checkpoint also saves); the default 0 takes every float input of the wrapped checkpoints.
    ``prefetch``: on unpack, start bringing back the tensor packed just before this one.
    ``stats`` counts packed / unpacked / prefetched tensors and packed bytes (for tests and logs).
    """

    def __init__(self, device: torch.device | str, *, min_bytes: int = 0, prefetch: bool = True):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.min_bytes = int(min_bytes)
        self.prefetch = prefetch
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._last = None  # weakref to the last _Saved of the current forward
        self.stats: Counter = Counter()

    def begin(self) -> None:
        """Start a new forward: tensors packed from now on are fetched back in reverse order."""
        self._last = None

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # ---- hooks -----------------------------------------------------------------------------------
    def _eligible(self, t: torch.Tensor) -> bool:
        return (t.device.type == self.device.type and t.is_floating_point() and t.is_contiguous()
                and t.numel() * t.element_size() >= self.min_bytes)

    def _pack(self, t: torch.Tensor):
        if not self._eligible(t):
            return t
        with torch.no_grad():
            if self.cuda:
                main = torch.cuda.current_stream(t.device)
                self.stream.wait_stream(main)  # t is written by work queued on the compute stream
                with torch.cuda.stream(self.stream):
                    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    host.copy_(t, non_blocking=True)
                t.record_stream(self.stream)  # its block is not reused before the copy has read it
            else:
                host = t.detach().clone()
        h = _Saved(host, t.device, self._last)
        self._last = weakref.ref(h)
        self.stats["packed"] += 1
        self.stats["packed_bytes"] += t.numel() * t.element_size()
        return h

    def _unpack(self, h):
        if not isinstance(h, _Saved):
            return h
        if h.fetched is None:
            self._fetch(h)
        else:
            self.stats["prefetched"] += 1
        t, h.fetched = h.fetched, None
        if self.cuda:
            main = torch.cuda.current_stream(h.device)
            main.wait_event(h.ready)
            t.record_stream(main)  # allocated on the side stream, used and freed on the compute stream
        self.stats["unpacked"] += 1
        if self.prefetch and h.prev is not None:
            p = h.prev()
            if p is not None and p.fetched is None:
                self._fetch(p)
        return t

    def _fetch(self, h: _Saved) -> None:
        with torch.no_grad():
            if self.cuda:
                with torch.cuda.stream(self.stream):  # after this tensor's copy out, queued on the same stream
                    t = torch.empty(h.host.shape, dtype=h.host.dtype, device=h.device)
                    t.copy_(h.host, non_blocking=True)
                    h.ready = torch.cuda.Event()
                    h.ready.record(self.stream)
            else:
                t = h.host.clone()
        h.fetched = t

    def describe(self) -> str:
        where = f"pinned CPU memory over a side stream of {self.device}" if self.cuda else "CPU copies"
        size = f" of >= {self.min_bytes} bytes" if self.min_bytes else ""
        return f"checkpointed layer inputs{size} go to {where}" + \
            (", the previous layer's prefetched in backward" if self.prefetch else "")
