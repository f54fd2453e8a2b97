"""Tests that kill mutants which survived the rest of the suite (manual mutation testing, round 5: `qerl eval`'s
flag checks, per-problem seeds, the context check, an engine's short answer, the adapter checks and the
fingerprint; the CLI wrapper's out-of-memory, QERL_DEBUG, warning, signal and interrupt handling, and the
allocator variable; 2026-11-26).

Each pins a behaviour a user would notice if it changed. The engine is the scripted generator of
tests/test_eval.py."""

import os
import re
import signal
import warnings

import pytest
import typer

from qerl_cli.cli import guarded, use_expandable_segments
from qerl_cli.errors import BadInputError, OutputExistsError, QerlError, QerlWarning
from qerl_cli.evaluate import EvalConfig, Sample, evaluate
from tests.helpers import make_tiny_hf_model
from tests.test_eval import GSM8K_ROWS, Scripted, run, write_jsonl

ANSWERS = [["#### 7"], ["#### 10"], ["#### 3"], ["#### -5"]]  # GSM8K_ROWS, all right


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("evalm"), arch="qwen2", hidden=32, layers=1)


# ---- eval: flag checks ---------------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    (dict(k=0), "--k must be at least 1, got 0"),
    (dict(num_samples=0), "--num-samples 0 is less than --k 1"),
    (dict(top_p=0.0), "--top-p must be in (0, 1], got 0.0"),
    (dict(max_new_tokens=0), "--max-new-tokens must be at least 1, got 0"),
    (dict(max_problems=0), "--max-problems must be at least 1, got 0"),
    (dict(chat_template_file="t.jinja", chat_template=False), "--chat-template-file with --no-chat-template"),
])
def test_eval_flag_at_its_bound_is_refused_naming_the_flag(tmp_path, kw, message):
    with pytest.raises(BadInputError, match=re.escape(message)):
        EvalConfig(model=tmp_path / "m", dataset=tmp_path / "d.jsonl", out=tmp_path / "o", **kw)


def test_several_samples_for_pass_at_1_are_sampled_not_greedy(tmp_path):
    # --num-samples 4 with the default --k 1: pass@1 averaged over 4 samples, drawn at temperature 1.0
    cfg = EvalConfig(model=tmp_path / "m", dataset=tmp_path / "d.jsonl", out=tmp_path / "o", num_samples=4)
    assert (cfg.samples, cfg.sampling_temperature) == (4, 1.0)


# ---- eval: per-problem seeds ---------------------------------------------------------------------
def _seeds(gen: Scripted) -> list[int]:
    return [s for *_, chunk in gen.calls for s in chunk]


def test_another_seed_draws_every_problem_from_new_seeds(model_dir, tmp_path):
    kw = dict(k=2, temperature=0.8)
    answers = [["#### 7", "#### 8"]] * 4
    seeds = [_seeds(run(model_dir, tmp_path, GSM8K_ROWS, answers, name=f"s{seed}", seed=seed, **kw)[1])
             for seed in (0, 1)]
    assert not set(seeds[0]) & set(seeds[1]), seeds  # --seed 1 repeats none of --seed 0's samples


def test_a_problems_seed_does_not_depend_on_the_chunk_it_is_generated_in(model_dir, tmp_path):
    rows = [{"question": f"{i} + 1?", "answer": str(i + 1)} for i in range(6)]
    answers = [[f"#### {i + 1}"] for i in range(6)]
    small = run(model_dir, tmp_path, rows, answers, name="small", max_num_seqs=1)[1]  # chunks of 4 prompts
    big = run(model_dir, tmp_path, rows, answers, name="big", max_num_seqs=8)[1]  # one chunk
    assert len(small.calls) == 2 and len(big.calls) == 1
    assert _seeds(small) == _seeds(big) and len(set(_seeds(small))) == 6


# ---- eval: the context check ---------------------------------------------------------------------
def test_max_new_tokens_equal_to_the_context_leaves_no_room(model_dir, tmp_path):
    with pytest.raises(BadInputError, match="--max-new-tokens 100 leaves no room for the prompt in a 100-token"):
        run(model_dir, tmp_path, GSM8K_ROWS, [], max_model_len=100, max_new_tokens=100)


def test_a_prompt_one_token_longer_than_the_room_is_refused(model_dir, tmp_path):
    rows = GSM8K_ROWS[:1]
    with pytest.raises(BadInputError, match=r"prompt has \d+ tokens, more than the 1 that fit") as e:
        run(model_dir, tmp_path, rows, [], max_model_len=100, max_new_tokens=99)
    length = int(re.search(r"prompt has (\d+) tokens", str(e.value)).group(1))
    with pytest.raises(BadInputError, match=f"prompt has {length} tokens, more than the {length - 1} that fit"):
        run(model_dir, tmp_path, rows, [], max_model_len=100, max_new_tokens=100 - (length - 1))
    res, _ = run(model_dir, tmp_path, rows, ANSWERS[:1], max_model_len=100, max_new_tokens=100 - length)
    assert res["metrics"]["score"] == 1.0  # a prompt exactly as long as the room fits


def test_a_prompt_longer_than_the_whole_context_is_not_told_to_lower_max_new_tokens_alone(model_dir, tmp_path):
    # A prompt longer than the context itself got "lower --max-new-tokens", which cannot make it fit (a
    # 37-token prompt on a 32-token sliding window, --max-new-tokens 1; review_arch).
    rows = GSM8K_ROWS[:1]
    with pytest.raises(BadInputError, match=r"prompt has \d+ tokens") as e:
        run(model_dir, tmp_path, rows, [], max_model_len=8, max_new_tokens=1)
    assert "shorten the prompt" in e.value.hint and e.value.hint.startswith("shorten the prompt") and "prompts of up to 7 tokens fit" in e.value.hint


# ---- eval: what the engine returns ---------------------------------------------------------------
def test_an_engine_returning_too_few_samples_for_a_problem_is_an_error(model_dir, tmp_path):
    def short(prompt_ids, n, seeds, progress=None):
        return [[Sample([1], "#### 7", "stop")] * (n if i else n - 1) for i, _ in enumerate(prompt_ids)]

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "answer": "7"} for i in range(2)])
    cfg = EvalConfig(model=model_dir, dataset=data, out=tmp_path / "o", device="cpu", k=2, temperature=0.8,
                     max_new_tokens=16, progress=False)
    with pytest.raises(RuntimeError, match=r"engine returned \[1, 2\] samples for 2 prompts x 2"):
        evaluate(cfg, generate=short)
    assert not (tmp_path / "o").exists()


# ---- eval: the adapter ---------------------------------------------------------------------------
def test_an_adapter_that_is_a_file_is_refused(model_dir, tmp_path):
    adapter = tmp_path / "adapter_model.safetensors"
    adapter.write_bytes(b"")
    with pytest.raises(BadInputError, match=r"--adapter .*adapter_model.safetensors: not a directory"):
        run(model_dir, tmp_path, GSM8K_ROWS, ANSWERS, adapter=adapter)


def test_an_adapter_that_attaches_no_lora_module_is_refused_not_scored_as_the_base(model_dir, tmp_path, monkeypatch):
    import qerl_cli.models as models

    real = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, adapter_dir=None, **kw: real(*a, **kw))  # adapter dropped
    (tmp_path / "ad").mkdir()
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "answer": "7"}])
    cfg = EvalConfig(model=model_dir, dataset=data, out=tmp_path / "o", adapter=tmp_path / "ad", device="cpu",
                     max_new_tokens=2, progress=False)
    with pytest.raises(BadInputError, match=r"--adapter .*ad: no LoRA module was attached"):
        evaluate(cfg)
    assert not (tmp_path / "o").exists()


# ---- eval: the fingerprint -----------------------------------------------------------------------
def test_the_fingerprint_counts_the_dtype_generated_with_not_the_flags_spelling(model_dir, tmp_path):
    assert not run(model_dir, tmp_path, GSM8K_ROWS, ANSWERS, dtype="auto")[0]["already_done"]  # fp32 on the CPU
    for same in ("fp32", "float32"):
        assert run(model_dir, tmp_path, GSM8K_ROWS, [], dtype=same)[0]["already_done"], same
    with pytest.raises(OutputExistsError, match='dtype: "fp32" -> "bf16"'):
        run(model_dir, tmp_path, GSM8K_ROWS, ANSWERS, dtype="bf16")


# ---- cli: the stage wrapper ----------------------------------------------------------------------
def _raising(exc):
    def stage():
        raise exc
    return stage


def _exit_code(fn, stage: str) -> int:
    with pytest.raises(typer.Exit) as e:
        guarded(fn, stage)()
    return e.value.exit_code


def test_a_cpu_allocation_failure_is_out_of_memory_naming_the_flag_to_lower(capsys):
    oom = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 10000000000000 bytes")
    assert _exit_code(_raising(oom), "eval") == 6
    err = capsys.readouterr().err
    assert err.startswith("error: out of memory in eval: DefaultCPUAllocator") and "lower --max-num-seqs" in err, err
    assert "--out was not written; problems finished before it are kept for a rerun" in err, err  # eval resumes


def test_a_stage_error_is_recorded_where_the_script_that_runs_it_asks(tmp_path, monkeypatch):
    # QERL_ERROR_FILE (the recipes set it for each stage): why the stage failed, for grpo.sh's and a Slurm job's notes,
    # which told an eval's GPU-model refusal from any other exit 4 by nothing, and torchrun's exit 1 from a refusal
    from qerl_cli.errors import OtherGpuModelError

    record = tmp_path / "record"
    assert _exit_code(_raising(BadInputError("bad flag")), "eval") == 2 and not record.exists()  # not asked: nothing
    monkeypatch.setenv("QERL_ERROR_FILE", str(record))
    assert _exit_code(_raising(OtherGpuModelError("e holds this eval stopped on 'H100'", hint="rerun")), "eval") == 4
    assert _exit_code(_raising(BadInputError("bad\nflag")), "eval") == 2  # appended, one line each
    assert record.read_text() == "4 OtherGpuModelError e holds this eval stopped on 'H100' (rerun)\n2 BadInputError bad flag\n"
    monkeypatch.setenv("QERL_ERROR_FILE", str(tmp_path / "no-such-dir" / "record"))  # unwritable: the error as before
    assert _exit_code(_raising(BadInputError("bad flag")), "eval") == 2


def test_qerl_debug_keeps_the_traceback_of_a_stage_error(monkeypatch):
    monkeypatch.setenv("QERL_DEBUG", "1")
    with pytest.raises(BadInputError, match="bad flag"):
        guarded(_raising(BadInputError("bad flag")), "eval")()


def test_a_repeated_warning_is_printed_every_time(capsys):
    def stage():
        for _ in range(2):
            warnings.warn("dataset row 3 is long", QerlWarning, stacklevel=1)

    guarded(stage, "eval")()
    assert capsys.readouterr().err.count("warning: dataset row 3 is long\n") == 2


def test_the_sigterm_handler_is_restored_after_a_stage():
    def mine(signum, frame):
        pass

    old = signal.signal(signal.SIGTERM, mine)  # a library caller's own handler
    try:
        guarded(lambda: None, "eval")()
        assert signal.getsignal(signal.SIGTERM) is mine
        with pytest.raises(typer.Exit):
            guarded(_raising(QerlError("x")), "eval")()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, old)


@pytest.mark.parametrize("stage, note", [("rollout", " (a rerun resumes its saved groups)"),
                                         ("eval", " (a rerun resumes its saved problems)"), ("merge", "")])
def test_only_an_interrupted_resumable_stage_says_a_rerun_resumes(capsys, stage, note):
    assert _exit_code(_raising(KeyboardInterrupt()), stage) == 130
    assert capsys.readouterr().err == f"interrupted: --out was not written{note}\n"


# ---- cli: the allocator variable -----------------------------------------------------------------
@pytest.mark.parametrize("torch_version, var", [("2.9.1", "PYTORCH_CUDA_ALLOC_CONF"), ("2.10.0", "PYTORCH_ALLOC_CONF")])
def test_torch_2_10_gets_expandable_segments_under_the_new_name(monkeypatch, torch_version, var):
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.setenv(name, "x")  # recorded, so that teardown restores the environment
        monkeypatch.delenv(name)
    monkeypatch.setattr("importlib.metadata.version", lambda name: torch_version)
    use_expandable_segments()
    assert {k: v for k, v in os.environ.items() if k.endswith("ALLOC_CONF")} == {var: "expandable_segments:True"}


def test_a_torchrun_rank_that_does_not_write_out_does_not_say_it_was_not_written(capsys, monkeypatch):
    # Stopped together after rank 0 put --out in place, rank 0 said "after --out was written: ... is complete" and
    # rank 1 "--out was not written" (a review, session 55): only rank 0 knows.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert _exit_code(_raising(KeyboardInterrupt()), "train-step") == 130
    assert capsys.readouterr().err == ("interrupted: torchrun rank 1 stopped (rank 0 alone writes --out: its line, "
                                       "or a rerun's \"already done\", says whether it was written)\n")
    monkeypatch.setenv("RANK", "0")
    assert _exit_code(_raising(KeyboardInterrupt()), "train-step") == 130
    assert capsys.readouterr().err == "interrupted: --out was not written\n"
