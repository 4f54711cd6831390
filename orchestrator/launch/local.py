"""``launcher=local``: the trainer and the engine in this process (the default).

With ``trainer.world_size=N`` the trainer is N rank processes on this machine (one GPU each
when it has them; gloo on CPU), behind one :class:`~orchestrator.launch.ranks.RankGroup`.

``launcher.colocate=true``: the trainer and the engine take turns on one GPU (the model's
device; vLLM sleeps through each train step, see :mod:`orchestrator.engines.vllm_engine`). It
needs a CUDA GPU, checked before anything is built. The engine's recipe says where the trainer
is (:class:`~orchestrator.engines.placement.Placement`): here, on ``model.device``'s GPU,
unless ranks in other processes hold it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from orchestrator.engines.base import InferenceEngine
from orchestrator.engines.placement import Placement, device_index
from orchestrator.errors import ConfigError
from orchestrator.launch.base import EngineRecipe, Launcher, TrainerRecipe
from orchestrator.launch.ranks import RankGroup, process_group, world_size
from orchestrator.trace.recorder import Recorder
from orchestrator.trainer.base import Trainer
from orchestrator.weights.update import WeightUpdate


class LocalLauncher(Launcher):
    def __init__(self, colocate: bool = False) -> None:
        if colocate and not torch.cuda.is_available():
            raise ConfigError("launcher.colocate=true needs a CUDA GPU for the trainer and the "
                              "engine to share, and none is visible: set launcher.colocate=false")
        self.colocate = colocate
        self._groups: list[RankGroup] = []
        self._trainer_here = True  # until trainer() builds rank processes

    def trainer(self, recipe: TrainerRecipe) -> Trainer:
        size = world_size(recipe)
        self._trainer_here = size is None
        if size is None:
            return recipe.build()
        group = process_group(replace(recipe, colocated=self.colocate), size)
        self._groups.append(group)
        return group

    def engine(self, recipe: EngineRecipe, weights: WeightUpdate,
               recorder: Recorder | None = None) -> InferenceEngine:
        return replace(recipe, placement=self.placement(recipe)).build(weights)

    def placement(self, recipe: EngineRecipe) -> Placement:
        """The trainer's side of the engine's placement: the trainer shares the model node (rank
        0 of trainer ranks is on that device too: :func:`~orchestrator.launch.ranks.rank_gpus`)."""
        device = str(recipe.model.get("device", "auto"))
        return Placement(trainer_here=self._trainer_here, colocate=self.colocate,
                         trainer_gpu=device_index(device, torch.cuda.is_available()))

    def close(self) -> None:
        for group in self._groups:
            group.close()
        self._groups.clear()
