"""train-step's one-pass Triton log-softmax kernels (``qerl_cli.train.triton_logprobs``) against the torch
path they replace on CUDA (``logprobs.apply_kept_`` + ``_lse_logp_entropy`` / the row-blocked gradient):
in Triton's interpreter on CPU, and on the GPU at a real vocabulary through the autograd function."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

# Shared by both tests: logits with ties (bf16-rounded, and a tie group crossing block boundaries with the
# cut inside it), a NaN row, uncut rows, targets the cut would drop; the kernels against the torch path.
CHECK = textwrap.dedent("""
    import torch
    import qerl_cli.train.logprobs as lp
    import qerl_cli.train.triton_logprobs as tl_lp

    def torch_path(z, t, kept, scale):
        zz = z.clone() if kept is None else lp.apply_kept_(z.clone(), t, kept)
        lse, logp, ent = lp._lse_logp_entropy(zz, t)
        g = zz.clone()
        for i in range(0, g.shape[0], lp._ROWS):
            blk = g[i : i + lp._ROWS]
            blk.sub_(lse[i : i + lp._ROWS, None]).exp_().mul_(-scale[i : i + lp._ROWS, None])
        g.scatter_add_(1, t[:, None], scale[:, None])
        return lse, logp, ent, g

    def check(dev, n, v, block):
        tl_lp.BLOCK = block
        g = torch.Generator().manual_seed(n + v)
        z = (torch.randn(n, v, generator=g) * 2).bfloat16().float()
        z[1, : 3 * block // 2] = z[1].max()          # a top tie group over more than one block
        z[2] = (torch.randn(v, generator=g) * 0.5).round()  # hundreds of ties per value
        z[3, ::2] = 0.0
        z[3, 1::4] = -0.0
        z[4, 5] = float("nan")
        t = torch.randint(0, v, (n,), generator=g)
        t[0] = z[0].argmin()                         # a target the cut drops: it must stay
        table = torch.tensor([[0.8, 0, 0.0], [1.0, 7, 0.0], [0.9, 40, 0.05], [1.0, 0, 0.0], [0.3, 0, 0.0]],
                             dtype=torch.float64)
        trunc = table[torch.randint(0, 5, (n,), generator=g)]
        trunc[:4] = torch.tensor([0.5, 0, 0.0], dtype=torch.float64)
        trunc[4] = torch.tensor([0.5, 0, 0.0], dtype=torch.float64)
        scale = torch.rand(n, generator=g) + 0.5
        for kept in (lp.find_kept(z, trunc), None):
            want = torch_path(z, t, kept, scale)
            zd, td = z.to(dev), t.to(dev)
            kd = None if kept is None else lp.Kept(kept.last.to(dev), kept.ties.to(dev))
            lse, logp, ent = tl_lp.lse_logp_entropy(zd, td, kd)
            assert torch.equal(zd.cpu().nan_to_num(), z.nan_to_num()), "the forward wrote its input"
            for got, ref, name in ((lse, want[0], "lse"), (logp, want[1], "logp"), (ent, want[2], "entropy")):
                got = got.cpu()
                assert torch.equal(got.isnan(), ref.isnan()), name
                torch.testing.assert_close(got.nan_to_num(), ref.nan_to_num(), rtol=2e-6, atol=2e-5, msg=name)
            gd = tl_lp.logits_grad_(zd, td, want[0].to(dev), scale.to(dev), kd).cpu()
            assert torch.equal(gd.isnan(), want[3].isnan())
            ok = ~want[3].isnan()
            assert torch.equal(gd[ok] == 0, want[3][ok] == 0), "the cut differs"
            torch.testing.assert_close(gd[ok], want[3][ok], rtol=1e-5, atol=1e-7)
    """)


def test_one_pass_kernels_match_the_torch_path_in_interpreter():
    pytest.importorskip("triton")
    script = CHECK + "\nfor n, v, block in ((37, 1000, 256), (9, 129, 64), (6, 64, 64)):\n    check('cpu', n, v, block)\nprint('ok')\n"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_kernels_refuse_what_they_cannot_read():
    pytest.importorskip("triton")
    from qerl_cli.train import triton_logprobs as tl_lp

    with pytest.raises(ValueError, match="fp32 logits"):
        tl_lp.lse_logp_entropy(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="unit column stride"):
        tl_lp.lse_logp_entropy(torch.zeros(8, 2).t(), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="3 targets for 2 rows"):
        tl_lp.logits_grad_(torch.zeros(2, 8), torch.zeros(3, dtype=torch.long), torch.zeros(2), torch.ones(2))


@pytest.mark.gpu
def test_one_pass_kernels_match_the_torch_path_on_gpu():
    ns = {}
    exec(CHECK, ns)
    for n, v, block in ((300, 152064, 4096), (37, 1000, 256)):
        ns["check"]("cuda", n, v, block)


@pytest.mark.gpu
def test_token_logprobs_with_the_kernels_equal_the_torch_path_on_gpu(monkeypatch):
    # The whole autograd function, cut replayed: log-probs, entropies and the hidden states' gradient.
    import qerl_cli.train.logprobs as lp
    from qerl_cli.layers.linear import QLinear

    torch.manual_seed(0)
    hdim, v, n = 256, 151936, 700
    head = QLinear(hdim, v, bias=False).cuda().to(torch.bfloat16).requires_grad_(False)
    model = type("M", (), {"lm_head": head})()
    monkeypatch.setattr(lp, "_dense_head", lambda m: (m.lm_head.weight, None))
    h = torch.randn(n, hdim, device="cuda", dtype=torch.bfloat16) * 4
    t = torch.randint(0, v, (n,), device="cuda")
    it = torch.full((n,), 1 / 0.7, device="cuda")
    trunc = torch.tensor([[0.9, 0, 0.0], [1.0, 50, 0.02], [1.0, 0, 0.0]], dtype=torch.float64,
                         device="cuda")[torch.arange(n, device="cuda") % 3]
    out = {}
    for fused in (True, False):
        monkeypatch.setattr(lp, "_fused", lambda z, f=fused: f)
        x = h.clone().requires_grad_(True)
        logp, ent = lp.token_logprobs(model, x, t, it, chunk=256, trunc=trunc)
        logp.sum().backward()
        out[fused] = (logp.detach(), ent, x.grad.float())
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out[True][2], out[False][2], rtol=2e-2, atol=1e-2 * float(out[False][2].abs().max()))
    print(json.dumps({"max_logp_diff": float((out[True][0] - out[False][0]).abs().max())}))
