"""The Triton paged decode attention kernel equals the torch gather + SDPA path (run on CPU by the interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qerl_cli.layers.paged_attention import paged_decode_attention_torch

SCRIPT = textwrap.dedent("""
    import torch
    from qerl_cli.layers.paged_attention import paged_decode_attention_torch
    from qerl_cli.layers.triton_attention import paged_decode_attention_triton
    torch.manual_seed(0)
    from qerl_kernels.decode import k_order_index
    for hq, hk, d, bs, splits in [(4, 2, 16, 4, 1), (7, 1, 32, 16, 4), (8, 8, 16, 8, 2), (8, 2, 32, 8, 1), (8, 2, 32, 8, 3)]:
        nblocks, b = 40, 3
        k = torch.randn(nblocks, bs, hk, d)
        v = torch.randn(nblocks, bs, hk, d)
        q = torch.randn(b, hq, d)
        lens = torch.tensor([1, 37, 70], dtype=torch.int32)
        tables = torch.stack([torch.randperm(nblocks - 1)[:20] + 1 for _ in range(b)]).int()
        ref = paged_decode_attention_torch(q, k, v, tables, lens, d ** -0.5)
        for fused in (True, False):  # splits merged by the last program to finish, or a second kernel
            out = paged_decode_attention_triton(q, k, v, tables, lens, d ** -0.5, num_splits=splits, fused=fused)
            err = (out - ref).abs().max().item()
            assert err < 1e-4, (hq, hk, d, bs, splits, fused, err)
            if hq * d % 128 == 0:  # rows written in the MMA's K order for o_proj: the same values, moved
                ko = paged_decode_attention_triton(q, k, v, tables, lens, d ** -0.5, num_splits=splits, fused=fused,
                                                   korder=True)
                assert torch.equal(ko.reshape(b, -1)[:, k_order_index(hq * d)], out.reshape(b, -1)), (splits, fused)
    from qerl_kernels.gemm_fwd import arrival_counters
    assert int(arrival_counters(torch.device("cpu")).abs().sum()) == 0  # every launch left them zero
    print("ok")
""")


def test_triton_kernel_matches_torch_in_interpreter(interpreted):
    assert interpreted["SCRIPT"] == "ok", interpreted["SCRIPT"]


@pytest.fixture(scope="module")
def interpreted():
    """Run every interpreter script in ONE subprocess (importing torch + triton costs ~10 s a time)."""
    pytest.importorskip("triton")
    parts = {"SCRIPT": SCRIPT, "FUSED": FUSED, "NORM_SHRINK": NORM_SHRINK, "SAMPLER": SAMPLER, "PHILOX": PHILOX,
             "TRUNC": TRUNC, "REPLAY": REPLAY, "STRIDED": STRIDED}
    driver = "import traceback\nres = {}\n"
    for key, code in parts.items():
        driver += f"try:\n    exec({code!r}, {{}})\n    res[{key!r}] = 'ok'\nexcept Exception:\n    res[{key!r}] = traceback.format_exc()[-2000:]\n"
    driver += "import json\nprint('RESULT' + json.dumps(res))\n"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", driver], env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line is not None, r.stderr[-3000:]
    return json.loads(line[len("RESULT"):])


def test_split_rule_drops_the_merge_once_the_pairs_fill_the_sms():
    pytest.importorskip("triton")
    from qerl_cli.layers.triton_attention import num_splits_for, tile_for

    # 7B shape (4 KV heads) on 132 SMs: 16 sequences -> 64 pairs, ~2 programs per SM (power of two);
    # 32 -> 128 pairs, still short of the SMs; 33 and up fill them with whole contexts.
    assert [num_splits_for(b, 4, 132) for b in (1, 16, 32, 33, 64, 256)] == [16, 8, 4, 1, 1, 1]
    assert tile_for(1) == (128, 4, 2) and tile_for(8) == (64, 4, 2)


def test_torch_path_equals_dense_attention():
    torch.manual_seed(1)
    hq, hk, d, bs = 4, 2, 8, 4
    k_seq = torch.randn(2, 10, hk, d)
    v_seq = torch.randn(2, 10, hk, d)
    k_cache = torch.zeros(8, bs, hk, d)
    v_cache = torch.zeros(8, bs, hk, d)
    tables = torch.tensor([[5, 2, 7], [1, 3, 6]], dtype=torch.int32)
    for b in range(2):
        for t in range(10):
            k_cache[tables[b, t // bs], t % bs] = k_seq[b, t]
            v_cache[tables[b, t // bs], t % bs] = v_seq[b, t]
    q = torch.randn(2, hq, d)
    lens = torch.tensor([10, 6], dtype=torch.int32)
    out = paged_decode_attention_torch(q, k_cache, v_cache, tables, lens, d**-0.5)
    for b in range(2):
        n = int(lens[b])
        kk = k_seq[b, :n].repeat_interleave(hq // hk, dim=1)  # [n, hq, d]
        vv = v_seq[b, :n].repeat_interleave(hq // hk, dim=1)
        att = torch.softmax(torch.einsum("hd,nhd->hn", q[b], kk) * d**-0.5, -1)
        assert torch.allclose(out[b], torch.einsum("hn,nhd->hd", att, vv), atol=1e-5)


FUSED = textwrap.dedent("""
    import torch
    from qerl_cli.layers import fused
    from qerl_cli.layers.norm import RMSNorm
    from qerl_cli.layers.rotary import RotaryEmbedding, _rot
    torch.manual_seed(0)
    norm = RMSNorm(48, 1e-6, noise_slot=True)
    norm.weight.data = 1 + 0.1 * torch.randn(48)
    norm.noise.copy_(0.01 * torch.randn(48))
    x, r = torch.randn(5, 48), torch.randn(5, 48)
    ref_y, ref_r = norm(x, r)  # CPU tensors: the torch path
    y, ro = fused.rmsnorm(x, norm.weight, norm.noise, 1e-6, r)
    assert torch.allclose(y, ref_y, atol=1e-5) and torch.allclose(ro, ref_r)
    norm.noise.zero_()
    assert torch.allclose(fused.rmsnorm(x, norm.weight, None, 1e-6), norm(x), atol=1e-5)
    rot = RotaryEmbedding(32, 64, 10000.0)
    q, k = torch.randn(2, 3, 6, 32), torch.randn(2, 3, 2, 32)
    pos = torch.tensor([[0, 5, 63], [1, 2, 3]])
    rq, rk = rot(pos, q.clone(), k.clone())
    fq, fk = fused.rope_(q.clone(), k.clone(), pos, rot.cos_sin)
    assert torch.allclose(fq, rq, atol=1e-5) and torch.allclose(fk, rk, atol=1e-5)
    # Rotation + paged-cache write in one kernel == rotation + the fallback's index_copy_.
    v = torch.randn(2, 3, 2, 32)
    kc, vc = torch.zeros(4, 4, 2, 32), torch.zeros(4, 4, 2, 32)
    slots = torch.tensor([5, 0, 15, 7, 9, 3])
    fq2, fk2 = fused.rope_(q.clone(), k.clone(), pos, rot.cos_sin, cache=(v, kc, vc, slots))
    assert torch.allclose(fq2, rq, atol=1e-5) and torch.allclose(fk2, rk, atol=1e-5)
    kc_ref, vc_ref = torch.zeros(4, 4, 2, 32), torch.zeros(4, 4, 2, 32)
    rot.rotate_and_cache(pos, q.clone(), k.clone(), v, kc_ref, vc_ref, slots)  # CPU: the torch path
    assert torch.allclose(kc, kc_ref, atol=1e-5) and torch.equal(vc, vc_ref)
    assert kc.view(-1, 2, 32)[[1, 2, 4]].abs().sum() == 0  # rows not in slots stay untouched
    # SwiGLU on the strided halves of one tensor.
    g, u = torch.randn(4, 2 * 40).chunk(2, -1)
    assert torch.allclose(fused.silu_mul(g, u), torch.nn.functional.silu(g) * u, atol=1e-6)
    # K-order outputs (for a TMA-fed GEMM): the same values at decode.k_order's columns, the residual
    # and the shrink untouched; rows of 256 columns (two 128-column steps), one SwiGLU block cut short.
    from qerl_kernels.decode import k_order_index
    idx = k_order_index(256)
    w256, z256, a8 = 1 + 0.1 * torch.randn(256), 0.01 * torch.randn(256), torch.randn(8, 256)
    x2, r2 = torch.randn(3, 256), torch.randn(3, 256)
    y_n, ro_n, t_n = fused.rmsnorm(x2, w256, z256, 1e-6, r2, lora_a=a8)
    y_k, ro_k, t_k = fused.rmsnorm(x2, w256, z256, 1e-6, r2, lora_a=a8, korder=True)
    assert torch.equal(y_k[:, idx], y_n) and torch.equal(ro_k, ro_n) and torch.equal(t_k, t_n)
    assert torch.equal(fused.rmsnorm(x2, w256, None, 1e-6, korder=True)[:, idx], fused.rmsnorm(x2, w256, None, 1e-6))
    g2, u2 = torch.randn(3, 2 * 1280).chunk(2, -1)
    idx1280 = k_order_index(1280)
    assert torch.equal(fused.silu_mul(g2, u2, korder=True)[:, idx1280], fused.silu_mul(g2, u2))
    try:
        fused.rmsnorm(x, norm.weight, None, 1e-6, korder=True)  # 48 columns: no whole 128-column step
        raise AssertionError("korder on 48 columns was accepted")
    except ValueError as e:
        assert "128" in str(e)
    # Deferred LoRA terms (column slices of one q/k/v- or gate/up-shaped tensor), fp16: added and rounded
    # first, so bit-equal to the same kernels on the summed inputs; v + dv is also stored back in place.
    # One token too (a batch-1 decode graph): size-1 dims report arbitrary strides.
    for dt, (b, s) in ((torch.float16, (2, 3)), (torch.float32, (2, 3)), (torch.float16, (1, 1))):
        y = torch.randn(b, s, (6 + 2 + 2) * 32).to(dt)
        d = (torch.randn(b, s, (6 + 2 + 2) * 32) * 0.5).to(dt)
        split = lambda t: [p.view(b, s, -1, 32) for p in t.split([6 * 32, 2 * 32, 2 * 32], -1)]
        q, k, v = split(y.clone())
        kc, vc = torch.zeros(4, 4, 2, 32, dtype=dt), torch.zeros(4, 4, 2, 32, dtype=dt)
        fused.rope_(q, k, pos[:b, :s], rot.cos_sin, cache=(v, kc, vc, slots[: b * s]), delta=split(d))
        q2, k2, v2 = split((y + d).to(dt))
        kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
        fused.rope_(q2, k2, pos[:b, :s], rot.cos_sin, cache=(v2, kc2, vc2, slots[: b * s]))
        assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
        gu, dgu = torch.randn(4, 2 * 40).to(dt), (torch.randn(4, 2 * 40) * 0.5).to(dt)
        got = fused.silu_mul(*gu.chunk(2, -1), *dgu.chunk(2, -1))
        assert torch.equal(got, fused.silu_mul(*(gu + dgu).to(dt).chunk(2, -1)))
    # A decode step's attention inputs in one launch == the torch ops the model runner ran before.
    bt = torch.randint(0, 50, (9, 7), dtype=torch.int32)
    slot, p = torch.tensor([3, 0, 8, 3]), torch.tensor([0, 17, 111, 16])
    t, sm, cl = fused.decode_inputs(bt, slot, p, 16)
    ref_t = bt.index_select(0, slot)
    assert torch.equal(t, ref_t) and torch.equal(cl, (p + 1).to(torch.int32))
    assert torch.equal(sm, ref_t.gather(1, (p // 16)[:, None])[:, 0].long() * 16 + p % 16)
    try:
        fused.rope_(q, k, pos, rot.cos_sin, delta=split(d))
        raise AssertionError("a delta without the cache write was accepted")
    except ValueError as e:
        assert "delta" in str(e)
    print("ok")
""")


def test_fused_norm_and_rope_match_torch_in_interpreter(interpreted):
    assert interpreted["FUSED"] == "ok", interpreted["FUSED"]


# The norm kernel's LoRA shrink: normed rows and residual bit-equal to the plain launch, the shrink
# equal to normed @ A^T (fp32 sums); A with a partial last chunk of 8 rows, a row count past the
# K slice, with and without residual and noise, fp16 and fp32.
NORM_SHRINK = textwrap.dedent("""
    import torch
    from qerl_cli.layers import fused
    torch.manual_seed(0)
    for dtype, rows, n, r, res, noise in [(torch.float32, 3, 1100, 20, True, True), (torch.float16, 3, 600, 8, False, True),
                                          (torch.float16, 17, 513, 7, True, False)]:  # 17 rows: 4 rows of A a program
        x = torch.randn(rows, n).to(dtype)
        resid = torch.randn(rows, n).to(dtype) if res else None
        w = (torch.rand(n) + 0.5).to(dtype)
        z = torch.randn(n) * 1e-2 if noise else None
        a = (torch.randn(r, n) * 0.05).to(dtype)
        plain = fused.rmsnorm(x, w, z, 1e-6, resid)
        y, ro, t = fused.rmsnorm(x, w, z, 1e-6, resid, lora_a=a)
        want_y, want_r = plain if res else (plain, None)
        assert torch.equal(y, want_y) and (ro is None) == (not res) and (ro is None or torch.equal(ro, want_r))
        ref = y.double() @ a.double().t()
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert t.shape == (rows, r) and t.dtype == dtype
        assert torch.allclose(t.double(), ref, rtol=tol, atol=tol), (dtype, n, r, (t.double() - ref).abs().max())
        # A deferred LoRA term: added to x and rounded first, exactly as if x had carried it (also under
        # the shrink, whose programs rebuild the row).
        d = (torch.randn(rows, n) * 0.3).to(dtype)
        xd = (x + d).to(dtype)
        want = fused.rmsnorm(xd, w, z, 1e-6, resid)
        got = fused.rmsnorm(x, w, z, 1e-6, resid, delta=d)
        for g_, w_ in zip(got if res else (got,), want if res else (want,)):
            assert torch.equal(g_, w_)
        y2, _, t2 = fused.rmsnorm(x, w, z, 1e-6, resid, lora_a=a, delta=d)
        y3, _, t3 = fused.rmsnorm(xd, w, z, 1e-6, resid, lora_a=a)
        assert torch.equal(y2, y3) and torch.equal(t2, t3) and not torch.equal(y2, y)
    try:
        fused.rmsnorm(x, w, None, 1e-6, lora_a=a.t().contiguous())
        raise AssertionError("a transposed A was accepted")
    except ValueError as e:
        assert "lora_a" in str(e)
    try:
        fused.rmsnorm(x, w, None, 1e-6, delta=d[:1])
        raise AssertionError("a delta of the wrong shape was accepted")
    except ValueError as e:
        assert "delta" in str(e)
""")


def test_norm_kernel_lora_shrink_in_interpreter(interpreted):
    assert interpreted["NORM_SHRINK"] == "ok", interpreted["NORM_SHRINK"]


SAMPLER = textwrap.dedent("""
    import torch
    from qerl_cli.engine.triton_sampler import gumbel_sample
    torch.manual_seed(0)
    logits = torch.randn(3, 9000) * 3
    seeds = torch.arange(3, dtype=torch.int64) * 7919 + 11
    tok, lp = gumbel_sample(logits, 0.8, seeds)
    ref = torch.log_softmax(logits / 0.8, -1).gather(-1, tok[:, None]).squeeze(-1)
    assert torch.allclose(lp, ref, atol=1e-5), (lp, ref)
    # Splitting the vocabulary into 1, 2 or 3 chunks (a partial last one) draws the same tokens.
    for chunks in (1, 2, 3):
        tc, lc = gumbel_sample(logits, 0.8, seeds, num_chunks=chunks)
        assert torch.equal(tc, tok) and torch.allclose(lc, lp, atol=1e-5), chunks
    tok2, _ = gumbel_sample(logits, 0.8, seeds)
    assert torch.equal(tok, tok2)
    # Row independence: a row's sample depends only on its logits and seed, not on the batch.
    t3, _ = gumbel_sample(logits[2:3].clone(), 0.8, seeds[2:3].clone())
    assert t3.item() == tok[2].item()
    # -inf logits (masked tokens), also a whole 4096-wide block of them at the start of a chunk: the
    # log-prob stays exact for every chunking (the running sum once went NaN there).
    masked = logits.clone()
    masked[0, :4096] = float("-inf")
    masked[1, ::7] = float("-inf")
    exact = torch.log_softmax(masked / 0.8, -1)
    for chunks in (1, 2, 3):
        tm, lm = gumbel_sample(masked, 0.8, seeds, num_chunks=chunks)
        assert torch.isfinite(lm).all() and torch.isfinite(masked.gather(-1, tm[:, None])).all(), (chunks, lm)
        assert torch.allclose(lm, exact.gather(-1, tm[:, None]).squeeze(-1), atol=1e-5), chunks
    print("ok")
""")

TRUNC = textwrap.dedent("""
    import torch
    from qerl_cli.engine import triton_truncation as tt
    from qerl_cli.engine.sampler import truncated_logprobs
    from qerl_cli.engine.sampling_params import SamplingParams
    from qerl_cli.engine.triton_sampler import gumbel_sample
    from tests.helpers import assert_same_nucleus, mask_from_cut
    torch.manual_seed(0)
    V = 1100
    base = torch.randn(4, V) * 2
    base[1, 100:160] = base[1].max()  # ties at the top: top-p cuts inside the group, lowest indices first
    base[2] = (torch.randn(V) * 0.5).round()  # a handful of values, hundreds of ties each
    base[3, ::2] = 0.0
    base[3, 1::4] = -0.0  # -0 and +0 tie
    base[3, 3::4] = float("-inf")
    cases = [dict(top_p=0.9), dict(top_k=5), dict(top_k=1), dict(min_p=0.05), dict(top_p=1e-6),
             dict(top_k=40, top_p=0.8, min_p=0.01, temperature=0.7), dict(top_p=0.6, temperature=1.7)]
    seeds = torch.arange(4) * 7919 + 3
    shipped = tt.CHUNK
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        logits = base.to(dt)
        for kw in cases:
            sp = SamplingParams(**kw)
            for chunk in (2048, 256) if dt == torch.bfloat16 else (256,):  # one or five programs per row
                tt.CHUNK = chunk
                kept = mask_from_cut(logits, sp.temperature, tt.find_cut(logits, sp, 1024, 2))
                assert_same_nucleus(kept, logits, sp)
                alone = mask_from_cut(logits[2:3], sp.temperature, tt.find_cut(logits[2:3], sp, 1024, 2))
                assert torch.equal(alone, kept[2:3]), (dt, kw)  # a row's cut does not depend on its batch
            tt.CHUNK = shipped
            for chunks in (1, 2) if dt == torch.float16 else (2,):
                tok, lp = gumbel_sample(logits, sp.temperature, seeds, num_chunks=chunks, sp=sp)
                ref = truncated_logprobs(logits.float(), sp).gather(-1, tok[:, None]).squeeze(-1)
                assert kept.gather(-1, tok[:, None]).all(), (dt, kw, tok)
                assert (lp - ref).abs().max().item() < 1e-5, (dt, kw, lp, ref)
                if chunks == 1 or dt != torch.float16:
                    tok1 = tok
                assert torch.equal(tok, tok1), (dt, kw)
    print("ok")
""")

FREQ = textwrap.dedent("""
    import torch
    from qerl_cli.engine.triton_sampler import gumbel_sample
    # Frequencies follow the distribution (5 tokens, N draws with distinct seeds).
    n = int(__import__("sys").argv[1])
    small = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).repeat(n, 1)
    t, _ = gumbel_sample(small.to(DEV), 1.0, (torch.arange(n, dtype=torch.int64) * 104729 + 5).to(DEV))
    freq = torch.bincount(t.cpu(), minlength=5).float() / n
    p = torch.softmax(small[0], -1)
    assert (freq - p).abs().max() < 4 * (0.25 / n) ** 0.5, (freq, p)
    print("ok")
""")


REPLAY = textwrap.dedent("""
    import torch
    from qerl_cli.engine import triton_truncation as tt
    from qerl_cli.engine.sampling_params import SamplingParams
    from qerl_cli.train.logprobs import Kept, _kept_by_radix, apply_kept_
    from tests.helpers import assert_same_nucleus
    torch.manual_seed(1)
    V = 1100
    base = torch.randn(4, V) * 2
    base[1, 100:160] = base[1].max()  # ties at the top: top-p cuts inside the group
    base[2] = (torch.randn(V) * 0.5).round()  # hundreds of ties per value
    base[3, ::2] = 0.0
    base[3, 1::4] = -0.0
    tt.CHUNK = 256
    for kw in [dict(top_p=0.9), dict(top_k=5), dict(min_p=0.05), dict(top_k=40, top_p=0.8, min_p=0.01),
               dict(top_p=1e-6), dict(top_k=V + 5)]:
        x = base * 1.3  # tempered fp32 logits, as train-step replays the cut on them
        kept = Kept(*_kept_by_radix(x, kw.get("top_p", 1.0), kw.get("top_k", 0), kw.get("min_p", 0.0)))
        cut = apply_kept_(x.clone(), x.argmax(-1), kept)
        assert_same_nucleus(torch.isfinite(cut), x, SamplingParams(temperature=1.0, **kw))
        assert torch.equal(cut[torch.isfinite(cut)], x[torch.isfinite(cut)])
    print("ok")
""")

PHILOX = textwrap.dedent("""
    import torch
    import triton
    import triton.language as tl
    from qerl_cli.engine.philox import uniform, uniform53
    from qerl_cli.engine.triton_sampler import row_uniforms

    @triton.jit
    def draw(S, OUT, V, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        tl.store(OUT + row * V + offs, tl.rand(tl.load(S + row), offs), mask=offs < V)

    # Seeds with both 32-bit halves in use, up to the engine's 62-bit mask.
    seeds = torch.tensor([0, 1, 7, 2**31 - 1, 2**32 + 5, 123456789012345, 2**62 - 1], dtype=torch.int64)
    out = torch.empty(len(seeds), 300)
    draw[(len(seeds),)](seeds, out, 300, BLOCK=512)
    assert torch.equal(out, uniform(seeds[:, None], torch.arange(300)[None, :])), (out != 0).sum()
    many = torch.arange(300, dtype=torch.int64) * 0x9E3779B97F4A7C15 % 2**62  # two launches of 256 rows
    assert torch.equal(row_uniforms(many), uniform53(many, torch.zeros_like(many)))
    print("ok")
""")


# What the decode step really passes: q a [B, Hq, D] view of the fused q/k/v output's q columns (row
# stride (Hq + 2 Hk) D, never Hq D), in fp32 and fp16; and decode_inputs on block tables wider than its
# 1024-column block (long contexts: 32k tokens in 16-token blocks), where the copy loop takes a second
# pass. Neither was compared with torch anywhere (a kernel reading q at dense row stride, or copying only
# the first 1024 table columns, passed every test).
STRIDED = textwrap.dedent("""
    import torch
    from qerl_cli.layers import fused
    from qerl_cli.layers.paged_attention import paged_decode_attention_torch
    from qerl_cli.layers.triton_attention import paged_decode_attention_triton
    g = torch.Generator().manual_seed(2)
    for dt, tol in ((torch.float32, 1e-4), (torch.float16, 2e-3)):
        hq, hk, d, bs, nblocks, b = 6, 2, 32, 8, 30, 3
        qkv = torch.randn(b, (hq + 2 * hk) * d, generator=g).to(dt)
        q = qkv[:, : hq * d].view(b, hq, d)
        assert not q.is_contiguous()
        k = torch.randn(nblocks, bs, hk, d, generator=g).to(dt)
        v = torch.randn(nblocks, bs, hk, d, generator=g).to(dt)
        lens = torch.tensor([1, 29, 50], dtype=torch.int32)
        tables = torch.stack([torch.randperm(nblocks - 1, generator=g)[:10] + 1 for _ in range(b)]).int()
        ref = paged_decode_attention_torch(q.float().contiguous(), k.float(), v.float(), tables, lens, d ** -0.5)
        for splits in (1, 3):
            for fz in (True, False):
                out = paged_decode_attention_triton(q, k, v, tables, lens, d ** -0.5, num_splits=splits, fused=fz)
                err = (out.float() - ref).abs().max().item()
                assert out.dtype == dt and err < tol, (dt, splits, fz, err)
    bt = torch.randint(0, 5000, (5, 1500), generator=g, dtype=torch.int32)
    slot, p = torch.tensor([4, 0, 2]), torch.tensor([0, 1033 * 16 + 5, 1499 * 16 + 15])
    t, sm, cl = fused.decode_inputs(bt, slot, p, 16)
    ref_t = bt.index_select(0, slot)
    assert torch.equal(t, ref_t) and torch.equal(cl, (p + 1).to(torch.int32))
    assert torch.equal(sm, ref_t.gather(1, (p // 16)[:, None])[:, 0].long() * 16 + p % 16)
""")


def test_attention_on_a_qkv_slice_and_wide_decode_tables_in_interpreter(interpreted):
    assert interpreted["STRIDED"] == "ok", interpreted["STRIDED"]


def test_torch_philox_draws_triton_rand_bits_in_interpreter(interpreted):
    assert interpreted["PHILOX"] == "ok", interpreted["PHILOX"]


def test_triton_sampler_in_interpreter(interpreted):
    assert interpreted["SAMPLER"] == "ok", interpreted["SAMPLER"]


def test_triton_truncation_keeps_the_sorted_nucleus_in_interpreter(interpreted):
    # min-p / top-k / top-p by radix select (no sort) keep what the stable-sort reference keeps, for
    # 16-bit and fp32 logits, ties at the cut (kept lowest index first), -0 against +0, -inf; the cut
    # does not depend on how rows are split over programs, the Gumbel kernel draws only kept tokens
    # and records their log-probability under the truncated distribution.
    assert interpreted["TRUNC"] == "ok", interpreted["TRUNC"]


def test_replayed_cut_by_the_samplers_radix_select_in_interpreter(interpreted):
    # train-step's replay on CUDA takes the GPU sampler's cut (no sort), as a last logit and a tie count
    # per row: the same nucleus as the stable-sort reference, on fp32 logits with ties, -0 and +0.
    assert interpreted["REPLAY"] == "ok", interpreted["REPLAY"]


@pytest.mark.slow
def test_triton_sampler_frequencies_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", FREQ.replace("DEV", "'cpu'"), "3000"], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_fused_entry_points_reject_mismatched_inputs_before_launching():
    pytest.importorskip("triton")
    from qerl_cli.layers import fused

    q, k, v = torch.randn(3, 6, 32), torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    pos, cs = torch.arange(3), torch.randn(8, 32)
    kc = torch.zeros(4, 4, 2, 32)
    with pytest.raises(ValueError, match="2 cache slots for 3 tokens"):
        fused.rope_(q, k, pos, cs, cache=(v, kc, kc.clone(), torch.tensor([0, 1])))
    with pytest.raises(ValueError, match="contiguous caches"):
        fused.rope_(q, k, pos, cs, cache=(v, kc.transpose(0, 1), kc.clone(), torch.arange(3)))
    with pytest.raises(ValueError, match="matching row-major"):
        fused.silu_mul(torch.randn(4, 8), torch.randn(4, 6))
