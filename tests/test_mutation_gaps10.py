"""Tests that kill mutants which survived the suite (manual mutation testing, round 12): recipes/lib.sh's python
finder (``qerl_find_python``), its error-file reading and argv mapping, and session 59's answer-rule readings
(math_rule.py's hedges and take-backs around the last box), and round 11's open ``_check_fits_model`` / ``_id_range``
mutants. docs/reliability.md has the counts; each docstring names the mutant it kills."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
BASH = shutil.which("bash")
pytestmark_bash = pytest.mark.skipif(BASH is None, reason="needs bash")


def _find_python(tmp_path: Path, path_names: dict[str, str], **env: str) -> tuple[int, str, str]:
    """``qerl_find_python`` run with a PATH of only ``path_names`` (name -> target) and ``env``: (its status,
    QERL_PYTHON, QERL_PYTHON_LOOKED). The finder uses builtins only, so the PATH needs nothing else."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, target in path_names.items():
        (bin_dir / name).symlink_to(target)
    script = f'source {RECIPES / "lib.sh"}; rc=0; qerl_find_python || rc=$?; printf "%s\\n" "$rc" "$QERL_PYTHON" "$QERL_PYTHON_LOOKED"'
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "QERL")}
    r = subprocess.run([BASH, "-c", script], env={**base, "PATH": str(bin_dir), **env}, capture_output=True, text=True,
                       check=True)
    rc, found, looked = r.stdout.split("\n")[:3]
    return int(rc), found, looked


# ---- recipes/lib.sh: qerl_find_python --------------------------------------------------------------------------------

@pytestmark_bash
def test_the_python_beside_the_qerl_a_wrapper_runs_is_found(tmp_path):
    """Mutant: ``case "${words[0]}"`` for ``"${words[-1]}"``: QERL="/usr/bin/time /venv/bin/qerl" (a wrapper, its
    qerl last) found no python beside that qerl on a host without python3."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "python3").symlink_to(sys.executable)
    rc, found, _ = _find_python(tmp_path, {}, QERL=f"/usr/bin/time {venv}/qerl")
    assert (rc, found) == (0, f"{venv}/python3")


@pytestmark_bash
def test_a_python_on_path_that_is_python_3_is_the_last_one_tried(tmp_path):
    """Mutant: no ``cands+=(python)``: a host whose only Python 3 is ``python`` (a conda env, Arch) found none."""
    rc, found, _ = _find_python(tmp_path, {"python": sys.executable}, QERL="qerl")
    assert (rc, found) == (0, "python")


# ---- recipes/lib.sh: the error file (qerl_run_recording, qerl_failed_with) and grpo.sh's exit-4 logic -----------------

@pytestmark_bash
def test_a_command_that_records_nothing_leaves_no_earlier_failure_in_qerl_failed(tmp_path):
    """Mutant: qerl_run_recording without its ``QERL_FAILED=""``: a command that failed without a record (a crash, a
    wrapper that passes no environment on) kept the record of the stage before it, whose notes were then chosen."""
    r = subprocess.run([BASH, "-c", f'source {RECIPES / "lib.sh"}; RUN_DIR={tmp_path}; '
                        'rec() { echo "4 OtherGpuModelError e stopped on H100" >> "$QERL_ERROR_FILE"; return 4; }; '
                        'qerl_run_recording rec || :; a=$QERL_FAILED; qerl_run_recording false || :; '
                        'printf "[%s][%s]" "$a" "$QERL_FAILED"'], capture_output=True, text=True)
    assert r.stdout == "[4 OtherGpuModelError e stopped on H100][]", r.stderr


@pytestmark_bash
@pytest.mark.parametrize("failed, code, kind, want", [
    ("1 BadInputError d.jsonl: record 4 of group 'g' has 4 tokens", "4", "", False),  # a 4 in the message
    ("8 OutputBusyError x\n4 OutputExistsError y", "4", "", True),  # another rank's line
    ("4 OutputExistsError y", "4", "OtherGpuModelError", False),
])
def test_qerl_failed_with_reads_a_lines_code_not_a_number_in_its_message(failed, code, kind, want):
    """Mutant: qerl_failed_with matching ``"CODE KIND "`` anywhere, not at a line's start: a torchrun job whose rank
    failed with a message holding "4 " (stage.sbatch's ``qerl_failed_with 4``) was taken for a refusal, redone under
    FORCE=1 with --force."""
    r = subprocess.run([BASH, "-c", f'source {RECIPES / "lib.sh"}; QERL_FAILED=$1; qerl_failed_with "$2" "$3"', "x",
                        failed, code, kind], capture_output=True, text=True)
    assert (r.returncode == 0) == want, r.stderr


def _grpo(tmp_path: Path, body: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """grpo.sh (STEPS=1) on a stand-in qerl running ``body`` after it logs each call: its result and the calls."""
    from tests.test_recipes import _qwen_cfg, _recorder

    log = tmp_path / "qerl.log"
    qerl = _recorder(tmp_path, "qerl", f'echo "$1 $([[ " $* " == *" --force "* ]] && echo forced)" >> {log}\n' + body)
    cfg = _qwen_cfg(tmp_path, "\nWARMUP_STEPS=0\nSTEPS=1\n")
    r = subprocess.run([BASH, str(RECIPES / "grpo.sh"), str(cfg), str(tmp_path / "run")],
                       env={**os.environ, "QERL": str(qerl), **env}, capture_output=True, text=True)
    return r, [x.strip() for x in log.read_text().splitlines()]


@pytestmark_bash
def test_force_does_not_redo_a_stage_another_run_is_writing(tmp_path):
    """Mutant: grpo.sh's stage() redoing any failure under FORCE=1 (``[ "$rc" != 0 ]`` for ``= 4``): an exit 8 (another
    qerl run writing that output: two loops on one run dir) was redone with --force, replacing the other loop's output."""
    r, calls = _grpo(tmp_path, 'if [ "$1" = merge ]; then echo "error: busy" >&2; exit 8; fi\n', FORCE="1")
    assert r.returncode == 8, r.stderr
    assert calls[-1] == "merge" and "merge forced" not in calls, calls


@pytestmark_bash
def test_a_failed_compare_leaves_no_error_record_in_the_run_dir(tmp_path):
    """Mutant: qerl_run_recording's ``"$@" || rc=$?`` as ``"$@"; rc=$?``: grpo.sh's last call (eval --compare, outside
    any ``||``) failing ended the script under ``set -e`` before the record was read and removed: a .qerl-error.* file
    left in RUN_DIR for good."""
    from tests.test_recipes import RECORD

    r, calls = _grpo(tmp_path, RECORD + 'if [[ " $* " == *" --compare "* ]]; then record 2 BadInputError no metrics; '
                     'exit 2; fi\n')
    assert r.returncode == 2 and calls[-1] == "eval", (r.stderr, calls)
    assert not list((tmp_path / "run").glob(".qerl-error.*"))


@pytestmark_bash
def test_a_stage_that_fails_otherwise_gets_no_exit_4_note(tmp_path):
    """Mutant: grpo.sh's stage() giving its "refused (exit 4): FORCE=1 reruns this script" note after any failure
    (``[ "$rc" != 0 ]``): a merge that failed with exit 2 (a bad input) was told to be redone with FORCE=1."""
    r, calls = _grpo(tmp_path, 'if [ "$1" = merge ]; then echo "error: bad" >&2; exit 2; fi\n')
    assert r.returncode == 2 and calls[-1] == "merge", (r.stderr, calls)
    assert r.stderr.endswith("error: bad\n"), r.stderr


# ---- round 11's open mutants: train/checks.py's _check_fits_model, train/inputs.py's _id_range ------------------------

@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    """A model directory of the bundled tiny model's config alone: all the check reads (the shards name no base hash
    the read checks), without a model's build."""
    d = tmp_path_factory.mktemp("gaps10") / "model"
    d.mkdir()
    shutil.copy(Path(__file__).resolve().parent.parent / "qerl_cli" / "assets" / "tiny_model" / "config.json", d)
    return d


def _step(tmp_path: Path, q: Path, max_positions: int | None = None, token: int | None = None):
    """(cfg, StepData) of a two-group shard for the model directory ``q`` (a copy, its config's
    max_position_embeddings set, where given), the second record's first completion id replaced by ``token`` where
    given."""
    import json

    from qerl_cli.train_step import TrainStepConfig, read_step
    from tests.train_fixtures import make_shard

    if max_positions is not None:
        q = Path(shutil.copytree(q, tmp_path / "model"))
        c = q / "config.json"
        c.write_text(json.dumps({**json.loads(c.read_text()), "max_position_embeddings": max_positions}))
    sh = make_shard(tmp_path / "sh", "0" * 64, groups=2)
    if token is not None:
        f = next(sh.glob("*.jsonl"))
        lines = f.read_text().splitlines(keepends=True)
        rec = json.loads(lines[1])
        rec["completion_token_ids"][0] = token
        f.write_text(lines[0] + json.dumps(rec) + "\n" + "".join(lines[2:]))
    cfg = TrainStepConfig(model=str(q), shards=[str(sh)], out=tmp_path / "o", progress=False)
    return cfg, read_step(cfg)


def test_a_record_of_exactly_the_models_positions_fits_and_one_more_does_not(tmp_path, tiny_config):
    """Round 11's open mutants of ``_check_fits_model``: ``>`` -> ``>=`` (a record filling the position range exactly,
    positions 0 .. limit-1, refused) and the lengths' sum taking the prompt's twice (a record whose completion is longer
    than its prompt passed past the limit: the rotary cache's error deep in the forward)."""
    from qerl_cli.errors import BadInputError
    from qerl_cli.train.checks import _check_fits_model

    cfg, data = _step(tmp_path, tiny_config)
    longest = max(p + c for p, c in zip(data.prompt_lengths, data.completion_lengths))
    assert any(p + c == longest and c > p for p, c in zip(data.prompt_lengths, data.completion_lengths))
    cfg, data = _step(tmp_path / "fits", tiny_config, max_positions=longest)
    _check_fits_model(cfg, data)
    cfg, data = _step(tmp_path / "over", tiny_config, max_positions=longest - 1)
    with pytest.raises(BadInputError, match=f"has {longest} tokens, more than the {longest - 1} positions"):
        _check_fits_model(cfg, data)


def test_a_token_id_below_int64_is_named_before_training(tmp_path, tiny_config):
    """Round 11's open mutant of ``_id_range``: its list path (ids past int64, which stay lists) taking 0 for the
    lowest id: a record holding -2**64 passed the check, the rest of its ids inside the vocabulary."""
    from qerl_cli.errors import BadInputError
    from qerl_cli.train.checks import _check_fits_model

    cfg, data = _step(tmp_path, tiny_config, token=-2**64)
    with pytest.raises(BadInputError, match=f"has token id {-2**64}, outside"):
        _check_fits_model(cfg, data)


@pytestmark_bash
def test_an_answer_key_alone_reaches_the_stages(tmp_path):
    """Mutant: _qerl_template_flags passing --answer-key where the prompt key is set (``-n "$1"``): a dataset whose
    reference alone has its own name (``final_answer``, the prompt under ``prompt``) was run without --answer-key."""
    r = subprocess.run([BASH, "-c", f'source {RECIPES / "lib.sh"}; SYSTEM_PROMPT= STOP= '
                        'PROMPT_TEMPLATE= CHAT_TEMPLATE_FILE= CHAT_TEMPLATE_KWARGS=; _qerl_template_flags "" final_answer; '
                        'printf "%s\\n" "${QERL_TEMPLATE[@]}"'], capture_output=True, text=True, check=True)
    assert r.stdout == "--answer-key\nfinal_answer\n", r.stderr


@pytestmark_bash
def test_an_fp4_merge_of_the_bf16_baseline_is_not_told_to_requantize_from_its_own_base(tmp_path):
    """Mutant: qerl_merge_cmd's ``--requantize-from`` without ``[ "$BASE" != "$MODEL" ]``: the 16-bit baseline
    (BASE_FORMAT=bf16, the base is MODEL) merged to nvfp4 was given its own base as the bf16 source too."""
    r = subprocess.run([BASH, "-c", f'source {RECIPES / "lib.sh"}; MODEL=/m BASE_FORMAT=bf16 MERGE_DTYPE=nvfp4 STEPS=2 '
                        f'CHAT_TEMPLATE_FILE=; qerl_set_base {tmp_path}; qerl_merge_cmd; printf "%s " "${{QERL_CMD[@]}}"'],
                       capture_output=True, text=True, check=True)
    assert r.stdout == f"merge --model /m --adapter {tmp_path}/step-000001/adapter --out {tmp_path}/merged --dtype nvfp4 ", \
        r.stderr


# ---- session 59's answer-rule readings (math_rule.py, gsm8k_rule.py) ---------------------------------------------------

@pytest.mark.parametrize("completion, reference, ok", [
    # _SEPARATOR_TOKEN's "..." one token: as three full stops a run of them passed _SIDE_BY_SIDE's six, the last box alone
    (r"\boxed{3} ... ... ... \boxed{4}", "4", False),
    # _AFTER_BOX_HEDGE's "and/or"
    (r"\boxed{3} and/or 4", "3", False),
    # _PROSE_VALUE's percent: the quantity restated as a percent is the box's value, no other one offered
    (r"\boxed{\frac{1}{2}} (or 50\%)", r"\frac{1}{2}", True),
    # _prose_values' units=True after a take-back: "4 apples" is a value there (units=False is the hedge's only)
    (r"\boxed{3}. Actually, it is 4 apples.", "3", False),
    # _BEFORE_BOX_HEDGE's lookbehind: an exponent's digit is no value offered
    (r"That is 10^2 or \boxed{100}", "100", True),
    # _hedged_before_box: a value before the "or" equal to the box's is a restatement, no hedge
    (r"0.5 or \boxed{\frac{1}{2}}", r"\frac{1}{2}", True),
    # _TAKE_BACK's "no" only as an interjection ("No, ..."), not the determiner
    (r"\boxed{3}. There are no more than 4 of them.", "3", True),
])
def test_what_stands_around_the_last_box_is_read_whole(completion, reference, ok):
    """Mutants of review s59r14's math readings: ``\\.\\.\\.`` dropped from _SEPARATOR_TOKEN, ``(?:and/)?`` from
    _AFTER_BOX_HEDGE, ``(?:\\\\?%)?`` from _PROSE_VALUE, ``units or`` from _prose_values, the lookbehind from
    _BEFORE_BOX_HEDGE, _hedged_before_box's value compare, _TAKE_BACK's lookahead after "no": each read the last box alone, or a restatement (a percent, an exponent's digit) as another value
    (the right box taken for no answer)."""
    from qerl_cli.answers import is_correct

    assert is_correct(completion, reference, "math") is ok


# ---- the unrun half (s60r14): more of session 59's readings ---------------------------------------------------------

@pytest.mark.parametrize("completion, reference, ok", [
    # _two_unknowns' later name a variable's: "2y = 4" gives 2y's value, not y's, so the two spans are listed
    ("<answer>$x = 3$; $2y = 4$</answer>", "4", False), ("<answer>$x = 3$; $2y = 4$</answer>", "3, 4", True),
    # _SPAN_NAME's "=(?!=)": "y == 4" tests an equality, it names no value
    ("<answer>$x = 3$; $y == 4$</answer>", "4", False), ("<answer>$x == 3$; $y = 4$</answer>", "4", False),
    # _TEXT_LETTERS' two letters at least: a one-letter text group is compared as text, and \text{I} is no sqrt(-1)
    ("\\boxed{\\sqrt{-1}}", "\\text{I}", False),
    # _bold_widened's 60 characters before the box: a long colour declaration is still the dress
    ("{\\color[rgb]{0.8,0.1,0.1}\\Large \\boxed{2}}, {\\color[rgb]{0.8,0.1,0.1}\\Large \\boxed{3}}", "3", False),
    ("{\\color[rgb]{0.8,0.1,0.1}\\Large \\boxed{2}}, {\\color[rgb]{0.8,0.1,0.1}\\Large \\boxed{3}}", "2, 3", True),
    # _DECIMAL_ELLIPSIS' end of the side: an ellipsis a term is followed by is no decimal's cut digits
    ("\\boxed{0.333... + 1}", "1.333", False),
])
def test_names_letters_and_dress_of_an_answer_are_read_whole(completion, reference, ok):
    """Mutants of session 59's math readings: _two_unknowns without ``_is_unknown(later...)`` (any later name split the
    spans), _SPAN_NAME without ``(?!=)`` ("y == 4" named y), _TEXT_LETTERS' ``{1,25}`` as ``{0,25}`` (one letter taken
    out of its text group: "\\sqrt{-1}" right against the choice "\\text{I}"), _bold_widened's declaration window of
    60 characters as 20 (a declaration longer than the window stood between two boxes as words: the last box alone),
    _DECIMAL_ELLIPSIS without its lookahead for the side's end ("0.333... + 1" read as 0.333\\ldots + 1)."""
    from qerl_cli.answers import is_correct

    assert is_correct(completion, reference, "math") is ok


@pytest.mark.parametrize("completion, ok", [
    ("The total is 18.0 or \\boxed{18}", True), ("The total is 19 or \\boxed{18}", False),
])
def test_a_value_before_a_gsm8k_box_that_restates_it_is_no_hedge(completion, ok):
    """Mutant: gsm8k's _hedged_box taking any number before "or" for a hedge, not only one of another value: "18.0 or
    \\boxed{18}" (the box restating it) was no answer, as the math rule's ``0.5 or \\boxed{\\frac12}`` was (round 12)."""
    from qerl_cli.answers import is_correct

    assert is_correct(completion, "18", "gsm8k") is ok


@pytest.mark.parametrize("completion", [
    "So she has \\boxed{18}. Actually, 18 is wrong: it is 19.",
    "The answer is 18. Wait, 18 counts the eggs twice; it is 19.",
])
def test_a_take_back_that_names_the_answer_before_another_number_is_no_answer(completion):
    """Mutant: gsm8k's _taken_back reading one number after the take-back word, not up to 16: the answer named again
    first ("Actually, 18 is wrong") hid the number that replaces it, and the taken-back 18 scored 1."""
    from qerl_cli.answers import is_correct

    assert is_correct(completion, "18", "gsm8k") is False


@pytestmark_bash
def test_step_1_starts_from_step_0s_adapter_and_step_0_from_none(tmp_path):
    """Mutant: _qerl_adapter_before's ``-gt 0`` as ``-gt 1``: step 1 sampled and trained from the base again, step 0's
    adapter dropped (the tests read step 0's, without one, and step 2's)."""
    r = subprocess.run([BASH, "-c", f'source {RECIPES / "lib.sh"}; RUN_DIR={tmp_path}; for s in 0 1 2; do '
                        '_qerl_adapter_before "$s"; echo "$s: ${QERL_ADAPTER[*]}"; done'],
                       capture_output=True, text=True, check=True)
    assert r.stdout.splitlines() == ["0: ", f"1: --adapter {tmp_path}/step-000000/adapter",
                                     f"2: --adapter {tmp_path}/step-000001/adapter"], r.stderr


@pytestmark_bash
def test_a_rollout_past_the_end_does_not_make_a_run_dir_begun(tmp_path):
    """Mutant: _qerl_any_rollout's ``< STEPS`` as ``<= STEPS``: step STEPS's rollout (an earlier, longer run's, left by
    a FORCE=1 rerun with fewer STEPS) made the run dir begun, SHUFFLE=auto read how its rollouts below STEPS were made
    (none) and kept file order, where a new run dir shuffles."""
    run = tmp_path / "run"
    (run / "step-000003" / "shards").mkdir(parents=True)
    r = subprocess.run([BASH, "-c", f'source {RECIPES / "lib.sh"}; RUN_DIR={run} STEPS=3 SHUFFLE=auto; '
                        'qerl_resolve_shuffle; echo "$SHUFFLE"'], capture_output=True, text=True)
    assert (r.returncode, r.stdout, r.stderr) == (0, "1\n", ""), r.stderr
    assert (run / "shuffle").read_text() == "1\n"


def _resume_point(tmp_path: Path, path_names: dict[str, str], **env: str) -> subprocess.CompletedProcess:
    """``qerl_resume_point`` on ``tmp_path/run`` (STEPS=3) with a PATH of only ``path_names`` and ``dirname`` (lib.sh
    finds its directory with it): "QERL_FIRST=..."."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, target in {**path_names, "dirname": shutil.which("dirname")}.items():
        if not (bin_dir / name).is_symlink():
            (bin_dir / name).symlink_to(target)
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "QERL", "FORCE")}
    return subprocess.run([BASH, "-c", f'source {RECIPES / "lib.sh"}; RUN_DIR={tmp_path / "run"} STEPS=3; '
                           'qerl_resume_point; echo "QERL_FIRST=$QERL_FIRST"'],
                          env={**base, "PATH": str(bin_dir), **env}, capture_output=True, text=True, check=True)


@pytestmark_bash
def test_a_resume_point_helper_that_fails_starts_from_step_0(tmp_path):
    """Mutant: qerl_resume_point without ``first=0`` where recipes/resume_point.py fails: QERL_FIRST was its empty
    output, and grpo.sh's ``[ "$first" -gt 0 ]`` said "integer expression expected"."""
    (tmp_path / "run" / "step-000001" / "adapter").mkdir(parents=True)
    (tmp_path / "run" / "step-000001" / "adapter" / "manifest.json").write_text("{}")
    fails = tmp_path / "python3-that-fails-scripts"
    fails.write_text(f'#!{BASH}\nif [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\nexit 1\n')
    fails.chmod(0o755)
    r = _resume_point(tmp_path, {}, PYTHON=str(fails))
    assert (r.stdout, r.stderr) == ("QERL_FIRST=0\n", "")


@pytestmark_bash
def test_no_python_note_only_where_a_step_holds_an_adapter(tmp_path):
    """Mutant: qerl_resume_point's "no Python 3 found ... every step is gone through from step 0" without
    ``_qerl_any_adapter``: said of a new run dir too, where there is no step to skip."""
    (tmp_path / "run").mkdir()
    r = _resume_point(tmp_path, {}, QERL="qerl")
    assert (r.stdout, r.stderr) == ("QERL_FIRST=0\n", "")
    (tmp_path / "run" / "step-000000" / "adapter").mkdir(parents=True)
    (tmp_path / "run" / "step-000000" / "adapter" / "manifest.json").write_text("{}")
    r = _resume_point(tmp_path, {}, QERL="qerl")
    assert r.stdout == "QERL_FIRST=0\n" and "note: no Python 3 found on this host" in r.stderr


@pytest.mark.parametrize("completion", [
    "The answer is 19.\nNo, the answer is 18 (she kept 2 of the 20).",
    # a statement's line ended by a break splitlines() sees (a vertical tab, a form feed, U+2028), the text's last
    "The answer is 18\v", "The answer is 18\f", "The answer is 18\u2028",
])
def test_a_gsm8k_answer_statement_is_read_from_its_phrase_to_its_lines_end(completion):
    """Mutants of gsm8k's _answer_statement: the words after it read from its sentence's start, not its phrase's end
    (a correction's lead "No," taken for a take-back of the 18 it states, its later numbers another answer), and its
    line kept with the break splitlines() ended it on (the break read as part of the number: no answer)."""
    from qerl_cli.answers import is_correct

    assert is_correct(completion, "18", "gsm8k") is True
