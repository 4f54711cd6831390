"""Trainers: the :class:`Trainer` interface and the torch implementation."""

from orchestrator.trainer.base import Trainer, TrainStats
from orchestrator.trainer.torch_trainer import PackedBatch, TorchTrainer, pack

__all__ = ["PackedBatch", "TorchTrainer", "TrainStats", "Trainer", "pack"]
