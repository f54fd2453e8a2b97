"""GPU: the Triton decode attention, CUDA-graph decode and NVFP4 kernels give the same generations as eager/HF."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from qerl_cli.aqn import apply_noise
from qerl_cli.engine import LLMEngine, SamplingParams
from qerl_cli.engine.sampler import truncated_logprobs
from qerl_cli.layers.lora import LoraSpec, lora_parameters
from qerl_cli.layers.paged_attention import paged_decode_attention_torch
from qerl_cli.layers.triton_attention import paged_decode_attention_triton
from qerl_cli.models import load_model
from tests.helpers import make_tiny_hf_model
from tests.test_models import nvfp4_checkpoint

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 53)), [30], [40, 41, 42, 43, 44, 45, 46, 47]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,hk,d", [(28, 4, 128), (40, 8, 128), (4, 2, 16)])
def test_triton_attention_matches_torch(dtype, hq, hk, d):
    torch.manual_seed(0)
    dev = "cuda"
    nblocks, bs, b = 300, 16, 9
    k = torch.randn(nblocks, bs, hk, d, device=dev, dtype=dtype)
    v = torch.randn(nblocks, bs, hk, d, device=dev, dtype=dtype)
    q = torch.randn(b, hq, d, device=dev, dtype=dtype)
    lens = torch.tensor([1, 15, 16, 17, 100, 511, 512, 700, 1000], dtype=torch.int32, device=dev)
    tables = torch.stack([torch.randperm(nblocks - 1, device=dev)[:64] + 1 for _ in range(b)]).int()
    ref = paged_decode_attention_torch(q.float(), k.float(), v.float(), tables, lens, d**-0.5)
    out = paged_decode_attention_triton(q, k, v, tables, lens, d**-0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert (out.float() - ref).abs().max().item() < tol


@pytest.mark.parametrize("rows,r,res", [(1, 48, False), (16, 48, True), (64, 32, True), (5, 20, True)])
def test_norm_kernel_lora_shrink_on_gpu(rows, r, res):
    from qerl_cli.layers import fused

    torch.manual_seed(0)
    n = 3584
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    resid = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16) if res else None
    w = (torch.rand(n, device="cuda") + 0.5).to(torch.bfloat16)
    z = torch.randn(n, device="cuda") * 1e-2
    a = (torch.randn(r, n, device="cuda") * 0.02).to(torch.bfloat16)
    plain = fused.rmsnorm(x, w, z, 1e-6, resid)
    y, ro, t = fused.rmsnorm(x, w, z, 1e-6, resid, lora_a=a)
    assert torch.equal(y, plain[0] if res else plain) and (not res or torch.equal(ro, plain[1]))
    ref = y.double() @ a.double().t()
    assert (t.double() - ref).abs().max().item() < 1e-2 * ref.abs().max().item()
    # A deferred LoRA term (bf16 here: the case the interpreter cannot check): x + d rounded first.
    d = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16) * 0.1
    y2, ro2, t2 = fused.rmsnorm(x, w, z, 1e-6, resid, lora_a=a, delta=d)
    y3, ro3, t3 = fused.rmsnorm(x + d, w, z, 1e-6, resid, lora_a=a)
    assert torch.equal(y2, y3) and torch.equal(t2, t3) and (not res or torch.equal(ro2, ro3))


def tiny_fp32_lora_model(tmp_path):
    """A tiny fp32 Qwen2 on the GPU with a random (non-zero) LoRA r=8 on all seven projections."""
    src = make_tiny_hf_model(tmp_path, arch="qwen2", dtype=torch.float32, init_std=0.1, tokenizer=False)
    model = load_model(src, device="cuda", dtype=torch.float32, lora=LoraSpec(r=8, alpha=16))
    with torch.no_grad():
        for p in lora_parameters(model):
            p.normal_(0, 0.05)
    return model


def assert_same_samples(out_a, out_b, logprob_tol: float) -> None:
    for g_a, g_b in zip(out_a, out_b, strict=True):
        for a, b in zip(g_a, g_b, strict=True):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < logprob_tol


def test_engine_norm_shrink_on_and_off_agree(tmp_path, monkeypatch):
    model = tiny_fp32_lora_model(tmp_path)
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=3)
    calls = []
    real = __import__("qerl_cli.layers.fused", fromlist=["rmsnorm"]).rmsnorm
    monkeypatch.setattr("qerl_cli.layers.fused.rmsnorm",
                        lambda *a, **k: calls.append(k.get("lora_a") is not None) or real(*a, **k))
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("QERL_NORM_SHRINK", flag)
        calls.clear()
        runs[flag] = LLMEngine(model, None, max_num_seqs=8).generate(PROMPTS, sp, n=2)
        assert any(calls) == (flag == "1")  # the norm kernel took the shrink only when allowed
    assert_same_samples(runs["1"], runs["0"], 1e-4)


def test_lora_shrink_side_stream_on_and_off_agree(tmp_path, monkeypatch):
    # The LoRA terms computed beside their base GEMMs on a side stream and added by the next kernel
    # (o/down: the norm; q/k/v: the rotary + cache write; gate/up: SwiGLU), the shrink there too past
    # the norm-shrink rows (the 67- and 129-token prompts' prefill): same samples as the serial path,
    # in captured decode and prefill graphs and in the eager prefill.
    import qerl_cli.layers.lora as lora

    model = tiny_fp32_lora_model(tmp_path)
    prompts = PROMPTS + [list(range(3, 70)), list(range(100, 229))]
    sp = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=5)
    real, rows, expands = lora.base_and_shrink, [], []
    monkeypatch.setattr(lora, "base_and_shrink", lambda base, x, a, b=None, t=None, x_korder=False:
                        rows.append(x.numel() // x.shape[-1]) or expands.append(b is not None)
                        or real(base, x, a, b, t, x_korder))
    runs = {}
    for graphs in ("1", "0"):
        monkeypatch.setenv("QERL_PREFILL_GRAPHS", graphs)
        for flag in ("1", "0"):
            monkeypatch.setenv("QERL_LORA_OVERLAP", flag)
            rows.clear()
            expands.clear()
            runs[graphs + flag] = LLMEngine(model, None, max_num_seqs=4, max_model_len=300).generate(prompts, sp, n=2)
            assert bool(rows) == (flag == "1") and (flag == "0" or max(rows) > 64)
            assert any(expands) == (flag == "1")  # o/down: the expand too, added by the next norm
    assert_same_samples(runs["11"], runs["10"], 1e-5)
    assert_same_samples(runs["01"], runs["00"], 1e-5)


def test_prefill_graphs_match_eager_prefill(tmp_path, monkeypatch):
    model = tiny_fp32_lora_model(tmp_path)
    prompts = PROMPTS + [list(range(3, 70)), list(range(100, 229))]  # up to 129 tokens: buckets 64, 128, 256
    sp = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    runs, used = {}, []
    for flag in ("1", "0"):
        monkeypatch.setenv("QERL_PREFILL_GRAPHS", flag)
        engine = LLMEngine(model, None, max_num_seqs=2, max_model_len=300)  # one group of 2 admitted at a time
        assert bool(engine.runner.prefill_graphs) == (flag == "1")
        if flag == "1":
            assert sorted(engine.runner.prefill_graphs) == [64, 128, 256]
            real = engine.runner._prefill_graphed
            monkeypatch.setattr(engine.runner, "_prefill_graphed", lambda g, b, _f=real: used.append(b) or _f(g, b))
        runs[flag] = engine.generate(prompts, sp, n=2)
    assert sorted(set(used)) == [64, 128, 256] and len(used) == len(prompts)
    assert_same_samples(runs["1"], runs["0"], 1e-3)


def test_graph_engine_greedy_equals_hf_fp32(tmp_path):
    src = make_tiny_hf_model(tmp_path, arch="qwen2", dtype=torch.float32, init_std=0.1, tokenizer=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).cuda().eval()
    engine = LLMEngine(load_model(src, device="cuda", dtype=torch.float32), None, max_num_seqs=8, block_size=16)
    assert engine.runner.use_graphs
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True), n=2)
    for p, group in zip(PROMPTS, out):
        ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=40, min_new_tokens=40, do_sample=False)
        assert group[0].token_ids == ref[0, len(p):].tolist() == group[1].token_ids


def test_bf16_nvfp4_graph_engine_logprobs_match_forward_train(tmp_path):
    src = make_tiny_hf_model(tmp_path, arch="qwen2", hidden=128, dtype=torch.bfloat16, init_std=0.05, tokenizer=False)
    qdir, _ = nvfp4_checkpoint(src, tmp_path / "q")
    model = load_model(qdir, device="cuda", dtype=torch.bfloat16, lora=LoraSpec(r=8, alpha=16))
    with torch.no_grad():
        for p in lora_parameters(model):
            p.normal_(0, 0.02)
    apply_noise(model, 1e-2, run_seed=0, step=5)
    sp = SamplingParams(temperature=1.0, max_new_tokens=48, ignore_eos=True, seed=0)
    graph = LLMEngine(model, None, max_num_seqs=16).generate(PROMPTS, sp, n=3)
    eager = LLMEngine(model, None, max_num_seqs=16, enforce_eager=True).generate(PROMPTS, sp, n=3)
    diffs = []
    for p, g_graph, g_eager in zip(PROMPTS, graph, eager):
        for c, e in zip(g_graph, g_eager):
            ids = torch.tensor([p + c.token_ids], device="cuda")
            with torch.no_grad():
                logits = model.compute_logits(model.forward_train(ids))[0, len(p) - 1: -1]
            ref = truncated_logprobs(logits, sp).gather(-1, torch.tensor(c.token_ids, device="cuda")[:, None]).squeeze(-1)
            diffs.append((torch.tensor(c.logprobs, device="cuda") - ref).abs())
            n = min(len(c.token_ids), 8)
            assert c.token_ids[:n] == e.token_ids[:n]  # bf16 rounding may let long samples drift apart
    d = torch.cat(diffs)
    assert d.mean().item() < 2e-2 and d.max().item() < 0.5, (d.mean().item(), d.max().item())


def test_triton_sampler_frequencies_on_gpu():
    import subprocess
    import sys

    from tests.test_engine_attention import FREQ

    r = subprocess.run([sys.executable, "-c", FREQ.replace("DEV", "'cuda'"), "200000"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_triton_sampler_logprobs_with_masked_blocks_on_gpu():
    # A chunk that starts with a whole 4096-wide block of -inf once returned NaN log-probs; at a 152k
    # vocabulary every row of a batch of 8 or 264 did (H200, 2026-11-26 audit).
    from qerl_cli.engine.triton_sampler import gumbel_sample

    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in (8, 264):
        x = torch.randn(rows, 152064, device="cuda", generator=g) * 3
        x[:, :4096] = float("-inf")
        x[:, 100000::3] = float("-inf")
        tok, lp = gumbel_sample(x.bfloat16(), 0.9, torch.arange(rows, device="cuda", dtype=torch.int64) * 7919 + 1)
        exact = torch.log_softmax(x.bfloat16().float() / 0.9, -1).gather(-1, tok[:, None]).squeeze(-1)
        assert torch.isfinite(lp).all() and torch.isfinite(exact).all()
        assert (lp - exact).abs().max().item() < 1e-4


def test_graphs_see_lora_and_noise_updates(tmp_path):
    from qerl_cli.aqn import clear_noise

    src = make_tiny_hf_model(tmp_path, arch="qwen2", hidden=128, dtype=torch.bfloat16, init_std=0.05, tokenizer=False)
    model = load_model(src, device="cuda", dtype=torch.bfloat16, lora=LoraSpec(r=8, alpha=16))
    # 5 slots for 5 prompts: the graph runs unpadded, so graph and eager run identical kernels.
    graph = LLMEngine(model, None, max_num_seqs=5)
    eager = LLMEngine(model, None, max_num_seqs=5, enforce_eager=True)
    sp = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    toks = lambda out: [g[0].token_ids for g in out]  # noqa: E731
    before = toks(graph.generate(PROMPTS, sp))
    with torch.no_grad():
        for p in lora_parameters(model):
            p.normal_(0, 0.05)
    apply_noise(model, 5e-2, run_seed=1, step=1)
    after = toks(graph.generate(PROMPTS, sp))
    assert after != before and after == toks(eager.generate(PROMPTS, sp))
    clear_noise(model)


def test_fused_norm_keeps_gradients_of_trained_norm_weights():
    from qerl_cli.layers.norm import RMSNorm

    norm = RMSNorm(64, noise_slot=True, device="cuda", dtype=torch.bfloat16)
    torch.nn.init.ones_(norm.weight)
    norm.weight.requires_grad_(True)
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)  # an input that needs no grad (layer 0)
    norm(x).float().sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_silu_mul_matches_torch_on_halves_of_one_tensor(dtype):
    from qerl_cli.layers import fused
    from qerl_cli.layers.activation import silu_mul

    gu = torch.randn(3, 5, 2 * 1000, device="cuda", dtype=dtype) * 4
    gu[0, 0, :8] = torch.tensor([0.0, -0.0, 80.0, -80.0, 1e-3, -1e-3, 20.0, -20.0])
    g, u = gu.chunk(2, dim=-1)  # strided halves, as the fused gate/up GEMM hands them over
    want = torch.nn.functional.silu(g) * u
    got = fused.silu_mul(g, u)
    assert got.shape == want.shape and got.is_contiguous()
    # Rounded where torch rounds; exp may differ by an ulp in fp32, so allow one unit in the last place.
    rtol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    assert torch.allclose(got.float(), want.float(), rtol=rtol, atol=1e-30)
    with torch.no_grad():
        assert torch.equal(silu_mul(g, u), got)  # the model's entry point takes the fused kernel


def test_nvfp4_gate_up_lora_defers_above_16_rows(monkeypatch):
    # Over an NVFP4 gate/up the LoRA expand is computed beside the GEMM and added by SwiGLU only above
    # lora.NVFP4_GATE_UP_DEFER_ROWS rows; either way the MLP's output (plus down's deferred term) is the
    # non-deferred path's up to the expand's rounding.
    import qerl_cli.layers.lora as lora
    from qerl_cli.layers.attention import group_lora
    from qerl_cli.layers.context import ForwardContext, set_context
    from qerl_cli.layers.lora import GroupedLoRA
    from tests.helpers import random_lora_model

    cfg = dict(model_type="qwen2", vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2)
    model = random_lora_model(cfg, device="cuda", dtype=torch.bfloat16, r=8, alpha=16, std=0.05)
    assert group_lora(model, torch.bfloat16) == 2
    mlp = model.model.layers[0].mlp
    real, calls = GroupedLoRA.run_deferred, []
    monkeypatch.setattr(GroupedLoRA, "run_deferred", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    limit = lora.NVFP4_GATE_UP_DEFER_ROWS
    set_context(ForwardContext(is_prefill=True, slot_mapping=torch.zeros(1, dtype=torch.long, device="cuda")))
    try:
        with torch.no_grad():
            for rows in (8, 16, 17, 40):
                h = torch.randn(1, rows, 128, device="cuda", dtype=torch.bfloat16)
                calls.clear()
                y, d = mlp(h, defer=True)
                assert bool(calls) == (rows > limit), rows
                monkeypatch.setattr(lora, "NVFP4_GATE_UP_DEFER_ROWS", 10**9)  # never defer
                y2, d2 = mlp(h, defer=True)
                monkeypatch.setattr(lora, "NVFP4_GATE_UP_DEFER_ROWS", limit)
                out, out2 = (y + d).float(), (y2 + d2).float()
                assert (out - out2).abs().max() <= 0.02 * out2.abs().max(), rows
    finally:
        set_context(None)


def test_row_uniforms_kernel_draws_the_torch_philox_bits_on_gpu():
    from qerl_cli.engine.philox import uniform53
    from qerl_cli.engine.triton_sampler import row_uniforms

    seeds = torch.arange(1000, dtype=torch.int64) * 0x9E3779B97F4A7C15 % 2**62
    u = row_uniforms(seeds.cuda()).cpu()
    assert u.dtype == torch.float64 and torch.equal(u, uniform53(seeds, torch.zeros_like(seeds)))
    assert torch.equal(uniform53(seeds.cuda(), torch.zeros_like(seeds).cuda()).cpu(), u)


@pytest.mark.parametrize("trunc", [dict(top_p=0.9), dict(top_k=50, min_p=0.01), dict(top_p=0.95, top_k=1000, min_p=0.001)])
def test_truncated_sampling_does_not_depend_on_the_batch_on_gpu(trunc):
    # bf16 logits at a 152k vocabulary hold many ties: an unstable sort could cut top-p differently
    # for the same row in another batch. Each row must draw the same token and log-prob alone or in
    # any subset of rows.
    from qerl_cli.engine.sampler import sample

    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(64, 152064, device="cuda", generator=g) * 3).bfloat16()
    seeds = torch.arange(64, device="cuda", dtype=torch.int64) * 7919 + 1
    sp = SamplingParams(temperature=0.9, max_new_tokens=1, **trunc)
    tok, lp = sample(x, sp, seeds)
    for rows in ([0], list(range(5, 37)), [63, 2, 17]):
        t, lp_rows = sample(x[rows], sp, seeds[rows])
        assert torch.equal(t, tok[rows]), rows
        # the Gumbel kernel's log-sum-exp is summed over chunks whose count follows the batch: rounding
        assert (lp_rows - lp[rows]).abs().max().item() < 1e-5, rows
    exact = truncated_logprobs(x.float(), sp).gather(-1, tok[:, None]).squeeze(-1)
    assert torch.isfinite(exact).all() and (exact - lp).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("trunc", [dict(top_p=0.9), dict(top_p=0.5, temperature=0.6), dict(top_k=50),
                                   dict(top_k=1000, top_p=0.95, min_p=0.001), dict(min_p=0.1)])
def test_truncation_cut_keeps_the_sorted_nucleus_on_gpu(dtype, trunc):
    # The radix-select cut against the stable-sort reference at a real vocabulary, with rows of heavy
    # ties (bf16 logits rounded to a few values) and a tie group at the top.
    from qerl_cli.engine import triton_truncation
    from qerl_cli.engine.triton_sampler import chunking
    from tests.helpers import assert_same_nucleus, mask_from_cut

    g = torch.Generator(device="cuda").manual_seed(2)
    v = 152064
    x = torch.randn(37, v, device="cuda", generator=g) * 3
    x[1] = (x[1] / 3).round()
    x[2, 5000:9000] = x[2].max()
    x = x.to(dtype)
    sp = SamplingParams(max_new_tokens=1, **trunc)
    chunk, nc = chunking(37, v)
    cut = triton_truncation.find_cut(x, sp, chunk, nc)
    kept = mask_from_cut(x, sp.temperature, cut)
    assert_same_nucleus(kept, x, sp)
    for rows in ([0], [2, 1], list(range(3, 30))):  # a row's cut alone or in another batch
        part = mask_from_cut(x[rows], sp.temperature, triton_truncation.find_cut(x[rows], sp, chunk, nc))
        assert torch.equal(part, kept[rows]), rows


@pytest.mark.parametrize("trunc", [dict(top_p=0.87), dict(top_k=3, min_p=0.2)])
def test_truncated_gumbel_draws_follow_the_truncated_distribution_on_gpu(trunc):
    from qerl_cli.engine.triton_sampler import gumbel_sample

    rows, calls, v = 4096, 32, 152064
    # top-p 0.87 keeps the first four and, of the three tied at 1.0, only the lowest index (11).
    x = torch.full((v,), -12.0, device="cuda")
    x[[7, 70000, 3, 150000, 11, 12, 13]] = torch.tensor([3.0, 2.5, 2.0, 1.5, 1.0, 1.0, 1.0], device="cuda")
    x = x.bfloat16()[None].expand(rows, v)
    sp = SamplingParams(max_new_tokens=1, **trunc)
    p = truncated_logprobs(x[:1].float(), sp)[0].exp()
    counts = torch.zeros(v, device="cuda")
    for k in range(calls):
        tok, lp = gumbel_sample(x, 1.0, torch.arange(rows, device="cuda", dtype=torch.int64) + k * rows + 99, sp=sp)
        counts += torch.bincount(tok, minlength=v)
        assert (lp - p[tok].log()).abs().max().item() < 1e-5
    n = rows * calls
    freq = counts / n
    assert (freq[p == 0] == 0).all()
    se = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 5 * se + 1e-12).all(), (freq[p > 0], p[p > 0])


@pytest.mark.parametrize("gap", [14.0, 18.0])
def test_gumbel_sampler_draws_rare_tokens_at_their_probability_on_gpu(gap):
    # One token at logit 0, 152063 at -gap: the tail's exact mass is 0.112 (gap 14) or 0.0023 (gap 18).
    # The noise used to be capped at ~16 nats (fp32 uniforms clamped under 1): 6% too few tail draws
    # at gap 14, 99.6% too few at gap 18 (H200, 2026-11-26 audit).
    from qerl_cli.engine.triton_sampler import gumbel_sample

    rows, calls, v = 4096, 64, 152064
    x = torch.full((rows, v), -gap, device="cuda", dtype=torch.bfloat16)
    x[:, 0] = 0.0
    tail = 0
    for k in range(calls):
        seeds = torch.arange(rows, device="cuda", dtype=torch.int64) + k * rows + 12345
        tok, _ = gumbel_sample(x, 1.0, seeds)
        tail += (tok != 0).sum().item()
    mass = (v - 1) * math.exp(-gap)
    exact, n = mass / (1 + mass), rows * calls
    assert abs(tail / n - exact) < 5 * (exact * (1 - exact) / n) ** 0.5, (tail / n, exact)


def test_an_adapter_on_some_layers_runs_in_the_gpu_engine_as_peft_applies_it(tmp_path):
    # LoRA at B = 0 on the layers PEFT leaves out (layers_to_transform): the CUDA-graph engine's grouped LoRA path must
    # add nothing there and the adapter's term on the others. Teacher-forced on the engine's own greedy tokens, the fp32
    # CPU model with the adapter (compared with peft.PeftModel in tests/test_adapters.py) gives the engine's log-probs.
    from qerl_cli.adapters import peft_leaves_out
    from qerl_cli.layers.lora import lora_disabled, lora_modules
    from tests.test_adapters import ALL_TARGETS, _peft_adapter

    src = make_tiny_hf_model(tmp_path, arch="qwen2", layers=3, tokenizer=False)
    qdir, deq = nvfp4_checkpoint(src, tmp_path / "q3")
    _peft_adapter(deq, tmp_path / "peft", 3, r=4, lora_alpha=8, target_modules=ALL_TARGETS, layers_to_transform=[1])
    gpu = load_model(qdir, device="cuda", dtype=torch.bfloat16, adapter_dir=tmp_path / "peft")
    cfg = {"target_modules": ALL_TARGETS, "layers_to_transform": [1]}
    assert all(bool(lin.lora_B.any()) == (peft_leaves_out(cfg, n) is None) for n, lin in lora_modules(gpu))
    out = LLMEngine(gpu, None, max_num_seqs=5).generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12,
                                                                                 ignore_eos=True))
    cpu = load_model(qdir, dtype=torch.float32, adapter_dir=tmp_path / "peft")

    def teacher_forced(prompt, c):
        ids = torch.tensor([prompt + c.token_ids[:-1]])
        with torch.no_grad():
            lp = torch.log_softmax(cpu.compute_logits(cpu.forward_train(ids, torch.ones_like(ids))).float(), -1)[0]
        return lp[len(prompt) - 1:].gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)

    got = torch.cat([torch.tensor(g[0].logprobs) for g in out])
    want = torch.cat([teacher_forced(p, g[0]) for p, g in zip(PROMPTS, out)])
    with lora_disabled(cpu):
        base = torch.cat([teacher_forced(p, g[0]) for p, g in zip(PROMPTS, out)])
    err, effect = (got - want).abs().max().item(), (want - base).abs().max().item()
    assert err < 0.1 and effect > 3 * err, (err, effect)
