"""The ``Trainer`` interface: what the pipeline needs of whatever trains the policy.

One abstract class, implemented in process by :class:`~orchestrator.trainer.TorchTrainer`
(its compute in a worker thread), in virtual time by the replay's cost model
(:class:`orchestrator.replay.SimulatedTrainer`), and later by a proxy for a trainer in
another process. The pipeline awaits these methods and cannot tell the implementations apart.

``version`` counts optimiser steps: a batch trained at version ``v`` produces ``v + 1``, and
:meth:`weights` hands out that new version's weights as a :class:`WeightUpdate`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator.types import Group
from orchestrator.weights import WeightUpdate

TrainStats = dict[str, float]  # the step's metrics: loss, grad_norm, lr, …


class Trainer(ABC):
    version: int = 0

    @abstractmethod
    async def step(self, groups: Sequence[Group]) -> TrainStats:
        """One optimiser step over the batch ``groups``; the version goes up by one."""

    @abstractmethod
    async def weights(self) -> WeightUpdate:
        """The current weights, stamped with :attr:`version`, for the engines."""

    async def supervised_step(self, sequences: Sequence[Sequence[int]],
                              masks: Sequence[Sequence[bool]], lr: float) -> float:
        """One cross-entropy step on the masked tokens (the warm start), with an optimiser of
        its own at ``lr``; returns the loss and leaves the version alone."""
        raise NotImplementedError(f"{type(self).__name__} has no supervised warm start")

    @abstractmethod
    def state_dict(self) -> Mapping[str, Any]:
        """Everything needed to resume training (weights, optimiser, schedule, version)."""

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    async def aclose(self) -> None:  # in-process trainers hold nothing to close
        pass
