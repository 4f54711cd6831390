"""A fixed-cost trainer that a launcher can build, in this process or in a Ray actor.

:class:`FixedCostRecipe` is a :class:`~orchestrator.launch.base.TrainerRecipe` whose
:meth:`~FixedCostRecipe.build` makes a :class:`bench.staleness.FixedCostTrainer` (a step sleeps
a fixed time in a worker thread; the weights are empty) instead of a torch policy and
optimiser, so ``launcher.trainer(recipe)`` places it like any trainer. Nothing trains.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.staleness import FixedCostTrainer
from orchestrator.launch.base import TrainerRecipe
from orchestrator.trainer.base import Trainer


@dataclass(frozen=True)
class FixedCostRecipe(TrainerRecipe):
    seconds: float = 0.3

    def build(self) -> Trainer:
        return FixedCostTrainer(self.seconds)


def recipe(seconds: float) -> FixedCostRecipe:
    return FixedCostRecipe(trainer={}, model={}, algo={}, seconds=seconds)
