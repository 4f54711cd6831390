"""``launcher=local``: the trainer and the engine in this process (the default)."""

from __future__ import annotations

from pathlib import Path

from orchestrator.checkpoint import load_checkpoint, save_checkpoint
from orchestrator.engines.base import InferenceEngine
from orchestrator.errors import ConfigError
from orchestrator.launch.base import EngineRecipe, Launcher, TrainerRecipe
from orchestrator.recorder import Recorder
from orchestrator.trainer import TorchTrainer
from orchestrator.trainer.base import Trainer
from orchestrator.weights import WeightUpdate


class LocalLauncher(Launcher):
    def trainer(self, recipe: TrainerRecipe) -> Trainer:
        return recipe.build()

    def engine(self, recipe: EngineRecipe, weights: WeightUpdate,
               recorder: Recorder | None = None) -> InferenceEngine:
        return recipe.build(weights)

    def save_checkpoint(self, trainer: Trainer, directory: Path) -> None:
        save_checkpoint(trainer, directory)

    def load_checkpoint(self, trainer: Trainer, directory: Path) -> None:
        if not isinstance(trainer, TorchTrainer):
            raise ConfigError(f"cannot load a checkpoint into a {type(trainer).__name__}")
        load_checkpoint(trainer, directory)
