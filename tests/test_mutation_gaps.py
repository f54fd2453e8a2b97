"""Tests that kill mutants which survived the rest of the suite (manual mutation testing of losses,
advantages, AQN, rewards, eval metrics, shards, the sampler and the replayed cut; 2026-11-26, session 41).

Each pins a behaviour a user would notice if it changed: masked sequences weigh nothing, AQN off and
greedy records are valid, a min-p-only cut is replayed, ties keep their lowest indices, the last shard is
reported missing, a sign-flip p-value is two-sided, and so on."""

import math

import pytest
import torch

from qerl_cli.errors import BadInputError


# ---- losses / advantages ----
def test_dapo_and_dr_grpo_give_masked_sequences_zero_weight():
    from qerl_cli.train.losses import sequence_weights
    for lt in ("dapo", "dr_grpo"):
        w = sequence_weights(lt, [0, 3, 5], [0, 0, 1], 8)
        assert w[0] == 0 and w[1] > 0, lt


def test_token_stats_count_only_live_tokens_and_nonzero_advantages():
    from qerl_cli.train.losses import LossConfig, policy_loss
    cfg = LossConfig(beta=0.1)
    lp = torch.log(torch.tensor([1.5, 1.5, 1.0], dtype=torch.float64))
    old = torch.zeros(3, dtype=torch.float64)
    ref = torch.tensor([0.0, 0.0, -1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)   # token 1: zero-variance group
    w = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)     # token 2: masked
    _, _, st = policy_loss(lp, old, adv, w, cfg, ref_logp=ref)
    assert st.clip_high == 1                                   # adv == 0 is not "clipped"
    d = -math.log(1.5)
    assert st.kl == pytest.approx(2 * (math.exp(d) - d - 1))  # masked token's KL not summed


def test_loss_config_bounds():
    from qerl_cli.train.losses import LossConfig
    LossConfig(tis_cap=0).validate()        # 0 documented as "disables TIS"
    with pytest.raises(BadInputError):
        LossConfig(clip_eps=1.0).validate()


def test_infinite_reward_is_refused():
    from qerl_cli.train.advantages import group_advantages
    with pytest.raises(BadInputError, match="reward of completion 1"):
        group_advantages([1.0, float("inf")], ["g", "g"])


def test_zero_variance_fraction_counts_groups_not_completions():
    from qerl_cli.train.advantages import group_advantages
    adv = group_advantages([1, 1, 1, 1, 0, 1], ["a"] * 4 + ["b"] * 2)
    assert adv.zero_variance_fraction == pytest.approx(1 / 2)


# ---- aqn ----
def _model():
    from qerl_cli.models import ModelConfig, build_random_model
    cfg = ModelConfig.from_hf(dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    return build_random_model(cfg, device="cpu", dtype=torch.float32, quantized=True, seed=0)


def test_seed_for_is_pinned_across_versions():
    import hashlib

    from qerl_cli.aqn import seed_for
    key = b"qerl-aqn:5:7:1:post_attention_layernorm"
    assert seed_for(5, 7, 1, "post_attention_layernorm") == \
        int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


def test_sigma_zero_clears_previous_steps_noise():
    from qerl_cli.aqn import apply_noise
    m = _model()
    apply_noise(m, 1e-2, run_seed=1, step=3)
    apply_noise(m, 0.0, run_seed=1, step=4)
    assert all(float(layer.input_layernorm.noise.abs().max()) == 0 for layer in m.model.layers)


def test_rounded_noise_is_rounded_weight_minus_weight():
    from qerl_cli.aqn import rounded_noise
    w = torch.full((4,), 1.0)
    z = torch.tensor([1e-3, 3e-3, -5e-3, 0.0])
    got = rounded_noise(z, w, torch.bfloat16)
    assert torch.equal(got, (w + z).bfloat16().float() - w)
    assert got[0] == 0  # 1 + 1e-3 rounds back to 1 in bf16


def test_noise_below_fp32_resolution_is_refused():
    from qerl_cli.aqn import apply_noise
    m = _model()
    for layer in m.model.layers:
        layer.input_layernorm.weight.data.fill_(1e6)
    with pytest.raises(BadInputError, match="below fp32 resolution"):
        apply_noise(m, 1e-12, run_seed=1, step=1)


def test_negative_sigma_end_is_refused():
    from qerl_cli.aqn import sigma_at
    with pytest.raises(ValueError):
        sigma_at(50, 100, 1e-2, -1e-4, 10)


# ---- rewards ----
@pytest.mark.parametrize("text,want", [
    (r"-1\frac{1}{2}", "-1.5"),
    ("1234,567", None),
    ("9" * 100, "9" * 100),
    ("9" * 101, None),
])
def test_number_edge_cases(text, want):
    from qerl_cli.rewards import normalize_number
    assert normalize_number(text) == want


def test_last_closed_answer_tag_counts():
    from qerl_cli.rewards import extract_answer
    assert extract_answer("<answer>1</answer> wait, no: <answer>2</answer>") == "2"


# ---- eval_metrics ----
def _exact_sign_flip(nz):
    obs = abs(sum(nz))
    hits = sum(abs(sum(x if (s >> j) & 1 else -x for j, x in enumerate(nz))) >= obs - 1e-12 for s in range(2 ** len(nz)))
    return hits / 2 ** len(nz)


def test_sign_flip_is_exact_and_two_sided():
    from qerl_cli.eval_metrics import paired_difference
    a = {str(i): 0.5 for i in range(20)}
    b6 = {str(i): (0.75 if i < 5 else 0.25 if i == 5 else 0.5) for i in range(20)}
    nz = [b6[i] - a[i] for i in sorted(a) if b6[i] != a[i]]
    assert paired_difference(a, b6)["p"] == pytest.approx(_exact_sign_flip(nz))
    b = {str(i): 0.75 if i < 12 else 0.25 for i in range(20)}   # 20 nonzero, all of one size: the sign test
    assert paired_difference(a, b)["p"] == pytest.approx(2 * sum(math.comb(20, i) for i in range(9)) / 2**20)
    # 16 nonzero, 12 up and 4 down: the normal approximation gave p = 0.046, the exact p is 0.077 (a review)
    c = {str(i): 1.0 if i < 12 else 0.0 if i < 16 else 0.5 for i in range(200)}
    a = {str(i): 0.5 for i in range(200)}
    assert paired_difference(a, c)["p"] == pytest.approx(2 * sum(math.comb(16, i) for i in range(5)) / 2**16)
    mixed = {str(i): x for i, x in enumerate([1 / 3, 2 / 3, 1.0, 0.0, 0.25, 0.75, 0.5] * 3)}
    other = {str(i): x for i, x in enumerate([0.5, 0.125, 0.0, 1.0, 0.6, 0.2, 0.5] * 3)}
    nz = [other[i] - mixed[i] for i in sorted(mixed) if other[i] != mixed[i]]
    assert len(nz) == 18 and paired_difference(mixed, other)["p"] == pytest.approx(_exact_sign_flip(nz))


def test_length_mean_two_decimals():
    from qerl_cli.eval_metrics import length_stats
    assert length_stats([1, 1, 2])["mean"] == 1.33


# ---- shards ----
def _rec(**kw):
    from qerl_cli.shards import make_record
    base = dict(prompt_id="p", group_id="g", prompt="q", prompt_token_ids=[1], completion_token_ids=[2, 3],
                completion="x", logprobs=[-0.1, -0.2], finish_reason="stop", rewards={"r": 1.0}, reward=1.0,
                answer=None, step=0, policy={"base": "b", "adapter": None},
                sampling={"temperature": 1.0}, noise={"sigma": 0.01, "seed": 1}, engine="native")
    base.update(kw)
    return make_record(**base)


def test_aqn_off_and_greedy_records_are_valid():
    from qerl_cli.shards import validate_record
    assert validate_record(_rec(noise={"sigma": 0.0})) is None
    assert validate_record(_rec(sampling={"temperature": 0.0})) is None


def test_group_split_across_two_files_is_refused(tmp_path):
    from qerl_cli.shards import check_groups_whole
    recs = [_rec(group_id="g"), _rec(group_id="g")]
    with pytest.raises(BadInputError, match="appears at"):
        check_groups_whole(recs, [(tmp_path / "a.jsonl", 1), (tmp_path / "b.jsonl", 1)])


def test_a_group_holding_two_prompts_is_refused(tmp_path):
    # Its advantages compared completions of different prompts, with exit 0 (a review, 2026-11-27).
    from qerl_cli.shards import check_groups_whole
    recs = [_rec(group_id="g", prompt_id="p0"), _rec(group_id="g", prompt_id="p1")]
    with pytest.raises(BadInputError, match=r"group 'g' holds prompt 'p0' at .*a.jsonl:1 and prompt 'p1' at .*a.jsonl:2"):
        check_groups_whole(recs, [(tmp_path / "a.jsonl", 1), (tmp_path / "a.jsonl", 2)])
    check_groups_whole(recs[:1] * 2, [(tmp_path / "a.jsonl", 1), (tmp_path / "a.jsonl", 2)])


def test_resume_drops_an_oversized_group(tmp_path):
    from qerl_cli.shards import load_complete_groups, write_records
    p = tmp_path / "s.jsonl"
    write_records(p, [_rec(group_id="a")] * 4 + [_rec(group_id="b")] * 3)
    groups, dropped = load_complete_groups(p, group_size=3)
    assert list(groups) == ["b"] and dropped == 4


def test_missing_last_shard_is_reported():
    from pathlib import Path

    from qerl_cli.shards import missing_shards
    assert missing_shards([Path("shard-00000-of-00002.jsonl")]) == ["shard-00001-of-00002.jsonl"]


# ---- sampler ----
def test_min_p_keeps_a_token_exactly_at_the_floor():
    from qerl_cli.engine.sampler import truncate
    x = torch.tensor([[0.0, -math.log(2), -3.0]])
    assert torch.isfinite(truncate(x, 1.0, 0, 0.5)).tolist() == [[True, True, False]]  # vLLM: probs < thresh cut


def test_top_p_cut_at_exact_mass_and_tie_order():
    from qerl_cli.engine.sampler import truncate
    x = torch.tensor([[0.5, 0.25, 0.25]]).log()
    assert torch.isfinite(truncate(x, 0.5, 0, 0.0)).tolist() == [[True, False, False]]
    kept = torch.isfinite(truncate(torch.zeros(1, 4000), 0.001, 0, 0.0))[0].nonzero().flatten()
    assert kept.tolist() == [0, 1, 2, 3]   # ties: lowest indices, as the stable sort promises


def test_top_k_of_vocab_minus_one_cuts_one_token():
    from qerl_cli.engine.sampler import truncate
    x = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    assert torch.isfinite(truncate(x, 1.0, 3, 0.0)).tolist() == [[True, True, True, False]]


def test_inverse_cdf_never_draws_a_token_without_mass_at_u_zero():
    from qerl_cli.engine.sampler import inverse_cdf
    v = 2048
    lp = torch.full((2, v), float("-inf"))
    lp[0, 1] = lp[0, 2] = math.log(0.5)          # token 0 masked
    lp[1, 1500] = 0.0                            # every chunk but one masked
    tok = inverse_cdf(lp, torch.zeros(2, dtype=torch.float64))
    assert tok.tolist() == [1, 1500]


# ---- logprobs ----
def test_min_p_only_rows_are_replayed():
    from qerl_cli.train.logprobs import replay_truncation_
    z = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    cut = replay_truncation_(z.clone(), torch.tensor([0]), torch.tensor([[1.0, 0, 0.5]], dtype=torch.float64))
    assert torch.isfinite(cut).tolist() == [[True, True, False, False]]


def test_model_without_noised_norms_is_refused():
    from types import SimpleNamespace

    from qerl_cli.aqn import apply_noise
    with pytest.raises(BadInputError, match="no noised RMSNorm"):
        apply_noise(SimpleNamespace(model=SimpleNamespace(layers=[])), 1e-2, run_seed=1, step=1)


def test_noise_record_names_the_rounding_dtype():
    from qerl_cli.aqn import apply_noise
    assert apply_noise(_model(), 1e-2, run_seed=1, step=1, rounded_to="bfloat16")["rounded_to"] == "bfloat16"


def test_a_group_interleaved_within_one_file_is_accepted(tmp_path):
    # The stages contract asks only that the G completions of a prompt share a group_id; a writer that
    # emits completions as they finish interleaves groups in its file. Refused as "appears ... and again".
    from qerl_cli.shards import check_groups_whole
    recs = [_rec(group_id="a", prompt_id="pa", engine="vllm"), _rec(group_id="b", prompt_id="pb", engine="vllm"),
            _rec(group_id="a", prompt_id="pa", engine="vllm"), _rec(group_id="b", prompt_id="pb", engine="vllm")]
    check_groups_whole(recs, [(tmp_path / "a.jsonl", i) for i in range(1, 5)])  # the contract's policy {base, adapter}
    # qerl's own records (policy with `norms`) hold a group as one run of lines: one that comes back is the same
    # group twice (`cat a.jsonl a.jsonl`, two retries appended to one file), which would double its weight (a review)
    own = [dict(r, policy=dict(r["policy"], norms=None)) for r in recs]
    with pytest.raises(BadInputError, match="group 'a' appears at .*a.jsonl:1 and again at .*a.jsonl:3"):
        check_groups_whole(own, [(tmp_path / "a.jsonl", i) for i in range(1, 5)])
    with pytest.raises(BadInputError, match="appears at"):  # across files it is still a group found twice
        check_groups_whole(recs, [(tmp_path / "a.jsonl", 1), (tmp_path / "a.jsonl", 2),
                                  (tmp_path / "b.jsonl", 1), (tmp_path / "b.jsonl", 2)])


def test_a_record_without_answer_reads_as_null(tmp_path):
    # The contract: "answer (reference, if any)"; a writer may leave it out.
    import json

    from qerl_cli.shards import read_records
    rec = _rec()
    del rec["answer"]
    (tmp_path / "shard-00000-of-00001.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps(rec) + "\n")
    got = read_records(tmp_path)
    assert len(got) == 2 and got[0]["answer"] is None


def test_no_records_left_after_skipping_says_why(tmp_path):
    # --skip-bad-lines over a shard whose every line is bad ended in "no rollout records to train on"
    # without the reason the lines were skipped.
    import json
    from types import SimpleNamespace

    from qerl_cli.train_step import read_step
    rec = _rec()
    del rec["engine"]
    (tmp_path / "shard-00000-of-00001.jsonl").write_text(json.dumps(rec) + "\n")
    with pytest.raises(BadInputError, match=r"no rollout records to train on .*skipped all 1 lines.*missing field\(s\) engine"):
        read_step(SimpleNamespace(shards=[str(tmp_path)], skip_bad_lines=True))
