"""Group-relative advantages and reward stats against numpy, group by group."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_rl.rl.advantages import group_advantages, reward_stats, zero_std_groups

torch.set_num_threads(1)

REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.1, 0.1, 0.1, 0.1], [0.0, 0.5, 2.0, 1.0], [3.0, 3.0, 3.0, 2.0]]


def test_advantages_match_numpy_with_unbiased_std():
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    adv = group_advantages(rewards, eps=1e-6).numpy()
    for i, group in enumerate(np.array(REWARDS)):
        if group.std() == 0:
            continue
        expected = (group - group.mean()) / (group.std(ddof=1) + 1e-6)
        np.testing.assert_allclose(adv[i], expected, rtol=1e-12)


def test_advantages_without_std_are_centred_rewards():
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    adv = group_advantages(rewards, scale_by_std=False).numpy()
    np.testing.assert_allclose(adv, np.array(REWARDS) - np.array(REWARDS).mean(axis=1, keepdims=True), atol=1e-15)


def test_each_group_is_centred_with_unit_sample_std():
    rewards = torch.randn(5, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    adv = group_advantages(rewards, eps=0.0)
    np.testing.assert_allclose(adv.sum(dim=1).numpy(), 0.0, atol=1e-12)
    np.testing.assert_allclose(adv.std(dim=1).numpy(), 1.0, rtol=1e-12)


def test_zero_std_groups_get_exactly_zero_advantage():
    rewards = torch.tensor(REWARDS, dtype=torch.float32)
    assert zero_std_groups(rewards).tolist() == [False, True, False, False]
    for scale in (True, False):
        assert torch.equal(group_advantages(rewards, scale_by_std=scale)[1], torch.zeros(4))


def test_equal_rewards_whose_float_mean_drifts_still_get_zero():
    rewards = torch.full((1, 7), 0.1)  # in float32 their mean is 0.1 - 7e-9, and 7e-9 / 1e-6 is not small
    assert torch.equal(group_advantages(rewards), torch.zeros(1, 7))


def test_reward_stats_follow_trl():
    stats = reward_stats(torch.tensor(REWARDS))
    groups = np.array(REWARDS)
    assert stats["reward"] == pytest.approx(groups.mean())
    assert stats["reward_std"] == pytest.approx(groups.std(axis=1, ddof=1).mean(), rel=1e-6)
    assert stats["frac_reward_zero_std"] == 0.25
    assert all(type(v) is float for v in stats.values())


def test_integer_rewards_are_accepted():
    adv = group_advantages(torch.tensor([[1, 0], [1, 1]]))
    assert adv.dtype == torch.float32 and adv[0, 0] > 0 > adv[0, 1] and adv[1].eq(0).all()


@pytest.mark.parametrize("shape", [(8,), (4, 1), (2, 2, 2)])
def test_bad_shapes_are_refused(shape):
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.zeros(shape))
