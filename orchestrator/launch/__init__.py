"""Launchers: where the trainer and the engines run (``conf/launcher``)."""

from orchestrator.launch.base import EngineRecipe, Launcher, TrainerRecipe
from orchestrator.launch.local import LocalLauncher

__all__ = ["EngineRecipe", "Launcher", "LocalLauncher", "TrainerRecipe"]
