"""Where a run's engines and trainer live: the ``Launcher`` interface and the recipes it builds.

A launcher gets *recipes*, never live objects: an :class:`EngineRecipe` (the ``conf/engine``
and ``conf/model`` nodes) and a :class:`TrainerRecipe` (the ``conf/trainer``, ``conf/model``
and ``conf/algo`` nodes plus the sampling temperature and thread count). Recipes are plain,
picklable data, so the same recipe builds its object in this process
(:class:`~orchestrator.launch.local.LocalLauncher`) or in a Ray actor on another machine
(``orchestrator.launch.ray``). What the launcher hands back implements the same
:class:`~orchestrator.engines.base.InferenceEngine` and :class:`~orchestrator.trainer.Trainer`
interfaces either way; the pipeline cannot tell them apart.

An engine recipe also carries the launcher's side of the engine's
:class:`~orchestrator.engines.placement.Placement` (is the trainer in the engine's process, on
which GPU, ``launcher.colocate``); an engine class that takes a ``placement`` argument gets it
(vLLM's chooses its weight-transfer backend and sleep mode from it), the others never see it.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

from orchestrator.engines.base import InferenceEngine
from orchestrator.engines.placement import Placement
from orchestrator.trace.recorder import Recorder
from orchestrator.trainer.base import Trainer
from orchestrator.weights.update import WeightUpdate


@dataclass(frozen=True)
class EngineRecipe:
    engine: Mapping[str, Any]  # conf/engine: _target_ and the engine's options
    model: Mapping[str, Any]  # conf/model: the engine builds its own copy of the architecture
    placement: Placement = field(default_factory=Placement)  # the trainer's side of it

    def build(self, weights: WeightUpdate) -> InferenceEngine:
        from hydra.utils import get_object

        values = dict(self.engine)
        cls = get_object(values.pop("_target_"))
        if "placement" in inspect.signature(cls).parameters:
            values["placement"] = self.placement
        return cls(**values, model=dict(self.model), weights=weights)


@dataclass(frozen=True)
class TrainerRecipe:
    trainer: Mapping[str, Any]  # conf/trainer
    model: Mapping[str, Any]  # conf/model
    algo: Mapping[str, Any]  # conf/algo
    temperature: float = 1.0  # the sampling temperature the trainer scores tokens at
    seed: int = 0
    torch_threads: int | None = None
    # Set by a launcher whose colocated engine is in another process (Ray actors, trainer
    # ranks): the trainer's process gives back the GPU memory torch cached during a step and
    # the weights' gather, which the engine's wake would otherwise find taken.
    colocated: bool = False
    # engine.delta: a trainer in another process than its engines sends each update as a delta
    # from the last one too (orchestrator/weights/delta.py); the trainer actor under launcher=ray
    # does
    weight_delta: bool = False
    # engine.attest: the trainer fingerprints each update it publishes (Trainer.fingerprints)
    fingerprint: bool = True

    def release_cached_memory(self) -> None:
        """Under :attr:`colocated`, the GPU blocks torch's allocator holds free go back."""
        import torch

        if self.colocated and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def build(self) -> Trainer:
        import torch
        from hydra.utils import get_object

        from orchestrator.algo.build import build_algorithm
        from orchestrator.models.policy import build_policy

        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        torch.manual_seed(self.seed)
        policy = build_policy(self.model)
        algorithm = build_algorithm(self.algo)
        values = dict(self.trainer)
        cls = get_object(values.pop("_target_"))
        trainer = cls(policy=policy, algorithm=algorithm, temperature=self.temperature, **values)
        trainer.fingerprints = self.fingerprint
        return trainer


class Launcher(ABC):
    """Places a run's trainer and engines; a context manager around the run."""

    colocate: bool = False  # launcher.colocate: the trainer and the engines take turns on a GPU

    @abstractmethod
    def trainer(self, recipe: TrainerRecipe) -> Trainer:
        """The run's trainer (built now: its starting weights are the engines')."""

    @abstractmethod
    def engine(self, recipe: EngineRecipe, weights: WeightUpdate,
               recorder: Recorder | None = None) -> InferenceEngine:
        """The run's engine (one, or several behind one interface), starting from ``weights``;
        called once, in the run's event loop. Spans recorded elsewhere (in actors) go to
        ``recorder``."""

    def recover(self, error: BaseException) -> bool:
        """After the run failed with ``error``: True when the launcher replaced what was lost
        (a dead trainer actor, within its restart budget) so that the run may go on from its
        last checkpoint; the next :meth:`trainer` and :meth:`engine` calls build it again."""
        return False

    def close(self) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
