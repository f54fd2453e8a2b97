"""Which of PyTorch's attention backends give the same gradient bits on every run, and what each costs (GPU).

train-step runs ``F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=...)`` and lets PyTorch
pick the backend. A user who reruns one stage to debug it wants the same bytes back; this probe runs
forward + backward of every backend ``--repeats`` times on identical inputs at the training shape
(rows x seq tokens, Qwen2.5-7B heads by default) and reports, per backend: whether q/k/v gradients are
equal bit for bit across the repeats, the largest difference, the median forward + backward time and
the kernels it ran. ``default`` is PyTorch's own choice. Every backend runs twice: as it is, and
(``+det``) under ``torch.use_deterministic_algorithms(True)``, which some backends read.

    python benchmarks/probe_sdpa_determinism.py [--rows 5] [--seq 1536] [--heads 28 --kv-heads 4 --head-dim 128]
"""

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def run(q, k, v, g, gqa):
    for t in (q, k, v):
        t.grad = None
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    o.backward(g)
    return o.detach().clone(), [t.grad.clone() for t in (q, k, v)]


def timed(fn, n):
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def probe(name, q, k, v, g, gqa, repeats, expand):
    qq, kk, vv = q, k, v
    if expand:  # backends without GQA get k/v repeated per query head, as a caller would have to
        rep = q.shape[1] // k.shape[1]
        kk = k.detach().repeat_interleave(rep, 1).requires_grad_(True)
        vv = v.detach().repeat_interleave(rep, 1).requires_grad_(True)
    ref = run(qq, kk, vv, g, gqa and not expand)
    diffs, equal = [], True
    for _ in range(repeats - 1):
        o, gr = run(qq, kk, vv, g, gqa and not expand)
        same = torch.equal(o, ref[0]) and all(torch.equal(a, b) for a, b in zip(gr, ref[1]))
        equal &= same
        diffs.append(max(float((a.float() - b.float()).abs().max()) for a, b in zip(gr, ref[1])))
    ms = timed(lambda: run(qq, kk, vv, g, gqa and not expand), 10)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(qq, kk, vv, g, gqa and not expand)
    kernels = sorted({e.key[:90] for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
                      and any(w in e.key.lower() for w in ("attn", "sdpa", "fmha", "flash", "bprop", "fprop"))})
    return {"backend": name, "bit_equal": equal, "max_abs_diff": max(diffs, default=0.0), "fwd_bwd_ms": ms,
            "gqa_expanded": expand, "kernels": kernels}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=5)
    ap.add_argument("--seq", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--json-out")
    a = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic mode refuses cuBLAS without it
    torch.manual_seed(0)
    shape = lambda h: (a.rows, h, a.seq, a.head_dim)  # noqa: E731
    q = torch.randn(shape(a.heads), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(shape(a.kv_heads), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(shape(a.kv_heads), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(shape(a.heads), device="cuda", dtype=torch.bfloat16)
    gqa = a.heads != a.kv_heads
    rows = []
    for det, name in [(det, name) for det in (False, True) for name in ["default", *BACKENDS]]:
        torch.use_deterministic_algorithms(det)
        for expand in (False, True):
            try:
                if name in BACKENDS:
                    with sdpa_kernel([BACKENDS[name]]):
                        r = probe(name, q, k, v, g, gqa, a.repeats, expand)
                else:
                    r = probe(name, q, k, v, g, gqa, a.repeats, expand)
                r["deterministic_mode"] = det
            except Exception as e:  # a backend that refuses the shape: say so, try the next
                print(f"{name} (deterministic mode {det}, gqa expanded={expand}): refused: {str(e).splitlines()[0][:160]}", flush=True)
                continue
            rows.append(r)
            print(json.dumps(r), flush=True)
            break
    torch.use_deterministic_algorithms(False)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"args": vars(a), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    sys.exit(0)


if __name__ == "__main__":
    main()
