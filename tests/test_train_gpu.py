"""train-step on CUDA: LoRA grads through the Triton NVFP4 kernels, and a bf16 step vs the fp32 CPU step."""

import pytest
import torch

from qerl_cli.train_step import TrainStepConfig, train_step
from tests.train_fixtures import base_hash_of, make_shard, quantized_tiny

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("m,k,n", [(300, 3584, 512), (4096, 512, 1024)])
def test_lora_grads_through_triton_nvfp4_equal_dequantize_then_matmul(m, k, n):
    import torch.nn.functional as F
    from qerl_kernels import reference

    from qerl_cli.layers.linear import QLinear
    from qerl_cli.layers.lora import LoRALinear

    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda") * 0.02
    packed, scale, gscale = reference.quantize(w)
    base = QLinear(k, n, bias=True, quantized=True, device="cuda", dtype=torch.bfloat16)
    base.weight_packed, base.weight_scale, base.weight_global_scale = packed, scale, gscale.reshape(1)
    with torch.no_grad():
        base.bias.normal_(0, 0.02)
    lora = LoRALinear(base, r=16, alpha=16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        lora.lora_B.normal_(0, 0.02)
    x = (torch.randn(m, k, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
    g = torch.randn(m, n, device="cuda").to(torch.bfloat16)
    (lora(x).float() * g.float()).sum().backward()
    got = (lora.lora_A.grad.clone(), lora.lora_B.grad.clone(), x.grad.float().clone())

    wd = reference.dequantize(packed, scale, gscale, torch.bfloat16)
    a = lora.lora_A.detach().clone().requires_grad_(True)
    b = lora.lora_B.detach().clone().requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    y = F.linear(x2, wd, base.bias) + (x2 @ a.to(torch.bfloat16).t()) @ b.to(torch.bfloat16).t()
    (y.float() * g.float()).sum().backward()
    for u, v in zip(got, (a.grad, b.grad, x2.grad.float())):
        torch.testing.assert_close(u, v, rtol=2e-2, atol=2e-2 * float(v.abs().max()))


def test_cuda_bf16_step_matches_cpu_fp32_step(tmp_path):
    _, q = quantized_tiny(tmp_path)
    sh = make_shard(tmp_path / "sh", base_hash_of(q), seed=4)
    kw = dict(micro_batch_tokens=40, progress=False, lr=1e-3)
    cpu = train_step(TrainStepConfig(model=q, shards=[str(sh)], out=tmp_path / "cpu", device="cpu", **kw))["metrics"]
    gpu = train_step(TrainStepConfig(model=q, shards=[str(sh)], out=tmp_path / "gpu", device="cuda", **kw))["metrics"]
    assert gpu["peak_gpu_memory_gib"] > 0
    assert gpu["loss"] == pytest.approx(cpu["loss"], rel=5e-2, abs=1e-3)
    assert gpu["entropy"] == pytest.approx(cpu["entropy"], rel=1e-2)
    assert gpu["grad_norm"] == pytest.approx(cpu["grad_norm"], rel=5e-2)


@pytest.mark.gpu
def test_a_trained_norms_master_is_rounded_in_the_fused_norm_too():
    # A checkpointed layer's first forward runs without grad, where the fused kernel took the fp32 master
    # as it was, while the recompute (grad on, torch path) used the rounded copy: two policies in one step.
    from qerl_cli.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(0)
    master = (1.0 + torch.randn(4096, generator=g) * 1e-3).cuda()
    x = torch.randn(4, 4096, generator=g).cuda().bfloat16()
    train = RMSNorm(4096, device="cuda", dtype=torch.float32)
    train.weight.data.copy_(master)
    train.weight.requires_grad_(True)
    rollout = RMSNorm(4096, device="cuda", dtype=torch.bfloat16)
    rollout.weight.data.copy_(master.bfloat16())
    with torch.no_grad():
        fused, ref = train(x), rollout(x)
    assert torch.equal(fused, ref)
    assert torch.equal(train(x).detach(), ref)


@pytest.mark.gpu
def test_train_step_keeps_a_callers_cuda_rng_it_did_not_initialise():
    import subprocess
    import sys

    code = """
import torch, qerl_cli.train_step as ts
torch.manual_seed(123)
with ts._callers_rng_kept():
    torch.manual_seed(999)
    torch.randn(3, device="cuda")
a = torch.randn(3, device="cuda").tolist()
torch.manual_seed(123)
b = torch.randn(3, device="cuda").tolist()
assert a == b, (a, b)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "ok", r.stderr[-2000:]
