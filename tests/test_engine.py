"""The native engine: greedy equals HF generate, exact logprobs, seeded sampling, continuous batching, stops."""

from __future__ import annotations

import time

import pytest
import torch
import transformers

from qerl_cli.aqn import apply_noise
from qerl_cli.engine import LLMEngine, SamplingParams
from qerl_cli.engine.block_manager import BlockManager
from qerl_cli.engine.sampler import truncated_logprobs
from qerl_cli.engine.scheduler import Group, Scheduler
from qerl_cli.errors import BadInputError
from qerl_cli.layers.lora import LoraSpec, lora_parameters
from qerl_cli.models import ModelConfig, build_random_model, load_model
from tests.helpers import make_tiny_hf_model
from tests.test_models import nvfp4_checkpoint


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Decode steps are tiny; with 2 intra-op threads on a shared 2-core box the OpenMP spin-waits
    # make them ~20x slower. One thread measures the engine, not the contention.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 33)), [30], [40, 41, 42, 43, 44, 45, 46, 47]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # init_std 0.1 gives peaked next-token distributions, so greedy ties (fp noise flips) do not occur.
    return make_tiny_hf_model(tmp_path_factory.mktemp("m"), arch="qwen2", dtype=torch.float32, init_std=0.1)


def _greedy(sp_tokens=12):
    return SamplingParams(temperature=0, max_new_tokens=sp_tokens, ignore_eos=True)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_greedy_equals_hf_generate(tmp_path, arch):
    src = make_tiny_hf_model(tmp_path, arch=arch, dtype=torch.float32, init_std=0.1, tokenizer=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    # block_size 4: prompts end mid-block, so the fork of partial prompt blocks is exercised (n=2).
    engine = LLMEngine(load_model(src, dtype=torch.float32), None, max_num_seqs=4, block_size=4)
    out = engine.generate(PROMPTS, _greedy(), n=2)
    for p, group in zip(PROMPTS, out):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(p):]
        assert group[0].token_ids == ref.tolist()
        assert group[1].token_ids == ref.tolist()
        assert group[0].finish_reason == "length"


def _recompute_logprobs(model, prompt, completion, sp):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model.compute_logits(model.forward_train(ids))[0, len(prompt) - 1: -1]
    lp = truncated_logprobs(logits, sp)
    return lp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


@pytest.mark.parametrize("trunc", [dict(), dict(top_k=20, top_p=0.9, min_p=0.05)], ids=["full", "truncated"])
def test_logprobs_match_forward_train_with_noise_and_lora(tmp_path, trunc):
    src = make_tiny_hf_model(tmp_path, arch="qwen2", dtype=torch.float32, init_std=0.1, tokenizer=False)
    qdir, _ = nvfp4_checkpoint(src, tmp_path / "q")
    model = load_model(qdir, dtype=torch.float32, lora=LoraSpec(r=4, alpha=8))
    with torch.no_grad():
        for p in lora_parameters(model):
            p.normal_(0, 0.05)
    apply_noise(model, 0.05, run_seed=3, step=2)
    sp = SamplingParams(temperature=0.7, max_new_tokens=10, ignore_eos=True, seed=1, **trunc)
    out = LLMEngine(model, None, max_num_seqs=8, block_size=4).generate(PROMPTS[:3], sp, n=3)
    for p, group in zip(PROMPTS, out):
        for c in group:
            ref = _recompute_logprobs(model, p, c.token_ids, sp)
            assert torch.isfinite(ref).all()  # sampled tokens lie inside the truncated support
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4), (c.logprobs, ref)


def test_seeded_sampling_is_reproducible(tiny):
    model = load_model(tiny, dtype=torch.float32)
    engine = LLMEngine(model, None, max_num_seqs=6, block_size=8)
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16, ignore_eos=True, seed=7)
    a = engine.generate(PROMPTS, sp, n=3)
    b = engine.generate(PROMPTS, sp, n=3)
    c = engine.generate(PROMPTS, SamplingParams(**{**sp.__dict__, "seed": 8}), n=3)
    toks = lambda out: [[x.token_ids for x in g] for g in out]  # noqa: E731
    assert toks(a) == toks(b)
    assert [[x.logprobs for x in g] for g in a] == [[x.logprobs for x in g] for g in b]
    assert toks(a) != toks(c)
    assert len({tuple(x.token_ids) for x in a[0]}) == 3  # the n children of one prompt differ


def test_philox_is_the_published_philox4x32_10():
    from qerl_cli.engine.philox import philox, philox4, uniform, uniform53

    # Random123's known-answer vector for Philox4x32-10, counter and key all zero.
    assert philox(torch.tensor(0), torch.tensor(0)).item() == 0x6627E8D5
    assert [w.item() for w in philox4(torch.tensor(0), torch.tensor(0))] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    u53 = uniform53(torch.arange(1000, dtype=torch.int64), torch.zeros(1000, dtype=torch.int64))
    assert u53.dtype == torch.float64 and 0 <= u53.min() and u53.max() < 1
    assert (u53 * 2.0**53 == (u53 * 2.0**53).round()).all() and (u53 * 2.0**24 % 1 != 0).any()  # 53-bit grid
    u = uniform(torch.arange(1000, dtype=torch.int64) * 7919, torch.arange(1000))
    assert u.dtype == torch.float32 and 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.05


def test_inverse_cdf_draws_the_distribution_and_never_a_masked_token():
    from qerl_cli.engine.sampler import inverse_cdf, row_uniforms

    logits = torch.tensor([[2.0, 1.0, float("-inf"), 0.0, -1.0, float("-inf")]])
    logp = torch.log_softmax(logits, -1)
    n = 20000
    tok = inverse_cdf(logp.repeat(n, 1), row_uniforms(torch.arange(n, dtype=torch.int64) * 104729 + 5))
    freq = torch.bincount(tok, minlength=6).double() / n
    assert (freq - logp.exp()[0]).abs().max() < 4 * (0.25 / n) ** 0.5, freq
    # The edges: u = 0 takes the first token with mass, u just under 1 (u x total may round to the
    # total) the last one with mass, never the masked tail.
    edge = torch.tensor([0.0, 1.0 - 2**-24, 0.25])
    masked_head = torch.log_softmax(torch.tensor([float("-inf"), 0.0, 0.0, float("-inf")]), -1)
    assert inverse_cdf(masked_head.repeat(3, 1), edge).tolist() == [1, 2, 1]
    assert inverse_cdf(logp.repeat(3, 1), edge).tolist()[:2] == [0, 4]


@pytest.mark.parametrize("vocab", [7, 384, 1000, 5003, 65553])
def test_two_level_inverse_cdf_equals_one_cumulative_sum(vocab):
    # Chunks that divide the vocabulary or not (padding), masked tokens at both ends and at chunk
    # edges, u = 0 and u just under 1: the same token as one fp64 cumulative sum over the row.
    from qerl_cli.engine.sampler import inverse_cdf

    def one_level(logp, u):
        cdf = logp.double().exp().cumsum(-1)
        total = cdf[:, -1]
        t = torch.minimum(u.double() * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, t[:, None], right=True).squeeze(1)

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(64, vocab, generator=g) * 3
    x[torch.rand(64, vocab, generator=g) < 0.5] = float("-inf")
    x[:, [0, -1]] = float("-inf")
    x[:, 1] = 0.0
    logp = torch.log_softmax(x, -1)
    for u in (torch.rand(64, generator=g), torch.zeros(64), torch.full((64,), 1 - 2**-24)):
        tok = inverse_cdf(logp, u)
        assert torch.equal(tok, one_level(logp, u))
        assert torch.isfinite(logp.gather(1, tok[:, None])).all()


def test_nan_logits_give_a_token_whose_nan_logprob_the_stages_report():
    # Rollout and eval turn a non-finite log-prob into exit 5; an index error here would be a traceback.
    from qerl_cli.engine.sampler import sample

    logits = torch.randn(3, 1000)
    logits[1] = float("nan")
    logits[2, 500] = float("nan")
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=1)
    tok, lp = sample(logits, sp, torch.arange(3, dtype=torch.int64))
    assert ((0 <= tok) & (tok < 1000)).all() and torch.isfinite(lp[0]) and not torch.isfinite(lp[1:]).any()
    with pytest.raises(ValueError, match="below 1e-05"):
        SamplingParams(temperature=1e-40)


@pytest.mark.parametrize("trunc", [dict(), dict(top_p=0.9, top_k=30, min_p=0.02)], ids=["full", "truncated"])
def test_a_sequence_samples_the_same_whatever_its_batch(tiny, trunc):
    # Per-sequence seeds: 2, 3 or 16 slots (different batches at every step, different scheduling)
    # and a shared-generator order no longer change a completion (they did on the torch path).
    model = load_model(tiny, dtype=torch.float32)
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=3, **trunc)
    runs = [LLMEngine(model, None, max_num_seqs=m, block_size=4).generate(PROMPTS, sp, n=2) for m in (2, 3, 16)]
    toks = [[[c.token_ids for c in g] for g in out] for out in runs]
    assert toks[0] == toks[1] == toks[2]
    for out in runs[1:]:
        for g, g0 in zip(out, runs[0]):
            for c, c0 in zip(g, g0):
                assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(c0.logprobs), atol=1e-5)
    assert len({tuple(c.token_ids) for g in runs[0] for c in g}) == 2 * len(PROMPTS)  # no shared streams


def test_per_prompt_seeds_make_a_prompts_completions_its_own(tiny):
    # With a seed per prompt, a prompt's completions do not depend on the call it came in: alone, in
    # another order, or admitted late through 2 slots (several admissions), it draws the same tokens.
    model = load_model(tiny, dtype=torch.float32)
    sp = SamplingParams(temperature=1.0, top_k=40, max_new_tokens=10, ignore_eos=True)
    seeds = [11, 22, 33, 44, 55]
    toks = lambda out: [[c.token_ids for c in g] for g in out]  # noqa: E731
    ref = toks(LLMEngine(model, None, max_num_seqs=16, block_size=4).generate(PROMPTS, sp, n=2, seeds=seeds))
    slots2 = LLMEngine(model, None, max_num_seqs=2, block_size=4)
    assert toks(slots2.generate(PROMPTS, sp, n=2, seeds=seeds)) == ref
    assert toks(slots2.generate(PROMPTS[::-1], sp, n=2, seeds=seeds[::-1])) == ref[::-1]
    assert toks(slots2.generate(PROMPTS[3:4], sp, n=2, seeds=seeds[3:4])) == ref[3:4]
    with pytest.raises(ValueError, match="4 seeds for 5 prompts"):
        slots2.generate(PROMPTS, sp, n=2, seeds=seeds[:4])


def test_continuous_batching_more_prompts_than_slots(tiny):
    model = load_model(tiny, dtype=torch.float32)
    prompts = [[i + 3, i + 4, i + 5] for i in range(10)]
    big = LLMEngine(model, None, max_num_seqs=32, block_size=4).generate(prompts, _greedy(8), n=2)
    small_engine = LLMEngine(model, None, max_num_seqs=3, block_size=4)
    calls = []
    small = small_engine.generate(prompts, _greedy(8), n=1, progress=lambda d, t: calls.append(d))
    assert [g[0].token_ids for g in small] == [g[0].token_ids for g in big]
    assert calls == list(range(1, 11))
    # 10 prompts through 3 slots, one token per step per slot: many more decode steps than with 32 slots.
    assert small_engine.stats["decode_steps"] >= 10 * 7 // 3


def test_scheduler_admits_waiting_group_when_a_sequence_finishes():
    blocks = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=1024)
    for i in range(3):
        sched.add(Group(i, [1, 2, 3, 4, 5], n=2, max_len=9))
    first = sched.admit()
    assert [g.index for g in first] == [0, 1] and sched.admit() == []
    # Group 0's shared full prompt block is referenced by both children.
    shared = first[0].seqs[0].block_table[0]
    assert first[0].seqs[1].block_table[0] == shared and blocks.refs[shared] == 2
    sched.finish(first[0].seqs[0])
    assert sched.admit() == [] and blocks.refs[shared] == 1  # one slot free, group 2 needs two
    sched.finish(first[0].seqs[1])
    assert [g.index for g in sched.admit()] == [2]
    for s in list(sched.running):
        sched.finish(s)
    assert blocks.num_free == 63 and not any(blocks.refs)


def test_stop_strings_eos_and_length(tmp_path):
    src = make_tiny_hf_model(tmp_path, arch="llama", dtype=torch.float32, init_std=0.1)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    model = load_model(src, dtype=torch.float32)
    engine = LLMEngine(model, tok, max_num_seqs=4, block_size=4)
    prompt = [tok.encode("How many clips")]
    full = engine.generate(prompt, _greedy(24), n=1)[0][0]
    assert full.finish_reason == "length" and len(full.token_ids) == 24
    # A stop string taken from the middle of the greedy text ends generation there.
    text = tok.decode(full.token_ids[:12], skip_special_tokens=True)
    stop = text[-3:] if text[-3:].strip() else text[-4:]
    cut = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, stop=(stop,)), n=1)[0][0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)] and len(cut.token_ids) <= 12
    assert stop not in cut.text and full.text.startswith(cut.text)
    # A stop token id is kept (with its logprob) and ends the completion.
    t = full.token_ids[5]
    eos = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=(t,)), n=1)[0][0]
    k = full.token_ids.index(t)
    assert eos.token_ids == full.token_ids[: k + 1] and eos.finish_reason == "stop" and eos.stop_reason == t
    assert len(eos.logprobs) == len(eos.token_ids)
    # a stop token's text is left out, as vLLM's detokenizer leaves it out (its text stayed: a review, session 52)
    assert eos.text == tok.decode(eos.token_ids[:-1], skip_special_tokens=True) != tok.decode(eos.token_ids)
    # An EOS is left out of text even when the tokenizer does not mark it special (its text stayed: audit)
    engine.eos_token_ids = {t}
    end = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24), n=1)[0][0]
    assert end.token_ids == full.token_ids[: k + 1] and end.stop_reason == t
    assert end.text == tok.decode(end.token_ids[:-1], skip_special_tokens=True) != tok.decode(end.token_ids)


def test_max_model_len_and_bad_prompts(tiny):
    model = load_model(tiny, dtype=torch.float32)
    engine = LLMEngine(model, None, max_num_seqs=2, max_model_len=16, block_size=4)
    out = engine.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], _greedy(50), n=1)[0][0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    with pytest.raises(BadInputError, match="prompt 1 has 16 tokens"):
        engine.generate([[1], list(range(16))], _greedy(), n=1)
    with pytest.raises(BadInputError, match="prompt 0 is empty"):
        engine.generate([[]], _greedy(), n=1)
    with pytest.raises(BadInputError, match="token id outside"):
        engine.generate([[10**6]], _greedy(), n=1)
    with pytest.raises(BadInputError, match="exceeds max_num_seqs"):
        engine.generate([[1]], _greedy(), n=3)


def test_cpu_64_completions_under_30s():
    cfg = ModelConfig.from_hf(dict(model_type="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))
    model = build_random_model(cfg, device="cpu", dtype=torch.float32, quantized=True)
    # the context it needs (32 + 64 tokens): with the model's whole one, the CPU cache zeroed what 64 sequences of it
    # could use, 1 GiB and since the cap rose 4 (test_engine.py's peak RSS 1.6 -> 4.7 GB, on a CI box shared by workers)
    engine = LLMEngine(model, None, max_num_seqs=64, max_model_len=128)
    assert engine.runner.kv.numel() * engine.runner.kv.element_size() < 64 << 20
    prompts = [list(range(3 + i, 35 + i)) for i in range(16)]
    t0 = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=64, ignore_eos=True), n=4)
    elapsed = time.perf_counter() - t0
    assert sum(len(g) for g in out) == 64 and all(len(c.token_ids) == 64 for g in out for c in g)
    assert elapsed < 30, f"64 completions took {elapsed:.1f}s"


def test_adapter_values_changed_after_engine_creation_are_used(tiny):
    """LoRA weights loaded into a live engine's model must reach the rollout (no stale inference copies)."""
    from qerl_cli.layers.lora import lora_disabled

    model = load_model(tiny, dtype=torch.float32, lora=LoraSpec(r=4, alpha=8))
    engine = LLMEngine(model, None, max_num_seqs=4, block_size=4)
    base = engine.generate(PROMPTS[:2], _greedy(10), n=1)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.3)
    changed = engine.generate(PROMPTS[:2], _greedy(10), n=1)
    fresh = LLMEngine(model, None, max_num_seqs=4, block_size=4).generate(PROMPTS[:2], _greedy(10), n=1)
    toks = lambda out: [g[0].token_ids for g in out]  # noqa: E731
    assert toks(changed) == toks(fresh) != toks(base)
    with lora_disabled(model), pytest.raises(RuntimeError, match="build a new LLMEngine"):
        engine.generate(PROMPTS[:1], _greedy(2), n=1)


def test_two_engines_on_one_model_do_not_share_caches(tiny):
    model = load_model(tiny, dtype=torch.float32)
    first = LLMEngine(model, None, max_num_seqs=4, block_size=4)
    ref = first.generate(PROMPTS, _greedy(10), n=1)
    second = LLMEngine(model, None, max_num_seqs=3, block_size=8)  # rebinds the layers' caches
    assert [g[0].token_ids for g in second.generate(PROMPTS, _greedy(10), n=1)] == [g[0].token_ids for g in ref]
    assert [g[0].token_ids for g in first.generate(PROMPTS, _greedy(10), n=1)] == [g[0].token_ids for g in ref]


def test_bundled_tiny_model_greedy_with_eos_equals_hf_and_64_completions_fast():
    """On the pretrained bundled model (real prompts, real EOS): greedy equals HF generate, and 64
    sampled completions take well under 30 s on CPU."""
    import json

    from qerl_cli.assets import tiny_model_dir, tiny_task_file

    src = tiny_model_dir()
    tok = transformers.AutoTokenizer.from_pretrained(src)
    rows = [json.loads(x) for x in tiny_task_file("test").read_text().splitlines()[:16]]
    prompts = [tok.encode(r["prompt"]) for r in rows]
    model = load_model(src, dtype=torch.float32)
    engine = LLMEngine(model, tok, max_num_seqs=64)
    greedy = engine.generate(prompts[:6], SamplingParams(temperature=0, max_new_tokens=40), n=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    for p, g in zip(prompts, greedy):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False)[0, len(p):].tolist()
        eos = model.config.eos_token_ids[0]
        ref = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert g[0].token_ids == ref
        assert g[0].finish_reason == ("stop" if ref[-1] == eos else "length")
    t0 = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=64, seed=1), n=4)
    assert sum(len(g) for g in out) == 64 and time.perf_counter() - t0 < 30
    assert all(c.text == tok.decode(c.token_ids, skip_special_tokens=True) for g in out for c in g)


def test_prefill_graph_buckets_and_which_admissions_replay_them():
    from types import SimpleNamespace

    from qerl_cli.engine.model_runner import PREFILL_GRAPH_MAX_GROUPS, ModelRunner, prefill_buckets

    assert prefill_buckets(4096, 2048) == [64, 128, 256, 512, 1024, 2048]
    assert prefill_buckets(1300, 2048) == [64, 128, 256, 512, 1024]  # no rotary entries past the context
    assert prefill_buckets(100, 2048) == [64] and prefill_buckets(50, 2048) == []
    assert prefill_buckets(4096, 300) == [64, 128, 256]
    runner = SimpleNamespace(prefill_graphs={64: None, 128: None, 256: None})
    g = lambda n: Group(0, list(range(n)), 8, n + 10)  # noqa: E731
    pick = lambda groups: ModelRunner._prefill_buckets(runner, groups)  # noqa: E731
    assert pick([g(1)]) == [64] and pick([g(64)]) == [64] and pick([g(65)]) == [128]
    assert pick([g(30), g(200), g(100)]) == [64, 256, 128]
    assert pick([g(257)]) is None  # longer than the largest bucket: eager
    assert pick([g(10)] * (PREFILL_GRAPH_MAX_GROUPS + 1)) is None  # a large admission: one eager batch
    assert ModelRunner._prefill_buckets(SimpleNamespace(prefill_graphs={}), [g(10)]) is None  # CPU / off


def _vllm_v1_logprobs(logits, temperature, top_k, top_p, min_p):
    """vLLM v1's sampler, written out: temperature, min-p on the probabilities, then top-k, then top-p
    (the first token always kept), then the distribution it samples from."""
    x = logits / temperature
    if min_p > 0:
        p = torch.softmax(x, -1)
        x = x.masked_fill(p < min_p * p.max(-1, keepdim=True).values, float("-inf"))
    if top_k:
        x = x.masked_fill(x < torch.topk(x, top_k, -1).values[:, -1:], float("-inf"))
    if top_p < 1:
        sx, order = torch.sort(x, -1, descending=True)
        cum = torch.softmax(sx, -1).cumsum(-1)
        drop = torch.zeros_like(cum, dtype=torch.bool)
        drop[:, 1:] = cum[:, :-1] >= top_p
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(x, -1)


def test_truncation_order_is_vllms():
    # --engine vllm and the native engine must draw from the same distribution for the same flags.
    # Probabilities .4 .3 .2 .1: top-p 0.5 keeps {0, 1}; min-p 0.6 first (vLLM) leaves only {0}.
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    lp = truncated_logprobs(logits, SamplingParams(temperature=1.0, top_p=0.5, min_p=0.6))
    assert torch.isfinite(lp).tolist() == [[True, False, False, False]] and lp[0, 0] == 0
    lp = truncated_logprobs(logits, SamplingParams(temperature=1.0, top_p=0.75, min_p=0.5))
    assert torch.isfinite(lp).tolist() == [[True, True, False, False]]
    g = torch.Generator().manual_seed(0)
    for t, k, p, m in [(1.0, 0, 0.9, 0.1), (0.7, 20, 0.8, 0.05), (1.3, 5, 1.0, 0.2), (0.5, 0, 0.95, 0.0)]:
        x = torch.randn(64, 300, generator=g) * 3
        ours = truncated_logprobs(x, SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m))
        ref = _vllm_v1_logprobs(x, t, k, p, m)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(ref)), (t, k, p, m)
        keep = torch.isfinite(ref)
        assert torch.allclose(ours[keep], ref[keep], atol=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5])
def test_temperature_must_be_finite(bad):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=bad)


class _ByteTokenizer:
    """One token per UTF-8 byte, as byte-level BPE falls back to for rare characters."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _engine_with_tokenizer(tiny, tokenizer):
    engine = LLMEngine(load_model(tiny, dtype=torch.float32), None, max_num_seqs=2, block_size=4)
    engine.tokenizer = tokenizer
    return engine


def test_stop_string_of_many_byte_tokens_is_found(tiny):
    # "你好" is 2 characters but 6 one-byte tokens: a window counted in characters never saw it whole.
    from qerl_cli.engine.sequence import Sequence

    engine = _engine_with_tokenizer(tiny, _ByteTokenizer())
    def seq(completion: bytes):
        return Sequence(group=0, child=0, token_ids=[1, 2, *completion], num_prompt=2, max_len=64)

    assert engine._stop_string_hit(seq("abc 你好".encode()), ("你好",)) == "你好"
    assert engine._stop_string_hit(seq("abc 你".encode()), ("你好",)) is None
    # One token completing two stops names the one the text is cut at: the earlier.
    assert engine._stop_string_hit(seq(b"xx An"), ("n", " A")) == " A"


def test_one_stop_string_is_one_stop_and_needs_a_tokenizer(tiny):
    # SamplingParams(stop="15.") became ("1", "5", "."): a stop at the first "1", "5" or ".", silently
    assert SamplingParams(stop="15.").stop == ("15.",)
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()  # vLLM's default (a TypeError)
    engine = LLMEngine(load_model(tiny, dtype=torch.float32), None, max_num_seqs=2, block_size=4)
    with pytest.raises(ValueError, match="tokenizer"):  # were ignored: every completion ran to its length
        engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=4, stop=("x",)))


def test_a_slot_reused_by_a_shorter_sequence_points_past_its_blocks_at_scratch():
    """A slot's block-table row kept its previous occupant's block ids past the new sequence's own blocks, and
    another live sequence may hold those blocks by then: one write past a reservation would have corrupted its
    KV silently (a mutation review: nothing but the reservation's +1 kept that from happening)."""
    from types import SimpleNamespace

    from qerl_cli.engine.block_manager import BlockManager
    from qerl_cli.engine.model_runner import ModelRunner
    from qerl_cli.engine.sequence import Sequence

    runner = SimpleNamespace(block_tables=torch.zeros(3, 6, dtype=torch.int32))
    long = Sequence(group=0, child=0, token_ids=[1] * 20, num_prompt=20, max_len=24, block_table=[5, 6, 7, 8, 9], slot=1)
    ModelRunner.set_block_table(runner, long)
    short = Sequence(group=1, child=0, token_ids=[1] * 3, num_prompt=3, max_len=6, block_table=[2, 3], slot=1)
    ModelRunner.set_block_table(runner, short)
    assert runner.block_tables[1].tolist() == [2, 3] + [BlockManager.SCRATCH] * 4


def _cpu_engine_shape(layers, kv_heads, head_dim, max_num_seqs, max_model_len, block_size=16):
    from types import SimpleNamespace

    config = SimpleNamespace(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim)
    model = SimpleNamespace(config=config, device=torch.device("cpu"), dtype=torch.float32)
    return SimpleNamespace(model=model, max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size)


def test_a_cpu_kv_cache_takes_what_the_request_can_use_up_to_its_cap_and_half_the_available_ram(monkeypatch):
    # CPU engines got a flat 1 GiB: a 1.5B model (28 layers, 2 KV heads of 128, fp32: 0.875 MiB a block of 16
    # tokens) had 1170 blocks, and one group of 8 completions of 4096 tokens (2056 blocks) was refused with "give
    # the engine more memory", which no flag did; a machine with 512 MiB free still got 1 GiB.
    import qerl_cli.engine.llm_engine as le

    big = _cpu_engine_shape(28, 2, 128, max_num_seqs=256, max_model_len=4096)
    block = 2 * 28 * 16 * 2 * 128 * 4
    monkeypatch.delenv("QERL_CPU_KV_CACHE_GIB", raising=False)
    monkeypatch.setattr(le, "available_ram", lambda: 64 << 30)  # 4 GiB at most, not half the RAM: it is zeroed
    assert LLMEngine._auto_num_blocks(big, 16384, 0.9) == (4 << 30) // block > 8 * 257
    monkeypatch.setenv("QERL_CPU_KV_CACHE_GIB", "16")
    assert LLMEngine._auto_num_blocks(big, 16384, 0.9) == (16 << 30) // block
    monkeypatch.setenv("QERL_CPU_KV_CACHE_GIB", "40")  # still at most half the RAM available
    assert LLMEngine._auto_num_blocks(big, 16384, 0.9) == (32 << 30) // block
    for bad in ("0", "-1", "lots", "inf", "nan"):
        monkeypatch.setenv("QERL_CPU_KV_CACHE_GIB", bad)
        with pytest.raises(BadInputError, match="QERL_CPU_KV_CACHE_GIB.* is no size in GiB"):
            LLMEngine._auto_num_blocks(big, 16384, 0.9)
    monkeypatch.delenv("QERL_CPU_KV_CACHE_GIB")
    monkeypatch.setattr(le, "available_ram", lambda: 512 << 20)
    assert LLMEngine._auto_num_blocks(big, 16384, 0.9) == (256 << 20) // block
    monkeypatch.setattr(le, "available_ram", lambda: None)  # unknown: the cap alone
    assert LLMEngine._auto_num_blocks(big, 16384, 0.9) == (4 << 30) // block
    # a tiny model's request fits: every block it can use, as before (CI's engines are these)
    tiny = _cpu_engine_shape(2, 2, 32, max_num_seqs=256, max_model_len=255)
    for ram in (16 << 30, 512 << 20, None):
        monkeypatch.setattr(le, "available_ram", lambda ram=ram: ram)
        assert LLMEngine._auto_num_blocks(tiny, 16384, 0.9) == 256 * 16 + 1
    monkeypatch.setattr(le, "available_ram", lambda: 1 << 20)
    with pytest.raises(BadInputError, match="no memory left") as e:
        LLMEngine._auto_num_blocks(big, 16384, 0.9)
    assert "RAM" in e.value.hint


def test_a_group_the_cpu_kv_cache_cannot_hold_says_what_bounded_it(tiny, monkeypatch):
    import qerl_cli.engine.llm_engine as le

    model = load_model(tiny, dtype=torch.float32)
    c = model.config
    block = 2 * c.num_layers * 4 * c.num_kv_heads * c.head_dim * 4  # bytes of a block of 4 fp32 tokens
    monkeypatch.setattr(le, "available_ram", lambda: 2 * 80 * block)  # half of it: 80 blocks
    engine = LLMEngine(model, None, max_num_seqs=8, block_size=4)
    assert engine.num_blocks == 80
    with pytest.raises(BadInputError, match="needs .* KV blocks, the cache has 79") as e:
        engine.generate(PROMPTS[:1], _greedy(40), n=8)
    hint = e.value.hint
    assert "50% of the RAM available" in hint and "80 blocks of 4 tokens" in hint and "raise QERL_CPU_KV_CACHE_GIB" in hint


def _fake_cgroups(root, monkeypatch, cgroup_line: str, levels: dict) -> None:
    """/proc/self/cgroup and a cgroup v2 tree under ``root``, which host_memory reads in place of the machine's:
    ``levels`` maps a path under /sys/fs/cgroup to its (memory.max, memory.current, page cache in memory.stat)."""
    from pathlib import Path

    import qerl_cli.engine.host_memory as hm

    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup_line + "\n")
    for rel, (limit, current, cache) in levels.items():
        d = root / "sys/fs/cgroup" / rel
        d.mkdir(parents=True, exist_ok=True)
        if limit is not None:  # the root cgroup has no memory.max
            (d / "memory.max").write_text(f"{limit}\n")
        (d / "memory.current").write_text(f"{current}\n")
        (d / "memory.stat").write_text(f"anon 1\nfile {cache}\nactive_file {cache // 4}\n"
                                       f"inactive_file {cache - cache // 4}\nshmem 0\n")
    monkeypatch.setattr(hm, "Path", lambda p: Path(root) / str(p).lstrip("/"))


def test_a_cgroup_limit_is_read_on_the_parents_too_and_its_page_cache_is_room(tmp_path, monkeypatch):
    # The CPU KV cache's cgroup bound read memory.max - memory.current of the process's own cgroup only:
    # - a limit on a parent only (a Slurm job's, over its step's cgroup of "max") was none: the host's MemAvailable
    #   was taken, and the zeroed cache could push the job past its limit;
    # - memory.current counts the page cache the job's reads and writes left, which the kernel reclaims and which
    #   fills up to the limit in a long job: a full cgroup gave 0 bytes, "no memory left for the KV cache" where the
    #   flat 1 GiB of before had run.
    import qerl_cli.engine.host_memory as hm

    gib = 2**30
    job, step = "system.slice/slurmstepd.scope/job_7", "system.slice/slurmstepd.scope/job_7/step_0/user/task_0"
    _fake_cgroups(tmp_path / "a", monkeypatch, f"0::/{step}", {"": (None, 60 * gib, 0), job: (8 * gib, 3 * gib, gib),
                                                               step: ("max", 3 * gib, gib)})
    assert hm._cgroup_room() == 6 * gib  # the job's 8 GiB less the 2 GiB it cannot give back
    _fake_cgroups(tmp_path / "b", monkeypatch, "0::/", {"": (16 * gib, 16 * gib, 12 * gib)})  # a container, full
    assert hm._cgroup_room() == 12 * gib
    tight = {"": (None, 60 * gib, 0), job: (8 * gib, 7 * gib, 0), step: (4 * gib, 1 * gib, 0)}
    _fake_cgroups(tmp_path / "c", monkeypatch, f"0::/{step}", tight)
    assert hm._cgroup_room() == gib  # the least room of every level: the job's
    _fake_cgroups(tmp_path / "d", monkeypatch, f"0::/{step}", {"": (None, 60 * gib, 0), job: ("max", gib, 0)})
    assert hm._cgroup_room() is None  # no limit anywhere (and the root has no memory.max)
    _fake_cgroups(tmp_path / "e", monkeypatch, "4:memory:/x", {"": (8 * gib, gib, 0)})
    assert hm._cgroup_room() is None  # cgroup v1 only: not read
