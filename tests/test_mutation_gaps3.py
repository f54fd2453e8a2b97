"""Tests that kill mutants which survived the rest of the suite (manual mutation testing, round 3: LoRA and
QLinear layers, the RMSNorm weight, train log-probs, train-step's loop and metrics, model config parsing and
rope scaling, the engine's EOS handling; 2026-11-26).

Each pins a behaviour a user would notice if it changed."""

import json
import math

import pytest
import torch

from qerl_cli.errors import BadInputError
from tests.test_mutation_gaps2 import _EosTokenizer
from tests.train_fixtures import quick_step as _step


# ---- layers: LoRA wrapping, init, disabling ----
def _lora_model(**kw):
    from qerl_cli.models.config import ModelConfig
    from qerl_cli.models.loader import build_random_model

    cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_position_embeddings=64, qkv_bias=True)
    return build_random_model(cfg, device="cpu", dtype=torch.float32, quantized=False, **kw)

def test_a_lora_target_that_names_no_linear_is_refused():
    from qerl_cli.layers.lora import LoraSpec, apply_lora

    with pytest.raises(ValueError, match="nope"):
        apply_lora(_lora_model(), LoraSpec(r=2, targets=("q_proj", "nope")))

def test_wrapping_an_eval_model_with_lora_dropout_samples_without_dropout():
    from qerl_cli.layers.lora import LoraSpec, lora_modules

    m = _lora_model(lora=LoraSpec(r=2, dropout=0.5))
    for _, mod in lora_modules(m):
        with torch.no_grad():
            mod.lora_B.normal_()
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        a, b = m.forward_train(ids), m.forward_train(ids)
    torch.testing.assert_close(a, b, rtol=0, atol=0)

def test_each_lora_module_gets_its_own_reproducible_init():
    from qerl_cli.layers.lora import LoraSpec, lora_modules

    a = dict(lora_modules(_lora_model(lora=LoraSpec(r=2, seed=3))))
    b = dict(lora_modules(_lora_model(lora=LoraSpec(r=2, seed=3))))
    q0, q1 = a["model.layers.0.self_attn.q_proj"].lora_A, a["model.layers.1.self_attn.q_proj"].lora_A
    assert not torch.equal(q0, q1)  # same shape, another module: not a copy of the same draw
    assert all(torch.equal(a[n].lora_A, b[n].lora_A) for n in a)  # same seed: the same adapter

def test_nested_lora_disabled_keeps_lora_off_until_the_outer_block_ends():
    from qerl_cli.layers.lora import LoraSpec, lora_disabled, lora_modules

    m = _lora_model(lora=LoraSpec(r=2))
    mods = [mod for _, mod in lora_modules(m)]
    with lora_disabled(m):
        with lora_disabled(m):
            pass
        assert not any(mod.enabled for mod in mods)
    assert all(mod.enabled for mod in mods)


# ---- layers: QLinear cast and fusing ----
def _qlinear(n=16, k=32, seed=0):
    from qerl_kernels import reference

    from qerl_cli.layers.linear import QLinear

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    packed, scale, gs = reference.quantize(w)
    m = QLinear(k, n, quantized=True)
    m.weight_packed.copy_(packed)
    m.weight_scale.copy_(scale)
    m.weight_global_scale.copy_(gs)
    return m


def test_casting_a_model_moves_but_never_casts_its_nvfp4_buffers():
    m = _qlinear()
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(5))
    want = m(x).half()
    m.half()
    assert m.weight_scale.dtype == torch.float8_e4m3fn and m.weight_global_scale.dtype == torch.float32
    torch.testing.assert_close(m(x.half()), want, rtol=1e-2, atol=1e-2)


def test_fusing_nvfp4_parts_with_different_global_scales_never_changes_their_outputs():
    from qerl_cli.layers.linear import fuse_linears

    a, b = _qlinear(seed=1), _qlinear(seed=2)
    with torch.no_grad():
        b.weight_global_scale.mul_(4)  # another tensor's amax: its own global scale
    x = torch.randn(3, 32)
    want = torch.cat([a(x), b(x)], -1)
    fused = fuse_linears([a, b])
    if fused is not None:  # fusing is an optimisation: it may only happen where the sum is the same
        torch.testing.assert_close(fused(x), want)
    torch.testing.assert_close(torch.cat([a(x), b(x)], -1), want)


def test_fusing_a_biased_part_with_an_unbiased_one_never_drops_the_bias():
    from qerl_cli.layers.linear import QLinear, fuse_linears

    g = torch.Generator().manual_seed(0)
    a, b = QLinear(8, 4), QLinear(8, 4, bias=True)
    with torch.no_grad():
        for t in (a.weight, b.weight, b.bias):
            t.copy_(torch.randn(t.shape, generator=g))
    x = torch.randn(2, 8, generator=g)
    fused = fuse_linears([a, b])
    if fused is not None:
        torch.testing.assert_close(fused(x), torch.cat([a(x), b(x)], -1))


# ---- layers: RMSNorm ----
def test_the_fused_norms_weight_is_the_one_the_torch_path_multiplies_by_for_an_fp32_master():
    from qerl_cli.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, dtype=torch.float32)
    with torch.no_grad():
        norm.weight.copy_(1 + 1e-3 * torch.randn(64, generator=g))  # steps fp16 cannot hold near 1
    norm.weight.requires_grad_(True)  # --train-norms: an fp32 master under fp16 activations
    x = torch.randn(4, 64, generator=g).half()
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.eps)
    fused_view = (h * norm._as_used(torch.float16).float()).half()  # what the fused kernel multiplies by
    assert torch.equal(norm(x), fused_view)


# ---- train: log-probs ----
def _dense_model():
    from qerl_cli.models.config import ModelConfig
    from qerl_cli.models.loader import build_random_model

    cfg = ModelConfig(arch="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    return build_random_model(cfg, device="cpu", dtype=torch.float32, quantized=False, std=0.3)


def test_scoring_without_grad_replays_the_sampling_cut_as_training_does():
    # The KL reference (--beta) is scored under no_grad: its log-probs must be over the same cut support.
    from qerl_cli.train.logprobs import token_logprobs

    model = _dense_model()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(20, 32, generator=g) * 3
    targets = model.compute_logits(h).argmax(-1).detach()  # always inside any cut
    inv_t = torch.ones(20)
    cut = torch.tensor([[0.5, 0, 0.0]], dtype=torch.float64).expand(20, 3).contiguous()
    with_grad = token_logprobs(model, h.clone().requires_grad_(True), targets, inv_t, trunc=cut)[0].detach()
    with torch.no_grad():
        no_grad = token_logprobs(model, h, targets, inv_t, trunc=cut)[0]
        full = token_logprobs(model, h, targets, inv_t)[0]
    torch.testing.assert_close(no_grad, with_grad)
    assert (no_grad > full + 1e-4).any()  # the cut renormalised something


def test_a_model_with_its_own_compute_logits_is_scored_through_it():
    from qerl_cli.models.decoder import CausalLM
    from qerl_cli.train.logprobs import token_logprobs

    model = _dense_model()

    class Capped(CausalLM):  # e.g. logit soft-capping: not lm_head(h).float()
        def compute_logits(self, hidden):
            return 2.0 * super().compute_logits(hidden)

    model.__class__ = Capped
    g = torch.Generator().manual_seed(1)
    h = torch.randn(6, 32, generator=g)
    t = torch.randint(0, 96, (6,), generator=g)
    want = torch.log_softmax(2.0 * model.lm_head(h).float(), -1).gather(-1, t[:, None]).squeeze(-1)
    lp = token_logprobs(model, h.requires_grad_(True), t, torch.ones(6))[0]
    torch.testing.assert_close(lp.detach(), want)


# ---- train-step ----


def test_the_kl_metric_is_the_pre_update_policys(qmodel, tmp_path):
    from tests.train_fixtures import make_shard

    q, h = qmodel
    # a fresh adapter (B = 0) is the base policy: its KL to the base is 0, whatever epoch 2 moved
    m = _step(q, make_shard(tmp_path / "sh", h, seed=5, groups=2), tmp_path / "a", beta=0.1, epochs=2, lr=2e-2)["metrics"]
    assert m["loss_last_epoch"] != pytest.approx(m["loss"], rel=1e-6, abs=1e-9)  # epoch 2 saw a moved policy
    assert m["kl"] == pytest.approx(0.0, abs=1e-9)
    # like loss and lr, grad_norm is epoch 1's
    g = m["grad_norm_per_epoch"]
    assert m["grad_norm"] == pytest.approx(g[0], rel=1e-4) and g[1] != pytest.approx(g[0], rel=1e-3)
    # throughput counts every epoch's pass over the step's tokens
    from qerl_cli.shards import read_records

    recs = read_records([str(tmp_path / "sh")])
    tokens = sum(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for r in recs)
    assert m["tokens_per_s"] * m["step_time_s"] == pytest.approx(2 * tokens, rel=1e-3)


def test_trainer_state_records_the_lr_of_the_steps_last_update(qmodel, tmp_path):
    from tests.train_fixtures import make_shard

    q, h = qmodel
    m = _step(q, make_shard(tmp_path / "sh", h, seed=1, groups=2), tmp_path / "a", warmup_steps=4, epochs=2)["metrics"]
    state = json.loads((tmp_path / "a" / "trainer_state.json").read_text())
    assert m["lr_per_epoch"][0] < m["lr_per_epoch"][1]  # warmup: epoch 2's update ran at a higher lr
    assert state["schedule"]["last_lr"] == pytest.approx(m["lr_per_epoch"][1])


def _edit_first_record(shard_dir, **changes):
    from qerl_cli.shards import shard_name

    path = shard_dir / shard_name(0, 1)
    lines = path.read_text().splitlines()
    rec = json.loads(lines[0])
    for k, f in changes.items():
        rec[k] = f(rec[k])
    lines[0] = json.dumps(rec)
    path.write_text("\n".join(lines) + "\n")


def test_one_token_past_the_models_positions_is_bad_input_and_exactly_all_of_them_trains(qmodel, tmp_path):
    from qerl_cli.errors import BadInputError
    from tests.train_fixtures import make_shard

    q, h = qmodel
    limit = json.loads((q / "config.json").read_text())["max_position_embeddings"]
    for n, ok in ((limit + 1, False), (limit, True)):
        sh = make_shard(tmp_path / f"sh{n}", h, seed=1, groups=2)
        _edit_first_record(sh, prompt_token_ids=lambda p, n=n: (p * n)[: n - 3], completion_token_ids=lambda c: [5, 6, 7],
                           logprobs=lambda lp: [-6.0] * 3)
        if ok:
            _step(q, sh, tmp_path / f"a{n}")
        else:
            with pytest.raises(BadInputError, match=f"{n} tokens, more than the {limit} positions"):
                _step(q, sh, tmp_path / f"a{n}")


def test_a_greedy_records_recorded_top_p_is_not_replayed(qmodel, tmp_path):
    # greedy (t = 0) records carry the untempered log-prob of the argmax over the full vocabulary
    from qerl_cli.train_step import TrainStepConfig, read_step
    from tests.train_fixtures import make_shard

    q, h = qmodel
    sh = make_shard(tmp_path / "sh", h, seed=1, groups=2, temperature=0.0)
    _edit_first_record(sh, sampling=lambda s: dict(s, top_p=0.5, top_k=5))
    data = read_step(TrainStepConfig(model=q, shards=[str(sh)], out=tmp_path / "a", progress=False))
    assert data.cuts is None and data.temperatures[0] == 1.0


def test_a_token_id_equal_to_the_vocab_size_is_bad_input(qmodel, tmp_path):
    from qerl_cli.errors import BadInputError
    from tests.train_fixtures import make_shard

    q, h = qmodel
    vocab = json.loads((q / "config.json").read_text())["vocab_size"]
    sh = make_shard(tmp_path / "sh", h, seed=1, groups=2)
    _edit_first_record(sh, completion_token_ids=lambda c: c[:-1] + [vocab])
    with pytest.raises(BadInputError, match=f"token id {vocab}, outside"):
        _step(q, sh, tmp_path / "a")


def test_dr_grpo_divides_by_no_less_than_the_longest_completion():
    # a shard from elsewhere may hold completions longer than its recorded budget: L_max covers them
    from types import SimpleNamespace

    from qerl_cli.train_step import dr_grpo_length

    cfg = SimpleNamespace(loss="dr_grpo", max_completion_length=None)
    data = SimpleNamespace(completion_lengths=[3, 12],
                           records=[{"sampling": {"max_new_tokens": 8}}, {"sampling": {"max_new_tokens": 8}}])
    assert dr_grpo_length(cfg, data) == 12
    data.completion_lengths = [3, 5]
    assert dr_grpo_length(cfg, data) == 8  # the budget, not the longest completion


def test_clip_ratios_count_each_side_on_its_own(qmodel, tmp_path):
    from tests.train_fixtures import make_shard

    q, h = qmodel
    # an upper clip no ratio reaches: only the lower side may clip
    m = _step(q, make_shard(tmp_path / "sh", h, seed=2, groups=2), tmp_path / "a", lr=5e-2, epochs=3,
              clip_eps=0.05, clip_eps_high=100.0, max_grad_norm=0.0)["metrics"]
    assert m["clip_ratio_low"] > 0 and m["clip_ratio_high"] == 0


# ---- engine ----
def _engine_model(**kw):
    from qerl_cli.models import ModelConfig, build_random_model

    cfg = ModelConfig.from_hf(dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=64, eos_token_id=0, **kw))
    return build_random_model(cfg, device="cpu", dtype=torch.float32, quantized=False, seed=0)


def _greedy(n_new, **kw):
    from qerl_cli.engine import SamplingParams

    return SamplingParams(temperature=0, max_new_tokens=n_new, **kw)






def test_an_eos_as_the_last_allowed_token_is_a_stop_and_ignore_eos_keeps_its_text():
    from qerl_cli.engine import LLMEngine

    model = _engine_model()
    first = LLMEngine(model, None, max_num_seqs=2, block_size=4).generate(
        [[3, 4, 5]], _greedy(1, ignore_eos=True))[0][0].token_ids[0]
    engine = LLMEngine(model, _EosTokenizer(first), max_num_seqs=2, block_size=4)
    out = engine.generate([[3, 4, 5]], _greedy(1))[0][0]  # EOS drawn as the one token allowed
    assert (out.token_ids, out.finish_reason, out.stop_reason, out.text) == ([first], "stop", first, "")
    # ignore_eos: the EOS id is an ordinary token, drawn again past it; stopping on it as a stop_token_id leaves
    # its text out, as vLLM does for any stop token
    free = engine.generate([[3, 4, 5]], _greedy(4, ignore_eos=True))[0][0]
    assert free.token_ids[0] == first and len(free.token_ids) == 4 and free.text.split()[0] == str(first)
    out = engine.generate([[3, 4, 5]], _greedy(4, ignore_eos=True, stop_token_ids=(first,)))[0][0]
    assert (out.token_ids, out.stop_reason, out.text) == ([first], first, "")


def test_generation_configs_eos_ids_stop_generation(tmp_path):
    import json

    from qerl_cli.engine import LLMEngine

    model = _engine_model()
    free = LLMEngine(model, None, max_num_seqs=2, block_size=4).generate([[3, 4, 5]], _greedy(4, ignore_eos=True))[0][0]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [63, free.token_ids[1]]}))
    model.model_dir = tmp_path
    out = LLMEngine(model, None, max_num_seqs=2, block_size=4).generate([[3, 4, 5]], _greedy(4))[0][0]
    assert out.token_ids == free.token_ids[:2] and out.finish_reason == "stop"


# ---- models: config parsing and rope ----
def _cfg(arch="llama", **kw):
    from qerl_cli.models.config import ModelConfig

    base = dict(model_type=arch, vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4)
    if arch != "llama":
        base["num_key_value_heads"] = 2  # the HF defaults (8, 32) fit no 4-head model
    return ModelConfig.from_hf(dict(base, **kw))


def test_hf_defaults_for_keys_a_config_leaves_out():
    assert _cfg("qwen3").head_dim == 128  # Qwen3Config's head_dim, not hidden / heads (16 here)
    from qerl_cli.models.config import ModelConfig

    mistral = dict(model_type="mistral", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=16)
    assert ModelConfig.from_hf(mistral).num_kv_heads == 8  # MistralConfig's default
    assert _cfg("llama").num_kv_heads == 4  # LlamaConfig: as many as attention heads
    assert _cfg("llama").tie_word_embeddings is False  # untied unless the config says so


def test_qwen3_attention_bias_covers_o_proj_and_qwen2_always_has_qkv_bias():
    c = _cfg("qwen3", attention_bias=True)
    assert c.qkv_bias and c.o_bias
    c = _cfg("qwen2", attention_bias=False)
    assert c.qkv_bias and not c.o_bias


def test_qwen_sliding_window_follows_max_window_layers_and_layer_types():
    on = dict(use_sliding_window=True, sliding_window=32)
    assert _cfg("qwen2", max_window_layers=2, **on).sliding_window is None  # from layer 2 on: none of 2 layers
    assert _cfg("qwen2", max_window_layers=1, **on).sliding_window == 32
    assert _cfg("qwen3", layer_types=["full_attention"] * 2, **on).sliding_window is None
    assert _cfg("qwen3", layer_types=["full_attention", "sliding_attention"], **on).sliding_window == 32
    assert _cfg("mistral").sliding_window == 4096  # MistralConfig's default when the key is absent
    assert _cfg("mistral", sliding_window=None).sliding_window is None


def test_rope_parameter_precedence():
    # a legacy rope_scaling replaces rope_parameters
    c = _cfg(rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_parameters={"rope_type": "default"})
    assert c.rope_scaling["factor"] == 2.0
    # the dict's rope_theta wins over the top-level default
    assert _cfg(rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 5e5}).rope_theta == 5e5
    # llama3: a top-level original_max_position_embeddings wins over the dict's
    c = _cfg(max_position_embeddings=4096, original_max_position_embeddings=1024,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 2048})
    assert c.rope_scaling["original_max_position_embeddings"] == 1024
    # the legacy "type" key names the kind as rope_type does
    assert _cfg(rope_scaling={"type": "linear", "factor": 4.0}).rope_scaling["factor"] == 4.0


@pytest.mark.parametrize("kw,field", [
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
])
def test_configs_qerl_cannot_compute_are_refused(kw, field):
    with pytest.raises(BadInputError, match=field):
        _cfg(**kw)


def _hf_llama3(inv, factor, low, high, old):  # transformers' _compute_llama3_parameters, written out
    low_wl, high_wl = old / low, old / high
    out = []
    for f in inv.tolist():
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(f)
        elif wl > low_wl:
            out.append(f / factor)
        else:
            s = (old / wl - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return torch.tensor(out)


def test_rope_inv_freq_of_linear_and_llama3_scaling():
    from qerl_cli.layers.rotary import rope_inv_freq

    inv = rope_inv_freq(128, 5e5, None)
    torch.testing.assert_close(rope_inv_freq(128, 5e5, {"rope_type": "linear", "factor": 4.0}), inv / 4)
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
    got = rope_inv_freq(128, 5e5, sc)
    torch.testing.assert_close(got, _hf_llama3(inv, 8.0, 1.0, 4.0, 8192.0))
    assert (got == inv).any() and (got == inv / 8).any() and ((got != inv) & (got != inv / 8)).any()  # all 3 bands


# ---- kernels: the NVFP4 weight in the kernels' code layout ----
def test_a_twiddled_weight_dequantizes_to_the_checkpoints_values():
    from qerl_cli.layers.linear import twiddle_codes_

    m = _qlinear(n=16, k=128, seed=3)
    want = m.dense_weight()
    assert twiddle_codes_(m) == 1 and m.twiddled
    torch.testing.assert_close(m.dense_weight(), want, rtol=0, atol=0)


# ---- models: loader ----
def test_a_loaded_model_with_a_dropout_adapter_samples_in_eval_mode(qmodel):
    from qerl_cli.layers.lora import LoraSpec
    from qerl_cli.models import load_model

    q, _ = qmodel
    model = load_model(q, dtype=torch.float32, lora=LoraSpec(r=2, dropout=0.5))
    assert not any(m.training for m in model.modules())


def test_an_index_naming_a_missing_shard_is_bad_input(qmodel, tmp_path):
    import shutil

    from qerl_cli.models import load_model

    q, _ = qmodel
    d = tmp_path / "m"
    shutil.copytree(q, d)
    files = sorted(p.name for p in d.glob("*.safetensors"))
    wm = {"extra.weight": "model-00009-of-00009.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict(wm, **{"x": files[0]})}))
    with pytest.raises(BadInputError, match="model-00009-of-00009.safetensors, which does not exist"):
        load_model(d, dtype=torch.float32)


def test_a_record_longer_than_the_sliding_window_is_bad_input_before_loading(qmodel, tmp_path):
    # Windowed attention is not implemented: the forward refused such a record with a plain ValueError,
    # after the model had loaded. Named up front, as a record past the positions is.
    import shutil

    from qerl_cli.errors import BadInputError
    from tests.train_fixtures import base_hash_of, make_shard

    q = tmp_path / "windowed"
    shutil.copytree(qmodel[0], q)
    cfg = json.loads((q / "config.json").read_text())
    windowed = dict(cfg, sliding_window=16, use_sliding_window=True, max_window_layers=0)
    windowed.pop("layer_types", None)  # every layer slides
    (q / "config.json").write_text(json.dumps(windowed))
    sh = make_shard(tmp_path / "sh", base_hash_of(q), seed=1, groups=2)
    _edit_first_record(sh, prompt_token_ids=lambda p: (p * 20)[:15], completion_token_ids=lambda c: [5, 6, 7],
                       logprobs=lambda lp: [-6.0] * 3)
    with pytest.raises(BadInputError, match="18 tokens, more than the 16 tokens of the sliding window"):
        _step(q, sh, tmp_path / "a")


# ---- gaps the helper left without a test (round 3) ----
def _tiny_dense(tmp_path, **kw):
    from tests.helpers import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path, arch="qwen2", dtype=torch.float32, tokenizer=False, **kw)


def test_each_position_draws_with_its_own_seed(tmp_path):
    # A token is drawn with seed base + its position, at prefill and at decode alike; without the decode's
    # +1 the first decoded token reused the prefill token's seed. With uniform logits the same seed is the
    # same token: every sequence would start with a repeated token.
    from qerl_cli.engine import LLMEngine, SamplingParams
    from qerl_cli.models import load_model

    model = load_model(_tiny_dense(tmp_path), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # logits all 0: a uniform draw over the vocabulary
    groups = LLMEngine(model, None, max_num_seqs=8).generate([[5, 9, 17]] * 8, SamplingParams(
        temperature=1.0, max_new_tokens=3, seed=11, ignore_eos=True), n=1)
    firsts = [(g[0].token_ids[0], g[0].token_ids[1]) for g in groups]
    assert sum(a == b for a, b in firsts) <= 1, firsts  # 1/512 each by chance


def test_a_tied_checkpoint_that_also_stores_its_head_loads_tied(tmp_path):
    # transformers writes lm_head.weight beside a tied embedding at times; equal to it, it is the same
    # model and must load (and stay tied), not be refused as an unexpected tensor. (Round 3 listed the
    # loader's `elif tied and name == "lm_head.weight"` as an untested gap; with lm_head among the built
    # model's parameters that branch is not reached here, so this pins the behaviour, not that line.)
    from safetensors.torch import load_file, save_file

    from qerl_cli.models import load_model

    src = _tiny_dense(tmp_path, tie_word_embeddings=True)
    sd = load_file(str(src / "model.safetensors"))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(src, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("name", ["weight_scale", "weight_global_scale"])
def test_nonfinite_nvfp4_scales_are_refused_at_load(tmp_path, name):
    from safetensors.torch import load_file, save_file

    from qerl_cli.errors import NumericalError
    from qerl_cli.models import load_model
    from tests.train_fixtures import quantized_tiny

    _, q = quantized_tiny(tmp_path)
    sd = load_file(str(q / "model.safetensors"))
    key = f"model.layers.0.mlp.down_proj.{name}"
    t = sd[key].float()
    t.view(-1)[0] = float("nan")
    sd[key] = t.to(sd[key].dtype)
    save_file(sd, str(q / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(NumericalError, match=f"{key}.*NaN"):
        load_model(q, dtype=torch.float32)
