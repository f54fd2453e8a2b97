"""Tests that kill mutants which survived the rest of the suite (manual mutation testing, round 5: the
rotary tables, SwiGLU, q/k/v fusion and LoRA grouping, the decoder's input checks, the engine's setup
and stop-string handling, and the Gumbel sampler's vocabulary chunking).

Each pins a behaviour a user would notice if it changed, or (where marked) a documented fast path.
All run on CPU in well under a second."""

from __future__ import annotations

import json
import math

import pytest
import torch

from qerl_cli.engine.llm_engine import LLMEngine, _stop_cut
from qerl_cli.engine.sampling_params import SamplingParams
from qerl_cli.engine.sequence import Sequence
from qerl_cli.errors import BadInputError
from qerl_cli.models import ModelConfig, build_random_model

HF_CFG = dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)


def _model(max_positions: int | None = None, **cfg):
    """A tiny dense fp32 decoder on CPU (random weights)."""
    return build_random_model(ModelConfig.from_hf(dict(HF_CFG, **cfg)), device="cpu", dtype=torch.float32,
                              quantized=False, max_positions=max_positions)


# ---- layers: rotary tables ----
def _llama3(factor=8.0, low=1.0, high=4.0, old=8192.0):
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": old}


def test_llama3_rope_scales_a_wavelength_exactly_at_the_low_frequency_bound_by_the_whole_factor():
    # The smoothing band is closed (HF: ~(wl < high_wl) & ~(wl > low_wl)); at its low end the blend is all
    # inv / factor, continuous with the band past it. head_dim 2: one frequency, 1.0, wavelength fp32(2 pi).
    from qerl_cli.layers.rotary import rope_inv_freq

    wl = float(torch.tensor(2 * math.pi))
    assert rope_inv_freq(2, 1e4, _llama3(old=wl)).tolist() == [1 / 8]  # low_wl = old / 1 = the wavelength
    assert rope_inv_freq(2, 1e4, _llama3(old=wl * 0.999)).tolist() == [1 / 8]  # past the band
    assert rope_inv_freq(2, 1e4, _llama3(old=wl * 4)).tolist() == [1.0]  # high_wl = old / 4 = wl: left unscaled


def test_rope_reads_the_legacy_type_key():
    from qerl_cli.layers.rotary import rope_inv_freq

    inv = rope_inv_freq(64, 1e4, None)
    torch.testing.assert_close(rope_inv_freq(64, 1e4, {"type": "linear", "factor": 4.0}), inv / 4)
    assert not torch.equal(rope_inv_freq(64, 1e4, dict(_llama3(), rope_type=None, type="llama3")), inv)


def test_an_unknown_rope_type_is_refused_by_name():
    from qerl_cli.layers.rotary import RotaryEmbedding, rope_inv_freq

    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        rope_inv_freq(64, 1e4, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="'dynamic'"):
        RotaryEmbedding(64, 16, 1e4, {"type": "dynamic", "factor": 2.0})


# ---- layers: SwiGLU ----
def test_swiglu_adds_both_deferred_lora_terms():
    # The engine's deferred gate/up LoRA terms: silu(g + dg) * (u + du), on the torch path (CPU).
    from qerl_cli.layers.activation import silu_mul

    g, u, dg, du = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(0)).unbind(0)
    with torch.no_grad():
        got = silu_mul(g, u, dg, du)
    torch.testing.assert_close(got, torch.nn.functional.silu(g + dg) * (u + du))


# ---- layers: q/k/v fusion, LoRA grouping ----
def test_fusing_again_changes_nothing_and_weight_updates_still_reach_the_fused_gemm():
    from qerl_cli.layers.attention import fuse_projections

    model = _model()
    assert fuse_projections(model) == 2 * model.config.num_layers
    assert fuse_projections(model) == 0
    attn = model.model.layers[0].self_attn
    assert len(attn._qkv) == 1
    with torch.no_grad():
        attn.q_proj.weight.mul_(2.0)  # an in-place update of a part (what a weight sync does)
    x = torch.randn(3, model.config.hidden_size)
    nq = model.config.num_heads * model.config.head_dim
    torch.testing.assert_close(attn._qkv[0](x)[:, :nq], attn.q_proj(x))


def test_group_lora_rebuilds_a_group_whose_parts_no_longer_read_it(monkeypatch):
    # A dtype round trip of one part's inference copies gives it new tensors: the old group is stale
    # (the engine would fall back to the per-part LoRA kernels); grouping again makes a fresh one.
    from qerl_cli.layers.attention import group_lora
    from qerl_cli.layers.context import ForwardContext, set_context
    from qerl_cli.layers.lora import GroupedLoRA
    from tests.helpers import random_lora_model

    model = random_lora_model(HF_CFG, quantized=False)
    assert group_lora(model, torch.float32) == 4
    attn = model.model.layers[0].self_attn
    old = attn._qkv_lora
    attn.q_proj.refresh_inference_copies(torch.float64)
    attn.q_proj.refresh_inference_copies(torch.float32)
    assert not old.valid()
    assert group_lora(model, torch.float32) == 4
    assert attn._qkv_lora is not old and attn._qkv_lora.valid()
    calls = []
    add = GroupedLoRA.add
    monkeypatch.setattr(GroupedLoRA, "add", lambda self, *a, **k: calls.append(self) or add(self, *a, **k))
    ids = torch.arange(6)[None] % model.config.vocab_size
    set_context(ForwardContext(is_prefill=True, slot_mapping=torch.zeros(ids.numel(), dtype=torch.long)))
    try:
        with torch.no_grad():
            model(ids, torch.arange(6)[None])
    finally:
        set_context(None)
    assert attn._qkv_lora in calls  # the grouped path ran for layer 0's q/k/v


# ---- models: decoder construction and input checks ----
def test_layer_one_is_not_quantized_by_layer_tens_names():
    from qerl_cli.models.decoder import CausalLM

    cfg = ModelConfig.from_hf(dict(HF_CFG, num_hidden_layers=11))
    with torch.device("meta"):
        model = CausalLM(cfg, {"model.layers.10.self_attn.q_proj", "model.layers.10.mlp.down_proj"})
    assert model.model.layers[10].self_attn.q_proj.quantized and model.model.layers[10].mlp.down_proj.quantized
    assert not model.model.layers[1].self_attn.q_proj.quantized and not model.model.layers[1].mlp.down_proj.quantized


def test_forward_train_refuses_a_sequence_past_max_positions():
    model = _model(max_positions=8)  # below the config's max_position_embeddings
    assert model.model.rotary.max_positions == 8
    with pytest.raises(ValueError, match="sequence length 9 exceeds the model's 8 positions"):
        model.forward_train(torch.zeros(1, 9, dtype=torch.long))
    assert model.forward_train(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, model.config.hidden_size)


@pytest.mark.parametrize("ids, mask, match", [
    (torch.zeros(2, 4, dtype=torch.long), torch.ones(1, 4), r"attention_mask shape \(1, 4\) != input_ids \(2, 4\)"),
    (torch.zeros(4, dtype=torch.long), None, r"input_ids must be \[B, L\], got shape \(4,\)"),
], ids=["mask-shape", "1d-ids"])
def test_forward_train_refuses_ill_shaped_inputs(ids, mask, match):
    with pytest.raises(ValueError, match=match):
        _model().forward_train(ids, mask)


def test_an_embedding_shared_with_the_head_stays_on_the_device():
    model = _model()  # tie_word_embeddings false, but the head is given the embedding's tensor
    model.lm_head.weight = model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="tied to the lm_head"):
        model.embeddings_to_cpu()


def test_a_trainable_embedding_stays_on_the_device():
    model = _model()
    model.model.embed_tokens.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="input embedding is trainable"):
        model.embeddings_to_cpu()


def test_nvfp4_gate_up_defers_its_lora_only_above_the_row_threshold(monkeypatch):
    # Documented fast path (lora.NVFP4_GATE_UP_DEFER_ROWS): beside NVFP4 gate/up tiles of 16 rows the
    # deferred expand was slower, so up to 16 rows the LoRA term is added by the grouped GEMM instead.
    from qerl_cli.layers import lora
    from qerl_cli.layers.attention import group_lora
    from qerl_cli.layers.context import ForwardContext, set_context
    from tests.helpers import random_lora_model

    model = random_lora_model(HF_CFG, quantized=True)
    group_lora(model, torch.float32)
    mlp = model.model.layers[0].mlp
    rows = []
    real = lora.GroupedLoRA.run_deferred
    monkeypatch.setattr(lora.GroupedLoRA, "run_deferred",
                        lambda self, base, x, *a: rows.append(x.numel() // x.shape[-1]) or real(self, base, x, *a))
    set_context(ForwardContext(is_prefill=True, slot_mapping=torch.zeros(1, dtype=torch.long)))
    try:
        with torch.no_grad():
            for n in (lora.NVFP4_GATE_UP_DEFER_ROWS, lora.NVFP4_GATE_UP_DEFER_ROWS + 1):
                mlp(torch.randn(n, model.config.hidden_size))
    finally:
        set_context(None)
    assert rows == [lora.NVFP4_GATE_UP_DEFER_ROWS + 1]


# ---- engine: setup ----
def test_a_token_budget_below_max_model_len_still_prefills_short_prompts_together():
    engine = LLMEngine(_model(), None, max_num_seqs=4, max_num_batched_tokens=1)
    sizes = []
    prefill = engine.runner.prefill
    engine.runner.prefill = lambda groups: sizes.append(len(groups)) or prefill(groups)
    engine.generate([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], SamplingParams(temperature=0, max_new_tokens=1))
    assert sizes == [2]  # the budget is raised to max_model_len: one prefill of both


def test_a_kv_cache_of_one_block_is_refused_before_it_is_allocated(monkeypatch):
    # CPU budget: 1 GiB of cache. A block of 600 MiB fits once; the pipelined decode needs a spare block.
    import qerl_cli.engine.llm_engine as le

    monkeypatch.setenv("QERL_CPU_KV_CACHE_GIB", "1")
    monkeypatch.setattr(le, "available_ram", lambda: 64 << 30)
    model = _model(num_hidden_layers=1)
    c = model.config
    block_size = 600 * 2**20 // (2 * c.num_layers * c.num_kv_heads * c.head_dim * 4)
    with pytest.raises(BadInputError, match="no memory left for the KV cache"):
        LLMEngine(model, None, max_num_seqs=1, block_size=block_size)


@pytest.mark.parametrize("eos", [7, [7, 9]], ids=["scalar", "list"])
def test_the_generation_configs_eos_ids_are_stop_ids(tmp_path, eos):
    model = _model()
    model.model_dir = tmp_path
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert {7} <= LLMEngine(model, None, max_num_seqs=1).eos_token_ids


# ---- engine: stop strings ----
def test_the_cut_is_at_the_stop_the_last_token_completed():
    # "X" shows earlier in the recorded text (generation went on past it); the last token completed "Y".
    assert _stop_cut("a X b Y", "a X b ", ("X", "Y")) == 6


def test_the_cut_falls_back_to_the_earliest_stop_anywhere():
    # The last token added no text (before == text): no stop ends in it, so the earliest one anywhere.
    assert _stop_cut("a X b", "a X b", ("X",)) == 2
    assert _stop_cut("a b", "a b", ("X",)) == 3  # no stop at all: nothing cut


class _CountingTokenizer:
    """A duck-typed (not Hugging Face) tokenizer: ``pieces`` {id: text}; ``len()`` counts only the first
    ``length`` ids; every ``decode`` call is counted."""

    def __init__(self, pieces: dict[int, str], length: int):
        self.pieces, self.length, self.decodes = pieces, length, 0

    def __len__(self):
        return self.length

    def decode(self, ids, skip_special_tokens=True):
        self.decodes += 1
        return "".join(self.pieces.get(i, "") for i in ids)


class _CountingTokenizerWithVocab(_CountingTokenizer):
    def get_vocab(self):
        return {t: i for i, t in self.pieces.items()}


def _feed(tok, completion_ids, stop, prompt=(0, 1)):
    """Append ``completion_ids`` one at a time as the engine does -> (Completion, decodes per step)."""
    engine = object.__new__(LLMEngine)
    engine.tokenizer, engine.eos_token_ids = tok, set()
    sp = SamplingParams(temperature=0, max_new_tokens=100, stop=tuple(stop))
    s = Sequence(group=0, child=0, token_ids=list(prompt), num_prompt=len(prompt), max_len=len(prompt) + 100)
    engine._stop_plan(sp.stop)  # the per-token texts: decoded once, up front
    steps = []
    for t in completion_ids:
        before = tok.decodes
        done = engine._append(s, t, -0.5, sp, set())
        steps.append(tok.decodes - before)
        if done:
            break
    return engine._completion(s, sp), steps


PIECES = {0: "a", 1: "b", 2: " ", 3: "#", 50: "</answer>"}  # ids skip 4..49: len() is 5, the largest id 50


def test_a_stop_shown_by_an_id_past_the_tokenizers_length_is_found_without_get_vocab():
    # Without get_vocab the per-token texts cover ids below len() only; a window holding a larger id
    # is decoded (not skipped as showing no stop's character).
    c, _ = _feed(_CountingTokenizer(PIECES, 5), [0, 1, 2] * 5 + [50, 0, 1], ["</answer>"])
    assert c.finish_reason == "stop" and c.stop_reason == "</answer>" and c.text == "ab " * 5


def test_windows_that_cannot_show_a_stop_are_not_decoded_with_ids_past_the_tokenizers_length():
    # Fast path: the per-token texts reach the largest id of get_vocab, so a window of ids none of whose
    # texts shows "#" (50 among them) is ruled out without a decode.
    comp = [0, 50, 1, 2, 50] * 4 + [3, 0]
    c, steps = _feed(_CountingTokenizerWithVocab(PIECES, 5), comp, ["#"])
    assert c.finish_reason == "stop" and c.text.endswith("</answer>") and len(c.token_ids) == 21
    assert sum(steps[3:20]) == 0 and steps[20] > 0  # past the prompt's reach only the "#" step decodes


# ---- engine: Gumbel sampler chunking ----
def test_the_gumbel_sampler_splits_a_row_into_whole_blocks_about_two_programs_per_sm():
    from qerl_cli.engine.triton_sampler import chunking, num_chunks_for

    v, block = 151936, 4096  # 37.1 blocks
    assert num_chunks_for(1, v) == 38 and num_chunks_for(256, v) == 2 and num_chunks_for(1, 1000) == 1
    assert chunking(256, v) == (19 * block, 2)  # 2 x 256 rows for 132 SMs, not a program per block
    assert chunking(1, 10000, num_chunks=3) == (block, 3)  # 3334 tokens a chunk, rounded to a block
    for rows, n in [(1, None), (7, None), (64, None), (3, 5)]:
        chunk, nc = chunking(rows, v, n)
        assert chunk % block == 0 and (nc - 1) * chunk < v <= nc * chunk
