"""``--keep-activations auto``: how many decoder layers can skip their recompute in the GPU memory there is.

Gradient checkpointing trades time for memory: every layer's forward runs twice. On a 7B model at 8192
tokens a micro-batch, keeping all 28 layers' activations made the step 1.39x faster for 30 GiB more
(docs/benchmarks.md, train-step). Which layers are kept changes no bit of the result
(``CausalLM.keep_activations``), so the count can be chosen while the step runs.

How: the first micro-batch runs with one layer kept. The model reports the bytes that layer's
activations took (``CausalLM.kept_bytes_per_layer``); the allocator's peak over that micro-batch is the
rest of the step's need. Both are scaled to the step's largest micro-batch (activations grow with its
padded tokens; weights, LoRA and AdamW state do not), and the remaining micro-batches keep as many
layers as fit under what the device can give PyTorch (its free memory plus what PyTorch already holds),
less a margin for the allocator's fragmentation, and less one copy of the gradients. An estimate can still
be wrong (fragmentation, a micro-batch of another shape, another process taking memory): a micro-batch that
runs out of memory with layers kept is run again with half as many, from the gradients as they were
before it (each micro-batch starts by copying them: ~0.1 ms and 160 MB for LoRA r=16 on a 7B model), so
`auto` fails only where keeping none would. An explicit N is not lowered: its out-of-memory error names N.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GIB = 2**30
MARGIN_FRACTION = 0.08  # of the memory PyTorch can have: fragmentation, the caching allocator's rounding
MARGIN_MIN = 1 * GIB


@dataclass
class AutoKeep:
    """Measure on the first micro-batch, then set ``model.keep_activations`` for the rest."""

    model: torch.nn.Module
    device: torch.device
    largest_tokens: int  # padded tokens of the largest micro-batch this rank will run
    params: list = field(default_factory=list)  # the trained tensors: their grads are saved before each try
    chosen: int | None = None
    note: str = ""
    said: bool = False
    retries: int = 0

    def before_first(self) -> None:
        self.model.keep_activations = 1
        self.model.kept_bytes_per_layer = None
        self.model.measure_kept = True
        self.resident = torch.cuda.memory_allocated(self.device)  # weights, LoRA (+ grads, AdamW state if any yet)
        torch.cuda.reset_peak_memory_stats(self.device)

    def after_first(self, tokens: int) -> int:
        self.model.measure_kept = False
        per_layer = self.model.kept_bytes_per_layer
        peak = torch.cuda.max_memory_allocated(self.device)
        free, _ = torch.cuda.mem_get_info(self.device)
        usable = free + torch.cuda.memory_reserved(self.device)
        # each later micro-batch first copies the gradients (save_grads): that copy is not in this peak
        grads = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        self.chosen = choose(n_layers=len(self.model.model.layers), resident=self.resident + grads,
                             peak_with_one=peak + grads, per_layer=per_layer or 0, tokens=tokens,
                             largest_tokens=self.largest_tokens, usable=usable)
        self.model.keep_activations = self.chosen
        n = len(self.model.model.layers)
        scale = max(1.0, self.largest_tokens / max(tokens, 1))
        self.note = (f"--keep-activations auto: {self.chosen} of {n} decoder layers keep "
                     f"their activations ({(per_layer or 0) * scale / GIB:.2f} GiB each at {self.largest_tokens} "
                     f"tokens; first micro-batch's peak {peak / GIB:.1f} GiB of {usable / GIB:.1f} GiB usable)")
        fits = tokens_for_all(n_layers=n, resident=self.resident + grads, peak_with_one=peak + grads,
                              per_layer=per_layer or 0, tokens=tokens, usable=usable)
        if self.chosen < n and fits:  # fewer, larger micro-batches recompute; smaller ones may keep every layer
            self.note += f"; all {n} would fit with --micro-batch-tokens {fits}"
        return self.chosen

    def save_grads(self) -> list:
        """The gradients as they stand before a micro-batch, for ``retry_with_fewer``: its backward may have
        added into some of them before running out of memory."""
        return [None if p.grad is None else p.grad.clone() for p in self.params]

    def retry_with_fewer(self, saved: list) -> str:
        """After an out-of-memory error in a micro-batch: the gradients back as ``saved``, half the layers
        kept (none if it failed while measuring); returns the note to print. The micro-batch then runs again,
        with the same dropout masks (it reseeds), to the same bits: which layers are kept changes none."""
        for p, g in zip(self.params, saved):
            p.grad = g
        before = self.model.keep_activations
        self.model.measure_kept = False
        self.chosen = 0 if self.chosen is None else before // 2
        self.model.keep_activations = self.chosen
        self.retries += 1
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return (f"--keep-activations auto: out of GPU memory with {before} layers kept; running the micro-batch "
                f"again with {self.chosen}")


def choose(*, n_layers: int, resident: int, peak_with_one: int, per_layer: int, tokens: int, largest_tokens: int,
           usable: int) -> int:
    """Layers to keep: the measured peak (one layer kept, ``tokens`` padded tokens) scaled to the largest
    micro-batch, plus one layer's activations per extra kept layer, under ``usable`` less the margin."""
    if per_layer <= 0:  # nothing measured (no grad, a model without layers): keep the recompute
        return 0
    scale = max(1.0, largest_tokens / max(tokens, 1))
    peak = resident + (peak_with_one - resident) * scale
    per = per_layer * scale
    budget = usable - max(MARGIN_MIN, MARGIN_FRACTION * usable)
    if peak > budget:
        return 0
    return max(0, min(n_layers, 1 + int((budget - peak) // per)))


def tokens_for_all(*, n_layers: int, resident: int, peak_with_one: int, per_layer: int, tokens: int,
                   usable: int) -> int | None:
    """The largest micro-batch (padded tokens, rounded down to 1024) at which every layer would be kept by
    ``choose``'s arithmetic; None when not even 1024 tokens would do."""
    if per_layer <= 0 or tokens <= 0:
        return None
    budget = usable - max(MARGIN_MIN, MARGIN_FRACTION * usable)
    per_token = ((peak_with_one - resident) + (n_layers - 1) * per_layer) / tokens
    fit = int((budget - resident) / per_token) // 1024 * 1024 if budget > resident else 0
    return fit or None
