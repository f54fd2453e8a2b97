"""Are the results of --keep-activations N the same bits for every N on the GPU, at a real model's shape?

A Qwen2.5-7B-shaped NVFP4 model with random weights and a random LoRA r=16 on all seven projections,
one micro-batch of 3 x 1536 tokens, torch's default attention backend (flash) and bf16: the hidden states
and every LoRA gradient under N = 0, 28, 0 (again) and 14, against the first.

    python benchmarks/probe_keep_bits.py [--rows 3] [--seq 1536] [--keeps 0,28,0,14]

The benchmark's 7B step uses micro-batches of 5 x 1536 tokens: ``--rows 5`` checks that shape.
"""

import argparse

import torch

from qerl_cli.layers.lora import LoraSpec
from qerl_cli.models import build_random_model, preset
from tests.test_train_memory import grads_of, train_lora_only


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=3)
    ap.add_argument("--seq", type=int, default=1536)
    ap.add_argument("--keeps", default="0,28,0,14", help="layers kept in each run; each is compared with the first")
    a = ap.parse_args()
    m = build_random_model(preset("qwen2.5-7b"), device="cuda", dtype=torch.bfloat16, quantized=True,
                           lora=LoraSpec(r=16, alpha=16), max_positions=a.seq + 16)
    params = train_lora_only(m, 0.01)
    ids = torch.randint(0, 150000, (a.rows, a.seq), device="cuda")
    mask = torch.ones_like(ids)
    ref = None
    for keep in (int(k) for k in a.keeps.split(",")):
        m.keep_activations = keep
        h, gr = grads_of(m, params, ids, mask)
        if ref is None:
            ref = (h, gr)
            continue
        print(keep, "hidden equal", torch.equal(ref[0], h), float((ref[0].float() - h.float()).abs().max()),
              "grads equal", sum(torch.equal(a, b) for a, b in zip(ref[1], gr)), "of", len(gr),
              "max rel", max(float((a - b).abs().max() / (a.abs().max() + 1e-30)) for a, b in zip(ref[1], gr)),
              flush=True)


if __name__ == "__main__":
    main()
