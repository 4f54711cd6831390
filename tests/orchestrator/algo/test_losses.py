"""Policy losses, aggregations, KL and entropy terms against hand-computed values and gradients
(orchestrator/algo/losses.py, aggregation.py, regularizers.py, composed.py)."""

from __future__ import annotations

import math

import pytest
import torch
from algo_helpers import loss_inputs

from orchestrator.algo.aggregation import aggregate
from orchestrator.algo.composed import PolicyGradient
from orchestrator.algo.losses import CISPO, GSPO, SAPO, PPOClip, cannot_act
from orchestrator.algo.regularizers import KL, kl_estimate
from orchestrator.errors import ConfigError


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def one_token(ratio: float, advantage: float, loss: object) -> tuple[float, float, dict]:
    """The per-token loss and its gradient for one token at ``ratio`` to ``old``."""
    old = -1.0
    li, logp = loss_inputs([[old + math.log(ratio)]], [[old]], advantages=[advantage])
    out = loss(li, li.proximal_logprobs)
    out.loss.sum().backward()
    return float(out.loss.sum().detach()), float(logp.grad[0, 0]), out.metrics


# -- PPO clip and dual clip --------------------------------------------------------------------


def test_dual_clip_bounds_a_negative_advantages_loss() -> None:
    value, grad, metrics = one_token(5.0, -1.0, PPOClip(0.2, 0.28, dual_clip=3.0))
    assert value == pytest.approx(3.0) and grad == 0.0
    assert float(metrics["dual_clip_fraction"]) == 1.0
    value, grad, _ = one_token(2.0, -1.0, PPOClip(0.2, 0.28, dual_clip=3.0))
    assert value == pytest.approx(2.0) and grad == pytest.approx(2.0)  # d(-A r)/dlog pi = -A r
    value, grad, _ = one_token(5.0, -1.0, PPOClip(0.2, 0.28))  # without: unbounded
    assert value == pytest.approx(5.0) and grad == pytest.approx(5.0)


def test_ppo_clip_higher_is_asymmetric() -> None:
    assert one_token(1.25, 1.0, PPOClip(0.2, 0.28))[1] == pytest.approx(-1.25)  # inside 1.28
    assert one_token(1.25, 1.0, PPOClip(0.2, 0.2))[1] == 0.0  # clipped at 1.2
    assert one_token(0.75, -1.0, PPOClip(0.2, 0.28))[1] == 0.0  # clipped at 0.8


# -- GSPO ------------------------------------------------------------------------------------


def test_gspo_takes_the_sequences_mean_log_ratio() -> None:
    # log r = [0.1, -0.3]: s = exp(-0.1), inside a wide clip; every token's gradient -A s
    old = [[-1.0, -2.0]]
    li, logp = loss_inputs([[-0.9, -2.3]], old, advantages=[2.0])
    out = GSPO(0.2, 0.28)(li, li.proximal_logprobs)
    s = math.exp(-0.1)
    assert out.loss.tolist()[0] == pytest.approx([-2.0 * s, -2.0 * s])
    out.loss.sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([-2.0 * s, -2.0 * s])
    assert float(out.sequence_metrics["sequence_ratio"]) == pytest.approx(s)


def test_gspo_clips_a_whole_sequence() -> None:
    li, logp = loss_inputs([[-0.9, -1.9]], [[-1.0, -2.0]], advantages=[1.0])  # s = e^0.1
    out = GSPO()(li, li.proximal_logprobs)
    out.loss.sum().backward()
    assert logp.grad.abs().sum() == 0.0
    assert float(out.sequence_metrics["sequence_clip_fraction"]) == 1.0


# -- CISPO and SAPO -----------------------------------------------------------------------------


def test_cispo_keeps_a_clipped_tokens_gradient() -> None:
    # r = 1.5 above 1 + 0.28: weight 1.28, and the gradient is -w A, not 0 as in PPO
    _, grad, metrics = one_token(1.5, 1.0, CISPO(eps_low=1.0, eps_high=0.28))
    assert grad == pytest.approx(-1.28)
    assert float(metrics["clip_fraction"]) == 1.0
    _, grad, _ = one_token(0.5, 1.0, CISPO(eps_low=1.0, eps_high=0.28))  # no lower bound
    assert grad == pytest.approx(-0.5)
    _, grad, _ = one_token(0.5, 1.0, CISPO(eps_low=0.2, eps_high=0.28))
    assert grad == pytest.approx(-0.8)


def test_cispo_bounds_are_relative_as_in_the_paper() -> None:
    # clip(r, 1 - eps_low, 1 + eps_high): TRL's absolute cap epsilon_high=5.0 is eps_high=4.0
    _, grad, _ = one_token(6.0, 1.0, CISPO(eps_low=1.0, eps_high=4.0))
    assert grad == pytest.approx(-5.0)
    _, grad, _ = one_token(4.5, 1.0, CISPO(eps_low=1.0, eps_high=4.0))
    assert grad == pytest.approx(-4.5)


@pytest.mark.parametrize("ratio", [1.0, math.exp(0.5), math.exp(-0.7)])
@pytest.mark.parametrize("advantage", [1.5, -0.5])
def test_sapo_gate_gradient(ratio: float, advantage: float) -> None:
    tau = 1.0 if advantage >= 0 else 1.05
    value, grad, _ = one_token(ratio, advantage, SAPO(1.0, 1.05))
    g = sigmoid(tau * (ratio - 1.0))
    assert value == pytest.approx(-advantage * 4.0 / tau * g)
    assert grad == pytest.approx(-advantage * 4.0 * g * (1 - g) * ratio)  # -A at ratio 1


# -- aggregation ----------------------------------------------------------------------------


def test_the_three_aggregations() -> None:
    # sequence 1: one token of loss 3; sequence 2: three tokens of loss 1
    values = torch.tensor([[3.0, 0.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    li, _ = loss_inputs([[0.0] * 3] * 2, mask=[[1, 0, 0], [1, 1, 1]])
    assert float(aggregate(values, li, "token_mean")) == pytest.approx(6.0 / 4)
    assert float(aggregate(values, li, "sequence_mean")) == pytest.approx((3.0 + 1.0) / 2)
    assert float(aggregate(values, li, "sequence_sum", 10.0)) == pytest.approx(6.0 / (2 * 10))


def test_aggregation_normalises_by_the_whole_minibatch() -> None:
    values = torch.ones((1, 2), dtype=torch.float64)
    li, _ = loss_inputs([[0.0, 0.0]], num_tokens=8.0, num_sequences=4.0)
    assert float(aggregate(values, li, "token_mean")) == pytest.approx(2 / 8)
    assert float(aggregate(values, li, "sequence_mean")) == pytest.approx(1 / 4)
    assert float(aggregate(values, li, "sequence_sum", 2.0)) == pytest.approx(2 / (4 * 2))


def test_an_unknown_aggregation_names_the_key() -> None:
    with pytest.raises(ConfigError, match="algo.aggregation must be one of"):
        PolicyGradient(aggregation="token_sum")


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_sum"])
def test_gspo_takes_its_papers_sequence_mean_only(aggregation: str) -> None:
    with pytest.raises(ConfigError, match="algo.aggregation=sequence_mean") as caught:
        PolicyGradient(loss=GSPO(), aggregation=aggregation)
    assert str(caught.value).startswith(f"algo.aggregation={aggregation} ")
    PolicyGradient(loss=GSPO(), aggregation="sequence_mean")


def test_an_aggregation_constant_applies_to_sequence_sum_only() -> None:
    with pytest.raises(ConfigError, match="algo.aggregation_constant=16 .*sequence_sum"):
        PolicyGradient(aggregation="token_mean", aggregation_constant=16)
    PolicyGradient(aggregation="sequence_sum", aggregation_constant=16)


# -- when a loss can act ------------------------------------------------------------------------


@pytest.mark.parametrize("loss", [GSPO(), CISPO(), SAPO(), PPOClip(dual_clip=3.0)],
                         ids=["gspo", "cispo", "sapo", "dual_clip"])
def test_a_loss_whose_point_is_its_clip_cannot_act_at_one_update(loss: object) -> None:
    aggregation = "sequence_mean" if isinstance(loss, GSPO) else "token_mean"
    decoupled = PolicyGradient(loss=loss, aggregation=aggregation)
    said = cannot_act(decoupled, updates=1)
    assert said is not None and "\n" not in said
    assert said.startswith(f"algo.loss={type(loss).__name__} cannot act")
    assert "trainer.num_minibatches" in said and "algo.mode=bypass" in said
    assert cannot_act(decoupled, updates=2) is None
    assert cannot_act(PolicyGradient(loss=loss, aggregation=aggregation, mode="bypass"), 1) is None


def test_grpo_at_one_update_is_legitimate() -> None:
    assert cannot_act(PolicyGradient(loss=PPOClip()), updates=1) is None
    assert cannot_act(object(), updates=1) is None  # not composed: nothing to judge


def test_at_one_update_in_decoupled_mode_cispo_is_grpo_and_with_two_it_is_not() -> None:
    # the ratio is exactly 1 at the first update: CISPO's gradient is PPO's; at r = 1.5 not
    for ratio, same in ((1.0, True), (1.5, False)):
        _, cispo, _ = one_token(ratio, 1.0, CISPO(eps_low=1.0, eps_high=0.28))
        _, ppo, _ = one_token(ratio, 1.0, PPOClip(0.2, 0.28))
        assert (cispo == pytest.approx(ppo)) is same


# -- KL and entropy ----------------------------------------------------------------------------


def test_kl_estimators() -> None:
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    d = [-0.5, 1.0]  # ref - logp
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([x * x / 2 for x in d])
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([math.exp(x) - 1 - x for x in d])
    far = kl_estimate(torch.tensor([0.0]), torch.tensor([-40.0]), "low_var_kl")
    assert float(far) == 10.0  # verl's: d clamped to -20, k3 = 19.0 clamped to 10


def test_kl_term_in_the_loss_and_its_gradient() -> None:
    # k2 with coef 0.5, token mean: loss = -A r + 0.5 * (ref - logp)^2 / 2 per token
    algo = PolicyGradient(kl=KL(coef=0.5, estimator="k2"), corrections={})
    li, logp = loss_inputs([[-1.0]], advantages=[0.0], reference=[[-1.5]])
    out = algo.loss(li)
    assert float(out.loss.detach()) == pytest.approx(0.5 * 0.25 / 2)
    out.loss.backward()
    assert float(logp.grad) == pytest.approx(0.5 * 0.5)  # d/dlogp of (ref - logp)^2 / 4
    assert float(out.metrics["kl_to_reference"]) == pytest.approx(math.exp(-0.5) - 1 + 0.5)


def test_kl_is_zero_where_the_policy_is_the_reference() -> None:
    algo = PolicyGradient(kl=KL(coef=1.0, estimator="k3"))
    li, logp = loss_inputs([[-1.0, -0.2]], advantages=[0.0], reference=[[-1.0, -0.2]])
    out = algo.loss(li)
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and float(logp.grad.abs().sum()) == 0.0
    assert float(out.metrics["kl_to_reference"]) == 0.0


def test_kl_in_the_reward_is_each_sequences_summed_k1() -> None:
    algo = PolicyGradient(kl=KL(coef=0.1, estimator="k1", in_reward=True))
    assert algo.penalises_reward and algo.needs_reference
    li, _ = loss_inputs([[-1.0, -2.0], [-0.5, 0.0]], reference=[[-1.5, -1.0], [-0.5, 0.0]],
                        mask=[[1, 1], [1, 0]])
    assert algo.reward_penalty(li).tolist() == pytest.approx([0.1 * (0.5 - 1.0), 0.0])
    # and the loss has no KL term of its own
    li, _ = loss_inputs([[-1.0]], advantages=[0.0], reference=[[-3.0]])
    assert float(algo.loss(li).loss.detach()) == 0.0


def test_entropy_bonus_lowers_the_loss_by_the_aggregated_entropy() -> None:
    algo = PolicyGradient(entropy_coef=0.01)
    assert algo.needs_entropy_grad
    li, _ = loss_inputs([[-1.0, -1.0]], advantages=[0.0])
    entropy = torch.tensor([[2.0, 4.0]], dtype=torch.float64, requires_grad=True)
    out = algo.loss(type(li)(**{**li.__dict__, "entropy": entropy}))
    assert float(out.loss.detach()) == pytest.approx(-0.01 * 3.0)
    out.loss.backward()
    assert entropy.grad.tolist() == [[pytest.approx(-0.005), pytest.approx(-0.005)]]


def test_a_bad_kl_estimator_names_the_key() -> None:
    with pytest.raises(ConfigError, match="algo.kl.estimator"):
        KL(estimator="k4")
