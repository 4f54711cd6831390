"""A fixed-cost trainer that a launcher can build, in this process or in a Ray actor.

:class:`FixedCostRecipe` is a :class:`~orchestrator.launch.base.TrainerRecipe` whose
:meth:`~FixedCostRecipe.build` makes the simulated trainer
(:class:`~orchestrator.trainer.simulated.SimulatedTrainer`: a step sleeps a fixed time in a
worker thread; the weights are empty) instead of a torch policy and optimiser, so
``launcher.trainer(recipe)`` places it like any trainer. Nothing trains.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.launch.base import TrainerRecipe
from orchestrator.trainer.base import Trainer
from orchestrator.trainer.simulated import SimulatedTrainer, TokenCost


@dataclass(frozen=True)
class FixedCostRecipe(TrainerRecipe):
    seconds: float = 0.3

    def build(self) -> Trainer:
        return fixed_cost_trainer(self.seconds)


def fixed_cost_trainer(seconds: float) -> SimulatedTrainer:
    """A step sleeps ``seconds`` in a worker thread, as a real optimiser step computes there."""
    return SimulatedTrainer(TokenCost(fixed_s=seconds), in_thread=True)


def recipe(seconds: float) -> FixedCostRecipe:
    return FixedCostRecipe(trainer={}, model={}, algo={}, seconds=seconds)
