"""`qerl train-step` end to end on a tiny NVFP4 model (CPU, fp32).

The first step's loss is checked against an independent computation: Hugging Face transformers
running the exact dequantized weights, with the formula written out here. Then: resume/rerun
determinism, lineage and bad-input errors (nothing written), LoRA gradients through the NVFP4
layer, and the CLI.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from qerl_cli.adapters import adapter_hash
from qerl_cli.aqn import NOISED_NORMS, noise_vector
from qerl_cli.errors import BadInputError, LineageError, NumericalError, OutOfMemoryError
from qerl_cli.shards import read_records, shard_name
from qerl_cli.train_step import TrainStepConfig, train_step
from tests.train_fixtures import base_hash_of, dequantized_twin, make_shard, quantized_tiny


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_models")
    src, qdir = quantized_tiny(root)
    twin = dequantized_twin(qdir, root / "twin")
    return {"src": src, "q": qdir, "twin": twin, "qhash": base_hash_of(qdir), "twinhash": base_hash_of(twin)}


def _cfg(model, shards, out, **kw):
    kw.setdefault("micro_batch_tokens", 40)
    kw.setdefault("progress", False)
    return TrainStepConfig(model=model, shards=[str(s) for s in shards], out=out, **kw)


# ---- independent reference ------------------------------------------------------------------------
def _hf_token_logprobs(model_dir, records, noise=None):
    """Per-record completion log-probs (tempered) and entropies from transformers, fp32."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if noise:
        with torch.no_grad():
            for i, layer in enumerate(hf.model.layers):
                for name in NOISED_NORMS:
                    w = getattr(layer, name).weight
                    z = noise_vector(w.shape[0], noise["sigma"], noise["seed"], noise["step"], i, name)
                    if noise.get("rounded_to") == "bfloat16":  # --engine vllm: w + Z stored in bf16
                        w.copy_((w.bfloat16().float() + z).bfloat16().float())
                    else:
                        w.add_(z)
    out = []
    with torch.no_grad():
        for r in records:
            p, c = r["prompt_token_ids"], r["completion_token_ids"]
            ids = torch.tensor([p + c])
            logits = hf(ids).logits[0].float() / r["sampling"]["temperature"]
            lsm = torch.log_softmax(logits, -1)
            rows = range(len(p) - 1, len(p) - 1 + len(c))
            lp = [float(lsm[t, tok]) for t, tok in zip(rows, c)]
            ent = [float(-(lsm[t].exp() * lsm[t]).sum()) for t in rows]
            out.append((lp, ent))
    return out


def _reference_first_step(records, token_lp, loss_type, mask_truncated, tis_cap=2.0):
    """Step-0 loss written out: fresh adapter => PPO ratio 1, so loss_t = -A * min(exp(lp - sampled), cap)."""
    groups = {}
    for r in records:
        groups.setdefault(r["group_id"], []).append(r["reward"])
    terms, live = [], []
    for r, (lp, _) in zip(records, token_lp):
        g = groups[r["group_id"]]
        a = (r["reward"] - statistics.mean(g)) / (statistics.stdev(g) + 1e-4)
        t = [-a * min(math.exp(x - s), tis_cap) for x, s in zip(lp, r["logprobs"])]
        masked = mask_truncated and r["finish_reason"] == "length"
        terms.append(t)
        live.append(0 if masked else len(t))
    if loss_type == "dapo":
        return sum(sum(t) for t, n in zip(terms, live) if n) / sum(live)
    if loss_type == "grpo":
        return sum(sum(t) / n for t, n in zip(terms, live) if n) / len(terms)
    raise AssertionError(loss_type)


@pytest.mark.parametrize(
    "which,loss,mask,noise",
    [
        ("q", "dapo", False, None),
        ("q", "grpo", True, None),
        ("q", "dapo", False, {"sigma": 0.05, "seed": 11, "step": 0, "norms": list(NOISED_NORMS)}),
        ("q", "dapo", False, {"sigma": 0.01, "seed": 11, "step": 0, "norms": list(NOISED_NORMS),
                              "rounded_to": "bfloat16"}),
        ("twin", "dapo", False, None),  # the 16-bit LoRA baseline path: plain HF dir as --model
    ],
)
def test_first_step_loss_matches_independent_computation(models, tmp_path, which, loss, mask, noise):
    model_dir, h = (models["q"], models["qhash"]) if which == "q" else (models["twin"], models["twinhash"])
    sh = make_shard(tmp_path / "sh", h, noise=noise)
    m = train_step(_cfg(model_dir, [sh], tmp_path / "a1", loss=loss, mask_truncated=mask,
                        baseline="bf16" if which == "twin" else None))
    recs = read_records(sh)
    lp = _hf_token_logprobs(models["twin"], recs, noise)
    want = _reference_first_step(recs, lp, loss, mask)
    got = m["metrics"]
    assert got["loss"] == pytest.approx(want, rel=2e-4, abs=1e-6)
    live = [(x, s, e) for r, (lps, ents) in zip(recs, lp) if not (mask and r["finish_reason"] == "length")
            for x, s, e in zip(lps, r["logprobs"], ents)]
    assert got["entropy"] == pytest.approx(sum(e for *_, e in live) / len(live), rel=1e-3)
    assert got["is_ratio_mean"] == pytest.approx(sum(math.exp(x - s) for x, s, _ in live) / len(live), rel=1e-3)
    assert got["is_ratio_max"] == pytest.approx(max(math.exp(x - s) for x, s, _ in live), rel=1e-3)
    assert got["zero_variance_groups"] == pytest.approx(1 / 3)
    assert got["clip_ratio_low"] == 0 and got["clip_ratio_high"] == 0  # one epoch: on-policy, ratio 1
    assert got["trained_tokens"] == len(live)
    if noise:  # the noise really reached the training forward
        clean = _reference_first_step(recs, _hf_token_logprobs(models["twin"], recs), loss, mask)
        assert abs(clean - want) > 100 * abs(got["loss"] - want)


def _read_bytes(d: Path):
    return {n: (d / n).read_bytes() for n in ("adapter_model.safetensors", "optimizer.safetensors")}


def test_outputs_rerun_and_resume_are_deterministic(models, tmp_path, monkeypatch):
    q, h = models["q"], models["qhash"]
    sh0 = make_shard(tmp_path / "sh0", h, seed=1)
    kw = dict(lr=1e-3, lora_rank=4, lora_alpha=8, warmup_steps=2, total_steps=5)
    m1 = train_step(_cfg(q, [sh0], tmp_path / "a1", **kw))
    a1 = tmp_path / "a1"
    for name in ("adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors", "trainer_state.json",
                 "metrics.jsonl", "manifest.json"):
        assert (a1 / name).is_file(), name
    st = json.loads((a1 / "trainer_state.json").read_text())
    assert (st["global_step"], st["optimizer_steps"], st["base_model_hash"]) == (1, 1, h)
    assert m1["metrics"]["lr"] == pytest.approx(0.5e-3)  # warmup step 1 of 2
    # same inputs, another dir: identical bytes
    train_step(_cfg(q, [sh0], tmp_path / "a1b", **kw))
    assert _read_bytes(a1) == _read_bytes(tmp_path / "a1b")
    # same dir: already done, nothing rewritten
    before = (a1 / "manifest.json").read_text()
    train_step(_cfg(q, [sh0], a1, **kw))
    assert (a1 / "manifest.json").read_text() == before

    sh1 = make_shard(tmp_path / "sh1", h, adapter_hash=adapter_hash(a1), step=1, seed=2)
    step2 = dict(lr=1e-3, warmup_steps=2, total_steps=5)
    train_step(_cfg(q, [sh1], tmp_path / "a2", adapter=a1, **step2))
    # a step that crashes mid-way leaves nothing, and its rerun equals the uninterrupted run
    import qerl_cli.train_step as ts

    real = ts.save_optimizer
    monkeypatch.setattr(ts, "save_optimizer", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("killed")))
    with pytest.raises(RuntimeError, match="killed"):
        train_step(_cfg(q, [sh1], tmp_path / "a2b", adapter=a1, **step2))
    assert not (tmp_path / "a2b").exists()
    assert not list(tmp_path.glob(".a2b*"))
    monkeypatch.setattr(ts, "save_optimizer", real)
    train_step(_cfg(q, [sh1], tmp_path / "a2b", adapter=a1, **step2))
    assert _read_bytes(tmp_path / "a2") == _read_bytes(tmp_path / "a2b")
    st2 = json.loads((tmp_path / "a2" / "trainer_state.json").read_text())
    assert st2["global_step"] == 2 and st2["lineage"] == [adapter_hash(a1)]
    assert st2["lora"]["r"] == 4
    # the LR schedule continued from the adapter's position (step 1 of warmup 2 -> full lr)
    line = json.loads((tmp_path / "a2" / "metrics.jsonl").read_text())
    assert line["lr"] == pytest.approx(1e-3) and line["step"] == 1


def test_step_moves_lora_b_and_epochs_reuse_old_logprobs(models, tmp_path):
    from safetensors.torch import load_file

    q, h = models["q"], models["qhash"]
    sh = make_shard(tmp_path / "sh", h, seed=3)
    m = train_step(_cfg(q, [sh], tmp_path / "e2", epochs=3, lr=5e-3, max_grad_norm=0.0,
                        metrics_file=tmp_path / "run" / "metrics.jsonl"))
    w = load_file(str(tmp_path / "e2" / "adapter_model.safetensors"))
    assert all(float(t.abs().max()) > 0 for k, t in w.items() if "lora_B" in k)
    met = m["metrics"]
    # epoch 1 is on-policy (ratio 1, nothing clipped); later epochs see ratio != 1 against the stored
    # epoch-1 log-probs: tokens get clipped and the loss moves (down: each epoch descends one objective)
    assert met["clip_ratio_low"] > 0 and met["clip_ratio_high"] > 0
    assert met["loss_last_epoch"] < met["loss"]
    assert len(met["grad_norm_per_epoch"]) == 3
    st = json.loads((tmp_path / "e2" / "trainer_state.json").read_text())
    assert st["optimizer_steps"] == 3 and st["global_step"] == 1
    run_lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(run_lines) == 1 and json.loads(run_lines[0])["loss"] == met["loss"]


def test_lora_grads_through_nvfp4_equal_dequantize_then_matmul():
    import torch.nn.functional as F
    from qerl_kernels import reference

    from qerl_cli.layers.linear import QLinear
    from qerl_cli.layers.lora import LoRALinear

    torch.manual_seed(0)
    w = torch.randn(48, 64) * 0.1
    packed, scale, gscale = reference.quantize(w)
    base = QLinear(64, 48, bias=True, quantized=True)
    base.weight_packed, base.weight_scale, base.weight_global_scale = packed, scale, gscale.reshape(1)
    base.bias = torch.nn.Parameter(torch.randn(48) * 0.1, requires_grad=False)
    lora = LoRALinear(base, r=4, alpha=8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        lora.lora_B.normal_()
    x = torch.randn(3, 5, 64, requires_grad=True)
    g = torch.randn(3, 5, 48)
    (lora(x) * g).sum().backward()
    got = (lora.lora_A.grad.clone(), lora.lora_B.grad.clone(), x.grad.clone())

    wd = reference.dequantize(packed, scale, gscale, torch.float32)
    a = lora.lora_A.detach().clone().requires_grad_(True)
    b = lora.lora_B.detach().clone().requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    y = F.linear(x2, wd, base.bias) + (x2 @ a.t()) @ b.t() * (8 / 4)
    (y * g).sum().backward()
    for u, v in zip(got, (a.grad, b.grad, x2.grad)):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


# ---- bad input: clear errors, nothing written -----------------------------------------------------
def _assert_nothing_written(out: Path):
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}*"))


def test_shards_from_another_base_name_both_hashes(models, tmp_path):
    sh = make_shard(tmp_path / "sh", "f" * 64)
    with pytest.raises(LineageError, match=r"ffffffffffff.*" + models["qhash"][:12]):
        train_step(_cfg(models["q"], [sh], tmp_path / "out"))
    _assert_nothing_written(tmp_path / "out")


def test_shards_sampled_with_another_adapter_are_refused(models, tmp_path):
    sh = make_shard(tmp_path / "sh", models["qhash"], adapter_hash="a" * 64)
    with pytest.raises(LineageError, match="sampled with adapter aaaaaaaaaaaa.*fresh start"):
        train_step(_cfg(models["q"], [sh], tmp_path / "out"))
    _assert_nothing_written(tmp_path / "out")


def test_mixed_schema_versions_and_single_completion_groups(models, tmp_path):
    sh = make_shard(tmp_path / "sh", models["qhash"])
    lines = (sh / shard_name(0, 1)).read_text().splitlines()
    old = json.loads(lines[-1])
    old["schema_version"] = 0  # not a version: refused with its line
    (sh / shard_name(0, 1)).write_text("\n".join(lines[:-1] + [json.dumps(old)]) + "\n")
    with pytest.raises(BadInputError, match=rf"{shard_name(0, 1)}:{len(lines)}: schema_version 0 is not a version"):
        train_step(_cfg(models["q"], [sh], tmp_path / "out"))
    sh2 = make_shard(tmp_path / "sh2", models["qhash"], per_group=4)
    lines = (sh2 / shard_name(0, 1)).read_text().splitlines()
    (sh2 / shard_name(0, 1)).write_text("\n".join(lines[:-3]) + "\n")  # last group keeps one completion
    with pytest.raises(BadInputError, match="group 's0-g2' has only one completion"):
        train_step(_cfg(models["q"], [sh2], tmp_path / "out"))
    _assert_nothing_written(tmp_path / "out")


def test_adapter_that_does_not_fit(models, tmp_path):
    sh = make_shard(tmp_path / "sh", models["qhash"])
    train_step(_cfg(models["q"], [sh], tmp_path / "a1", lora_rank=4))
    a1 = tmp_path / "a1"
    sh1 = make_shard(tmp_path / "sh1", models["qhash"], adapter_hash=adapter_hash(a1), step=1)
    with pytest.raises(BadInputError, match="--lora-rank 8 does not fit --adapter"):
        train_step(_cfg(models["q"], [sh1], tmp_path / "out", adapter=a1, lora_rank=8))
    with pytest.raises(BadInputError, match="is the --adapter directory"):
        train_step(_cfg(models["q"], [sh1], a1, adapter=a1))
    # tensors of the wrong shape inside the adapter itself
    from safetensors.torch import load_file, save_file

    w = load_file(str(a1 / "adapter_model.safetensors"))
    key = next(k for k in w if "q_proj.lora_A" in k)
    w[key] = torch.zeros(4, 32)
    save_file(w, str(a1 / "adapter_model.safetensors"))
    with pytest.raises(BadInputError, match=r"q_proj.lora_A.weight.*shape \(4, 32\)"):
        train_step(_cfg(models["q"], [make_shard(tmp_path / "sh2", models["qhash"], adapter_hash=adapter_hash(a1), step=1)],
                        tmp_path / "out", adapter=a1))
    _assert_nothing_written(tmp_path / "out")


def test_nan_loss_names_step_and_microbatch(models, tmp_path, monkeypatch):
    # The shard reader refuses NaN inputs, so poison the loss of the third micro-batch directly
    # (what an fp overflow in the forward would produce).
    import qerl_cli.train_step as ts

    real, calls = ts.policy_loss, []

    def poisoned(*a, **k):
        loss, per_tok, st = real(*a, **k)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 3 else loss), per_tok, st

    monkeypatch.setattr(ts, "policy_loss", poisoned)
    sh = make_shard(tmp_path / "sh", models["qhash"])
    with pytest.raises(NumericalError, match=r"non-finite loss at step 0 \(epoch 1\), micro-batch 2"):
        train_step(_cfg(models["q"], [sh], tmp_path / "out"))
    _assert_nothing_written(tmp_path / "out")


def test_out_of_memory_says_which_flag_to_lower(models, tmp_path, monkeypatch):
    import qerl_cli.train_step as ts

    def boom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(ts, "microbatch_logprobs", boom)
    sh = make_shard(tmp_path / "sh", models["qhash"])
    with pytest.raises(OutOfMemoryError, match="lower --micro-batch-tokens \\(now 40\\)"):
        train_step(_cfg(models["q"], [sh], tmp_path / "out"))
    _assert_nothing_written(tmp_path / "out")


def test_baseline_bf16_refuses_a_quantized_model(models, tmp_path):
    sh = make_shard(tmp_path / "sh", models["qhash"])
    with pytest.raises(BadInputError, match="--baseline bf16 expects a plain 16-bit"):
        train_step(_cfg(models["q"], [sh], tmp_path / "out", baseline="bf16"))


# ---- CLI ------------------------------------------------------------------------------------------
def test_cli_runs_a_step_and_reports_errors(models, tmp_path):
    from qerl_cli.cli import app

    runner = CliRunner()
    help_out = runner.invoke(app, ["train-step", "--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})
    assert help_out.exit_code == 0
    for flag in ("--micro-batch-tokens", "--tis-cap", "--clip-eps-high", "--lora-targets", "--epochs", "--beta"):
        assert flag in help_out.output
    sh = make_shard(tmp_path / "sh", models["qhash"])
    res = runner.invoke(app, ["train-step", "--model", str(models["q"]), "--shards", str(sh), "--out",
                              str(tmp_path / "a1"), "--lora-rank", "4", "--lora-targets", "q_proj,v_proj",
                              "--micro-batch-tokens", "64", "--quiet"])
    assert res.exit_code == 0, res.output
    cfg = json.loads((tmp_path / "a1" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and sorted(cfg["target_modules"]) == ["q_proj", "v_proj"]
    # the result line on stdout, as every other stage's (it went to stderr; audit)
    again = runner.invoke(app, ["train-step", "--model", str(models["q"]), "--shards", str(sh), "--out",
                                str(tmp_path / "a1"), "--lora-rank", "4", "--lora-targets", "q_proj,v_proj",
                                "--micro-batch-tokens", "64"])
    assert again.exit_code == 0 and again.stdout.startswith("already done: "), (again.stdout, again.stderr)
    res = runner.invoke(app, ["train-step", "--model", str(models["q"]), "--shards", str(sh), "--out",
                              str(tmp_path / "a1b"), "--lora-rank", "4", "--micro-batch-tokens", "64"])
    assert res.exit_code == 0 and "step 0 -> " in res.stdout and "step 0 -> " not in res.stderr, res.stderr
    bad = runner.invoke(app, ["train-step", "--model", str(models["q"]), "--shards", str(sh), "--out",
                              str(tmp_path / "a2"), "--loss", "ppo"])
    assert bad.exit_code == 2 and "--loss must be one of" in bad.output


def test_train_norms_saves_and_resumes_norm_weights(models, tmp_path):
    from safetensors.torch import load_file

    q, h = models["q"], models["qhash"]
    sh = make_shard(tmp_path / "sh", h, seed=6)
    train_step(_cfg(q, [sh], tmp_path / "a1", train_norms=True, lr=1e-2, lora_rank=4))
    norms = load_file(str(tmp_path / "a1" / "norms.safetensors"))
    assert "model.layers.0.input_layernorm.weight" in norms and "model.norm.weight" in norms
    src = load_file(str(next(q.glob("*.safetensors"))))
    moved = max(float((norms[k] - src[k].float()).abs().max()) for k in norms)
    assert moved > 1e-4  # the norm weights trained (fp32 master: bf16 would round lr-sized steps away)
    a1 = tmp_path / "a1"
    sh1 = make_shard(tmp_path / "sh1", h, adapter_hash=adapter_hash(a1), step=1, seed=7)
    with pytest.raises(BadInputError, match="has trained norm weights"):
        train_step(_cfg(q, [sh1], tmp_path / "a2", adapter=a1))
    train_step(_cfg(q, [sh1], tmp_path / "a2", adapter=a1, train_norms=True, lr=1e-2))
    assert (tmp_path / "a2" / "norms.safetensors").is_file()
    # The policy is the adapter and its norms: rollout and eval load them (load_model), merge writes them.
    from qerl_cli.merge import MergeConfig, merge
    from qerl_cli.models import load_model

    model = load_model(q, device="cpu", dtype=torch.float32, adapter_dir=a1)
    assert torch.equal(model.model.norm.weight.detach(), norms["model.norm.weight"])
    m = merge(MergeConfig(q, a1, tmp_path / "merged"), progress=False)
    merged = {}
    for f in sorted((tmp_path / "merged").glob("*.safetensors")):
        merged.update(load_file(str(f)))
    for k in ("model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(merged[k], norms[k].to(merged[k].dtype)), k
    assert m["inputs"]["adapter_norms"]


def test_trained_norms_continue_from_their_fp32_values_in_bf16(models, tmp_path):
    # load_model rounds the saved fp32 norms to the model dtype; in bf16 every reload threw away the
    # last step's lr-sized change, so chained steps never moved the norms. An lr = 0 step must keep
    # them bit for bit.
    from safetensors.torch import load_file

    q, h = models["q"], models["qhash"]
    train_step(_cfg(q, [make_shard(tmp_path / "sh0", h, seed=6)], tmp_path / "a1", train_norms=True, lr=1e-3,
                    lora_rank=4, dtype="bf16", device="cpu"))
    a1 = tmp_path / "a1"
    sh1 = make_shard(tmp_path / "sh1", h, adapter_hash=adapter_hash(a1), step=1, seed=7)
    train_step(_cfg(q, [sh1], tmp_path / "a2", adapter=a1, train_norms=True, lr=0.0, dtype="bf16", device="cpu"))
    n1, n2 = load_file(str(a1 / "norms.safetensors")), load_file(str(tmp_path / "a2" / "norms.safetensors"))
    assert any(not torch.equal(v, v.bfloat16().float()) for v in n1.values())  # not representable in bf16
    assert all(torch.equal(n1[k], n2[k]) for k in n1)


def test_lora_target_order_is_not_a_new_step(models, tmp_path):
    sh = make_shard(tmp_path / "sh", models["qhash"])
    first = train_step(_cfg(models["q"], [sh], tmp_path / "a", lora_targets=("q_proj", "v_proj")))
    again = train_step(_cfg(models["q"], [sh], tmp_path / "a", lora_targets=("v_proj", "q_proj")))
    assert again == dict(first, already_done=True)  # done


def test_train_step_refuses_out_over_its_inputs_and_bad_numbers(models, tmp_path):
    import shutil

    q, h = models["q"], models["qhash"]
    sh = make_shard(tmp_path / "sh", h, seed=6)
    qc = tmp_path / "qc"
    shutil.copytree(q, qc)
    for out, what in ((sh, "--shards"), (qc, "--model"), (tmp_path, "--model")):
        with pytest.raises(BadInputError, match=f"overlaps {what}"):
            train_step(_cfg(qc, [sh], out, force=True))
    assert (qc / "config.json").is_file() and list(Path(sh).glob("*.jsonl"))  # nothing replaced
    for kw, flag in ((dict(lora_rank=0), "--lora-rank"), (dict(lora_alpha=0.0), "--lora-alpha"),
                     (dict(min_lr_ratio=2.0), "--min-lr-ratio"), (dict(warmup_steps=-1), "--warmup-steps"),
                     (dict(total_steps=0), "--total-steps"), (dict(max_grad_norm=-1.0), "--max-grad-norm"),
                     # total <= warmup left the LR at its peak forever and dropped --min-lr-ratio (audit)
                     (dict(warmup_steps=5, total_steps=5), "--total-steps"),
                     (dict(logits_chunk_tokens=0), "--logits-chunk-tokens"), (dict(lora_dropout=1.5), "--lora-dropout"),
                     # NaN / inf passed "< 0" checks: a NaN beta silently dropped the KL term, an inf weight
                     # decay wrote an all-NaN adapter with exit 0
                     (dict(weight_decay=float("inf")), "--weight-decay"), (dict(beta=float("nan")), "--beta"),
                     (dict(beta=float("inf")), "--beta"), (dict(tis_cap=float("nan")), "--tis-cap"),
                     (dict(clip_eps_high=float("nan")), "--clip-eps-high"),
                     # finite values past float32's range reached torch as clamp bounds: a traceback (review)
                     (dict(tis_cap=1e39), "--tis-cap"), (dict(clip_eps_high=1e39), "--clip-eps-high"),
                     (dict(max_completion_length=0, loss="dr_grpo"), "--max-completion-length"),
                     (dict(max_completion_length=-5), "--max-completion-length"),
                     # past fp32's range AdamW's update raised after the whole step: a traceback, exit 1 (audit)
                     (dict(lr=1e38), "--lr/--weight-decay"), (dict(lr=1e-5, weight_decay=1e44), "--lr/--weight-decay"),
                     # a directory was found only after --out was written: a traceback, exit 1 (audit)
                     (dict(metrics_file=tmp_path), "--metrics-file"),
                     (dict(metrics_file=qc / "config.json" / "m.jsonl"), "--metrics-file"),
                     (dict(metrics_file=qc / "config.json" / "run" / "m.jsonl"), "--metrics-file")):
        with pytest.raises(BadInputError, match=flag):
            train_step(_cfg(q, [sh], tmp_path / "bad", **kw))
    assert not (tmp_path / "bad").exists()


def test_missing_shards_of_a_sharded_step_are_named():
    from qerl_cli.shards import missing_shards

    assert missing_shards([Path("a/shard-00000-of-00003.jsonl"), Path("b/shard-00002-of-00003.jsonl")]) == [
        "shard-00001-of-00003.jsonl"]
    assert missing_shards([Path("a/shard-00000-of-00002.jsonl"), Path("b/shard-00001-of-00002.jsonl")]) == []
    assert missing_shards([Path("mine.jsonl")]) == []


@pytest.mark.parametrize("train_norms", [False, True], ids=["lora", "lora+norms"])
def test_kl_to_base_and_resumed_policy_match_peft_reference(models, tmp_path, train_norms):
    """Step 1 with --beta: the policy is base + adapter (+ its trained norms; checked through PEFT on
    the dequantized weights), the KL reference is the base alone (LoRA off, the checkpoint's norms),
    and the loss is the formula."""
    import peft
    import transformers
    from safetensors.torch import load_file

    q, h, twin = models["q"], models["qhash"], models["twin"]
    sh0 = make_shard(tmp_path / "sh0", h, seed=8)
    train_step(_cfg(q, [sh0], tmp_path / "a1", lr=2e-2, lora_rank=4, max_grad_norm=0.0, train_norms=train_norms))
    a1 = tmp_path / "a1"
    sh1 = make_shard(tmp_path / "sh1", h, adapter_hash=adapter_hash(a1), step=1, seed=9)
    beta = 0.5
    got = train_step(_cfg(q, [sh1], tmp_path / "a2", adapter=a1, beta=beta, lr=2e-2, train_norms=train_norms))["metrics"]

    recs = read_records(sh1)
    base = _hf_token_logprobs(twin, recs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32)
    if train_norms:
        norms = load_file(str(a1 / "norms.safetensors"))
        assert not hf.load_state_dict(norms, strict=False).unexpected_keys
    pol_model = peft.PeftModel.from_pretrained(hf, a1)
    pol = []
    with torch.no_grad():
        for r in recs:
            p, c = r["prompt_token_ids"], r["completion_token_ids"]
            lsm = torch.log_softmax(pol_model(input_ids=torch.tensor([p + c])).logits[0].float() / r["sampling"]["temperature"], -1)
            pol.append([float(lsm[len(p) - 1 + t, tok]) for t, tok in enumerate(c)])
    kls = [math.exp(b - x) - (b - x) - 1 for (bl, _), pl in zip(base, pol) for b, x in zip(bl, pl)]
    assert max(kls) > 1e-4  # the adapter moved the policy away from the base
    assert got["kl"] == pytest.approx(sum(kls) / len(kls), rel=2e-3)
    groups = {}
    for r in recs:
        groups.setdefault(r["group_id"], []).append(r["reward"])
    total, n = 0.0, 0
    for r, pl, (bl, _) in zip(recs, pol, base):
        g = groups[r["group_id"]]
        a = (r["reward"] - statistics.mean(g)) / (statistics.stdev(g) + 1e-4)
        for x, s, b in zip(pl, r["logprobs"], bl):
            total += -a * min(math.exp(x - s), 2.0) + beta * (math.exp(b - x) - (b - x) - 1)
            n += 1
    assert got["loss"] == pytest.approx(total / n, rel=2e-4, abs=1e-6)


def test_tokens_outside_vocab_or_positions_are_named(models, tmp_path):
    sh = make_shard(tmp_path / "sh", models["qhash"], vocab=600)  # the model's vocabulary is 384
    with pytest.raises(BadInputError, match=r"shard-00000-of-00001.jsonl:\d+: record of group 's0-g\d' \(prompt 'p\d'\) has token id \d+, outside"):
        train_step(_cfg(models["q"], [sh], tmp_path / "out"))
    sh2 = make_shard(tmp_path / "sh2", models["qhash"])
    path = sh2 / shard_name(0, 1)
    lines = path.read_text().splitlines()
    rec = json.loads(lines[0])
    rec["prompt_token_ids"] = rec["prompt_token_ids"] * 200  # > 512 positions
    lines[0] = json.dumps(rec)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadInputError, match=r"shard-00000-of-00001.jsonl:1: record .* tokens, more than the 512 positions"):
        train_step(_cfg(models["q"], [sh2], tmp_path / "out"))
    _assert_nothing_written(tmp_path / "out")


def test_a_group_found_twice_is_refused_with_both_places(models, tmp_path):
    # A retried rollout job's second output dir (or a copy of a shard) would merge two samplings of
    # the same prompts into one group each: double weight, mixed group sizes. Refused, naming both.
    import shutil

    sh = make_shard(tmp_path / "sh", models["qhash"])
    shutil.copytree(sh, tmp_path / "retry")
    with pytest.raises(BadInputError, match=r"group 's0-g0' appears at .*retry/shard-00000-of-00001.jsonl:1 and again "
                                            r"at .*sh/shard-00000-of-00001.jsonl:1"):  # (read in path order)
        train_step(_cfg(models["q"], [sh, tmp_path / "retry"], tmp_path / "a"))
    assert not (tmp_path / "a").exists()
    train_step(_cfg(models["q"], [sh, sh], tmp_path / "a"))  # the same file named twice is read once


def test_an_empty_completion_alone_in_its_micro_batch_trains(models, tmp_path):
    # Shards from elsewhere may hold a completion of no tokens; alone in a micro-batch its loss has no
    # graph, and backward() raised torch's "element 0 of tensors does not require grad".
    from qerl_cli.shards import shard_name

    sh = make_shard(tmp_path / "sh", models["qhash"], seed=1, truncate_every=0)
    p = sh / shard_name(0, 1)
    lines = p.read_text().splitlines()
    rec = json.loads(lines[0])
    rec.update(completion_token_ids=[], logprobs=[], completion="")
    p.write_text("\n".join([json.dumps(rec), *lines[1:]]) + "\n")
    a = train_step(_cfg(models["q"], [sh], tmp_path / "a40", micro_batch_tokens=40))["metrics"]
    b = train_step(_cfg(models["q"], [sh], tmp_path / "a1", micro_batch_tokens=1))["metrics"]
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["micro_batches"] > a["micro_batches"]


def test_a_rerun_restores_the_metrics_line_a_kill_lost(models, tmp_path, monkeypatch):
    # Killed after the output was in place, before the --metrics-file append: every rerun is "already
    # done", so the step's line was lost for good. The rerun appends it, once.
    import qerl_cli.train.metrics as train_metrics  # where --metrics-file is appended (_append_metrics)

    sh = make_shard(tmp_path / "sh", models["qhash"])
    mf = tmp_path / "run" / "metrics.jsonl"
    real = train_metrics.append_jsonl

    def killed(path, record):
        if path == mf:
            raise KeyboardInterrupt  # stands in for the kill
        real(path, record)

    monkeypatch.setattr(train_metrics, "append_jsonl", killed)
    with pytest.raises(KeyboardInterrupt):
        train_step(_cfg(models["q"], [sh], tmp_path / "a", metrics_file=mf))
    assert (tmp_path / "a" / "manifest.json").is_file() and not mf.exists()
    monkeypatch.setattr(train_metrics, "append_jsonl", real)
    for _ in range(2):
        m = train_step(_cfg(models["q"], [sh], tmp_path / "a", metrics_file=mf))
    lines = [json.loads(x) for x in mf.read_text().splitlines()]
    assert lines == [m["metrics"]]


def test_a_redone_step_replaces_its_metrics_line(models, tmp_path):
    # FORCE=1 in grpo.sh redoes a step with --force: the file kept both lines, so "one line per step"
    # read two runs. The redo replaces the step's line; other steps' lines and a torn line stay.
    sh = make_shard(tmp_path / "sh", models["qhash"])
    mf = tmp_path / "run" / "metrics.jsonl"
    mf.parent.mkdir()
    mf.write_text(json.dumps({"step": 7, "loss": 1.0}) + "\n" + '{"step": 1, "lo')
    train_step(_cfg(models["q"], [sh], tmp_path / "a", metrics_file=mf))
    m = train_step(_cfg(models["q"], [sh], tmp_path / "a", metrics_file=mf, lr=2e-3, force=True))
    lines = mf.read_text().splitlines()
    assert lines[:2] == [json.dumps({"step": 7, "loss": 1.0}), '{"step": 1, "lo']
    assert [json.loads(x) for x in lines[2:]] == [m["metrics"]] and m["metrics"]["lr"] == pytest.approx(2e-3)


def test_adapter_names_its_base_by_absolute_path(models, tmp_path, monkeypatch):
    # PEFT resolves base_model_name_or_path against its own working directory: "runs/x/base" as
    # written for a relative --model could not be found from anywhere else.
    sh = make_shard(tmp_path / "sh", models["qhash"])
    q = Path(models["q"]).resolve()
    monkeypatch.chdir(q.parent)
    train_step(_cfg(Path(q.name), [sh], tmp_path / "a"))
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(q)


def test_a_smaller_micro_batch_resumes_a_run(models, tmp_path):
    # After an out-of-memory the advice is a smaller --micro-batch-tokens; the finished steps must stay
    # "already done" (the sizes only reorder float sums), except where they change the math.
    import json as _json

    from qerl_cli.errors import OutputExistsError
    from qerl_cli.hashing import sha256_json

    sh = make_shard(tmp_path / "sh", models["qhash"])
    first = train_step(_cfg(models["q"], [sh], tmp_path / "a", micro_batch_tokens=64, logits_chunk_tokens=64))
    again = train_step(_cfg(models["q"], [sh], tmp_path / "a", micro_batch_tokens=16, logits_chunk_tokens=8))
    assert again == dict(first, already_done=True)
    train_step(_cfg(models["q"], [sh], tmp_path / "b", loss="bnpo", micro_batch_tokens=64))
    with pytest.raises(OutputExistsError):  # bnpo normalises per micro-batch: a different step
        train_step(_cfg(models["q"], [sh], tmp_path / "b", loss="bnpo", micro_batch_tokens=16))
    train_step(_cfg(models["q"], [sh], tmp_path / "c", lora_dropout=0.1, micro_batch_tokens=64))
    with pytest.raises(OutputExistsError):  # dropout masks are drawn per micro-batch
        train_step(_cfg(models["q"], [sh], tmp_path / "c", lora_dropout=0.1, micro_batch_tokens=16))
    # a step an older qerl finished (its fingerprint counted every size) stays done
    cfg = _cfg(models["q"], [sh], tmp_path / "a", micro_batch_tokens=64, logits_chunk_tokens=64)
    man = _json.loads((tmp_path / "a" / "manifest.json").read_text())
    man["fingerprint"] = sha256_json({"stage": "train-step", "config": cfg.legacy_fingerprint_config(),
                                      "inputs": man["inputs"]})
    (tmp_path / "a" / "manifest.json").write_text(_json.dumps(man))
    assert train_step(cfg)["fingerprint"] == man["fingerprint"]


def test_lora_targets_repeated_or_comma_joined_and_never_empty(models, tmp_path, monkeypatch):
    import qerl_cli.train_step as ts
    from qerl_cli.cli import app

    seen = []
    monkeypatch.setattr(ts, "train_step", lambda cfg: seen.append(cfg.lora_targets) or {})
    base = ["train-step", "--model", str(models["q"]), "--shards", str(tmp_path), "--out", str(tmp_path / "a")]
    for flags in (["--lora-targets", "q_proj", "--lora-targets", "v_proj"], ["--lora-targets", "q_proj,v_proj"]):
        assert CliRunner().invoke(app, base + flags).exit_code == 0
    assert seen == [("q_proj", "v_proj")] * 2  # a repeated flag once kept only its last value
    bad = CliRunner().invoke(app, base + ["--lora-targets", ","])
    assert bad.exit_code == 2 and "names no Linear" in bad.output


def test_a_record_without_prompt_tokens_is_named_before_anything_loads(models, tmp_path, monkeypatch):
    # Found later by the one rank that collated it, the other torchrun ranks died in gloo.
    import qerl_cli.train_step as ts
    from qerl_cli.shards import shard_name

    sh = make_shard(tmp_path / "sh", models["qhash"])
    p = sh / shard_name(0, 1)
    lines = p.read_text().splitlines()
    rec = json.loads(lines[3])
    rec["completion_token_ids"] = rec["prompt_token_ids"] + rec["completion_token_ids"]
    rec["logprobs"] = [-1.0] * len(rec["prompt_token_ids"]) + rec["logprobs"]
    rec["prompt_token_ids"] = []
    lines[3] = json.dumps(rec)
    p.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(ts, "_load", lambda *a, **k: pytest.fail("loaded the model before checking the shards"))
    with pytest.raises(BadInputError, match=r"shard-00000-of-00001.jsonl:4: record of group 's0-g0' has no prompt"):
        train_step(_cfg(models["q"], [sh], tmp_path / "a"))


def test_noise_record_in_the_contracts_form_draws_for_the_records_step(models, tmp_path):
    # stages.md names noise {sigma, seed}; qerl's rollout adds the step. A record without it made
    # train-step fail with KeyError: 'step' (2026-11-26 audit); it is the record's own step.
    from qerl_cli.train_step import read_step

    full = make_shard(tmp_path / "a", models["qhash"], step=5, noise={"sigma": 0.01, "seed": 3, "step": 5})
    short = make_shard(tmp_path / "b", models["qhash"], step=5, noise={"sigma": 0.01, "seed": 3})
    got = read_step(_cfg(models["q"], [short], tmp_path / "o"))
    assert got.noise["step"] == 5 and got.noise["sigma"] == 0.01 and got.noise["seed"] == 3
    assert read_step(_cfg(models["q"], [full], tmp_path / "o")).noise["step"] == 5


def test_noise_records_in_both_forms_for_one_step_are_one_noise(models, tmp_path):
    # {sigma, seed} is drawn for the record's step, so beside qerl's {sigma, seed, step} of that step it names
    # the same vectors: train-step refused the mix as "shards mix AQN noise records" (review, session 52).
    from qerl_cli.shards import read_records, write_records
    from qerl_cli.train_step import read_step

    sh = make_shard(tmp_path / "a", models["qhash"], step=5, noise={"sigma": 0.01, "seed": 3, "step": 5})
    f = sh / shard_name(0, 1)
    recs = read_records(f)
    for r in recs[len(recs) // 2:]:
        r["noise"] = {"sigma": 0.01, "seed": 3}
    f.unlink()
    write_records(f, recs)
    got = read_step(_cfg(models["q"], [sh], tmp_path / "o"))
    assert (got.noise["sigma"], got.noise["seed"], got.noise["step"]) == (0.01, 3, 5)
    for r in recs[len(recs) // 2:]:  # another step's noise is still another noise
        r["noise"] = {"sigma": 0.01, "seed": 3, "step": 4}
    f.unlink()
    write_records(f, recs)
    with pytest.raises(BadInputError, match="shards mix AQN noise records"):
        read_step(_cfg(models["q"], [sh], tmp_path / "o"))


def test_the_metrics_line_holds_the_names_the_docs_list(models, tmp_path):
    # docs/train-step.md's "Metrics" paragraph is the metrics file's schema: plots and users read these names.
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "train-step.md").read_text()
    para = text.split("### Metrics (one JSON line per step)")[1].split("\n## ")[0]
    documented, full = set(), ""
    for tok in re.findall(r"`([a-z_][a-z0-9_/]*)`", para):  # `is_ratio_mean` / `_min`, `completion_length_mean/min/max`
        first, *more = tok.split("/")
        full = full.rsplit("_", 1)[0] + first if first.startswith("_") else first
        documented |= {full} | {full.rsplit("_", 1)[0] + "_" + m for m in more}
    sh = make_shard(tmp_path / "sh", models["qhash"], seed=3)
    got = train_step(_cfg(models["q"], [sh], tmp_path / "a", epochs=2, beta=0.1))["metrics"]
    documented.discard("global_step")  # "`step` (the input adapter's `global_step`)": trainer_state.json's field
    assert set(got) == documented, (set(got) - documented, documented - set(got))
    plain = train_step(_cfg(models["q"], [sh], tmp_path / "b", tis_cap=0))["metrics"]
    assert set(got) - set(plain) == {"grad_norm_per_epoch", "lr_per_epoch", "is_capped_fraction"}
    assert plain["kl"] is None and plain["peak_gpu_memory_gib"] is None  # null on CPU without --beta, as documented


def test_result_line_survives_metrics_that_are_not_numbers():
    # a reward of 1.7e308 overflowed the mean to inf, stored as None; formatting it failed after --out was
    # written (traceback, exit 1; audit)
    from qerl_cli.train_step import _result_numbers

    line = _result_numbers({"loss": 0.5, "reward_mean": None, "grad_norm": 1.0, "tokens_per_s": 10.0})
    assert line == "loss 0.5, reward n/a, grad norm 1, 10 tok/s"


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_callers_grad_mode_and_rng_are_not_the_steps(models, tmp_path, mode):
    # From Python, inside an eval helper's no_grad / inference_mode block: the step still trains (it wrote
    # an untrained adapter as done, grad norm 0), and the caller's RNG stream goes on as if it had not run.
    q, h = models["q"], models["qhash"]
    sh = make_shard(tmp_path / "sh", h, seed=5)
    normal = train_step(_cfg(q, [sh], tmp_path / "plain", lr=1e-3))
    torch.manual_seed(123)
    expect = torch.rand(3)
    torch.manual_seed(123)
    with getattr(torch, mode)():
        got = train_step(_cfg(q, [sh], tmp_path / "inside", lr=1e-3))
    assert torch.equal(torch.rand(3), expect)
    assert torch.is_grad_enabled()
    assert got["metrics"]["grad_norm"] == normal["metrics"]["grad_norm"] > 0
    assert _read_bytes(tmp_path / "inside") == _read_bytes(tmp_path / "plain")


def test_shards_sampled_with_other_trained_norms_are_refused(models, tmp_path):
    # The adapter's hash covers its PEFT files, not norms.safetensors: shards sampled with other norm
    # weights trained as if on-policy (is_ratio_min 0.0004 in the audit). Records name the norms now.
    from qerl_cli.adapters import norms_input

    q, h = models["q"], models["qhash"]
    train_step(_cfg(q, [make_shard(tmp_path / "sh0", h, seed=6)], tmp_path / "a1", train_norms=True, lr=1e-2,
                    lora_rank=4))
    a1 = tmp_path / "a1"
    mine = norms_input(a1)["adapter_norms"]

    def shard(name, **policy):
        d = make_shard(tmp_path / name, h, adapter_hash=adapter_hash(a1), step=1, seed=7)
        f = d / shard_name(0, 1)
        recs = [json.loads(x) for x in f.read_text().splitlines()]
        for r in recs:
            r["policy"].update(policy)
        f.write_text("".join(json.dumps(r) + "\n" for r in recs))
        return d

    for name, policy in (("none", {"norms": None}), ("other", {"norms": "0" * 64})):
        with pytest.raises(LineageError, match="norm weights"):
            train_step(_cfg(q, [shard(name, **policy)], tmp_path / f"x-{name}", adapter=a1, train_norms=True))
        assert not (tmp_path / f"x-{name}").exists()
    train_step(_cfg(q, [shard("same", norms=mine)], tmp_path / "ok", adapter=a1, train_norms=True))
    train_step(_cfg(q, [shard("older")], tmp_path / "ok-older", adapter=a1, train_norms=True))  # no "norms": not known


def test_library_results_say_already_done_and_configs_take_what_the_cli_takes(models, tmp_path):
    from qerl_cli.merge import MergeConfig

    q, h = models["q"], models["qhash"]
    sh = make_shard(tmp_path / "sh", h, seed=8)
    first = train_step(_cfg(q, [sh], tmp_path / "a"))
    again = train_step(_cfg(q, [sh], tmp_path / "a"))
    assert first["already_done"] is False and again["already_done"] is True
    assert again["metrics"] == first["metrics"]
    with pytest.raises(BadInputError, match="names no Linear"):  # trained all seven, recorded as []
        _cfg(q, [sh], tmp_path / "b", lora_targets=())
    assert MergeConfig(q, tmp_path / "a", tmp_path / "m", max_shard_size="2GB").max_shard_size == 2_000_000_000


def test_shards_named_in_another_order_are_the_same_step(models, tmp_path, monkeypatch):
    # --shards b a was another step than --shards a b (exit 4 over the finished one), since the read order
    # changes float sums; the files are now read in path order, whatever order they were named in.
    import qerl_cli.train.inputs as train_inputs  # where read_step orders the files (_in_path_order)
    from qerl_cli.shards import write_records

    q, h = models["q"], models["qhash"]
    a, b = make_shard(tmp_path / "a", h, seed=1), make_shard(tmp_path / "b", h, seed=2)
    recs = read_records(b)
    for r in recs:
        r["group_id"] = "b-" + r["group_id"]
    (b / shard_name(0, 1)).unlink()
    write_records(b / shard_name(0, 1), recs)
    train_step(_cfg(q, [a, b], tmp_path / "o1"))
    assert train_step(_cfg(q, [b, a], tmp_path / "o1"))["already_done"]
    train_step(_cfg(q, [b, a], tmp_path / "o2"))
    name = "adapter_model.safetensors"
    assert (tmp_path / "o1" / name).read_bytes() == (tmp_path / "o2" / name).read_bytes()
    # a step older qerl finished over --shards b a (read and hashed in that order) stays done
    monkeypatch.setattr(train_inputs, "_in_path_order", lambda files: files)
    train_step(_cfg(q, [b, a], tmp_path / "o3"))
    monkeypatch.undo()
    # read as named, b's file first (else this run was an ordinary one, and "stays done" tested nothing)
    assert Path(json.loads((tmp_path / "o3" / "trainer_state.json").read_text())["last_shards"][0]).parent == b.resolve()
    assert train_step(_cfg(q, [b, a], tmp_path / "o3"))["already_done"]
    assert not train_step(_cfg(q, [a, b], tmp_path / "o2", force=True))["already_done"]  # --force still redoes it


def test_a_step_whose_every_group_has_equal_rewards_warns_of_no_learning_signal(models, tmp_path):
    """All-0 rewards (a reward that scores nothing, the reference in a column rollout did not read) printed "loss 0,
    grad norm 0" and wrote an adapter without a word; only `zero_variance_groups: 1.0` in the metrics said why."""
    import warnings

    from qerl_cli.errors import QerlWarning
    from qerl_cli.shards import write_records

    mixed = make_shard(tmp_path / "mixed", models["qhash"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", QerlWarning)  # groups 0 and 2 differ: no warning
        train_step(_cfg(models["q"], [mixed], tmp_path / "a0"))
    flat = tmp_path / "flat"
    flat.mkdir()
    write_records(flat / shard_name(0, 1), [dict(r, reward=0.0, rewards={"r": 0.0}) for r in read_records(mixed)])
    with pytest.warns(QerlWarning, match=r"no learning signal: in all 3 groups of this step all 12 rewards are 0, so "
                                         r"every advantage is 0.*the reward.*--answer-key.*--num-generations"):
        m = train_step(_cfg(models["q"], [flat], tmp_path / "a1"))
    assert m["metrics"]["zero_variance_groups"] == 1.0 and m["metrics"]["loss"] == 0
