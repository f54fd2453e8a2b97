"""`qerl merge`: merged logits equal base + adapter, lineage and shape checks, atomic reruns."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from qerl_cli.errors import BadInputError, LineageError, OutputExistsError
from qerl_cli.hashing import model_hash
from qerl_cli.merge import MergeConfig, merge, read_adapter
from tests.helpers import PEFT_LAYER_FIELDS, make_tiny_hf_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base_dir: Path, out: Path, *, r=4, alpha=8, seed=1, scale=0.05,
                      modules_to_save=None, trainer_state=True, targets=TARGETS, base_hash=None, **lora) -> Path:
    """A PEFT adapter for ``base_dir`` with random (non-zero) A and B, as training would leave it (``lora``: more
    ``peft.LoraConfig`` fields)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets if isinstance(targets, str) else list(targets),
                          modules_to_save=modules_to_save,
                          **lora)
    pm = peft.get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
            elif "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.1)
    pm.save_pretrained(out)
    if trainer_state:
        state = {"global_step": 3, "base_model_hash": base_hash or model_hash(base_dir)}
        (out / "trainer_state.json").write_text(json.dumps(state))
    return out


def peft_logits(base_dir, adapter_dir, ids):
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    with torch.no_grad():
        return model(input_ids=ids).logits


def hf_logits(model_dir, ids):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("merge")
    base = make_tiny_hf_model(tmp, arch="qwen2", hidden=64, layers=2)
    adapter = make_peft_adapter(base, tmp / "adapter", modules_to_save=["input_layernorm", "norm"])
    return base, adapter


IDS = torch.tensor([[1, 5, 9, 200, 17, 33, 2, 101, 7, 64]])


def test_bf16_merge_matches_base_plus_adapter(pair, tmp_path):
    base, adapter = pair
    m = merge(MergeConfig(base, adapter, tmp_path / "merged"), progress=False)
    out = tmp_path / "merged"
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "bfloat16"
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).exists(), f
    s = m["summary"]
    assert s["merged_modules"] == 2 * len(TARGETS)
    assert s["replaced_tensors"] == 2 * 2 + 1  # both layer norms of 2 layers + final norm
    assert s["lineage"] == "verified" and s["delta_rel_norm_max"] > 0.01

    merged = hf_logits(out, IDS)
    ref = peft_logits(base, adapter, IDS)
    plain = peft_logits(base, None, IDS)
    err = (merged - ref).abs().max().item()
    effect = (ref - plain).abs().max().item()
    # the adapter moves the logits far more than the merged checkpoint's bf16 rounding does
    assert effect > 20 * err, (effect, err)
    assert err < 2e-2 * ref.abs().max().item()


def test_merged_tensors_are_exact_fp32_sums_rounded_once(pair, tmp_path):
    from safetensors.torch import load_file

    base, adapter = pair
    merge(MergeConfig(base, adapter, tmp_path / "m"), progress=False)
    got = load_file(tmp_path / "m" / "model.safetensors")
    src = load_file(base / "model.safetensors")
    a = load_file(adapter / "adapter_model.safetensors")
    pre = "base_model.model.model.layers.1.mlp.down_proj"
    want = src["model.layers.1.mlp.down_proj.weight"].float() + \
        a[f"{pre}.lora_B.weight"] @ a[f"{pre}.lora_A.weight"] * (8 / 4)
    assert torch.equal(got["model.layers.1.mlp.down_proj.weight"], want.to(torch.bfloat16))
    assert torch.equal(got["model.norm.weight"], a["base_model.model.model.norm.weight"].to(torch.bfloat16))
    assert torch.equal(got["model.embed_tokens.weight"], src["model.embed_tokens.weight"])
    assert got.keys() == src.keys()


def test_rerun_is_idempotent_and_force_redoes(pair, tmp_path):
    base, adapter = pair
    out = tmp_path / "m"
    first = merge(MergeConfig(base, adapter, out), progress=False)
    again = merge(MergeConfig(base, adapter, out), progress=False)
    assert again.get("already_done") and again["fingerprint"] == first["fingerprint"]
    with pytest.raises(OutputExistsError, match="--force"):
        merge(MergeConfig(base, adapter, out, max_shard_size=1 << 20), progress=False)
    redo = merge(MergeConfig(base, adapter, out, max_shard_size=40_000, force=True), progress=False)
    assert not redo.get("already_done")
    assert (out / "model.safetensors.index.json").exists() and not (out / "model.safetensors").exists()
    torch.testing.assert_close(hf_logits(out, IDS), peft_logits(base, adapter, IDS), rtol=0, atol=0.05)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp dirs left behind


@pytest.mark.parametrize("edit", ["generation_config.json", "tokenizer_config.json", "chat_template.jinja"])
def test_a_rerun_after_the_bases_text_files_changed_is_not_already_done(pair, tmp_path, edit):
    """The merge copies the base's tokenizer, chat template and generation config verbatim, but its fingerprint
    counted only config.json and the weights: after the base's eos or template was fixed, the rerun was "already
    done" with the stale copies, and eval of the merge stopped and prompted otherwise than eval of base + adapter."""
    import shutil

    base0, adapter = pair
    base = tmp_path / "base"
    shutil.copytree(base0, base)
    out = tmp_path / "m"
    merge(MergeConfig(base, adapter, out), progress=False)
    assert merge(MergeConfig(base, adapter, out), progress=False)["already_done"]
    p = base / edit
    p.write_text(p.read_text().replace("<|im_end|>", "<|endoftext|>") if edit != "generation_config.json" else
                 json.dumps({**json.loads(p.read_text()), "eos_token_id": [2, 3]}))
    with pytest.raises(OutputExistsError, match="input base_text changed"):
        merge(MergeConfig(base, adapter, out), progress=False)
    merge(MergeConfig(base, adapter, out, force=True), progress=False)
    assert (out / edit).read_bytes() == p.read_bytes()


def test_a_merge_older_qerl_made_is_done_while_its_text_copies_match_the_base(pair, tmp_path, monkeypatch):
    import shutil

    import qerl_cli.merge as mg
    from qerl_cli.outputs import StageOutput

    base0, adapter = pair
    base = tmp_path / "base"
    shutil.copytree(base0, base)
    out = tmp_path / "m"

    def older(*args, inputs, legacy_inputs=(), **kw):  # qerl before 2026-11-28: no base_text among the inputs
        return StageOutput(*args, inputs={k: v for k, v in inputs.items() if k != "base_text"}, **kw)

    monkeypatch.setattr(mg, "StageOutput", older)
    merge(MergeConfig(base, adapter, out), progress=False)
    monkeypatch.undo()
    assert merge(MergeConfig(base, adapter, out), progress=False)["already_done"]
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    with pytest.raises(OutputExistsError, match="--force"):
        merge(MergeConfig(base, adapter, out), progress=False)


def test_sharded_fp32_base_and_plain_peft_adapter(tmp_path):
    base = make_tiny_hf_model(tmp_path, arch="llama", hidden=32, layers=1, dtype=torch.float32,
                              max_shard_size="20KB")
    adapter = make_peft_adapter(base, tmp_path / "ad", r=2, alpha=4, trainer_state=False,
                                targets=["q_proj", "v_proj"])
    m = merge(MergeConfig(base, adapter, tmp_path / "out"), progress=False)
    assert m["summary"]["lineage"] == "unverified"
    assert m["summary"]["merged_modules"] == 2
    ref = peft_logits(base, adapter, IDS % 300)
    torch.testing.assert_close(hf_logits(tmp_path / "out", IDS % 300), ref, rtol=0, atol=2e-2 * ref.abs().max())


def test_refuses_adapter_for_another_base(pair, tmp_path):
    base, adapter = pair
    other = make_tiny_hf_model(tmp_path, arch="qwen2", hidden=64, layers=2, seed=7, name="other")
    with pytest.raises(LineageError) as e:
        merge(MergeConfig(other, adapter, tmp_path / "m"), progress=False)
    msg = str(e.value)
    assert model_hash(other)[:12] in msg and model_hash(base)[:12] in msg and "trainer_state.json" in msg
    assert "--allow-base-mismatch" in msg
    assert not (tmp_path / "m").exists()
    m = merge(MergeConfig(other, adapter, tmp_path / "m", allow_base_mismatch=True), progress=False)
    assert m["summary"]["lineage"] == "mismatch-allowed" and m["summary"]["adapter_base_hash"] == model_hash(base)


def test_refuses_shape_mismatch(tmp_path):
    base = make_tiny_hf_model(tmp_path, arch="qwen2", hidden=64, layers=1)
    wider = make_tiny_hf_model(tmp_path, arch="qwen2", hidden=32, layers=1, name="wider", tokenizer=False)
    adapter = make_peft_adapter(wider, tmp_path / "ad", trainer_state=False)
    with pytest.raises(BadInputError, match=r"model.layers.0.mlp.down_proj LoRA maps 64 -> 32 features .* \[64, 128\]"):
        merge(MergeConfig(base, adapter, tmp_path / "m"), progress=False)
    deeper = make_tiny_hf_model(tmp_path, arch="qwen2", hidden=64, layers=2, name="deeper", tokenizer=False)
    adapter2 = make_peft_adapter(deeper, tmp_path / "ad2", trainer_state=False)
    with pytest.raises(BadInputError, match=r"module model.layers.1.\S+ is not in --model"):
        merge(MergeConfig(base, adapter2, tmp_path / "m"), progress=False)


def test_refuses_missing_files(pair, tmp_path):
    base, adapter = pair
    with pytest.raises(BadInputError, match="not a directory"):
        merge(MergeConfig(base, tmp_path / "nope", tmp_path / "m"), progress=False)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    with pytest.raises(BadInputError, match="adapter_model.safetensors not found"):
        merge(MergeConfig(base, broken, tmp_path / "m"), progress=False)
    empty_model = tmp_path / "empty_model"
    empty_model.mkdir()
    (empty_model / "config.json").write_text("{}")
    with pytest.raises(BadInputError, match="no \\*.safetensors"):
        merge(MergeConfig(empty_model, adapter, tmp_path / "m"), progress=False)
    with pytest.raises(BadInputError, match="--dtype"):
        MergeConfig(base, adapter, tmp_path / "m", dtype="fp8")


@pytest.mark.parametrize("edit, match", [
    (lambda c: [c], "expected a JSON object, got list"),
    (lambda c: dict(c, lora_alpha=None), "'lora_alpha' must be a number, got None"),
    (lambda c: dict(c, r=str(c["r"])), "'r' must be a positive integer, got '4'"),
    (lambda c: dict(c, r=0), "'r' must be a positive integer, got 0"),
    (lambda c: dict(c, rank_pattern={"q_proj(": 2}), "rank_pattern key 'q_proj\\(' is not a valid regex"),
    (lambda c: dict(c, alpha_pattern="v_proj"), "alpha_pattern must map module-name patterns"),
    # the fields the PEFT target check matches with (it was blind to them): a TypeError / re.error otherwise
    (lambda c: dict(c, layers_to_transform="1"), "layers_to_transform must be a layer index or a list of them, got '1'"),
    (lambda c: dict(c, layers_to_transform=[0, True]), "layers_to_transform must be a layer index"),
    (lambda c: dict(c, exclude_modules="v_proj("), "exclude_modules 'v_proj\\(' is not a valid regex"),
    (lambda c: dict(c, exclude_modules={"v_proj": 1}), "exclude_modules must be a list of module names or a regex"),
    # a pair PEFT's LoraConfig refuses: every reader applied each pair the regex matched, layers_to_transform ignored
    (lambda c: dict(c, target_modules=".*", layers_to_transform=[1]),
     r"layers_to_transform \[1\] with a regex target_modules '\.\*': PEFT refuses this config"),
    (lambda c: dict(c, target_modules="all-linear", layers_to_transform=0), "layers_to_transform 0 with a regex"),
])
def test_malformed_adapter_config_is_one_line_error(pair, tmp_path, edit, match):
    """A hand-edited adapter_config.json: merge and the adapter loader name the key (they raised
    AttributeError / TypeError / re.error tracebacks, or said "rank 4 but r=4")."""
    import shutil

    from qerl_cli.adapters import read_adapter_spec

    base, adapter = pair
    bad = tmp_path / "bad"
    shutil.copytree(adapter, bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(edit(cfg)))
    with pytest.raises(BadInputError, match=match):
        read_adapter(bad)
    with pytest.raises(BadInputError, match=match):
        merge(MergeConfig(base, bad, tmp_path / "m"), progress=False)
    assert not (tmp_path / "m").exists()
    if "pattern" not in match:  # the loader refuses any rank/alpha pattern before reading it
        with pytest.raises(BadInputError, match=match):
            read_adapter_spec(bad)


def test_lora_tensors_of_a_module_target_modules_does_not_name_are_refused(pair, tmp_path):
    # merge merged every LoRA pair in the file, where PEFT's merge_and_unload wraps only target_modules (and the
    # loader refuses the tensor): a hand-edited config that dropped v_proj still had v_proj merged
    import shutil

    base, adapter = pair
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert isinstance(cfg["target_modules"], list) and len(cfg["target_modules"]) > 1
    dropped = sorted(cfg["target_modules"])[-1]
    bad = tmp_path / "bad"
    shutil.copytree(adapter, bad)
    (bad / "adapter_config.json").write_text(json.dumps(dict(cfg, target_modules=[t for t in cfg["target_modules"]
                                                                                  if t != dropped])))
    with pytest.raises(BadInputError, match=rf"LoRA tensors of '.*\.{dropped}', which target_modules .* does not name"):
        read_adapter(bad)
    regex = tmp_path / "regex"  # a regex is matched as PEFT matches it (re.fullmatch): ".*" takes every pair
    shutil.copytree(adapter, regex)
    (regex / "adapter_config.json").write_text(json.dumps(dict(cfg, target_modules=".*")))
    assert read_adapter(regex).deltas.keys() == read_adapter(adapter).deltas.keys()


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    """An fp32 3-layer base and a PEFT adapter on every target of every layer."""
    tmp = tmp_path_factory.mktemp("layers")
    base = make_tiny_hf_model(tmp, arch="llama", hidden=32, layers=3, dtype=torch.float32, tokenizer=False)
    return base, make_peft_adapter(base, tmp / "all", r=2, alpha=4, trainer_state=False)


@pytest.mark.parametrize("fields", list(PEFT_LAYER_FIELDS.values()), ids=list(PEFT_LAYER_FIELDS))
def test_lora_pairs_of_layers_or_modules_peft_leaves_out_are_refused(three_layers, tmp_path, fields):
    # The check read target_modules only: an adapter whose config says layers_to_transform / exclude_modules but
    # whose file holds pairs of the other layers (a hand-edited config, a review) had them all merged, where PEFT
    # wraps only the modules those fields leave it and drops the other tensors without a word.
    import shutil

    import peft
    import transformers

    base, full = three_layers
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=TARGETS, **fields))
    wraps = {n.removeprefix("base_model.model.") for n, m in pm.named_modules() if hasattr(m, "lora_A")}
    edited = tmp_path / "edited"
    shutil.copytree(full, edited)
    cfg = json.loads((full / "adapter_config.json").read_text())
    (edited / "adapter_config.json").write_text(json.dumps(dict(cfg, **fields)))
    left_out = sorted(read_adapter(full).deltas.keys() - wraps)
    assert left_out and wraps < read_adapter(full).deltas.keys()
    field = next(iter(fields)) if "layers_pattern" not in fields else "layers_to_transform"
    with pytest.raises(BadInputError, match=rf"LoRA tensors of '{left_out[0]}', which {field} .*PEFT would not load"):
        merge(MergeConfig(base, edited, tmp_path / "m"), progress=False)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("fields", list(PEFT_LAYER_FIELDS.values()), ids=list(PEFT_LAYER_FIELDS))
def test_peft_adapters_with_layer_fields_merge_to_peft_merge_and_unload(three_layers, tmp_path, fields):
    # The other side of the check above: the adapters PEFT itself writes with these fields are not refused, and
    # every merged tensor is PEFT's own merge_and_unload (fp32 base) rounded to bf16, untouched layers included.
    import peft
    import transformers
    from safetensors.torch import load_file

    base, _ = three_layers
    adapter = make_peft_adapter(base, tmp_path / "ad", r=2, alpha=4, trainer_state=False, **fields)
    m = merge(MergeConfig(base, adapter, tmp_path / "m"), progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(model, adapter)
    assert m["summary"]["merged_modules"] == sum(hasattr(x, "lora_A") for x in pm.modules()) > 0
    want = pm.merge_and_unload().state_dict()
    got = load_file(tmp_path / "m" / "model.safetensors")
    assert got.keys() == load_file(base / "model.safetensors").keys()
    for name, t in got.items():
        assert torch.equal(t, want[name].to(torch.bfloat16)), name


def test_read_adapter_scaling_and_rslora(pair, tmp_path):
    _, adapter = pair
    a = read_adapter(adapter)
    assert {d.scaling for d in a.deltas.values()} == {2.0}
    import shutil

    rs = tmp_path / "rs"
    shutil.copytree(adapter, rs)
    cfg = json.loads((rs / "adapter_config.json").read_text())
    cfg.update(use_rslora=True, alpha_pattern={"down_proj": 2})
    (rs / "adapter_config.json").write_text(json.dumps(cfg))
    b = read_adapter(rs)
    assert b.deltas["model.layers.0.mlp.down_proj"].scaling == pytest.approx(2 / 2)
    assert b.deltas["model.layers.0.self_attn.q_proj"].scaling == pytest.approx(8 / 2)


def test_cli_merge_rerun_and_lineage_exit_code(pair, tmp_path):
    from typer.testing import CliRunner

    from qerl_cli.cli import app

    base, adapter = pair
    out = tmp_path / "cli"
    args = ["merge", "--model", str(base), "--adapter", str(adapter), "--out", str(out), "-q"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "merged 14 LoRA modules (+5 trained tensors)" in r.output and "lineage verified" in r.output
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and "already done" in r.output
    r = CliRunner().invoke(app, [*args, "--max-shard-size", "lots"])
    assert r.exit_code == 2 and "--max-shard-size 'lots' is not a size" in r.output
    other = make_tiny_hf_model(tmp_path, arch="qwen2", hidden=64, layers=2, seed=9, name="other", tokenizer=False)
    r = CliRunner().invoke(app, ["merge", "--model", str(other), "--adapter", str(adapter), "--out", str(tmp_path / "x")])
    assert r.exit_code == 3 and "error:" in r.output and "trained on base" in r.output


def test_out_must_not_overlap_inputs(pair, tmp_path):
    base, adapter = pair
    for out in (base, adapter, base / "sub", base.parent):
        with pytest.raises(BadInputError, match="overlaps"):
            MergeConfig(base, adapter, out)


def test_tied_embeddings_stay_tied(tmp_path):
    base = make_tiny_hf_model(tmp_path, arch="qwen3", hidden=32, layers=1, tie_word_embeddings=True)
    adapter = make_peft_adapter(base, tmp_path / "ad", r=2, alpha=2, targets=["q_proj", "o_proj"])
    merge(MergeConfig(base, adapter, tmp_path / "out"), progress=False)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    ref = peft_logits(base, adapter, IDS % 300)
    torch.testing.assert_close(hf_logits(tmp_path / "out", IDS % 300), ref, rtol=0, atol=2e-2 * ref.abs().max())


@pytest.mark.parametrize("how", ["lora", "trained_copy", "nvfp4"])
def test_an_adapter_that_changes_a_tied_embedding_unties_lm_head(tmp_path, how):
    # PEFT's policy embeds through the adapter's embedding but scores with the original one; keeping
    # tie_word_embeddings made lm_head take the update too (further from the policy than the base was).
    base = make_tiny_hf_model(tmp_path, arch="llama", hidden=32, layers=1, tie_word_embeddings=True)
    kw = (dict(targets=["embed_tokens", "v_proj"]) if how == "lora"
          else dict(targets=["v_proj"], modules_to_save=["embed_tokens"]))
    adapter = make_peft_adapter(base, tmp_path / "ad", r=2, alpha=4, scale=0.2, **kw)
    if how == "nvfp4":
        from qerl_cli.quantize import QuantizeConfig, quantize

        quantize(QuantizeConfig(src=base, out=tmp_path / "q", progress=False, device="cpu"))
    m = merge(MergeConfig(tmp_path / "q" if how == "nvfp4" else base, adapter, tmp_path / "out",
                          allow_base_mismatch=how == "nvfp4"), progress=False)
    assert m["summary"]["untied_lm_head"] is True
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    ref = peft_logits(base, adapter, IDS % 300)
    plain = peft_logits(base, None, IDS % 300)
    got = hf_logits(tmp_path / "out", IDS % 300)
    err = (got - ref).abs().max().item()
    tol = (0.25 if how == "nvfp4" else 2e-2) * ref.abs().max().item()  # NVFP4: the base's own rounding
    assert err < tol and (plain - ref).abs().max().item() > 2 * err, (err, (plain - ref).abs().max().item())


@pytest.mark.parametrize("targets", [["lm_head", "v_proj"], ["embed_tokens", "lm_head"]])
def test_lora_on_a_tied_lm_head_unties_it_as_peft_does(tmp_path, targets):
    # It was refused as "module lm_head is not in --model", a head the model plainly has (a review, 2026-11-27).
    # PEFT puts the LoRA on the output head only: merged, lm_head = the base's embedding + B A, embedding as the
    # adapter left it.
    base = make_tiny_hf_model(tmp_path, arch="llama", hidden=32, layers=1, tie_word_embeddings=True)
    adapter = make_peft_adapter(base, tmp_path / "ad", r=2, alpha=4, scale=0.2, targets=targets, trainer_state=False)
    m = merge(MergeConfig(base, adapter, tmp_path / "out"), progress=False)
    assert m["summary"]["untied_lm_head"] is True and m["summary"]["merged_modules"] == 2
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False
    ref, plain = peft_logits(base, adapter, IDS % 300), peft_logits(base, None, IDS % 300)
    err = (hf_logits(tmp_path / "out", IDS % 300) - ref).abs().max().item()
    assert err < 2e-2 * ref.abs().max().item() and (plain - ref).abs().max().item() > 20 * err


@pytest.mark.parametrize("how", ["ensure_weight_tying", "target_parameters"])
def test_lora_pairs_peft_wraps_beyond_the_saved_target_modules_are_merged(tmp_path, how):
    # The target_modules check refused adapters PEFT writes itself: with ensure_weight_tying on a tied base PEFT
    # saves the head's LoRA (the embedding's, transposed) but moves lm_head out of target_modules; a
    # target_parameters entry wraps its module without naming it there. Merged, they equal PEFT's unmerged policy
    # (its own merge_and_unload adds a tied pair's update to the shared weight twice).
    base = make_tiny_hf_model(tmp_path, arch="llama", hidden=32, layers=1, tie_word_embeddings=how == "ensure_weight_tying")
    kw = (dict(targets=["embed_tokens", "v_proj"], ensure_weight_tying=True) if how == "ensure_weight_tying"
          else dict(targets=["v_proj"], target_parameters=["self_attn.q_proj.weight"]))
    adapter = make_peft_adapter(base, tmp_path / "ad", r=2, alpha=4, scale=0.2, trainer_state=False, **kw)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    extra = "lm_head" if how == "ensure_weight_tying" else "model.layers.0.self_attn.q_proj"
    assert extra in read_adapter(adapter).deltas and extra.rsplit(".", 1)[-1] not in cfg["target_modules"]
    merge(MergeConfig(base, adapter, tmp_path / "out"), progress=False)
    ref, plain = peft_logits(base, adapter, IDS % 300), peft_logits(base, None, IDS % 300)
    err = (hf_logits(tmp_path / "out", IDS % 300) - ref).abs().max().item()
    assert err < 2e-2 * ref.abs().max().item() and (plain - ref).abs().max().item() > 20 * err


def add_pairs(adapter: Path, base: Path, modules=("lm_head",), into: Path | None = None) -> Path:
    """Write ADAPTER's tensors plus a hand-added random LoRA pair for each of MODULES (lm_head, model.embed_tokens),
    into INTO (a copy of the adapter) or the adapter itself: pairs PEFT's loader drops where it wraps no such layer."""
    from safetensors.torch import load_file, save_file

    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    shapes = {"lm_head": {"lora_A": (2, 32), "lora_B": (vocab, 2)},
              "model.embed_tokens": {"lora_embedding_A": (2, vocab), "lora_embedding_B": (32, 2)}}
    if into is not None:
        shutil.copytree(adapter, into)
    tensors = load_file(adapter / "adapter_model.safetensors")
    g = torch.Generator().manual_seed(5)
    for module in modules:
        tensors.update({f"base_model.model.{module}.{k}.weight": torch.randn(shape, generator=g)
                        for k, shape in shapes[module].items()})
    save_file(tensors, (into or adapter) / "adapter_model.safetensors")
    return into or adapter


@pytest.mark.parametrize("spelling", ["all-linear", "All-Linear"])
def test_all_linear_adapters_merge_to_the_policy_peft_loads(tmp_path, spelling):
    # PEFT reads target_modules "all-linear" in any case (merge refused "All-Linear" as a regex matching nothing), and
    # its all-linear wraps every Linear but the output layer: a hand-added pair of lm_head, or of the embedding (no
    # Linear), is dropped by PeftModel.from_pretrained without a word; merge merged it (logits ~100 off PEFT's), and
    # rollout/eval's loader failed on it as "LoRA targets ['lm_head'] match no Linear".

    from qerl_cli.adapters import read_adapter_spec

    base = make_tiny_hf_model(tmp_path, arch="llama", hidden=32, layers=1, dtype=torch.float32, tokenizer=False)
    adapter = make_peft_adapter(base, tmp_path / "ad", r=2, alpha=4, scale=0.2, targets="all-linear", trainer_state=False)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(dict(cfg, target_modules=spelling)))
    m = merge(MergeConfig(base, adapter, tmp_path / "out"), progress=False)
    assert m["summary"]["merged_modules"] == len(TARGETS)
    ref, plain = peft_logits(base, adapter, IDS % 300), peft_logits(base, None, IDS % 300)
    err = (hf_logits(tmp_path / "out", IDS % 300) - ref).abs().max().item()
    assert err < 2e-2 * ref.abs().max().item() and (plain - ref).abs().max().item() > 20 * err
    for module in ("lm_head", "model.embed_tokens"):
        extra = add_pairs(adapter, base, (module,), into=tmp_path / module)
        assert torch.equal(peft_logits(base, extra, IDS % 300), ref)  # PEFT drops the pair
        for read in (lambda d: merge(MergeConfig(base, d, tmp_path / "m"), progress=False), read_adapter_spec):
            with pytest.raises(BadInputError, match=rf"LoRA tensors of '{module}', which target_modules 'all-linear' "
                                                    "leaves out .*PEFT would not load them"):
                read(extra)
        assert not (tmp_path / "m").exists()


def test_a_head_pair_beside_ensure_weight_tying_without_an_embedding_target_is_refused(tmp_path):
    # ensure_weight_tying puts LoRA on a tied head only where target_modules names an embedding layer; beside
    # all-linear (PEFT saves the Linears it found) it only warns, and PEFT drops a hand-added lm_head pair. Merge took
    # any head pair beside ensure_weight_tying for one PEFT wraps and merged it (logits ~100 off PEFT's).

    base = make_tiny_hf_model(tmp_path, arch="llama", hidden=32, layers=1, dtype=torch.float32, tokenizer=False,
                              tie_word_embeddings=True)
    with pytest.warns(UserWarning, match="ensure_weight_tying"):
        adapter = make_peft_adapter(base, tmp_path / "ad", r=2, alpha=4, targets="all-linear", ensure_weight_tying=True,
                                    trainer_state=False)
    ref = peft_logits(base, adapter, IDS % 300)
    add_pairs(adapter, base)
    assert torch.equal(peft_logits(base, adapter, IDS % 300), ref)  # PEFT drops the pair
    with pytest.raises(BadInputError, match=r"LoRA tensors of 'lm_head', which target_modules .* does not name"):
        merge(MergeConfig(base, adapter, tmp_path / "m"), progress=False)


def test_a_head_pair_beside_ensure_weight_tying_on_an_untied_base_is_refused(tmp_path):
    # ensure_weight_tying ties the head to a LoRA'd embedding only where the base ties them; on an untied base PEFT
    # warns "no tied modules were found", puts no LoRA on lm_head (target_modules does not name it) and drops a
    # hand-added head pair. Merge took it for the tied head's pair and merged it (logits ~50 off PEFT's, at ~0.4).

    base = make_tiny_hf_model(tmp_path, arch="llama", hidden=32, layers=1, dtype=torch.float32, tokenizer=False)
    with pytest.warns(UserWarning, match="no tied modules were found"):
        adapter = make_peft_adapter(base, tmp_path / "ad", r=2, alpha=4, scale=0.2, targets=["q_proj", "embed_tokens"],
                                    ensure_weight_tying=True, trainer_state=False)
    ref = peft_logits(base, adapter, IDS % 300)
    merge(MergeConfig(base, adapter, tmp_path / "out"), progress=False)  # as PEFT saved it: merged
    assert (hf_logits(tmp_path / "out", IDS % 300) - ref).abs().max().item() < 2e-2 * ref.abs().max().item()
    add_pairs(adapter, base)
    assert torch.equal(peft_logits(base, adapter, IDS % 300), ref)  # PEFT drops the pair
    with pytest.raises(BadInputError, match=r"LoRA tensors of 'lm_head', which target_modules .* does not name.*"
                                            r"ties nothing"):
        merge(MergeConfig(base, adapter, tmp_path / "m"), progress=False)
    assert not (tmp_path / "m").exists()


def test_embedding_and_lm_head_lora(tmp_path):
    base = make_tiny_hf_model(tmp_path, arch="llama", hidden=32, layers=1)
    adapter = make_peft_adapter(base, tmp_path / "ad", r=2, alpha=4, targets=["embed_tokens", "lm_head", "v_proj"],
                                trainer_state=False)
    keys = read_adapter(adapter)
    assert keys.deltas["model.embed_tokens"].embedding and not keys.deltas["lm_head"].embedding
    m = merge(MergeConfig(base, adapter, tmp_path / "out"), progress=False)
    assert m["summary"]["merged_modules"] == 3
    ref = peft_logits(base, adapter, IDS % 300)
    plain = peft_logits(base, None, IDS % 300)
    got = hf_logits(tmp_path / "out", IDS % 300)
    err = (got - ref).abs().max().item()
    assert err < 2e-2 * ref.abs().max().item() and (plain - ref).abs().max().item() > 20 * err


def test_the_cli_default_shard_size_is_the_library_default():
    # "4GB" on the CLI was 4e9 bytes, MergeConfig's 4 GiB: the same merge made by either read as
    # "different inputs" from the other (exit 4).
    from typer.main import get_command

    from qerl_cli.cli import app
    from qerl_cli.quantize import parse_size

    opt = next(p for p in get_command(app).commands["merge"].params if p.name == "max_shard_size")
    assert parse_size(opt.default) == MergeConfig.max_shard_size


def _fp8(t: dict) -> dict:  # llm-compressor's FP8 layout: e4m3 weights, an fp32 scale per row
    out = {}
    for k, v in t.items():
        if k.endswith("_proj.weight"):
            out[k] = v.to(torch.float8_e4m3fn)
            out[k.removesuffix(".weight") + ".weight_scale"] = torch.ones(v.shape[0], 1)
        else:
            out[k] = v
    return out


def _gptq(t: dict) -> dict:  # GPTQ/AWQ: int32 qweight/qzeros, fp16 scales, g_idx
    out = {k: v for k, v in t.items() if not k.endswith("_proj.weight")}
    for k, v in t.items():
        if k.endswith("_proj.weight"):
            m, (n, k_in) = k.removesuffix(".weight"), v.shape
            out |= {f"{m}.qweight": torch.zeros(k_in // 8, n, dtype=torch.int32), f"{m}.scales": torch.ones(1, n).half(),
                    f"{m}.qzeros": torch.zeros(1, n // 8, dtype=torch.int32), f"{m}.g_idx": torch.zeros(k_in, dtype=torch.int32)}
    return out


def _int4(t: dict) -> dict:  # compressed-tensors W4A16 (pack-quantized): int32 weight_packed, weight_shape
    out = {k: v for k, v in t.items() if not k.endswith("_proj.weight")}
    for k, v in t.items():
        if k.endswith("_proj.weight"):
            m, (n, k_in) = k.removesuffix(".weight"), v.shape
            out |= {f"{m}.weight_packed": torch.zeros(n, k_in // 8, dtype=torch.int32),
                    f"{m}.weight_scale": torch.ones(n, 1).bfloat16(), f"{m}.weight_shape": torch.tensor([n, k_in])}
    return out


@pytest.mark.parametrize("kind, qcfg, match", [
    ("fp8", {"quant_method": "compressed-tensors", "format": "float-quantized"}, "format='float-quantized'"),
    ("fp8", None, r"weight_scale \(float32\) is not part of an NVFP4 weight"),
    ("gptq", {"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
    ("gptq", None, r"\(int32\) is not part of an NVFP4 weight"),
    ("int4", {"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format='pack-quantized'"),
    ("int4", None, r"weight_shape \(int64\) is not part of an NVFP4 weight"),
])
def test_a_base_quantized_in_another_format_is_refused_by_name(pair, tmp_path, kind, qcfg, match):
    """merge dequantizes NVFP4 only: an FP8 base's e4m3 weights were cast to bf16 without their scales and
    written as a plain checkpoint (exit 0); GPTQ/int4 bases failed as "module ... is not in --model" or on a
    missing NVFP4 global scale, which named neither the format nor the fix."""
    import shutil

    from safetensors.torch import load_file, save_file

    base, adapter = pair
    q = tmp_path / kind
    shutil.copytree(base, q)
    save_file({"fp8": _fp8, "gptq": _gptq, "int4": _int4}[kind](load_file(q / "model.safetensors")),
              q / "model.safetensors", metadata={"format": "pt"})
    if qcfg is not None:
        (q / "config.json").write_text(json.dumps(dict(json.loads((q / "config.json").read_text()),
                                                       quantization_config=qcfg)))
    with pytest.raises(BadInputError, match=match):
        merge(MergeConfig(q, adapter, tmp_path / "m", allow_base_mismatch=True), progress=False)
    assert not (tmp_path / "m").exists()


def test_nvfp4_merge_of_an_architecture_quantize_refuses_is_refused_before_merging(pair, tmp_path, monkeypatch):
    """--dtype nvfp4 quantizes the merged checkpoint last: a Gemma base was merged in full first, then refused
    naming the stage's temporary directory (`.../.merged-bf16/config.json`) instead of --model."""
    import shutil

    import qerl_cli.merge as merge_mod

    base, adapter = pair
    gemma = tmp_path / "gemma"
    shutil.copytree(base, gemma)
    (gemma / "config.json").write_text(json.dumps(dict(json.loads((base / "config.json").read_text()),
                                                       model_type="gemma", architectures=["GemmaForCausalLM"])))

    def no_merge(*a, **k):
        raise AssertionError("merged before refusing")

    monkeypatch.setattr(merge_mod, "write_checkpoint", no_merge)
    with pytest.raises(BadInputError, match=r"--model \S*/gemma/config.json: model_type 'gemma' is not supported "
                                             r"\(supported: llama, qwen2, qwen3, mistral\).*--dtype bf16 merges"):
        merge(MergeConfig(gemma, adapter, tmp_path / "m", dtype="nvfp4", allow_base_mismatch=True), progress=False)
    assert not (tmp_path / "m").exists()


def _trained_with_template(base: Path, adapter0: Path, tmp_path: Path, template: str) -> Path:
    """A copy of ``adapter0`` whose trainer_state.json names shards of a rollout that rendered its prompts with
    ``template`` (its manifest's inputs.chat_template, as `qerl rollout --chat-template-file` records it)."""
    from qerl_cli.hashing import sha256_bytes

    rollout = tmp_path / "rollout"
    rollout.mkdir()
    (rollout / "manifest.json").write_text(json.dumps({"stage": "rollout", "fingerprint": "f",
                                                       "inputs": {"chat_template": sha256_bytes(template.encode())}}))
    adapter = tmp_path / "adapter"
    shutil.copytree(adapter0, adapter)
    state = json.loads((adapter / "trainer_state.json").read_text())
    (adapter / "trainer_state.json").write_text(json.dumps(dict(state, last_shards=[
        str(rollout / "shard-00000-of-00001.jsonl")])))
    return adapter


def test_a_merge_writes_the_chat_template_the_rollouts_rendered_with_and_warns_without_it(pair, tmp_path):
    """A run on a base without a chat template (or with another) rendered its prompts with --chat-template-file;
    the merge copied the base's tokenizer files only, so transformers' apply_chat_template on the servable model
    failed ("tokenizer.chat_template is not set"), and nothing said so. --chat-template-file writes it
    (chat_template.jinja, as transformers 5 saves it); without it the merge warns."""
    import transformers

    from qerl_cli.errors import QerlWarning
    from tests.helpers import CHAT_TEMPLATE

    base0, adapter0 = pair
    base = tmp_path / "base"
    shutil.copytree(base0, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)  # a base model's tokenizer: no template
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    adapter = _trained_with_template(base, adapter0, tmp_path, CHAT_TEMPLATE)
    (tmp_path / "chat.jinja").write_text(CHAT_TEMPLATE)
    chat = [{"role": "user", "content": "Hi"}]

    with pytest.warns(QerlWarning, match=r"rendered with a --chat-template-file \(sha256 \w{12}\), but the merged "
                                         r"checkpoint gets --model's template \(or none\).*--chat-template-file"):
        merge(MergeConfig(base, adapter, tmp_path / "plain"), progress=False)
    with pytest.raises(ValueError, match="chat_template is not set"):
        transformers.AutoTokenizer.from_pretrained(tmp_path / "plain").apply_chat_template(chat, tokenize=False)

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", QerlWarning)
        m = merge(MergeConfig(base, adapter, tmp_path / "m", chat_template_file=tmp_path / "chat.jinja"), progress=False)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert "chat_template" in m["inputs"]  # a merge without it (or with another) is another output
    with pytest.raises(OutputExistsError, match="--force"), pytest.warns(QerlWarning):
        merge(MergeConfig(base, adapter, tmp_path / "m"), progress=False)

    (tmp_path / "other.jinja").write_text("{{ messages[0]['content'] }}")
    with pytest.warns(QerlWarning, match=r"--chat-template-file \S*other.jinja is another"):
        merge(MergeConfig(base, adapter, tmp_path / "o", chat_template_file=tmp_path / "other.jinja"), progress=False)


def test_a_chat_template_file_replaces_the_bases_template_in_tokenizer_config(pair, tmp_path):
    """transformers reads chat_template.jinja before tokenizer_config.json's chat_template; the base's key there is
    dropped as transformers' save_pretrained drops it, so no reader finds the base's template instead. A base whose
    own template is the rollouts' needs no flag: no warning."""
    import warnings

    import transformers

    from qerl_cli.errors import QerlWarning
    from tests.helpers import CHAT_TEMPLATE

    base0, adapter0 = pair
    base = tmp_path / "base"
    shutil.copytree(base0, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=CHAT_TEMPLATE)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", QerlWarning)
        merge(MergeConfig(base, _trained_with_template(base, adapter0, tmp_path, CHAT_TEMPLATE), tmp_path / "same"),
              progress=False)
    (tmp_path / "t.jinja").write_text("T {{ messages[0]['content'] }}")
    merge(MergeConfig(base, adapter0, tmp_path / "m", chat_template_file=tmp_path / "t.jinja"), progress=False)
    assert "chat_template" not in json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False) == "T Hi"


def test_a_bases_list_form_chat_templates_round_trip_and_its_default_is_compared(pair, tmp_path):
    """tokenizer_config.json may hold named templates, a list of {"name", "template"} (transformers' older form for
    several). The warning read a string only: a base whose "default" was the rollouts' template was said to give
    the merged checkpoint another; and --chat-template-file dropped the whole list with the base's key, so the merged
    tokenizer lost its other templates ("tool_use": apply_chat_template(..., chat_template="tool_use") failed)."""
    import warnings

    import transformers

    from qerl_cli.errors import QerlWarning
    from tests.helpers import CHAT_TEMPLATE

    base0, adapter0 = pair
    base = tmp_path / "base"
    shutil.copytree(base0, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    named = [{"name": "default", "template": CHAT_TEMPLATE}, {"name": "tool_use", "template": "TOOL {{ tools | length }}"}]
    (base / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=named)))
    chat = [{"role": "user", "content": "Hi"}]
    with warnings.catch_warnings():
        warnings.simplefilter("error", QerlWarning)
        merge(MergeConfig(base, _trained_with_template(base, adapter0, tmp_path, CHAT_TEMPLATE), tmp_path / "same"),
              progress=False)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "same")
    assert tok.chat_template == {"default": CHAT_TEMPLATE, "tool_use": "TOOL {{ tools | length }}"}

    (tmp_path / "t.jinja").write_text("T {{ messages[0]['content'] }}")
    merge(MergeConfig(base, adapter0, tmp_path / "m", chat_template_file=tmp_path / "t.jinja"), progress=False)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    assert tok.apply_chat_template(chat, tokenize=False) == "T Hi"
    assert tok.apply_chat_template(chat, tools=[{"type": "function", "function": {"name": "f"}}], tokenize=False,
                                   chat_template="tool_use") == "TOOL 1"


def test_a_bases_named_template_that_is_no_file_name_is_refused_before_the_merge(pair, tmp_path, monkeypatch):
    """--chat-template-file saves the base's named templates as files (additional_chat_templates/NAME.jinja): a name
    that is none ("../x") was refused only after the whole merge, naming the temporary directory's copy of
    tokenizer_config.json; now --model's, before a tensor is merged."""
    import qerl_cli.merge as merge_mod
    from tests.helpers import CHAT_TEMPLATE

    base = tmp_path / "base"
    shutil.copytree(pair[0], base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    named = [{"name": "default", "template": CHAT_TEMPLATE}, {"name": "../x", "template": "X"}]
    (base / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=named)))
    (tmp_path / "t.jinja").write_text("T {{ messages[0]['content'] }}")
    merged = []
    real = merge_mod.write_checkpoint
    monkeypatch.setattr(merge_mod, "write_checkpoint", lambda *a, **k: (merged.append(1), real(*a, **k))[1])
    with pytest.raises(BadInputError, match="chat template name '../x' is no file name") as e:
        merge(MergeConfig(base, pair[1], tmp_path / "m", chat_template_file=tmp_path / "t.jinja"), progress=False)
    assert str(e.value).startswith(f"{base / 'tokenizer_config.json'}:") and not merged
    assert not (tmp_path / "m").exists() and not (tmp_path / "x.jinja").exists()
    # without the flag the list is copied as it is: nothing is written by name, and the merge runs
    merge(MergeConfig(base, pair[1], tmp_path / "m"), progress=False)
    assert json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())["chat_template"] == named
