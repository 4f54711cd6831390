"""The Ray actors of ``launcher=ray``: one hosts an engine, one the trainer.

Both are asyncio actors (their methods are coroutines, so Ray runs them concurrently on one
event loop in the actor's process) built from the same picklable recipes as in a local run.
Blocking work goes to worker threads as it does in this process: the torch engine's forward
passes and weight loads (``ray.get`` of an object-store update included), the trainer's steps
and its one ``ray.put`` of the new weights per step.

:class:`EngineActor` builds its engine in :meth:`~EngineActor.serve`, a call that lasts as long
as the engine runs, so the driver learns that the actor died the moment that call fails (see
:mod:`orchestrator.launch.ray.engines`). Each actor records its own spans (``engine_start``,
``weight_sync`` with ``bytes`` (pulled: a delta's, or the full update's) and ``seconds``;
``train_compute``, ``supervised_compute``,
``weights_put``, ``checkpoint_copy``). The calls the driver awaits on its event loop (a train
step, a weight update, a forwarded trainer coroutine, an engine's weight load) return them with
their result in a :class:`~orchestrator.launch.ray.spans.Reply`, so they count in the step that
made the call; the driver drains the rest (:mod:`orchestrator.launch.ray.spans`).

With ``engine.delta`` the trainer actor also puts, beside each full update, its delta from the
update before (:class:`~orchestrator.weights.delta.DeltaEncoder`, which keeps the last one in the
wire dtype): an engine actor that holds that version pulls only the delta; any other, or one whose
reconstruction fails its attestation, pulls the full update (:mod:`orchestrator.weights.delta`).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import ray
import torch
from ray.exceptions import ObjectLostError

from orchestrator.engines.base import InferenceEngine
from orchestrator.errors import EngineClosed, RunAborted
from orchestrator.faults import kill_point
from orchestrator.launch.base import EngineRecipe, TrainerRecipe
from orchestrator.launch.ray.spans import Reply, SpanBuffer
from orchestrator.trace.recorder import Span
from orchestrator.trainer.base import Trainer, TrainStats, forwarded_methods
from orchestrator.trainer.proxy import Answer, answer
from orchestrator.types import Generation, Group, SamplingParams
from orchestrator.weights.delta import DeltaEncoder, Loaded
from orchestrator.weights.update import WeightUpdate


class WeightsLost(RunAborted):
    """An engine could not pull weights from the object store: their owner, the trainer actor,
    died."""


@contextmanager
def _pulling(update: WeightUpdate) -> Iterator[None]:
    try:
        yield
    except ObjectLostError as error:
        raise WeightsLost(
            f"the weights of version {update.version} are gone from the object store "
            f"({type(error).__name__}): the trainer actor that put them died") from error


@dataclass(frozen=True)
class ActorInfo:
    """Who answered: the actor's name, process, node and the version it holds (an engine's:
    with the fingerprint of the weights it holds, if it attests)."""

    name: str
    pid: int
    node: str  # Ray node id
    ip: str
    version: int
    fingerprint: str | None = None
    attests: bool = False


@dataclass(frozen=True)
class Synced:
    """An engine actor's answer to a weight update: the fingerprint of the weights it now holds
    and what the load moved."""

    fingerprint: str | None
    loaded: Loaded | None


@dataclass(frozen=True)
class TrainStepResult:
    metrics: TrainStats
    version: int


def _info(name: str, version: int, fingerprint: str | None = None,
          attests: bool = False) -> ActorInfo:
    return ActorInfo(name, os.getpid(), ray.get_runtime_context().get_node_id(),
                     ray.util.get_node_ip_address(), version, fingerprint, attests)


class _Reporting:
    """What the driver asks of every actor: its clock (for the offset), its pid (to tell a
    restart) and the spans it recorded since the last drain."""

    _spans: SpanBuffer

    async def ping(self) -> float:
        return time.time()

    async def pid(self) -> int:
        return os.getpid()

    async def drain_spans(self) -> list[Span]:
        return self._spans.drain()


class EngineActor(_Reporting):
    """One engine (any ``InferenceEngine`` its recipe names) in a Ray actor."""

    def __init__(self, recipe: EngineRecipe, name: str, threads: int) -> None:
        torch.set_num_threads(threads)
        # Weight loads call ray.get in a worker thread, never on the event loop; Ray's warning
        # about blocking calls inside asyncio actors does not apply.
        os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = "0"
        self._recipe = recipe
        self._name = name
        self._spans = SpanBuffer(name)
        self._engine: InferenceEngine | None = None
        self._serving = False
        self._up = anyio.Event()  # the engine runs, or failed to start (_error)
        self._stop = anyio.Event()
        self._stopped = anyio.Event()
        self._error: BaseException | None = None
        self._inflight = 0
        # a fault point naming this actor fires in its first life, not again once Ray restarts it
        self._first_life = not ray.get_runtime_context().was_current_actor_reconstructed

    async def serve(self, weights: WeightUpdate) -> None:
        """Build the engine from the recipe and ``weights`` and run it until :meth:`stop`.

        A second call while the engine runs (the driver lost sight of this actor for a while)
        waits with the first instead of building another engine.
        """
        if self._serving:
            await self._stopped.wait()
            return
        self._serving = True
        try:
            with self._spans.span("engine_start", weights.version) as attrs, _pulling(weights):
                local = await anyio.to_thread.run_sync(weights.detached)  # the pull, off the loop
                engine = self._recipe.build(local)
                del local  # the engine copied them: do not pin the starting weights in the store
                attrs.update(bytes=weights.nbytes, transport=weights.transport)
            async with engine:
                self._engine = engine
                self._up.set()
                await self._stop.wait()
        except BaseException as error:
            self._error = error
            self._up.set()
            raise
        finally:
            self._engine = None
            self._stopped.set()

    async def ready(self) -> ActorInfo:
        """Return once :meth:`serve` has its engine running (or raise why it could not)."""
        await self._up.wait()
        if self._error is not None:
            raise self._error
        engine = self._running()
        return _info(self._name, engine.version, await engine.attested(), engine.attests)

    async def stop(self) -> None:
        self._stop.set()
        if self._serving:
            await self._stopped.wait()

    def _running(self) -> InferenceEngine:
        if self._engine is None:
            raise EngineClosed(f"{self._name} has no running engine")
        return self._engine

    # -- InferenceEngine, forwarded ------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        engine = self._running()
        self._inflight += 1
        try:
            if self._first_life:
                kill_point(f"{self._name}.generate", engine.version)  # tests: a request in flight
            return await engine.generate(prompt_ids, sampling)
        finally:
            self._inflight -= 1

    async def update_weights(self, update: WeightUpdate) -> Reply[Synced]:
        """Load ``update``; the reply is the fingerprint of the weights the engine now holds
        and what the load pulled."""
        engine = self._running()
        started = time.time()
        engine.last_load = None
        with self._spans.span("weight_sync", update.version) as attrs, _pulling(update):
            await engine.update_weights(update)  # the torch engine pulls and loads in a thread
            loaded = engine.last_load
            attrs.update(bytes=loaded.nbytes if loaded else update.nbytes,
                         seconds=time.time() - started, transport=update.transport,
                         delta=bool(loaded and loaded.delta))
        return self._spans.reply(Synced(await engine.attested(), loaded))

    async def pause(self) -> None:
        await self._running().pause()

    async def resume(self) -> None:
        await self._running().resume()

    async def sleep(self) -> None:
        await self._running().sleep()

    async def version(self) -> int:
        return self._running().version

    # -- for the driver ------------------------------------------------------------------

    async def inflight(self) -> int:
        return self._inflight


class TrainerActor(_Reporting):
    """The trainer its recipe names, in a Ray actor; hands out weights through the object store."""

    def __init__(self, recipe: TrainerRecipe, name: str, threads: int) -> None:
        self._recipe = recipe
        self._name = name
        self._threads = threads
        self._spans = SpanBuffer(name)
        self._trainer: Trainer | None = None
        self._delta = DeltaEncoder() if recipe.weight_delta else None

    async def start(self) -> ActorInfo:
        """Build the trainer (a method, not the constructor: its errors reach the driver as
        themselves)."""
        if self._recipe.torch_threads is None:
            torch.set_num_threads(self._threads)
        self._trainer = self._recipe.build()
        return _info(self._name, self._trainer.version)

    def _built(self) -> Trainer:
        if self._trainer is None:
            raise RuntimeError(f"{self._name} was not started")
        return self._trainer

    async def step(self, groups: Sequence[Group]) -> Reply[TrainStepResult]:
        """One train step; its ``train_compute`` span comes back with its result."""
        trainer = self._built()
        with self._spans.span("train_compute", trainer.version,
                              samples=sum(len(g) for g in groups)):
            metrics = await trainer.step(groups)
        self._recipe.release_cached_memory()
        return self._spans.reply(TrainStepResult(metrics, trainer.version))

    async def weights(self) -> Reply[WeightUpdate]:
        """The current weights, put once into the object store (every engine pulls them), and
        the ``weights_put`` span."""
        update = await self._built().weights()
        with self._spans.span("weights_put", update.version) as attrs:
            # a view that keeps the update's adapters (LoRA), stats and wire dtype
            shared = await anyio.to_thread.run_sync(update.unleased().to_object_store)
            attrs["bytes"] = shared.nbytes
        update.release()  # in the loop that made its lease; the store holds a copy
        if self._delta is not None and shared.adapters is None:  # LoRA: adapters travel whole
            with self._spans.span("weights_delta", update.version) as attrs:
                shared = await anyio.to_thread.run_sync(self._with_delta, shared)
                attrs["bytes"] = shared.delta.nbytes if shared.delta else shared.nbytes
        self._recipe.release_cached_memory()
        return self._spans.reply(shared)

    def _with_delta(self, shared: WeightUpdate) -> WeightUpdate:
        """``shared`` with its delta from the last update, also in the store (encoded from the
        store's copy: the wire dtype the engines hold)."""
        assert self._delta is not None
        delta = self._delta.encode(shared.version, shared.tensors(), shared.fingerprint)
        return shared.with_delta(delta.to_object_store() if delta is not None else None)

    async def call(self, name: str, args: Sequence[Any], with_spans: bool = False) -> Reply[Answer]:
        """A forwarded :class:`Trainer` method (:mod:`orchestrator.trainer.proxy`), in the span
        its declaration names (``supervised_compute`` for the warm start's steps). The spans
        come back with the answer if ``with_spans`` (a caller on the driver's event loop,
        which can record them); else they wait for a drain."""
        trainer = self._built()
        method = forwarded_methods().get(name)
        span = method.span if method is not None else None
        with self._spans.span(span, trainer.version) if span else nullcontext():
            done = await answer(trainer, name, args)
        return self._spans.reply(done) if with_spans else Reply(done)

    async def snapshot(self) -> list[Any]:
        """The trainer's checkpoint state, copied before this returns (so no step can change
        it) and put into the object store for the driver to write: ``[ref]`` (a ref in a list
        is handed back as a ref, not fetched)."""
        with self._spans.span("checkpoint_copy", self._built().version):
            snapshot = self._built().snapshot()
        return [await anyio.to_thread.run_sync(ray.put, snapshot)]

    async def restore(self, snapshot: Any) -> int:
        """Load a checkpoint the driver read from the run directory; returns its version."""
        trainer = self._built()
        await anyio.to_thread.run_sync(trainer.restore, snapshot)  # type: ignore[attr-defined]
        return trainer.version

    async def load_files(self, files: Mapping[str, bytes]) -> int:
        """Load a checkpoint shipped as its files (a group of ranks' shards: read at any
        world size); returns its version."""
        trainer = self._built()

        def load() -> None:
            with tempfile.TemporaryDirectory(prefix="polyrl-checkpoint-") as folder:
                for name, data in files.items():
                    path = Path(folder) / name
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(data)
                trainer.load(Path(folder))

        await anyio.to_thread.run_sync(load)
        return trainer.version

    async def version(self) -> int:
        return self._built().version
