"""Where a decode step's time goes: CUDA-graph step time and a per-kernel breakdown.

Qwen2.5-7B shape, random weights, NVFP4 and bf16, the engine's captured decode graph replayed at a
fixed context (as ``bench_rollout.py``'s decode-bandwidth row); the breakdown profiles one eager
step with ``torch.profiler`` and sums device time per kernel name.

    python benchmarks/profile_decode.py --seqs 16,64 --ctx 768 --json-out $OUT/decode.json
    python benchmarks/profile_decode.py --seqs 16,64 --lora 16   # LoRA r=16 on all seven projections
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rollout import decode_bandwidth, free  # noqa: E402

from qerl_cli.engine import LLMEngine  # noqa: E402
from qerl_cli.layers.lora import LoraSpec  # noqa: E402
from qerl_cli.models import build_random_model, preset  # noqa: E402


def breakdown(runner, steps: int = 3) -> list[tuple[str, float, int]]:
    """(kernel name, us per step, launches per step) of the eager decode step, slowest first."""
    b = runner.padded
    args = (runner.state[0, :b], runner.state[1, :b], runner.state[2, :b], runner.max_context)
    with torch.inference_mode():
        runner._decode_step(*args)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                runner._decode_step(*args)
            torch.cuda.synchronize()
    tot, cnt = collections.Counter(), collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name[:90]
            tot[name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            cnt[name] += 1
    return [(n, t / steps, cnt[n] // steps) for n, t in tot.most_common()]


def loop_breakdown(engine, vocab: int, seqs: int, new_tokens: int = 128) -> dict:
    """Profile ``generate`` (G = 8): wall time per decode step vs device kernel time per step, and the
    kernels outside the captured graph (sampling, state updates, copies)."""
    from bench_rollout import prompts

    from qerl_cli.engine import SamplingParams

    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    ps = prompts(max(seqs // 8, 1), 256, vocab)
    engine.generate(ps, sp, n=min(8, seqs))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.generate(ps, sp, n=min(8, seqs))
        torch.cuda.synchronize()
    steps = engine.stats["decode_steps"]
    tot = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            tot[ev.name[:90]] += ev.device_time_total
    busy = sum(tot.values())
    return dict(bench=f"loop-{seqs}", wall_ms_per_step=round(engine.stats["elapsed_s"] * 1e3 / steps, 3),
                kernel_ms_per_step=round(busy / 1e3 / steps, 3),
                top=[(n, round(t / steps, 1)) for n, t in tot.most_common(12)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="16,64")
    ap.add_argument("--ctx", type=int, default=768)
    ap.add_argument("--quants", default="nvfp4,bf16")
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--loop", action="store_true", help="also profile the generate loop (sampling, host)")
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank on all seven projections (0: none)")
    ap.add_argument("--json-out", default="")
    args = ap.parse_args(argv)
    seqs = [int(s) for s in args.seqs.split(",")]
    out = []
    print(f"# {torch.cuda.get_device_name()}", flush=True)
    for quant in args.quants.split(","):
        free()
        model = build_random_model(preset("qwen2.5-7b"), device="cuda", dtype=torch.bfloat16,
                                   quantized=quant == "nvfp4", max_positions=4096,
                                   lora=LoraSpec(r=args.lora, alpha=args.lora) if args.lora else None)
        tag = f"{quant}-lora{args.lora}" if args.lora else quant
        engine = LLMEngine(model, None, max_num_seqs=max(seqs), max_model_len=args.ctx + 64)
        for s in seqs:
            rec = decode_bandwidth(f"decode-{tag}-7b", engine, model, s, args.ctx)
            print(json.dumps(rec), flush=True)
            out.append(rec)
            if not args.no_breakdown:
                rows = breakdown(engine.runner)
                total = sum(t for _, t, _ in rows)
                print(f"## eager step kernels, {tag}, {s} seqs: {total / 1e3:.2f} ms of kernel time")
                for name, t, c in rows[:25]:
                    print(f"{t:9.1f} us {c:5d}x  {name}")
                out.append(dict(bench=f"breakdown-{tag}-{s}", kernels=rows[:40], total_us=total))
            if args.loop:
                rec = loop_breakdown(engine, model.config.vocab_size, s)
                print(json.dumps(rec), flush=True)
                out.append(rec)
        del engine
        free()
        del model
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
