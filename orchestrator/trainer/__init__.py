"""Trainers: the :class:`Trainer` interface, the torch implementation and the simulated one
(a cost, no model)."""

from orchestrator.trainer.base import Trainer, TrainStats
from orchestrator.trainer.simulated import SimulatedTrainer, TokenCost, UniformCost
from orchestrator.trainer.torch_trainer import PackedBatch, TorchTrainer, pack

__all__ = ["PackedBatch", "SimulatedTrainer", "TokenCost", "TorchTrainer", "TrainStats", "Trainer",
           "UniformCost", "pack"]
