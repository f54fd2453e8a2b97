"""Tests that kill mutants which survived the rest of the suite (manual mutation testing, round 4: the
CLI's merge / quantize / checkpoint I/O, adapters, lineage, outputs, hashing, prompt data, the sampler,
Philox, sampling params, runtime and errors; 2026-11-26).

Each pins a behaviour a user would notice if it changed."""

import json

import pytest
import torch

from qerl_cli.errors import BadInputError
from tests.test_mutation_gaps2 import _lora_model

GOLDEN_MODEL_HASH = "12b25eb94801320b6b44b8e74d2865de5892bd216fd72b2af07532ef41e34848"  # test_model_hash_of_a_fixed_directory_is_stable


# ---- runtime ----
def test_an_unknown_device_is_bad_input():
    from qerl_cli.runtime import resolve_device

    with pytest.raises(BadInputError, match="--device must be auto, cpu or cuda"):
        resolve_device("tpu")
    assert resolve_device("cpu") == "cpu"


def test_auto_dtype_is_fp32_on_cpu_and_bf16_on_cuda():
    from qerl_cli.runtime import resolve_dtype

    assert resolve_dtype("auto", "cpu") == ("fp32", torch.float32)
    assert resolve_dtype("auto", "cuda:0") == ("bf16", torch.bfloat16)
    assert resolve_dtype("float16", "cpu") == ("fp16", torch.float16)


def test_an_unknown_dtype_is_bad_input():
    from qerl_cli.runtime import resolve_dtype

    with pytest.raises(BadInputError, match="--dtype must be auto, bf16, fp16 or fp32"):
        resolve_dtype("int8", "cpu")


def _windowed_model(tmp_path, window):
    from tests.helpers import make_tiny_hf_model

    src = make_tiny_hf_model(tmp_path, "mistral", tokenizer=False)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(cfg, sliding_window=window)))
    return src, cfg["max_position_embeddings"]


def test_a_max_model_len_equal_to_the_window_is_told_it_cannot_be_raised(tmp_path):
    from qerl_cli.runtime import context_limit

    src, _ = _windowed_model(tmp_path, 32)
    n, hint = context_limit(src, 32)  # the model's own limit binds as much as the flag does
    assert n == 32 and "cannot raise it" in hint
    assert context_limit(src, 31) == (31, "raise --max-model-len")


def test_a_window_of_max_positions_less_one_is_named_as_the_window(tmp_path):
    from qerl_cli.runtime import context_limit

    src, max_pos = _windowed_model(tmp_path / "a", None)
    src, max_pos = _windowed_model(tmp_path / "b", max_pos - 1)
    n, hint = context_limit(src, None)
    assert n == max_pos - 1 and f"sliding window of {max_pos - 1} tokens" in hint


# ---- sampling params ----
@pytest.mark.parametrize("kw, match", [
    (dict(top_p=0.0), "top_p must be in"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(min_p=1.0), "min_p must be in"),
    (dict(max_new_tokens=0), "max_new_tokens must be positive"),
    (dict(stop=("a", "")), "stop strings must be non-empty"),
])
def test_sampling_params_refuse_values_outside_their_range(kw, match):
    from qerl_cli.engine.sampling_params import SamplingParams

    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_sampling_params_keep_stops_as_tuples():
    from qerl_cli.engine.sampling_params import SamplingParams

    sp = SamplingParams(stop=["##"], stop_token_ids=[3])
    assert sp.stop == ("##",) and sp.stop_token_ids == (3,)
    hash(sp)  # frozen and hashable, whatever sequence type the caller passed


# ---- philox / sampler ----
def test_row_uniforms_are_the_triton_kernels_bits():
    # Philox(seed, offset 0): the first word, then the top 21 bits of the second, on a 2^-53 grid (the
    # GPU's _row_uniform_kernel computes exactly this, so CPU and GPU runs draw the same tokens)
    from qerl_cli.engine.philox import philox4
    from qerl_cli.engine.sampler import row_uniforms

    seeds = torch.tensor([1, 7, 2**40 + 3, 2**61 + 5], dtype=torch.int64)
    c0, c1, _, _ = philox4(seeds, torch.zeros_like(seeds))
    bits = (row_uniforms(seeds) * 2.0**53).to(torch.int64)
    assert torch.equal(bits >> 21, c0) and torch.equal(bits & (2**21 - 1), c1 >> 11)


def test_row_seeds_use_all_62_bits():
    from qerl_cli.engine.sampler import row_seed

    seeds = [row_seed(s, g, 0, 0) for s in range(16) for g in range(16)]
    assert max(seeds).bit_length() == 62 and min(seeds) >= 0


def test_a_token_without_mass_is_never_drawn_where_a_chunks_sum_and_cumsum_round_apart():
    # The chunk sum (a reduction) and the chunk's cumulative sum round differently in their last bit; a
    # target between the two once ran off the end of its chunk onto the next chunk's first token.
    from qerl_cli.engine.sampler import _chunk_len, inverse_cdf

    v = 512
    n = _chunk_len(v)
    cases = 0
    for seed in range(60):
        x = torch.randn(1, v, generator=torch.Generator().manual_seed(seed)) * 4
        x[0, n] = float("-inf")  # the next chunk's first token has no mass
        logp = torch.log_softmax(x, -1)
        p = logp.exp()[0]
        chunk_sum = float(p[:n].sum(dtype=torch.float64))
        chunk_cum = float(p[:n].double().cumsum(0)[-1])
        if chunk_sum <= chunk_cum:
            continue
        cases += 1
        total = float(p.view(-1, n).sum(-1, dtype=torch.float64).sum())
        u, us = torch.tensor(chunk_cum / total, dtype=torch.float64), []
        for _ in range(40):
            us.append(float(u))
            u = torch.nextafter(u, torch.tensor(2.0, dtype=torch.float64))
        toks = inverse_cdf(logp.expand(len(us), v).contiguous(), torch.tensor(us, dtype=torch.float64))
        assert n not in toks.tolist()
        assert bool(torch.isfinite(logp[0, toks]).all())
    if not cases:  # depends on how this CPU's reduction orders the sum
        pytest.skip("no chunk whose sum rounds above its cumulative sum on this platform")


# ---- hashing ----
def test_dir_hash_sees_file_names_and_ignores_the_manifest(tmp_path):
    from qerl_cli.hashing import dir_hash

    a, b = tmp_path / "a", tmp_path / "b"
    for d, name in ((a, "x.jsonl"), (b, "y.jsonl")):
        d.mkdir()
        (d / name).write_text("same bytes\n")
    assert dir_hash(a) != dir_hash(b)  # a renamed shard file is another directory
    before = dir_hash(a)
    (a / "manifest.json").write_text('{"created": "now"}')  # timings, dates: differ between identical runs
    assert dir_hash(a) == before


def test_text_files_hash_covers_generation_config(tmp_path):
    from qerl_cli.hashing import text_files_hash

    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2}')
    before = text_files_hash(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 7]}')  # where generation stops
    assert text_files_hash(tmp_path) != before


def test_model_hash_of_a_fixed_directory_is_stable(tmp_path):
    # Adapters record their base's model_hash and outputs their inputs' hashes: a change to how the hash
    # is computed turns every earlier adapter into a lineage error and every finished output into a rerun.
    import struct

    from qerl_cli.hashing import model_hash

    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    header = b'{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}}'
    data = torch.arange(6, dtype=torch.float32).numpy().tobytes()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)
    assert model_hash(tmp_path) == GOLDEN_MODEL_HASH
    (tmp_path / "model.safetensors").rename(tmp_path / "other.safetensors")
    assert model_hash(tmp_path) != GOLDEN_MODEL_HASH  # the shard's name is part of it



# ---- checkpoint I/O and formats ----
def test_a_shard_one_byte_short_is_refused_from_its_header(tmp_path):
    from safetensors.torch import save_file

    from qerl_cli.checkpoint import read_header

    p = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(4), "b": torch.ones(3)}, str(p))
    assert [t.name for t in read_header(p)] == ["a", "b"]
    p.write_bytes(p.read_bytes()[:-1])
    with pytest.raises(BadInputError, match="'b' byte range does not match its shape"):
        read_header(p)


def test_the_sharded_writer_refuses_a_tensor_of_another_dtype(tmp_path):
    from qerl_cli.checkpoint import PlannedTensor, ShardedWriter

    w = ShardedWriter(tmp_path, [PlannedTensor("a", torch.float32, (2,))], 1 << 20)
    with pytest.raises(RuntimeError, match="write order broken"):
        w.write("a", torch.ones(2, dtype=torch.int32))  # same bytes per element: it would write garbage
    w.abort()


def test_the_index_is_written_for_several_shards_only_with_the_total_size(tmp_path):
    from qerl_cli.checkpoint import PlannedTensor, ShardedWriter

    def write(out, max_bytes):
        out.mkdir()
        plan = [PlannedTensor("a", torch.float32, (4,)), PlannedTensor("b", torch.float32, (2,))]
        w = ShardedWriter(out, plan, max_bytes)
        w.write("a", torch.ones(4))
        w.write("b", torch.ones(2))
        return w.close()

    assert set(write(tmp_path / "one", 1 << 20).values()) == {"model.safetensors"}
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["model.safetensors"]
    write(tmp_path / "two", 16)
    index = json.loads((tmp_path / "two" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 24
    assert index["weight_map"] == {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}


def test_an_empty_plan_still_writes_a_valid_shard(tmp_path):
    from qerl_cli.checkpoint import ShardedWriter, read_header

    assert ShardedWriter(tmp_path, [], 1 << 20).close() == {}
    assert read_header(tmp_path / "model.safetensors") == []


def test_closing_a_writer_before_every_planned_tensor_is_an_error(tmp_path):
    from qerl_cli.checkpoint import PlannedTensor, ShardedWriter

    w = ShardedWriter(tmp_path, [PlannedTensor("a", torch.float32, (1,)), PlannedTensor("b", torch.float32, (1,))], 1 << 20)
    w.write("a", torch.ones(1))
    with pytest.raises(RuntimeError, match="1 planned tensors never written"):
        w.close()
    w.abort()


def test_an_index_naming_a_shard_in_a_subdirectory_is_refused(tmp_path):
    from safetensors.torch import save_file

    from qerl_cli.checkpoint import open_source

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "sub").mkdir()
    save_file({"w": torch.ones(2)}, str(tmp_path / "sub" / "model.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "sub/model.safetensors"}}))
    with pytest.raises(BadInputError, match="names shard 'sub/model.safetensors', which is not in"):
        open_source(tmp_path)


def test_a_tensor_the_index_does_not_point_to_is_ignored(tmp_path):
    from safetensors.torch import save_file

    from qerl_cli.checkpoint import open_source

    (tmp_path / "config.json").write_text("{}")
    save_file({"w": torch.ones(2), "stray": torch.zeros(3)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    assert list(open_source(tmp_path).tensors) == ["w"]  # as transformers loads it


def test_a_tensor_stored_in_two_shards_is_refused(tmp_path):
    from safetensors.torch import save_file

    from qerl_cli.checkpoint import open_source

    (tmp_path / "config.json").write_text("{}")
    save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(BadInputError, match="tensor 'w' also appears in a.safetensors"):
        open_source(tmp_path)


def test_a_stored_head_that_differs_from_the_embedding_in_one_element_is_refused(tmp_path):
    from safetensors.torch import save_file

    from qerl_cli.checkpoint.source import check_tied_head

    emb = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    head = emb.clone()
    head[2, 1] += 1
    save_file({"model.embed_tokens.weight": emb, "lm_head.weight": head}, str(tmp_path / "m.safetensors"))
    files = {"model.embed_tokens.weight": tmp_path / "m.safetensors", "lm_head.weight": tmp_path / "m.safetensors"}
    with pytest.raises(BadInputError, match="differs from the embedding"):
        check_tied_head(True, files, tmp_path / "config.json")
    check_tied_head(False, files, tmp_path / "config.json")  # untied: the stored head is the head


# ---- adapters ----
def test_an_adapter_config_with_null_flags_reads_as_their_defaults(tmp_path):
    from qerl_cli.adapters import read_adapter_spec

    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps(dict(cfg, use_dora=None, bias=None, fan_in_fan_out=None)))
    spec = read_adapter_spec(tmp_path)
    assert spec.r == 4 and spec.targets == ("q_proj", "v_proj")
    (tmp_path / "adapter_config.json").write_text(json.dumps(dict(cfg, use_dora=True)))
    with pytest.raises(BadInputError, match="use_dora=True is not supported"):
        read_adapter_spec(tmp_path)


def test_adapter_keys_without_peft_prefix_load(tmp_path):
    from safetensors.torch import load_file, save_file

    from qerl_cli.adapters import PREFIX, load_adapter, save_adapter
    from qerl_cli.layers.lora import LoraSpec, lora_modules

    spec = LoraSpec(r=4, alpha=8, targets=("q_proj",))
    src = _lora_model(spec)
    with torch.no_grad():
        for _, m in lora_modules(src):
            m.lora_B.normal_()
    save_adapter(src, tmp_path, base_model_path="x")
    w = load_file(str(tmp_path / "adapter_model.safetensors"))
    save_file({k.removeprefix(PREFIX): t for k, t in w.items()}, str(tmp_path / "adapter_model.safetensors"))
    dst = _lora_model(spec)
    load_adapter(dst, tmp_path)
    for (_, a), (_, b) in zip(lora_modules(src), lora_modules(dst)):
        assert torch.equal(a.lora_A, b.lora_A) and torch.equal(a.lora_B, b.lora_B)


def test_an_adapter_that_changes_nothing_is_refused_even_if_only_one_module_has_nonzero_b(tmp_path):
    from qerl_cli.adapters import load_adapter, save_adapter
    from qerl_cli.layers.lora import LoraSpec, lora_modules

    spec = LoraSpec(r=4, alpha=8, targets=("q_proj", "v_proj"))
    src = _lora_model(spec)
    with torch.no_grad():
        for name, m in lora_modules(src):
            m.lora_A.zero_()  # A = 0: B @ A is zero whatever B holds
            if name.endswith("q_proj"):
                m.lora_B.fill_(1.0)
            else:
                m.lora_B.zero_()
    save_adapter(src, tmp_path, base_model_path="x")
    with pytest.raises(BadInputError, match="does not change the model's output"):
        load_adapter(_lora_model(spec), tmp_path)


# ---- prompt data ----
def test_a_non_finite_decimal_answer_is_refused():
    from decimal import Decimal

    from qerl_cli.data import parse_row

    assert parse_row({"prompt": "p", "answer": Decimal("1.50")}, "f:row 1", 0).answer == "1.50"
    with pytest.raises(BadInputError, match="not a number an answer can equal"):
        parse_row({"prompt": "p", "answer": Decimal("NaN")}, "f:row 1", 0)


def test_a_whitespace_only_prompt_is_refused():
    from qerl_cli.data import parse_row

    with pytest.raises(BadInputError, match="`prompt` must be a non-empty string"):
        parse_row({"prompt": " \n\t"}, "f:1", 0)


# ---- outputs ----
def test_crash_point_fires_on_its_nth_visit(monkeypatch):
    from qerl_cli import outputs

    kills = []
    monkeypatch.setattr(outputs, "_kill_hits", {})
    monkeypatch.setattr(outputs.os, "kill", lambda pid, sig: kills.append(sig))
    monkeypatch.setenv(outputs.KILL_ENV, "tensor:2")
    outputs.crash_point("tensor")
    outputs.crash_point("shard-group")
    assert kills == []
    outputs.crash_point("tensor")  # the second visit of the named point
    assert len(kills) == 1
    monkeypatch.setenv(outputs.KILL_ENV, "before-manifest")
    outputs.crash_point("before-manifest")  # no count: the first visit
    assert len(kills) == 2


def test_a_safetensors_no_space_error_is_a_one_line_write_error(tmp_path):
    from qerl_cli.errors import OutputWriteError
    from qerl_cli.outputs import StageOutput

    SafetensorError = type("SafetensorError", (Exception,), {})  # safetensors' own type, by name
    so = StageOutput(tmp_path / "o", "demo", config={}, inputs={})
    with pytest.raises(OutputWriteError, match="cannot write"):
        with so:
            raise SafetensorError("Error while serializing: IoError(Os { code: 28 }) (os error 28)")
    assert not (tmp_path / "o").exists()


def test_a_finished_output_missing_a_listed_file_is_damaged_not_done(tmp_path):
    from qerl_cli.errors import OutputExistsError
    from qerl_cli.outputs import StageOutput

    def stage():
        return StageOutput(tmp_path / "o", "demo", config={"a": 1}, inputs={})

    with stage() as work:
        (work / "x.bin").write_bytes(b"1234")
        (work / "y.bin").write_bytes(b"5")
    (tmp_path / "o" / "x.bin").unlink()
    with pytest.raises(OutputExistsError, match=r"damaged after it was written \(x.bin is missing\)"):
        stage().already_done()


# ---- merge ----
@pytest.fixture(scope="module")
def merge_pair(tmp_path_factory):
    from tests.helpers import make_tiny_hf_model
    from tests.test_merge import make_peft_adapter

    tmp = tmp_path_factory.mktemp("merge4")
    base = make_tiny_hf_model(tmp, arch="llama", hidden=32, layers=1, tokenizer=False)
    return base, make_peft_adapter(base, tmp / "ad", r=2, alpha=4, targets=["q_proj"], trainer_state=False)


def test_a_config_without_tie_word_embeddings_keeps_its_own_lm_head(merge_pair, tmp_path):
    # llama / qwen2 / qwen3 / mistral all default to untied: an adapter on embed_tokens must not replace
    # the stored lm_head with the embedding
    import shutil

    from safetensors.torch import load_file

    from qerl_cli.merge import MergeConfig, merge
    from tests.test_merge import make_peft_adapter

    base, _ = merge_pair
    adapter = make_peft_adapter(base, tmp_path / "ad", r=2, alpha=4, targets=["embed_tokens", "q_proj"],
                                trainer_state=False)
    own = tmp_path / "base"
    shutil.copytree(base, own)
    cfg = json.loads((own / "config.json").read_text())
    assert cfg.pop("tie_word_embeddings") is False
    (own / "config.json").write_text(json.dumps(cfg))
    m = merge(MergeConfig(own, adapter, tmp_path / "out"), progress=False)
    assert m["summary"]["untied_lm_head"] is False
    head = load_file(str(base / "model.safetensors"))["lm_head.weight"]
    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["lm_head.weight"], head.to(torch.bfloat16))


def test_the_low_retention_warning_starts_below_half_the_update(tmp_path, recwarn):
    from qerl_cli.errors import QerlWarning
    from qerl_cli.merge import MergeConfig, _warn_of_low_retention

    cfg = MergeConfig(tmp_path / "m", tmp_path / "a", tmp_path / "o", dtype="nvfp4")
    _warn_of_low_retention({"update_retained": 0.5}, cfg)
    assert not [w for w in recwarn if issubclass(w.category, QerlWarning)]
    with pytest.warns(QerlWarning, match="kept only 30% of the LoRA update"):
        _warn_of_low_retention({"update_retained": 0.3}, cfg)
    with pytest.warns(QerlWarning, match="kept only 49% of"):  # (review) it rounded to "50%" under the threshold
        _warn_of_low_retention({"update_retained": 0.4996}, cfg)
    with pytest.warns(QerlWarning, match="kept only 0% of"):  # not "-0%"
        _warn_of_low_retention({"update_retained": -0.003}, cfg)


def test_update_retention_reports_the_relative_error_as_a_norm_ratio(tmp_path):
    # error = ||W1 - W0 - D|| / ||D||, checked against dequantized weights the reference decoder wrote
    from safetensors.torch import load_file

    from qerl_cli.merge import open_base, read_adapter, update_retention
    from tests.test_merge import make_peft_adapter
    from tests.train_fixtures import dequantized_twin, quantized_tiny

    src0, q0 = quantized_tiny(tmp_path / "a")
    _, q1 = quantized_tiny(tmp_path / "b", seed=1)
    adapter = read_adapter(make_peft_adapter(src0, tmp_path / "ad", r=2, alpha=4, targets=["q_proj"],
                                             scale=0.3, trainer_state=False))
    got = update_retention(open_base(q0), q1, adapter)
    w0 = load_file(str(dequantized_twin(q0, tmp_path / "d0") / "model.safetensors"))
    w1 = load_file(str(dequantized_twin(q1, tmp_path / "d1") / "model.safetensors"))
    dot = dd = err = 0.0
    for m, delta in adapter.deltas.items():
        d, dw = delta.dense(), w1[m + ".weight"] - w0[m + ".weight"]
        dot, dd, err = dot + float((dw * d).sum()), dd + float((d * d).sum()), err + float(((dw - d) ** 2).sum())
    assert got["update_retained"] == pytest.approx(dot / dd, abs=2e-4)
    assert got["update_rel_error"] == pytest.approx((err / dd) ** 0.5, abs=2e-4)


def test_merge_stats_average_the_relative_update_over_modules():
    from qerl_cli.merge import MergeStats

    s = MergeStats()
    s.add_delta(torch.ones(4), torch.full((4,), 0.1))
    s.add_delta(torch.ones(4), torch.full((4,), 0.3))
    assert s.merged_modules == 2
    assert s.delta_rel_norm_mean == pytest.approx(0.2) and s.delta_rel_norm_max == pytest.approx(0.3)


def test_a_merge_to_another_dtype_is_not_already_done(merge_pair, tmp_path):
    from qerl_cli.errors import OutputExistsError
    from qerl_cli.merge import MergeConfig, merge

    base, adapter = merge_pair
    merge(MergeConfig(base, adapter, tmp_path / "out"), progress=False)
    with pytest.raises(OutputExistsError, match="different inputs or arguments"):
        merge(MergeConfig(base, adapter, tmp_path / "out", dtype="nvfp4"), progress=False)


def test_a_tied_base_that_stores_its_head_unties_with_one_lm_head(tmp_path):
    from safetensors.torch import load_file, save_file

    from qerl_cli.merge import MergeConfig, merge
    from tests.helpers import make_tiny_hf_model
    from tests.test_merge import make_peft_adapter

    base = make_tiny_hf_model(tmp_path, arch="llama", hidden=32, layers=1, tie_word_embeddings=True, tokenizer=False)
    adapter = make_peft_adapter(base, tmp_path / "ad", r=2, alpha=4, targets=["v_proj"],
                                modules_to_save=["embed_tokens"], trainer_state=False)
    t = load_file(str(base / "model.safetensors"))
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()  # a stored copy of the tied head
    save_file(t, str(base / "model.safetensors"), metadata={"format": "pt"})
    m = merge(MergeConfig(base, adapter, tmp_path / "out"), progress=False)
    assert m["summary"]["untied_lm_head"] is True
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(out["lm_head.weight"], t["model.embed_tokens.weight"].to(torch.bfloat16))
    assert not torch.equal(out["model.embed_tokens.weight"], out["lm_head.weight"])
    # a stored head that is not the embedding is ambiguous (transformers 4 ties, 5 keeps it): refused, as the
    # loader and quantize refuse it; merge picked the embedding without a word
    t["lm_head.weight"] = t["lm_head.weight"] + 1
    save_file(t, str(base / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BadInputError, match="tie_word_embeddings is true, but the checkpoint stores an lm_head"):
        merge(MergeConfig(base, adapter, tmp_path / "out2"), progress=False)
    assert not (tmp_path / "out2").exists()


# ---- quantize ----
def test_a_model_whose_heads_are_wider_than_its_hidden_size_quantizes(tmp_path):
    # Qwen3 sets head_dim apart from hidden_size / heads: q_proj is [heads * head_dim, hidden] and o_proj
    # its transpose, [hidden, heads * head_dim]
    import transformers
    from safetensors import safe_open

    from qerl_cli.quantize import QuantizeConfig, quantize
    from tests.helpers import tiny_config

    cfg = tiny_config("qwen3", hidden=32, layers=1, heads=4, kv_heads=2)
    cfg.head_dim = 16  # q_out 64 != hidden 32
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path / "src")
    quantize(QuantizeConfig(src=tmp_path / "src", out=tmp_path / "q", device="cpu", progress=False))
    with safe_open(str(tmp_path / "q" / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.layers.0.self_attn.o_proj.weight_packed").get_shape() == [32, 32]
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight_packed").get_shape() == [64, 16]


def test_quantize_copies_no_hidden_files_and_reports_each_layers_worst_error(tmp_path):
    from qerl_cli.quantize import QuantizeConfig, quantize
    from tests.helpers import make_tiny_hf_model

    src = make_tiny_hf_model(tmp_path, arch="llama", hidden=32, layers=2, tokenizer=False)
    (src / ".gitattributes").write_text("*.safetensors filter=lfs\n")  # a git / hub clone's own files
    res = quantize(QuantizeConfig(src=src, out=tmp_path / "q", device="cpu", progress=False))
    assert not (tmp_path / "q" / ".gitattributes").exists() and ".gitattributes" not in res.summary["copied_files"]
    per_layer = res.summary["per_layer_max_rel_error"]
    assert sorted(per_layer) == ["0", "1"]
    assert max(per_layer.values()) == res.summary["max_rel_error"]["value"]


def test_olora_is_refused_in_any_case():
    # PEFT reads init_lora_weights="OLoRA" as olora (it lowercases that one): a rewritten base
    from qerl_cli.adapters import unsupported_lora_variant

    assert "relative to a base PEFT rewrote" in unsupported_lora_variant({"init_lora_weights": "OLoRA"})
    assert unsupported_lora_variant({"init_lora_weights": "gaussian"}) is None
