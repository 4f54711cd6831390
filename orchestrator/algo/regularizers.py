"""KL to a frozen reference policy (``algo.kl``) and the entropy bonus (``algo.entropy_coef``).

The reference is the policy RL starts from (after any warm start): under ``trainer.lora`` the
base model with its adapters disabled (no second copy), else a frozen copy the trainer keeps.
With ``d_t = log pi_ref - log pi_theta`` per token, the estimators of KL(pi_theta || pi_ref)
from the policy's samples (Schulman, "Approximating KL divergence", 2020):

* ``k1``: ``-d`` — unbiased, high variance, can be negative;
* ``k2``: ``d^2 / 2`` — biased, low variance;
* ``k3``: ``exp(d) - 1 - d`` — unbiased, low variance, never negative;
* ``low_var_kl``: verl's form of k3, ``d`` clamped to [-20, 20] and the result to [-10, 10],
  so one token the reference finds impossible cannot blow up the step;
* ``k3+``, ``low_var_kl+``: the value of ``k3`` / ``low_var_kl`` with the gradient of ``k2``
  (straight through, as verl's ``k3+``).

As a loss term what matters is the gradient, and in expectation over the policy's samples
(the sampled tokens are not differentiated) it is not the value's: ``E[grad k1] = 0`` (k1
only adds noise), ``E[grad k2] = grad KL(pi_theta || pi_ref)``, ``E[grad k3] =
grad KL(pi_ref || pi_theta)`` (the reverse direction). The ``+`` forms log k3's value and pull
along grad KL(pi_theta || pi_ref).

``in_reward: false`` adds ``coef`` times the aggregated estimate to the loss; ``in_reward:
true`` subtracts ``coef`` times each sequence's summed estimate (``estimator``'s value, no
gradient) from its reward before the advantages (REINFORCE++'s form). Either way
``kl_to_reference`` (k3, per token) is logged.
"""

from __future__ import annotations

import torch

from orchestrator.errors import ConfigError

ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "k3+", "low_var_kl+")


def _k3(d: torch.Tensor) -> torch.Tensor:
    return torch.exp(d) - 1.0 - d


def kl_estimate(logprobs: torch.Tensor, reference: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref), differentiable through ``logprobs``."""
    d = reference - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        return _k3(d)
    if estimator == "low_var_kl":
        return _k3(d.clamp(-20.0, 20.0)).clamp(-10.0, 10.0)
    if estimator in ("k3+", "low_var_kl+"):
        value = kl_estimate(logprobs, reference, estimator.removesuffix("+")).detach()
        k2 = 0.5 * d.square()
        return k2 - k2.detach() + value
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
