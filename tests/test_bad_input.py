"""Bad input, every stage, through the CLI: each case gets one ``error:`` line on stderr (no
traceback), the documented non-zero exit code (2 bad input, 5 NaN/Inf, 6 out of memory) and no
output directory, not even a temp one.

Cases: truncated / corrupt / empty safetensors, JSONL lines that are not JSON or lack fields
(``file:line`` in the message; ``--skip-bad-lines`` counts and continues), empty inputs, wrong
dtypes, shapes that do not match, unknown architectures, NaN/Inf in weights, shards or loss, and
an out-of-memory (simulated: ``torch.OutOfMemoryError`` raised where the stage allocates).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qerl_cli.outputs import read_manifest
from tests.reliability_fixtures import (
    ANSWERED_ROWS,
    assert_one_line_error,
    copy_tree,
    invoke,
    leftovers,
    pipeline,
    write_jsonl,
)


@pytest.fixture(scope="module")
def p():
    return pipeline()


def nothing_written(tmp_path, name="out"):
    """No --out and no temp dir; rollout's resumable ``.out.partial-*`` (hidden, resumed by a rerun) is allowed."""
    left = [n for n in leftovers(tmp_path, name) if not n.startswith(f".{name}.partial-")]
    assert left == [], f"partial output left behind: {left}"


def edit_weights(src_dir, dst_dir, fn, file="model.safetensors"):
    """Copy a model dir and rewrite one safetensors file through ``fn(tensors) -> tensors``."""
    d = copy_tree(src_dir, dst_dir)
    (d / "manifest.json").unlink(missing_ok=True)
    tensors = load_file(str(d / file))
    save_file(fn(tensors), str(d / file), metadata={"format": "pt"})
    return d


def edit_config(src_dir, dst_dir, **changes):
    d = copy_tree(src_dir, dst_dir)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def corrupt_header(path):
    data = bytearray(path.read_bytes())
    data[8:24] = b"\x00\xff not json!!!!!"
    path.write_bytes(bytes(data))


# ---- cli arguments of each stage -------------------------------------------------------------------
def quantize_args(src, out):
    return ["quantize", src, "--out", out, "--device", "cpu", "--no-progress"]


def rollout_args(model, prompts, out, *extra):
    return ["rollout", "--model", model, "--prompts", prompts, "--out", out, "-G", 2, "--max-new-tokens", 3,
            "--device", "cpu", "-q", *extra]


def train_args(model, shards, out, *extra):
    return ["train-step", "--model", model, "--shards", shards, "--out", out, "--device", "cpu", "-q", *extra]


def merge_args(model, adapter, out):
    return ["merge", "--model", model, "--adapter", adapter, "--out", out, "-q"]


def eval_args(model, dataset, out, *extra):
    return ["eval", "--model", model, "--dataset", dataset, "--out", out, "--max-new-tokens", 3, "--device", "cpu",
            "-q", *extra]


NORM = "model.layers.0.input_layernorm.weight"
PACKED = "model.layers.0.self_attn.q_proj.weight_packed"


def _nan_norm(t):
    t[NORM] = t[NORM].clone()
    t[NORM][3] = float("nan")
    return t


def _inf_embed(t):
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()
    t["model.embed_tokens.weight"][5, 7] = float("inf")
    return t


# ---- models: corrupt / truncated / empty / dtype / shape / arch / NaN -----------------------------
def _model_cases(base_key):
    """(case id, how to break a copy of the model dir, exit code, words the message must hold)."""

    def trunc(d):
        truncate(d / "model.safetensors")

    def header(d):
        corrupt_header(d / "model.safetensors")

    def empty_file(d):
        (d / "model.safetensors").write_bytes(b"")

    def lfs_pointer(d):  # a repo cloned without git-lfs: the error said only "header length 2e18 > file size"
        (d / "model.safetensors").write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{'0' * 64}\nsize 9\n")

    def no_weights(d):
        (d / "model.safetensors").unlink()

    def arch(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["model_type"], cfg["architectures"] = "gpt_neox", ["GPTNeoXForCausalLM"]
        (d / "config.json").write_text(json.dumps(cfg))

    def rewrite(fn):
        def go(d):
            t = load_file(str(d / "model.safetensors"))
            save_file(fn(t), str(d / "model.safetensors"), metadata={"format": "pt"})
        return go

    if base_key == "src":
        shape_key, dtype_key = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"
    else:
        shape_key, dtype_key = PACKED, PACKED
    cases = [
        ("truncated", trunc, 2, ["model.safetensors"]),
        ("corrupt-header", header, 2, ["model.safetensors"]),
        ("empty-file", empty_file, 2, ["model.safetensors"]),
        ("lfs-pointer", lfs_pointer, 2, ["model.safetensors", "git lfs pull"]),
        ("no-weights", no_weights, 2, ["safetensors"]),
        ("unknown-arch", arch, 2, ["gpt_neox"]),
        ("wrong-shape", rewrite(lambda t: {**t, shape_key: t[shape_key][:, : t[shape_key].shape[1] // 2].contiguous()}),
         2, [shape_key]),
        ("wrong-dtype", rewrite(lambda t: {**t, dtype_key: t[dtype_key].to(torch.int32)}), 2, [dtype_key]),
        ("nan-weight", rewrite(_nan_norm), 5, [NORM]),
        ("inf-weight", rewrite(_inf_embed), 5, ["model.embed_tokens.weight"]),
    ]
    return cases


def _ids(cases):
    return [c[0] for c in cases]


SRC_CASES = _model_cases("src")
Q_CASES = _model_cases("q")


@pytest.mark.parametrize("case,breaker,code,needles", SRC_CASES, ids=_ids(SRC_CASES))
def test_quantize_bad_source(p, tmp_path, case, breaker, code, needles):
    src = copy_tree(p["src"], tmp_path / "src")
    breaker(src)
    r = invoke(quantize_args(src, tmp_path / "out"))
    assert_one_line_error(r, code, *needles)
    nothing_written(tmp_path)


@pytest.mark.parametrize("case,breaker,code,needles", Q_CASES, ids=_ids(Q_CASES))
def test_rollout_bad_model(p, tmp_path, case, breaker, code, needles):
    q = copy_tree(p["q"], tmp_path / "q")
    breaker(q)
    r = invoke(rollout_args(q, p["prompts"], tmp_path / "out"))
    assert_one_line_error(r, code, *needles)
    nothing_written(tmp_path)


@pytest.mark.parametrize("case,breaker,code,needles", Q_CASES, ids=_ids(Q_CASES))
def test_eval_bad_model(p, tmp_path, case, breaker, code, needles):
    q = copy_tree(p["q"], tmp_path / "q")
    breaker(q)
    r = invoke(eval_args(q, p["prompts"], tmp_path / "out"))
    assert_one_line_error(r, code, *needles)
    nothing_written(tmp_path)


@pytest.mark.parametrize("case,breaker,code,needles", Q_CASES, ids=_ids(Q_CASES))
def test_train_step_bad_model(p, tmp_path, case, breaker, code, needles):
    """Shards made from the broken model itself (else lineage refuses it first, exit 3)."""
    from qerl_cli.hashing import model_hash
    from tests.train_fixtures import make_shard

    q = copy_tree(p["q"], tmp_path / "q")
    breaker(q)
    sh = make_shard(tmp_path / "sh", model_hash(q))
    r = invoke(train_args(q, sh, tmp_path / "out"))
    assert_one_line_error(r, code, *needles)
    nothing_written(tmp_path)


MERGE_CASES = [c for c in Q_CASES if c[0] in ("truncated", "corrupt-header", "lfs-pointer", "wrong-shape", "nan-weight")]


@pytest.mark.parametrize("case,breaker,code,needles", MERGE_CASES, ids=_ids(MERGE_CASES))
def test_merge_bad_base(p, tmp_path, case, breaker, code, needles):
    q = copy_tree(p["q"], tmp_path / "q")
    breaker(q)
    # The adapter was trained on the intact base: lineage would refuse first, so drop its record.
    a = copy_tree(p["a1"], tmp_path / "a")
    (a / "trainer_state.json").unlink()
    r = invoke(merge_args(q, a, tmp_path / "out"))
    # merge checks the adapter against the base's headers first: a resized q_proj is named as a module
    assert_one_line_error(r, code, *(["q_proj", "[64, 32]"] if case == "wrong-shape" else needles))
    nothing_written(tmp_path)


def test_merge_names_the_base_when_a_merged_weight_is_nan_because_of_it(p, tmp_path):
    # a NaN block scale of a LoRA-targeted base weight was reported as "check --adapter" (audit)
    from safetensors.torch import load_file, save_file

    q = copy_tree(p["q"], tmp_path / "q")
    t = load_file(str(q / "model.safetensors"))
    key = PACKED.replace("weight_packed", "weight_scale")
    t[key] = t[key].clone()
    t[key].view(torch.uint8)[0, 0] = 0x7F  # e4m3fn's NaN
    save_file(t, str(q / "model.safetensors"), metadata={"format": "pt"})
    a = copy_tree(p["a1"], tmp_path / "a")
    (a / "trainer_state.json").unlink()
    r = invoke(merge_args(q, a, tmp_path / "out"))
    msg = assert_one_line_error(r, 5, "q_proj", "in --model")
    assert "--adapter" not in msg, msg
    nothing_written(tmp_path)


# ---- prompt / dataset files ------------------------------------------------------------------------
BAD_LINES = [ANSWERED_ROWS[0], "{not json", {"text": "no prompt field", "answer": "1"}, ANSWERED_ROWS[1]]


def test_rollout_prompt_file_errors_name_file_and_line(p, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", BAD_LINES)
    r = invoke(rollout_args(p["q"], prompts, tmp_path / "out"))
    assert_one_line_error(r, 2, "prompts.jsonl:2", "not valid JSON", "--skip-bad-lines")
    nothing_written(tmp_path)

    prompts = write_jsonl(tmp_path / "p2.jsonl", [BAD_LINES[0], BAD_LINES[2]])
    r = invoke(rollout_args(p["q"], prompts, tmp_path / "out"))
    assert_one_line_error(r, 2, "p2.jsonl:2", "neither `prompt` nor `messages`")
    nothing_written(tmp_path)


def test_rollout_skip_bad_lines_counts_and_continues(p, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", BAD_LINES)
    r = invoke(rollout_args(p["q"], prompts, tmp_path / "out", "--skip-bad-lines"))
    assert r.exit_code == 0, r.stderr
    s = read_manifest(tmp_path / "out")["summary"]
    assert s["skipped_bad_rows"] == 2 and s["groups"] == 2
    assert any("prompts.jsonl:2" in b for b in s["bad_rows"]) and any("prompts.jsonl:3" in b for b in s["bad_rows"])


@pytest.mark.parametrize("content", ["", "\n\n"], ids=["empty", "blank-lines"])
def test_rollout_and_eval_empty_prompt_file(p, tmp_path, content):
    f = tmp_path / "prompts.jsonl"
    f.write_text(content)
    assert_one_line_error(invoke(rollout_args(p["q"], f, tmp_path / "out")), 2, "prompts.jsonl", "no rows")
    assert_one_line_error(invoke(eval_args(p["q"], f, tmp_path / "out")), 2, "prompts.jsonl", "no rows")
    nothing_written(tmp_path)


def test_eval_dataset_errors_name_file_and_line(p, tmp_path):
    ds = write_jsonl(tmp_path / "ds.jsonl", BAD_LINES)
    msg = assert_one_line_error(invoke(eval_args(p["q"], ds, tmp_path / "out")), 2, "ds.jsonl:2", "not valid JSON")
    assert "--skip-bad-lines" not in msg  # eval has no such flag: the hint must not offer it
    ds = write_jsonl(tmp_path / "ds2.jsonl", [ANSWERED_ROWS[0], {"prompt": "no answer here"}])
    assert_one_line_error(invoke(eval_args(p["q"], ds, tmp_path / "out")), 2, "ds2.jsonl:2", "answer")
    nothing_written(tmp_path)


# ---- rollout shards ---------------------------------------------------------------------------------
def _shard_lines(p):
    f = next(p["sh0"].glob("shard-*.jsonl"))
    return f.name, f.read_text().splitlines()


def _write_shard(tmp_path, name, lines):
    d = tmp_path / "sh"
    d.mkdir()
    (d / name).write_text("".join(ln + "\n" for ln in lines))
    return d


def test_train_step_shard_line_not_json_names_file_line(p, tmp_path):
    name, lines = _shard_lines(p)
    lines[4] = lines[4][: len(lines[4]) // 2]
    sh = _write_shard(tmp_path, name, lines)
    assert_one_line_error(invoke(train_args(p["q"], sh, tmp_path / "out")), 2, f"{name}:5", "not valid JSON",
                          "--skip-bad-lines")
    nothing_written(tmp_path)


def test_train_step_shard_record_missing_field(p, tmp_path):
    name, lines = _shard_lines(p)
    rec = json.loads(lines[2])
    del rec["logprobs"]
    lines[2] = json.dumps(rec)
    sh = _write_shard(tmp_path, name, lines)
    assert_one_line_error(invoke(train_args(p["q"], sh, tmp_path / "out")), 2, f"{name}:3", "logprobs")
    nothing_written(tmp_path)


def test_train_step_skip_bad_lines_counts_and_continues(p, tmp_path):
    name, lines = _shard_lines(p)
    lines.insert(3, "garbage line")
    sh = _write_shard(tmp_path, name, lines)
    r = invoke(train_args(p["q"], sh, tmp_path / "out", "--skip-bad-lines"))
    assert r.exit_code == 0, r.stderr
    m = read_manifest(tmp_path / "out")
    assert m["metrics"]["completions"] == len(lines) - 1


def test_train_step_skip_bad_lines_reports_the_count(p, tmp_path):
    name, lines = _shard_lines(p)
    lines.insert(3, "garbage line")
    lines.insert(7, '{"schema_version": 1}')
    sh = _write_shard(tmp_path, name, lines)
    args = train_args(p["q"], sh, tmp_path / "out", "--skip-bad-lines")  # with -q: it hid the warning and
    r = invoke(args)  # the result line too, where every other stage's -q drops only the progress (docs audit)
    assert r.exit_code == 0, r.stderr
    assert "warning: skipped 2 bad shard line(s)" in r.stderr and f"{name}:4" in r.stderr
    assert r.stdout.startswith("step 0 -> ") and "loss " in r.stdout, r.stdout
    assert read_manifest(tmp_path / "out")["metrics"]["skipped_bad_lines"] == 2
    again = invoke(args)
    assert again.exit_code == 0 and again.stdout.startswith("already done: "), again.stdout
    # (review) RANK set without a process group (WORLD_SIZE unset: k8s, Ray) is a single process: it prints too
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, {"RANK": "1"}):
        os.environ.pop("WORLD_SIZE", None)
        alone = invoke(args)
    assert alone.exit_code == 0 and alone.stdout.startswith("already done: "), alone.stdout


def test_train_step_warnings_reach_a_library_caller(p, tmp_path, capsys):
    from qerl_cli.errors import QerlWarning
    from qerl_cli.train_step import TrainStepConfig, train_step

    name, lines = _shard_lines(p)
    lines.insert(3, "garbage line")
    sh = _write_shard(tmp_path, name, lines)
    with pytest.warns(QerlWarning, match="skipped 1 bad shard line"):
        train_step(TrainStepConfig(model=p["q"], shards=[sh], out=tmp_path / "out", device="cpu",
                                   skip_bad_lines=True, progress=False))
    assert capsys.readouterr().out == ""  # progress=False: the library prints nothing


@pytest.mark.parametrize("how", ["empty-file", "empty-dir"])
def test_train_step_empty_shards(p, tmp_path, how):
    d = tmp_path / "sh"
    d.mkdir()
    if how == "empty-file":
        (d / "shard-00000-of-00001.jsonl").write_text("")
        needle = "no rollout records"
    else:
        needle = "no shard files"
    assert_one_line_error(invoke(train_args(p["q"], d, tmp_path / "out")), 2, needle)
    nothing_written(tmp_path)


@pytest.mark.parametrize("field,value", [("reward", "NaN"), ("reward", "Infinity"), ("logprobs", "Infinity")])
def test_train_step_nonfinite_shard_values(p, tmp_path, field, value):
    """Python's json reads bare NaN/Infinity: a shard holding them must not train silently."""
    name, lines = _shard_lines(p)
    rec = json.loads(lines[0])
    if field == "logprobs":
        rec["logprobs"] = [0.0] * len(rec["logprobs"])
        line = json.dumps(rec).replace('"logprobs": [0.0', f'"logprobs": [{value}', 1)
    else:
        line = json.dumps(rec).replace(f'"reward": {json.dumps(rec["reward"])}', f'"reward": {value}', 1)
    assert value in line
    lines[0] = line
    sh = _write_shard(tmp_path, name, lines)
    r = invoke(train_args(p["q"], sh, tmp_path / "out"))
    msg = assert_one_line_error(r, r.exit_code if r.exit_code in (2, 5) else -1)
    assert f"{name}:1" in msg or "non-finite" in msg or "NaN" in msg, msg
    nothing_written(tmp_path)


def test_train_step_nan_loss(p, tmp_path, monkeypatch):
    import qerl_cli.train_step as ts

    real = ts.policy_loss

    def nan_loss(*a, **k):
        loss, x, st = real(*a, **k)
        return loss * float("nan"), x, st

    monkeypatch.setattr(ts, "policy_loss", nan_loss)
    r = invoke(train_args(p["q"], p["sh0"], tmp_path / "out"))
    assert_one_line_error(r, 5, "non-finite loss", "--lr")
    nothing_written(tmp_path)


# ---- adapters ---------------------------------------------------------------------------------------
def _adapter_cases():
    def trunc(a):
        truncate(a / "adapter_model.safetensors")

    def header(a):
        corrupt_header(a / "adapter_model.safetensors")

    def rewrite(fn):
        def go(a):
            t = load_file(str(a / "adapter_model.safetensors"))
            save_file(fn(t), str(a / "adapter_model.safetensors"), metadata={"format": "pt"})
        return go

    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

    def nan(t):
        t[key] = t[key].clone()
        t[key][0, 0] = float("nan")
        return t

    return [
        ("truncated", trunc, 2, ["adapter_model.safetensors"]),
        ("corrupt-header", header, 2, ["adapter_model.safetensors"]),
        ("wrong-shape", rewrite(lambda t: {**t, key: t[key][:, :32].contiguous()}), 2, ["q_proj"]),
        ("nan", rewrite(nan), None, ["q_proj"]),
        ("empty", rewrite(lambda t: {}), 2, ["adapter"]),
    ]


AD_CASES = _adapter_cases()


@pytest.mark.parametrize("case,breaker,code,needles", AD_CASES, ids=_ids(AD_CASES))
@pytest.mark.parametrize("stage", ["merge", "train-step", "rollout", "eval"])
def test_bad_adapter(p, tmp_path, stage, case, breaker, code, needles):
    a = copy_tree(p["a1"], tmp_path / "a")
    breaker(a)
    out = tmp_path / "out"
    if stage == "merge":
        args = merge_args(p["q"], a, out)
    elif stage == "train-step":
        from qerl_cli.adapters import adapter_hash
        from tests.train_fixtures import make_shard

        try:
            ahash = adapter_hash(a)
        except Exception:  # noqa: BLE001
            ahash = None
        sh = make_shard(tmp_path / "sh", p["qhash"], adapter_hash=ahash, step=1)
        args = train_args(p["q"], sh, out)
    elif stage == "rollout":
        args = rollout_args(p["q"], p["prompts"], out) + ["--adapter", a]
    else:
        args = eval_args(p["q"], p["prompts"], out) + ["--adapter", a]
    if stage == "train-step":
        args += ["--adapter", a]
    r = invoke(args)
    # NaN in an adapter: refused on load (2) or as a NaN merged weight (5), never used.
    assert_one_line_error(r, code if code is not None else (r.exit_code if r.exit_code in (2, 5) else -1), *needles)
    nothing_written(tmp_path)


# ---- out of memory -----------------------------------------------------------------------------------
def _oom(*a, **k):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")


def _cpu_oom(*a, **k):  # what torch.empty(10**13) on the CPU raises: a plain RuntimeError, not OutOfMemoryError
    raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 10000000000000 bytes. Error code 12 (Cannot allocate memory)")


@pytest.mark.parametrize("stage,target,flag", [
    ("quantize", "qerl_cli.quantize._process_unit", "--device cpu"),
    ("rollout-cpu", "qerl_cli.rollout._native_generator", "--max-num-seqs"),
    ("rollout", "qerl_cli.rollout._native_generator", "--max-num-seqs"),
    ("rollout-generate", "qerl_cli.engine.LLMEngine.generate", "--max-num-seqs"),
    ("train-step", "qerl_cli.train_step.microbatch_logprobs", "--micro-batch-tokens"),
    ("train-step-load", "qerl_cli.train_step._load", None),
    ("merge", "qerl_cli.merge.merged_tensors", "memory"),
    ("eval", "qerl_cli.evaluate.native_generator", "--max-num-seqs"),
])
def test_out_of_memory_names_the_flag_to_lower(p, tmp_path, monkeypatch, stage, target, flag):
    mod, _, attr = target.rpartition(".")
    if mod.endswith("LLMEngine"):
        import qerl_cli.engine as eng

        monkeypatch.setattr(eng.LLMEngine, "generate", _oom)
    else:
        import importlib

        monkeypatch.setattr(importlib.import_module(mod), attr, _cpu_oom if stage.endswith("-cpu") else _oom)
    out = tmp_path / "out"
    args = {
        "quantize": quantize_args(p["src"], out),
        "rollout": rollout_args(p["q"], p["prompts"], out),
        "train-step": train_args(p["q"], p["sh0"], out),
        "merge": merge_args(p["q"], p["a1"], out),
        "eval": eval_args(p["q"], p["prompts"], out),
    }[stage.split("-")[0] if stage != "train-step-load" and stage != "train-step" else "train-step"]
    r = invoke(args)
    msg = assert_one_line_error(r, 6, "out of")
    if flag:
        assert flag in msg, msg
    nothing_written(tmp_path)
    shutil.rmtree(tmp_path / "never", ignore_errors=True)


def test_out_of_memory_inside_a_decode_step_names_rollouts_flags_and_keeps_its_groups(p, tmp_path, monkeypatch):
    # A real GPU OOM surfaces in a decode step, inside LLMEngine.generate: it named max_num_batched_tokens (no
    # stage takes it), not --batch-prompts, and the generic path said "nothing was written" while the groups
    # finished before it stayed in the partial directory and a rerun resumed them.
    from qerl_cli.engine.model_runner import ModelRunner

    real, calls = ModelRunner.step, []

    def step(self):
        calls.append(1)
        if len(calls) > 3:
            _oom()
        return real(self)

    monkeypatch.setattr(ModelRunner, "step", step)
    r = invoke(rollout_args(p["q"], p["prompts"], tmp_path / "out", "--batch-prompts", 1))
    msg = assert_one_line_error(r, 6, "out of memory in rollout", "--max-num-seqs", "--batch-prompts", "kept")
    assert "max_num_batched_tokens" not in msg and "nothing was written" not in msg
    partial = [d for d in tmp_path.iterdir() if d.name.startswith(".out.partial-")]
    assert partial and any(f.read_text().strip() for f in partial[0].glob("*.jsonl"))  # a finished group kept
    monkeypatch.setattr(ModelRunner, "step", real)
    r = invoke(rollout_args(p["q"], p["prompts"], tmp_path / "out", "--batch-prompts", 1))
    assert r.exit_code == 0 and "wrote 8 completions for 4 prompts" in r.stdout, (r.stdout, r.stderr)


def test_one_string_for_a_many_strings_field_is_that_string_not_its_characters():
    # From Python, stop="####" became ('#', '#', '#', '#'): a stop at every '#', silently.
    from qerl_cli.evaluate import EvalConfig
    from qerl_cli.rollout import RolloutConfig
    from qerl_cli.train_step import TrainStepConfig

    assert EvalConfig(model="m", dataset="d", out="o", stop="####").stop == ("####",)
    r = RolloutConfig(model="m", prompts="p", out="o", stop="\nQ:", rewards="gsm8k")
    assert (r.stop, r.rewards) == (("\nQ:",), ("gsm8k",))
    t = TrainStepConfig(model="m", shards=Path("s"), out="o", lora_targets="q_proj")
    assert (t.shards, t.lora_targets) == ([Path("s")], ("q_proj",))
    assert RolloutConfig(model="m", prompts="p", out="o", stop=["a", "b"]).stop == ["a", "b"]


@pytest.mark.parametrize("stage", ["rollout", "eval"])
def test_a_flag_bad_in_itself_is_exit_2_over_an_existing_output_too(p, tmp_path, stage):
    # Over an output made with other flags, `--system-prompt` on a tokenizer without a chat template was
    # exit 4 ("made from different inputs (system_prompt: null -> 'hi')"), into a fresh --out exit 2 (docs audit)
    from qerl_cli.assets import ASSETS_DIR

    model = ASSETS_DIR / "tiny_model"  # its tokenizer has no chat template
    args = rollout_args if stage == "rollout" else eval_args
    first = invoke(args(model, p["prompts"], tmp_path / "out"))
    assert first.exit_code == 0, first.stderr
    fresh = invoke(args(model, p["prompts"], tmp_path / "fresh", "--system-prompt", "hi"))
    assert_one_line_error(fresh, 2, "--system-prompt needs a chat template")
    bad = invoke(args(model, p["prompts"], tmp_path / "out", "--system-prompt", "hi"))
    assert_one_line_error(bad, 2, "--system-prompt needs a chat template")
    other = invoke(args(model, p["prompts"], tmp_path / "out", "--max-new-tokens", 4))  # merely different: 4
    assert_one_line_error(other, 4, "made from different inputs")


def test_a_rollout_whose_prompts_leave_less_than_max_new_tokens_says_so(p, tmp_path):
    # the summary called such completions "hit --max-new-tokens" while they stopped at the context (docs audit)
    args = rollout_args(p["q"], p["prompts"], tmp_path / "out", "--max-model-len", 40, "--max-new-tokens", 48)
    args.remove("-q")
    r = invoke(args)
    assert r.exit_code == 0, r.stderr
    from qerl_cli.shards import read_records

    n = len(read_records(tmp_path / "out")) // 2
    assert f"note: {n} of {n} prompts leave fewer than --max-new-tokens 48 tokens of the 40-token context" in r.stderr
    assert "hit --max-new-tokens" not in r.stdout


def test_every_stage_draws_its_progress_on_stderr(p, tmp_path, monkeypatch):
    # rollout's, merge's and eval's bars went to stdout, where the result lines go: with stdout in a file the
    # bar vanished, and a terminal got it among the results (a library trial, session 44)
    import sys

    import rich.progress

    seen = []
    init = rich.progress.Progress.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        seen.append(self.console.file is sys.stderr)

    monkeypatch.setattr(rich.progress.Progress, "__init__", spy)
    runs = [rollout_args(p["q"], p["prompts"], tmp_path / "r"), eval_args(p["q"], p["prompts"], tmp_path / "e"),
            merge_args(p["q"], p["a1"], tmp_path / "m"), quantize_args(p["src"], tmp_path / "q")]
    for args in runs:
        args = [a for a in args if a not in ("-q", "--no-progress")]
        r = invoke(args)
        assert r.exit_code == 0, (args[0], r.stderr)
    assert len(seen) >= 4 and all(seen), seen


# ---- model dirs and adapters given where they do not fit (s54) ------------------------------------------------------
def _no_tokenizer_json(d):
    (d / "tokenizer.json").unlink()


def _no_tokenizer_files(d):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).unlink()


def _bad_tokenizer_config(d):
    (d / "tokenizer_config.json").write_text("{bad")


@pytest.mark.parametrize("stage", ["rollout", "eval"])
@pytest.mark.parametrize("breaker, needles", [
    # transformers 5 built an empty tokenizer from config.json's model_type: with tokenizer_config.json left the
    # rollout ran on the chat template's special tokens alone (exit 0); without it, "prompt encodes to zero tokens"
    (_no_tokenizer_json, ["its tokenizer has no vocabulary", "tokenizer.json"]),
    (_no_tokenizer_files, ["its tokenizer has no vocabulary"]),
    (_bad_tokenizer_config, ["tokenizer_config.json: not valid JSON"]),  # was transformers' bare JSONDecodeError
], ids=["no-tokenizer-json", "no-tokenizer-files", "bad-tokenizer-config"])
def test_a_model_dir_without_a_usable_tokenizer_is_named(p, tmp_path, stage, breaker, needles):
    m = copy_tree(p["q"], tmp_path / "m")
    (m / "manifest.json").unlink(missing_ok=True)
    breaker(m)
    out = tmp_path / "out"
    args = rollout_args(m, p["prompts"], out) if stage == "rollout" else eval_args(m, p["prompts"], out)
    assert_one_line_error(invoke(args), 2, *needles)
    nothing_written(tmp_path)


def test_an_adapter_dir_given_as_the_model_is_named_so(p, tmp_path):
    # eval loaded its tokenizer first: "cannot load its tokenizer (ValueError: Couldn't instantiate the backend ...)"
    r = invoke(eval_args(p["a1"], p["prompts"], tmp_path / "out"))
    assert_one_line_error(r, 2, f"--model {p['a1']} is a PEFT adapter directory", "pass it as --adapter")
    nothing_written(tmp_path)
    # without --max-new-tokens eval reads config.json first, as the other stages do: that said only "not found"
    for args in ([a for a in eval_args(p["a1"], p["prompts"], tmp_path / "out") if a not in ("--max-new-tokens", 3)],
                 rollout_args(p["a1"], p["prompts"], tmp_path / "out"), train_args(p["a1"], p["sh0"], tmp_path / "out"),
                 quantize_args(p["a1"], tmp_path / "out"), merge_args(p["a1"], p["a1"], tmp_path / "out")):
        # quantize and merge read the model as a source (open_source): that said only "no config.json"
        assert_one_line_error(invoke(args), 2, "adapter_config.json", "pass it as --adapter")
        nothing_written(tmp_path)


@pytest.mark.parametrize("stage", ["rollout", "merge", "train-step"])
def test_a_model_dir_given_as_the_adapter_is_named_so(p, tmp_path, stage):
    out = tmp_path / "out"
    args = {"rollout": rollout_args(p["q"], p["prompts"], out) + ["--adapter", p["q_other"]],
            "merge": merge_args(p["q"], p["q_other"], out),
            "train-step": train_args(p["q"], p["sh0"], out, "--adapter", p["q_other"])}[stage]
    assert_one_line_error(invoke(args), 2, "adapter_config.json", "it is a model, not a LoRA adapter")
    nothing_written(tmp_path)


@pytest.mark.parametrize("content, needle", [
    ('{"eos_token_id": "abc"}', "eos_token_id must be a token id or a list of them, got 'abc'"),  # was int()'s traceback
    ("[1, 2]", "not a JSON object"),  # was AttributeError: 'list' object has no attribute 'get'
    ("{bad", "not valid JSON"),  # was skipped without a word: generation ran past the model's end-of-turn token
], ids=["string-eos", "array", "not-json"])
def test_a_bad_generation_config_is_named_not_a_traceback(p, tmp_path, content, needle):
    m = copy_tree(p["q"], tmp_path / "m")
    (m / "manifest.json").unlink(missing_ok=True)
    (m / "generation_config.json").write_text(content)
    assert_one_line_error(invoke(rollout_args(m, p["prompts"], tmp_path / "out")), 2, "generation_config.json", needle)
    nothing_written(tmp_path)


def test_lora_targets_matching_nothing_name_where_they_came_from(p, tmp_path):
    # was "LoRA targets ['foo_proj'] match no Linear in the model", naming neither the flag nor the adapter's file
    r = invoke(train_args(p["q"], p["sh0"], tmp_path / "out", "--lora-targets", "foo_proj"))
    assert_one_line_error(r, 2, "--lora-targets: LoRA targets ['foo_proj'] match no Linear", "q_proj, up_proj, v_proj")
    a = copy_tree(p["a1"], tmp_path / "a")
    cfg = json.loads((a / "adapter_config.json").read_text())
    # (every target it has pairs of kept: a pair target_modules does not name is refused first, as PEFT drops it)
    (a / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": [*cfg["target_modules"], "foo_proj"]}))
    r = invoke(rollout_args(p["q"], p["prompts"], tmp_path / "out") + ["--adapter", a])
    assert_one_line_error(r, 2, f"{a / 'adapter_config.json'} target_modules: LoRA targets ['foo_proj']")
    nothing_written(tmp_path)


def test_a_token_outside_the_vocabulary_is_named_by_the_file_and_line_that_hold_it(p, tmp_path):
    # was "<first file>: record 13 (...)": the index counted over every file, and the first file was named whatever
    # file held the record
    from qerl_cli.shards import shard_name

    lines = (p["sh0"] / shard_name(0, 1)).read_text().splitlines()
    sh = tmp_path / "sh"
    sh.mkdir()
    (sh / shard_name(0, 2)).write_text("\n".join(lines[:4]) + "\n")  # groups whole: 4 completions a group
    rec = json.loads(lines[5])
    rec["completion_token_ids"][0] = 999  # the model's vocabulary is 384
    (sh / shard_name(1, 2)).write_text("\n".join([lines[4], json.dumps(rec), *lines[6:]]) + "\n")
    r = invoke(train_args(p["q"], sh, tmp_path / "out"))
    assert_one_line_error(r, 2, f"{sh / shard_name(1, 2)}:2: record of group", "has token id 999")
    nothing_written(tmp_path)
