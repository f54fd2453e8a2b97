"""Tests that kill mutants which survived the rest of the suite (manual mutation testing, round 8: eval
metrics and the --compare table, rollout shards, atomic outputs, advantages, batching, the engine's
scheduler and block manager, lineage; 2026-11-27).

Each pins a behaviour a user would notice if it changed; each docstring names the mutant it kills."""

import json

import pytest
from rich.console import Console

from qerl_cli.errors import BadInputError


# ---- eval_metrics --------------------------------------------------------------------------------
def _run(path, *, counts=None, scores=None, sampling=None, manifest=None):
    path.mkdir(parents=True)
    m = {
        "model": "/m/base", "adapter": None, "dataset": "/d/gsm8k.jsonl", "dataset_hash": "abc",
        "sampling": {"temperature": 0.0, **(sampling or {})},
        "scores": scores or {"pass@1": {"value": 0.5, "ci95": [0.4, 0.6]}},
        "counts": {"problems": 10, "samples_per_problem": 1, "samples": 10, "no_answer": 2, "truncated": 1,
                   **(counts or {})},
        "lengths": {"mean": 12.0}, "time": {"total_s": 3.0},
    }
    (path / "metrics.json").write_text(json.dumps(m))
    if manifest is not None:
        (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def _table_text(dirs) -> str:
    from qerl_cli.eval_metrics import compare_table

    console = Console(record=True, width=250)
    console.print(compare_table(dirs))
    return " ".join(console.export_text().replace("\u2502", " ").split())  # cells without their borders


def test_the_score_interval_is_over_problems_not_samples():
    """Mutant: ``score_block`` computes Wilson's interval over the number of samples (sum of n) instead of
    the number of problems: with 8 samples a problem the 95% interval shrank ~3x, overstating certainty."""
    from qerl_cli.eval_metrics import score_block, wilson_interval

    counts = [(8, 4)] * 10  # 10 problems, 8 samples each, pass@1 = 0.5
    lo, hi = score_block(counts, [1])["pass@1"]["ci95"]
    want = wilson_interval(0.5, 10)
    assert (lo, hi) == (round(want[0], 6), round(want[1], 6))
    assert hi - lo > 0.5  # 10 problems: wide; over 80 samples it would be ~0.21


def test_the_normal_approximation_of_the_sign_flip_test_is_two_sided():
    """Mutant: the sign-flip test's large-table fallback returns ``erfc(z)`` instead of ``erfc(z / sqrt 2)``
    (a p-value far too small on a large eval: 0.00002 for the true 0.0027 at z = 3)."""
    import math

    from qerl_cli.eval_metrics import _sign_flip_p

    nz = [0.5] * 20 + [-0.5] * 5  # z = 7.5 / sqrt(25 * 0.25) = 3
    p = _sign_flip_p(nz, max_states=0)  # forced onto the normal approximation
    assert p == pytest.approx(2 * (1 - 0.5 * (1 + math.erf(3 / math.sqrt(2)))), rel=1e-9)
    assert p == pytest.approx(_sign_flip_p(nz), rel=0.5)  # and near the exact count


def test_per_problem_pass1_is_the_fraction_of_correct_samples(tmp_path):
    """Mutant: ``per_problem_pass1`` takes a problem as solved when any sample is (pass@n), so the paired
    "pass@1 vs first" row of --compare compared pass@n, not pass@1."""
    from qerl_cli.eval_metrics import per_problem_pass1

    (tmp_path / "samples.jsonl").write_text("".join(
        json.dumps({"id": "p0", "sample": j, "correct": j == 0}) + "\n" for j in range(4)))
    assert per_problem_pass1(tmp_path) == {"p0": 0.25}


def test_paired_difference_counts_only_the_problems_both_runs_scored():
    """Mutants: the mean difference divided by the first run's problem count, and the ids taken from the
    first run alone (a KeyError on a problem the second lacks)."""
    from qerl_cli.eval_metrics import paired_difference

    a = {"0": 0.0, "1": 0.0, "2": 1.0, "3": 1.0}
    b = {"0": 1.0, "1": 0.0}
    r = paired_difference(a, b)
    assert r["diff"] == pytest.approx(50.0) and r["discordant"] == (1, 0)


def test_a_greedy_run_against_a_sampled_one_is_not_tested_as_mcnemar():
    """Mutant: McNemar's test chosen when only the first run's scores are 0/1: a greedy run (one sample a
    problem) against one of 4 samples a problem took the signs of fractional differences as discordant pairs."""
    from qerl_cli.eval_metrics import paired_difference

    a = {str(i): float(i < 5) for i in range(10)}
    b = {str(i): 0.75 if i < 5 else 0.25 for i in range(10)}
    r = paired_difference(a, b)
    assert r["test"] == "sign-flip" and r["discordant"] is None and r["p"] == pytest.approx(1.0)


@pytest.mark.parametrize("where,key,value,flag", [
    ("sampling", "top_p", 0.9, "--top-p"),
    ("sampling", "stop", ["\n\n"], "--stop"),
    ("config", "system_prompt", "Be brief.", "--system-prompt"),
    ("config", "chat_template", False, "--no-chat-template"),
    ("inputs", "chat_template", "ab12", "--chat-template-file"),
])
def test_compare_names_each_generation_setting_that_differs(tmp_path, where, key, value, flag):
    """Mutants: one of --top-p, --stop, --system-prompt, --chat-template-file left out of the generation
    settings --compare checks, so two runs generated differently were compared without a warning."""
    base = {"stage": "eval", "fingerprint": "f", "config": {}, "inputs": {}}
    other = json.loads(json.dumps(base))
    sampling = {}
    if where == "sampling":
        sampling[key] = value
    else:
        other[where][key] = value
    a = _run(tmp_path / "a", manifest=base)
    b = _run(tmp_path / "b", manifest=other, sampling=sampling)
    assert f"generated with different {flag};" in _table_text([a, b])
    assert "generated with different" not in _table_text([a, _run(tmp_path / "c", manifest=base)])


def test_compare_shows_no_answer_and_truncated_as_shares_of_the_samples(tmp_path):
    """Mutants: the "no answer" row divided by the problems instead of the samples; the "truncated" row
    showing the no-answer count."""
    a = _run(tmp_path / "a", counts={"problems": 10, "samples_per_problem": 4, "samples": 40, "no_answer": 8,
                                     "truncated": 2})
    text = _table_text([a])
    assert "no answer 20.0%" in text and "truncated 5.0%" in text


def test_compare_lists_the_scores_by_increasing_k(tmp_path):
    """Mutant: the pass@k rows in set order (pass@8 above pass@1) instead of sorted by k."""
    s = {f"pass@{k}": {"value": 0.5, "ci95": [0.4, 0.6]} for k in (1, 2, 4, 8)}
    text = _table_text([_run(tmp_path / "a", scores=s)])
    assert text.index("pass@1 ") < text.index("pass@2 ") < text.index("pass@4 ") < text.index("pass@8 ")


def test_compare_refuses_a_metrics_json_without_scores(tmp_path):
    """Mutant: ``read_metrics`` accepts any JSON object, and --compare then fails with a KeyError
    traceback on a metrics.json that is not eval's."""
    from qerl_cli.eval_metrics import read_metrics

    (tmp_path / "metrics.json").write_text(json.dumps({"loss": 1.0}))
    with pytest.raises(BadInputError, match="has no 'scores'"):
        read_metrics(tmp_path)


# ---- shards --------------------------------------------------------------------------------------
def _record(**over):
    from tests.test_shards import rec

    return rec(**over)


@pytest.mark.parametrize("field,value,why", [
    ("noise", {"sigma": float("nan"), "seed": 1}, "noise.sigma should be a number"),
    ("noise", {"sigma": float("inf"), "seed": 1}, "noise.sigma should be a number"),
    ("sampling", {"temperature": float("nan")}, "sampling.temperature should be a number"),
])
def test_a_non_finite_noise_sigma_or_temperature_is_refused(field, value, why):
    """Mutant: ``_number`` without ``math.isfinite``: a shard (from another tool, or hand-edited; Python's json
    reads NaN and Infinity) with a NaN or infinite sigma or temperature passed validation and trained on NaN."""
    from qerl_cli.shards import validate_record

    assert why in (validate_record(_record(**{field: value})) or "")


def test_prompt_token_ids_that_are_not_integers_are_refused():
    """Mutant: the per-element check of ``prompt_token_ids`` dropped: 2.7 was collated as token 2 (torch's
    long conversion truncates) and a string failed later with a traceback."""
    from qerl_cli.shards import validate_record

    assert validate_record(_record(prompt_token_ids=[1, 2.7, 3])) == "prompt_token_ids must be integers"
    assert validate_record(_record(prompt_token_ids=[1, "2"])) == "prompt_token_ids must be integers"


def test_a_shard_glob_with_a_character_class_is_expanded(tmp_path):
    """Mutant: ``[`` no longer marks a glob: ``--shards 'run/step-[12]'`` was read as one path that does not
    exist."""
    from qerl_cli.shards import read_records, resolve_shard_files, shard_name, write_records

    for step in (1, 2, 3):
        write_records(tmp_path / f"step-{step}" / shard_name(0, 1), [_record(pid=f"s{step}", k=k) for k in range(2)])
    files = resolve_shard_files(str(tmp_path / "step-[12]"))
    assert [f.parent.name for f in files] == ["step-1", "step-2"]
    assert len(read_records(str(tmp_path / "step-[12]"))) == 4


def test_a_directory_with_shards_reads_only_its_shard_files(tmp_path):
    """Mutant: a directory's files taken as every ``*.jsonl`` even when it holds ``shard-*-of-*.jsonl``: a
    notes or prompts file a user left in a rollout directory was read as shard lines (bad lines, exit 2)."""
    from qerl_cli.shards import resolve_shard_files, shard_name, write_records

    write_records(tmp_path / shard_name(0, 1), [_record(k=k) for k in range(2)])
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "x"}\n')
    assert [f.name for f in resolve_shard_files(tmp_path)] == [shard_name(0, 1)]


def test_a_missing_first_shard_is_named():
    """Mutant: ``missing_shards`` counts from index 1: a step whose shard 0 never finished trained on the
    other shards without a word."""
    from qerl_cli.shards import missing_shards, shard_name

    assert missing_shards([shard_name(1, 3), shard_name(2, 3)]) == [shard_name(0, 3)]


def test_fewer_logprobs_than_completion_tokens_is_refused():
    """Mutant: the ragged-pair check only refuses more logprobs than tokens: a record with one logprob for
    two sampled tokens passed validation (docs: a ragged pair is a bad line naming file:line)."""
    from qerl_cli.shards import validate_record

    assert "1 logprobs for 2 completion tokens" in (validate_record(_record(logprobs=[-0.5])) or "")


# ---- outputs -------------------------------------------------------------------------------------
def test_a_refusal_names_three_differences_and_counts_the_rest():
    """Mutant: the "and N more" of an output's differences dropped: a rerun with five changed flags was told
    of three, as if those were all."""
    from qerl_cli.outputs import _differences

    old = {"stage": "rollout", "config": {k: 1 for k in "abcde"}, "inputs": {}}
    msg = _differences(old, "rollout", {k: 2 for k in "abcde"}, {})
    assert msg == "a: 1 -> 2; b: 1 -> 2; c: 1 -> 2 and 2 more"


def test_a_refusal_shortens_long_values():
    """Mutant: ``_short`` without its 40-character cut: a changed --system-prompt of a page was printed whole
    in the one-line error."""
    from qerl_cli.outputs import _differences

    old = {"stage": "eval", "config": {"system_prompt": "x" * 500}, "inputs": {}}
    msg = _differences(old, "eval", {"system_prompt": "y" * 500}, {})
    assert msg == f'system_prompt: "{"x" * 36}... -> "{"y" * 36}...'
