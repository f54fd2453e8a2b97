"""train-step --deterministic: PyTorch's deterministic mode for the loop, the cuBLAS setting it needs, a
clear error for an op without a deterministic kernel, and the same bytes from a rerun (CPU, and GPU)."""

from __future__ import annotations

import pytest
import torch

from qerl_cli.errors import BadInputError
from qerl_cli.train.determinism import (
    CUBLAS_VAR,
    NondeterministicOpError,
    deterministic_algorithms,
    prepare_environment,
)
from tests.test_train_memory import _step, step_inputs  # noqa: F401

FILES = ("adapter_model.safetensors", "optimizer.safetensors")


def _unset_cublas(monkeypatch):
    monkeypatch.setenv(CUBLAS_VAR, "-")  # recorded as unset: undone after the test, whatever the code sets
    monkeypatch.delenv(CUBLAS_VAR)


def test_prepare_environment_sets_keeps_or_refuses_the_cublas_workspace(monkeypatch):
    import os

    _unset_cublas(monkeypatch)
    prepare_environment()
    assert os.environ[CUBLAS_VAR] == ":4096:8"
    monkeypatch.setenv(CUBLAS_VAR, ":16:8")
    prepare_environment()
    assert os.environ[CUBLAS_VAR] == ":16:8"
    monkeypatch.setenv(CUBLAS_VAR, ":4096:2")
    with pytest.raises(BadInputError, match=f"{CUBLAS_VAR}=':4096:2'") as e:
        prepare_environment()
    assert ":4096:8" in str(e.value)


@pytest.mark.parametrize("callers", [(False, False), (True, True)])
def test_the_mode_holds_inside_the_block_and_the_callers_comes_back(callers):
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(callers[0], warn_only=callers[1])
    try:
        with deterministic_algorithms(False):
            assert torch.are_deterministic_algorithms_enabled() == callers[0]
        with deterministic_algorithms(True):
            assert torch.are_deterministic_algorithms_enabled()
            assert not torch.is_deterministic_algorithms_warn_only_enabled()  # strict: an op raises, never varies
        assert (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()) == callers
        with pytest.raises(NondeterministicOpError):
            with deterministic_algorithms(True):
                torch.zeros(3).put_(torch.tensor([0]), torch.tensor([1.0]))
        assert (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()) == callers
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def test_an_op_without_a_deterministic_kernel_is_named_and_other_errors_pass():
    with pytest.raises(NondeterministicOpError, match="--deterministic: put_ does not have a deterministic") as e:
        with deterministic_algorithms(True):
            torch.zeros(3).put_(torch.tensor([0]), torch.tensor([1.0]))  # refused on every device in this mode
    assert e.value.exit_code == 2 and "without --deterministic" in str(e.value)
    assert "\n" not in str(e.value) and "warn_only" not in str(e.value)  # not PyTorch's advice for its API
    with pytest.raises(RuntimeError, match="^other$"):
        with deterministic_algorithms(True):
            raise RuntimeError("other")


def test_deterministic_step_on_cpu_is_the_same_step(step_inputs, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv(CUBLAS_VAR, ":0:0")  # the CPU reads no cuBLAS setting: not refused there
    q, sh = step_inputs
    a = _step(q, sh, tmp_path / "a", device="cpu")
    b = _step(q, sh, tmp_path / "b", device="cpu", deterministic=True)
    assert not torch.are_deterministic_algorithms_enabled()  # the caller's mode after the step
    assert a["deterministic"] is False and b["deterministic"] is True  # how it ran, in the manifest
    assert a["fingerprint"] == b["fingerprint"]  # not a new step: a rerun with the flag finds it done
    for f in FILES:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    assert _step(q, sh, tmp_path / "a", device="cpu", deterministic=True)["already_done"] is True


def test_cli_flag_and_the_error_of_an_op_without_a_deterministic_kernel(step_inputs, tmp_path, monkeypatch):  # noqa: F811
    from typer.testing import CliRunner

    import qerl_cli.train_step as ts
    from qerl_cli.cli import app

    _unset_cublas(monkeypatch)
    q, sh = step_inputs
    base = ["train-step", "--model", str(q), "--shards", str(sh), "--device", "cpu", "--micro-batch-tokens", "40"]
    real = ts.run_epochs

    def with_put(*a, **kw):  # the loop meets an op PyTorch has no deterministic kernel for
        torch.zeros(3).put_(torch.tensor([0]), torch.tensor([1.0]))
        return real(*a, **kw)

    monkeypatch.setattr(ts, "run_epochs", with_put)
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "x"), "--deterministic"])
    assert res.exit_code == 2, res.output
    assert "put_ does not have a deterministic implementation" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "x").exists()
    monkeypatch.setattr(ts, "run_epochs", real)
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "y"), "--deterministic"])
    assert res.exit_code == 0, res.output
    import json

    assert json.loads((tmp_path / "y" / "manifest.json").read_text())["deterministic"] is True
    res = CliRunner().invoke(app, ["train-step", "--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})
    assert "--deterministic" in res.output


@pytest.mark.parametrize("deterministic,device,prepared", [(True, "cuda", 1), (True, "cpu", 0), (False, "cuda", 0)])
def test_the_cublas_setting_is_made_on_a_gpu_before_the_step_reads_anything(step_inputs, tmp_path, monkeypatch,  # noqa: F811
                                                                              deterministic, device, prepared):
    import qerl_cli.train_step as ts

    calls = []

    class Stop(Exception):
        pass

    def read_step(cfg, dist=None):  # the first thing after the device is known: CUDA is not touched before it
        raise Stop

    monkeypatch.setattr(ts, "resolve_device", lambda d: device)
    monkeypatch.setattr(ts, "prepare_environment", lambda: calls.append(1))
    monkeypatch.setattr(ts, "read_step", read_step)
    q, sh = step_inputs
    with pytest.raises(Stop):
        _step(q, sh, tmp_path / "o", deterministic=deterministic)
    assert len(calls) == prepared


@pytest.mark.gpu
def test_deterministic_mode_makes_attention_backward_repeatable_at_a_shape_cudnn_varies_at(monkeypatch):
    """Qwen2.5-32B heads, 3 x 2560 tokens: cuDNN's backward differed between identical calls on an H100
    (benchmarks/probe_sdpa_determinism.py); in the mode PyTorch runs a deterministic kernel."""
    import torch.nn.functional as F

    monkeypatch.setenv(CUBLAS_VAR, ":4096:8")
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(h):
        return torch.randn(3, h, 2560, 128, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v, go = rand(40).requires_grad_(), rand(8).requires_grad_(), rand(8).requires_grad_(), rand(40)
    runs = []
    with deterministic_algorithms(True):
        for _ in range(4):
            q.grad = k.grad = v.grad = None
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(go)
            runs.append([t.grad.clone() for t in (q, k, v)])
    for r in runs[1:]:
        assert all(torch.equal(x, y) for x, y in zip(runs[0], r))


@pytest.mark.gpu
def test_deterministic_step_on_cuda_runs_and_a_rerun_writes_the_same_bytes(step_inputs, tmp_path, monkeypatch):  # noqa: F811
    """Every op of the loop has a deterministic kernel on CUDA (none raises), with the recipes' memory options on."""
    monkeypatch.setenv(CUBLAS_VAR, ":4096:8")
    q, sh = step_inputs
    kw = dict(device="cuda", deterministic=True, keep_activations=1, offload_activations=True, lora_dropout=0.1,
              embeddings_on_cpu=True)
    a = _step(q, sh, tmp_path / "a", **kw)
    _step(q, sh, tmp_path / "b", **kw)
    assert a["deterministic"] is True
    for f in FILES:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()


@pytest.mark.gpu
def test_rollout_engine_rerun_gives_the_same_tokens_and_logprobs_on_cuda():
    """A fresh engine (new KV cache, new CUDA graphs) samples the same completions bit for bit: rollout needs
    no --deterministic (the 7B-shaped check: benchmarks/probe_rollout_repeat.py)."""
    from qerl_cli.engine import LLMEngine, SamplingParams
    from qerl_cli.layers.lora import LoraSpec, lora_parameters
    from qerl_cli.models import ModelConfig, build_random_model
    from tests.test_train_memory import CUDA_TINY

    m = build_random_model(ModelConfig(**CUDA_TINY), device="cuda", dtype=torch.bfloat16, quantized=True,
                           lora=LoraSpec(r=8, alpha=16), max_positions=96)
    g = torch.Generator(device="cuda").manual_seed(5)
    with torch.no_grad():
        for p in lora_parameters(m):
            p.copy_(torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype) * 0.05)
    m.eval()
    prompts = [[(7 * i + j) % 200 + 1 for j in range(12 + i)] for i in range(6)]
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=40, ignore_eos=True, seed=3)
    runs = []
    for _ in range(2):
        engine = LLMEngine(m, None, max_num_seqs=24, max_model_len=80)
        runs.append([(c.token_ids, c.logprobs) for grp in engine.generate(prompts, sp, n=4) for c in grp])
        del engine
    assert runs[0] == runs[1]
