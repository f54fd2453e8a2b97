"""Prefill of freshly admitted prompts: host time, wall time and kernel time, eager or graphed.

Qwen2.5-7B shape, random NVFP4 weights, without and with LoRA r=16 on all seven projections; 1 and
4 prompts of 256 tokens admitted together, as continuous batching admits them (G = 8 children each).
``QERL_PREFILL_GRAPHS=0`` measures the eager prefill. Host time is until ``prefill`` returns; wall
time includes the device finishing; kernel time is the profiler's device total for one call.

    QERL_PREFILL_GRAPHS=0 python benchmarks/probe_prefill.py; python benchmarks/probe_prefill.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rollout import free, prompts  # noqa: E402

from qerl_cli.engine import LLMEngine  # noqa: E402
from qerl_cli.engine.block_manager import BlockManager  # noqa: E402
from qerl_cli.engine.scheduler import Group, Scheduler  # noqa: E402
from qerl_cli.layers.lora import LoraSpec  # noqa: E402
from qerl_cli.models import build_random_model, preset  # noqa: E402


def admit(engine, ps):
    sched = Scheduler(BlockManager(engine.num_blocks, engine.block_size), 64, 16384)
    for i, p in enumerate(ps):
        sched.add(Group(i, p, 8, len(p) + 64))
    return sched.admit()


def main() -> int:
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        return 0
    print(f"# {torch.cuda.get_device_name()}", flush=True)
    for lora in (0, 16):
        free()
        model = build_random_model(preset("qwen2.5-7b"), device="cuda", dtype=torch.bfloat16, quantized=True,
                                   max_positions=4096, lora=LoraSpec(r=lora, alpha=lora) if lora else None)
        engine = LLMEngine(model, None, max_num_seqs=64, max_model_len=1300)
        engine._sync_lora()
        engine.runner.bind()
        for count in (1, 4):
            ps = prompts(count, 256, model.config.vocab_size)
            times = []
            for _ in range(4):
                groups = admit(engine, ps)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.inference_mode():
                    engine.runner.prefill(groups)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                times.append(((t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                with torch.inference_mode():
                    engine.runner.prefill(admit(engine, ps))
                torch.cuda.synchronize()
            kernels = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
            busy = sum(ev.device_time_total for ev in kernels) / 1e3
            print(f"lora {lora}, {count} prompt(s) x 256: host {times[-1][0]:.1f} ms, wall {times[-1][1]:.1f} ms "
                  f"(reps {[round(w, 1) for _, w in times]}), kernels {busy:.1f} ms in {len(kernels)} launches",
                  flush=True)
        del engine, model
    return 0


if __name__ == "__main__":
    sys.exit(main())
