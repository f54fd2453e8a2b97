"""The one-launch LoRA shrink (kernels/lora_shrink.py) against torch, on CPU in Triton's interpreter
(fp32/fp16) and on the GPU (bf16), over odd shapes: a K that is no multiple of the step, ranks that are
no power of two, partial row tiles, one split and many."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

# (M, K, r): one split; partial steps and four splits; two row tiles, 14 splits; 24 splits, rank 1
CASES = [(1, 128, 4), (3, 384, 16), (17, 1000, 48), (100, 3584, 72), (40, 9000, 1), (128, 512, 128)]

_SCRIPT = r"""
import json, torch
from qerl_kernels import lora_shrink as ls
out = {}
for m, k, r in CASES:
    for dtype in (torch.float32, torch.float16):
        g = torch.Generator().manual_seed(m * 7 + k + r)
        x = torch.randn(m, k, generator=g).to(dtype)
        a = (torch.randn(r, k, generator=g) / k ** 0.5).to(dtype)
        key = f"{m}x{k}x{r}-{str(dtype)[6:]}"
        try:
            assert ls.kernel_applies(x, a)
            t = ls.lora_shrink(x, a)
            ref = x.double() @ a.double().t()
            out[key] = ((t.double() - ref).abs().max() / ref.abs().max()).item()
            out[key + "-split"] = ls.shrink_plan(m, k)[2]
        except Exception as e:
            out[key] = repr(e)
print("RESULTS" + json.dumps(out))
"""


def test_lora_shrink_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    script = _SCRIPT.replace("CASES", repr(CASES))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS")]
    assert proc.returncode == 0 and line, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    res = json.loads(line[-1][len("RESULTS"):])
    assert {res[f"{m}x{k}x{r}-float32-split"] for m, k, r in CASES} >= {1, 4, 14, 24}  # the cases do split
    for m, k, r in CASES:
        for dt, tol in (("float32", 1e-5), ("float16", 3e-3)):
            err = res[f"{m}x{k}x{r}-{dt}"]
            assert isinstance(err, float) and err < tol, (m, k, r, dt, err)


def test_falls_back_to_torch_off_its_reach(monkeypatch):
    from qerl_kernels import lora_shrink as ls

    x, a = torch.randn(5, 64), torch.randn(4, 64)
    assert not ls.kernel_applies(x, a)  # CPU without the interpreter
    assert torch.equal(ls.lora_shrink(x, a), x @ a.t())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ls.kernel_applies(x, a)
    assert not ls.kernel_applies(torch.randn(ls.MAX_ROWS + 1, 64), a)  # prefill sizes: cuBLAS
    assert not ls.kernel_applies(x, torch.randn(ls.MAX_RANK + 1, 64))
    assert not ls.kernel_applies(x.t().contiguous().t(), a)  # K not unit-stride
    assert not ls.kernel_applies(x.requires_grad_(), a)
    monkeypatch.setenv("QERL_LORA_SHRINK_KERNEL", "0")
    assert not ls.kernel_applies(x.detach(), a)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,r", CASES + [(64, 18944, 16), (16, 3584, 48)])
def test_lora_shrink_on_gpu(m, k, r):
    from qerl_kernels import lora_shrink as ls

    g = torch.Generator(device="cuda").manual_seed(m + k + r)
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
        a = (torch.randn(r, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
        t = ls.lora_shrink(x, a)
        ref = x.double() @ a.double().t()
        assert ((t.double() - ref).abs().max() / ref.abs().max()).item() < tol, dtype
        assert torch.equal(ls.lora_shrink(x, a), t)  # deterministic: the partials summed in split order
        # strided rows (a view's x) and the counters left at zero for the next call
        xs = torch.randn(m, k + 64, device="cuda", generator=g).to(dtype)[:, 32:32 + k]
        torch.testing.assert_close(ls.lora_shrink(xs, a).double(), (xs.double() @ a.double().t()), atol=tol * 10,
                                   rtol=tol * 10)
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for c in ls._counters.values())
