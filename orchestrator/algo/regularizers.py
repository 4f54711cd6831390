"""KL to a frozen reference policy (``algo.kl``) and the entropy bonus (``algo.entropy_coef``).

The reference is the policy RL starts from (after any warm start): under ``trainer.lora`` the
base model with its adapters disabled (no second copy), else a frozen copy the trainer keeps.
With ``d_t = log pi_ref - log pi_theta`` per token, the estimators of KL(pi_theta || pi_ref)
from the policy's samples (Schulman, "Approximating KL divergence", 2020):

* ``k1``: ``-d`` — unbiased, high variance, can be negative;
* ``k2``: ``d^2 / 2`` — biased, low variance;
* ``k3``: ``exp(d) - 1 - d`` — unbiased, low variance, never negative;
* ``low_var_kl``: k3 with ``d`` and the result clamped to [-10, 10] (verl's form), so one
  token the reference finds impossible cannot blow up the step.

``in_reward: false`` adds ``coef`` times the aggregated estimate to the loss; ``in_reward:
true`` subtracts ``coef`` times each sequence's summed k1 from its reward before the
advantages (REINFORCE++'s form). Either way ``kl_to_reference`` (k3, per token) is logged.
"""

from __future__ import annotations

import torch

from orchestrator.errors import ConfigError

ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def kl_estimate(logprobs: torch.Tensor, reference: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref), differentiable through ``logprobs``."""
    d = reference - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        return torch.exp(d) - 1.0 - d
    if estimator == "low_var_kl":
        d = d.clamp(-10.0, 10.0)
        return (torch.exp(d) - 1.0 - d).clamp(-10.0, 10.0)
    raise ConfigError(f"algo.kl.estimator must be one of {', '.join(ESTIMATORS)}, got "
                      f"{estimator!r}")


class KL:
    """A KL penalty towards the reference policy: in the loss or in the reward."""

    def __init__(self, coef: float = 0.001, estimator: str = "k3", in_reward: bool = False) -> None:
        if coef < 0:
            raise ConfigError(f"algo.kl.coef must be >= 0, got {coef}")
        if estimator not in ESTIMATORS:
            raise ConfigError(f"algo.kl.estimator must be one of {', '.join(ESTIMATORS)}, got "
                              f"{estimator!r}")
        self.coef, self.estimator, self.in_reward = coef, estimator, in_reward
