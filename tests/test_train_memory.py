"""train-step memory machinery on CPU: the one-tensor-per-layer checkpoint gives the gradients of the
plain forward, bit for bit."""

from __future__ import annotations

import pytest
import torch

from qerl_cli.layers.lora import LoraSpec, lora_parameters
from qerl_cli.models import ModelConfig, build_random_model

TINY = dict(arch="qwen2", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
            num_kv_heads=2, head_dim=16, qkv_bias=True)


def tiny_model(quantized=True, dropout=0.0, tie=False, train_norms=False, device="cpu", dtype=torch.float32):
    cfg = ModelConfig(**TINY, tie_word_embeddings=tie)
    m = build_random_model(cfg, device=device, dtype=dtype, quantized=quantized, seed=3, std=0.05,
                           lora=LoraSpec(r=4, alpha=8, dropout=dropout, seed=1))
    g = torch.Generator(device=device).manual_seed(5)
    with torch.no_grad():
        for p in lora_parameters(m):  # B = 0 at init would leave A's gradient at zero
            p.copy_(torch.randn(p.shape, generator=g, device=device) * 0.1)
    for p in m.parameters():
        p.requires_grad_(False)
    params = lora_parameters(m)
    if train_norms:
        for layer in m.model.layers:
            layer.post_attention_layernorm.weight.requires_grad_(True)
            params.append(layer.post_attention_layernorm.weight)
    for p in params:
        p.requires_grad_(True)
    m.train()
    return m, params


def batch(b=3, seq=11, vocab=256, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, seq), generator=g)
    mask = torch.ones(b, seq, dtype=torch.long)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    return ids.to(device), mask.to(device)


def grads_of(model, params, ids, mask, seed=7):
    """Hidden states and the gradients of every trainable tensor for a fixed random loss."""
    for p in params:
        p.grad = None
    torch.manual_seed(seed)  # LoRA dropout masks
    hidden = model.forward_train(ids, mask)
    w = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(11)).to(hidden)
    (model.compute_logits(hidden).logsumexp(-1).sum() + (hidden.float() * w.float()).sum()).backward()
    return hidden.detach().clone(), [p.grad.clone() for p in params]


@pytest.mark.parametrize("quantized,dropout,train_norms", [(True, 0.0, False), (False, 0.2, True)])
def test_checkpointed_gradients_equal_plain_gradients_bit_for_bit(quantized, dropout, train_norms):
    model, params = tiny_model(quantized, dropout, train_norms=train_norms)
    ids, mask = batch()
    model.gradient_checkpointing = False
    h0, g0 = grads_of(model, params, ids, mask)
    model.gradient_checkpointing = True
    h1, g1 = grads_of(model, params, ids, mask)
    assert torch.equal(h0, h1)
    for a, b in zip(g0, g1):
        assert a.abs().sum() > 0
        assert torch.equal(a, b)
    # and the inference forward (no grad: the engine's path) is unchanged too
    torch.manual_seed(7)
    with torch.no_grad():
        assert torch.equal(model.forward_train(ids, mask), h0)


def test_checkpoint_saves_one_residual_stream_tensor_per_layer(monkeypatch):
    import qerl_cli.models.decoder as decoder

    model, params = tiny_model()
    model.gradient_checkpointing = True
    ids, mask = batch()
    calls = []
    real = decoder.checkpoint

    def spy(fn, *args, **kw):
        calls.append([a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()])
        return real(fn, *args, **kw)

    monkeypatch.setattr(decoder, "checkpoint", spy)
    grads_of(model, params, ids, mask)
    assert len(calls) == TINY["num_layers"]
    for floats in calls:
        assert [tuple(t.shape) for t in floats] == [(3, 11, TINY["hidden_size"])]


# ---- --offload-activations -----------------------------------------------------------------------
def test_offload_hooks_round_trip_every_layer_input_and_prefetch_in_reverse():
    """The offloader's bookkeeping on CPU (plain copies stand in for the pinned/stream copies): it
    takes exactly the checkpointed layer inputs, gives them back for the recompute (all but the first
    one already prefetched), the gradients do not change by a bit, and nothing outlives the backward."""
    from qerl_cli.train.offload import ActivationOffloader

    model, params = tiny_model(dropout=0.1)
    ids, mask = batch()
    model.gradient_checkpointing = True
    h0, g0 = grads_of(model, params, ids, mask)
    for prefetch in (True, False):
        off = model.activation_offload = ActivationOffloader("cpu", min_bytes=0, prefetch=prefetch)
        h1, g1 = grads_of(model, params, ids, mask)
        n = TINY["num_layers"]
        assert off.stats["packed"] == n and off.stats["unpacked"] == n
        assert off.stats["packed_bytes"] == n * ids.numel() * TINY["hidden_size"] * 4
        assert off.stats["prefetched"] == (n - 1 if prefetch else 0)
        assert off._last is not None and off._last() is None  # the graph and its host copies are gone
        assert torch.equal(h0, h1)
        for a, b in zip(g0, g1):
            assert torch.equal(a, b)
    # below min_bytes (and non-float, e.g. positions) nothing is taken
    off = model.activation_offload = ActivationOffloader("cpu", min_bytes=1 << 30)
    grads_of(model, params, ids, mask)
    assert off.stats["packed"] == 0
    model.activation_offload = None


@pytest.fixture(scope="module")
def step_inputs(tmp_path_factory):
    from tests.train_fixtures import base_hash_of, make_shard, quantized_tiny

    root = tmp_path_factory.mktemp("mem_models")
    _, q = quantized_tiny(root)
    return q, make_shard(root / "sh", base_hash_of(q), seed=2)


def _step(q, sh, out, **kw):
    from qerl_cli.train_step import TrainStepConfig, train_step

    return train_step(TrainStepConfig(model=q, shards=[str(sh)], out=out, micro_batch_tokens=40, lr=1e-3, **kw))


def test_offload_flag_is_a_logged_no_op_on_cpu_and_needs_checkpointing(step_inputs, tmp_path, capsys):
    from typer.testing import CliRunner

    from qerl_cli.cli import app
    from qerl_cli.errors import BadInputError

    q, sh = step_inputs
    a = _step(q, sh, tmp_path / "a", device="cpu")
    capsys.readouterr()
    b = _step(q, sh, tmp_path / "b", device="cpu", offload_activations=True)
    assert "--offload-activations: no effect on cpu" in capsys.readouterr().err
    assert a["metrics"]["loss"] == b["metrics"]["loss"] and a["metrics"]["grad_norm"] == b["metrics"]["grad_norm"]
    assert a["fingerprint"] == b["fingerprint"]  # same result: toggling the flag is not a new step
    assert (tmp_path / "a" / "adapter_model.safetensors").read_bytes() == \
        (tmp_path / "b" / "adapter_model.safetensors").read_bytes()
    with pytest.raises(BadInputError, match="needs gradient checkpointing"):
        _step(q, sh, tmp_path / "c", device="cpu", offload_activations=True, gradient_checkpointing=False)
    assert not (tmp_path / "c").exists()
    res = CliRunner().invoke(app, ["train-step", "--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})
    assert "--offload-activations" in res.output
    res = CliRunner().invoke(app, ["train-step", "--model", str(q), "--shards", str(sh), "--out", str(tmp_path / "d"),
                                   "--offload-activations", "--no-checkpointing", "--device", "cpu"])
    assert res.exit_code == 2 and "needs gradient checkpointing" in res.output


# ---- GPU -----------------------------------------------------------------------------------------
CUDA_TINY = dict(TINY, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                 vocab_size=512)


def train_lora_only(m, scale: float, device="cuda"):
    """Random LoRA weights (B = 0 at init would leave A's gradient at zero), the base frozen, the model in
    training mode under gradient checkpointing; returns the LoRA parameters."""
    g = torch.Generator(device=device).manual_seed(5)
    with torch.no_grad():
        for p in lora_parameters(m):
            p.copy_(torch.randn(p.shape, generator=g, device=device) * scale)
    for p in m.parameters():
        p.requires_grad_(False)
    params = lora_parameters(m)
    for p in params:
        p.requires_grad_(True)
    m.train()
    m.gradient_checkpointing = True
    return params


def cuda_model(quantized=True):
    cfg = ModelConfig(**CUDA_TINY)
    m = build_random_model(cfg, device="cuda", dtype=torch.bfloat16, quantized=quantized, seed=3, std=0.05,
                           lora=LoraSpec(r=8, alpha=8, seed=1))
    return m, train_lora_only(m, 0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("quantized", [True, False])
def test_offloaded_gradients_are_bit_identical_on_cuda(quantized):
    """Offload + prefetch on the side stream vs the layer inputs kept on the GPU: same bits. The math
    SDPA backend keeps the attention backward deterministic (flash's backward is not), so any
    difference would be the offload's; the baseline is run twice to prove the comparison is fair."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from qerl_cli.train.offload import ActivationOffloader

    model, params = cuda_model(quantized)
    ids, mask = batch(b=4, seq=512, vocab=CUDA_TINY["vocab_size"], device="cuda")
    with sdpa_kernel([SDPBackend.MATH]):
        h0, g0 = grads_of(model, params, ids, mask)
        h0b, g0b = grads_of(model, params, ids, mask)
        assert torch.equal(h0, h0b) and all(torch.equal(a, b) for a, b in zip(g0, g0b)), "baseline not reproducible"
        off = model.activation_offload = ActivationOffloader("cuda", min_bytes=1024)
        for _ in range(2):  # second round reuses the cached pinned blocks
            h1, g1 = grads_of(model, params, ids, mask)
            torch.cuda.synchronize()
            assert torch.equal(h0, h1)
            for a, b in zip(g0, g1):
                assert torch.equal(a, b)
    n = CUDA_TINY["num_layers"]
    assert off.stats["packed"] == 2 * n and off.stats["prefetched"] == 2 * (n - 1)


@pytest.mark.gpu
def test_offload_frees_the_layer_inputs_on_cuda_and_round_trips_exactly():
    """Default attention backends (flash): every recomputed layer gets back exactly the bytes it saved,
    and after the forward the GPU holds num_layers fewer [tokens, hidden] tensors."""
    from qerl_cli.train.offload import ActivationOffloader

    class Checked(ActivationOffloader):
        def _pack(self, t):
            h = super()._pack(t)
            if h is not t:
                self.originals[id(h)] = t.detach().clone()
            return h

        def _unpack(self, h):
            t = super()._unpack(h)
            if id(h) in self.originals:
                assert torch.equal(t, self.originals[id(h)])
                self.checked += 1
            return t

    model, params = cuda_model()
    ids, mask = batch(b=4, seq=512, vocab=CUDA_TINY["vocab_size"], device="cuda")
    layer_bytes = ids.numel() * CUDA_TINY["hidden_size"] * 2
    allocated = []
    for offload in (False, True):
        model.activation_offload = None
        if offload:
            model.activation_offload = Checked("cuda", min_bytes=1024)
            model.activation_offload.originals, model.activation_offload.checked = {}, 0
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        hidden = model.forward_train(ids, mask)
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated() - before)
        if offload:  # the test's own clones of the originals do not count
            allocated[-1] -= CUDA_TINY["num_layers"] * layer_bytes
        hidden.float().pow(2).sum().backward()
        del hidden
    assert model.activation_offload.checked == CUDA_TINY["num_layers"]
    assert allocated[0] - allocated[1] >= 0.95 * CUDA_TINY["num_layers"] * layer_bytes
    model.activation_offload = None


# ---- --embeddings-on-cpu -------------------------------------------------------------------------
def test_embeddings_on_cpu_is_a_logged_no_op_on_cpu_and_refused_when_tied(step_inputs, tmp_path, capsys):
    from typer.testing import CliRunner

    from qerl_cli.cli import app
    from qerl_cli.errors import BadInputError
    from tests.train_fixtures import base_hash_of, make_shard, quantized_tiny

    q, sh = step_inputs
    a = _step(q, sh, tmp_path / "a", device="cpu")
    capsys.readouterr()
    b = _step(q, sh, tmp_path / "b", device="cpu", embeddings_on_cpu=True, offload_activations=True)
    err = capsys.readouterr().err
    assert "--embeddings-on-cpu: no effect on cpu" in err and "--offload-activations: no effect on cpu" in err
    assert a["fingerprint"] == b["fingerprint"]
    assert (tmp_path / "a" / "adapter_model.safetensors").read_bytes() == \
        (tmp_path / "b" / "adapter_model.safetensors").read_bytes()

    model, _ = tiny_model(tie=True)
    with pytest.raises(ValueError, match="tied to the lm_head"):
        model.embeddings_to_cpu()
    _, tied = quantized_tiny(tmp_path / "tied", tie_word_embeddings=True)
    tsh = make_shard(tmp_path / "tsh", base_hash_of(tied))
    with pytest.raises(BadInputError, match="ties its input embedding to the lm_head"):
        _step(tied, tsh, tmp_path / "c", device="cpu", embeddings_on_cpu=True)
    assert not (tmp_path / "c").exists()
    runner = CliRunner()
    res = runner.invoke(app, ["train-step", "--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})
    assert "--embeddings-on-cpu" in res.output
    res = runner.invoke(app, ["train-step", "--model", str(tied), "--shards", str(tsh), "--out", str(tmp_path / "d"),
                              "--embeddings-on-cpu", "--device", "cpu"])
    assert res.exit_code == 2 and "tie_word_embeddings" in res.output


def test_device_follows_the_layers_not_the_embedding_table():
    model, _ = tiny_model()
    assert model.device == torch.device("cpu") and not model.embeddings_on_cpu
    model.embeddings_to_cpu()  # already there: nothing changes
    assert not model.embeddings_on_cpu


@pytest.mark.gpu
@pytest.mark.parametrize("offload", [False, True])
def test_embeddings_on_cpu_give_identical_gradients_and_free_the_table_on_cuda(offload):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from qerl_cli.train.offload import ActivationOffloader

    model, params = cuda_model()
    ids, mask = batch(b=4, seq=512, vocab=CUDA_TINY["vocab_size"], device="cuda")
    with sdpa_kernel([SDPBackend.MATH]):
        h0, g0 = grads_of(model, params, ids, mask)
        table = model.model.embed_tokens.weight
        table_bytes = table.numel() * table.element_size()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        model.embeddings_to_cpu()
        del table
        assert before - torch.cuda.memory_allocated() == table_bytes
        assert model.embeddings_on_cpu and model.device.type == "cuda"
        assert model.lm_head.weight.is_cuda
        if offload:
            model.activation_offload = ActivationOffloader("cuda", min_bytes=1024)
        for ids_on in ("cuda", "cpu"):  # train-step hands over host ids when the table is on the host
            h1, g1 = grads_of(model, params, ids.to(ids_on), mask.to(ids_on))
            torch.cuda.synchronize()
            assert h1.is_cuda and torch.equal(h0, h1)
            for a, b in zip(g0, g1):
                assert torch.equal(a, b)
    model.activation_offload = None


@pytest.mark.gpu
def test_train_step_with_both_memory_options_matches_plain_on_cuda(step_inputs, tmp_path):
    q, sh = step_inputs
    a = _step(q, sh, tmp_path / "a", device="cuda")["metrics"]
    b = _step(q, sh, tmp_path / "b", device="cuda", offload_activations=True, embeddings_on_cpu=True)["metrics"]
    assert a["loss"] == b["loss"] and a["entropy"] == b["entropy"]  # the forward is deterministic
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)  # flash attention's backward may not be


# ---- benchmarks/bench_train.py --memory-breakdown -------------------------------------------------
def _bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train.py"
    spec = importlib.util.spec_from_file_location("bench_train", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_peak_breakdown_replays_the_allocator_trace_to_the_peak():
    b = _bench()
    mib = 2**20
    ckpt = [{"filename": "/x/site-packages/torch/utils/checkpoint.py", "line": 1, "name": "checkpoint"},
            {"filename": "/repo/qerl_cli/models/decoder.py", "line": 140, "name": "forward"},
            {"filename": "/repo/benchmarks/bench_train.py", "line": 9, "name": "run_one"}]
    logits = [{"filename": "/repo/qerl_cli/train/logprobs.py", "line": 66, "name": "backward"}]
    trace = [
        {"action": "free_requested", "addr": 1, "size": 10 * mib},  # allocated before recording (an old grad)
        {"action": "alloc", "addr": 2, "size": 56 * mib, "frames": ckpt},
        {"action": "alloc", "addr": 3, "size": 56 * mib, "frames": ckpt},
        {"action": "alloc", "addr": 4, "size": 600 * mib, "frames": logits},
        {"action": "alloc", "addr": 5, "size": 1 * mib, "frames": []},
        {"action": "free_requested", "addr": 4, "size": 600 * mib},
        {"action": "free_completed", "addr": 4, "size": 600 * mib},
        {"action": "alloc", "addr": 6, "size": 300 * mib, "frames": logits},
    ]
    r = b.peak_breakdown(trace, baseline=100 * mib)
    assert r["peak_gib"] * 2**30 == (100 - 10 + 56 + 56 + 600 + 1) * mib
    assert r["before_step_live_at_peak_gib"] * 2**30 == 90 * mib
    assert r["step_allocations_live_at_peak_gib"] * 2**30 == (56 + 56 + 600 + 1) * mib
    g = r["top_groups"]
    assert g[0]["where"] == "qerl_cli/train/logprobs.py:66 backward" and g[0]["count"] == 1
    assert g[1]["count"] == 2 and g[1]["each_mib"] == [56.0]
    assert g[1]["where"] == "qerl_cli/models/decoder.py:140 forward < benchmarks/bench_train.py:9 run_one"
    assert g[2]["where"].startswith("(no Python frame")
    assert [a["mib"] for a in r["top_allocations"]] == [600.0, 56.0, 56.0, 1.0]
    assert b.peak_breakdown([], baseline=5)["top_groups"] == []


def test_bench_train_runs_on_cpu_with_the_memory_options(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train.py"
    r = subprocess.run([sys.executable, str(script), "--configs", "tiny-nvfp4", "--device", "cpu", "--steps", "1",
                        "--offload-activations", "--embeddings-on-cpu", "--memory-breakdown", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    row = json.loads((tmp_path / "bench_train.json").read_text())[0]
    assert "error" not in row, row
    assert row["offload_activations"] and row["embeddings_on_cpu"] and row["step_s"] > 0
    mem = json.loads((tmp_path / "bench_train_tiny-nvfp4_memory.json").read_text())
    assert mem["before_step"]["weights_gib"] > 0 and mem["before_step"]["optimizer_state_gib"] > 0
    assert "offload, embeddings on CPU" in (tmp_path / "bench_train.md").read_text()
