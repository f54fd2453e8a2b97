"""Activation checkpointing: run a piece of the model without keeping its activations, run it again in the backward.

``torch.utils.checkpoint.checkpoint`` does this, but it is wrapped to import ``torch._dynamo`` on its
first call: 1.5 s of every train-step process on a CPU machine, 4-6 s on an H100 machine
(docs/benchmarks.md, RL loop), for a module qerl never uses. ``checkpoint`` here is the reentrant
form as an ``autograd.Function``:

- forward: runs ``fn`` without grad and saves only its tensor inputs, through whatever saved-tensor
  hooks are active (so the activation offloader still parks the layer input in host memory), and the
  CPU and CUDA RNG states it started from;
- backward: restores those RNG states (LoRA dropout draws the same masks), runs ``fn`` again with grad
  and backpropagates the incoming gradients through it; parameters inside ``fn`` get their ``.grad``
  from that inner backward.

The same operations in the same order as the plain forward, so the same bits:
tests/test_train_memory.py checks the gradients against the un-checkpointed model bit for bit, with
dropout, trained norms and the offloader (on CPU; on CUDA in 16-bit the fused norm's backward adds the
residual stream's gradient before rounding, where the checkpointed graph lets autograd add it after, so
the two agree to one rounding of the activations' dtype). A reentrant checkpoint gets no backward at all when none of
its inputs requires grad (the first layer: its input is the frozen embedding), so every call passes a
zero-size tensor that does, and gives it no gradient. Being reentrant, it supports ``.backward()``
through the checkpointed piece (all train-step does), not ``torch.autograd.grad``.
"""

from __future__ import annotations

import torch

_ANCHOR = torch.empty(0, requires_grad=True)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, anchor, *args):
        ctx.fn = fn
        ctx.is_tensor = [torch.is_tensor(a) for a in args]
        ctx.constants = [a for a in args if not torch.is_tensor(a)]
        ctx.devices = sorted({a.device for a in args if torch.is_tensor(a) and a.is_cuda}, key=str)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.devices]
        ctx.save_for_backward(*[a for a in args if torch.is_tensor(a)])
        return fn(*args)  # autograd.Function runs its forward without grad

    @staticmethod
    def backward(ctx, *grads):
        tensors, constants = iter(ctx.saved_tensors), iter(ctx.constants)
        needs = iter(ctx.needs_input_grad[2:])
        args = []
        for is_tensor in ctx.is_tensor:
            if is_tensor:
                args.append(next(tensors).detach().requires_grad_(next(needs)))
            else:
                next(needs)
                args.append(next(constants))
        with torch.random.fork_rng(devices=ctx.devices):
            torch.set_rng_state(ctx.cpu_rng)
            for device, state in zip(ctx.devices, ctx.cuda_rng):
                torch.cuda.set_rng_state(state, device)
            with torch.enable_grad():
                out = ctx.fn(*args)
                outs = out if isinstance(out, tuple) else (out,)
                pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and torch.is_tensor(o) and o.requires_grad]
                # Backward from the scalar sum(o.sum()), each o's hook swapping the ones that arrive for its
                # incoming gradient g: exactly g, and no extra [tokens, hidden] tensor. Handing the grads
                # to torch.autograd.backward instead would import torch.fx's symbolic shapes (0.7 s on a
                # CPU machine) to check their shapes.
                for o, g in pairs:
                    o.register_hook(lambda _ones, g=g: g)
                surrogate = sum(o.sum() for o, _ in pairs) if pairs else None
        if surrogate is not None:
            torch.autograd.backward(surrogate)
        return (None, None, *[a.grad if torch.is_tensor(a) and a.requires_grad else None for a in args])


def checkpoint(fn, *args):
    """``fn(*args)`` whose activations are recomputed in the backward (see the module docstring)."""
    return _Recompute.apply(fn, _ANCHOR, *args)
