"""Spans recorded inside Ray actors, brought to the driver's recorder on the driver's clock.

An actor records its spans in wall-clock seconds (``time.time()``) into a :class:`SpanBuffer`
and hands them over two ways:

* **with a reply**: a call the driver awaits on its event loop (the trainer's step, its weight
  update, a forwarded trainer method, an engine's weight load) returns a :class:`Reply`, its
  result and every span the actor holds once the call is done, the call's own included. The
  driver's proxy adds them to the recorder (:meth:`SpanCollector.receive`) before it returns,
  so they count in the step that made the call, as an in-process trainer's would: the
  pipeline's step report sums the spans recorded since the previous report.
* **drained**: the rest (an engine's start, a checkpoint's copy, what a blocking call
  recorded) wait for :meth:`SpanCollector.drain` (the actor's ``drain_spans``), which the
  engine router runs every ``launcher.span_flush_s`` seconds and once more at close; they
  count in the step during which they arrive.

On the driver, a :class:`SpanCollector` estimates each actor's clock offset with pings (the
driver reads ``t0``, the actor its clock, the driver ``t2``: ``offset = t_actor - (t0 + t2) /
2``, keeping the reading with the shortest round trip of a few) and adds the spans to the run's
:class:`~orchestrator.trace.recorder.Recorder` shifted onto its timeline. Every such span names its
``node`` (the Ray node id), its ``actor`` and its ``process`` (``node-<id>/<actor>``), and the
timeline gives each process a track group of its own.

Limits: spans an actor had not handed over when it died are lost with it; an actor's offset is
measured once per incarnation (at its first reply or drain), so a clock that drifts during a
long run drifts on the timeline too (NTP keeps machines within milliseconds). A span that
arrives with a reply counts in the step of the call it came back from, which is its own step
only for the calls a step awaits (the trainer's); an engine's weight load counts in the step
whose report follows the sync, as the driver's own ``weight_sync`` span does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio
import ray
from ray.exceptions import RayActorError

from orchestrator.trace.recorder import Recorder, Span

log = logging.getLogger(__name__)

PINGS = 3  # clock readings per offset estimate; the one with the shortest round trip wins
T = TypeVar("T")


@dataclass(frozen=True)
class Reply(Generic[T]):
    """An actor call's result and the spans its actor recorded until the call was done (the
    call's own among them), for the driver to record before it hands the result on."""

    value: T
    spans: tuple[Span, ...] = ()


class SpanBuffer:
    """An actor's spans until the driver drains them; knows the node and actor they come from."""

    def __init__(self, actor: str) -> None:
        node = ray.get_runtime_context().get_node_id()
        self.actor = actor
        self.where = {"node": node, "actor": actor, "process": f"node-{node[:8]}/{actor}"}
        self._spans: list[Span] = []  # times: seconds of this actor's own wall clock

    def add(self, stage: str, start: float, end: float, version: int | None = None,
            **attributes: Any) -> None:
        self._spans.append(Span(stage, self.actor, start, end, version,
                                {**attributes, **self.where}))

    @contextmanager
    def span(self, stage: str, version: int | None = None, **attributes: Any) -> Iterator[dict[str, Any]]:
        """Time the body on the wall clock; the yielded dict collects attributes known at the end."""
        start = time.time()
        extra = dict(attributes)
        try:
            yield extra
        finally:
            self.add(stage, start, time.time(), version, **extra)

    def drain(self) -> list[Span]:
        spans, self._spans = self._spans, []
        return spans

    def reply(self, value: T) -> Reply[T]:
        """``value`` with every span held here (taken: a later drain does not see them again)."""
        return Reply(value, tuple(self.drain()))


async def clock_offset(actor: Any) -> float:
    """The actor's wall clock minus the driver's, from the ping with the shortest round trip
    (the actor answers ``ping`` with its ``time.time()``)."""
    best: tuple[float, float] | None = None
    for _ in range(PINGS):
        t0 = time.time()
        reading = await actor.ping.remote()
        t2 = time.time()
        if best is None or t2 - t0 < best[0]:
            best = (t2 - t0, reading - (t0 + t2) / 2)
    assert best is not None
    return best[1]


class SpanCollector:
    """Driver side: the actors whose spans go to the run's recorder, and their clock offsets.

    Spans drained before a recorder is attached (:meth:`record_to`) wait here for it.
    """

    def __init__(self) -> None:
        self.recorder: Recorder | None = None
        self._sources: dict[str, tuple[Any, float | None]] = {}
        self._waiting: list[tuple[Span, float]] = []

    def record_to(self, recorder: Recorder) -> None:
        self.recorder = recorder
        waiting, self._waiting = self._waiting, []
        for span, offset in waiting:
            self._add(span, offset)

    def watch(self, name: str, actor: Any, offset: float | None = None) -> None:
        """Drain ``actor`` from now on, and take its replies' spans (:meth:`receive`); its clock
        offset is measured at the first of them unless given (watch it again after a restart:
        a new process, a new offset)."""
        self._sources[name] = (actor, offset)

    async def _offset(self, name: str) -> float:
        entry = self._sources[name]
        actor, offset = entry
        if offset is None:
            offset = await clock_offset(actor)
            if self._sources.get(name) is entry:  # not watched again meanwhile (a restart)
                self._sources[name] = (actor, offset)
        return offset

    async def drain(self, name: str) -> None:
        actor, _ = self._sources[name]
        try:
            offset = await self._offset(name)
            spans: list[Span] = await actor.drain_spans.remote()
        except RayActorError:  # died or restarting: what it held is lost, its keeper knows
            return
        for span in spans:
            self._add(span, offset)

    async def receive(self, name: str, reply: Reply[T]) -> T:
        """Record the spans ``reply`` brought from the actor watched as ``name`` now, on the
        event loop that awaited it, and return its value: the caller goes on once they count.
        An actor that dies before its clock is read loses them, as a drain would (its next
        call says it died)."""
        if reply.spans:
            try:
                offset = await self._offset(name)
            except RayActorError:
                log.debug("%s: %d spans lost with the actor", name, len(reply.spans))
                return reply.value
            for span in reply.spans:
                self._add(span, offset)
        return reply.value

    async def drain_all(self) -> None:
        async with anyio.create_task_group() as tg:
            for name in list(self._sources):
                tg.start_soon(self.drain, name)

    async def run(self, period: float) -> None:
        """Drain every ``period`` seconds until cancelled."""
        while True:
            await anyio.sleep(period)
            await self.drain_all()

    def _add(self, span: Span, offset: float) -> None:
        if self.recorder is None:
            self._waiting.append((span, offset))
            return
        # actor wall clock -> driver wall clock -> the recorder's timeline
        shift = offset + self.recorder.wall_origin
        self.recorder.add(span.stage, span.worker, span.start - shift, span.end - shift,
                          span.version, **span.attributes)
