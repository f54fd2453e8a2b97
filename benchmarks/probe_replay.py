"""What train-step's replay of a sampling cut costs per 128-row block at a 152k vocabulary.

Times ``find_kept`` (the sampler's own cut: min-p, top-k, stable-sort top-p) and ``apply_kept_`` (the
backward's re-application from two numbers per row) on random logits rounded to bf16 values, as an lm_head
gives them (ties everywhere), and the top-p sort alone,
each as the median of CUDA-event timings after a warm-up.

    python benchmarks/probe_replay.py --vocab 152064 --rows 128 --scales 1,4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sampler import timed as _timed  # noqa: E402  (median of CUDA-event timings after a warm-up)

from qerl_cli.engine.sampler import truncate  # noqa: E402
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--scales", default="1,4", help="logit std: 1 is near flat over 152k tokens, 4 peaked")
    args = ap.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()} rows {args.rows} vocab {args.vocab}", flush=True)
    for scale in (float(s) for s in args.scales.split(",")):
        for cut in ((0.95, 0, 0.0), (1.0, 50, 0.0), (0.95, 50, 0.02)):
            print(probe(args.rows, args.vocab, scale, cut), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
