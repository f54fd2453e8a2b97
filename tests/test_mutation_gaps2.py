"""Tests that kill mutants which survived the rest of the suite (manual mutation testing, round 2: the
rollout engine's scheduler and block manager, prompt loading, lineage/hashing/manifests/atomic outputs,
merge, quantize, adapters and train-step's batching/optimizer/resume; 2026-11-26).

Each pins a behaviour a user would notice if it changed."""

import json

import pytest
import torch

from qerl_cli.errors import BadInputError
from tests.train_fixtures import quick_step


# ---- engine: scheduler / block manager ----
def test_a_group_that_exactly_fills_the_free_slots_and_blocks_is_admitted_one_more_block_is_refused():
    from qerl_cli.engine.block_manager import BlockManager
    from qerl_cli.engine.scheduler import Group, Scheduler

    blocks = BlockManager(num_blocks=5, block_size=4)  # 4 usable blocks (block 0 is scratch)
    sched = Scheduler(blocks, max_num_seqs=1, max_num_batched_tokens=64)
    # 5 blocks can never be free at once: refused up front, not a stalled scheduler later
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        sched.add(Group(0, [1, 2, 3, 4], n=1, max_len=19))
    g = Group(1, [1, 2, 3, 4], n=1, max_len=15)  # needs exactly the 4 free blocks and the one slot
    sched.add(g)
    assert sched.can_admit()
    assert sched.admit() == [g] and blocks.num_free == 0



def test_a_kv_block_released_more_often_than_referenced_is_an_error():
    from qerl_cli.engine.block_manager import BlockManager

    blocks = BlockManager(num_blocks=4, block_size=4)
    (b,) = blocks.allocate(1)
    blocks.release([b])
    with pytest.raises(RuntimeError, match="released more often"):
        blocks.release([b])  # a double free would hand one block to two sequences

# ---- data ----
def _row(raw, **kw):
    from qerl_cli.data import parse_row, remap_row

    return parse_row(remap_row(raw, "f:1", kw.get("prompt_key"), kw.get("answer_key")), "f:1", 7)


def test_float_answers_are_plain_decimals():
    assert _row({"prompt": "p", "answer": 72.0}).answer == "72"
    assert _row({"prompt": "p", "answer": 1e16}).answer == "10000000000000000"


def test_a_null_id_falls_back_to_the_row_index_and_a_boolean_id_is_refused():
    assert _row({"id": None, "prompt": "p"}).id == "7"
    assert _row({"id": None, "unique_id": "u", "prompt": "p"}).id == "u"
    with pytest.raises(BadInputError, match="`id` must be"):
        _row({"id": True, "prompt": "p"})


def test_a_math_rows_answer_wins_over_its_solutions_boxed():
    assert _row({"problem": "p", "answer": "5", "solution": "so \\boxed{6}"}).answer == "5"


def test_answer_key_naming_a_null_column_means_no_reference_not_the_solution():
    row = _row({"problem": "p", "ans": None, "solution": "so \\boxed{6}"}, answer_key="ans")
    assert row.answer is None


def test_a_boolean_answer_is_refused():
    with pytest.raises(BadInputError, match="`answer` must be a string or number"):
        _row({"prompt": "p", "answer": True})


def test_a_blank_question_is_no_prompt():
    assert _row({"question": "  ", "problem": "real"}).prompt == "real"
    with pytest.raises(BadInputError, match="neither `prompt` nor `messages`"):
        _row({"question": " \n"})


def test_a_json_array_file_may_start_with_blank_lines(tmp_path):
    from qerl_cli.data import load_prompts

    p = tmp_path / "d.json"
    p.write_text('\n  [{"prompt": "a"},\n   {"prompt": "b"}]\n')
    assert [r.prompt for r in load_prompts(p)] == ["a", "b"]


@pytest.fixture(scope="module")
def chat_tok():
    from tests.helpers import make_tiny_tokenizer

    return make_tiny_tokenizer()


def test_a_template_wraps_the_last_user_turn_of_a_chat(chat_tok):
    from qerl_cli.data import PromptRow, render_prompt

    row = PromptRow("0", messages=[{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
                                   {"role": "user", "content": "second"}], where="f:1")
    text = render_prompt(row, chat_tok, template="Q: {prompt} A:")
    assert "Q: second A:" in text and "Q: first" not in text


def test_a_chat_prompt_gets_no_second_bos_from_the_tokenizer(chat_tok):
    import copy

    from tokenizers import processors

    from qerl_cli.data import PromptRow, encode_prompts

    tok = copy.deepcopy(chat_tok)
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                                  special_tokens=[("<|endoftext|>", bos)])
    assert tok("x")["input_ids"][0] == bos  # the tokenizer's usual special tokens: a BOS
    (enc,) = encode_prompts([PromptRow("0", prompt="hi", where="f:1")], tok)
    assert enc.token_ids == tok(enc.text, add_special_tokens=False)["input_ids"]  # the template wrote its own


def test_a_prompt_of_exactly_the_limit_is_kept(chat_tok):
    from qerl_cli.data import EncodeReport, PromptRow, encode_prompts

    rows = [PromptRow("0", prompt="hello there", where="f:1")]
    n = len(encode_prompts(rows, chat_tok)[0].token_ids)
    rep = EncodeReport()
    assert len(encode_prompts(rows, chat_tok, max_prompt_tokens=n, report=rep)) == 1 and not rep.skipped_long
    assert encode_prompts(rows, chat_tok, max_prompt_tokens=n - 1) == []


def test_only_rows_with_their_own_system_message_are_reported(chat_tok):
    from qerl_cli.data import EncodeReport, PromptRow, encode_prompts

    rows = [PromptRow("0", messages=[{"role": "user", "content": "a"}], where="f:1"),
            PromptRow("1", messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "b"}], where="f:2")]
    rep = EncodeReport()
    encode_prompts(rows, chat_tok, system_prompt="sys", report=rep)
    assert rep.own_system == ["f:2"]


def test_the_prefill_batch_stays_under_the_token_budget_padded_to_its_longest_prompt():
    from qerl_cli.engine.block_manager import BlockManager
    from qerl_cli.engine.scheduler import Group, Scheduler

    sched = Scheduler(BlockManager(num_blocks=64, block_size=4), max_num_seqs=8, max_num_batched_tokens=16)
    for i, n in enumerate([6, 2, 2]):
        sched.add(Group(i, list(range(1, n + 1)), n=1, max_len=n + 2))
    assert [g.index for g in sched.admit()] == [0, 1]  # a third would pad to 3 x 6 = 18 > 16 tokens
    sched2 = Scheduler(BlockManager(num_blocks=64, block_size=4), max_num_seqs=8, max_num_batched_tokens=8)
    for i in range(2):
        sched2.add(Group(i, [1, 2, 3, 4, 5], n=1, max_len=7))
    assert [g.index for g in sched2.admit()] == [0]  # two would be 10 > 8 tokens


# ---- lineage / hashing / outputs ----
def test_a_trainer_state_that_is_not_an_object_is_bad_input(tmp_path):
    from qerl_cli.lineage import recorded_base_hash

    (tmp_path / "trainer_state.json").write_text("[1, 2]")
    with pytest.raises(BadInputError, match="unreadable trainer state"):
        recorded_base_hash(tmp_path)


# ---- engine: LLMEngine ----
def _tiny_model(**extra):
    from qerl_cli.models import ModelConfig, build_random_model

    cfg = ModelConfig.from_hf(dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, **extra))
    return build_random_model(cfg, device="cpu", dtype=torch.float32, quantized=False, seed=0)


def _greedy(n_new, **kw):
    from qerl_cli.engine import SamplingParams

    return SamplingParams(temperature=0, max_new_tokens=n_new, **kw)


def test_engine_context_never_exceeds_the_models_positions_or_its_sliding_window():
    from qerl_cli.engine import LLMEngine

    assert LLMEngine(_tiny_model(), None, max_num_seqs=2, max_model_len=10**6, block_size=4).max_model_len <= 64
    windowed = _tiny_model(use_sliding_window=True, sliding_window=24, max_window_layers=0)
    assert LLMEngine(windowed, None, max_num_seqs=2, block_size=4).max_model_len <= 24


def test_a_token_id_equal_to_the_vocab_size_is_refused():
    from qerl_cli.engine import LLMEngine

    engine = LLMEngine(_tiny_model(), None, max_num_seqs=2, block_size=4)
    with pytest.raises(BadInputError, match="token id outside"):
        engine.generate([[1, 64]], _greedy(2), n=1)


class _EosTokenizer:
    def __init__(self, eos):
        self.eos_token_id = eos

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def test_ignore_eos_and_the_tokenizers_own_eos():
    from qerl_cli.engine import LLMEngine

    model = _tiny_model()
    free = LLMEngine(model, None, max_num_seqs=2, block_size=4).generate([[3, 4, 5]], _greedy(4, ignore_eos=True))[0][0]
    first = free.token_ids[0]
    # the tokenizer's EOS (not in config.json's eos ids) stops generation...
    stopped = LLMEngine(model, _EosTokenizer(first), max_num_seqs=2, block_size=4)
    out = stopped.generate([[3, 4, 5]], _greedy(4))[0][0]
    assert out.token_ids == [first] and out.finish_reason == "stop"
    # ...unless ignore_eos
    out = stopped.generate([[3, 4, 5]], _greedy(4, ignore_eos=True))[0][0]
    assert out.token_ids == free.token_ids and out.finish_reason == "length"


def test_progress_is_reported_when_a_whole_group_is_done():
    from qerl_cli.engine import LLMEngine

    engine = LLMEngine(_tiny_model(), None, max_num_seqs=2, block_size=4)
    calls = []
    engine.generate([[3, 4, 5], [6, 7]], _greedy(3, ignore_eos=True), n=2, progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (2, engine.stats["generated_tokens"]) == (2, 12)
    assert [d for d, _ in calls] == [1, 2]


def _stage(out, config, **kw):
    from qerl_cli.outputs import StageOutput

    return StageOutput(out, "demo", config=config, inputs={"x": "h1"}, **kw)


def _finish(so, text="one"):
    with so as work:
        (work / "a.txt").write_text(text)
    return so.manifest


def test_a_manifest_without_a_stage_is_no_manifest(tmp_path):
    from qerl_cli.outputs import read_manifest

    (tmp_path / "manifest.json").write_text(json.dumps({"fingerprint": "abc"}))
    assert read_manifest(tmp_path) is None


def test_an_empty_out_dir_is_replaced_with_force(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    so = _stage(out, {"k": 1}, force=True)
    assert not so.already_done()
    _finish(so)
    assert (out / "a.txt").read_text() == "one"


def test_two_identical_runs_into_one_out_both_finish(tmp_path):
    from qerl_cli.outputs import read_manifest

    out = tmp_path / "o"
    a, b = _stage(out, {"k": 1}), _stage(out, {"k": 1})
    assert not a.already_done() and not b.already_done()
    wb = b.__enter__()
    (wb / "a.txt").write_text("one")
    _finish(a)
    b.__exit__(None, None, None)  # the same run's output: replacing it with the same bytes is fine
    assert read_manifest(out)["fingerprint"] == a.fingerprint and (out / "a.txt").read_text() == "one"


def test_the_newest_old_output_is_the_one_put_back(tmp_path):
    import os

    from qerl_cli.outputs import read_manifest

    out = tmp_path / "o"
    fps = []
    for i, name in enumerate([".o.old-aaaaaaaa", ".o.old-bbbbbbbb"]):
        so = _stage(tmp_path / f"x{i}", {"k": i})
        assert not so.already_done()
        fps.append(_finish(so)["fingerprint"])
        (tmp_path / f"x{i}").rename(tmp_path / name)
        os.utime(tmp_path / name, (1000 + i, 1000 + i))  # bbbbbbbb is the newer one
    assert _stage(out, {"k": 1}).already_done()
    assert read_manifest(out)["fingerprint"] == fps[1]


def test_a_failed_second_rename_puts_the_old_output_back(tmp_path, monkeypatch):
    import errno
    import os

    import qerl_cli.outputs as outputs
    from qerl_cli.errors import OutputWriteError

    out = tmp_path / "o"
    so = _stage(out, {"k": 1})
    assert not so.already_done()
    _finish(so, "old")
    monkeypatch.setattr(outputs, "_exchange", lambda a, b: False)  # a file system without RENAME_EXCHANGE
    real = os.replace

    def replace(src, dst):
        if ".tmp-" in str(src) and str(dst) == str(out):
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real(src, dst)

    monkeypatch.setattr(outputs.os, "replace", replace)
    so = _stage(out, {"k": 2}, force=True)
    assert not so.already_done()
    with pytest.raises(OutputWriteError, match="No space left"):
        _finish(so, "new")
    assert (out / "a.txt").read_text() == "old"


def test_out_may_not_hold_an_input(tmp_path):
    from qerl_cli.outputs import check_out_apart

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "p.jsonl").write_text("{}\n")
    with pytest.raises(BadInputError, match="overlaps --prompts"):
        check_out_apart(tmp_path / "d", prompts=tmp_path / "d" / "p.jsonl")  # --force would delete the prompts
    check_out_apart(tmp_path / "e", prompts=tmp_path / "d" / "p.jsonl")
    with pytest.raises(BadInputError, match="overlaps --model"):
        check_out_apart(tmp_path / "d" / "out", model=tmp_path / "d")  # inside a directory input


def test_a_forced_rerun_over_its_own_output_did_not_finish_meanwhile(tmp_path):
    out = tmp_path / "o"
    first = _stage(out, {"k": 1})
    assert not first.already_done()
    _finish(first)
    again = _stage(out, {"k": 1}, force=True)
    assert not again.already_done()
    assert not again.finished_meanwhile()  # rollout --force would refuse: "finished by another qerl rollout"


def _hash_of(tmp_path, name, tensors, edit=None):
    from safetensors.torch import save_file

    from qerl_cli.hashing import model_hash

    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text("{}")
    save_file(tensors, str(d / "model.safetensors"))
    if edit:
        edit(d / "model.safetensors")
    return model_hash(d)


def test_model_hash_sees_the_middle_of_a_shard_and_its_length(tmp_path):
    big = {"w": torch.zeros(4 << 20, dtype=torch.uint8)}
    base = _hash_of(tmp_path, "a", big)

    def poke_middle(p):
        with open(p, "r+b") as f:
            f.seek(p.stat().st_size // 2)
            f.write(b"\x01")

    def truncate(p):
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size - 16)

    assert _hash_of(tmp_path, "b", big, poke_middle) != base  # a retrained tensor in the middle of a shard
    assert _hash_of(tmp_path, "c", big, truncate) != base     # a truncated download


def test_model_hash_reads_the_whole_safetensors_header(tmp_path):
    data = torch.arange(16, dtype=torch.float32)
    one = {"a.weight": data.clone(), "model.layers.0.mlp.up_proj.weight": data.reshape(4, 4).clone()}
    two = {"a.weight": data.clone(), "model.layers.0.mlp.up_proj.weight": data.reshape(2, 8).clone()}
    assert _hash_of(tmp_path, "one", one) != _hash_of(tmp_path, "two", two)  # same bytes, another shape


def test_fingerprints_do_not_depend_on_dict_order():
    from qerl_cli.hashing import sha256_json

    assert sha256_json({"a": 1, "b": {"c": 2, "d": 3}}) == sha256_json({"b": {"d": 3, "c": 2}, "a": 1})


def test_model_hash_covers_config_json(tmp_path):
    from qerl_cli.hashing import model_hash

    (tmp_path / "config.json").write_text(json.dumps({"rope_theta": 10000}))
    before = model_hash(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"rope_theta": 1000000}))  # another model, same weights
    assert model_hash(tmp_path) != before


def test_a_crash_while_replacing_a_resumable_output_leaves_no_old_output_to_resume_from(tmp_path, monkeypatch):
    import qerl_cli.outputs as outputs
    from qerl_cli.outputs import read_manifest

    class Crash(BaseException):
        pass

    out = tmp_path / "o"
    first = _stage(out, {"k": 1}, resumable=True)
    assert not first.already_done()
    old_fp = _finish(first, "old")["fingerprint"]

    def crash_at(name):
        if name == "mid-swap":
            raise Crash

    monkeypatch.setattr(outputs, "crash_point", crash_at)
    second = _stage(out, {"k": 2}, resumable=True, force=True)
    assert not second.already_done()
    with pytest.raises(Crash):
        _finish(second, "new")
    partial = tmp_path / f".o.partial-{second.fingerprint[:16]}"
    assert not partial.exists() or (read_manifest(partial) or {}).get("fingerprint") != old_fp


def test_a_file_in_the_way_inside_a_stage_is_a_one_line_write_error(tmp_path):
    from qerl_cli.errors import OutputWriteError

    so = _stage(tmp_path / "o", {"k": 1})
    assert not so.already_done()
    with pytest.raises(OutputWriteError):
        with so as work:
            (work / "sub").write_text("x")
            (work / "sub").mkdir()  # FileExistsError (EEXIST)
    assert not (tmp_path / "o").exists()


def test_an_old_output_left_beside_a_finished_one_is_swept_not_put_back(tmp_path):
    from qerl_cli.outputs import read_manifest

    out = tmp_path / "o"
    new = _stage(out, {"k": 2})
    assert not new.already_done()
    fp = _finish(new, "new")["fingerprint"]
    old = _stage(tmp_path / "x", {"k": 1})
    assert not old.already_done()
    _finish(old, "old")
    (tmp_path / "x").rename(tmp_path / ".o.old-aaaaaaaa")  # a replace killed before deleting the old one
    assert _stage(out, {"k": 2}).already_done()
    assert read_manifest(out)["fingerprint"] == fp and not (tmp_path / ".o.old-aaaaaaaa").exists()


def test_ranks_that_put_the_old_output_back_at_once_all_find_it(tmp_path, monkeypatch):
    # torchrun's ranks check one --out together: after a replace killed between its renames, each found the old
    # output beside it and put it back; the one that came second died in os.replace (FileNotFoundError, a traceback)
    # and torchrun stopped the others (a review, session 55). Here the other rank puts it back while this one reads.
    import os
    from pathlib import Path

    import qerl_cli.outputs as outputs

    out, old = tmp_path / "o", tmp_path / ".o.old-aaaaaaaa"
    so = _stage(tmp_path / "x", {"k": 1})
    assert not so.already_done()
    fp = _finish(so)["fingerprint"]
    (tmp_path / "x").rename(old)
    real = outputs.read_manifest

    def read_then_other_rank_recovers(d):
        m = real(d)
        if Path(d) == old and old.exists():
            os.replace(old, out)  # the other rank, a moment earlier
        return m

    monkeypatch.setattr(outputs, "read_manifest", read_then_other_rank_recovers)
    assert _stage(out, {"k": 1}).already_done()
    assert real(out)["fingerprint"] == fp and not old.exists()


def test_an_old_output_without_a_manifest_is_not_put_back(tmp_path):
    half = tmp_path / ".o.old-aaaaaaaa"  # half deleted: its manifest already gone
    half.mkdir()
    (half / "a.txt").write_text("x")
    assert not _stage(tmp_path / "o", {"k": 1}).already_done()


# ---- engine / train: sizes at their limits ----
def test_the_automatic_kv_cache_holds_max_num_seqs_completions_of_max_model_len():
    from qerl_cli.engine import LLMEngine

    engine = LLMEngine(_tiny_model(), None, max_num_seqs=2, max_model_len=16, block_size=4)
    outs = engine.generate([[1]], _greedy(15, ignore_eos=True), n=2)[0]
    assert [len(c.token_ids) for c in outs] == [15, 15]


def test_a_micro_batch_of_exactly_the_budget_is_one_micro_batch():
    from qerl_cli.train.batching import pack_microbatches

    assert pack_microbatches([4, 4], 8) == [[0, 1]]
    assert pack_microbatches([4, 4, 4], 8) == [[0, 1], [2]]


def test_lr_with_total_steps_equal_to_warmup_stays_at_peak():
    from qerl_cli.train.optim import lr_at

    assert lr_at(5, 1e-3, warmup_steps=3, total_steps=3) == 1e-3


def test_grad_clip_never_scales_small_gradients_up():
    from qerl_cli.train.optim import grad_norm_and_clip

    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([0.3, 0.4])
    assert grad_norm_and_clip([p], 1.0) == pytest.approx(0.5)
    assert torch.equal(p.grad, torch.tensor([0.3, 0.4]))


def test_a_trainer_state_of_a_newer_schema_is_refused(tmp_path):
    from qerl_cli.train.state import STATE_SCHEMA, TrainerState

    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 3, "schema": STATE_SCHEMA + 1}))
    with pytest.raises(BadInputError, match="newer than this qerl"):
        TrainerState.load(tmp_path / "trainer_state.json")



def test_a_trainer_state_with_keys_this_qerl_does_not_know_loads(tmp_path):
    from qerl_cli.train.state import TrainerState

    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 3, "written_by": "a later qerl"}))
    assert TrainerState.load(tmp_path / "trainer_state.json").global_step == 3


# ---- adapters ----
def test_an_adapter_config_with_rank_zero_is_bad_input(tmp_path):
    from qerl_cli.adapters import read_adapter_spec

    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 0, "target_modules": ["q_proj"]}))
    with pytest.raises(BadInputError, match="'r' must be a positive integer, got 0"):
        read_adapter_spec(tmp_path)


def _lora_model(spec):
    from qerl_cli.models import ModelConfig, build_random_model

    cfg = ModelConfig.from_hf(dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    return build_random_model(cfg, device="cpu", dtype=torch.float32, quantized=False, lora=spec)


def test_an_rslora_adapter_loads_with_rslora_scaling(tmp_path):
    from qerl_cli.adapters import load_adapter, save_adapter
    from qerl_cli.layers.lora import LoraSpec, lora_modules

    model = _lora_model
    save_adapter(model(LoraSpec(r=4, alpha=8, targets=("q_proj",), use_rslora=True)), tmp_path / "a", base_model_path="x")
    into = model(LoraSpec(r=4, alpha=1, targets=("q_proj",)))
    load_adapter(into, tmp_path / "a")
    assert {m.scaling for _, m in lora_modules(into)} == {8 / 4 ** 0.5}


def test_an_adapter_missing_a_modules_lora_b_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from qerl_cli.adapters import load_adapter, save_adapter
    from qerl_cli.layers.lora import LoraSpec

    spec = LoraSpec(r=4, alpha=8, targets=("q_proj", "v_proj"))
    save_adapter(_lora_model(spec), tmp_path / "a", base_model_path="x")
    w = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    save_file({k: t for k, t in w.items() if not ("v_proj" in k and "lora_B" in k)}, str(tmp_path / "a" / "adapter_model.safetensors"))
    with pytest.raises(BadInputError, match="no lora_A/lora_B"):
        load_adapter(_lora_model(spec), tmp_path / "a")


def test_an_adapter_holding_nan_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from qerl_cli.adapters import load_adapter, save_adapter
    from qerl_cli.layers.lora import LoraSpec

    spec = LoraSpec(r=4, alpha=8, targets=("q_proj",))
    save_adapter(_lora_model(spec), tmp_path / "a", base_model_path="x")
    w = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    w = {k: (t.fill_(float("nan")) if "lora_A" in k else t) for k, t in w.items()}
    save_file(w, str(tmp_path / "a" / "adapter_model.safetensors"))
    with pytest.raises(BadInputError, match="NaN or Inf"):
        load_adapter(_lora_model(spec), tmp_path / "a")


def test_per_module_alpha_pattern_is_refused(tmp_path):
    from qerl_cli.adapters import read_adapter_spec

    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"],
                                                              "alpha_pattern": {"q_proj": 32}}))
    with pytest.raises(BadInputError, match="alpha_pattern"):
        read_adapter_spec(tmp_path)


def test_adapter_config_lists_targets_in_one_order():
    from qerl_cli.adapters import lora_config

    kw = dict(r=4, alpha=8, dropout=0.0, rslora=False, base_model_path="x")
    assert lora_config(targets=["v_proj", "q_proj"], **kw) == lora_config(targets=["q_proj", "v_proj"], **kw)


def test_trained_norms_of_another_shape_are_refused(tmp_path):
    from safetensors.torch import save_file

    from qerl_cli.adapters import load_norms
    from qerl_cli.layers.lora import LoraSpec

    model = _lora_model(LoraSpec(r=4, alpha=8, targets=("q_proj",)))
    save_file({"model.norm.weight": torch.ones(1)}, str(tmp_path / "norms.safetensors"))  # would broadcast
    with pytest.raises(BadInputError, match="has shape"):
        load_norms(model, tmp_path / "norms.safetensors")

# ---- quantize ----
@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    from tests.helpers import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("src"), "qwen2", intermediate=32)


def _quantize(src, out, **kw):
    from qerl_cli.quantize import QuantizeConfig, quantize

    return quantize(QuantizeConfig(src=src, out=out, progress=False, device="cpu", **kw))


def test_quantize_refuses_an_out_inside_its_source(tiny_src):
    with pytest.raises(BadInputError, match="must not be the source directory, inside it"):
        _quantize(tiny_src, tiny_src / "q")
    assert not (tiny_src / "q").exists()


def test_quantize_refuses_an_out_that_holds_its_source(tiny_src, tmp_path):
    # (mutation round 4) `quantize out/src --out out --force` over an earlier output swapped `out` away,
    # and the source inside it with it: exit 0, the source gone
    import shutil

    out = tmp_path / "out"
    _quantize(tiny_src, out)
    shutil.copytree(tiny_src, out / "src")
    with pytest.raises(BadInputError, match="or hold it"):
        _quantize(out / "src", out, force=True)
    assert (out / "src" / "config.json").is_file()


def test_another_max_shard_size_is_not_already_done(tiny_src, tmp_path):
    from qerl_cli.errors import OutputExistsError

    assert not _quantize(tiny_src, tmp_path / "q", max_shard_size="5GB").already_done
    with pytest.raises(OutputExistsError):  # the same bytes in other shards: not the output asked for
        _quantize(tiny_src, tmp_path / "q", max_shard_size="20KB")


# ---- train-step: resume ----
_step = quick_step


def test_a_resumed_step_continues_the_adam_moments_and_the_lr_schedule(qmodel, tmp_path):
    from safetensors.torch import load_file

    from qerl_cli.adapters import adapter_hash
    from tests.train_fixtures import make_shard

    q, h = qmodel
    sched = dict(warmup_steps=4, total_steps=10, epochs=2)
    _step(q, make_shard(tmp_path / "sh0", h, seed=1, groups=2), tmp_path / "a1", **sched)
    sh1 = make_shard(tmp_path / "sh1", h, adapter_hash=adapter_hash(tmp_path / "a1"), step=1, seed=2, groups=2)
    m = _step(q, sh1, tmp_path / "a2", adapter=tmp_path / "a1", **sched)["metrics"]
    # epochs advance the schedule by 1/epochs each: positions 1 and 1.5 of a 4-step warmup
    assert m["lr_per_epoch"] == pytest.approx([1e-3 * 2 / 4, 1e-3 * 2.5 / 4])
    # AdamW's moments came from step 1's optimizer.safetensors: 2 + 2 updates, not a fresh start
    steps = {float(t) for k, t in load_file(str(tmp_path / "a2" / "optimizer.safetensors")).items() if k.endswith(".step")}
    assert steps == {4.0}


def test_an_adapter_without_trainer_state_starts_the_schedule_at_the_shards_step(qmodel, tmp_path):
    from qerl_cli.adapters import adapter_hash
    from tests.train_fixtures import make_shard

    q, h = qmodel
    _step(q, make_shard(tmp_path / "sh0", h, seed=1, groups=2), tmp_path / "a1")
    (tmp_path / "a1" / "trainer_state.json").unlink()  # a plain PEFT adapter
    (tmp_path / "p").mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (tmp_path / "p" / f).write_bytes((tmp_path / "a1" / f).read_bytes())
    sh = make_shard(tmp_path / "sh5", h, adapter_hash=adapter_hash(tmp_path / "p"), step=5, seed=2, groups=2)
    _step(q, sh, tmp_path / "a6", adapter=tmp_path / "p")
    state = json.loads((tmp_path / "a6" / "trainer_state.json").read_text())
    assert state["global_step"] == state["schedule"]["position"] == 6


def test_bnpo_normalises_each_micro_batch_by_its_own_tokens(qmodel, tmp_path):
    from tests.train_fixtures import make_shard

    q, h = qmodel
    sh = make_shard(tmp_path / "sh", h, seed=3, groups=2)
    one = _step(q, sh, tmp_path / "one", loss="bnpo", micro_batch_tokens=4000)["metrics"]
    many = _step(q, sh, tmp_path / "many", loss="bnpo", micro_batch_tokens=40)["metrics"]
    assert many["micro_batches"] > one["micro_batches"] == 1
    assert many["loss"] != pytest.approx(one["loss"], rel=1e-3)  # dapo's would agree; bnpo's may not



def test_each_epoch_starts_from_fresh_gradients(qmodel, tmp_path):
    from tests.train_fixtures import make_shard

    q, h = qmodel
    # lr 0: the parameters never move, so every epoch's gradient is the first one's, unless they pile up
    m = _step(q, make_shard(tmp_path / "sh", h, seed=4, groups=2), tmp_path / "a", lr=0.0, epochs=2, max_grad_norm=0.0)
    g = m["metrics"]["grad_norm_per_epoch"]
    assert g[0] > 0 and g[1] == pytest.approx(g[0], rel=1e-4)


def test_each_epoch_draws_its_own_dropout_masks(qmodel, tmp_path):
    from qerl_cli.adapters import adapter_hash
    from tests.train_fixtures import make_shard

    q, h = qmodel
    _step(q, make_shard(tmp_path / "sh0", h, seed=1, groups=2), tmp_path / "a1", lr=2e-2, lora_dropout=0.3)
    sh1 = make_shard(tmp_path / "sh1", h, adapter_hash=adapter_hash(tmp_path / "a1"), step=1, seed=2, groups=2)
    m = _step(q, sh1, tmp_path / "a2", adapter=tmp_path / "a1", lr=0.0, epochs=2, lora_dropout=0.3)["metrics"]
    # lr 0: epoch 2 differs from epoch 1 (ratio 1) only through its own dropout masks
    assert m["loss_last_epoch"] != pytest.approx(m["loss"], rel=1e-6, abs=1e-9)



# ---- merge ----
def test_merge_refuses_a_zero_max_shard_size(tmp_path):
    from qerl_cli.merge import MergeConfig

    with pytest.raises(BadInputError, match="--max-shard-size must be positive"):
        MergeConfig(model=tmp_path / "m", adapter=tmp_path / "a", out=tmp_path / "o", max_shard_size=0)


def _peft_dir(d, tensors, **cfg):
    from safetensors.torch import save_file

    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                       "target_modules": ["q_proj"], **cfg}))
    save_file({f"base_model.model.model.layers.0.self_attn.q_proj.lora_{k}.weight": t for k, t in tensors.items()},
              str(d / "adapter_model.safetensors"))
    return d


def test_merge_reads_alpha_pattern_keys_as_module_name_suffixes(tmp_path):
    from qerl_cli.merge import read_adapter

    a = read_adapter(_peft_dir(tmp_path / "a", {"A": torch.ones(4, 8), "B": torch.ones(8, 4)}, alpha_pattern={"proj": 2}))
    assert a.deltas["model.layers.0.self_attn.q_proj"].scaling == 8 / 4  # "proj" is no suffix of "...q_proj"


def test_merge_refuses_lora_a_and_b_of_different_ranks(tmp_path):
    from qerl_cli.merge import read_adapter

    with pytest.raises(BadInputError, match="do not form a rank-r pair"):
        read_adapter(_peft_dir(tmp_path / "a", {"A": torch.ones(4, 8), "B": torch.ones(8, 3)}))


# ---- checkpoint writer ----
def _write_shards(out, tensors, max_bytes):
    from qerl_cli.checkpoint import PlannedTensor, ShardedWriter

    out.mkdir()
    w = ShardedWriter(out, [PlannedTensor(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], max_bytes)
    for n, t in tensors.items():
        w.write(n, t)
    return w.close()


def test_a_shard_filled_exactly_to_max_shard_size_is_one_shard(tmp_path):
    tensors = {"a": torch.ones(4), "b": torch.ones(4)}  # 16 + 16 bytes
    assert set(_write_shards(tmp_path / "o", tensors, 32).values()) == {"model.safetensors"}


def test_a_two_shard_checkpoint_has_an_index_and_aligned_data(tmp_path):
    import struct

    from safetensors.torch import load_file

    tensors = {"a": torch.arange(3, dtype=torch.float32), "b": torch.arange(5, dtype=torch.float32)}
    wm = _write_shards(tmp_path / "o", tensors, 16)
    index = json.loads((tmp_path / "o" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == wm and len(set(wm.values())) == 2
    for f in set(wm.values()):
        raw = (tmp_path / "o" / f).read_bytes()
        assert (8 + struct.unpack("<Q", raw[:8])[0]) % 8 == 0  # tensors start 8-byte aligned, as safetensors writes
        for n, t in load_file(str(tmp_path / "o" / f)).items():
            assert torch.equal(t, tensors[n])


def test_merge_refuses_tensors_whose_rank_is_not_the_configs(tmp_path):
    from qerl_cli.merge import read_adapter

    with pytest.raises(BadInputError, match="has rank 4 but adapter_config.json says r=8"):
        read_adapter(_peft_dir(tmp_path / "a", {"A": torch.ones(4, 8), "B": torch.ones(8, 4)}, r=8))


def test_merge_finds_the_base_tensor_of_a_modules_to_save_copy(tmp_path):
    from safetensors.torch import load_file, save_file

    from qerl_cli.merge import read_adapter

    d = _peft_dir(tmp_path / "a", {"A": torch.ones(4, 8), "B": torch.ones(8, 4)})
    w = load_file(str(d / "adapter_model.safetensors"))
    w["base_model.model.model.norm.modules_to_save.default.weight"] = torch.ones(8)
    save_file(w, str(d / "adapter_model.safetensors"))
    assert set(read_adapter(d).replacements) == {"model.norm.weight"}


def test_merge_checks_a_trained_tensors_shape_before_writing(tiny_src):
    from qerl_cli.merge import Adapter, open_base, validate_pair

    bad = Adapter(tiny_src, {}, deltas={}, replacements={"model.norm.weight": torch.ones(3)}, base_hash=None)
    with pytest.raises(BadInputError, match="has shape"):
        validate_pair(bad, open_base(tiny_src))


def test_a_merged_config_carries_no_quantization_blocks(tiny_src, tmp_path):
    from qerl_cli.merge import open_base, write_plain_config

    base = open_base(tiny_src)
    base.config["compression_config"] = {"quant_method": "compressed-tensors"}  # an older compressed-tensors base
    base.config["quantization_config"] = {"quant_method": "compressed-tensors"}
    base.config["dtype"] = "float32"  # transformers >= 4.56 writes `dtype` beside (or instead of) torch_dtype
    write_plain_config(base, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "compression_config" not in cfg and "quantization_config" not in cfg
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"


def test_the_saved_rng_state_does_not_depend_on_the_micro_batching(qmodel, tmp_path):
    from tests.train_fixtures import make_shard

    q, h = qmodel
    sh = make_shard(tmp_path / "sh", h, seed=5, groups=2)
    _step(q, sh, tmp_path / "a", micro_batch_tokens=4000)
    _step(q, sh, tmp_path / "b", micro_batch_tokens=40)  # as a run on more GPUs splits it
    rng = [json.loads((tmp_path / d / "trainer_state.json").read_text())["rng"] for d in ("a", "b")]
    assert rng[0] == rng[1]


def test_merging_a_zero_update_into_nvfp4_reports_no_retention(qmodel, tmp_path):
    from qerl_cli.merge import MergeConfig, merge
    from tests.train_fixtures import make_shard

    q, h = qmodel
    _step(q, make_shard(tmp_path / "sh", h, seed=6, groups=2), tmp_path / "a", lr=0.0)  # lora_B stays 0
    m = merge(MergeConfig(model=q, adapter=tmp_path / "a", out=tmp_path / "o", dtype="nvfp4", device="cpu"), progress=False)
    assert m["summary"]["requantization"]["update_retained"] is None


def test_editing_an_adapters_trained_norms_makes_a_merge_a_different_run(qmodel, tmp_path):
    from safetensors.torch import load_file, save_file

    from qerl_cli.errors import OutputExistsError
    from qerl_cli.merge import MergeConfig, merge
    from tests.train_fixtures import make_shard

    q, h = qmodel
    _step(q, make_shard(tmp_path / "sh", h, seed=7, groups=2), tmp_path / "a", train_norms=True)
    cfg = MergeConfig(model=q, adapter=tmp_path / "a", out=tmp_path / "o", device="cpu")
    merge(cfg, progress=False)
    norms = tmp_path / "a" / "norms.safetensors"
    save_file({k: t * 2 for k, t in load_file(str(norms)).items()}, str(norms))
    with pytest.raises(OutputExistsError):
        merge(cfg, progress=False)



def test_an_nvfp4_weight_without_its_global_scale_is_named(tiny_src, tmp_path):
    from safetensors.torch import save_file

    from qerl_cli.merge import open_base, packed_weights

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text((tiny_src / "config.json").read_text())
    save_file({"model.layers.0.self_attn.q_proj.weight_packed": torch.zeros(4, 8, dtype=torch.uint8),
               "model.layers.0.self_attn.q_proj.weight_scale": torch.zeros(4, 1).to(torch.float8_e4m3fn)},
              str(d / "model.safetensors"))
    with pytest.raises(BadInputError, match="has no model.layers.0.self_attn.q_proj.weight_global_scale"):
        packed_weights(open_base(d))


def test_merge_counts_only_really_trained_tensors_as_replaced(tiny_src):
    from qerl_cli.checkpoint import TensorReader
    from qerl_cli.merge import Adapter, MergeStats, merged_tensors, open_base

    base = open_base(tiny_src)
    with TensorReader(base.tensors) as r:
        norm = r.get("model.norm.weight").clone()
    for rep, want in ((norm, 0), (norm * 2, 1)):  # PEFT's saved copy of an untouched base tensor, a trained one
        stats = MergeStats()
        with TensorReader(base.tensors) as r:
            list(merged_tensors(base, r, Adapter(tiny_src, {}, {}, {"model.norm.weight": rep}, None), stats))
        assert stats.replaced_tensors == want
