"""Engines in Ray actors, seen by the pipeline as one ``InferenceEngine``.

:class:`RayEngine` is the driver's proxy for one :class:`~.actors.EngineActor`: it forwards
``generate``, ``pause``, ``update_weights`` and ``resume``, and raises :class:`EngineActorLost`
when the actor cannot be reached. :class:`EngineRouter` puts any number of them behind the one
interface the pipeline knows:

* **Routing.** A request goes to the engine with the fewest requests in flight, unless an
  engine already took a prompt sharing its prefix and has at most ``affinity_slack`` more in
  flight than that one. Prefixes are hashed in blocks of :data:`BLOCK` tokens (the last, partial
  block too), so a group's samples (one prompt) and an episode's later turns (its earlier
  prompt extended) find the engine that holds their prefix; an engine with a prefix cache
  (vLLM) serves them from it, and the torch engine batches a group in one wave.
* **Weight sync.** ``pause``, ``update_weights`` and ``resume`` go to every running engine at
  once; :attr:`EngineRouter.version` is the version of the last completed update. The update is
  an object-store handle: each actor pulls the weights itself.
* **Faults.** A keeper task per engine holds the actor's long ``serve`` call. When the actor
  dies that call fails; Ray restarts the process (``max_restarts=-1``); the keeper pings until
  it answers, starts an engine there from the latest weights and only then routes to it again.
  Engines joining hold the :class:`~orchestrator.gate.Gate`'s shared side and a weight sync
  its exclusive side, so an engine never joins with weights older than the others'. A request
  in flight on a lost engine fails with a Ray actor error and runs again on another engine:
  its episode goes on from the same tokens and nothing the lost engine generated is kept.
  Counters (:meth:`EngineRouter.metrics`): ``faults/engine_restarts`` (engines lost, each
  restarted by Ray; counted when the loss is seen) and ``faults/episodes_rerun`` (requests run
  again, one turn of an episode each).

Limits: an engine that does not come back within ``restart_timeout_s`` is left out for the rest
of the run (with a warning); with none running, a request waits that long and then fails with
:class:`EnginesLost`. Requests are never split across engines mid-generation.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Self

import anyio
from anyio.abc import TaskGroup, TaskStatus

from orchestrator.engines.base import InferenceEngine
from orchestrator.errors import EngineClosed, RunAborted
from orchestrator.gate import Gate
from orchestrator.launch.ray.actors import ActorInfo
from orchestrator.launch.ray.remote import RayActorError, first_line, result
from orchestrator.launch.ray.spans import SpanCollector
from orchestrator.types import Generation, SamplingParams
from orchestrator.weights import WeightUpdate

log = logging.getLogger(__name__)

BLOCK = 16  # tokens per prefix block
MAX_PREFIXES = 1 << 16  # prefix blocks remembered (least recently used dropped)
PING_INTERVAL_S = 0.2  # between pings of an actor that Ray is restarting
STOP_TIMEOUT_S = 10.0  # at close: for the last spans and the engines' shutdown


class EngineActorLost(RunAborted):
    """An engine actor could not be reached (dead, restarting, or cut off)."""


class EnginesLost(RunAborted):
    """No engine actor came back within the restart timeout."""


class RayEngine(InferenceEngine):
    """The driver's proxy for one engine actor (the router starts and stops its engine)."""

    def __init__(self, actor: Any, name: str) -> None:
        self.actor = actor
        self.name = name
        self.version = 0
        self.info: ActorInfo | None = None
        self.pid: int | None = None
        # The router's bookkeeping: routable, which incarnation, and the load it sent here.
        self.up = False
        self.incarnation = 0
        self.inflight = 0
        self.routed = 0
        self.lost = anyio.Event()

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

    async def update_weights(self, update: WeightUpdate) -> None:
        await self._call(self.actor.update_weights.remote(update))
        self.version = update.version

    async def pause(self) -> None:
        await self._call(self.actor.pause.remote())

    async def resume(self) -> None:
        await self._call(self.actor.resume.remote())

    async def start(self, weights: WeightUpdate) -> Any:
        """Start the actor's engine from ``weights`` (or find it running); returns the ref of
        the ``serve`` call, which fails when the actor is lost and returns when it stops."""
        serving = self.actor.serve.remote(weights)
        self.info = await self._call(self.actor.ready.remote())
        self.pid = self.info.pid
        self.version = self.info.version
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


def prefix_blocks(prompt_ids: Sequence[int]) -> list[int]:
    """Chained hashes of the prompt's blocks: entry ``i`` stands for its first ``i + 1`` blocks."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(prompt_ids), BLOCK):
        previous = hash((previous, tuple(prompt_ids[start:start + BLOCK])))
        hashes.append(previous)
    return hashes


class EngineRouter(InferenceEngine):
    """Engines in actors behind one ``InferenceEngine``: routing, weight sync fan-out, restarts."""

    def __init__(self, engines: Sequence[RayEngine], weights: WeightUpdate, spans: SpanCollector,
                 restart_timeout_s: float = 120.0, span_flush_s: float = 5.0,
                 affinity_slack: int | None = 8) -> None:
        self.engines = list(engines)
        self.version = weights.version
        self.restart_timeout_s = restart_timeout_s
        self.span_flush_s = span_flush_s
        self.affinity_slack = affinity_slack
        self.engine_restarts = 0
        self.requests_rerun = 0
        self._latest = weights
        self._spans = spans
        self._gate = Gate()  # shared: an engine joining; exclusive: a weight sync
        self._paused = False
        self._changed = anyio.Event()  # set (and replaced) whenever an engine comes up
        self._prefixes: OrderedDict[int, RayEngine] = OrderedDict()
        self._task_group: TaskGroup | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._task_group = task_group = anyio.create_task_group()
        await task_group.__aenter__()
        try:
            async with anyio.create_task_group() as starting:  # every engine starts at once
                for engine in self.engines:
                    starting.start_soon(task_group.start, self._keep, engine)
        except BaseException:
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(None, None, None)
            self._closed = True
            raise
        task_group.start_soon(self._spans.run, self.span_flush_s)
        return self

    async def aclose(self) -> None:
        if self._closed or self._task_group is None:
            return
        self._closed = True
        with anyio.move_on_after(STOP_TIMEOUT_S, shield=True):
            await self._spans.drain_all()  # the last spans of every actor, trainer included
            async with anyio.create_task_group() as stopping:
                for engine in self.engines:
                    stopping.start_soon(engine.stop)
        self._task_group.cancel_scope.cancel()
        await self._task_group.__aexit__(None, None, None)

    # -- keeping engines up ----------------------------------------------------------------

    async def _keep(self, engine: RayEngine, *,
                    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        serving = await self._join(engine)  # the first start: any failure ends the run
        task_status.started()
        while await self._lost_sight(engine, serving):
            self.engine_restarts += 1  # its process is gone or cut off: Ray restarts it
            revived = await self._revive(engine)
            if revived is None:
                return
            serving = revived

    async def _join(self, engine: RayEngine) -> Any:
        """Start ``engine`` on the latest weights and route to it; the ref of its serve call."""
        async with self._gate:
            serving = await engine.start(self._latest)
            if engine.version != self._latest.version:  # it missed a sync while cut off
                await engine.pause()
                try:
                    await engine.update_weights(self._latest)
                finally:
                    await engine.resume()
            self._spans.watch(engine.name, engine.actor)  # a new process: a new clock offset
            engine.up = True
            engine.incarnation += 1
            engine.lost = anyio.Event()
            self._changed.set()
            self._changed = anyio.Event()
        log.info("%s serves version %d (pid %s)", engine.name, engine.version, engine.pid)
        return serving

    async def _lost_sight(self, engine: RayEngine, serving: Any) -> bool:
        """Wait until the engine's serve call ends: True when the actor was lost (or a call to
        it failed), False when it was stopped."""
        stopped = False
        async with anyio.create_task_group() as tg:

            async def serve_ends() -> None:
                nonlocal stopped
                try:
                    await result(serving)
                    stopped = True
                except RayActorError:
                    engine.lost.set()
                tg.cancel_scope.cancel()

            tg.start_soon(serve_ends)
            await engine.lost.wait()
            tg.cancel_scope.cancel()
        return not stopped

    async def _revive(self, engine: RayEngine) -> Any | None:
        engine.up = False
        with anyio.move_on_after(self.restart_timeout_s):
            while True:
                pid = await engine.answering()
                if pid != engine.pid:
                    log.warning("%s restarted by Ray (pid %s -> %s)", engine.name, engine.pid, pid)
                    engine.pid = pid
                try:
                    return await self._join(engine)
                except EngineActorLost:
                    continue  # lost again while starting
        log.warning("%s did not come back within launcher.engine_restart_timeout_s=%g; "
                    "the run goes on without it", engine.name, self.restart_timeout_s)
        return None

    def _lose(self, engine: RayEngine, incarnation: int, error: EngineActorLost) -> None:
        if engine.incarnation == incarnation and engine.up:
            log.warning("lost %s; its requests run again on the other engines: %s",
                        engine.name, error)
            engine.up = False
            engine.lost.set()

    # -- InferenceEngine -----------------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        blocks = prefix_blocks(prompt_ids)
        failed: dict[str, int] = {}  # engine -> the incarnation that failed this request
        while True:
            engine = await self._choose(blocks, failed)
            incarnation = engine.incarnation
            engine.inflight += 1
            try:
                return await engine.generate(prompt_ids, sampling)
            except EngineActorLost as error:
                failed[engine.name] = incarnation
                self._lose(engine, incarnation, error)
                self.requests_rerun += 1
            finally:
                engine.inflight -= 1

    async def _choose(self, blocks: list[int], failed: dict[str, int]) -> RayEngine:
        try:
            with anyio.fail_after(self.restart_timeout_s):
                while True:
                    candidates = [e for e in self.engines
                                  if e.up and failed.get(e.name) != e.incarnation]
                    if candidates:
                        break
                    await self._changed.wait()
        except TimeoutError:
            raise EnginesLost(
                f"no engine actor was running for launcher.engine_restart_timeout_s="
                f"{self.restart_timeout_s:g} seconds") from None
        chosen = min(candidates, key=lambda e: (e.inflight, e.routed))
        if self.affinity_slack is not None:
            for block in reversed(blocks):  # the longest prefix some engine took
                holder = self._prefixes.get(block)
                if holder is None:
                    continue
                if holder in candidates and holder.inflight <= chosen.inflight + self.affinity_slack:
                    chosen = holder
                break
            for block in blocks:
                self._prefixes[block] = chosen
                self._prefixes.move_to_end(block)
            while len(self._prefixes) > MAX_PREFIXES:
                self._prefixes.popitem(last=False)
        chosen.routed += 1
        return chosen

    async def pause(self) -> None:
        if self._paused:
            return
        await self._gate.acquire_exclusive()  # engines joining finish first; none start
        self._paused = True
        try:
            await self._each(lambda e: e.pause())
        except BaseException:
            self._paused = False
            with anyio.CancelScope(shield=True):
                await self._gate.release_exclusive()
            raise

    async def update_weights(self, update: WeightUpdate) -> None:
        if update.transport != "object_store":  # engines in other processes pull from the store
            update = update.to_object_store()
        self._latest = update
        await self._each(lambda e: e.update_weights(update))
        self.version = update.version

    async def resume(self) -> None:
        if not self._paused:
            return
        try:
            await self._each(lambda e: e.resume())
        finally:
            self._paused = False
            with anyio.CancelScope(shield=True):
                await self._gate.release_exclusive()

    async def _each(self, call: Callable[[RayEngine], Awaitable[None]]) -> None:
        """``call`` on every running engine at once; an engine lost meanwhile is left to its
        keeper, which starts it again on the latest weights."""

        async def one(engine: RayEngine) -> None:
            incarnation = engine.incarnation
            try:
                await call(engine)
            except EngineActorLost as error:
                self._lose(engine, incarnation, error)

        async with anyio.create_task_group() as tg:
            for engine in self.engines:
                if engine.up:
                    tg.start_soon(one, engine)

    def metrics(self) -> dict[str, float]:
        return {"faults/engine_restarts": float(self.engine_restarts),
                "faults/episodes_rerun": float(self.requests_rerun)}
