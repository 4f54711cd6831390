"""Engines in Ray actors, seen by the pipeline as one ``InferenceEngine``.

:class:`RayEngine` is the driver's proxy for one :class:`~.actors.EngineActor`: it forwards
``generate``, ``pause``, ``update_weights`` and ``resume``, and raises :class:`EngineActorLost`
when the actor cannot be reached. :func:`ray_router` puts any number of them behind the one
:class:`~orchestrator.engines.router.EngineRouter` (the replay's router too), with

* **Routing.** A request goes to the engine with the fewest requests in flight, unless an
  engine already took a prompt sharing its prefix and has at most ``affinity_slack`` more in
  flight than that one (:class:`~orchestrator.engines.router.PrefixAffinity`), so a group's
  samples and an episode's later turns find the engine that holds their prefix; an engine with
  a prefix cache (vLLM) serves them from it, and the torch engine batches a group in one wave.
* **Weight sync.** ``pause``, ``update_weights`` and ``resume`` go to every running engine at
  once. The update is an object-store handle: each actor pulls the weights itself, and its
  ``weight_sync`` span comes back with the reply (recorded before the sync ends, in the step
  that reports the driver's own ``weight_sync``; :mod:`~.spans`).
* **Faults** (:class:`RayKeeper`). A keeper task per engine holds the actor's long ``serve``
  call. When the actor dies that call fails; Ray restarts the process (``max_restarts=-1``);
  the keeper pings until it answers, starts an engine there from the latest weights and only
  then routes to it again. Engines joining hold the
  :class:`~orchestrator.engines.rwlock.ReadWriteLock`'s shared side and a weight sync its exclusive
  side, so an engine never joins with weights older than the others'. A request in flight on a lost
  engine fails with a Ray actor error and runs again on another engine: its episode goes on from the
  same tokens and nothing the lost engine generated is kept. Counters (:meth:`RayKeeper.metrics`):
  ``faults/engine_restarts`` (engines lost, each restarted by Ray; counted when the loss is seen)
  and
  ``faults/episodes_rerun`` (requests run again, one turn of an episode each).

Limits: an engine that does not come back within ``restart_timeout_s`` is left out for the rest
of the run (with a warning); with none running, a request waits that long and then fails with
:class:`~orchestrator.engines.router.EnginesLost`. Requests are never split across engines
mid-generation.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
from anyio.abc import TaskStatus

from orchestrator.engines.base import InferenceEngine
from orchestrator.engines.router import EngineRouter, EnginesLost, Keeper, PrefixAffinity, Replica
from orchestrator.engines.rwlock import ReadWriteLock
from orchestrator.errors import EngineClosed, RunAborted, first_line
from orchestrator.launch.ray.actors import ActorInfo, Synced
from orchestrator.launch.ray.remote import RayActorError, result
from orchestrator.launch.ray.spans import Reply, SpanCollector
from orchestrator.types import Generation, SamplingParams
from orchestrator.weights.delta import LoadCounter
from orchestrator.weights.update import WeightUpdate

log = logging.getLogger(__name__)
__all__ = ["EngineActorLost", "EnginesLost", "RayEngine", "RayKeeper", "ray_router"]

PING_INTERVAL_S = 0.2  # between pings of an actor that Ray is restarting
STOP_TIMEOUT_S = 10.0  # at close: for the last spans and the engines' shutdown


class EngineActorLost(RunAborted):
    """An engine actor could not be reached (dead, restarting, or cut off)."""


class RayEngine(InferenceEngine):
    """The driver's proxy for one engine actor (the router starts and stops its engine); the
    spans its replies bring go to ``spans``, where the keeper watches the actor as ``name``."""

    def __init__(self, actor: Any, name: str, spans: SpanCollector,
                 colocated: bool = False) -> None:
        self.actor = actor
        self.name = name
        self.spans = spans
        self.colocated = colocated  # launcher.colocate: only then does sleep() reach the actor
        self.version = 0
        self.info: ActorInfo | None = None
        self.pid: int | None = None
        self.loads = LoadCounter()  # what its loads pulled (engine.delta: deltas, fallbacks)

    async def _call(self, ref: Any) -> Any:
        try:
            return await result(ref)
        except RayActorError as error:
            raise EngineActorLost(f"{self.name}: {first_line(error)}") from error
        except EngineClosed as error:  # Ray restarted the actor and it has no engine yet
            raise EngineActorLost(f"{self.name}: {error}") from error

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        generation: Generation = await self._call(
            self.actor.generate.remote(list(prompt_ids), sampling))
        return generation

    @property
    def attests(self) -> bool:
        """Whether the actor's engine attests (known once :meth:`start` has answered)."""
        return self.info is not None and self.info.attests

    async def update_weights(self, update: WeightUpdate) -> None:
        reply: Reply[Synced] = await self._call(self.actor.update_weights.remote(update))
        synced = await self.spans.receive(self.name, reply)
        self.fingerprint = synced.fingerprint  # the actor's own reading
        self.version = update.version
        if synced.loaded is not None:
            self.last_load = synced.loaded
            self.loads.add(synced.loaded, offered=update.delta is not None)

    def metrics(self) -> dict[str, float]:
        return self.loads.metrics()

    async def pause(self) -> None:
        await self._call(self.actor.pause.remote())

    async def resume(self) -> None:
        await self._call(self.actor.resume.remote())

    async def sleep(self) -> None:
        if self.colocated:  # else nothing to give back: no round trip to the actor every step
            await self._call(self.actor.sleep.remote())

    async def start(self, weights: WeightUpdate) -> Any:
        """Start the actor's engine from ``weights`` (or find it running); returns the ref of
        the ``serve`` call, which fails when the actor is lost and returns when it stops."""
        serving = self.actor.serve.remote(weights)
        self.info = await self._call(self.actor.ready.remote())
        self.pid = self.info.pid
        self.version, self.fingerprint = self.info.version, self.info.fingerprint
        return serving

    async def stop(self) -> None:
        try:
            await self._call(self.actor.stop.remote())
        except EngineActorLost:
            pass

    async def answering(self) -> int:
        """Ping until the actor answers (Ray restarts a dead one); its process id."""
        while True:
            try:
                pid: int = await self._call(self.actor.pid.remote())
                return pid
            except EngineActorLost:
                await anyio.sleep(PING_INTERVAL_S)


class RayKeeper(Keeper):
    """Engines in actors: started on the latest weights, restarted by Ray when lost."""

    lost_errors = (EngineActorLost,)

    def __init__(self, weights: WeightUpdate, spans: SpanCollector,
                 restart_timeout_s: float = 120.0, span_flush_s: float = 5.0) -> None:
        super().__init__()
        self.restart_timeout_s = restart_timeout_s
        self.span_flush_s = span_flush_s
        self.engine_restarts = 0
        self.requests_rerun = 0
        self._latest = weights
        self._spans = spans
        self._gate = ReadWriteLock()  # shared: an engine joining; exclusive: a weight sync
        self._lost: dict[str, anyio.Event] = {}  # engine -> set when its incarnation is lost
        self._router: EngineRouter | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self, router: EngineRouter) -> AsyncIterator[None]:
        """Every engine started at once (a failure ends the run), kept up while the router
        runs, then stopped (their last spans drained first, within STOP_TIMEOUT_S)."""
        self._router = router
        try:
            async with anyio.create_task_group() as task_group:
                async with anyio.create_task_group() as starting:  # every engine starts at once
                    for replica in router.replicas:
                        starting.start_soon(task_group.start, self._keep, replica)
                task_group.start_soon(self._spans.run, self.span_flush_s)
                try:
                    yield
                finally:
                    self._closed = True
                    with anyio.move_on_after(STOP_TIMEOUT_S, shield=True):
                        await self._spans.drain_all()  # every actor's last spans, trainer's too
                        async with anyio.create_task_group() as stopping:
                            for replica in router.replicas:
                                stopping.start_soon(_engine(replica).stop)
                    task_group.cancel_scope.cancel()
        finally:
            self._closed = True

    # -- keeping engines up ----------------------------------------------------------------

    async def _keep(self, replica: Replica, *,
                    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        serving = await self._join(replica)  # the first start: any failure ends the run
        task_status.started()
        while await self._lost_sight(replica, serving):
            self.engine_restarts += 1  # its process is gone or cut off: Ray restarts it
            revived = await self._revive(replica)
            if revived is None:
                return
            serving = revived

    async def _join(self, replica: Replica) -> Any:
        """Start the engine on the latest weights and route to it; the ref of its serve call."""
        engine = _engine(replica)
        assert self._router is not None
        async with self._gate:
            # a new process, a new clock offset: watched before its first reply brings spans
            self._spans.watch(engine.name, engine.actor)
            serving = await engine.start(self._latest)
            if engine.version != self._latest.version:  # it missed a sync while cut off
                await engine.pause()
                try:
                    await engine.update_weights(self._latest)
                finally:
                    await engine.resume()
            self._lost[replica.name] = anyio.Event()
            self._router.joined(replica)
        log.info("%s serves version %d (pid %s)", engine.name, engine.version, engine.pid)
        return serving

    async def _lost_sight(self, replica: Replica, serving: Any) -> bool:
        """Wait until the engine's serve call ends: True when the actor was lost (or a call to
        it failed), False when it was stopped."""
        stopped = False
        lost = self._lost[replica.name]
        async with anyio.create_task_group() as tg:

            async def serve_ends() -> None:
                nonlocal stopped
                try:
                    await result(serving)
                    stopped = True
                except RayActorError:
                    lost.set()
                tg.cancel_scope.cancel()

            tg.start_soon(serve_ends)
            await lost.wait()
            tg.cancel_scope.cancel()
        return not stopped

    async def _revive(self, replica: Replica) -> Any | None:
        engine = _engine(replica)
        replica.up = False
        with anyio.move_on_after(self.restart_timeout_s):
            while True:
                pid = await engine.answering()
                if pid != engine.pid:
                    log.warning("%s restarted by Ray (pid %s -> %s)", engine.name, engine.pid, pid)
                    engine.pid = pid
                try:
                    return await self._join(replica)
                except EngineActorLost:
                    continue  # lost again while starting
        log.warning("%s did not come back within launcher.engine_restart_timeout_s=%g; "
                    "the run goes on without it", engine.name, self.restart_timeout_s)
        return None

    # -- the router's calls ----------------------------------------------------------------

    def lose(self, replica: Replica, incarnation: int, error: BaseException,
             rerun: bool) -> None:
        if rerun:
            self.requests_rerun += 1
        if replica.incarnation == incarnation and replica.up:
            log.warning("lost %s; its requests run again on the other engines: %s",
                        replica.name, error)
            replica.up = False
            self._lost[replica.name].set()

    async def hold(self) -> None:
        await self._gate.acquire_exclusive()  # engines joining finish first; none start

    async def release(self) -> None:
        await self._gate.release_exclusive()

    def prepare(self, update: WeightUpdate) -> WeightUpdate:
        if update.transport != "object_store":  # engines in other processes pull from the store
            update = update.to_object_store()
        self._latest = update
        return update

    def metrics(self) -> dict[str, float]:
        return {"faults/engine_restarts": float(self.engine_restarts),
                "faults/episodes_rerun": float(self.requests_rerun)}


def _engine(replica: Replica) -> RayEngine:
    assert isinstance(replica.engine, RayEngine)
    return replica.engine


def ray_router(engines: Sequence[RayEngine], weights: WeightUpdate, spans: SpanCollector,
               restart_timeout_s: float = 120.0, span_flush_s: float = 5.0,
               affinity_slack: int | None = 8) -> EngineRouter:
    """The engines behind one router: least-loaded with prefix affinity, kept by Ray."""
    return EngineRouter(engines, names=[e.name for e in engines],
                        affinity=PrefixAffinity(affinity_slack),
                        keeper=RayKeeper(weights, spans, restart_timeout_s, span_flush_s),
                        version=weights.version)
