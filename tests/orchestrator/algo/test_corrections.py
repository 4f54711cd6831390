"""Off-policy corrections and reward shaping against hand-computed values
(orchestrator/algo/corrections.py, shaping.py, composed.py)."""

from __future__ import annotations

import math

import pytest
import torch
from algo_helpers import groups, loss_inputs, trajectory

from orchestrator.algo.composed import PolicyGradient
from orchestrator.algo.corrections import (
    M2PO,
    OPSM,
    GeometricMask,
    IcePop,
    SequenceMask,
    SequenceTIS,
    TokenMask,
    TokenTIS,
)
from orchestrator.algo.losses import PPOClip
from orchestrator.algo.shaping import MaskTruncated, OverlongPenalty
from orchestrator.errors import ConfigError
from orchestrator.types import FinishReason, Group

LOG3 = math.log(3.0)


def algo(mode: str = "decoupled", **corrections: object) -> PolicyGradient:
    return PolicyGradient(loss=PPOClip(0.2, 0.28), mode=mode, corrections=corrections)


def test_token_tis_truncates_the_proximal_to_behaviour_weight() -> None:
    # pi_prox / mu = 3, truncated at 2; on-policy ratio 1: loss -A * 2, gradient -2A
    li, logp = loss_inputs([[-1.0]], [[-1.0]], [[-1.0 - LOG3]], advantages=[1.0])
    out = algo(tis=TokenTIS(2.0)).loss(li)
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(-2.0) and float(logp.grad) == pytest.approx(-2.0)
    assert float(out.metrics["importance_weight"]) == pytest.approx(3.0)
    assert float(out.metrics["truncated_fraction"]) == 1.0


def test_bypass_takes_the_ratio_to_the_behaviour_policy() -> None:
    # r = pi_theta / mu = 3: with A < 0 unclipped, -A r = 3; the TIS weight min(3, 2) / 3 makes
    # the token's effective weight the truncated 2
    li, logp = loss_inputs([[-1.0]], [[-1.0]], [[-1.0 - LOG3]], advantages=[-1.0])
    bypass = algo("bypass", tis=TokenTIS(2.0))
    assert not bypass.needs_proximal
    out = bypass.loss(li)
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(2.0) and float(logp.grad) == pytest.approx(2.0)
    # without a correction the bypass ratio is the whole weight
    li, logp = loss_inputs([[-1.0]], [[-1.0]], [[-1.0 - LOG3]], advantages=[-1.0])
    algo("bypass").loss(li).loss.backward()
    assert float(logp.grad) == pytest.approx(3.0)


def test_sequence_tis_weighs_every_token_by_the_truncated_product() -> None:
    # delta = [log 2, log 2]: the sequence's ratio 4, truncated at 3
    li, logp = loss_inputs([[-1.0, -1.0]], [[-1.0, -1.0]], [[-1 - math.log(2)] * 2],
                           advantages=[1.0])
    out = algo(seq=SequenceTIS(3.0)).loss(li)
    out.loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-3.0 / 2, -3.0 / 2])
    assert float(out.sequence_metrics["sequence_truncated_fraction"]) == 1.0
    assert float(out.sequence_metrics["sequence_importance_weight"]) == pytest.approx(4.0)


def test_token_mask_masks_tokens_outside_the_band_and_weighs_nothing() -> None:
    li, logp = loss_inputs([[-1.0, -1.0, -1.0]], behaviour=[[-1 - LOG3, -1.0, -1 + LOG3]],
                           advantages=[1.0])
    out = algo(mask=TokenMask(0.5, 2.0)).loss(li)
    out.loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -1 / 3, 0.0])
    assert float(out.metrics["token_masked_fraction"]) == pytest.approx(2 / 3)


def test_icepop_weighs_by_k_inside_the_band_and_masks_outside() -> None:
    # k = pi_prox / mu = [3, 1, 1/3, 6]: M(k) = k inside [0.5, 5], 0 outside
    li, logp = loss_inputs([[-1.0] * 4], behaviour=[[-1 - LOG3, -1.0, -1 + LOG3,
                                                    -1 - math.log(6.0)]], advantages=[1.0])
    out = algo(icepop=IcePop(0.5, 5.0)).loss(li)
    out.loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-3 / 4, -1 / 4, 0.0, 0.0])
    assert float(out.metrics["token_masked_fraction"]) == pytest.approx(2 / 4)
    # bypass: the ratio pi_theta / mu is k already; IcePop adds the band, not k again
    li, logp = loss_inputs([[-1.0] * 4], behaviour=[[-1 - LOG3, -1.0, -1 + LOG3,
                                                    -1 - math.log(6.0)]], advantages=[1.0])
    algo("bypass", icepop=IcePop(0.5, 5.0)).loss(li).loss.backward()
    # A > 0: PPO's clip at 1.28 holds k = 3 at 1.28 (no gradient); k = 1 is inside
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -1 / 4, 0.0, 0.0])


def test_areal_behaviour_cap_is_tis_and_a_mask_at_the_cap() -> None:
    # AReaL's cap in its mask form: a weight above the cap is 0, below it is the weight itself
    li, logp = loss_inputs([[-1.0] * 2], behaviour=[[-1 - LOG3, -1 - math.log(6.0)]],
                           advantages=[1.0])
    algo(tis=TokenTIS(5.0), cap=TokenMask(0.0, 5.0)).loss(li).loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-3 / 2, 0.0])


def test_sequence_and_geometric_masks() -> None:
    # sequence 1: delta [0.3, 0.3] (product e^0.6 = 1.82, mean e^0.3 = 1.35); sequence 2: on-policy
    behaviour = [[-1.3, -1.3], [-1.0, -1.0]]
    li, _ = loss_inputs([[-1.0, -1.0]] * 2, behaviour=behaviour, advantages=[1.0, 1.0])
    seq = algo(m=SequenceMask(0.5, 2.0)).loss(li)
    assert float(seq.sequence_metrics["sequence_masked_fraction"]) == 0.0
    geo = algo(m=GeometricMask(0.9, 1.1)).loss(li)
    assert float(geo.sequence_metrics["geometric_masked_fraction"]) == pytest.approx(0.5)
    li, logp = loss_inputs([[-1.0, -1.0]] * 2, behaviour=behaviour, advantages=[1.0, 1.0])
    algo(m=SequenceMask(0.5, 1.5)).loss(li).loss.backward()
    assert logp.grad.tolist() == [[0.0, 0.0], [pytest.approx(-0.25)] * 2]


def test_opsm_drops_only_negative_sequences_the_policy_has_moved_away_from() -> None:
    # mean (mu - log pi_theta): 0.5 in both sequences; only the negative one is dropped
    li, logp = loss_inputs([[-1.5, -1.5], [-1.5, -1.5]], behaviour=[[-1.0, -1.0]] * 2,
                           advantages=[1.0, -1.0])
    out = algo(opsm=OPSM(0.1)).loss(li)
    out.loss.backward()
    assert logp.grad[1].abs().sum() == 0.0 and logp.grad[0].abs().sum() > 0
    assert float(out.sequence_metrics["opsm_masked_fraction"]) == pytest.approx(0.5)


def test_m2po_masks_the_largest_second_moments_until_the_rest_is_within_tau() -> None:
    # delta = [0.1, 0.5, -0.3, 0.0]: mean square 0.0875 > 0.04; without 0.5: 0.0333
    delta = [0.1, 0.5, -0.3, 0.0]
    li, logp = loss_inputs([[-1.0] * 4], behaviour=[[-1.0 - d for d in delta]], advantages=[1.0])
    out = algo(m2po=M2PO(0.04)).loss(li)
    out.loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-0.25, 0.0, -0.25, -0.25])
    assert float(out.metrics["m2po_masked_fraction"]) == pytest.approx(0.25)
    assert float(out.metrics["m2po_second_moment"]) == pytest.approx(0.0875)


def test_m2po_keeps_the_smallest_token_when_every_token_exceeds_tau() -> None:
    # every delta^2 (0.25, 0.09, 0.16) > tau = 0.01: AReaL keeps the smallest, -0.3's
    delta = [0.5, -0.3, 0.4]
    li, logp = loss_inputs([[-1.0] * 3], behaviour=[[-1.0 - d for d in delta]], advantages=[1.0])
    out = algo(m2po=M2PO(0.01)).loss(li)
    out.loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -1 / 3, 0.0])
    assert float(out.metrics["m2po_masked_fraction"]) == pytest.approx(2 / 3)


def test_m2po_keeps_everything_within_tau() -> None:
    li, _ = loss_inputs([[-1.0] * 3], behaviour=[[-1.05, -0.95, -1.0]])
    assert float(algo(m2po=M2PO(0.04)).loss(li).metrics["m2po_masked_fraction"]) == 0.0


@pytest.mark.parametrize("make", [lambda: TokenMask(1.5, 2.0), lambda: IcePop(0.5, 0.9),
                                  lambda: TokenTIS(0.5),
                                  lambda: M2PO(0.0), lambda: OPSM(-1.0)])
def test_bad_correction_settings_say_what_to_change(make: object) -> None:
    with pytest.raises(ConfigError):
        make()


def test_an_unknown_mode_names_the_key() -> None:
    with pytest.raises(ConfigError, match="algo.mode"):
        PolicyGradient(mode="bypassed")


# -- shaping ----------------------------------------------------------------------------------


def test_overlong_penalty_ramps_over_the_buffer() -> None:
    penalty = OverlongPenalty(buffer=4)
    cap = 16
    # free up to 12 tokens; 14 -> -0.5; 16 -> -1; beyond -> -1
    assert [penalty.penalty(n, cap) for n in (5, 12, 13, 14, 16, 30)] == pytest.approx(
        [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])


def test_shaping_reaches_the_advantages_and_masks_truncated_samples() -> None:
    algo_ = PolicyGradient(shaping={"overlong": OverlongPenalty(buffer=4),
                                    "truncated": MaskTruncated()})
    group = Group(0, (trajectory(1.0, 0, generated=14, max_tokens=16),
                      trajectory(1.0, 1, generated=5, max_tokens=16),
                      trajectory(1.0, 2, generated=16, max_tokens=16, finish=FinishReason.LENGTH),
                      trajectory(0.0, 3, generated=5, max_tokens=16)), 0)
    out = algo_.advantages([group])
    # shaped rewards 0.5, 1, 0, 0: the penalised sample ranks below the clean one
    assert out.values[0][1] > out.values[0][0] > out.values[0][2]
    assert out.trained == [[True, True, False, True]]
    assert out.metrics["shaping/truncated_masked"] == pytest.approx(0.25)
    assert out.metrics["shaping/overlong_penalty"] == pytest.approx((-0.5 - 1.0) / 4)


def test_penalties_are_subtracted_before_the_advantages() -> None:
    out = PolicyGradient().advantages(groups([[1.0, 1.0]]), penalties=[[0.0, 0.5]])
    assert out.values[0][0] > 0 > out.values[0][1]
    assert out.metrics["kl_penalty"] == pytest.approx(0.25)
    assert out.trained is None


def test_weights_are_detached() -> None:
    li, logp = loss_inputs([[-1.0]], [[-1.0]], [[-2.0]])
    out = algo(tis=TokenTIS(5.0), seq=SequenceTIS(5.0), icepop=TokenMask(0.1, 10.0)).loss(li)
    out.loss.backward()
    # on-policy ratio 1, weights e * e (both detached): gradient -A e^2 exactly
    assert float(logp.grad) == pytest.approx(-math.e ** 2)
    assert isinstance(out.loss, torch.Tensor)
