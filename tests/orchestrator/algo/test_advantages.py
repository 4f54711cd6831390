"""Advantage estimators against hand-computed values (orchestrator/algo/advantages.py)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from algo_helpers import groups, trajectory
from helpers import quick_config

from envs.base import RewardTerm
from orchestrator.algo.advantages import (
    BatchWhitened,
    GroupNorm,
    LeaveOneOut,
    NormalizeThenSum,
)
from orchestrator.algo.composed import PolicyGradient
from orchestrator.algo.regularizers import KL
from orchestrator.builders import run
from orchestrator.errors import ConfigError
from orchestrator.types import Group

REWARDS = [[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]]


def approx(values: list[list[float]]) -> object:
    return [pytest.approx(v, abs=1e-6) for v in values]


def flat(values: list[list[float]]) -> list[float]:
    return [v for g in values for v in g]


def test_grpo_divides_by_each_groups_sample_std() -> None:
    # group 1: mean 0.5, sample std sqrt(1/3); group 2: mean 0.25, sample std 0.5
    s1, s2 = statistics.stdev(REWARDS[0]), statistics.stdev(REWARDS[1])
    assert GroupNorm("group", eps=0.0)(groups(REWARDS), REWARDS) == approx(
        [[0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1],
         [0.75 / s2, -0.25 / s2, -0.25 / s2, -0.25 / s2], [0, 0, 0, 0]])


def test_grpo_one_right_in_four_gets_verl_and_trls_1_5() -> None:
    # sample std (n - 1) as verl and TRL: 1.5; the population std would give sqrt(3) = 1.732
    out = GroupNorm("group", eps=0.0)(groups([[1.0, 0.0, 0.0, 0.0]]), [[1.0, 0.0, 0.0, 0.0]])
    assert out == approx([[1.5, -0.5, -0.5, -0.5]])


def test_dr_grpo_only_centres() -> None:
    assert GroupNorm("none")(groups(REWARDS), REWARDS) == approx(
        [[0.5, -0.5, -0.5, 0.5], [0.75, -0.25, -0.25, -0.25], [0, 0, 0, 0]])


def test_litePPO_divides_by_the_sample_std_of_every_reward_of_the_batch() -> None:
    # every reward, the all-equal group's included (ROLL, TRL)
    std = statistics.stdev(flat(REWARDS))
    out = GroupNorm("batch", eps=0.0)(groups(REWARDS), REWARDS)
    assert out == approx([[0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std],
                          [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], [0, 0, 0, 0]])


def test_rloo_baseline_is_the_others_mean() -> None:
    out = LeaveOneOut()(groups(REWARDS), REWARDS)
    # sample 0 of group 2: 1 - mean(0, 0, 0) = 1; sample 1: 0 - mean(1, 0, 0) = -1/3
    assert out == approx([[1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3],
                          [1.0, -1 / 3, -1 / 3, -1 / 3], [0, 0, 0, 0]])


def test_reinforce_pp_baseline_whitens_the_centred_rewards_over_every_sample() -> None:
    # OpenRLHF's reinforce_baseline: the all-equal group's zeros count in the statistics
    centred = [0.5, -0.5, -0.5, 0.5, 0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]
    mean, std = statistics.fmean(centred), statistics.pstdev(centred)
    expected = [(c - mean) / std for c in centred]
    out = BatchWhitened(eps=0.0)(groups(REWARDS), REWARDS)
    assert out == approx([expected[:4], expected[4:8], [0, 0, 0, 0]])
    assert out[2] == [0.0] * 4  # exactly


def test_reinforce_pp_without_baseline_whitens_the_raw_rewards_over_the_batch() -> None:
    rewards = [[1.0, 1.0], [0.0, 1.0]]  # mean 0.75, population std sqrt(3) / 4
    out = BatchWhitened(group_baseline=False, eps=0.0)(groups(rewards), rewards)
    assert out == approx([[1 / 3 ** 0.5, 1 / 3 ** 0.5], [-(3 ** 0.5), 1 / 3 ** 0.5]])


def test_reinforce_pp_without_baseline_works_at_group_size_one() -> None:
    rewards = [[1.0], [0.0], [1.0], [0.0]]
    estimator = BatchWhitened(group_baseline=False, eps=0.0)
    assert estimator(groups(rewards), rewards) == approx([[1.0], [-1.0], [1.0], [-1.0]])
    estimator.check(1)  # no group baseline: group size 1 is its design case


def test_equal_rewards_give_exactly_zero_for_every_group_baseline() -> None:
    rewards = [[0.7] * 4, [0.0] * 3]
    for estimator in (GroupNorm("group"), GroupNorm("batch"), GroupNorm("none"), LeaveOneOut(),
                      BatchWhitened(), NormalizeThenSum()):
        assert estimator(groups(rewards), rewards) == [[0.0] * 4, [0.0] * 3], estimator


def test_without_a_baseline_only_an_all_equal_batch_is_exactly_zero() -> None:
    estimator = BatchWhitened(group_baseline=False)
    mixed = [[0.7] * 4, [0.0] * 3]  # each group equal, the batch not: 0.7 beats 0.0
    out = estimator(groups(mixed), mixed)
    assert out[0][0] > 0 > out[1][0]
    same = [[0.7] * 4, [0.7] * 3]
    assert estimator(groups(same), same) == [[0.0] * 4, [0.0] * 3]


# -- GDPO: reward terms, typed ---------------------------------------------------------------

WEIGHTS = {"math": 1.0, "format": 0.1}
MATH, FORMAT = [1.0, 0.0, 1.0, 0.0], [0.0, 0.1, 0.1, 0.0]


def termed(math: list[float], fmt: list[float], prompt: int = 0,
           weights: dict[str, float] = WEIGHTS,
           metrics: dict[str, float] | None = None) -> Group:
    samples = []
    for i, (m, f) in enumerate(zip(math, fmt, strict=True)):
        terms = (RewardTerm("math", weights["math"], m), RewardTerm("format", weights["format"], f))
        total = sum(t.weight * t.value for t in terms)
        samples.append(trajectory(total, i, terms=terms, metrics={
            "reward/math": m, "reward/format": f, **(metrics or {})}))
    return Group(prompt, tuple(samples), 0)


def normalised(values: list[float]) -> list[float]:
    mean, std = statistics.fmean(values), statistics.stdev(values)
    return [(v - mean) / std for v in values]


def test_gdpo_normalises_each_term_then_sums_with_env_reward_weights() -> None:
    group = termed(MATH, FORMAT)
    out = NormalizeThenSum(whiten=False, eps=0.0)([group], [list(group.rewards)])
    expected = [1.0 * m + 0.1 * f for m, f in zip(normalised(MATH), normalised(FORMAT),
                                                     strict=True)]
    assert out == approx([expected])
    # algo.advantage.weights overrides env.reward's by name
    out = NormalizeThenSum(weights={"format": 1.0}, whiten=False, eps=0.0)(
        [group], [list(group.rewards)])
    assert out == approx([[m + f for m, f in zip(normalised(MATH), normalised(FORMAT),
                                                 strict=True)]])


def test_gdpo_whitens_the_sum_over_every_sample_with_the_sample_std() -> None:
    live, flat_ = termed(MATH, FORMAT), termed([1.0] * 4, [0.1] * 4, prompt=1)
    batch = [live, flat_]
    summed = NormalizeThenSum(whiten=False, eps=0.0)(batch, [list(g.rewards) for g in batch])
    values = flat(summed)
    mean, std = statistics.fmean(values), statistics.stdev(values)
    out = NormalizeThenSum(eps=0.0)(batch, [list(g.rewards) for g in batch])
    assert out == approx([[(v - mean) / std for v in summed[0]], [0.0] * 4])
    assert out[1] == [0.0] * 4  # exactly


def test_gdpo_never_takes_a_diagnostic_for_a_term() -> None:
    # reasoning-gym's reward is one number; exact_match, tagged and verifier_error are logged
    # beside it: a wrong answer that hit a verifier error is one more wrong answer
    score, error = [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]
    group = Group(0, tuple(trajectory(s, i, metrics={
        "reward/score": s, "reward/exact_match": s, "reward/tagged": 1.0,
        "reward/verifier_error": e}) for i, (s, e) in enumerate(zip(score, error, strict=True))),
        0)
    out = NormalizeThenSum(whiten=False, eps=0.0)([group], [score])
    assert out == approx([[1.5, -0.5, -0.5, -0.5]])


def test_gdpo_keeps_the_kl_coefficients_effect() -> None:
    batch = [termed(MATH, FORMAT), termed([0.0, 1.0, 1.0, 1.0], [0.1, 0.1, 0.0, 0.0], prompt=1)]
    kl_sums = [[1.0, 4.0, 2.0, 3.0], [2.0, 0.5, 3.0, 1.0]]  # each sequence's summed estimate
    outs = {}
    for coef in (0.001, 0.1):
        algo = PolicyGradient(advantage=NormalizeThenSum(), kl=KL(coef=coef, in_reward=True))
        penalties = [[coef * k for k in g] for g in kl_sums]
        outs[coef] = flat(algo.advantages(batch, penalties).values)
    assert max(abs(a - b) for a, b in zip(outs[0.001], outs[0.1], strict=True)) > 0.1
    # the penalty is centred in its group and added unscaled, before whitening
    summed = NormalizeThenSum(whiten=False, eps=0.0)(batch, [list(g.rewards) for g in batch])
    assert NormalizeThenSum(whiten=False, eps=0.0)(
        batch, [[r - 0.1 * k for r, k in zip(g.rewards, ks, strict=True)]
                for g, ks in zip(batch, kl_sums, strict=True)]) == approx(
        [[s - 0.1 * (k - statistics.fmean(ks)) for s, k in zip(ss, ks, strict=True)]
         for ss, ks in zip(summed, kl_sums, strict=True)])


def test_gdpo_without_terms_normalises_the_total() -> None:
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]]
    out = NormalizeThenSum(whiten=False, eps=0.0)(groups(rewards), rewards)
    assert out == approx([normalised(r) for r in rewards])


def test_gdpo_rejects_a_weight_for_a_term_the_environment_has_not() -> None:
    with pytest.raises(ConfigError, match="algo.advantage.weights names \\['fromat'\\]"):
        NormalizeThenSum(weights={"fromat": 1.0})([termed(MATH, FORMAT)], [[1.0, 0.0, 0.0, 0.0]])


def test_a_bad_std_setting_names_the_key() -> None:
    with pytest.raises(ConfigError, match="algo.advantage.std"):
        GroupNorm("grup")


# -- a group baseline at group size 1 ------------------------------------------------------------


@pytest.mark.parametrize("estimator", [GroupNorm("group"), GroupNorm("batch"), GroupNorm("none"),
                                       LeaveOneOut(), BatchWhitened(), NormalizeThenSum()])
def test_a_group_baseline_at_group_size_one_is_one_line(estimator: object) -> None:
    algo = PolicyGradient(advantage=estimator)
    algo.check(2)
    with pytest.raises(ConfigError, match=r"rollout\.group_size >= 2") as caught:
        algo.check(1)
    assert "group_baseline: false" in str(caught.value) and "\n" not in str(caught.value)


def test_a_run_with_a_group_baseline_at_group_size_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"algo\.advantage=GroupNorm\(std=group\) needs "
                                          r"rollout\.group_size >= 2"):
        run(quick_config("smoke", "rollout.group_size=1"), tmp_path)
