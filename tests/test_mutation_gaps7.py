"""Tests that kill mutants of what session 57 added or changed which survived the suite (manual mutation testing,
round 9: TRL's calling convention in qerl_cli/trl_rewards.py, the dataset columns a reward is passed (data.py,
rewards.py, rollout.py), PEFT's all-linear and ensure_weight_tying in adapters.py and merge.py, and the GPU checks of
eval_devices.py). docs/reliability.md has the counts; each docstring names the mutant it kills."""

import json
import signal
import threading
import time

import pytest

from qerl_cli.errors import BadInputError
from qerl_cli.rewards import RewardSet
from qerl_cli.shards import read_records

REWARDS = '''\
import asyncio

cancelled = []


def named_completion(completion, completion_ids, answer=None):  # names `completion`: a per-completion reward
    return 1.0


def ids_and_state(completion_ids, trainer_state):
    return [0.0] * len(completion_ids)


def defaulted_before_state(completions, *, level=None, trainer_state):
    return [0.0] * len(completions)


def star_before_state(*extra, completions, trainer_state):
    return [0.0] * len(completions)


def takes_prompt(completions, prompt):
    return [0.0] * len(completions)


def grows_ids(completions, completion_ids, **kwargs):
    for ids in completion_ids:
        ids.append(-1)
    return [float(len(ids)) for ids in completion_ids]


def marks(completions, checks, **kwargs):  # each completion's copy of the column: marked once
    for c in checks:
        c["seen"].append(1)
    return [float(len(c["seen"])) for c in checks]


def text(completions, **kwargs):
    return "ab"


def by_index(completions, **kwargs):
    return {i: 1.0 for i in range(len(completions))}


def one_more(completions, **kwargs):
    return [1.0] * (len(completions) + 1)


def keys(completions, **kwargs):
    return [float(len(kwargs))] * len(completions)


async def waits(completions, **kwargs):
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        cancelled.append(1)
        raise
    return [0.0] * len(completions)


async def judged(completions, **kwargs):
    await asyncio.sleep(0)
    return [1.0] * len(completions)
'''


@pytest.fixture
def rewards(tmp_path):
    f = tmp_path / "r7.py"
    f.write_text(REWARDS)
    return lambda name: RewardSet.from_specs([f"{f}:{name}"])


# ---- which functions are TRL's, and what a refusal says ---------------------------------------------------------
def test_a_reward_naming_completion_is_per_completion_even_with_its_ids_required(rewards):
    """Mutant T02: written_for_trl without its `"completion" in params` check read f(completion, completion_ids,
    answer=None) as TRL's and refused it as missing `completion`."""
    assert rewards("named_completion").specs[0].reward.batched is None


def test_a_refused_reward_of_token_ids_alone_is_said_to_take_completion_ids(rewards):
    """Mutant T08: the refusal named `completions`, which the function does not take."""
    with pytest.raises(BadInputError, match=r"takes `completion_ids`, so it is read as a TRL reward") as e:
        rewards("ids_and_state")
    assert "`completions`" not in str(e.value)


def test_the_refusal_hint_names_the_required_parameter_not_one_with_a_default(rewards):
    """Mutants T16 and T17: the hint's `missing` took a parameter with a default (`level`), or `*extra`, for the one
    that fails to bind, and told the user to rename it."""
    for name in ("defaulted_before_state", "star_before_state"):
        with pytest.raises(BadInputError) as e:
            rewards(name)
        assert e.value.hint == "qerl has no TRL trainer to pass as `trainer_state`: give the parameter a default (None)"


def test_a_reward_requiring_a_reserved_name_is_told_to_rename_it(rewards):
    """Mutant T19: the hint for a required name no column is passed under (`prompt`: TRL's is `prompts`)."""
    with pytest.raises(BadInputError, match="missing a required argument: 'prompt'") as e:
        rewards("takes_prompt")
    assert e.value.hint.startswith("`prompt` is a name qerl passes nothing under (TRL's are `prompts` and "
                                   "`completions`") and e.value.hint.endswith("rename it, or give it a default")


def test_a_dataset_without_columns_is_said_to_have_none(rewards):
    """Mutant R04: the hint read "they are ; the reference is passed as `answer`" for a file whose rows hold only
    a prompt and an answer."""
    with pytest.raises(BadInputError) as e:
        rewards("marks").check_columns([], " of p.jsonl")
    assert e.value.hint.startswith("they are none; the reference is passed as `answer`")


def test_the_columns_may_be_any_iterable_as_check_columns_is_typed(rewards):
    """Mutant R09: without `list(columns)`, a generator was used up by the first `in`: a column it holds was "not
    among the columns" and the hint said there were none."""
    rewards("marks").check_columns((k for k in ("id", "checks")), " of p.jsonl")
    with pytest.raises(BadInputError) as e:
        rewards("marks").check_columns((k for k in ("id", "task")), " of p.jsonl")
    assert e.value.hint.startswith("they are `id`, `task`;")


# ---- what a TRL reward is passed: copies --------------------------------------------------------------------
def test_a_reward_that_changes_the_token_ids_it_is_passed_changes_no_record(rewards):
    """Mutant T22: the completions' own token-id lists were passed; a reward appending to them changed the shard's
    `completion_token_ids`."""
    ids = [[1, 2], [3]]
    got = rewards("grows_ids").score_group(["a", "b"], None, "q", completion_ids=ids)
    assert [total for _, total in got] == [3.0, 2.0] and ids == [[1, 2], [3]]


def test_a_column_that_cannot_be_pickled_is_still_one_copy_per_completion(rewards):
    """Mutant T29: a column pickle refuses (a library caller's object holding a lambda) was passed as the same object to
    every completion: what a reward did to one completion's copy was the next one's, and the caller's row changed."""
    column = {"check": lambda: 1, "seen": []}
    rs = rewards("marks")
    assert [total for _, total in rs.score_group(["a", "b", "c"], None, "q", columns={"checks": column})] == [1.0] * 3
    assert column["seen"] == []


@pytest.mark.parametrize("fn, msg", [("text", "returned str 'ab' for p.jsonl:1, not a list of 2 rewards"),
                                     ("by_index", "returned dict '{0: 1.0, 1: 1.0}' for p.jsonl:1, not a list of 2"),
                                     ("one_more", "returned 3 rewards for the 2 completions for p.jsonl:1")])
def test_a_trl_reward_returning_no_list_of_one_per_completion_is_refused(rewards, fn, msg):
    """Mutants T33, T34, T35: a text of G characters read as G rewards (its characters "not a number"), a dict of G
    keys scored its keys (0, 1, ... as rewards, silently), and a list one longer than the group was cut to it."""
    with pytest.raises(BadInputError) as e:
        rewards(fn).score_group(["a", "b"], None, "q", where=" for p.jsonl:1")
    assert msg in str(e.value), e.value


def test_a_column_named_completion_is_not_passed_as_trl_leaves_it_out(rewards):
    """Mutant T40: `completion` left out of RESERVED_COLUMNS: a dataset's `completion` column (a reference completion,
    as TRL's prompt-completion datasets hold) was passed to a **kwargs reward, where TRL passes none."""
    got = rewards("keys").score_group(["a"], None, "q", columns={"completion": "ref", "id": 3})
    assert got[0][1] == 3.0  # prompts, answer, id


# ---- async rewards ------------------------------------------------------------------------------------------
def test_a_ctrl_c_while_an_async_reward_runs_cancels_it(rewards):
    """Mutant T37: without done.cancel(), the reward went on running on the loop's thread after the Ctrl-C."""
    rs = rewards("waits")
    cancelled = rs.specs[0].reward.fn.__globals__["cancelled"]

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            rs.score_group(["a"], None, "q")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    deadline = time.monotonic() + 5
    while not cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cancelled == [1]


def test_async_rewards_get_a_new_loop_where_its_thread_is_gone(rewards):
    """Mutant T38: _event_loop kept a loop whose thread had ended (a forked child has none): the reward's coroutine
    was handed to a loop nobody runs and the call hung."""
    from qerl_cli import trl_rewards

    loop = trl_rewards._event_loop()
    loop.call_soon_threadsafe(loop.stop)
    trl_rewards._LOOP[1].join(5)
    assert not trl_rewards._LOOP[1].is_alive()
    rs, done = rewards("judged"), []
    t = threading.Thread(target=lambda: done.append(rs.score_group(["a"], None, "q")), daemon=True)
    t.start()
    t.join(10)
    assert done and done[0][0][1] == 1.0, "the call hung on a loop without a thread"
    assert trl_rewards._LOOP[0] is not loop and not loop.is_running()


# ---- the dataset's columns (data.py) ----------------------------------------------------------------------------
def test_the_datasets_columns_are_every_rows_in_the_order_first_seen(tmp_path):
    """Mutants D10 and D11: column_names sorted them (the refusal's "they are ..." listed another order than the file's),
    or read the first row's alone: a column only later rows hold was "not among the columns" (exit 2 before
    generating) and a **kwargs reward was not passed it."""
    from qerl_cli.data import column_names, load_prompts

    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "x", "tests": [1]}) + "\n" + json.dumps({"prompt": "y", "level": 2, "tests": []})
                 + "\n")
    assert column_names(load_prompts(p)) == ["tests", "level"]


def test_a_parquet_large_list_of_float32_reaches_a_reward_as_floats(tmp_path):
    """Mutant D04: _holds_float32 without its large_list case: such a column was passed as the text qerl reads float32
    columns as (["0.5"], not [0.5])."""
    from qerl_cli.data import load_prompts

    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"prompt": ["a"], "answer": ["1"],
                      "scores": pa.array([[0.5, 2.0]], pa.large_list(pa.float32()))})
    pq.write_table(table, tmp_path / "f.parquet")
    assert load_prompts(tmp_path / "f.parquet")[0].columns == {"scores": [0.5, 2.0]}


def test_a_chat_rows_messages_are_its_prompt_not_a_column(tmp_path):
    """Mutant D17: `messages` left out of ROW_FIELDS: a chat row's conversation, passed as `prompts` already, was kept
    as a column too and passed again to a **kwargs reward under `messages`."""
    from qerl_cli.data import load_prompts

    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"}], "answer": "4", "level": 1}) + "\n")
    assert load_prompts(p)[0].columns == {"level": 1}


def test_a_column_named_by_answer_key_is_still_passed_under_its_own_name(tmp_path):
    """Mutant D16: the columns read from the row as --answer-key renamed it: `--answer-key solution` took `solution`
    away from a reward that reads it (open-r1's accuracy_reward), as TRL passes it."""
    from qerl_cli.data import load_prompts

    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"question": "2+2?", "solution": "4", "level": 1}) + "\n")
    row = load_prompts(p, prompt_key="question", answer_key="solution")[0]
    assert row.answer == "4" and row.columns == {"question": "2+2?", "solution": "4", "level": 1}


# ---- rollout: the columns passed, and warned of before generating ---------------------------------------------
@pytest.fixture(scope="module")
def model_dir():
    from qerl_cli.assets import tiny_model_dir

    return tiny_model_dir()


@pytest.fixture()
def fake_engine(monkeypatch):
    import qerl_cli.rollout as ro
    from tests.test_rollout import FakeEngine

    FakeEngine.calls, FakeEngine.seeds = [], []
    monkeypatch.setattr(ro, "_native_generator",
                        lambda cfg, tokenizer, *a, **k: (ro._Generator(FakeEngine(tokenizer), "sp", "fake"), None))
    return FakeEngine


def _column_rollout(model_dir, tmp_path, rows, reward, **kw):
    from qerl_cli.rollout import rollout
    from tests.test_rollout import cfg_for

    prompts = tmp_path / "cols.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = tmp_path / "r.py"
    r.write_text(reward)
    return prompts, lambda **more: rollout(cfg_for(model_dir, tmp_path, prompts=prompts, rewards=(f"{r}:f",),
                                                   **dict(kw, **more)))


def test_a_kwargs_reward_is_passed_the_columns_of_every_row_not_of_this_steps_slice(model_dir, tmp_path, fake_engine):
    """Mutant O07: the columns read from this step's --prompts-per-step slice: a column only other steps' rows hold was
    not passed at this step (TRL's dataset has one schema: None there), so one reward saw other keywords per step."""
    _, run = _column_rollout(model_dir, tmp_path, [{"prompt": "Q0?"}, {"prompt": "Q1?", "level": 3}],
                             "def f(completions, **kwargs):\n    return [float('level' in kwargs)] * len(completions)\n",
                             prompts_per_step=1)
    for step in (0, 1):
        run(step=step, out=tmp_path / f"o{step}")
        assert {rec["reward"] for rec in read_records(tmp_path / f"o{step}")} == {1.0}


def test_each_required_column_a_row_holds_no_value_for_is_warned_of(model_dir, tmp_path, fake_engine):
    """Mutant O12: only a reward's first required column was looked at: rows passing None for its second went
    unsaid."""
    from qerl_cli.errors import QerlWarning

    _, run = _column_rollout(model_dir, tmp_path, [{"prompt": "Q0?", "solution": "0", "level": 1},
                                                   {"prompt": "Q1?", "solution": "1"}],
                             "def f(completions, solution, level, **kwargs):\n    return [0.0] * len(completions)\n")
    with pytest.warns(QerlWarning, match=r"column `level` .* 1 of the 2 rows hold no value for \(first: .*cols.jsonl:2\)"):
        run()


# ---- PEFT's ensure_weight_tying (adapters.py) -------------------------------------------------------------------
# target_modules as PEFT 0.21 saves them with ensure_weight_tying on a tied llama: asked for ["lm_head", "q_proj"] it
# writes the embedding's full name; asked for a regex, it adds the embedding's; both save lm_head's LoRA pair
PEFT_TIED_TARGETS = [["model.embed_tokens", "q_proj"], r"(?:.*(embed_tokens|q_proj)|^model\.embed_tokens$)"]


@pytest.mark.parametrize("targets", PEFT_TIED_TARGETS)
def test_a_tied_head_beside_the_embedding_target_peft_writes_is_wrapped(targets):
    """Mutants P05 and P06: _ties_head read a regex target as naming no embedding, or compared a full module name
    (model.embed_tokens) with the bare names: lm_head's pair in such an adapter, which PEFT saves and loads, was
    refused as "target_modules ... does not name"."""
    from qerl_cli.adapters import peft_leaves_out

    assert peft_leaves_out({"target_modules": targets, "ensure_weight_tying": True}, "lm_head") is None


def test_ensure_weight_tying_ties_only_the_head_and_reads_target_modules_as_peft_does():
    """Mutants P07 and P11: a config tying the head made every module wrapped (exclude_modules ignored), and a regex
    target was searched, not fully matched as PEFT matches it against embed_tokens ("embed" names no embedding)."""
    from qerl_cli.adapters import peft_leaves_out

    cfg = {"target_modules": ["embed_tokens", "q_proj"], "ensure_weight_tying": True, "exclude_modules": ["q_proj"]}
    assert peft_leaves_out(cfg, "lm_head") is None
    assert peft_leaves_out(cfg, "model.layers.0.self_attn.q_proj") == "exclude_modules ['q_proj'] excludes"
    cfg = {"target_modules": "embed|q_proj", "ensure_weight_tying": True}
    assert peft_leaves_out(cfg, "lm_head") == "target_modules 'embed|q_proj' does not match"


# ---- eval_devices: the GPU model a stopped eval resumes on, an older qerl's partial directory ---------------------
def _eval_output(tmp_path, device="cuda", force=False):
    from qerl_cli.outputs import StageOutput

    return StageOutput(tmp_path / "e", "eval", config={"device": device, "dtype": "bf16", "seed": 0},
                       inputs={"model": "m"}, resumable=True, force=force)


@pytest.mark.parametrize("record, model", [({"gpu": "H100"}, None), ({"gpu": None}, "H100"), ({"gpu": 3}, "H100"),
                                           ([1, 2], "H100")])
def test_a_partial_dir_without_two_gpu_models_to_compare_resumes(tmp_path, record, model):
    """Mutants V01, V02, V10: check_made_on_this_gpu compared what it cannot: this GPU's model where CUDA cannot name it
    (None), a record naming none (a GPU CUDA could not name when it stopped) or not a name, or a record that is no
    JSON object (AttributeError): each refused a resume (exit 4) its docstring lets through."""
    from qerl_cli.eval_devices import MADE_ON, check_made_on_this_gpu

    so = _eval_output(tmp_path)
    so.partial_dir().mkdir()
    (so.partial_dir() / MADE_ON).write_text(json.dumps(record))
    check_made_on_this_gpu(so, model)
    assert (so.partial_dir() / MADE_ON).exists()


def test_an_older_qerls_partial_dir_renamed_meanwhile_is_left_alone(tmp_path, monkeypatch):
    """Mutant V05: adopt_indexed_partial renamed the cuda:1 partial directory without looking again under its writer
    lock: where the run that held the lock had finished it meanwhile (renamed into --out), a FileNotFoundError."""
    import shutil

    import qerl_cli.eval_devices as ed
    from qerl_cli.outputs import WriterLock

    so, old = _eval_output(tmp_path), _eval_output(tmp_path, device="cuda:1")
    old.partial_dir().mkdir()

    class FinishedMeanwhile(WriterLock):
        def __enter__(self):
            shutil.rmtree(old.partial_dir())  # the older qerl's run, holding the lock, renamed it into --out
            return super().__enter__()

    monkeypatch.setattr(ed, "WriterLock", FinishedMeanwhile)
    ed.adopt_indexed_partial(so, "cuda:1", None)
    assert not so.partial_dir().exists() and not old.partial_dir().exists()


def test_a_leftover_partial_dir_gone_under_the_lock_is_not_said_removed(tmp_path, monkeypatch):
    """Mutant V08: sweep_leftover_partial without `part.is_dir()` under the lock: a directory a run holding the lock
    finished meanwhile was "removed" (True: eval's sweep printed "note: removed ...")."""
    import shutil

    import qerl_cli.outputs as outputs

    so = _eval_output(tmp_path)
    so.partial_dir().mkdir()

    class FinishedMeanwhile(outputs.WriterLock):
        def __enter__(self):
            got = super().__enter__()
            shutil.rmtree(so.partial_dir())
            return got

    monkeypatch.setattr(outputs, "WriterLock", FinishedMeanwhile)
    assert outputs.sweep_leftover_partial(so) is False
