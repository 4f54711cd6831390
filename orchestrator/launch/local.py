"""``launcher=local``: the trainer and the engine in this process (the default).

With ``trainer.world_size=N`` the trainer is N rank processes on this machine (one GPU each
when it has them; gloo on CPU), behind one :class:`~orchestrator.launch.ranks.RankGroup`.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.checkpoint import Snapshot, TrainerSnapshot, load_checkpoint
from orchestrator.engines.base import InferenceEngine
from orchestrator.errors import ConfigError
from orchestrator.launch.base import EngineRecipe, Launcher, TrainerRecipe
from orchestrator.launch.ranks import RankGroup, process_group, world_size
from orchestrator.recorder import Recorder
from orchestrator.trainer import TorchTrainer
from orchestrator.trainer.base import Trainer
from orchestrator.trainer.distributed import SHARDS, load_shards
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

    _last: TrainerSnapshot | None = None  # written already: its memory is reused

    def snapshot(self, trainer: Trainer) -> Snapshot:
        if isinstance(trainer, RankGroup):
            return trainer.snapshot()
        self._last = TrainerSnapshot.capture(trainer, into=self._last)
        return self._last

    def load_checkpoint(self, trainer: Trainer, directory: Path) -> None:
        if isinstance(trainer, RankGroup):
            trainer.load(directory)
            return
        if isinstance(trainer, TorchTrainer) and (directory / SHARDS).is_dir():
            load_shards(trainer, directory)  # a run of trainer ranks, resumed in this process
            return
        if not isinstance(trainer, TorchTrainer):
            raise ConfigError(f"cannot load a checkpoint into a {type(trainer).__name__}")
        load_checkpoint(trainer, directory)

    def close(self) -> None:
        for group in self._groups:
            group.close()
        self._groups.clear()
