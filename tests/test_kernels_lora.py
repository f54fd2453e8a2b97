"""The LoRA shrink kernel (qerl_kernels.lora) against an fp64 torch reference, over awkward shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

# (M, N, K, dtype): N not a power of two, K with a partial last step, one split and many, row blocks
# of 16/32/64 with ragged ends.
CASES = [(1, 16, 96, "float32"), (5, 12, 600, "float16"), (17, 48, 1000, "float32"), (33, 20, 2300, "float16"),
         (100, 7, 130, "float32"), (64, 64, 9000, "float16")]

DRIVER = r"""
import json, torch
from qerl_kernels import lora
from qerl_kernels.gemm_fwd import arrival_counters
out = {}
for m, n, k, dt in CASES:
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).to(getattr(torch, dt))
    a = (torch.randn(n, k, generator=g) / k ** 0.5).to(x.dtype)
    assert lora.usable(x, a)
    t1, t2 = lora.shrink(x, a), lora.shrink(x, a)
    ref = x.double() @ a.double().t()
    err = float((t1.double() - ref).norm() / ref.norm())
    out[f"{m}x{n}x{k}-{dt}"] = dict(err=err, same=bool(torch.equal(t1, t2)), split=lora.plan(m, n, k)["split"],
                                    counters=int(arrival_counters(x.device).abs().sum()))
print("RESULT" + json.dumps(out))
"""


def test_shrink_matches_reference_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", f"CASES = {CASES!r}\n" + DRIVER], env=env, capture_output=True, text=True,
                       timeout=600)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line is not None, r.stderr[-3000:]
    res = json.loads(line[len("RESULT"):])
    assert len(res) == len(CASES)
    assert any(v["split"] > 1 for v in res.values()) and any(v["split"] == 1 for v in res.values())
    for name, v in res.items():
        tol = 1e-6 if name.endswith("float32") else 2e-3
        assert v["err"] < tol, (name, v)
        assert v["same"], f"{name}: two calls differ (the split reduction must be deterministic)"
        assert v["counters"] == 0, f"{name}: arrival counters not reset"


def test_shrink_falls_back_to_matmul_off_the_kernel_path():
    from qerl_kernels import lora

    x, a = torch.randn(4, 64), torch.randn(8, 64)
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not lora.usable(x, a)  # CPU tensors without the interpreter
    big = torch.randn(lora.MAX_M + 1, 64)
    assert not lora.usable(big, a)
    assert not lora.usable(x, a.double())  # mixed dtypes
    torch.testing.assert_close(lora.shrink(x, a), x @ a.t())
    xg = x.clone().requires_grad_()
    assert not lora.usable(xg, a)  # autograd needs the torch op


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 16, 3584), (16, 48, 3584), (16, 16, 18944), (64, 32, 3584), (256, 48, 5120),
                                   (7, 200, 27648)])
def test_shrink_bf16_on_gpu(m, n, k):
    from qerl_kernels import lora
    from qerl_kernels.gemm_fwd import arrival_counters

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    a = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    assert lora.usable(x, a)
    t = lora.shrink(x, a)
    ref = x.double() @ a.double().t()
    assert float((t.double() - ref).norm() / ref.norm()) < 8e-3
    assert torch.equal(t, lora.shrink(x, a))
    assert int(arrival_counters(x.device).abs().sum()) == 0
