"""Rollout engine throughput on an H100: NVFP4 vs bf16, vs transformers generate(), decode bandwidth, 32B.

Random weights built directly on the GPU (speed does not depend on values), Qwen2.5-shaped models,
256-token random prompts, EOS ignored, G=8 completions per prompt (the RL shape: one prefill per
prompt shared by its 8 completions). tokens/s = generated tokens / wall time of ``generate`` (prefill,
decode, sampling and host bookkeeping included). Each configuration runs in its own try block; results
stream to stdout and ``$OUT/bench_rollout.jsonl`` so a crash or timeout keeps what was measured;
the summary table goes to stdout and ``$OUT/bench_rollout.md``.

    python benchmarks/bench_rollout.py                    # everything (~5 min on an H100)
    python benchmarks/bench_rollout.py --only nvfp4-16,bf16-16 --new-tokens 128   # a quick subset
    python benchmarks/bench_rollout.py --pairs 16,256 --rounds 4   # the NVFP4/bf16 ratios, engines alternated
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch

from qerl_cli.engine import LLMEngine, SamplingParams
from qerl_cli.layers.lora import LoraSpec
from qerl_cli.models import build_random_model, preset

HBM_TBPS = 3.0  # measured H100 SXM HBM3 bandwidth (nvfp4-format.md)
RESULTS: list[dict] = []
TRUNCATION: dict = {}  # --top-p / --top-k / --min-p for the run_engine benches


def log(rec: dict) -> None:
    RESULTS.append(rec)
    print(json.dumps(rec), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_rollout.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (num, length), generator=g).tolist()


def weight_bytes(model) -> int:
    """Bytes one decode step must read: every Linear (packed NVFP4 or dense), norms, LoRA, lm_head.

    The embedding table is excluded (a step reads one row per sequence) unless tied to lm_head.
    """
    seen, total = set(), 0
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
    for name, t in named:
        if name.endswith(("noise", "cos_sin")) or t.data_ptr() in seen:
            continue
        if name.startswith("model.embed_tokens") and not model.config.tie_word_embeddings:
            continue
        seen.add(t.data_ptr())
        # LoRA: the step reads its copies in the activations' dtype, not the fp32 masters (audit)
        size = torch.empty(0, dtype=model.dtype).element_size() if ".lora_" in name else t.element_size()
        total += t.numel() * size
    return total


def run_engine(name, model, seqs, prompt_len, new_tokens, group=8, max_model_len=None):
    free()
    t0 = time.perf_counter()
    engine = LLMEngine(model, None, max_num_seqs=seqs, max_model_len=max_model_len or prompt_len + new_tokens + 16)
    setup = time.perf_counter() - t0
    trunc = {k: v for k, v in TRUNCATION.items() if k != "sampler"}
    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0, **trunc)
    ps = prompts(max(seqs // group, 1), prompt_len, model.config.vocab_size)
    n = min(group, seqs)
    # Warm-up at the timed batch (prefill of every prompt, decode at this batch size), so no first-use
    # cost (Triton JIT for a new shape, cuBLAS heuristics) lands in the timed call.
    engine.generate(ps, SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, **trunc), n=n)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = engine.generate(ps, sp, n=n)
    torch.cuda.synchronize()
    st = engine.stats
    assert all(len(c.token_ids) == new_tokens for g in out for c in g)
    rec = dict(bench=name, seqs=len(ps) * n, prompt=prompt_len, new_tokens=new_tokens, tok_s=round(st["tokens_per_s"], 1),
               wall_s=round(st["elapsed_s"], 2), setup_s=round(setup, 1), decode_steps=st["decode_steps"],
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2), kv_blocks=engine.num_blocks,
               sampling=" ".join(f"{k}={v}" for k, v in TRUNCATION.items()))
    return engine, rec


def run_pair(models: dict, seqs: int, prompt_len: int, new_tokens: int, rounds: int, group: int = 8) -> dict:
    """NVFP4 / bf16 tokens/s with the two engines built side by side and timed alternately (A B B A ...),
    each side's median over ``rounds``: the single-sample rows run every NVFP4 row before every bf16 one,
    so a drift of the clocks over the run went into the ratio one way (audit, 2026-11-26)."""
    free()
    trunc = {k: v for k, v in TRUNCATION.items() if k != "sampler"}
    ps = prompts(max(seqs // group, 1), prompt_len, next(iter(models.values())).config.vocab_size)
    n = min(group, seqs)
    engines = {q: LLMEngine(m, None, max_num_seqs=seqs, max_model_len=prompt_len + new_tokens + 16)
               for q, m in models.items()}
    for e in engines.values():  # warm-up at the timed batch
        e.generate(ps, SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, **trunc), n=n)
    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0, **trunc)
    samples: dict[str, list[float]] = {q: [] for q in engines}
    order = list(engines)
    for r in range(rounds):
        for q in (order if r % 2 == 0 else order[::-1]):
            torch.cuda.synchronize()
            out = engines[q].generate(ps, sp, n=n)
            torch.cuda.synchronize()
            assert all(len(c.token_ids) == new_tokens for g in out for c in g)
            samples[q].append(round(engines[q].stats["tokens_per_s"], 1))
    med = {q: statistics.median(v) for q, v in samples.items()}
    del engines
    return dict(bench=f"pair-{'-'.join(models)}-7b", seqs=len(ps) * n, prompt=prompt_len, new_tokens=new_tokens,
                rounds=rounds, median_tok_s=med, samples=samples, ratio=round(med[order[0]] / med[order[1]], 4),
                tok_s=" / ".join(f"{med[q]:.1f}" for q in order), sampling=" ".join(f"{k}={v}" for k, v in TRUNCATION.items()))


def run_eos(name, model, seqs, prompt_len, new_tokens, prompts_total, stop_every=500, group=8):
    """Continuous batching as an RL rollout sees it: completions stop at random lengths (a random
    1/``stop_every`` of the vocabulary are stop tokens; random weights sample near-uniformly), and
    ``prompts_total`` prompts stream through ``seqs`` slots, so finished groups free slots and single
    prompts are admitted (prefilled) mid-run. Run twice, prefill graphs off then on (same model)."""
    out = []
    vocab = model.config.vocab_size
    stops = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[: vocab // stop_every].tolist()
    ps = prompts(prompts_total, prompt_len, vocab)
    for flag in ("0", "1"):
        free()
        os.environ["QERL_PREFILL_GRAPHS"] = flag
        try:
            engine = LLMEngine(model, None, max_num_seqs=seqs, max_model_len=prompt_len + new_tokens + 16)
        finally:
            os.environ.pop("QERL_PREFILL_GRAPHS")
        sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=stops, seed=0)
        engine.generate(ps[: seqs // group], sp, n=group)  # warm-up
        torch.cuda.synchronize()
        res = engine.generate(ps, sp, n=group)
        torch.cuda.synchronize()
        lens = [len(c.token_ids) for g in res for c in g]
        st = engine.stats
        out.append(dict(bench=f"{name}-prefill-graphs-{'on' if flag == '1' else 'off'}", seqs=seqs, prompts=prompts_total,
                        n=group, prompt=prompt_len, max_new_tokens=new_tokens, mean_len=round(sum(lens) / len(lens), 1),
                        tok_s=round(st["tokens_per_s"], 1), wall_s=round(st["elapsed_s"], 2),
                        decode_steps=st["decode_steps"]))
        del engine
    return out


def decode_bandwidth(name, engine, model, seqs, ctx):
    """Replay the captured decode graph for `seqs` sequences at context `ctx`: bytes read / step time."""
    from qerl_cli.engine.sequence import Sequence

    runner = engine.runner
    bs = runner.block_size
    ctx = min(ctx, runner.max_model_len - 1)
    nb = -(-(ctx + 1) // bs)
    fake = []
    for i in range(seqs):
        blocks = list(range(1 + i * nb, 1 + (i + 1) * nb))
        s = Sequence(group=i, child=0, token_ids=[1] * ctx, num_prompt=ctx, max_len=ctx + 1, block_table=blocks, slot=i)
        runner.set_block_table(s)
        fake.append(s)
    runner.load_batch(fake)  # the step only reads the state, so replays repeat the same step
    for _ in range(3):
        runner.step()
    torch.cuda.synchronize()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    iters = 20
    ev0.record()
    for _ in range(iters):
        runner.step()
    ev1.record()
    torch.cuda.synchronize()
    step_ms = ev0.elapsed_time(ev1) / iters
    wb = weight_bytes(model)
    kvb = seqs * ctx * runner.kv_bytes_per_token
    tbps = (wb + kvb) / (step_ms * 1e-3) / 1e12
    return dict(bench=name, seqs=seqs, context=ctx, step_ms=round(step_ms, 3), weight_gb=round(wb / 1e9, 2),
                kv_gb=round(kvb / 1e9, 2), tb_s=round(tbps, 2), pct_of_3TBs=round(100 * tbps / HBM_TBPS, 1))


def hf_generate(seqs, prompt_len, new_tokens, group=8):
    import transformers

    free()
    cfg = preset("qwen2.5-7b")
    hcfg = transformers.Qwen2Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                    intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                                    num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                                    max_position_embeddings=4096, rope_theta=cfg.rope_theta)
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(hcfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    hf.eval()
    ps = torch.tensor(prompts(seqs // group, prompt_len, cfg.vocab_size), device="cuda")
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, min_new_tokens=new_tokens, num_return_sequences=group,
              pad_token_id=0)
    with torch.no_grad():
        hf.generate(ps, max_new_tokens=4, **{**kw, "min_new_tokens": 4})  # at the timed batch, as the engine warms up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf.generate(ps, max_new_tokens=new_tokens, **kw)
        torch.cuda.synchronize()
    el = time.perf_counter() - t0
    gen = out.shape[0] * (out.shape[1] - prompt_len)
    del hf
    return dict(bench="hf-generate-bf16-7b", seqs=out.shape[0], prompt=prompt_len, new_tokens=new_tokens,
                tok_s=round(gen / el, 1), wall_s=round(el, 2))


def guarded(fn, *a, **k):
    try:
        return fn(*a, **k)
    except Exception as e:  # keep going: one failing configuration must not lose the others
        log(dict(bench=getattr(fn, "__name__", "?"), args=str(a[:1]), error=f"{type(e).__name__}: {e}"))
        traceback.print_exc()
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma list: nvfp4-16,bf16-16,nvfp4-256,bf16-256,nvfp4-lora-16,bf16-lora-16,"
                                                   "nvfp4-lora-256,bf16-lora-256,hf-64,bw-64,32b,32b-bf16,eos-nvfp4,eos-bf16 "
                                                   "(32b-bf16: the 32B row's workload on bf16 weights, which leave "
                                                   "KV room for fewer sequences at once)")
    ap.add_argument("--pairs", default="", help="comma list of sequence counts (e.g. 16,256): NVFP4 and bf16 engines "
                                               "side by side, timed alternately; the ratio of medians")
    ap.add_argument("--rounds", type=int, default=4, help="with --pairs: timed calls per engine")
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--hf-new-tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--big-new-tokens", type=int, default=2048)
    ap.add_argument("--top-p", type=float, default=1.0, help="sampling truncation for the engine benches (default: none)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--torch-sampler", action="store_true",
                    help="truncated sampling by the torch reference (sort + inverse CDF), as before 2026-11-26")
    args = ap.parse_args()
    TRUNCATION.update(top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    if args.torch_sampler:
        TRUNCATION["sampler"] = "torch"
        from qerl_cli.engine import sampler

        plain = sampler._fast_path
        sampler._fast_path = lambda logits, sp: plain(logits, sp) and sp.top_p == 1.0 and not sp.top_k and not sp.min_p
    want = set(args.only.split(",")) if args.only else {"nvfp4-16", "bf16-16", "nvfp4-256", "bf16-256", "nvfp4-lora-16",
                                                        "bf16-lora-16", "nvfp4-lora-256", "bf16-lora-256", "hf-64",
                                                        "bw-64", "32b"}
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    cfg7 = preset("qwen2.5-7b")
    if args.pairs:
        models = {q: build_random_model(cfg7, device="cuda", dtype=torch.bfloat16, quantized=q == "nvfp4",
                                        max_positions=4096) for q in ("nvfp4", "bf16")}
        for seqs in map(int, args.pairs.split(",")):
            r = guarded(run_pair, models, seqs, args.prompt, args.new_tokens, args.rounds)
            if r:
                log(r)
        del models
        want = set(args.only.split(",")) if args.only else set()
    for quant in ("nvfp4", "bf16"):
        if not any(w.startswith(quant) for w in want) and not ("bw-64" in want or (quant == "bf16" and "hf-64" in want)):
            continue
        free()
        model = build_random_model(cfg7, device="cuda", dtype=torch.bfloat16, quantized=quant == "nvfp4",
                                   max_positions=4096)
        for seqs in (16, 256):
            if f"{quant}-{seqs}" in want:
                r = guarded(run_engine, f"engine-{quant}-7b", model, seqs, args.prompt, args.new_tokens)
                if r:
                    log(r[1])
                    del r
        if "bw-64" in want or (quant == "bf16" and "hf-64" in want):
            r = guarded(run_engine, f"engine-{quant}-7b", model, 64, args.prompt, args.hf_new_tokens,
                        max_model_len=args.prompt + args.new_tokens + 16)
            if r:
                engine, rec = r
                log(rec)
                if "bw-64" in want:
                    bw = guarded(decode_bandwidth, f"decode-bw-{quant}-7b", engine, model, 64, args.prompt + args.new_tokens // 2)
                    if bw:
                        log(bw)
                del engine, r
        del model
        lora_seqs = [s for s in (16, 256) if f"{quant}-lora-{s}" in want]
        if lora_seqs:  # the RL case: the policy's adapter on all seven projections
            free()
            model = build_random_model(cfg7, device="cuda", dtype=torch.bfloat16, quantized=quant == "nvfp4",
                                       lora=LoraSpec(r=16, alpha=16), max_positions=4096)
            for seqs in lora_seqs:
                r = guarded(run_engine, f"engine-{quant}-lora16-7b", model, seqs, args.prompt, args.new_tokens)
                if r:
                    log(r[1])
                    del r
            del model
    for quant in ("nvfp4", "bf16"):
        if f"eos-{quant}" in want:  # 64 prompts x 8 through 256 slots, random stop lengths
            free()
            model = build_random_model(cfg7, device="cuda", dtype=torch.bfloat16, quantized=quant == "nvfp4",
                                       lora=LoraSpec(r=16, alpha=16), max_positions=4096)
            for rec in guarded(run_eos, f"engine-{quant}-lora16-7b-eos", model, 256, args.prompt, args.new_tokens, 64) or []:
                log(rec)
            del model
    if "hf-64" in want:
        r = guarded(hf_generate, 64, args.prompt, args.hf_new_tokens)
        if r:
            log(r)
    for quant in ("nvfp4", "bf16"):
        if ("32b" if quant == "nvfp4" else "32b-bf16") not in want:
            continue
        free()
        model = guarded(build_random_model, preset("qwen2.5-32b"), device="cuda", dtype=torch.bfloat16,
                        quantized=quant == "nvfp4", lora=LoraSpec(r=16, alpha=16), max_positions=4096)
        if model is not None:
            r = guarded(run_engine, f"engine-{quant}-lora16-32b", model, 64, args.prompt, args.big_new_tokens)
            if r:
                r[1]["mean_batch"] = round(r[0].stats["generated_tokens"] / max(r[0].stats["decode_steps"], 1), 1)
                log(r[1])
                del r
            del model
    lines = ["| bench | seqs | new tok | tok/s | wall s | peak GiB | step ms | TB/s | % of 3 TB/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in RESULTS:
        lines.append(f"| {r.get('bench')} | {r.get('seqs', '')} | {r.get('new_tokens', r.get('context', ''))} | "
                     f"{r.get('tok_s', '')} | {r.get('wall_s', '')} | {r.get('peak_gib', '')} | {r.get('step_ms', '')} | "
                     f"{r.get('tb_s', '')} | {r.get('pct_of_3TBs', r.get('error', ''))} |")
    table = "\n".join(lines)
    print("\n" + table, flush=True)
    if os.environ.get("OUT"):  # the table for docs/benchmarks.md, "## rollout engine"
        with open(os.path.join(os.environ["OUT"], "bench_rollout.md"), "w") as f:
            f.write(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n\n{table}\n")

if __name__ == "__main__":
    sys.exit(main())
