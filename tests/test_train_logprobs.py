"""The memory-lean log-prob function equals plain autograd: values, entropies and gradients."""

import pytest
import torch

from qerl_cli.layers.lora import LoraSpec
from qerl_cli.models import ModelConfig, build_random_model
from qerl_cli.train.logprobs import _autograd_chunk, _dense_head, token_logprobs

CFG = dict(arch="qwen2", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
           num_kv_heads=2, head_dim=16, qkv_bias=True)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_logprobs_equal_autograd(dtype, tol, bias):
    model = build_random_model(ModelConfig(**CFG), device="cpu", dtype=dtype, quantized=True,
                               lora=LoraSpec(r=4, alpha=4), std=0.2)
    if bias:
        model.lm_head.bias = torch.nn.Parameter(torch.randn(320, dtype=dtype) * 0.3, requires_grad=False)
    assert _dense_head(model) is not None
    g = torch.Generator().manual_seed(0)
    n = 300  # > the 128-row block, not a multiple of it nor of the chunk
    h = (torch.randn(n, 64, generator=g) * 2).to(dtype)
    targets = torch.randint(0, 320, (n,), generator=g)
    inv_t = 1.0 / (0.5 + torch.rand(n, generator=g))
    up = torch.randn(n, generator=g)

    h1 = h.clone().requires_grad_(True)
    lp1, ent1 = token_logprobs(model, h1, targets, inv_t, chunk=70)
    (lp1 * up).sum().backward()
    h2 = h.clone().requires_grad_(True)
    lp2, ent2 = _autograd_chunk(model, h2, targets, inv_t)
    (lp2 * up).sum().backward()
    torch.testing.assert_close(lp1, lp2, rtol=tol, atol=tol)
    torch.testing.assert_close(ent1, ent2, rtol=tol, atol=tol)
    torch.testing.assert_close(h1.grad.float(), h2.grad.float(), rtol=tol, atol=tol * float(h2.grad.float().abs().max()))
    assert not ent1.requires_grad
    with torch.no_grad():
        lp3, ent3 = token_logprobs(model, h, targets, inv_t, chunk=1000)
    torch.testing.assert_close(lp3, lp2.detach(), rtol=tol, atol=tol)


def test_checkpointed_chunks_equal_plain_autograd_bit_for_bit(monkeypatch):
    # A head that is not a plain dense Linear runs each chunk through autograd inside qerl's checkpoint
    # (qerl_cli.train.recompute): the same values and input gradients as plain autograd, entropy detached.
    import qerl_cli.train.logprobs as logprobs

    model = build_random_model(ModelConfig(**CFG), device="cpu", dtype=torch.float32, quantized=True,
                               lora=LoraSpec(r=4, alpha=4), std=0.2)
    monkeypatch.setattr(logprobs, "_dense_head", lambda m: None)
    g = torch.Generator().manual_seed(1)
    n = 150
    h = torch.randn(n, 64, generator=g) * 2
    targets = torch.randint(0, 320, (n,), generator=g)
    inv_t = 1.0 / (0.5 + torch.rand(n, generator=g))
    up = torch.randn(n, generator=g)
    h1 = h.clone().requires_grad_(True)
    lp1, ent1 = token_logprobs(model, h1, targets, inv_t, chunk=150)  # one chunk: the same sums as below
    (lp1 * up).sum().backward()
    h2 = h.clone().requires_grad_(True)
    lp2, ent2 = _autograd_chunk(model, h2, targets, inv_t)
    (lp2 * up).sum().backward()
    assert torch.equal(lp1, lp2) and torch.equal(ent1, ent2) and torch.equal(h1.grad, h2.grad)
    assert lp1.requires_grad and not ent1.requires_grad


def test_gradient_matches_finite_differences_fp64_direction():
    model = build_random_model(ModelConfig(**CFG), device="cpu", dtype=torch.float32, quantized=False, std=0.2)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, 64, generator=g)
    t = torch.randint(0, 320, (5,), generator=g)
    it = torch.full((5,), 1 / 0.7)
    hh = h.clone().requires_grad_(True)
    token_logprobs(model, hh, t, it)[0].sum().backward()
    d = torch.randn(5, 64, generator=g)
    eps = 1e-2
    f = lambda x: float(token_logprobs(model, x, t, it)[0].double().sum())  # noqa: E731
    fd = (f(h + eps * d) - f(h - eps * d)) / (2 * eps)
    assert float((hh.grad * d).sum()) == pytest.approx(fd, rel=2e-3)


def _cuda_batch(n: int, seed: int):
    """A bf16 NVFP4 model on the GPU and n tokens: (model, hidden, targets, 1/T, upstream grad, generator)."""
    model = build_random_model(ModelConfig(**CFG), device="cuda", dtype=torch.bfloat16, quantized=True,
                               lora=LoraSpec(r=4, alpha=4), std=0.2)
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, 64, generator=g) * 2).to(torch.bfloat16).cuda()
    targets = torch.randint(0, 320, (n,), generator=g).cuda()
    inv_t = (1.0 / (0.5 + torch.rand(n, generator=g))).cuda()
    up = torch.randn(n, generator=g).cuda()
    return model, h, targets, inv_t, up, g


@pytest.mark.gpu
def test_fused_logprobs_equal_autograd_on_cuda_bf16():
    model, h, targets, inv_t, up, _ = _cuda_batch(1000, seed=0)
    h1, h2 = h.clone().requires_grad_(True), h.clone().requires_grad_(True)
    lp1, ent1 = token_logprobs(model, h1, targets, inv_t, chunk=300)
    (lp1 * up).sum().backward()
    lp2, ent2 = _autograd_chunk(model, h2, targets, inv_t)
    (lp2 * up).sum().backward()
    torch.testing.assert_close(lp1, lp2, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ent1, ent2, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h1.grad.float(), h2.grad.float(), rtol=2e-2, atol=2e-2 * float(h2.grad.float().abs().max()))


def _cuts(n, g):
    """Per-token (top_p, top_k, min_p): three cut settings and an uncut one, mixed within row blocks."""
    table = torch.tensor([[0.8, 0, 0.0], [1.0, 7, 0.0], [0.9, 40, 0.05], [1.0, 0, 0.0]], dtype=torch.float64)
    return table[torch.randint(0, 4, (n,), generator=g)]


@pytest.mark.parametrize("dense", [True, False])
def test_replayed_cut_gives_the_samplers_logprobs_and_their_gradient(dense, monkeypatch):
    # A record sampled with top-p / top-k / min-p carries log-probs of the distribution renormalised over
    # what the cut kept; train-step's must be the same (else exp(old - sampled) is the kept mass, not 1).
    import qerl_cli.train.logprobs as logprobs
    from qerl_cli.engine.sampler import truncated_logprobs
    from qerl_cli.engine.sampling_params import SamplingParams

    model = build_random_model(ModelConfig(**CFG), device="cpu", dtype=torch.float32, quantized=True,
                               lora=LoraSpec(r=4, alpha=4), std=0.2)
    if not dense:
        monkeypatch.setattr(logprobs, "_dense_head", lambda m: None)
    g = torch.Generator().manual_seed(3)
    n = 300
    h = torch.randn(n, 64, generator=g) * 2
    inv_t = 1.0 / (0.5 + torch.rand(n, generator=g))
    cuts = _cuts(n, g)
    with torch.no_grad():
        logits = model.compute_logits(h).float()
    # sampled from the cut distribution (as the engine does), so every target is in its kept set
    ref_all = torch.stack([truncated_logprobs(logits[i : i + 1], SamplingParams(
        temperature=1.0 / float(inv_t[i]), top_p=float(cuts[i, 0]), top_k=int(cuts[i, 1]), min_p=float(cuts[i, 2])))[0]
        for i in range(n)])
    targets = torch.multinomial(ref_all.exp(), 1, generator=g).squeeze(-1)
    ref = ref_all.gather(-1, targets[:, None]).squeeze(-1)
    assert (ref > -1e30).all() and (ref_all == float("-inf")).any()

    h1 = h.clone().requires_grad_(True)
    lp, ent = token_logprobs(model, h1, targets, inv_t, chunk=70, trunc=cuts)
    torch.testing.assert_close(lp.detach(), ref, rtol=1e-5, atol=1e-5)
    p = ref_all.exp()
    torch.testing.assert_close(ent, -(p * ref_all.clamp(min=-1e30)).sum(-1), rtol=1e-4, atol=1e-5)
    uncut = token_logprobs(model, h, targets, inv_t, chunk=70)[0]
    assert (lp.detach() - uncut > 1e-3).sum() > n // 3  # the cut rows: log S off the full-vocabulary value

    up = torch.randn(n, generator=g)
    (lp * up).sum().backward()
    h2 = h.clone().requires_grad_(True)
    z = model.compute_logits(h2).float() * inv_t[:, None]
    z = z.masked_fill(ref_all == float("-inf"), float("-inf"))
    (torch.log_softmax(z, -1).gather(-1, targets[:, None]).squeeze(-1) * up).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-4, atol=1e-5 * float(h2.grad.abs().max()))


def test_replayed_cut_keeps_the_sampled_token():
    # The trainer's logits are a rounding away from the sampler's: a token that was sampled stays in the
    # support (finite log-prob) even where the replayed cut would drop it.
    from qerl_cli.train.logprobs import replay_truncation_

    z = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    cut = replay_truncation_(z.clone(), torch.tensor([3]), torch.tensor([[1.0, 1, 0.0]], dtype=torch.float64))
    assert cut.tolist() == [[3.0, float("-inf"), float("-inf"), 0.0]]
    same = replay_truncation_(z.clone(), torch.tensor([0]), torch.tensor([[1.0, 0, 0.0]], dtype=torch.float64))
    assert same.tolist() == z.tolist()


@pytest.mark.gpu
def test_replayed_cut_on_cuda_bf16_matches_the_reference_and_autograd():
    # The fused path on the GPU (bf16 lm_head, fp32 logits): the same cut rows as the CPU reference of
    # the sampler, values and gradients as plain autograd over the masked logits.
    from qerl_cli.engine.sampler import truncate

    n = 700
    model, h, targets, inv_t, up, g = _cuda_batch(n, seed=4)
    cuts = _cuts(n, g).cuda()
    h1, h2 = h.clone().requires_grad_(True), h.clone().requires_grad_(True)
    lp1, ent1 = token_logprobs(model, h1, targets, inv_t, chunk=300, trunc=cuts)
    (lp1 * up).sum().backward()
    z = model.compute_logits(h2).float() * inv_t[:, None]
    with torch.no_grad():
        cut = torch.zeros_like(z, dtype=torch.bool)
        for i in range(n):
            p, k, m = cuts[i].tolist()
            cut[i] = torch.isneginf(truncate(z[i : i + 1].detach(), p, int(k), m))[0]
        cut[torch.arange(n), targets] = False
    lp2 = torch.log_softmax(z.masked_fill(cut, float("-inf")), -1).gather(-1, targets[:, None]).squeeze(-1)
    (lp2 * up).sum().backward()
    torch.testing.assert_close(lp1, lp2.detach(), rtol=1e-4, atol=1e-4)
    assert torch.isfinite(ent1).all()
    torch.testing.assert_close(h1.grad.float(), h2.grad.float(), rtol=2e-2, atol=2e-2 * float(h2.grad.float().abs().max()))


def test_kept_as_two_numbers_per_row_is_the_samplers_cut_with_ties():
    # Logits rounded to bf16 tie often, and top-p may cut inside a tie group (the stable sort keeps the
    # lowest indices): the (last, ties) form the backward applies must give exactly the sampler's set.
    from qerl_cli.engine.sampler import truncate
    from qerl_cli.train.logprobs import apply_kept_, find_kept

    g = torch.Generator().manual_seed(5)
    n, v = 256, 97
    z = (torch.randn(n, v, generator=g) * 1.5).bfloat16().float()
    trunc = _cuts(n, g)
    targets = torch.randint(0, v, (n,), generator=g)
    got = apply_kept_(z.clone(), targets, find_kept(z, trunc))
    for i in range(n):
        p, k, m = trunc[i].tolist()
        ref = truncate(z[i : i + 1], p, int(k), m)[0].clone()
        ref[targets[i]] = z[i, targets[i]]
        assert torch.equal(got[i], ref), i


def test_replayed_cut_leaves_uncut_rows_and_nan_as_they_are():
    # Uncut rows in a chunk with cut ones stay bit for bit; a NaN logit stays NaN for the step's
    # NumericalError check (the mask had turned it into -inf, a finite-looking log-prob).
    from qerl_cli.train.logprobs import replay_truncation_

    g = torch.Generator().manual_seed(6)
    z = torch.randn(4, 50, generator=g)
    z[1, 7] = float("nan")
    z[2, 3] = float("nan")
    trunc = torch.tensor([[0.5, 0, 0.0], [1.0, 0, 0.0], [0.5, 0, 0.0], [1.0, 0, 0.0]], dtype=torch.float64)
    out = replay_truncation_(z.clone(), torch.zeros(4, dtype=torch.long), trunc)
    assert torch.equal(out[[1, 3]].nan_to_num(), z[[1, 3]].nan_to_num()) and out[1, 7].isnan()
    assert out[2, 3].isnan() and torch.isneginf(out[0]).any()
