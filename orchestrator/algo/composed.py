"""An algorithm composed from pieces, each chosen by config (``conf/algo/<preset>.yaml``).

Per step: reward ``shaping`` (and a KL penalty in the reward, if any), then the ``advantage``
estimator; per micro-batch: the ``corrections`` give each token a weight and a keep mask from
the engine/trainer mismatch (``mode``), the policy ``loss`` gives each token its loss against
the ratio ``mode`` names, and ``aggregation`` makes it the batch's loss, with the ``kl`` term
and the entropy bonus (``entropy_coef``) aggregated the same way:

``loss = agg(w * keep * l_policy) + kl.coef * agg(keep * k) - entropy_coef * agg(keep * H)``

Everything it logs is per trained token unless it says sequence; ``kl_to_behaviour`` (k3 of
``delta``) is always logged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from orchestrator.algo import aggregation as agg
from orchestrator.algo.advantages import GroupNorm
from orchestrator.algo.base import Advantages, Algorithm, LossInputs, LossOutput, masked_mean
from orchestrator.algo.corrections import MODES, Correction, Mismatch
from orchestrator.algo.losses import PerToken, PPOClip, check_aggregation
from orchestrator.algo.regularizers import KL, kl_estimate
from orchestrator.errors import ConfigError
from orchestrator.types import Group, Trajectory

Shaping = Callable[[Trajectory, float], tuple[float, bool, float]]


def _pieces(value: Mapping[str, Any] | Sequence[Any] | None, key: str) -> list[Any]:
    """A piece dict (``{name: piece}``: Hydra overrides reach each by name; a null entry is
    switched off) or a list, as a list."""
    if value is None:
        return []
    items = list(value.values()) if isinstance(value, Mapping) else list(value)
    for item in items:
        if item is not None and not callable(item):
            raise ConfigError(f"{key} entries must be pieces with a _target_, got {item!r}")
    return [item for item in items if item is not None]


class PolicyGradient(Algorithm):
    """Every preset: one policy-gradient algorithm composed of pieces (``conf/algo``): an
    advantage estimator (``advantage``), a per-token policy loss (``loss``) and its
    aggregation, the mode the ratio is taken in (``decoupled``: to the proximal policy, with
    corrections against the engine's log-probs; ``bypass``: to the engine's directly),
    off-policy ``corrections``, an optional ``kl`` term (in the loss or in the reward), an
    entropy bonus and reward ``shaping``. docs/algorithms.md gives each piece's formula and
    its source; a piece that does not apply to the mode chosen is a ConfigError naming it."""

    def __init__(
        self,
        advantage: Callable[[Sequence[Group], Sequence[Sequence[float]]], list[list[float]]] | None = None,
        loss: Callable[[LossInputs, torch.Tensor], PerToken] | None = None,
        aggregation: str = "token_mean",
        aggregation_constant: float | None = None,
        mode: str = "decoupled",
        corrections: Mapping[str, Any] | Sequence[Any] | None = None,
        kl: KL | None = None,
        entropy_coef: float = 0.0,
        shaping: Mapping[str, Any] | Sequence[Any] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"algo.mode must be one of {', '.join(MODES)}, got {mode!r}")
        agg.check(aggregation, aggregation_constant)
        self.advantage = advantage if advantage is not None else GroupNorm()
        self.policy_loss = loss if loss is not None else PPOClip()
        check_aggregation(self.policy_loss, aggregation)
        self.aggregation = aggregation
        self.aggregation_constant = aggregation_constant
        self.bypass = mode == "bypass"
        self.corrections = _pieces(corrections, "algo.corrections")
        self.kl = kl if kl is not None and kl.coef > 0 else None
        self.entropy_coef = float(entropy_coef)
        self.shaping: list[Shaping] = _pieces(shaping, "algo.shaping")
        # what the trainer must compute for this algorithm
        self.needs_proximal = not self.bypass
        self.needs_reference = self.kl is not None
        self.needs_entropy_grad = self.entropy_coef != 0.0
        self.penalises_reward = self.kl is not None and self.kl.in_reward

    # -- per step: rewards to advantages ----------------------------------------------------

    def advantages(self, groups: Sequence[Group],
                   penalties: Sequence[Sequence[float]] | None = None) -> Advantages:
        rewards: list[list[float]] = []
        trained: list[list[bool]] = []
        logged: dict[str, float] = {}
        samples = sum(len(g) for g in groups)
        for gi, group in enumerate(groups):
            g_rewards, g_trained = [], []
            for i, t in enumerate(group.trajectories):
                reward, keep = t.reward, True
                for piece in self.shaping:
                    reward, kept, value = piece(t, reward)
                    keep = keep and kept
                    name = getattr(piece, "metric", type(piece).__name__)
                    logged[name] = logged.get(name, 0.0) + value / max(samples, 1)
                if penalties is not None:
                    reward -= penalties[gi][i]
                g_rewards.append(reward)
                g_trained.append(keep)
            rewards.append(g_rewards)
            trained.append(g_trained)
        values = self.advantage(groups, rewards)
        if penalties is not None:
            logged["kl_penalty"] = sum(p for g in penalties for p in g) / max(samples, 1)
        masked = any(not k for g in trained for k in g)
        return Advantages(values=values, trained=trained if masked else None, metrics=logged)

    def check(self, group_size: int) -> None:
        check = getattr(self.advantage, "check", None)  # a plain callable has none
        if callable(check):
            check(group_size)

    def reward_penalty(self, inputs: LossInputs) -> torch.Tensor | None:
        if self.kl is None or not self.kl.in_reward or inputs.reference_logprobs is None:
            return None
        k = kl_estimate(inputs.logprobs.detach(), inputs.reference_logprobs, self.kl.estimator)
        return self.kl.coef * inputs.sequence_sum(k)

    # -- per micro-batch: the loss ------------------------------------------------------------

    def _aggregate(self, values: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        constant = self.aggregation_constant or inputs.generation_cap
        return agg.aggregate(values, inputs, self.aggregation, constant)

    def loss(self, inputs: LossInputs) -> LossOutput:
        old = inputs.behaviour_logprobs if self.bypass else inputs.proximal_logprobs
        target = inputs.logprobs.detach() if self.bypass else inputs.proximal_logprobs
        delta = (target - inputs.behaviour_logprobs).detach()
        mismatch = Mismatch(inputs, delta, self.bypass)
        weight = torch.ones_like(delta)
        keep = inputs.mask
        metrics: dict[str, Any] = {}
        sequence_metrics: dict[str, Any] = {}
        for correction in self.corrections:
            out: Correction = correction(mismatch)
            if out.weight is not None:
                weight = weight * out.weight
            if out.keep is not None:
                keep = keep * out.keep
            metrics.update(out.metrics)
            sequence_metrics.update(out.sequence_metrics)

        per_token = self.policy_loss(inputs, old)
        metrics.update(per_token.metrics)
        sequence_metrics.update(per_token.sequence_metrics)
        loss = self._aggregate(per_token.loss * weight * keep, inputs)

        if self.kl is not None and not self.kl.in_reward and inputs.reference_logprobs is not None:
            k = kl_estimate(inputs.logprobs, inputs.reference_logprobs, self.kl.estimator)
            loss = loss + self.kl.coef * self._aggregate(k * keep, inputs)
        if self.entropy_coef and inputs.entropy is not None:
            loss = loss - self.entropy_coef * self._aggregate(inputs.entropy * keep, inputs)

        with torch.no_grad():
            mask = inputs.mask
            # k3 estimator of KL(behaviour || target) from behaviour samples
            metrics["kl_to_behaviour"] = masked_mean(torch.exp(delta) - 1.0 - delta, mask)
            if inputs.reference_logprobs is not None:
                k3 = kl_estimate(inputs.logprobs.detach(), inputs.reference_logprobs, "k3")
                metrics["kl_to_reference"] = masked_mean(k3, mask)
            if self.corrections and keep is not mask:
                metrics["masked_fraction"] = masked_mean(mask - keep, mask)
        return LossOutput(loss=loss, metrics=metrics, sequence_metrics=sequence_metrics)
