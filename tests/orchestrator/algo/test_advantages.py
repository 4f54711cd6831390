"""Advantage estimators against hand-computed values (orchestrator/algo/advantages.py)."""

from __future__ import annotations

import math
import statistics

import pytest
from algo_helpers import groups, trajectory

from orchestrator.algo.advantages import (
    BatchWhitened,
    GroupNorm,
    LeaveOneOut,
    NormalizeThenSum,
)
from orchestrator.errors import ConfigError
from orchestrator.types import Group

REWARDS = [[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]]


def approx(values: list[list[float]]) -> object:
    return [pytest.approx(v, abs=1e-6) for v in values]


def test_grpo_divides_by_each_groups_std() -> None:
    # group 1: mean 0.5, std 0.5; group 2: mean 0.25, std sqrt(3)/4
    s = math.sqrt(3) / 4
    assert GroupNorm("group", eps=0.0)(groups(REWARDS), REWARDS) == approx(
        [[1, -1, -1, 1], [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s], [0, 0, 0, 0]])


def test_dr_grpo_only_centres() -> None:
    assert GroupNorm("none")(groups(REWARDS), REWARDS) == approx(
        [[0.5, -0.5, -0.5, 0.5], [0.75, -0.25, -0.25, -0.25], [0, 0, 0, 0]])


def test_litePPO_divides_by_the_std_of_the_live_groups_rewards() -> None:
    live = [r for g in REWARDS[:2] for r in g]
    std = statistics.pstdev(live)
    out = GroupNorm("batch", eps=0.0)(groups(REWARDS), REWARDS)
    assert out == approx([[0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std],
                          [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], [0, 0, 0, 0]])


def test_rloo_baseline_is_the_others_mean() -> None:
    out = LeaveOneOut()(groups(REWARDS), REWARDS)
    # sample 0 of group 2: 1 - mean(0, 0, 0) = 1; sample 1: 0 - mean(1, 0, 0) = -1/3
    assert out == approx([[1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3],
                          [1.0, -1 / 3, -1 / 3, -1 / 3], [0, 0, 0, 0]])


def test_reinforce_pp_whitens_the_centred_rewards_over_the_batch() -> None:
    centred = [0.5, -0.5, -0.5, 0.5, 0.75, -0.25, -0.25, -0.25]
    mean, std = statistics.fmean(centred), statistics.pstdev(centred)
    expected = [(c - mean) / std for c in centred]
    out = BatchWhitened(eps=0.0)(groups(REWARDS), REWARDS)
    assert out == approx([expected[:4], expected[4:], [0, 0, 0, 0]])


def test_equal_rewards_give_exactly_zero_for_every_estimator() -> None:
    rewards = [[0.7] * 4, [0.0] * 3]
    for estimator in (GroupNorm("group"), GroupNorm("batch"), GroupNorm("none"), LeaveOneOut(),
                      BatchWhitened(), NormalizeThenSum()):
        assert estimator(groups(rewards), rewards) == [[0.0] * 4, [0.0] * 3], estimator


def test_gdpo_normalises_each_part_before_the_sum() -> None:
    # part "math" is 0/1, part "format" 0/0.1: summed first, "format" would barely count
    parts = [({"reward/math": 1.0, "reward/format": 0.0}), ({"reward/math": 0.0, "reward/format": 0.1}),
             ({"reward/math": 1.0, "reward/format": 0.1}), ({"reward/math": 0.0, "reward/format": 0.0})]
    group = Group(0, tuple(trajectory(p["reward/math"] + p["reward/format"], i, metrics=p)
                           for i, p in enumerate(parts)), 0)
    rewards = [list(group.rewards)]
    out = NormalizeThenSum(whiten=False, eps=0.0)([group], rewards)
    # each part normalised: math -> [1, -1, 1, -1], format -> [-1, 1, 1, -1]
    assert out == approx([[0.0, 0.0, 2.0, -2.0]])
    weighted = NormalizeThenSum(weights={"format": 0.5}, whiten=False, eps=0.0)([group], rewards)
    assert weighted == approx([[0.5, -0.5, 1.5, -1.5]])


def test_gdpo_rejects_a_weight_for_a_term_the_environment_has_not() -> None:
    group = Group(0, (trajectory(1.0, 0, metrics={"reward/math": 1.0}),
                      trajectory(0.0, 1, metrics={"reward/math": 0.0})), 0)
    with pytest.raises(ConfigError, match="algo.advantage.weights names \\['fromat'\\]"):
        NormalizeThenSum(weights={"fromat": 1.0})([group], [[1.0, 0.0]])


def test_a_bad_std_setting_names_the_key() -> None:
    with pytest.raises(ConfigError, match="algo.advantage.std"):
        GroupNorm("grup")
