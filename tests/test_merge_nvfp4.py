"""`qerl merge` from an NVFP4 base: bf16 output equals qerl's unmerged forward; --dtype nvfp4 error bound."""

import json
import warnings

import pytest
import torch
from qerl_kernels.reference import dequantize
from safetensors.torch import load_file

from qerl_cli.errors import QerlWarning
from qerl_cli.hashing import model_hash
from qerl_cli.merge import MergeConfig, merge
from qerl_cli.quantize import QuantizeConfig, quantize
from tests.helpers import make_tiny_hf_model
from tests.test_merge import IDS, hf_logits, make_peft_adapter


def qerl_logits(model_dir, adapter_dir, ids):
    """The unmerged forward: qerl's own decoder, NVFP4 base + LoRA wrapper (not merge's code)."""
    from qerl_cli.models import load_model

    model = load_model(model_dir, device="cpu", dtype=torch.float32, adapter_dir=adapter_dir)
    with torch.no_grad():
        return model.compute_logits(model.forward_train(ids, torch.ones_like(ids)))


@pytest.fixture(scope="module")
def qpair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mq")
    src = make_tiny_hf_model(tmp, arch="qwen2", hidden=64, layers=2)
    qdir = tmp / "q"
    quantize(QuantizeConfig(src=src, out=qdir, device="cpu", progress=False))
    adapter = make_peft_adapter(src, tmp / "adapter", base_hash=model_hash(qdir))
    return src, qdir, adapter


def test_bf16_merge_of_nvfp4_base_matches_unmerged_forward(qpair, tmp_path):
    _, qdir, adapter = qpair
    m = merge(MergeConfig(qdir, adapter, tmp_path / "m"), progress=False)
    s = m["summary"]
    assert s["base_quantized"] and s["dequantized_modules"] == 14 and s["lineage"] == "verified"
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert "quantization_config" not in cfg
    ref = qerl_logits(qdir, adapter, IDS)
    plain = qerl_logits(qdir, None, IDS)
    got = hf_logits(tmp_path / "m", IDS)
    err = (got - ref).abs().max().item()
    assert (ref - plain).abs().max().item() > 20 * err
    assert err < 2e-2 * ref.abs().max().item()


def test_nvfp4_merge_is_quantize_of_bf16_merge_with_bounded_error(qpair, tmp_path):
    _, qdir, adapter = qpair
    mb = tmp_path / "bf16"
    merge(MergeConfig(qdir, adapter, mb), progress=False)
    m = merge(MergeConfig(qdir, adapter, tmp_path / "fp4", dtype="nvfp4"), progress=False)
    out = tmp_path / "fp4"
    rq = m["summary"]["requantization"]
    assert rq["quantized_linears"] == 14
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    assert (out / "tokenizer.json").exists()

    # The same bytes `qerl quantize` writes for the merged bf16 checkpoint (one code path).
    again = tmp_path / "requant"
    quantize(QuantizeConfig(src=mb, out=again, device="cpu", progress=False))
    a, b = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn else a[k],
                           b[k].view(torch.uint8) if b[k].dtype == torch.float8_e4m3fn else b[k]), k
    # q/k/v share one global scale, gate/up another (vLLM fuses them).
    pre = "model.layers.0"
    gq = {a[f"{pre}.self_attn.{p}_proj.weight_global_scale"].item() for p in "qkv"}
    gm = {a[f"{pre}.mlp.{p}_proj.weight_global_scale"].item() for p in ("gate", "up")}
    assert len(gq) == 1 and len(gm) == 1

    # The reported error is the relative Frobenius error against the merged bf16 weights.
    merged = load_file(mb / "model.safetensors")
    errs = {}
    for name in merged:
        if name.endswith("_proj.weight"):
            mod = name.removesuffix(".weight")
            w = merged[name].float()
            deq = dequantize(a[f"{mod}.weight_packed"], a[f"{mod}.weight_scale"], a[f"{mod}.weight_global_scale"],
                             dtype=torch.float32)
            errs[mod] = ((deq - w).norm() / w.norm()).item()
    assert max(errs.values()) == pytest.approx(rq["rel_err_max"], abs=1e-5)
    assert sum(errs.values()) / len(errs) == pytest.approx(rq["rel_err_mean"], abs=1e-5)
    # E2M1 with a per-16 fp8 scale: worst-case rounding is 1/6 of a block's max per element
    # (between 4 and 6); Gaussian weights land near 0.1 in Frobenius norm.
    assert 0.02 < rq["rel_err_max"] < 0.17

    # End to end: the FP4 checkpoint's logits stay within the same order as the base's own
    # quantization error of the unmerged (NVFP4 base + adapter) forward.
    ref = qerl_logits(qdir, adapter, IDS)
    got = qerl_logits(out, None, IDS)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 0.25, rel


def test_modelopt_base_merges_to_the_same_weights(qpair, tmp_path):
    import shutil

    src, qdir, adapter = qpair
    mo = tmp_path / "modelopt"
    quantize(QuantizeConfig(src=src, out=mo, format="modelopt", device="cpu", progress=False))
    plain_adapter = tmp_path / "ad"
    shutil.copytree(adapter, plain_adapter, ignore=shutil.ignore_patterns("trainer_state.json"))
    merge(MergeConfig(qdir, adapter, tmp_path / "from-ct"), progress=False)
    m = merge(MergeConfig(mo, plain_adapter, tmp_path / "from-mo"), progress=False)
    assert m["summary"]["dequantized_modules"] == 14
    assert not (tmp_path / "from-mo" / "hf_quant_config.json").exists()
    a = load_file(tmp_path / "from-ct" / "model.safetensors")
    b = load_file(tmp_path / "from-mo" / "model.safetensors")
    assert a.keys() == b.keys()
    # With its trainer state the adapter names the compressed-tensors base: the error says how to go on.
    from qerl_cli.errors import LineageError

    with pytest.raises(LineageError) as e:
        merge(MergeConfig(mo, adapter, tmp_path / "from-mo-2"), progress=False)
    assert "ModelOpt quantization of the same source" in e.value.hint and "--allow-base-mismatch" in e.value.hint
    for k in a:
        # ModelOpt multiplies by 1/global where compressed-tensors divides by it: the fp32 results
        # differ in the last bit at most, which bf16 rounding almost always hides
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=2**-7, atol=0, msg=k)
        assert (a[k] == b[k]).float().mean() > 0.999, k


def test_adapter_saved_by_qerl_with_trainer_state_merges(qpair, tmp_path):
    """The train-step output format (qerl_cli.adapters + TrainerState) round-trips through merge."""
    from qerl_cli.adapters import save_adapter
    from qerl_cli.layers.lora import LoraSpec, lora_modules
    from qerl_cli.models import load_model
    from qerl_cli.train.state import TrainerState

    _, qdir, _ = qpair
    model = load_model(qdir, device="cpu", dtype=torch.float32, lora=LoraSpec(r=8, alpha=16, use_rslora=True))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.05)
    ad = save_adapter(model, tmp_path / "step-1", base_model_path=qdir)
    TrainerState(global_step=1, base_model_hash=model_hash(qdir)).save(ad / "trainer_state.json")
    with torch.no_grad():
        ref = model.compute_logits(model.forward_train(IDS, torch.ones_like(IDS)))
    m = merge(MergeConfig(qdir, ad, tmp_path / "m"), progress=False)
    assert m["summary"]["lineage"] == "verified" and m["summary"]["merged_modules"] == 14
    got = hf_logits(tmp_path / "m", IDS)
    err = (got - ref).abs().max().item()
    assert err < 2e-2 * ref.abs().max().item()
    assert (qerl_logits(qdir, None, IDS) - ref).abs().max().item() > 20 * err  # rsLoRA scaling applied


@pytest.fixture(scope="module")
def small_update(qpair, tmp_path_factory):
    """An adapter whose update is a few % of the weights, as after RL (smaller than the FP4 grid step)."""
    src, qdir, _ = qpair
    return make_peft_adapter(src, tmp_path_factory.mktemp("small") / "ad", scale=0.006, base_hash=model_hash(qdir))


def test_requantize_from_source_keeps_small_updates(qpair, small_update, tmp_path):
    from typer.testing import CliRunner

    from qerl_cli.cli import app

    src, qdir, _ = qpair
    with pytest.warns(QerlWarning, match="re-quantizing kept only"):  # a library caller hears it too
        naive = merge(MergeConfig(qdir, small_update, tmp_path / "naive", dtype="nvfp4"), progress=False)
    rq = naive["summary"]["requantization"]
    assert naive["summary"]["delta_rel_norm_mean"] < 0.1
    assert rq["from"] == "dequantized base" and rq["update_retained"] < 0.5 and rq["update_rel_error"] > 0.7
    with warnings.catch_warnings():
        warnings.simplefilter("error", QerlWarning)
        good = merge(MergeConfig(qdir, small_update, tmp_path / "good", dtype="nvfp4", requantize_from=src),
                     progress=False)
    rq2 = good["summary"]["requantization"]
    assert rq2["from"] == "source" and 0.8 < rq2["update_retained"] < 1.2, rq2
    assert good["inputs"]["requantize_from"] == model_hash(src)
    # the CLI says so, naming the source recorded by `qerl quantize`
    r = CliRunner().invoke(app, ["merge", "--model", str(qdir), "--adapter", str(small_update), "--out",
                                 str(tmp_path / "cli"), "--dtype", "nvfp4", "-q"], terminal_width=400)
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())  # rich wraps long lines
    assert "warning: re-quantizing kept only" in text and f"--requantize-from {src.resolve()}" in text


def test_an_update_fp4_cannot_hold_even_from_the_source_is_not_told_to_pass_the_source(qpair, tmp_path):
    # (docs audit, session 44) with --requantize-from given, the warning still said "pass --requantize-from
    # SRC", and a near-zero retention printed as "-0%"
    src, qdir, _ = qpair
    tiny = make_peft_adapter(src, tmp_path / "ad", scale=1e-6, base_hash=model_hash(qdir))
    with pytest.warns(QerlWarning) as seen:
        m = merge(MergeConfig(qdir, tiny, tmp_path / "m", dtype="nvfp4", requantize_from=src), progress=False)
    assert m["summary"]["requantization"]["update_retained"] < 0.5
    text = " ".join(str(w.message) for w in seen)
    assert "serve the bf16 merge (--dtype bf16)" in text and "pass --requantize-from" not in text, text
    assert "-0%" not in text


def test_requantize_from_checks_the_source(qpair, small_update, tmp_path):
    from qerl_cli.errors import BadInputError, LineageError

    src, qdir, _ = qpair
    other = make_tiny_hf_model(tmp_path, arch="qwen2", hidden=64, layers=2, seed=4, name="other", tokenizer=False)
    with pytest.raises(LineageError, match="was quantized from a model with hash"):
        merge(MergeConfig(qdir, small_update, tmp_path / "m", dtype="nvfp4", requantize_from=other), progress=False)
    with pytest.raises(BadInputError, match="only applies to --dtype nvfp4"):
        MergeConfig(qdir, small_update, tmp_path / "m", requantize_from=src)
    with pytest.raises(BadInputError, match="is quantized"):
        merge(MergeConfig(qdir, small_update, tmp_path / "m", dtype="nvfp4", requantize_from=qdir,
                          allow_base_mismatch=True), progress=False)
    assert not (tmp_path / "m").exists()


def test_a_full_trained_copy_of_a_quantized_linear_is_named_as_such(qpair, tmp_path):
    # It said "trained tensor ...o_proj.weight is not in --model", which reads like a wrong base: the
    # Linear is there, packed as NVFP4 (the documented limit, docs/merge-eval.md).
    from qerl_cli.errors import BadInputError

    src, qdir, _ = qpair
    adapter = make_peft_adapter(src, tmp_path / "a", modules_to_save=["o_proj"], base_hash=model_hash(qdir))
    with pytest.raises(BadInputError, match=r"o_proj.weight is a full-trained copy \(modules_to_save\) of an NVFP4"):
        merge(MergeConfig(qdir, adapter, tmp_path / "m"), progress=False)
    assert not (tmp_path / "m").exists()


def test_retained_percent_truncates_the_share_not_its_float_error():
    from qerl_cli.merge import retained_percent

    assert [retained_percent(x) for x in (0.57, 0.29, 0.58, 0.4999, 0.1779, -0.003, 1.2)] == [57, 29, 58, 49, 17, 0, 120]


def test_a_w4a4_base_merges_without_its_activation_scales(qpair, tmp_path):
    """llm-compressor's NVFP4 preset (W4A4) stores an ``input_global_scale`` per Linear: merge copied them into
    the bf16 checkpoint, which qerl's loader then refused ("unexpected tensor ...input_global_scale")."""
    import shutil

    from safetensors.torch import save_file

    from qerl_cli.models import load_model

    _, qdir, adapter = qpair
    w4a4 = tmp_path / "w4a4"
    shutil.copytree(qdir, w4a4)
    t = load_file(w4a4 / "model.safetensors")
    t |= {k.replace(".weight_packed", ".input_global_scale"): torch.tensor([448.0 * 6 / 3])
          for k in list(t) if k.endswith(".weight_packed")}
    save_file(t, w4a4 / "model.safetensors", metadata={"format": "pt"})
    merge(MergeConfig(qdir, adapter, tmp_path / "a"), progress=False)
    merge(MergeConfig(w4a4, adapter, tmp_path / "b", allow_base_mismatch=True), progress=False)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    load_model(tmp_path / "b")


@pytest.mark.parametrize("fmt, names", [
    ("compressed-tensors", ("self_attn.k_scale", "self_attn.v_scale")),  # llm-compressor's kv_cache_scheme
    ("modelopt", ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale")),  # kv_cache_quant_algo FP8
])
def test_an_nvfp4_base_with_fp8_kv_cache_scales_merges_without_them(qpair, tmp_path, fmt, names):
    """NVFP4 checkpoints calibrated for an FP8 KV cache (ModelOpt's kv_cache_quant_algo FP8, llm-compressor's
    kv_cache_scheme) store k_scale/v_scale per layer: merge copied them into the bf16 checkpoint, which qerl's
    loader then refused ("unexpected tensor ...k_scale"), and --dtype nvfp4 was refused only after the whole
    merge, naming its temporary .merged-bf16 directory."""
    import shutil

    from safetensors.torch import save_file

    from qerl_cli.models import load_model

    src, qdir, adapter = qpair
    base = qdir
    if fmt == "modelopt":
        base = tmp_path / "mo"
        quantize(QuantizeConfig(src=src, out=base, format="modelopt", device="cpu", progress=False))
    kv = tmp_path / "kv"
    shutil.copytree(base, kv)
    t = load_file(kv / "model.safetensors")
    t |= {f"model.layers.{i}.{n}": torch.tensor(0.05) for i in range(2) for n in names}
    save_file(t, kv / "model.safetensors", metadata={"format": "pt"})
    merge(MergeConfig(base, adapter, tmp_path / "a", allow_base_mismatch=True), progress=False)
    merge(MergeConfig(kv, adapter, tmp_path / "b", allow_base_mismatch=True), progress=False)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    load_model(tmp_path / "b")
    merge(MergeConfig(kv, adapter, tmp_path / "c", dtype="nvfp4", allow_base_mismatch=True), progress=False)
    load_model(tmp_path / "c")


def test_an_awq_smoothed_modelopt_base_is_refused(qpair, tmp_path):
    """ModelOpt's NVFP4_AWQ (and W4A8_AWQ) store a pre_quant_scale per Linear, which the engine multiplies the input
    by: the effective weight is the dequantized one times that scale per input channel. merge took it for plain
    ModelOpt NVFP4 (it has weight_scale_2), merged the unscaled weights and copied pre_quant_scale beside them:
    exit 0, wrong weights, an output qerl's loader refused."""
    from safetensors.torch import save_file

    from qerl_cli.errors import BadInputError

    src, _, adapter = qpair
    mo = tmp_path / "mo"
    quantize(QuantizeConfig(src=src, out=mo, format="modelopt", device="cpu", progress=False))
    t = load_file(mo / "model.safetensors")
    t |= {k.replace(".weight_scale_2", ".pre_quant_scale"): torch.full((t[k.replace("_scale_2", "")].shape[1] * 2,), 2.0)
          for k in list(t) if k.endswith(".weight_scale_2")}
    save_file(t, mo / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(BadInputError, match=r"pre_quant_scale \(float32\) is not part of an NVFP4 weight"):
        merge(MergeConfig(mo, adapter, tmp_path / "m", allow_base_mismatch=True), progress=False)
    assert not (tmp_path / "m").exists()
