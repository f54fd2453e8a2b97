"""LoRA shrink (``x @ A^T`` at decode sizes): qerl's one-launch kernel vs cuBLAS, per K-steps setting.

Each time is the median over CUDA-graph replays of 64 back-to-back calls (as in a decode graph, where
launch and tail latency are the cost), inputs rotated over 8 copies; Qwen2.5-7B / 32B LoRA shapes:
N = 16 (one projection at r = 16), 32 (gate/up), 48 (q/k/v).

    python benchmarks/bench_lora.py --json-out $OUT/lora.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import time_graph  # noqa: E402
from qerl_kernels import lora  # noqa: E402

SHAPES = [(3584, 48), (3584, 32), (3584, 16), (18944, 16), (5120, 48), (27648, 16)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,16,64,256")
    ap.add_argument("--steps", default="2,4,8", help="K steps per split to compare (the shipped plan uses 4)")
    ap.add_argument("--json-out", default="")
    args = ap.parse_args(argv)
    out = []
    print(f"# {torch.cuda.get_device_name()}", flush=True)
    for k, n in SHAPES:
        for m in (int(v) for v in args.ms.split(",")):
            xs = [torch.randn(m, k, device="cuda").bfloat16() for _ in range(8)]
            a = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
            calls = [xs[i % 8] for i in range(64)]
            rec = dict(m=m, k=k, n=n, cublas_us=round(time_graph([lambda x=x, a=a: x @ a.t() for x in calls]), 2))
            ref = xs[0].double() @ a.double().t()
            for s in (int(v) for v in args.steps.split(",")):
                orig = lora.plan
                lora.plan = lambda m_, n_, k_, s=s, orig=orig: orig(m_, n_, k_, steps=s)
                try:
                    rec[f"qerl_s{s}_us"] = round(time_graph([lambda x=x, a=a: lora.shrink(x, a) for x in calls]), 2)
                    err = float((lora.shrink(xs[0], a).double() - ref).norm() / ref.norm())
                    assert err < 8e-3, err
                finally:
                    lora.plan = orig
            print(json.dumps(rec), flush=True)
            out.append(rec)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
