"""AdamW on the trainable (fp32) parameters, the LR schedule, and ``optimizer.safetensors``.

Each ``qerl train-step`` is a fresh process, so the optimizer must survive a round trip through
files bit-exactly: the moments are saved as fp32 tensors keyed by parameter name
(``<name>.exp_avg``, ``<name>.exp_avg_sq``, ``<name>.step``) in safetensors (no pickle, loadable
without qerl) and restored into ``AdamW`` below. Names make the file robust to parameter
order and let a mismatch name the offending tensor.

The learning rate is a pure function of the *schedule position* (``lr_at``), counted in RL steps
(a train-step with ``--epochs E`` advances it by 1 in E increments of 1/E), so a resumed or
restarted run never depends on a stateful scheduler object: linear warmup to ``lr`` over
``warmup_steps`` (the first step already gets ``lr / warmup_steps``, not 0), then cosine decay
to ``min_lr_ratio * lr`` at ``total_steps`` (constant when ``total_steps`` is not given).
Weight decay applies to LoRA matrices only: decaying a trained norm weight would pull it
toward 0, not toward its pretrained value.

``AdamW`` here is torch's own update (its functional ``torch.optim.adamw.adamw``, single-tensor
path, the code ``torch.optim.AdamW(foreach=False)`` runs), held by a small class instead of a
``torch.optim.Optimizer``: the Optimizer's methods are wrapped to import ``torch._dynamo`` on first
call, 1.5 s of every train-step process on a CPU machine and 4-6 s on an H100 machine (docs/benchmarks.md,
RL loop). A test checks it against ``torch.optim.AdamW`` bit for bit, over steps and groups.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open

from qerl_cli.checkpoint.safetensors_io import save_small
from qerl_cli.errors import BadInputError

OPTIMIZER_FILE = "optimizer.safetensors"


def lr_at(position: float, lr: float, warmup_steps: int = 0, total_steps: int | None = None,
          min_lr_ratio: float = 0.0) -> float:
    """Learning rate at schedule ``position`` (RL steps already taken, fractional with epochs)."""
    if warmup_steps > 0 and position < warmup_steps:
        return lr * min(1.0, (position + 1.0) / warmup_steps)
    if not total_steps or total_steps <= warmup_steps:
        return lr
    progress = min(1.0, max(0.0, (position - warmup_steps) / (total_steps - warmup_steps)))
    floor = lr * min_lr_ratio
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class AdamW:
    """``torch.optim.AdamW(groups, foreach=False)``'s state and update without its Optimizer base
    (see the module docstring): ``param_groups`` and ``state`` as torch lays them out."""

    def __init__(self, groups: list[dict], *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8):
        self.param_groups = [{"lr": lr, "betas": tuple(betas), "eps": eps, **g, "params": list(g["params"])}
                             for g in groups]
        self.state: dict[torch.Tensor, dict] = {}

    def zero_grad(self) -> None:
        """Drop the grads (torch's default, ``set_to_none=True``)."""
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        from torch.optim.adamw import adamw

        for g in self.param_groups:
            ps = [p for p in g["params"] if p.grad is not None]
            for p in ps:
                if not self.state.get(p):  # as torch's _init_group: a CPU step counter, zero moments
                    self.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                     "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            st = [self.state[p] for p in ps]
            beta1, beta2 = g["betas"]
            adamw(ps, [p.grad for p in ps], [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st], [],
                  [s["step"] for s in st], foreach=False, capturable=False, differentiable=False, fused=None,
                  grad_scale=None, found_inf=None, has_complex=False, amsgrad=False, beta1=beta1, beta2=beta2,
                  lr=g["lr"], weight_decay=g["weight_decay"], eps=g["eps"], maximize=False)


def make_optimizer(named_params: list[tuple[str, torch.nn.Parameter]], *, lr: float,
                   betas=(0.9, 0.99), eps: float = 1e-8, weight_decay: float = 0.1) -> AdamW:
    """AdamW with decay on LoRA matrices and none on norm weights; groups remember names."""
    decay = [(n, p) for n, p in named_params if "lora_" in n]
    no_decay = [(n, p) for n, p in named_params if "lora_" not in n]
    groups = []
    for items, wd in ((decay, weight_decay), (no_decay, 0.0)):
        if items:
            groups.append({"params": [p for _, p in items], "names": [n for n, _ in items], "weight_decay": wd})
    # foreach=False: one code path on CPU and GPU, so a gloo run and an NCCL run update alike.
    return AdamW(groups, lr=lr, betas=betas, eps=eps)


def set_lr(opt: AdamW, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def _named(opt: AdamW):
    for g in opt.param_groups:
        yield from zip(g["names"], g["params"])


def save_optimizer(opt: AdamW, path: Path) -> None:
    tensors = {}
    for name, p in _named(opt):
        st = opt.state.get(p)
        if not st:
            continue
        tensors[f"{name}.exp_avg"] = st["exp_avg"].detach().float().cpu().contiguous()
        tensors[f"{name}.exp_avg_sq"] = st["exp_avg_sq"].detach().float().cpu().contiguous()
        tensors[f"{name}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1).cpu()
    # One metadata key only: safetensors writes metadata in hash-map order, so several keys would
    # make the file's bytes differ between identical runs (betas and eps are the stage's arguments,
    # recorded in the manifest).
    save_small(tensors, Path(path))


def load_optimizer(opt: AdamW, path: Path) -> int:
    """Restore moments saved by ``save_optimizer``; returns how many parameters had state.

    Every saved tensor must belong to a trainable parameter of the same shape, and a parameter
    with saved state must have all three entries; anything else is a BadInputError naming it.
    """
    path = Path(path)
    try:
        f = safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error types
        raise BadInputError(f"{path}: not a readable safetensors optimizer state ({e})") from None
    with f:
        keys = set(f.keys())
        params = dict(_named(opt))
        known = {f"{n}.{s}" for n in params for s in ("exp_avg", "exp_avg_sq", "step")}
        stray = sorted(keys - known)
        if stray:
            raise BadInputError(
                f"{path}: optimizer state for {stray[0]!r} matches no trainable parameter",
                hint="the adapter was trained with other --lora-targets/--train-norms",
            )
        restored = 0
        for name, p in params.items():
            have = [k in keys for k in (f"{name}.exp_avg", f"{name}.exp_avg_sq", f"{name}.step")]
            if not any(have):
                continue
            if not all(have):
                raise BadInputError(f"{path}: incomplete optimizer state for {name!r}")
            avg, sq = f.get_tensor(f"{name}.exp_avg"), f.get_tensor(f"{name}.exp_avg_sq")
            for kind, t in (("exp_avg", avg), ("exp_avg_sq", sq)):
                if t.shape != p.shape:
                    raise BadInputError(
                        f"{path}: optimizer state {name}.{kind} has shape {tuple(t.shape)}, parameter has {tuple(p.shape)}"
                    )
            step = f.get_tensor(f"{name}.step").reshape(())
            opt.state[p] = {
                "step": step.to(torch.float32),
                "exp_avg": avg.to(device=p.device, dtype=p.dtype),
                "exp_avg_sq": sq.to(device=p.device, dtype=p.dtype),
            }
            restored += 1
    return restored


def grad_norm_and_clip(params: list[torch.Tensor], max_norm: float | None) -> float:
    """Global L2 norm of the grads (before clipping); clips in place when ``max_norm`` > 0."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    if max_norm and max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return float(norm)
