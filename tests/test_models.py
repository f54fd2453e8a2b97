"""The qerl decoder equals Hugging Face's on tiny random models (dense and NVFP4), and bad checkpoints fail clearly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from qerl_kernels import reference
from safetensors.torch import load_file, save_file

from qerl_cli.errors import BadInputError
from qerl_cli.models import ModelConfig, build_random_model, load_model
from tests.helpers import make_tiny_hf_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def nvfp4_checkpoint(src, dst, keep_dense=()):
    """Rewrite a dense HF dir as a compressed-tensors NVFP4 one; also return the dequantized fp32 HF dir."""
    dst.mkdir()
    deq = dst.parent / (dst.name + "-deq")
    deq.mkdir()
    sd = load_file(str(src / "model.safetensors"))
    q, d = {}, {}
    for name, t in sd.items():
        mod = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and mod.endswith(LINEARS) and not mod.endswith(tuple(keep_dense)):
            packed, scale, g = reference.quantize(t)
            q[f"{mod}.weight_packed"], q[f"{mod}.weight_scale"], q[f"{mod}.weight_global_scale"] = packed, scale, g
            d[name] = reference.dequantize(packed, scale, g, torch.float32)
        else:
            q[name] = t
            d[name] = t.float()
    save_file(q, str(dst / "model.safetensors"))
    save_file(d, str(deq / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    (deq / "config.json").write_text(json.dumps(cfg))
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
            "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
                        "dynamic": False}}}}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, deq


def right_padded(batch=3, length=12, vocab=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for b in range(1, batch):
        mask[b, length - 3 * b:] = 0
    return ids * mask, mask


def hf_logits(model_dir, ids, mask):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask).logits


def ours(model, ids, mask):
    with torch.no_grad():
        return model.compute_logits(model.forward_train(ids, mask))


def assert_close_on_mask(a, b, mask, atol=1e-4):
    diff = ((a - b).abs() * mask[..., None]).max().item()
    assert diff <= atol, f"max |diff| on real tokens = {diff}"


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "mistral"])
def test_dense_logits_equal_hf(tmp_path, arch):
    src = make_tiny_hf_model(tmp_path, arch=arch, dtype=torch.float32, tokenizer=False)
    ids, mask = right_padded()
    model = load_model(src, dtype=torch.float32)
    assert not model.is_quantized
    assert_close_on_mask(ours(model, ids, mask), hf_logits(src, ids, mask), mask)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_nvfp4_logits_equal_hf_on_dequantized(tmp_path, arch):
    src = make_tiny_hf_model(tmp_path, arch=arch, dtype=torch.bfloat16, tokenizer=False)
    qdir, deq = nvfp4_checkpoint(src, tmp_path / "q")
    model = load_model(qdir, dtype=torch.float32)
    assert model.is_quantized
    assert model.model.layers[0].self_attn.q_proj.quantized and not model.lm_head.quantized
    ids, mask = right_padded()
    assert_close_on_mask(ours(model, ids, mask), hf_logits(deq, ids, mask), mask)


def test_ignored_linear_stays_dense(tmp_path):
    src = make_tiny_hf_model(tmp_path, arch="llama", dtype=torch.float32, tokenizer=False)
    qdir, deq = nvfp4_checkpoint(src, tmp_path / "q", keep_dense=("down_proj",))
    model = load_model(qdir, dtype=torch.float32)
    mlp = model.model.layers[1].mlp
    assert mlp.gate_proj.quantized and not mlp.down_proj.quantized
    ids, mask = right_padded()
    assert_close_on_mask(ours(model, ids, mask), hf_logits(deq, ids, mask), mask)


def test_tied_embeddings_and_sharded_checkpoint(tmp_path):
    src = make_tiny_hf_model(tmp_path, arch="qwen2", dtype=torch.float32, tie_word_embeddings=True,
                             max_shard_size="40KB", tokenizer=False)
    assert (src / "model.safetensors.index.json").exists()
    model = load_model(src, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids, mask = right_padded()
    assert_close_on_mask(ours(model, ids, mask), hf_logits(src, ids, mask), mask)


def test_bf16_load_keeps_dtype_and_hash(tmp_path):
    src = make_tiny_hf_model(tmp_path, arch="qwen2", tokenizer=False)
    model = load_model(src, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.base_hash
    ids, mask = right_padded()
    assert ours(model, ids, mask).dtype == torch.float32


def test_left_padding_is_rejected(tmp_path):
    model = build_random_model(ModelConfig.from_hf(_tiny_cfg()), device="cpu", dtype=torch.float32, quantized=False)
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="right-padded"):
        model.forward_train(ids, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))


def _tiny_cfg(**kw):
    cfg = dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)
    cfg.update(kw)
    return cfg


def test_random_nvfp4_model_is_finite():
    model = build_random_model(ModelConfig.from_hf(_tiny_cfg()), device="cpu", dtype=torch.float32, quantized=True)
    assert model.is_quantized
    logits = ours(model, *right_padded(vocab=64))
    assert torch.isfinite(logits).all()


# ---- bad input -------------------------------------------------------------------------------
def test_unknown_architecture(tmp_path):
    src = make_tiny_hf_model(tmp_path, arch="llama", tokenizer=False)
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BadInputError, match="unsupported architecture model_type='gpt2'"):
        load_model(src)


def test_missing_tensor_is_named(tmp_path):
    src = make_tiny_hf_model(tmp_path, arch="llama", tokenizer=False)
    sd = load_file(str(src / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(src / "model.safetensors"))
    with pytest.raises(BadInputError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(src)


def test_shape_mismatch_is_named(tmp_path):
    src = make_tiny_hf_model(tmp_path, arch="llama", tokenizer=False)
    sd = load_file(str(src / "model.safetensors"))
    sd["model.layers.0.self_attn.o_proj.weight"] = sd["model.layers.0.self_attn.o_proj.weight"][:, :32].contiguous()
    save_file(sd, str(src / "model.safetensors"))
    with pytest.raises(BadInputError, match=r"o_proj.weight' has shape \(64, 32\), expected \(64, 64\)"):
        load_model(src)


def test_missing_config_and_weights(tmp_path):
    with pytest.raises(BadInputError, match="config.json: not found"):
        load_model(tmp_path)
    src = make_tiny_hf_model(tmp_path, arch="llama", tokenizer=False)
    shutil.move(src / "model.safetensors", tmp_path / "elsewhere.safetensors")
    with pytest.raises(BadInputError, match="no \\*.safetensors"):
        load_model(src)


def test_unsupported_quantization(tmp_path):
    src = make_tiny_hf_model(tmp_path, arch="llama", tokenizer=False)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BadInputError, match="quant_method='gptq'"):
        load_model(src)


def test_config_parsing_llama3_rope_and_eos_list():
    cfg = ModelConfig.from_hf(_tiny_cfg(model_type="llama", eos_token_id=[5, 7], rope_theta=5e5, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}))
    assert cfg.eos_token_ids == (5, 7) and cfg.rope_theta == 5e5 and cfg.rope_scaling["rope_type"] == "llama3"
    assert not cfg.qkv_bias and not cfg.qk_norm
    with pytest.raises(BadInputError, match="hidden_act"):
        ModelConfig.from_hf(_tiny_cfg(hidden_act="gelu"))


def test_qwen_sliding_window_caps_only_where_some_layer_slides():
    # HF's Qwen2/3 slide only in layers >= max_window_layers; a window no layer uses capped the context.
    base = dict(model_type="qwen2", use_sliding_window=True, sliding_window=16)
    layers = _tiny_cfg(**base)["num_hidden_layers"]
    assert ModelConfig.from_hf(_tiny_cfg(**base, max_window_layers=layers)).sliding_window is None
    assert ModelConfig.from_hf(_tiny_cfg(**base, max_window_layers=layers - 1)).sliding_window == 16
    # No max_window_layers: HF's default 28, so these 2 layers do not slide (qerl once capped them).
    assert ModelConfig.from_hf(_tiny_cfg(**base)).sliding_window is None
    assert ModelConfig.from_hf(_tiny_cfg(**base, num_hidden_layers=30)).sliding_window == 16
    assert ModelConfig.from_hf(_tiny_cfg(**{**base, "use_sliding_window": False})).sliding_window is None
    assert ModelConfig.from_hf(_tiny_cfg(model_type="mistral", sliding_window=16)).sliding_window == 16
    # An explicit layer_types decides, as in HF (it once lost to max_window_layers), and a missing
    # sliding_window is HF's default 4096 (Mistral: it once meant no window), null none.
    types = ["full_attention", "sliding_attention"]
    assert ModelConfig.from_hf(_tiny_cfg(**base, max_window_layers=2, layer_types=types)).sliding_window == 16
    assert ModelConfig.from_hf(_tiny_cfg(**base, max_window_layers=0, layer_types=types[:1] * 2)).sliding_window is None
    assert ModelConfig.from_hf(_tiny_cfg(model_type="mistral")).sliding_window == 4096
    assert ModelConfig.from_hf(_tiny_cfg(model_type="mistral", sliding_window=None)).sliding_window is None
    assert ModelConfig.from_hf(_tiny_cfg(model_type="qwen2", use_sliding_window=True, max_window_layers=0)).sliding_window == 4096


def _hf_checkpoint(tmp_path, hf_config, patch=(), drop=()):
    """A tiny random HF model saved from ``hf_config``, its config.json then edited by hand (``patch``,
    ``drop``): the forms transformers reads but would not write itself."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(0, 0.1)
    out = tmp_path / "hf"
    model.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(dict(patch))
    for key in drop:
        cfg.pop(key, None)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
_LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize("case", ["theta_in_dict_wins", "llama3_orig_defaults_to_max_pos", "llama3_orig_top_level_wins"])
def test_rope_parameters_are_read_as_transformers_reads_them(tmp_path, case):
    # Each form once gave logits 1.8-2.3 away from HF's or a bare KeyError (audit 2026-11-26).
    patch, drop = {
        "theta_in_dict_wins": ({"rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}, ()),
        "llama3_orig_defaults_to_max_pos": ({"rope_parameters": _LLAMA3}, ()),
        "llama3_orig_top_level_wins": ({"rope_parameters": {**_LLAMA3, "original_max_position_embeddings": 128},
                                        "original_max_position_embeddings": 16}, ()),
    }[case]
    src = _hf_checkpoint(tmp_path, transformers.LlamaConfig(**_LLAMA), patch, drop)
    ids, mask = right_padded(length=40, vocab=256)
    assert_close_on_mask(ours(load_model(src, dtype=torch.float32), ids, mask), hf_logits(src, ids, mask), mask)


def test_qwen2_layer_types_window_is_refused_past_it_and_equal_within(tmp_path):
    cfg = transformers.Qwen2Config(**_LLAMA, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    src = _hf_checkpoint(tmp_path, cfg, {"max_window_layers": 2, "layer_types": ["full_attention", "sliding_attention"]})
    model = load_model(src, dtype=torch.float32)
    assert model.config.sliding_window == 16
    with pytest.raises(ValueError, match="exceeds sliding_window 16"):
        ours(model, *right_padded(length=40, vocab=256))
    ids, mask = right_padded(length=16, vocab=256)
    assert_close_on_mask(ours(model, ids, mask), hf_logits(src, ids, mask), mask)


def test_rope_and_activation_forms_qerl_cannot_compute_are_refused_by_name():
    llama = dict(_tiny_cfg(model_type="llama"))
    for rope, match in [({"rope_type": "yarn", "factor": 4.0}, "rope_type 'yarn' is not supported"),
                        ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic'"),
                        ({"rope_type": "llama3", "factor": 8.0}, "needs a positive number 'low_freq_factor'"),
                        ({"rope_type": "linear"}, "needs a positive number 'factor'"),
                        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
                        ({"rope_type": "default", "rope_theta": -1}, "invalid rope_theta")]:
        with pytest.raises(BadInputError, match=match):
            ModelConfig.from_hf({**llama, "rope_parameters": rope})
    assert ModelConfig.from_hf({**llama, "hidden_act": "swish"}).arch == "llama"  # transformers' SiLU too


@pytest.mark.parametrize("quantized", [True, False])
def test_fused_projections_keep_logits_and_share_memory(quantized):
    from qerl_cli.layers.attention import fuse_projections
    from qerl_cli.layers.lora import LoraSpec, lora_parameters

    model = build_random_model(ModelConfig.from_hf(_tiny_cfg()), device="cpu", dtype=torch.float32,
                               quantized=quantized, lora=LoraSpec(r=4, alpha=8, targets=("q_proj", "v_proj", "up_proj")))
    with torch.no_grad():
        for p in lora_parameters(model):
            p.normal_(0, 0.1)
    ids, mask = right_padded(vocab=64)
    before = ours(model, ids, mask)
    assert fuse_projections(model) == 2 * model.config.num_layers
    after = ours(model, ids, mask)
    assert torch.allclose(before, after, atol=1e-5)
    attn = model.model.layers[0].self_attn
    fused = attn._qkv[0]
    name = "weight_packed" if quantized else "weight"
    # q_proj's tensor is a view into the fused one: no second copy of the weights
    assert getattr(attn.q_proj.base, name).data_ptr() == getattr(fused, name).data_ptr()
    loss = model.compute_logits(model.forward_train(ids, mask)).logsumexp(-1).mean()
    loss.backward()  # the fused path stays differentiable for training
    assert all(p.grad is not None for p in lora_parameters(model))


def test_loads_qerl_quantize_output(tmp_path):
    """The loader reads what `qerl quantize` writes; shared q/k/v and gate/up global scales let it fuse."""
    from qerl_cli.layers.attention import fuse_projections
    from tests.train_fixtures import dequantized_twin, quantized_tiny

    _, qdir = quantized_tiny(tmp_path)
    deq = dequantized_twin(qdir, tmp_path / "deq")
    model = load_model(qdir, dtype=torch.float32)
    assert model.is_quantized and model.model.layers[0].mlp.down_proj.quantized
    ids, mask = right_padded(vocab=384)
    assert_close_on_mask(ours(model, ids, mask), hf_logits(deq, ids, mask), mask)
    assert fuse_projections(model) == 2 * model.config.num_layers


def test_modelopt_checkpoint_is_named(tmp_path):
    src = make_tiny_hf_model(tmp_path, arch="llama", tokenizer=False)
    (src / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    with pytest.raises(BadInputError, match="ModelOpt"):
        load_model(src)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_absent_config_keys_take_transformers_defaults(arch):
    # qerl used 4096 positions and hidden / heads for every architecture: a Qwen3 config without head_dim
    # (transformers: 128) was refused, a llama3-rope config without max_position_embeddings (transformers:
    # 2048) rotated differently, silently (audit, 2026-11-26).
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[arch]
    heads = 64  # divisible by every default KV head count
    kw = dict(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=heads)
    ref = cls(**kw)
    ours_cfg = ModelConfig.from_hf(dict(kw, model_type=arch))
    assert ours_cfg.num_kv_heads == ref.num_key_value_heads
    assert ours_cfg.head_dim == (getattr(ref, "head_dim", None) or 128 // heads)
    assert ours_cfg.max_position_embeddings == ref.max_position_embeddings
    if arch == "llama":
        rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
        cfg = ModelConfig.from_hf(dict(kw, model_type=arch, rope_scaling=rope))
        assert cfg.rope_scaling["original_max_position_embeddings"] == 2048


def test_a_tied_config_with_a_different_stored_lm_head_is_refused(tmp_path):
    # transformers 4 ties it (ignores the stored head), transformers 5 keeps the stored head: qerl tied it,
    # 1.5-2.9 off transformers 5 in log-prob, silently (audit, 2026-11-26). Refused by load and quantize;
    # a stored copy equal to the embedding is fine.
    from qerl_cli.quantize import QuantizeConfig, quantize

    src = make_tiny_hf_model(tmp_path, "llama", tie_word_embeddings=True, dtype=torch.float32)
    t = load_file(str(src / "model.safetensors"))
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    load_model(src, dtype=torch.float32)  # equal: loads
    t["lm_head.weight"] = t["lm_head.weight"] + 0.01
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BadInputError, match="tie_word_embeddings is true, but the checkpoint stores an lm_head.weight"):
        load_model(src, dtype=torch.float32)
    with pytest.raises(BadInputError, match="differs from the embedding"):
        quantize(QuantizeConfig(src=src, out=tmp_path / "q", device="cpu"))
    assert not (tmp_path / "q").exists()


def test_context_limit_says_when_max_model_len_cannot_raise_it(tmp_path):
    # Over a sliding window the stages said "raise --max-model-len", which cannot help (the engine stays
    # inside the window), and rollout lowered a larger --max-model-len without a word (audit, 2026-11-26).
    from qerl_cli.runtime import context_limit

    src = make_tiny_hf_model(tmp_path, "mistral", tokenizer=False)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(cfg, sliding_window=32)))
    n, hint = context_limit(src, 64)
    assert n == 32 and "sliding window of 32 tokens" in hint and "cannot raise it" in hint
    assert context_limit(src, 16) == (16, "raise --max-model-len")
    (src / "config.json").write_text(json.dumps(dict(cfg, sliding_window=None)))
    n, hint = context_limit(src, None)
    assert n == cfg["max_position_embeddings"] - 1 and "max_position_embeddings" in hint


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_bias_keys_count_only_where_transformers_reads_them(tmp_path, arch):
    # attention_bias / mlp_bias in a Mistral (both) or Qwen2/Qwen3 (mlp_bias) config: transformers builds no
    # bias and loads the checkpoint; qerl expected q_proj.bias / gate_proj.bias and refused it (a review).
    import json

    src = make_tiny_hf_model(tmp_path, arch=arch, dtype=torch.float32, tokenizer=False)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(attention_bias=cfg.get("attention_bias", False) or arch == "mistral", mlp_bias=arch != "llama")
    (src / "config.json").write_text(json.dumps(cfg))
    ids, mask = right_padded()
    assert_close_on_mask(ours(load_model(src, dtype=torch.float32), ids, mask), hf_logits(src, ids, mask), mask)
