"""PEFT round trips: our saved adapter works in peft on the dequantized base, and peft's adapter works here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from qerl_cli.adapters import adapter_hash, read_adapter_spec, save_adapter
from qerl_cli.errors import BadInputError
from qerl_cli.layers.lora import LoraSpec, lora_disabled, lora_parameters
from qerl_cli.models import load_model
from tests.helpers import PEFT_LAYER_FIELDS, make_tiny_hf_model
from tests.test_models import nvfp4_checkpoint, right_padded


def _randomize_lora(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _logits(model, ids, mask):
    with torch.no_grad():
        return model.compute_logits(model.forward_train(ids, mask))


@pytest.fixture
def nvfp4_dirs(tmp_path):
    src = make_tiny_hf_model(tmp_path, arch="qwen2", tokenizer=False)
    return nvfp4_checkpoint(src, tmp_path / "q")


def test_saved_adapter_loads_in_peft_on_dequantized_base(tmp_path, nvfp4_dirs):
    qdir, deq = nvfp4_dirs
    model = load_model(qdir, dtype=torch.float32, lora=LoraSpec(r=4, alpha=8))
    _randomize_lora(model)
    save_adapter(model, tmp_path / "adapter", base_model_path=qdir)
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["peft_type"] == "LORA"
    base = transformers.AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids, mask = right_padded()
    with torch.no_grad():
        ref = pm(input_ids=ids, attention_mask=mask).logits
    ours = _logits(model, ids, mask)
    with lora_disabled(model):
        base_only = _logits(model, ids, mask)
    m = mask[..., None].bool()
    assert (ours - base_only).abs().masked_select(m).max() > 1e-2  # the adapter matters...
    assert (ours - ref).abs().masked_select(m).max() < 1e-4  # ...and peft agrees with us


def _peft_adapter(deq, out, seed, **lora):
    """A PEFT adapter with random lora_B saved to ``out`` from the dequantized base; returns the PeftModel."""
    base = transformers.AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32)
    pm = peft.get_peft_model(base, peft.LoraConfig(**lora))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    pm.save_pretrained(out)
    return pm


def _peft_adapter_and_logits(deq, out, seed, **lora):
    """``_peft_adapter``, and PEFT's logits."""
    pm = _peft_adapter(deq, out, seed, **lora)
    ids, mask = right_padded()
    with torch.no_grad():
        return pm.eval()(input_ids=ids, attention_mask=mask).logits


def _assert_loads_as_peft(qdir, adapter, ref):
    ids, mask = right_padded()
    model = load_model(qdir, dtype=torch.float32, adapter_dir=adapter)
    assert (_logits(model, ids, mask) - ref).abs().masked_select(mask[..., None].bool()).max() < 1e-4


def test_peft_adapter_loads_here(tmp_path, nvfp4_dirs):
    qdir, deq = nvfp4_dirs
    ref = _peft_adapter_and_logits(deq, tmp_path / "peft", 3, r=8, lora_alpha=16,
                                   target_modules=["q_proj", "v_proj", "down_proj"])
    spec = read_adapter_spec(tmp_path / "peft")
    assert spec.r == 8 and spec.alpha == 16 and set(spec.targets) == {"q_proj", "v_proj", "down_proj"}
    _assert_loads_as_peft(qdir, tmp_path / "peft", ref)


def test_rank_mismatch_names_tensor(tmp_path, nvfp4_dirs):
    qdir, _ = nvfp4_dirs
    model = load_model(qdir, dtype=torch.float32, lora=LoraSpec(r=4, alpha=4))
    _randomize_lora(model)
    save_adapter(model, tmp_path / "a", base_model_path=qdir)
    with pytest.raises(BadInputError, match=r"lora_A.weight. has shape \(4, \d+\), the model expects \(8, \d+\)"):
        load_model(qdir, dtype=torch.float32, lora=LoraSpec(r=8, alpha=8), adapter_dir=tmp_path / "a")


def test_target_mismatch_names_tensor(tmp_path, nvfp4_dirs):
    qdir, _ = nvfp4_dirs
    model = load_model(qdir, dtype=torch.float32, lora=LoraSpec(r=4, alpha=4))
    _randomize_lora(model)
    save_adapter(model, tmp_path / "a", base_model_path=qdir)
    with pytest.raises(BadInputError, match="targets 'model.layers.0.mlp.down_proj'"):
        load_model(qdir, dtype=torch.float32, lora=LoraSpec(r=4, alpha=4, targets=("q_proj", "v_proj")),
                   adapter_dir=tmp_path / "a")


def test_adapter_that_changes_nothing_is_rejected(tmp_path, nvfp4_dirs):
    qdir, _ = nvfp4_dirs
    model = load_model(qdir, dtype=torch.float32, lora=LoraSpec(r=4, alpha=4))
    _randomize_lora(model)
    save_adapter(model, tmp_path / "a", base_model_path=qdir)
    path = tmp_path / "a" / "adapter_model.safetensors"
    sd = load_file(str(path))
    save_file({k: (torch.zeros_like(v) if "lora_A" in k else v) for k, v in sd.items()}, str(path))
    with pytest.raises(BadInputError, match="silent no-op"):
        load_model(qdir, dtype=torch.float32, adapter_dir=tmp_path / "a")


def test_fresh_adapter_round_trip_is_base_policy(tmp_path, nvfp4_dirs):
    qdir, _ = nvfp4_dirs
    model = load_model(qdir, dtype=torch.float32, lora=LoraSpec(r=4, alpha=4, seed=7))
    save_adapter(model, tmp_path / "a", base_model_path=qdir)
    again = load_model(qdir, dtype=torch.float32, adapter_dir=tmp_path / "a")
    for a, b in zip(lora_parameters(model), lora_parameters(again)):
        assert torch.equal(a, b)
    ids, mask = right_padded()
    with lora_disabled(again):
        assert torch.equal(_logits(again, ids, mask), _logits(model, ids, mask))


def test_unsupported_adapter_config(tmp_path, nvfp4_dirs):
    qdir, _ = nvfp4_dirs
    model = load_model(qdir, dtype=torch.float32, lora=LoraSpec(r=4, alpha=4))
    save_adapter(model, tmp_path / "a", base_model_path=qdir, extra_config={"use_dora": True})
    with pytest.raises(BadInputError, match="use_dora"):
        load_model(qdir, dtype=torch.float32, adapter_dir=tmp_path / "a")
    with pytest.raises(BadInputError, match="adapter_config.json: not found"):
        load_model(qdir, dtype=torch.float32, adapter_dir=tmp_path)


def test_adapter_inputs_hash_the_trained_norms_too(tmp_path):
    # rollout, eval and merge record these: editing norms.safetensors alone must make a different run.
    from qerl_cli.adapters import NORMS, adapter_hash, adapter_inputs

    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"w")
    assert adapter_inputs(tmp_path) == {"adapter": adapter_hash(tmp_path)}
    (tmp_path / NORMS).write_bytes(b"a")
    first = adapter_inputs(tmp_path)
    (tmp_path / NORMS).write_bytes(b"b")
    second = adapter_inputs(tmp_path)
    assert first["adapter"] == second["adapter"] == adapter_hash(tmp_path)
    assert first["adapter_norms"] != second["adapter_norms"]


@pytest.mark.parametrize("rslora", [False, True])
def test_adapter_config_is_the_lora_config_peft_builds(tmp_path, nvfp4_dirs, rslora):
    # save_adapter writes the config without importing peft; peft must read back exactly the
    # LoraConfig it would have built itself from the same settings.
    qdir, _ = nvfp4_dirs
    model = load_model(qdir, dtype=torch.float32, lora=LoraSpec(r=4, alpha=8, dropout=0.05, use_rslora=rslora,
                                                                 targets=("q_proj", "v_proj", "down_proj")))
    save_adapter(model, tmp_path / "a", base_model_path=qdir)
    ours = peft.LoraConfig.from_pretrained(tmp_path / "a").to_dict()
    theirs = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["down_proj", "q_proj", "v_proj"],
                             bias="none", task_type="CAUSAL_LM", use_rslora=rslora,
                             base_model_name_or_path=str(qdir)).to_dict()
    ours["target_modules"], theirs["target_modules"] = sorted(ours["target_modules"]), sorted(theirs["target_modules"])
    assert ours == theirs


def test_saving_an_adapter_does_not_import_peft(tmp_path):
    # The import costs seconds per train step (docs/benchmarks.md, "RL loop"); only tests need peft.
    code = (
        "import sys, torch\n"
        "from qerl_cli.adapters import save_adapter\n"
        "from qerl_cli.models import build_random_model\n"
        "from qerl_cli.layers.lora import LoraSpec\n"
        "from qerl_cli.models.config import ModelConfig\n"
        "cfg = ModelConfig(arch='qwen2', vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,"
        " num_kv_heads=1, head_dim=16)\n"
        "m = build_random_model(cfg, device='cpu', dtype=torch.float32, quantized=False, lora=LoraSpec(r=2, alpha=4))\n"
        f"save_adapter(m, {str(tmp_path / 'a')!r}, base_model_path='x')\n"
        "assert 'peft' not in sys.modules, 'save_adapter imported peft'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
    assert (tmp_path / "a" / "adapter_config.json").exists()


def test_an_adapter_trained_with_dropout_samples_without_it(tmp_path, nvfp4_dirs):
    # adapter_config.json keeps lora_dropout; rollout and eval load it and must sample the policy
    # itself (PEFT in eval mode applies no dropout), the same on every call.
    from qerl_cli.engine import LLMEngine, SamplingParams
    from qerl_cli.layers.lora import lora_parameters

    qdir, _ = nvfp4_dirs
    trained = load_model(qdir, dtype=torch.float32, lora=LoraSpec(r=4, alpha=8, dropout=0.5))
    with torch.no_grad():
        for p in lora_parameters(trained):
            p.normal_(0, 0.3)
    save_adapter(trained, tmp_path / "a", base_model_path=qdir)
    model = load_model(qdir, dtype=torch.float32, adapter_dir=tmp_path / "a")
    assert not any(m.training for m in model.modules())
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        a, b = (model.compute_logits(model.forward_train(ids)) for _ in range(2))
    assert torch.equal(a, b)
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=1)
    runs = [LLMEngine(model, None, max_num_seqs=4, block_size=4).generate([[3, 4, 5]], sp, n=2) for _ in range(2)]
    assert [c.logprobs for c in runs[0][0]] == [c.logprobs for c in runs[1][0]]


def test_a_config_without_lora_alpha_scales_as_peft_does(tmp_path, nvfp4_dirs):
    # PEFT reads a missing lora_alpha as LoraConfig's default (8), not as r.
    import json

    from qerl_cli.adapters import read_adapter_spec

    qdir, _ = nvfp4_dirs
    model = load_model(qdir, dtype=torch.float32, lora=LoraSpec(r=4, alpha=4))
    save_adapter(model, tmp_path / "a", base_model_path=qdir)
    cfg_path = tmp_path / "a" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["lora_alpha"]
    cfg_path.write_text(json.dumps(cfg))
    want = peft.LoraConfig.from_pretrained(tmp_path / "a").lora_alpha
    spec = read_adapter_spec(tmp_path / "a")
    assert spec.alpha == want == 8 and spec.scaling == 2.0


def test_int_and_float_alpha_write_the_same_config():
    # The Python API passed an int alpha through: `8` against the CLI's `8.0`, so one adapter had two
    # hashes and shards sampled with one were refused for the other (audit 2026-11-26).
    import json

    from qerl_cli.adapters import lora_config

    kw = dict(r=4, targets=["q_proj"], rslora=False, base_model_path="m")
    a = json.dumps(lora_config(alpha=8, dropout=0, **kw))
    assert a == json.dumps(lora_config(alpha=8.0, dropout=0.0, **kw)) and '"lora_alpha": 8.0' in a


@pytest.mark.parametrize("variant,match", [
    (dict(lora_bias=True), "lora_bias"),
    (dict(init_lora_weights="pissa"), "init_lora_weights='pissa'"),
    (dict(init_lora_weights="olora"), "init_lora_weights='olora'"),
    (dict(alora_invocation_tokens=[5, 6], task_type="CAUSAL_LM"), "alora_invocation_tokens"),
    # merge refused it as "trained tensor ...token_adapter.trainable_tokens_delta is not in --model"
    (dict(trainable_token_indices=[3, 5]), "trainable_token_indices is set"),
    # merge applied the layers of a [[1, 2], [0, 1]] stack to base layers 0 and 1, in the wrong order
    (dict(layer_replication=[[1, 2], [0, 1]]), "layer_replication is set"),
])
def test_lora_variants_that_are_not_plain_lora_are_refused(tmp_path, nvfp4_dirs, variant, match):
    # Real PEFT adapters whose saved tensors are not "base + scale * B @ A": PiSSA/OLoRA are relative to a
    # base PEFT rewrote, lora_bias adds a trained bias, aLoRA acts only after its invocation tokens. Both
    # the engine's loader and merge applied them as plain LoRA without a word (logits 0.3-0.75 off PEFT's;
    # merge dropped lora_B.bias, 2026-11-26 audit).
    from qerl_cli.merge import read_adapter

    qdir, deq = nvfp4_dirs
    base = transformers.AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32)
    pm = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **variant))
    pm.save_pretrained(tmp_path / "a")
    with pytest.raises(BadInputError, match=match):
        load_model(qdir, dtype=torch.float32, adapter_dir=tmp_path / "a")
    with pytest.raises(BadInputError, match=match):
        read_adapter(tmp_path / "a")


def test_lora_ga_adapter_is_refused(tmp_path, nvfp4_dirs):
    # LoRA-GA (init_lora_weights="lora_ga") subtracts scale * B0 @ A0 from the base weight at init, as PiSSA
    # does; PEFT converts it only with path_initial_model_for_weight_conversion. Saved as is, merge and the
    # loader applied it as plain LoRA: a merged model further from the trained policy than the base.
    from peft.tuners.lora.config import LoraGAConfig
    from peft.tuners.lora.loraga import preprocess_loraga

    from qerl_cli.merge import read_adapter

    qdir, deq = nvfp4_dirs
    base = transformers.AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="lora_ga",
                          lora_ga_config=LoraGAConfig())
    ids = torch.arange(8).unsqueeze(0)
    preprocess_loraga(base, cfg, lambda: base(ids, labels=ids).loss.backward())
    peft.get_peft_model(base, cfg).save_pretrained(tmp_path / "a")
    with pytest.raises(BadInputError, match="init_lora_weights='lora_ga'"):
        load_model(qdir, dtype=torch.float32, adapter_dir=tmp_path / "a")
    with pytest.raises(BadInputError, match="init_lora_weights='lora_ga'"):
        read_adapter(tmp_path / "a")


def test_adapter_without_target_modules_is_bad_input(tmp_path, nvfp4_dirs):
    qdir, _ = nvfp4_dirs
    model = load_model(qdir, dtype=torch.float32, lora=LoraSpec(r=4, alpha=4))
    save_adapter(model, tmp_path / "a", base_model_path=qdir, extra_config={"target_modules": None})
    with pytest.raises(BadInputError, match="target_modules"):  # was a TypeError traceback
        read_adapter_spec(tmp_path / "a")


def test_peft_targets_named_as_dotted_suffixes_load(tmp_path, nvfp4_dirs):
    # PEFT matches "self_attn.q_proj" as a suffix of the module path; the loader said it matched no Linear.
    qdir, deq = nvfp4_dirs
    ref = _peft_adapter_and_logits(deq, tmp_path / "peft", 5, r=4, lora_alpha=8,
                                   target_modules=["self_attn.q_proj", "mlp.down_proj"])
    assert set(read_adapter_spec(tmp_path / "peft").targets) == {"q_proj", "down_proj"}
    _assert_loads_as_peft(qdir, tmp_path / "peft", ref)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_steps_files_get_the_mode_the_umask_gives_any_file(tmp_path, umask):
    # safetensors 0.8's save_file wrote adapter_model, optimizer and norms files 0600: a teammate, or a
    # vLLM server running as another user, could not read the adapter (docs audit, session 44)
    import os

    from tests.train_fixtures import make_shard, quantized_tiny_with_hash, quick_step

    q, base = quantized_tiny_with_hash(tmp_path / "m")
    old = os.umask(umask)
    try:
        quick_step(q, make_shard(tmp_path / "sh", base), tmp_path / "a", train_norms=True)
        (tmp_path / "plain").write_text("x")
    finally:
        os.umask(old)
    want = (tmp_path / "plain").stat().st_mode & 0o777
    assert want == 0o666 & ~umask
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "a").iterdir() if p.suffix == ".safetensors"}
    assert set(modes) == {"adapter_model.safetensors", "optimizer.safetensors", "norms.safetensors"}, modes
    assert set(modes.values()) == {want}, modes


def test_saved_adapter_loads_over_the_nvfp4_dir_as_the_docs_say(tmp_path, nvfp4_dirs):
    # docs/train-step.md: adapter_config.json names the NVFP4 QDIR; transformers keeps its Linears
    # compressed unless told to decompress, and PEFT then fails on the missing `.weight`.
    qdir, _ = nvfp4_dirs
    model = load_model(qdir, dtype=torch.float32, lora=LoraSpec(r=4, alpha=8))
    _randomize_lora(model)
    save_adapter(model, tmp_path / "adapter", base_model_path=qdir)
    pm = peft.AutoPeftModelForCausalLM.from_pretrained(
        tmp_path / "adapter", dtype=torch.bfloat16,
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True)).eval()
    ids, mask = right_padded()
    with torch.no_grad():
        ref = pm(input_ids=ids, attention_mask=mask).logits.float()
    ours = _logits(model, ids, mask)
    m = mask[..., None].bool()
    with lora_disabled(model):
        base_only = _logits(model, ids, mask)
    assert (ours - base_only).abs().masked_select(m).max() > 0.2  # the adapter matters (0.96 here)...
    assert (ours - ref).abs().masked_select(m).max() < 0.02  # ...and bf16 PEFT agrees with fp32 qerl (0.007)


def test_an_adapter_saved_as_bin_names_why(tmp_path, nvfp4_dirs):
    """A PEFT adapter saved with safe_serialization=False was refused as a bare "not found"."""
    q, _ = nvfp4_dirs
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(nvfp4_dirs[1]), dtype=torch.float32)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    pm.save_pretrained(str(tmp_path / "bin"), safe_serialization=False)
    assert not (tmp_path / "bin" / "adapter_model.safetensors").exists()
    with pytest.raises(BadInputError, match="adapter_model.bin, a pickle") as e:
        load_model(str(q), device="cpu", dtype=torch.float32, adapter_dir=str(tmp_path / "bin"))
    assert "safe_serialization=True" in str(e.value)


ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture
def three_layer_dirs(tmp_path):
    src = make_tiny_hf_model(tmp_path, arch="qwen2", layers=3, tokenizer=False)
    return nvfp4_checkpoint(src, tmp_path / "q3")


# PEFT_LAYER_FIELDS (per-layer fields as PEFT writes them), exclude_modules taking a target out of one layer, and a
# regex target_modules over one layer
SOME_LAYERS = {**PEFT_LAYER_FIELDS, "exclude_one_layer": dict(exclude_modules=["model.layers.0.self_attn.q_proj"]),
               "regex_one_layer": dict(target_modules=r".*\.1\.(self_attn|mlp)\.(q|v|down)_proj")}


@pytest.mark.parametrize("fields", list(SOME_LAYERS.values()), ids=list(SOME_LAYERS))
def test_an_adapter_on_some_layers_loads_as_peft_applies_it(tmp_path, three_layer_dirs, fields):
    # Refused by rollout, eval and rollout's vLLM engine ("layers_to_transform is not supported", "it covers only some
    # layers"): an SFT adapter trained on the top layers could only be merged. Loaded now as PEFT applies it: LoRA on
    # every layer of each target, with B = 0 where PEFT puts none.
    from qerl_cli.adapters import peft_leaves_out
    from qerl_cli.layers.lora import lora_modules

    qdir, deq = three_layer_dirs
    ref = _peft_adapter_and_logits(deq, tmp_path / "peft", 3, r=4, lora_alpha=8,
                                   **{"target_modules": ALL_TARGETS, **fields})
    ids, mask = right_padded()
    model = load_model(qdir, dtype=torch.float32, adapter_dir=tmp_path / "peft")
    ours = _logits(model, ids, mask)
    with lora_disabled(model):
        base = _logits(model, ids, mask)
    m = mask[..., None].bool()
    assert (ours - ref).abs().masked_select(m).max() < 1e-4 < (ours - base).abs().masked_select(m).max()
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    left = {n for n, lin in lora_modules(model) if peft_leaves_out(cfg, n)}
    assert left and all(not lin.lora_B.any() for n, lin in lora_modules(model) if n in left)
    assert all(lin.lora_B.any() for n, lin in lora_modules(model) if n not in left)


def test_layers_to_transform_naming_every_layer_is_the_plain_adapter(tmp_path, nvfp4_dirs):
    qdir, deq = nvfp4_dirs
    _peft_adapter_and_logits(deq, tmp_path / "peft", 3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    every = _edited(tmp_path / "peft", tmp_path / "every", layers_to_transform=[0, 1])
    ids, mask = right_padded()
    plain = _logits(load_model(qdir, dtype=torch.float32, adapter_dir=tmp_path / "peft"), ids, mask)
    assert torch.equal(_logits(load_model(qdir, dtype=torch.float32, adapter_dir=every), ids, mask), plain)


def test_a_pair_peft_wraps_missing_from_an_adapter_on_some_layers_is_refused(tmp_path, nvfp4_dirs):
    # Layer 0 is left out (B = 0), but layer 1's q_proj is one PEFT wraps: a file without its pair is damaged.
    qdir, deq = nvfp4_dirs
    _peft_adapter_and_logits(deq, tmp_path / "peft", 3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             layers_to_transform=[1])
    path = tmp_path / "peft" / "adapter_model.safetensors"
    save_file({k: v for k, v in load_file(str(path)).items() if "layers.1.self_attn.q_proj" not in k}, str(path))
    with pytest.raises(BadInputError, match=r"no lora_A/lora_B for 'model\.layers\.1\.self_attn\.q_proj', a module "
                                            "adapter_config.json has PEFT wrap"):
        load_model(qdir, dtype=torch.float32, adapter_dir=tmp_path / "peft")


# Configs whose adapters PEFT wraps on only some modules: per-layer fields, exclusions, a full name beside a layer
# filter (PEFT takes it in any layer), a regex, modules_to_save taking a target, target_parameters beside exclusions
PEFT_WRAPPING = {
    **PEFT_LAYER_FIELDS,
    "full_name_and_layers": dict(target_modules=["model.layers.0.self_attn.q_proj", "v_proj"], layers_to_transform=[1]),
    "regex_and_exclude": dict(target_modules=r".*\.(q|v)_proj", exclude_modules=["model.layers.2.self_attn.q_proj"]),
    "modules_to_save": dict(target_modules=["q_proj", "v_proj", "o_proj"], modules_to_save=["o_proj"]),
    "target_parameters": dict(target_modules=["v_proj"], target_parameters=["self_attn.q_proj.weight"],
                              exclude_modules=["model.layers.0.self_attn.v_proj"]),
}


@pytest.mark.parametrize("fields", list(PEFT_WRAPPING.values()), ids=list(PEFT_WRAPPING))
def test_peft_leaves_out_exactly_the_modules_peft_does_not_wrap(tmp_path, fields):
    # The readers' check against the real PEFT: the modules get_peft_model wraps, by the adapter_config.json it saves
    from qerl_cli.adapters import peft_leaves_out

    hf = make_tiny_hf_model(tmp_path, arch="qwen2", layers=3, tokenizer=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    names = [n for n, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None]
    pm = peft.get_peft_model(model, peft.LoraConfig(r=2, **{"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                               "gate_proj", "up_proj", "down_proj"],
                                                            **fields}))
    wraps = {n.removeprefix("base_model.model.") for n, m in pm.named_modules() if hasattr(m, "lora_A")}
    pm.save_pretrained(tmp_path / "ad")
    cfg = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    mine = {n for n in names if peft_leaves_out(cfg, n) is None}
    assert wraps and mine == wraps, (sorted(mine - wraps), sorted(wraps - mine))


def _edited(src: Path, dst: Path, **fields) -> Path:
    """A copy of the adapter ``src`` whose adapter_config.json also says ``fields`` (its tensors unchanged)."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps(dict(cfg, **fields)))
    return dst


@pytest.mark.parametrize("fields", [dict(exclude_modules=["v_proj"]), dict(exclude_modules=r".*\.1\..*"),
                                    dict(layers_to_transform=0)], ids=["exclude_list", "exclude_regex", "layers_0"])
def test_pairs_peft_would_not_load_are_refused_by_every_stage(tmp_path, nvfp4_dirs, fields):
    # rollout, train-step and eval applied every pair in the file: exclude_modules was not read, and
    # layers_to_transform=0 passed as unset (`if cfg.get(key)`), so these adapters ran another policy than PEFT's
    # (max logit difference 0.86 and 0.61 on this model)
    from qerl_cli.adapters import load_adapter

    qdir, deq = nvfp4_dirs
    _peft_adapter_and_logits(deq, tmp_path / "peft", 3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    bad = _edited(tmp_path / "peft", tmp_path / "bad", **fields)
    why = r"LoRA tensors of 'model\.layers\.\d\.self_attn\.._proj', which (exclude_modules .*|layers_to_transform 0 leaves " \
          r"out): PEFT would not load them"
    with pytest.raises(BadInputError, match=why):  # the native engine: rollout, eval, train-step's model
        load_model(qdir, dtype=torch.float32, adapter_dir=bad)
    with pytest.raises(BadInputError, match=why):  # rollout's vLLM engine and train-step resuming read this first
        read_adapter_spec(bad)
    with pytest.raises(BadInputError, match=why):  # and the loader itself, given the layout (train-step)
        load_adapter(load_model(qdir, dtype=torch.float32, lora=LoraSpec(r=4, alpha=8, targets=("q_proj", "v_proj"))),
                     bad)


def test_layers_to_transform_beside_a_regex_target_modules_is_refused_as_peft_refuses_it(tmp_path, nvfp4_dirs):
    # PEFT's LoraConfig refuses the pair (its regex alone picks the modules); once rollout and eval took
    # layers_to_transform, they applied every pair the regex matched, layer 0's too, the field dropped without a word
    qdir, deq = nvfp4_dirs
    _peft_adapter(deq, tmp_path / "peft", 3, r=4, lora_alpha=8, target_modules=r".*\.(q|v)_proj")
    bad = _edited(tmp_path / "peft", tmp_path / "bad", layers_to_transform=[1])
    base = transformers.AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32)
    with pytest.raises(ValueError, match="`layers_to_transform` cannot be used when `target_modules` is a str"):
        peft.PeftModel.from_pretrained(base, bad)
    with pytest.raises(BadInputError, match=r"layers_to_transform \[1\] with a regex target_modules .* PEFT refuses"):
        load_model(qdir, dtype=torch.float32, adapter_dir=bad)


def test_a_peft_adapter_excluding_a_target_from_every_layer_loads(tmp_path, nvfp4_dirs):
    # PEFT saves no pair of a target exclude_modules takes out of every layer; the loader put LoRA on it anyway (from
    # target_modules) and refused the adapter as "no lora_A/lora_B for ...v_proj". It is plain LoRA on the others.
    qdir, deq = nvfp4_dirs
    ref = _peft_adapter_and_logits(deq, tmp_path / "peft", 3, r=4, lora_alpha=8,
                                   target_modules=["q_proj", "v_proj", "down_proj"], exclude_modules=["v_proj"])
    assert set(read_adapter_spec(tmp_path / "peft").targets) == {"q_proj", "down_proj"}
    _assert_loads_as_peft(qdir, tmp_path / "peft", ref)


@pytest.fixture(scope="module")
def twin(qmodel, tmp_path_factory):
    """(QDIR of the tiny quantized model with its tokenizer, base hash, its fp32 dequantized twin for PEFT)."""
    from tests.train_fixtures import dequantized_twin

    q, qhash = qmodel
    return q, qhash, dequantized_twin(q, tmp_path_factory.mktemp("twin") / "deq")


def test_an_adapter_on_some_layers_rolls_out_and_evals_through_the_cli(twin, tmp_path):
    # an SFT adapter trained with LoRA on the top layer only: both stages refused it ("layers_to_transform is not
    # supported"); eval's lora_modules counts the Linears it adapts, not the zero LoRA of the layer left out
    from qerl_cli.shards import read_records
    from tests.reliability_fixtures import ANSWERED_ROWS, invoke, write_jsonl

    q, _, deq = twin
    _peft_adapter(deq, tmp_path / "top", 3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             layers_to_transform=[1])
    rows = write_jsonl(tmp_path / "rows.jsonl", ANSWERED_ROWS)
    common = ["--model", q, "--adapter", tmp_path / "top", "--max-new-tokens", 3, "--device", "cpu", "-q"]
    r = invoke(["rollout", "--prompts", rows, "--out", tmp_path / "ro", "-G", 2, *common])
    assert r.exit_code == 0, (r.stderr, r.exception)
    assert len(read_records(tmp_path / "ro")) == 8
    r = invoke(["eval", "--dataset", rows, "--out", tmp_path / "ev", *common])
    assert r.exit_code == 0, (r.stderr, r.exception)
    assert json.loads((tmp_path / "ev" / "metrics.json").read_text())["lora_modules"] == 2


@pytest.mark.parametrize("fields,field", [(dict(layers_to_transform=[1]), "layers_to_transform [1] leaves out"),
                                          (dict(exclude_modules=["model.layers.0.self_attn.q_proj"]),
                                           "exclude_modules ['model.layers.0.self_attn.q_proj'] excludes"),
                                          (dict(layers_to_transform=[0, 1]), None)],
                         ids=["layers_to_transform", "exclude_modules", "every_layer"])
def test_train_step_refuses_to_continue_an_adapter_on_some_layers(twin, tmp_path, fields, field):
    # A step trains LoRA on every layer of its targets and writes an adapter_config.json without these fields: it
    # continued such an adapter (once the loader took it) into one adapting the layers it left out, without a word.
    # Refused before the model loads, naming the field; one that names every layer is the plain adapter and trains.
    from qerl_cli.adapters import adapter_hash
    from tests.train_fixtures import make_shard, quick_step

    q, qhash, deq = twin
    _peft_adapter(deq, tmp_path / "a", 3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **fields)
    shard = make_shard(tmp_path / "sh", qhash, adapter_hash=adapter_hash(tmp_path / "a"), step=1)
    if field is None:
        quick_step(q, shard, tmp_path / "out", adapter=tmp_path / "a")
        assert "layers_to_transform" not in json.loads((tmp_path / "out" / "adapter_config.json").read_text())
        return
    with pytest.raises(BadInputError, match=rf"adapter_config.json {re.escape(field)} 'model.layers.0.self_attn.q_proj'"
                                            ".*train-step trains LoRA on every layer.*change the adapter's layout") as e:
        quick_step(q, shard, tmp_path / "out", adapter=tmp_path / "a")
    assert "qerl merge" in e.value.hint and not (tmp_path / "out").exists()


def test_train_step_refusing_an_adapter_on_some_layers_hints_the_merge_dtype_of_the_base(twin, tmp_path):
    # The hint said `--dtype nvfp4` whatever --model was: on a plain HF base (the 16-bit baseline) that merge is an
    # NVFP4 model, another experiment, which --baseline bf16 then refuses. It names the dtype that keeps the base's.
    from qerl_cli.adapters import adapter_hash
    from tests.train_fixtures import base_hash_of, make_shard, quick_step

    q, qhash, deq = twin
    _peft_adapter(deq, tmp_path / "a", 3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[1])
    for model, base_hash, dtype in ((q, qhash, "nvfp4"), (deq, base_hash_of(deq), "bf16")):
        shard = make_shard(tmp_path / f"sh-{dtype}", base_hash, adapter_hash=adapter_hash(tmp_path / "a"), step=1)
        with pytest.raises(BadInputError, match="train-step trains LoRA on every layer") as e:
            quick_step(model, shard, tmp_path / f"out-{dtype}", adapter=tmp_path / "a")
        assert f"(--dtype {dtype})" in e.value.hint


def test_a_head_pair_peft_drops_on_an_untied_base_is_refused_by_every_reader(tmp_path, monkeypatch):
    # ensure_weight_tying lets an lm_head pair through only where the base ties its head to the LoRA'd embedding; on an
    # untied base PEFT ties nothing and drops a hand-added head pair. Merge refused it (review s57r11), but only merge
    # knew the base: rollout's and eval's vLLM engine handed the file to vLLM, which applies the pairs in it (another
    # policy than PEFT's), and the native engine and train-step refused it for another reason ("LoRA targets
    # ['embed_tokens'] match no Linear"). One check, given the base (adapters.check_peft_wraps), serves every reader.
    from qerl_cli.engine_vllm import VLLMEngine
    from qerl_cli.merge import MergeConfig, merge
    from tests.test_merge import IDS, add_pairs, make_peft_adapter, peft_logits
    from tests.test_rollout_vllm import _fake_vllm
    from tests.train_fixtures import base_hash_of, make_shard, quick_step

    base = make_tiny_hf_model(tmp_path, arch="llama", hidden=32, layers=1, dtype=torch.float32, tokenizer=False)
    with pytest.warns(UserWarning, match="no tied modules were found"):
        adapter = make_peft_adapter(base, tmp_path / "ad", r=2, alpha=4, scale=0.2, targets=["q_proj", "embed_tokens"],
                                    ensure_weight_tying=True, trainer_state=False)
    ref = peft_logits(base, adapter, IDS % 300)
    add_pairs(adapter, base)
    assert torch.equal(peft_logits(base, adapter, IDS % 300), ref)  # PEFT drops the pair
    why = (r"LoRA tensors of 'lm_head', which target_modules .* does not name, and ensure_weight_tying ties nothing in "
           rf"--model {re.escape(str(base))} \(its head is untied\): PEFT would not load them")
    seen: dict = {}
    _fake_vllm(monkeypatch, seen)
    with pytest.raises(BadInputError, match=why):  # rollout's and eval's --engine vllm
        VLLMEngine(base, adapter_dir=adapter, dtype="bf16", max_num_seqs=1, max_model_len=None, seed=0)
    assert "kw" not in seen  # refused before vLLM started
    with pytest.raises(BadInputError, match=why):  # rollout's and eval's native engine
        load_model(base, dtype=torch.float32, adapter_dir=adapter)
    shard = make_shard(tmp_path / "sh", base_hash_of(base), adapter_hash=adapter_hash(adapter), step=1)
    with pytest.raises(BadInputError, match=why):  # train-step continuing it
        quick_step(base, shard, tmp_path / "step", adapter=adapter, lora_rank=None)
    with pytest.raises(BadInputError, match=why):
        merge(MergeConfig(base, adapter, tmp_path / "m"), progress=False)
