"""What train-step's replay of a sampling cut costs per 128-row block at a 152k vocabulary.

Times ``find_kept`` (the sampler's own cut: min-p, top-k, stable-sort top-p) and ``apply_kept_`` (the
backward's re-application from two numbers per row) on random logits rounded to bf16 values, as an lm_head
gives them (ties everywhere), and the top-p sort alone,
each as the median of CUDA-event timings after a warm-up. ``--fused`` also times, per logits chunk of
``--chunk-rows``, the log-prob forward (cut + log-sum-exp + log-prob + entropy) and backward (cut +
softmax gradient) as train-step runs them on CUDA (``train.triton_logprobs``, one pass each) against the
torch path they replaced, with and without a cut.

    python benchmarks/probe_replay.py --vocab 152064 --rows 128 --scales 1,4 --fused --chunk-rows 1024
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sampler import timed as _timed  # noqa: E402  (median of CUDA-event timings after a warm-up)

from qerl_cli.engine.sampler import truncate  # noqa: E402
from qerl_cli.train import logprobs as lp  # noqa: E402
from qerl_cli.train import triton_logprobs  # noqa: E402
from qerl_cli.train.logprobs import apply_kept_, find_kept  # noqa: E402


def timed(fn) -> float:
    return _timed(fn, 20)


def probe(rows: int, vocab: int, scale: float, cut: tuple[float, int, float]) -> dict:
    z = (torch.randn(rows, vocab, device="cuda") * scale).bfloat16().float()  # lm_head's values: bf16, ties
    t = torch.randint(0, vocab, (rows,), device="cuda")
    trunc = torch.tensor([cut] * rows, dtype=torch.float64, device="cuda")
    kept = find_kept(z, trunc)
    row = {"scale": scale, "cut": cut, "find_kept_us": round(timed(lambda: find_kept(z, trunc)), 1),
           "apply_kept_us": round(timed(lambda: apply_kept_(z.clone(), t, kept)), 1),
           "clone_us": round(timed(lambda: z.clone()), 1),
           "kept_tokens_mean": float((z >= kept.last[:, None]).sum(-1).float().mean())}
    if cut[0] < 1:
        row["sort_us"] = round(timed(lambda: torch.sort(z, dim=-1, descending=True, stable=True)), 1)
        row["truncate_us"] = round(timed(lambda: truncate(z, cut[0], int(cut[1]), cut[2])), 1)
    return row


def _torch_forward(z, t, kept):
    return lp._lse_logp_entropy(z if kept is None else apply_kept_(z, t, kept), t)


def _torch_backward(z, t, lse, scale, kept):
    if kept is not None:
        apply_kept_(z, t, kept)
    for i in range(0, z.shape[0], lp._ROWS):
        blk = z[i : i + lp._ROWS]
        blk.sub_(lse[i : i + lp._ROWS].unsqueeze(-1)).exp_().mul_(-scale[i : i + lp._ROWS].unsqueeze(-1))
    return z.scatter_add_(1, t.unsqueeze(-1), scale.unsqueeze(-1))


def probe_fused(rows: int, vocab: int, scale: float, cut: tuple[float, int, float] | None) -> dict:
    """us per chunk of the log-prob forward / backward: torch path against the one-pass kernels. The torch
    forward and both backwards include a clone of the chunk (they overwrite it; ``clone_us``, also given);
    the one-pass forward leaves it as it is and clones nothing."""
    z = (torch.randn(rows, vocab, device="cuda") * scale).bfloat16().float()
    t = torch.randint(0, vocab, (rows,), device="cuda")
    g = torch.rand(rows, device="cuda") + 0.5
    kept = None if cut is None else find_kept(z, torch.tensor([cut] * rows, dtype=torch.float64, device="cuda"))
    lse = _torch_forward(z.clone(), t, kept)[0]
    got = triton_logprobs.lse_logp_entropy(z, t, kept)
    return {"rows": rows, "scale": scale, "cut": cut,
            "max_logp_diff": float((got[1] - _torch_forward(z.clone(), t, kept)[1]).abs().max()),
            "torch_fwd_us": round(timed(lambda: _torch_forward(z.clone(), t, kept)), 1),
            "fused_fwd_us": round(timed(lambda: triton_logprobs.lse_logp_entropy(z, t, kept)), 1),
            "torch_bwd_us": round(timed(lambda: _torch_backward(z.clone(), t, lse, g, kept)), 1),
            "fused_bwd_us": round(timed(lambda: triton_logprobs.logits_grad_(z.clone(), t, lse, g, kept)), 1),
            "clone_us": round(timed(lambda: z.clone()), 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--scales", default="1,4", help="logit std: 1 is near flat over 152k tokens, 4 peaked")
    ap.add_argument("--fused", action="store_true", help="also time the one-pass log-prob kernels per chunk")
    ap.add_argument("--chunk-rows", type=int, default=1024, help="rows of a logits chunk (--logits-chunk-tokens)")
    args = ap.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()} rows {args.rows} vocab {args.vocab}", flush=True)
    for scale in (float(s) for s in args.scales.split(",")):
        for cut in ((0.95, 0, 0.0), (1.0, 50, 0.0), (0.95, 50, 0.02)):
            print(probe(args.rows, args.vocab, scale, cut), flush=True)
        if args.fused:
            for cut in (None, (0.95, 0, 0.0), (0.95, 50, 0.02)):
                print(probe_fused(args.chunk_rows, args.vocab, scale, cut), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
