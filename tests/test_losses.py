"""Each loss type equals a direct per-token reference formula written with Python loops."""

import math
import random

import pytest
import torch

from qerl_cli.errors import BadInputError
from qerl_cli.train.losses import LossConfig, policy_loss, sequence_weights, tis_weights


def _make_step(seed=0):
    """Hand-made step: 5 sequences of different lengths, 2 micro-batches, one masked sequence."""
    rnd = random.Random(seed)
    lengths = [4, 1, 6, 3, 5]
    adv = [0.7, -1.2, 0.0, 1.5, -0.4]
    micro = [0, 1, 0, 1, 1]
    masked = [False, False, False, True, False]
    seqs = []
    for n, a in zip(lengths, adv):
        logp = [math.log(rnd.uniform(0.05, 0.95)) for _ in range(n)]
        old = [lp + rnd.uniform(-0.5, 0.5) for lp in logp]  # ratios on both sides of the clip range
        samp = [o + rnd.uniform(-1.0, 1.0) for o in old]    # TIS ratios above and below the cap
        ref = [lp + rnd.uniform(-0.3, 0.3) for lp in logp]
        seqs.append(dict(logp=logp, old=old, samp=samp, ref=ref, adv=a))
    return lengths, adv, micro, masked, seqs


def _token_term(lp, old, samp, ref, a, cfg):
    ratio = math.exp(lp - old)
    clipped = min(max(ratio, 1 - cfg.clip_eps), 1 + cfg.clip_eps_high)
    pg = max(-a * ratio, -a * clipped)
    if cfg.tis_cap:
        pg *= min(math.exp(old - samp), cfg.tis_cap)
    if cfg.beta:
        d = ref - lp
        pg += cfg.beta * (math.exp(d) - d - 1)
    return pg


def _reference_loss(loss_type, cfg, lengths, micro, masked, seqs, lmax=None):
    live = [0 if m else n for n, m in zip(lengths, masked)]
    terms = [[_token_term(*(s[k][t] for k in ("logp", "old", "samp", "ref")), s["adv"], cfg) for t in range(n)]
             for s, n in zip(seqs, lengths)]
    N = len(lengths)
    if loss_type == "grpo":
        return sum(sum(t) / n for t, n in zip(terms, live) if n) / N
    if loss_type == "dapo":
        return sum(sum(t) for t, n in zip(terms, live) if n) / sum(live)
    if loss_type == "dr_grpo":
        return sum(sum(t) for t, n in zip(terms, live) if n) / (N * (lmax or max(live)))
    if loss_type == "bnpo":
        mbs = sorted(set(micro))
        per = []
        for m in mbs:
            toks = sum(n for n, mm in zip(live, micro) if mm == m)
            per.append(sum(sum(t) for t, n, mm in zip(terms, live, micro) if mm == m and n) / max(toks, 1))
        return sum(per) / len(per)  # TRL: per micro-batch sum / max(tokens, 1), then / accumulation steps
    raise AssertionError


def _flat(lengths, micro, masked, seqs, loss_type, lmax=None, only_mb=None):
    counts = [0 if m else n for n, m in zip(lengths, masked)]
    w = sequence_weights(loss_type, counts, micro, lmax)
    cols = {k: [] for k in ("logp", "old", "samp", "ref", "adv", "w")}
    for b, (s, n) in enumerate(zip(seqs, lengths)):
        if only_mb is not None and micro[b] != only_mb:
            continue
        for k in ("logp", "old", "samp", "ref"):
            cols[k] += s[k]
        cols["adv"] += [s["adv"]] * n
        cols["w"] += [0.0 if masked[b] else float(w[b])] * n
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in cols.items()}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
@pytest.mark.parametrize("beta,tis", [(0.0, 2.0), (0.04, None), (0.1, 1.5)])
def test_loss_equals_direct_formula(loss_type, beta, tis):
    lengths, adv, micro, masked, seqs = _make_step()
    cfg = LossConfig(loss_type=loss_type, beta=beta, tis_cap=tis)
    lmax = 8 if loss_type == "dr_grpo" else None
    want = _reference_loss(loss_type, cfg, lengths, micro, masked, seqs, lmax)
    # Summing the two micro-batches' losses must give the step loss (gradient accumulation is a sum).
    total = 0.0
    for mb in (0, 1):
        t = _flat(lengths, micro, masked, seqs, loss_type, lmax, only_mb=mb)
        isw = tis_weights(t["old"], t["samp"], tis)[0] if tis else None
        loss, _, _ = policy_loss(t["logp"], t["old"], t["adv"], t["w"], cfg, is_weight=isw, ref_logp=t["ref"])
        total += float(loss)
    assert total == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_gradient_matches_finite_difference_of_reference():
    lengths, adv, micro, masked, seqs = _make_step(3)
    cfg = LossConfig(loss_type="dapo", beta=0.05)
    t = _flat(lengths, micro, masked, seqs, "dapo")
    lp = t["logp"].clone().requires_grad_(True)
    isw = tis_weights(t["old"], t["samp"], cfg.tis_cap)[0]
    loss, _, _ = policy_loss(lp, t["old"], t["adv"], t["w"], cfg, is_weight=isw, ref_logp=t["ref"])
    loss.backward()
    k, h = 2, 1e-6

    def shifted(delta):
        seqs2 = [dict(s, logp=list(s["logp"])) for s in seqs]
        seqs2[0]["logp"][k] += delta
        return _reference_loss("dapo", cfg, lengths, micro, masked, seqs2)

    assert lp.grad[k].item() == pytest.approx((shifted(h) - shifted(-h)) / (2 * h), rel=1e-5)


def test_clip_and_token_stats():
    cfg = LossConfig(clip_eps=0.2, clip_eps_high=0.28)
    old = torch.zeros(4, dtype=torch.float64)
    lp = torch.log(torch.tensor([0.5, 1.5, 1.1, 0.7], dtype=torch.float64))
    adv = torch.tensor([-1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    w = torch.tensor([0.25, 0.25, 0.25, 0.0], dtype=torch.float64)
    loss, per_tok, st = policy_loss(lp, old, adv, w, cfg)
    # ratio 0.5 with A<0 clipped low (-A*0.8 = 0.8 > 0.5); ratio 1.5 with A>0 clipped high (-1.28 > -1.5).
    assert per_tok[:3].tolist() == pytest.approx([0.8, -1.28, -1.1])
    assert (st.tokens, st.clip_low, st.clip_high) == (3, 1, 1)
    assert float(loss) == pytest.approx((0.8 - 1.28 - 1.1) / 4)


def test_tis_weights_cap_and_disable():
    w, raw = tis_weights(torch.tensor([0.0, 0.0]), torch.tensor([-2.0, 1.0]), 2.0)
    assert raw.tolist() == pytest.approx([math.exp(2), math.exp(-1)])
    assert w.tolist() == pytest.approx([2.0, math.exp(-1)])
    w, _ = tis_weights(torch.tensor([0.0]), torch.tensor([-2.0]), 0)
    assert w.tolist() == [1.0]


def test_sequence_weight_errors():
    with pytest.raises(BadInputError, match="no completion tokens"):
        sequence_weights("dapo", [0, 0])
    with pytest.raises(BadInputError, match="--max-completion-length 2"):
        sequence_weights("dr_grpo", [3, 1], max_completion_length=2)
    with pytest.raises(BadInputError, match="--loss"):
        LossConfig(loss_type="ppo").validate()


def test_dr_grpo_divides_by_the_generation_budget_not_the_longest_trained_completion():
    # Dr. GRPO's L_max is a constant (TRL: max_completion_length). --mask-truncated drops exactly the
    # longest completions, so "the longest live completion" made the divisor shrink with the mask.
    from types import SimpleNamespace

    from qerl_cli.train_step import dr_grpo_length

    comps = [[1] * 10, [1] * 3, [1] * 5, [1] * 2]
    recs = [{"sampling": {"max_new_tokens": 12}} for _ in comps]
    data = SimpleNamespace(completion_lengths=[len(c) for c in comps], records=recs)
    cfg = SimpleNamespace(loss="dr_grpo", max_completion_length=None)
    assert dr_grpo_length(cfg, data) == 12
    assert dr_grpo_length(SimpleNamespace(loss="dr_grpo", max_completion_length=64), data) == 64
    assert dr_grpo_length(SimpleNamespace(loss="dapo", max_completion_length=None), data) is None
    legacy = SimpleNamespace(completion_lengths=[len(c) for c in comps], records=[{"sampling": {}} for _ in comps])  # no budget recorded
    assert dr_grpo_length(cfg, legacy) == 10
    # the same 3-token completion weighs the same whether or not the longest one is masked
    live = [0, 3, 5, 2]
    masked = sequence_weights("dr_grpo", live, max_completion_length=dr_grpo_length(cfg, data))
    unmasked = sequence_weights("dr_grpo", [10, 3, 5, 2], max_completion_length=dr_grpo_length(cfg, data))
    assert masked[1] == unmasked[1] == pytest.approx(1 / (4 * 12))


def test_bnpo_counts_a_micro_batch_whose_completions_are_all_masked():
    # TRL divides by its gradient-accumulation steps, all of them; qerl counted only micro-batches with
    # trained tokens, so a micro-batch emptied by --mask-truncated scaled the loss by M / (M - 1).
    w = sequence_weights("bnpo", [0, 0, 5, 5], [0, 0, 1, 1])
    assert w.tolist() == [0.0, 0.0, 0.05, 0.05]
