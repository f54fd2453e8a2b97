"""The Triton paged decode attention kernel equals the torch gather + SDPA path (run on CPU by the interpreter)."""

from __future__ import annotations

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
    for hq, hk, d, bs, splits in [(4, 2, 16, 4, 1), (7, 1, 32, 16, 4), (8, 8, 16, 8, 2)]:
        nblocks, b = 40, 3
        k = torch.randn(nblocks, bs, hk, d)
        v = torch.randn(nblocks, bs, hk, d)
        q = torch.randn(b, hq, d)
        lens = torch.tensor([1, 37, 70], dtype=torch.int32)
        tables = torch.stack([torch.randperm(nblocks - 1)[:20] + 1 for _ in range(b)]).int()
        ref = paged_decode_attention_torch(q, k, v, tables, lens, d ** -0.5)
        out = paged_decode_attention_triton(q, k, v, tables, lens, d ** -0.5, num_splits=splits)
        err = (out - ref).abs().max().item()
        assert err < 1e-4, (hq, hk, d, bs, splits, err)
    print("ok")
""")


def test_triton_kernel_matches_torch_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


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
    print("ok")
""")


def test_fused_norm_and_rope_match_torch_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", FUSED], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
