"""The ``Trainer`` interface: what the pipeline needs of whatever trains the policy.

One abstract class, implemented in process by :class:`~orchestrator.trainer.TorchTrainer`
(its compute in a worker thread), by a group of trainer ranks
(:class:`~orchestrator.launch.ranks.RankGroup`), by a proxy for a trainer in a Ray actor
(:class:`~orchestrator.launch.ray.trainer.RayTrainer`), and in virtual time by a cost model
for replay and benchmarks. The pipeline awaits these methods and cannot tell the
implementations apart.

Checkpoints belong to the trainer: :meth:`Trainer.snapshot` copies its state (the only part
training waits for), the run writes that copy in the background; :meth:`Trainer.save` and
:meth:`Trainer.load` write and read a checkpoint directory wherever the trainer lives.

``version`` counts optimiser steps: a batch trained at version ``v`` produces ``v + 1``, and
:meth:`weights` hands out that new version's weights as a :class:`WeightUpdate`.

A method marked :func:`forwarded` is defined here once and reaches a trainer wherever it lives
with no launcher code of its own: the proxies (:class:`~orchestrator.trainer.proxy.TrainerProxy`:
the rank group, the Ray trainer) derive it from this declaration and the far sides (the rank
server, the trainer actor) answer it through one generic call
(:mod:`orchestrator.trainer.proxy`). The methods whose transport differs per launcher (a step's
spans and version, weights through the object store, checkpoints as shards or snapshots) are
written out in each proxy instead.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, TypeVar

from orchestrator.errors import ConfigError
from orchestrator.types import Group
from orchestrator.weights.update import WeightUpdate

TrainStats = dict[str, float]  # the step's metrics: loss, grad_norm, lr, …
F = TypeVar("F", bound=Callable[..., Any])
# How a group of trainer ranks answers a forwarded call that every rank runs: ``first``, rank
# 0's result (the ranks agree, or met in a collective inside); ``sum``, the ranks' results
# added (numbers, or mappings of numbers by key); ``gather``, a list of every rank's, in order.
RankAnswer = Literal["first", "sum", "gather"]


@dataclass(frozen=True)
class Forwarded:
    """How a proxy forwards one :class:`Trainer` method (see :func:`forwarded`)."""

    name: str
    function: Callable[..., Any]  # the interface's declaration: its signature binds the call
    doing: str  # what the call is, in an error's words ("a warm-start step")
    span: str | None  # the span a trainer in another process records around it (None: none)
    ranks: RankAnswer = "first"  # how a group of ranks combines its answers (RankAnswer)

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.function)


def forwarded(*, doing: str, span: str | None = None,
              ranks: RankAnswer = "first") -> Callable[[F], F]:
    """Mark a :class:`Trainer` method as one a proxy forwards as it is: its arguments to the
    trainer wherever it lives, its result back (both plain, picklable data), the trainer's
    version after it with them. A trainer that lacks it inherits the declaration's body, so
    give it a default (a no-op, or ``NotImplementedError`` naming the trainer). ``ranks``: how
    a group of trainer ranks, each of which runs the call, makes one answer of theirs
    (:data:`RankAnswer`; :func:`combine_ranks`)."""
    if ranks not in ("first", "sum", "gather"):
        raise ValueError(f"forwarded(ranks={ranks!r}): choose first, sum or gather")

    def mark(function: F) -> F:
        function.__forwarded__ = Forwarded(  # type: ignore[attr-defined]
            function.__name__, function, doing, span, ranks)
        return function

    return mark


def combine_ranks(how: RankAnswer, answers: Sequence[Any]) -> Any:
    """One answer from every rank's, in rank order, as a forwarded method declares
    (:data:`RankAnswer`)."""
    if how == "first":
        return answers[0]
    if how == "gather":
        return list(answers)
    if all(isinstance(a, Mapping) for a in answers):
        keys = dict.fromkeys(k for a in answers for k in a)
        return {k: sum(a.get(k, 0) for a in answers) for k in keys}
    return sum(answers)


def forwarded_methods() -> dict[str, Forwarded]:
    """The :class:`Trainer` methods marked :func:`forwarded`, by name."""
    return {name: value.__forwarded__ for name, value in vars(Trainer).items()
            if hasattr(value, "__forwarded__")}


class Snapshot(Protocol):
    """A trainer's checkpoint state taken at one moment (:meth:`Trainer.snapshot`), written
    later, in a worker thread, while training goes on."""

    def write(self, directory: Path) -> Any:
        """Write the trainer's files into ``directory``."""


class Trainer(ABC):
    version: int = 0
    # Whether ``trainer.world_size`` can split this trainer over ranks (FSDP2: the launcher
    # builds one rank trainer per process, orchestrator/launch/ranks.py)
    trains_in_ranks: ClassVar[bool] = False
    # engine.attest: each update :meth:`weights` publishes carries its fingerprint (computed
    # on the trainer's device) for the engines' loads to be checked against; off, none is
    # computed (a delta encoder computes its own)
    fingerprints: bool = True

    @abstractmethod
    async def step(self, groups: Sequence[Group]) -> TrainStats:
        """One optimiser step over the batch ``groups``; the version goes up by one."""

    @abstractmethod
    async def weights(self) -> WeightUpdate:
        """The current weights, stamped with :attr:`version`, for the engines."""

    # ranks="first": the ranks sum their losses in a collective, so every rank returns the total
    @forwarded(doing="a warm-start step", span="supervised_compute", ranks="first")
    async def supervised_step(self, sequences: Sequence[Sequence[int]],
                              masks: Sequence[Sequence[bool]], lr: float) -> float:
        """One cross-entropy step on the masked tokens (the warm start), with an optimiser of
        its own at ``lr``; returns the loss and leaves the version alone."""
        raise NotImplementedError(f"{type(self).__name__} has no supervised warm start")

    # -- checkpoints: the trainer saves and loads its own ----------------------------------

    def snapshot(self) -> Snapshot:
        """This trainer's checkpoint state, copied now (blocking: call it in a worker thread);
        training may go on while the run writes it (``snapshot.write(directory)``). The next
        call may reuse its memory: make it only once this one is written."""
        raise ConfigError(f"a {type(self).__name__} has no checkpoint to take")

    def save(self, directory: Path) -> None:
        """Write this trainer's checkpoint into ``directory`` now."""
        self.snapshot().write(Path(directory))

    def load(self, directory: Path) -> None:
        """Load the checkpoint in ``directory`` (written by :meth:`save` or a snapshot),
        wherever this trainer lives."""
        raise ConfigError(f"cannot load a checkpoint into a {type(self).__name__}")

    @forwarded(doing="state_dict")
    @abstractmethod
    def state_dict(self) -> Mapping[str, Any]:
        """Everything needed to resume training (weights, optimiser, schedule, version)."""

    @forwarded(doing="load_state_dict")
    @abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    async def aclose(self) -> None:  # in-process trainers hold nothing to close
        pass
