"""The KL estimators (orchestrator/algo/regularizers.py): verl's ``low_var_kl``, the
straight-through ``+`` forms, each estimator's expected gradient on a small categorical
distribution by exact expectation, and the KL in the reward with the chosen estimator."""

from __future__ import annotations

import math

import pytest
import torch
from algo_helpers import loss_inputs

from orchestrator.algo.composed import PolicyGradient
from orchestrator.algo.regularizers import ESTIMATORS, KL, kl_estimate
from orchestrator.errors import ConfigError


def one(logp: float, ref: float, estimator: str) -> float:
    return float(kl_estimate(torch.tensor([logp], dtype=torch.float64),
                             torch.tensor([ref], dtype=torch.float64), estimator))


def test_low_var_kl_is_verls_form() -> None:
    # d = ref - logp clamped to [-20, 20], k3 of it, the result clamped to [-10, 10]
    assert one(0.0, -15.0, "low_var_kl") == 10.0  # k3(-15) = 14.0000003, clamped
    assert one(0.0, -9.0, "low_var_kl") == pytest.approx(math.exp(-9) - 1 + 9)
    assert one(0.0, -40.0, "low_var_kl") == 10.0
    assert one(0.0, 30.0, "low_var_kl") == 10.0
    assert one(0.0, 2.0, "low_var_kl") == pytest.approx(math.exp(2) - 1 - 2)


@pytest.mark.parametrize("estimator", ["k3+", "low_var_kl+"])
def test_straight_through_forms_have_the_value_of_their_base_and_the_gradient_of_k2(
        estimator: str) -> None:
    logp = torch.tensor([-1.0, -2.0, -0.3, 0.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.3, -15.0], dtype=torch.float64)
    value = kl_estimate(logp, ref, estimator)
    base = kl_estimate(logp.detach(), ref, estimator.removesuffix("+"))
    assert value.tolist() == base.tolist()
    value.sum().backward()
    assert logp.grad.tolist() == pytest.approx((logp - ref).detach().tolist())  # d/dlogp of k2


def _categorical_expected_gradients(estimator: str) -> tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor]:
    """E_{x ~ pi}[grad k(x)] by enumerating the tokens (the sample is not differentiated),
    and the exact grad KL(pi || ref) and grad KL(ref || pi), all with respect to the logits."""
    theta = torch.tensor([0.3, -1.2, 0.8, 0.1, -0.4], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([-0.5, 0.4, 0.2, -1.0, 0.9], dtype=torch.float64), 0)
    logp = torch.log_softmax(theta, 0)
    pi = logp.exp().detach()
    (expected,) = torch.autograd.grad((pi * kl_estimate(logp, ref, estimator)).sum(), theta)
    logp = torch.log_softmax(theta, 0)
    (forward,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)
    logp = torch.log_softmax(theta, 0)
    (reverse,) = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), theta)
    return expected, forward, reverse


def test_expected_gradients_of_the_kl_estimators() -> None:
    expected, forward, reverse = _categorical_expected_gradients("k1")
    assert forward.abs().max() > 0.05 and (forward - reverse).abs().max() > 0.05
    assert torch.allclose(expected, torch.zeros_like(expected), atol=1e-12)  # k1: nothing
    for estimator in ("k2", "k3+", "low_var_kl+"):  # the gradient of KL(pi || ref)
        expected, forward, _ = _categorical_expected_gradients(estimator)
        assert torch.allclose(expected, forward, atol=1e-12), estimator
    for estimator in ("k3", "low_var_kl"):  # the reverse KL's gradient, KL(ref || pi)
        expected, _, reverse = _categorical_expected_gradients(estimator)
        assert torch.allclose(expected, reverse, atol=1e-12), estimator


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_kl_in_the_reward_is_each_sequences_sum_of_the_chosen_estimator(estimator: str) -> None:
    algo = PolicyGradient(kl=KL(coef=0.1, estimator=estimator, in_reward=True))
    logp, ref = [[-1.0, -2.0], [-0.5, 0.0]], [[-1.5, -1.0], [-0.5, -0.7]]
    li, _ = loss_inputs(logp, reference=ref, mask=[[1, 1], [1, 0]])
    expected = [0.1 * (one(logp[0][0], ref[0][0], estimator) + one(logp[0][1], ref[0][1], estimator)),
                0.1 * one(logp[1][0], ref[1][0], estimator)]
    assert algo.reward_penalty(li).tolist() == pytest.approx(expected)


def test_kl_in_the_reward_is_not_k1_when_k3_is_asked() -> None:
    algo = PolicyGradient(kl=KL(coef=1.0, estimator="k3", in_reward=True))
    li, _ = loss_inputs([[-1.0]], reference=[[-2.0]])
    # d = -1: k3 = exp(-1) - 1 + 1 = 0.368, where k1 would be 1
    assert float(algo.reward_penalty(li)[0]) == pytest.approx(math.exp(-1.0))


def test_an_unknown_kl_estimator_lists_every_name() -> None:
    with pytest.raises(ConfigError, match="algo.kl.estimator must be one of") as caught:
        KL(estimator="k4")
    for name in ("k1", "k2", "k3", "low_var_kl", "k3+", "low_var_kl+"):
        assert name in str(caught.value)
    assert "\n" not in str(caught.value)
