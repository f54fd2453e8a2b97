"""Does a rerun of the rollout engine give the same tokens and log-probs bit for bit on the GPU?

A Qwen2.5-7B-shaped model (random weights, NVFP4 unless --bf16, a random LoRA r=16 on all seven
projections unless --no-lora), ``--prompts`` random prompts x G completions, temperature 1 with the
given truncation. It generates twice in one engine, then once in a second engine built afresh (new KV
cache and CUDA graphs), and prints a digest of every completion's token ids and log-probs for each
run, so running the script twice also compares separate processes, as a rerun of `qerl rollout` is:

    python benchmarks/probe_rollout_repeat.py [--prompts 8 --group 8 --new-tokens 256 --top-p 0.95]
"""

import argparse
import hashlib

import torch

from qerl_cli.engine import LLMEngine, SamplingParams
from qerl_cli.layers.lora import LoraSpec, lora_parameters
from qerl_cli.models import ModelConfig, build_random_model, preset

TINY = dict(arch="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, qkv_bias=True)


def digest(out) -> str:
    h = hashlib.sha256()
    for group in out:
        for c in group:
            h.update(torch.tensor(c.token_ids, dtype=torch.int64).numpy().tobytes())
            h.update(torch.tensor(c.logprobs, dtype=torch.float64).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--no-lora", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda; cpu with --shape tiny checks this script")
    ap.add_argument("--shape", default="qwen2.5-7b", help="a qerl_cli.models preset, or tiny")
    a = ap.parse_args()
    dev = a.device
    lora = None if a.no_lora else LoraSpec(r=16, alpha=16)
    cfg = ModelConfig(**TINY) if a.shape == "tiny" else preset(a.shape)
    m = build_random_model(cfg, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32, quantized=not a.bf16, lora=lora,
                           max_positions=a.prompt_len + a.new_tokens + 16)
    if lora is not None:
        g = torch.Generator(device=dev).manual_seed(5)
        with torch.no_grad():
            for p in lora_parameters(m):  # B = 0 at init would make the adapter a no-op
                p.copy_(torch.randn(p.shape, generator=g, device=dev, dtype=p.dtype) * 0.01)
    m.eval()
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(0, m.config.vocab_size, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
    sp = SamplingParams(temperature=1.0, top_p=a.top_p, max_new_tokens=a.new_tokens, ignore_eos=True, seed=3)
    seqs = a.prompts * a.group
    runs = []
    for engines in range(2):
        engine = LLMEngine(m, None, max_num_seqs=seqs, max_model_len=a.prompt_len + a.new_tokens + 16)
        for _ in range(2 - engines):
            runs.append(digest(engine.generate(ps, sp, n=a.group)))
            print(f"engine {engines + 1}: {runs[-1]}", flush=True)
        del engine
        if dev == "cuda":
            torch.cuda.empty_cache()
    print("all equal" if len(set(runs)) == 1 else "DIFFER", runs, flush=True)


if __name__ == "__main__":
    main()
