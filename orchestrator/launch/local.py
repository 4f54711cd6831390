"""``launcher=local``: the trainer and the engine in this process (the default).

With ``trainer.world_size=N`` the trainer is N rank processes on this machine (one GPU each
when it has them; gloo on CPU), behind one :class:`~orchestrator.launch.ranks.RankGroup`.
"""

from __future__ import annotations

from orchestrator.engines.base import InferenceEngine
from orchestrator.launch.base import EngineRecipe, Launcher, TrainerRecipe
from orchestrator.launch.ranks import RankGroup, process_group, world_size
from orchestrator.recorder import Recorder
from orchestrator.trainer.base import Trainer
from orchestrator.weights import WeightUpdate


class LocalLauncher(Launcher):
    def __init__(self) -> None:
        self._groups: list[RankGroup] = []

    def trainer(self, recipe: TrainerRecipe) -> Trainer:
        size = world_size(recipe)
        if size is None:
            return recipe.build()
        group = process_group(recipe, size)
        self._groups.append(group)
        return group

    def engine(self, recipe: EngineRecipe, weights: WeightUpdate,
               recorder: Recorder | None = None) -> InferenceEngine:
        return recipe.build(weights)

    def close(self) -> None:
        for group in self._groups:
            group.close()
        self._groups.clear()
