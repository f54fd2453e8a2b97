"""Group advantages against a direct per-group computation."""

import statistics

import pytest
import torch

from qerl_cli.errors import BadInputError
from qerl_cli.train.advantages import group_advantages


def _direct(rewards, groups, scale, eps=1e-4):
    out = []
    all_std = statistics.stdev(rewards)
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        mean = sum(members) / len(members)
        std = statistics.stdev(members)
        if scale == "group":
            out.append((r - mean) / (std + eps))
        elif scale == "batch":
            out.append((r - mean) / (all_std + eps))
        else:
            out.append(r - mean)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_matches_direct_formula_with_interleaved_groups(scale):
    rewards = [1.0, 0.0, 0.5, 1.0, 1.0, 0.0, 0.25, 1.0, 1.0]
    groups = ["a", "b", "a", "c", "b", "a", "c", "c", "b"]
    adv = group_advantages(rewards, groups, scale=scale)
    assert torch.allclose(adv.values, torch.tensor(_direct(rewards, groups, scale), dtype=torch.float32), atol=1e-6)
    assert adv.num_groups == 3
    assert adv.group_index.tolist() == [0, 1, 0, 2, 1, 0, 2, 2, 1]


def test_zero_variance_groups_get_zero_advantage_and_are_counted():
    adv = group_advantages([1, 1, 0, 1, 0.5, 0.5], ["x", "x", "y", "y", "z", "z"])
    assert adv.values[[0, 1, 4, 5]].abs().max() == 0
    assert adv.zero_variance_fraction == pytest.approx(2 / 3)
    assert adv.values[2] < 0 < adv.values[3]


def test_group_of_one_is_refused_and_named():
    with pytest.raises(BadInputError, match="group 'lonely' has only one completion"):
        group_advantages([1.0, 0.0, 1.0], ["g", "g", "lonely"], where="shards/")


def test_non_finite_reward_and_bad_scale_are_refused():
    with pytest.raises(BadInputError, match="reward of completion 1"):
        group_advantages([1.0, float("nan")], ["g", "g"])
    with pytest.raises(BadInputError, match="--scale-rewards"):
        group_advantages([1.0, 0.0], ["g", "g"], scale="rank")


def test_equal_rewards_that_floats_cannot_average_exactly_are_zero_variance():
    # (0.1 + 0.1 + 0.1) / 3 != 0.1: the group's std came out ~1e-17, its advantages ~1e-13, and it was
    # not counted as a zero-variance group.
    for scale in ("group", "batch", "none"):
        adv = group_advantages([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.2, 0.9, 0.3], ["a"] * 3 + ["b"] * 3 + ["c"] * 3,
                               scale=scale)
        assert adv.values[:6].abs().max() == 0, scale
        assert adv.zero_variance_fraction == pytest.approx(2 / 3)
