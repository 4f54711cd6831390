"""GRPO advantages and the decoupled PPO loss (orchestrator/algo/grpo.py)."""

from __future__ import annotations

import math

import pytest
import torch

from orchestrator.algo.advantages import GroupNorm
from orchestrator.algo.base import LossInputs, LossOutput
from orchestrator.algo.grpo import GRPO
from orchestrator.types import FinishReason, Group, Trajectory

EPS_LOW, EPS_HIGH, CAP = 0.2, 0.28, 5.0


def inputs(
    logprobs: list[list[float]],
    proximal: list[list[float]] | None = None,
    behaviour: list[list[float]] | None = None,
    advantages: list[list[float]] | None = None,
    mask: list[list[float]] | None = None,
    num_tokens: float | None = None,
) -> tuple[LossInputs, torch.Tensor]:
    """LossInputs from nested lists; returns the logprobs leaf tensor (requires grad) too."""
    logp = torch.tensor(logprobs, dtype=torch.float64, requires_grad=True)
    prox = torch.tensor(proximal if proximal is not None else logprobs, dtype=torch.float64)
    behav = torch.tensor(behaviour if behaviour is not None else proximal or logprobs,
                         dtype=torch.float64)
    adv = torch.tensor(advantages if advantages is not None else [[1.0] * len(logprobs[0])] * len(logprobs),
                       dtype=torch.float64)
    m = torch.tensor(mask if mask is not None else [[1.0] * len(logprobs[0])] * len(logprobs),
                     dtype=torch.float64)
    n = float(m.sum()) if num_tokens is None else num_tokens
    return LossInputs(logp, prox, behav, adv, m, n), logp


def groups(rewards: list[list[float]]) -> list[Group]:
    return [Group(g, tuple(Trajectory(g, i, (1, 2), (False, True), (0.0, -1.0), (0, 0), r, 0,
                                      FinishReason.STOP) for i, r in enumerate(rs)), 0)
            for g, rs in enumerate(rewards)]


def loss_of(li: LossInputs) -> LossOutput:
    return GRPO(EPS_LOW, EPS_HIGH, CAP).loss(li)


def group_advantages(rewards: list[float], normalize_std: bool = True,
                     eps: float = 1e-6) -> list[float]:
    """One group's advantages as GRPO computes them (``normalize_std=False``: Dr. GRPO's)."""
    return GroupNorm("group" if normalize_std else "none", eps)([], [rewards])[0]


# -- on-policy ---------------------------------------------------------------------------


def test_on_policy_ratio_and_weight_are_exactly_one() -> None:
    lp = [[-0.5, -1.2, -2.0], [-0.1, -3.0, -0.7]]
    li, _ = inputs(lp, lp, lp, advantages=[[1.0] * 3, [-0.5] * 3])
    out = loss_of(li)
    assert out.metrics["ratio"] == 1.0
    assert out.metrics["importance_weight"] == 1.0
    assert out.metrics["kl_to_behaviour"] == 0.0
    assert out.metrics["clip_fraction"] == 0.0
    assert out.metrics["truncated_fraction"] == 0.0
    # ratio 1, weight 1: the loss is minus the mean advantage per token
    assert out.loss.item() == pytest.approx(-(3 * 1.0 + 3 * -0.5) / 6, abs=1e-12)


def test_on_policy_gradient_is_minus_advantage_over_tokens() -> None:
    lp = [[-0.5, -1.2, -2.0]]
    li, logp = inputs(lp, lp, lp, advantages=[[2.0, 2.0, 2.0]])
    loss_of(li).loss.backward()
    assert torch.allclose(logp.grad, torch.full((1, 3), -2.0 / 3, dtype=torch.float64))


# -- clipping ------------------------------------------------------------------------------


def _grad_of_one_token(ratio: float, advantage: float) -> tuple[float, float]:
    prox = -1.0
    li, logp = inputs([[prox + math.log(ratio)]], [[prox]], [[prox]], advantages=[[advantage]])
    out = loss_of(li)
    out.loss.backward()
    return float(logp.grad[0, 0]), out.metrics["clip_fraction"]


def test_positive_advantage_above_upper_clip_has_zero_gradient() -> None:
    grad, clipped = _grad_of_one_token(ratio=1.0 + EPS_HIGH + 0.2, advantage=1.0)
    assert grad == 0.0
    assert clipped == 1.0


def test_negative_advantage_below_lower_clip_has_zero_gradient() -> None:
    grad, clipped = _grad_of_one_token(ratio=1.0 - EPS_LOW - 0.2, advantage=-1.0)
    assert grad == 0.0
    assert clipped == 1.0


@pytest.mark.parametrize(("ratio", "advantage"), [
    (1.1, 1.0),    # inside the trust region
    (0.9, -1.0),
    (1.0 + EPS_HIGH - 0.01, 1.0),
    (1.0 - EPS_LOW + 0.01, -1.0),
    # the pessimistic side is never clipped: moving away from the region still gets a gradient
    (1.0 + EPS_HIGH + 0.2, -1.0),
    (1.0 - EPS_LOW - 0.2, 1.0),
])
def test_gradient_flows_where_not_clipped(ratio: float, advantage: float) -> None:
    grad, clipped = _grad_of_one_token(ratio, advantage)
    # d/dlogp of -A * ratio is -A * ratio (weight 1, one token)
    assert grad == pytest.approx(-advantage * ratio, rel=1e-9)
    assert clipped == 0.0


def test_clip_asymmetry_uses_eps_high_above_and_eps_low_below() -> None:
    # 1.25 is above 1 + eps_low but below 1 + eps_high: not clipped for a positive advantage
    grad, _ = _grad_of_one_token(1.25, 1.0)
    assert grad != 0.0
    # 0.78 is below 1 - eps_low: clipped for a negative advantage
    grad, _ = _grad_of_one_token(0.78, -1.0)
    assert grad == 0.0


# -- importance weights and truncation --------------------------------------------------


def test_importance_weight_is_truncated_at_the_cap() -> None:
    prox = [[-1.0, -1.0]]
    behaviour = [[-1.0 - math.log(10.0), -1.0 - math.log(2.0)]]  # weights 10 and 2
    li, logp = inputs(prox, prox, behaviour, advantages=[[1.0, 1.0]])
    out = loss_of(li)
    # ratio 1: per-token loss -A * w with w = min(10, 5) and 2
    assert out.loss.item() == pytest.approx(-(CAP + 2.0) / 2, rel=1e-9)
    assert out.metrics["truncated_fraction"] == pytest.approx(0.5)
    assert out.metrics["importance_weight"] == pytest.approx((10.0 + 2.0) / 2, rel=1e-9)
    out.loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(-CAP / 2, rel=1e-9)
    assert logp.grad[0, 1].item() == pytest.approx(-2.0 / 2, rel=1e-9)


def test_weight_below_one_is_not_raised() -> None:
    prox = [[-2.0]]
    behaviour = [[-2.0 + math.log(4.0)]]  # behaviour more likely than proximal: w = 0.25
    li, _ = inputs(prox, prox, behaviour, advantages=[[1.0]])
    out = loss_of(li)
    assert out.loss.item() == pytest.approx(-0.25, rel=1e-9)
    assert out.metrics["truncated_fraction"] == 0.0
    assert out.metrics["kl_to_behaviour"] > 0.0


# -- aggregation ---------------------------------------------------------------------------


def test_token_level_aggregation_weighs_every_token_equally() -> None:
    # a long (3 tokens) and a short (1 token) sequence, right-padded; masked tokens hold junk
    lp = [[-1.0, -1.0, -1.0], [-1.0, -7.0, -9.0]]
    mask = [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    adv = [[1.0, 1.0, 1.0], [-3.0, -3.0, -3.0]]
    li, logp = inputs(lp, lp, lp, advantages=adv, mask=mask)
    out = loss_of(li)
    # sum over tokens / 4 tokens, not the mean of per-sequence means ((-1) + 3) / 2
    assert out.loss.item() == pytest.approx((3 * -1.0 + 1 * 3.0) / 4, rel=1e-12)
    out.loss.backward()
    expected = torch.tensor([[-0.25, -0.25, -0.25], [0.75, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(logp.grad, expected)


def test_num_tokens_is_the_normaliser_not_the_local_mask() -> None:
    # a micro-batch of a larger minibatch: normalised by the minibatch's token count
    lp = [[-1.0, -1.0]]
    li, _ = inputs(lp, lp, lp, advantages=[[1.0, 1.0]], num_tokens=8.0)
    assert loss_of(li).loss.item() == pytest.approx(-2.0 / 8.0)


# -- advantages ------------------------------------------------------------------------------


@pytest.mark.parametrize("reward", [0.0, 1.0, 0.5, 0.1, 0.7, -2.0])
@pytest.mark.parametrize("n", [2, 3, 7, 8])
def test_equal_rewards_give_exactly_zero_advantages(reward: float, n: int) -> None:
    assert group_advantages([reward] * n) == [0.0] * n
    assert group_advantages([reward] * n, normalize_std=False) == [0.0] * n


@pytest.mark.parametrize("rewards", [
    [0.0, 1.0],
    [0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0],
    [0.3, -1.2, 4.0, 2.5, 0.0],
    [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
])
def test_group_advantages_are_zero_mean_unit_sample_std(rewards: list[float]) -> None:
    adv = torch.tensor(group_advantages(rewards), dtype=torch.float64)
    assert adv.mean().item() == pytest.approx(0.0, abs=1e-12)
    # the sample std (n - 1), as verl and TRL
    assert adv.std(unbiased=True).item() == pytest.approx(1.0, abs=1e-5)
    # order is kept: the best sample gets the largest advantage
    assert int(adv.argmax()) == rewards.index(max(rewards))


def test_one_right_in_four_gets_1_5_as_in_verl_and_trl() -> None:
    # the population std would give sqrt(3) = 1.732
    assert group_advantages([1.0, 0.0, 0.0, 0.0], eps=0.0) == pytest.approx([1.5, -0.5, -0.5, -0.5])


def test_group_advantages_without_std_normalisation_are_centred_rewards() -> None:
    assert group_advantages([1.0, 0.0, 0.0, 1.0], normalize_std=False) == [0.5, -0.5, -0.5, 0.5]


def test_grpo_advantages_are_per_group() -> None:
    algo = GRPO()
    adv = algo.advantages(groups([[1.0, 0.0], [5.0, 5.0, 5.0]])).values
    assert len(adv) == 2 and len(adv[0]) == 2 and len(adv[1]) == 3
    assert adv[0][0] > 0 > adv[0][1]
    assert adv[1] == [0.0, 0.0, 0.0]


def test_grpo_loss_uses_its_settings() -> None:
    algo = GRPO(eps_low=0.1, eps_high=0.1, importance_cap=2.0)
    prox = [[-1.0]]
    li, _ = inputs([[-1.0 + math.log(1.15)]], prox, [[-1.0 - math.log(3.0)]], advantages=[[1.0]])
    out = algo.loss(li)
    # ratio 1.15 clipped to 1.1, weight 3 truncated to 2
    assert out.loss.item() == pytest.approx(-1.1 * 2.0, rel=1e-9)
    assert out.metrics["clip_fraction"] == 1.0
    assert out.metrics["truncated_fraction"] == 1.0


@pytest.mark.parametrize("kwargs", [{"eps_low": -0.1}, {"eps_high": -0.1}, {"importance_cap": 0.5}])
def test_grpo_rejects_bad_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        GRPO(**kwargs)
