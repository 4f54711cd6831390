"""GRPO advantages with AReaL's decoupled PPO objective.

Advantages are group-normalised: ``(r - mean(group)) / (std(group) + eps)``, so a group
whose rewards are all equal contributes nothing.

The loss separates the two reasons a sample is off-policy (AReaL, "decoupled PPO"):

* the trust region is taken around the *proximal* policy (the weights at the start of this
  train step): ``ratio = pi_theta / pi_prox``, clipped to ``[1 - eps_low, 1 + eps_high]``;
* staleness is corrected by the importance weight ``pi_prox / pi_behaviour`` against the
  engine's behaviour log-probs, truncated at ``importance_cap`` so one very stale token
  cannot dominate.

``loss = sum_t w_t * max(-A ratio_t, -A clip(ratio_t)) / num_tokens`` (token-level
aggregation over the whole batch, as in DAPO).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from orchestrator.algo.base import Algorithm, LossInputs, LossOutput


def group_advantages(rewards: Sequence[float], normalize_std: bool = True, eps: float = 1e-6) -> list[float]:
    r = torch.tensor(rewards, dtype=torch.float64)
    if len(rewards) == 0 or bool((r == r[0]).all()):
        return [0.0] * len(rewards)  # exactly zero: no signal, and no float residue either
    centred = r - r.mean()
    if normalize_std and len(rewards) > 1:
        centred = centred / (r.std(unbiased=False) + eps)
    return centred.tolist()


def decoupled_ppo_loss(
    inputs: LossInputs, eps_low: float, eps_high: float, importance_cap: float
) -> LossOutput:
    mask = inputs.mask
    ratio = torch.exp(inputs.logprobs - inputs.proximal_logprobs)
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    unclipped = -inputs.advantages * ratio
    clipped = -inputs.advantages * clipped_ratio
    per_token = torch.maximum(unclipped, clipped)

    log_w = (inputs.proximal_logprobs - inputs.behaviour_logprobs).detach()
    raw_weight = torch.exp(log_w)
    weight = raw_weight.clamp(max=importance_cap)
    loss = (per_token * weight * mask).sum() / max(inputs.num_tokens, 1.0)

    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        # k3 estimator of KL(behaviour || proximal) from behaviour samples, w = prox / behav.
        kl = (raw_weight - 1.0 - log_w) * mask
        metrics = {
            "clip_fraction": ((clipped > unclipped) * mask).sum() / n,
            "importance_weight": (raw_weight * mask).sum() / n,
            "truncated_fraction": ((raw_weight > importance_cap) * mask).sum() / n,
            "kl_to_behaviour": kl.sum() / n,
            "ratio": (ratio * mask).sum() / n,
        }
    return LossOutput(loss=loss, metrics=metrics)


class GRPO(Algorithm):
    def __init__(
        self,
        eps_low: float = 0.2,
        eps_high: float = 0.28,
        importance_cap: float = 5.0,
        normalize_std: bool = True,
    ) -> None:
        if eps_low < 0 or eps_high < 0:
            raise ValueError("algo.eps_low and algo.eps_high must be >= 0")
        if importance_cap < 1.0:
            raise ValueError("algo.importance_cap must be >= 1 so on-policy tokens keep weight 1")
        self.eps_low = eps_low
        self.eps_high = eps_high
        self.importance_cap = importance_cap
        self.normalize_std = normalize_std

    def advantages(self, rewards: Sequence[Sequence[float]]) -> list[list[float]]:
        return [group_advantages(group, self.normalize_std) for group in rewards]

    def loss(self, inputs: LossInputs) -> LossOutput:
        return decoupled_ppo_loss(inputs, self.eps_low, self.eps_high, self.importance_cap)
