"""GRPO advantages with AReaL's decoupled PPO objective (``algo=grpo``, the default).

Advantages are group-normalised: ``(r - mean(group)) / (std(group) + eps)`` with the sample
std (n - 1, as verl and TRL: one right answer in four gets 1.5), so a group whose rewards are
all equal contributes nothing.

The loss separates the two reasons a sample is off-policy (AReaL, "decoupled PPO"):

* the trust region is taken around the *proximal* policy (the weights at the start of this
  train step): ``ratio = pi_theta / pi_prox``, clipped to ``[1 - eps_low, 1 + eps_high]``;
* staleness is corrected by the importance weight ``pi_prox / pi_behaviour`` against the
  engine's behaviour log-probs, truncated at ``importance_cap`` so one very stale token
  cannot dominate.

``loss = sum_t w_t * max(-A ratio_t, -A clip(ratio_t)) / num_tokens`` (token-level
aggregation over the whole batch, as in DAPO).

It is :class:`~orchestrator.algo.composed.PolicyGradient` with these pieces
(``GroupNorm``, ``PPOClip``, ``TokenTIS``, ``token_mean``); ``conf/algo/grpo.yaml`` composes
the same pieces by name, so any of them can be swapped from the command line.
"""

from __future__ import annotations

from orchestrator.algo.advantages import GroupNorm
from orchestrator.algo.composed import PolicyGradient
from orchestrator.algo.corrections import TokenTIS
from orchestrator.algo.losses import PPOClip


class GRPO(PolicyGradient):
    """The default preset as one object (what ``conf/algo/grpo.yaml`` composes by name)."""

    def __init__(
        self,
        eps_low: float = 0.2,
        eps_high: float = 0.28,
        importance_cap: float = 5.0,
        normalize_std: bool = True,
    ) -> None:
        super().__init__(advantage=GroupNorm("group" if normalize_std else "none"),
                         loss=PPOClip(eps_low, eps_high),
                         corrections={"tis": TokenTIS(importance_cap)})
