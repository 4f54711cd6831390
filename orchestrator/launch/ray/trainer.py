"""The driver's proxy for the trainer in a Ray actor: a :class:`Trainer` like any other.

Every call goes to the :class:`~.actors.TrainerActor` (placed on its own bundle: a GPU node,
say); the pipeline awaits them as it awaits an in-process trainer. :meth:`RayTrainer.weights`
returns an object-store :class:`~orchestrator.weights.update.WeightUpdate`: the actor put the new
weights once and every engine actor pulls them from there. ``state_dict`` and
``load_state_dict`` are blocking (the interface is synchronous): call them outside the run's
event loop, as checkpoints do.

Spans: a step, a weight update and a forwarded coroutine (a warm-start step) come back with the
spans the actor recorded (``train_compute``, ``weights_put``, ``supervised_compute``), which
this proxy records before it returns: they count in the step that awaited them, as an
in-process trainer's time does (:mod:`~.spans`). The blocking calls' spans (a checkpoint's
``checkpoint_copy``) wait for the driver's next drain: no recorder may be touched off its
event loop.

Checkpoints: :meth:`RayTrainer.snapshot` has the actor copy its state and put it into the
object store; the driver writes it into its own run directory (in a worker thread, while the
actor trains on), so a run's checkpoints are on the driver's disk whichever node trained, and
``resume=`` finds them there. Loading goes the other way: the driver reads the checkpoint and
ships it to the actor.

When the trainer actor dies its calls raise :class:`TrainerLost`; the launcher then builds a
new one and the run goes on from its last checkpoint, up to ``launcher.trainer.max_restarts``
times (:meth:`~orchestrator.launch.ray.RayLauncher.recover`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ray.exceptions import ObjectLostError

from orchestrator.errors import RunAborted, first_line
from orchestrator.launch.ray.actors import ActorInfo, TrainStepResult
from orchestrator.launch.ray.remote import RayActorError, result, result_now
from orchestrator.launch.ray.spans import Reply, SpanCollector
from orchestrator.trainer.base import Forwarded, TrainStats
from orchestrator.trainer.proxy import Answer, TrainerProxy
from orchestrator.types import Group
from orchestrator.weights.update import WeightUpdate


class TrainerLost(RunAborted):
    """The trainer's actor died (the launcher restarts it from the last checkpoint while
    ``launcher.trainer.max_restarts`` allows)."""


class RayTrainer(TrainerProxy):
    """The trainer actor's proxy; its forwarded methods go to :meth:`TrainerActor.call`; the
    spans its replies bring go to ``spans`` (the actor is watched there as ``name``)."""

    def __init__(self, actor: Any, info: ActorInfo, spans: SpanCollector,
                 name: str = "trainer") -> None:
        self.actor = actor
        self.info = info
        self.spans = spans
        self.name = name
        self.version = info.version
        self._death: str | None = None  # what the first failed call found: later ones repeat it

    def _lost(self, doing: str, error: RayActorError) -> TrainerLost:
        if self._death is None:
            self._death = (
                f"the trainer actor (pid {self.info.pid} on Ray node {self.info.node[:8]}, "
                f"{self.info.ip}) died (found by {doing}: {first_line(error)})")
        return TrainerLost(self._death)

    async def _call(self, doing: str, ref: Any) -> Any:
        try:
            return await result(ref)
        except RayActorError as error:
            raise self._lost(doing, error) from error

    def _call_now(self, doing: str, ref: Any) -> Any:
        try:
            return result_now(ref)
        except RayActorError as error:
            raise self._lost(doing, error) from error

    async def _replied(self, doing: str, ref: Any) -> Any:
        """The value of an actor call that replies with its spans, once they are recorded."""
        reply: Reply[Any] = await self._call(doing, ref)
        return await self.spans.receive(self.name, reply)

    async def step(self, groups: Sequence[Group]) -> TrainStats:
        done: TrainStepResult = await self._replied("a train step",
                                                    self.actor.step.remote(list(groups)))
        self.version = done.version
        return done.metrics

    async def weights(self) -> WeightUpdate:
        update: WeightUpdate = await self._replied("a weight update", self.actor.weights.remote())
        return update

    async def _forward(self, method: Forwarded, args: Sequence[Any]) -> Answer:
        done: Answer = await self._replied(
            method.doing, self.actor.call.remote(method.name, tuple(args), with_spans=True))
        return done

    def _forward_now(self, method: Forwarded, args: Sequence[Any]) -> Answer:
        reply: Reply[Answer] = self._call_now(method.doing, self.actor.call.remote(method.name,
                                                                                   tuple(args)))
        return reply.value

    def snapshot(self) -> RemoteSnapshot:
        """The actor's checkpoint state, copied and put into the object store (blocking: call
        it outside the event loop, or in a worker thread); the driver writes it."""
        [ref] = self._call_now("a checkpoint", self.actor.snapshot.remote())
        return RemoteSnapshot(ref)

    def load(self, directory: Path) -> None:
        """Load a checkpoint of the driver's run directory: read here, shipped to the actor
        (whose node need not see the driver's files). A group of trainer ranks' sharded
        checkpoint travels as its files, which the actor loads into its one trainer."""
        from orchestrator.trainer.snapshot import SHARDS, TRAINER_STATE, TrainerSnapshot

        directory = Path(directory)
        if (directory / SHARDS).is_dir():
            files = {str(p.relative_to(directory)): p.read_bytes()
                     for p in [*(directory / SHARDS).rglob("*"), directory / TRAINER_STATE]
                     if p.is_file()}
            self.version = self._call_now("a checkpoint load", self.actor.load_files.remote(files))
            return
        snapshot = TrainerSnapshot.read(directory)
        self.version = self._call_now("a checkpoint load", self.actor.restore.remote(snapshot))


class RemoteSnapshot:
    """A trainer actor's snapshot in the object store, written by the driver."""

    def __init__(self, ref: Any) -> None:
        self.ref = ref

    def write(self, directory: Path) -> Path:
        try:
            snapshot = result_now(self.ref)
        except (RayActorError, ObjectLostError) as error:
            raise TrainerLost(f"the trainer actor died before its checkpoint reached the driver "
                              f"({first_line(error)})") from error
        return snapshot.write(directory)
