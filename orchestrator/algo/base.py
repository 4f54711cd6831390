"""What an RL algorithm is to the trainer: advantages per sample and a per-token loss.

One algorithm per module; ``conf/algo/<name>.yaml`` names its class with ``_target_``, so
the trainer never branches on an algorithm's name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossInputs:
    """Per-token tensors of shape (batch, time); ``mask`` marks the tokens that are trained."""

    logprobs: torch.Tensor  # current policy, with grad
    proximal_logprobs: torch.Tensor  # policy at the start of this train step, no grad
    behaviour_logprobs: torch.Tensor  # the engine's, at generation time
    advantages: torch.Tensor
    mask: torch.Tensor  # float, 1.0 where trained
    num_tokens: float  # loss normaliser: trained tokens in the whole (mini)batch


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor
    # per trained token, averaged over the micro-batch: numbers or 0-d tensors (detached),
    # which the trainer sums on the device and reads once a step
    metrics: dict[str, float | torch.Tensor]


class Algorithm(ABC):
    @abstractmethod
    def advantages(self, rewards: Sequence[Sequence[float]]) -> list[list[float]]:
        """One advantage per sample, given the rewards of each group."""

    @abstractmethod
    def loss(self, inputs: LossInputs) -> LossOutput: ...
