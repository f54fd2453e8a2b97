"""Host-side paths at the sizes of a real run: no per-row or per-token cost that grows with the input.

Each bound is 3 s: ~15x and more above the fixed code's time on a loaded 2-core machine, and 3x and more below
the time the quadratic code took there, so a regression fails without a timing flake.
"""

from __future__ import annotations

import time
from types import SimpleNamespace


def _timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def test_a_shuffled_step_past_the_first_epoch_selects_in_linear_time():
    # order(epoch) was recomputed (O(n)) for each of the step's P rows: 4 s for 50,007 rows and P = 1000,
    # 10 s for 100k, ~20 min a shard for 1M rows and P = 10k, at every step after the first epoch.
    from qerl_cli.rollout import select_prompts

    n, p = 100_007, 1000
    cfg = SimpleNamespace(max_prompts=None, prompts_per_step=p, step=n // p + 1, shuffle=True, run_seed=0,
                          shard_index=0, num_shards=1, prompts="x")
    picked, dt = _timed(select_prompts, list(range(n)), cfg)
    assert len(picked) == p == len(set(picked))
    assert dt < 3.0, f"select_prompts took {dt:.2f} s"


def test_a_caret_before_a_run_of_spaces_is_scored_in_linear_time():
    # _DEGREES' "\^\s*\{?\s*\\circ" split a run of spaces between its two \s* every way: 18 s for one reward.
    from qerl_cli.rewards import gsm8k_reward

    text = "so the answer is\n#### 2^" + " " * 80_000 + "."
    _, dt = _timed(gsm8k_reward, text, "2")
    assert dt < 3.0, f"gsm8k reward took {dt:.2f} s"


def test_mcnemar_on_many_discordant_problems_is_fast():
    # A math.comb per term of the binomial tail: 9 minutes at 100,000 problems, ~10 s at 40,000.
    from qerl_cli.eval_metrics import paired_difference

    n = 40_000
    a = {str(i): float(i % 2) for i in range(n)}
    b = {str(i): float((i // 2) % 2) for i in range(n)}  # half the problems discordant, evenly split
    r, dt = _timed(paired_difference, a, b)
    assert r["test"] == "McNemar" and r["discordant"] == (n // 4, n // 4) and r["p"] == 1.0
    assert dt < 3.0, f"paired_difference took {dt:.2f} s"


def test_special_tokens_are_not_stop_checked():
    # A special token shows no text, so it cannot complete a stop; checked anyway, each one walked the stop
    # window back over the whole run of them before it: 13 s of host time for 16,000 of them.
    from pathlib import Path

    from qerl_cli.engine.llm_engine import LLMEngine
    from qerl_cli.engine.sampling_params import SamplingParams
    from qerl_cli.engine.sequence import Sequence
    from qerl_cli.runtime import load_tokenizer, special_tokens

    tok = load_tokenizer(Path(__file__).parents[1] / "qerl_cli" / "assets" / "tiny_model")
    engine = object.__new__(LLMEngine)
    engine.tokenizer = tok
    special = sorted(special_tokens(tok).values())[0]
    calls = []
    real = engine._stop_string_hit
    engine._stop_string_hit = lambda s, stops: calls.append(s.token_ids[-1]) or real(s, stops)
    sp = SamplingParams(max_new_tokens=10**6, stop=("Q:",))
    prompt = tok("1 2 3", add_special_tokens=False)["input_ids"]
    s = Sequence(0, 0, list(prompt), len(prompt), 10**9)
    for _ in range(5000):
        assert not engine._append(s, special, -0.1, sp, set())
    assert special not in calls
    for t in tok("Q:", add_special_tokens=False)["input_ids"]:
        engine._append(s, t, -0.1, sp, set())
    assert (s.finish_reason, s.stop_reason) == ("stop", "Q:")
