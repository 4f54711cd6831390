"""Trainers: the :class:`Trainer` interface, the torch implementation and the simulated one
(a cost, no model); the batch a train step works on (:mod:`~orchestrator.trainer.batch`)."""

from orchestrator.trainer.base import Trainer, TrainStats
from orchestrator.trainer.batch import TokenBatch, token_batch
from orchestrator.trainer.simulated import SimulatedTrainer, TokenCost, UniformCost
from orchestrator.trainer.torch_trainer import TorchTrainer

__all__ = ["SimulatedTrainer", "TokenBatch", "TokenCost", "TorchTrainer", "TrainStats", "Trainer",
           "UniformCost", "token_batch"]
