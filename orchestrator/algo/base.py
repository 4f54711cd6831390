"""What an RL algorithm is to the trainer: advantages per sample and a per-token loss.

An algorithm is composed from small pieces (:class:`~orchestrator.algo.composed.PolicyGradient`:
an advantage estimator, a policy loss, an aggregation, off-policy corrections, KL and entropy
terms, reward shaping), each chosen by ``_target_`` in ``conf/algo/<preset>.yaml``; the trainer
never branches on an algorithm's name. It asks the algorithm what it needs instead:
:attr:`Algorithm.needs_proximal`, :attr:`Algorithm.needs_reference`,
:attr:`Algorithm.needs_entropy_grad`.

The trainer's batch has one sequence (one trajectory) per row, so a row's trained tokens are
its sequence: sequence-level pieces reduce over rows (:meth:`LossInputs.sequence_mean`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from orchestrator.types import Group


def masked_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` where ``weights`` (a token mask ``[sequences, time]`` or a sequence
    mask ``[sequences]``) is set; 0 for none. What every piece logs is such a mean."""
    return (values * weights).sum() / weights.sum().clamp(min=1.0)


@dataclass(frozen=True)
class LossInputs:
    """Per-token tensors of shape (sequences, time); ``mask`` marks the tokens that are trained."""

    logprobs: torch.Tensor  # current policy, with grad
    proximal_logprobs: torch.Tensor  # policy at the start of this train step, no grad
    behaviour_logprobs: torch.Tensor  # the engine's, at generation time
    advantages: torch.Tensor
    mask: torch.Tensor  # float, 1.0 where trained
    num_tokens: float  # trained tokens in the whole (mini)batch, over every micro-batch and rank
    # sequences with a trained token in the whole (mini)batch (0: count this micro-batch's)
    num_sequences: float = 0.0
    reference_logprobs: torch.Tensor | None = None  # the frozen reference policy's, no grad
    entropy: torch.Tensor | None = None  # the policy's entropy per token (with grad if asked)
    # the largest max_tokens the step's samples were generated with (None: not known):
    # sequence_sum's constant when algo.aggregation_constant is not set
    generation_cap: float | None = None

    @property
    def sequence_tokens(self) -> torch.Tensor:
        """Trained tokens per sequence, ``[sequences]``."""
        return self.mask.sum(1)

    @property
    def sequences(self) -> torch.Tensor:
        """1.0 for each sequence with a trained token, ``[sequences]``."""
        return (self.sequence_tokens > 0).to(self.mask.dtype)

    @property
    def total_sequences(self) -> float | torch.Tensor:
        return self.num_sequences if self.num_sequences > 0 else self.sequences.sum().clamp(min=1.0)

    def sequence_sum(self, values: torch.Tensor) -> torch.Tensor:
        return (values * self.mask).sum(1)

    def sequence_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Each sequence's mean of ``values`` over its trained tokens (0 for none)."""
        return self.sequence_sum(values) / self.sequence_tokens.clamp(min=1.0)


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor
    # per trained token, averaged over the micro-batch: numbers or 0-d tensors (detached),
    # which the trainer sums on the device and reads once a step
    metrics: dict[str, float | torch.Tensor]
    # per sequence with a trained token, averaged over the micro-batch's sequences
    sequence_metrics: dict[str, float | torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Advantages:
    """One advantage per sample, per group; ``trained[g][i]`` False leaves a sample out of the
    loss altogether (its tokens are not counted either); ``metrics`` are the step's."""

    values: list[list[float]]
    trained: list[list[bool]] | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def per_sample(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The values (and trained flags) of every sample, groups one after the other: what a
        batch's rows index by their sample (:meth:`~orchestrator.trainer.batch.TokenBatch.with_advantages`)."""
        values = torch.tensor([v for group in self.values for v in group], dtype=torch.float64)
        if self.trained is None:
            return values, None
        return values, torch.tensor([t for group in self.trained for t in group], dtype=torch.bool)


class Algorithm(ABC):
    needs_proximal: bool = True  # several minibatches: recompute pi_prox before the first update
    needs_reference: bool = False  # reference_logprobs in LossInputs
    needs_entropy_grad: bool = False  # LossInputs.entropy differentiable
    penalises_reward: bool = False  # reward_penalty() needs the current and reference log-probs

    @abstractmethod
    def advantages(self, groups: Sequence[Group],
                   penalties: Sequence[Sequence[float]] | None = None) -> Advantages:
        """One advantage per sample of each group; ``penalties`` (per sample, from
        :meth:`reward_penalty`) are subtracted from the rewards first."""

    @abstractmethod
    def loss(self, inputs: LossInputs) -> LossOutput: ...

    def check(self, group_size: int) -> None:
        """Raise :class:`~orchestrator.errors.ConfigError` if this algorithm cannot learn from
        groups of ``group_size`` samples (a group baseline at group size 1)."""

    def reward_penalty(self, inputs: LossInputs) -> torch.Tensor | None:
        """Per sequence, what to subtract from its reward before the advantages (a KL penalty
        in the reward), from detached ``inputs`` with ``reference_logprobs``; None: nothing."""
        return None
