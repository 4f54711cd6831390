"""The calibrated replay engine: a continuously-batched server model in (virtual) time.

:func:`replay_engine` builds a :class:`~orchestrator.engines.simulated.SimulatedEngine` from
two parts defined here. :class:`PlanReplies` says what a request generates: its token counts
come from the episode plan it belongs to (see :mod:`envs.replay`): the prompt's first token
names the plan, the number of observation markers in the prompt is the turn (the id layout is
:mod:`orchestrator.replay.tokenizer`'s). :class:`FluidServer` says how long it takes: it runs
:class:`~orchestrator.replay.model.ServerModel` in one loop (one task, started by
``async with engine``) that advances the model to the next event with ``anyio.sleep``-style
waits, so under trio's ``MockClock`` (see :func:`orchestrator.replay.run.run_virtual`) a whole
step takes no real time and a few CPU seconds; on a real clock it runs in real time.

Generated tokens are placeholders (``FILL``, then a stop token unless the turn hit its
length cap), with behaviour log-probs of ``-1.0``. Each token is stamped with the version the
server held when it was decoded: a weight update notes how many tokens every request in flight
had decoded (the fluid model's progress, rounded down), and the tokens after that carry the new
version, so a request that crosses updates under ``inflight_update=continue`` has the
per-token versions a real engine would give it. ``pause`` freezes the server; a weight
update carries no weights (the simulated trainer has none), only its version, and takes
``sync_seconds`` to load.

One engine is one server (one replica). Several behind
:class:`~orchestrator.engines.router.EngineRouter` are a cluster; with ``cache_affinity`` an
engine serves a later turn of an episode from its prefix cache (the turn's recorded
``cached_tokens``) only if it served the episode's previous turn, and prefills the whole
prompt otherwise (routing that scatters an episode's turns pays for it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import cast

import anyio

from envs.replay import EpisodePlan
from orchestrator.engines.base import InferenceEngine
from orchestrator.engines.router import EngineRouter, EpisodeAffinity
from orchestrator.engines.simulated import Replies, Reply, SimulatedEngine, Timing
from orchestrator.errors import EngineClosed
from orchestrator.replay.model import RequestSpec, ServerModel, ServerParams
from orchestrator.replay.tokenizer import FILL, plan_key, turn_of
from orchestrator.types import FinishReason, SamplingParams


def replay_engine(plans: Mapping[int, EpisodePlan], params: ServerParams,
                  sync_seconds: float = 0.0, version: int = 0,
                  cache_affinity: bool = False) -> SimulatedEngine:
    """One replica of the fitted server ``params``, serving the prompts of ``plans``."""
    return SimulatedEngine(PlanReplies(plans, cache_affinity), FluidServer(params),
                           version=version, sync_seconds=sync_seconds)


def replay_router(plans: Mapping[int, EpisodePlan], params: ServerParams, engines: int,
                  routing: str = "least_loaded", sticky: bool = True, sync_seconds: float = 0.0,
                  version: int = 0) -> EngineRouter:
    """``engines`` replicas of ``params``, each with its prefix cache, behind one router:
    ``routing``, ties broken by the fewest resident tokens; ``sticky``: an episode's later turns
    go to the replica of its previous one."""
    replicas = [replay_engine(plans, params, sync_seconds, version, cache_affinity=True)
                for _ in range(engines)]
    servers = [_server(e) for e in replicas]
    return EngineRouter(replicas, names=[f"replica-{i}" for i in range(engines)],
                        routing=routing, affinity=EpisodeAffinity(_episode) if sticky else None,
                        tiebreak=lambda replica: servers[replica.index].resident_tokens)


def busy_seconds(engine: InferenceEngine) -> float:
    """Seconds the replicas of ``engine`` (one, or a router's) spent prefilling or decoding."""
    return sum(_server(e).model.busy for e in _replicas(engine))


def cache_misses(engine: InferenceEngine) -> int:
    """Later turns the replicas of ``engine`` prefilled in full (their episode's previous turn
    was served elsewhere)."""
    return sum(_plans(e).cache_misses for e in _replicas(engine))


def _replicas(engine: InferenceEngine) -> list[SimulatedEngine]:
    """The replay's engines behind ``engine`` (one, or a router's replicas): every one a
    :class:`SimulatedEngine` with the fluid server model and plan replies (``replay_parts``
    builds no other)."""
    return cast(list[SimulatedEngine], engine.engines)


def _server(engine: SimulatedEngine) -> FluidServer:
    assert isinstance(engine.timing, FluidServer), "not a replay engine"
    return engine.timing


def _plans(engine: SimulatedEngine) -> PlanReplies:
    assert isinstance(engine.replies, PlanReplies), "not a replay engine"
    return engine.replies


def _episode(prompt_ids: Sequence[int]) -> tuple[int | None, int]:
    """A replay prompt's episode (its plan key) and turn."""
    return plan_key(prompt_ids), turn_of(prompt_ids)


class PlanReplies(Replies):
    """A turn's recorded completion, capped at ``max_tokens``; its recorded prefix-cache hit."""

    fill = FILL

    def __init__(self, plans: Mapping[int, EpisodePlan], cache_affinity: bool = False) -> None:
        self.plans = plans
        self.cache_affinity = cache_affinity
        self._last_turn: dict[int, int] = {}  # plan key -> the last turn served here
        self.cache_misses = 0  # later turns prefilled in full (cache_affinity only)

    def _shape(self, prompt_ids: Sequence[int]) -> tuple[EpisodePlan, int]:
        key = plan_key(prompt_ids)
        if key is None or key not in self.plans:
            raise ValueError("a replay engine serves only prompts of replay plans (envs.replay)")
        plan = self.plans[key]
        return plan, min(turn_of(prompt_ids), len(plan.turns) - 1)

    def _cached(self, plan: EpisodePlan, turn: int) -> int:
        """Prompt tokens this engine serves from its prefix cache."""
        cached = plan.turns[turn].cached_tokens
        if self.cache_affinity:
            hit = turn == 0 or self._last_turn.get(plan.key) == turn - 1
            self._last_turn[plan.key] = turn
            if not hit and cached:
                self.cache_misses += 1
                return 0
        return cached

    def reply(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Reply:
        plan, turn = self._shape(prompt_ids)
        shape = plan.turns[turn]
        n = max(1, min(shape.completion_tokens, sampling.max_tokens))
        capped = shape.completion_tokens >= sampling.max_tokens or shape.finish_reason == "length"
        cached = self._cached(plan, turn)
        return Reply(n, FinishReason.LENGTH if capped else FinishReason.STOP,
                     len(prompt_ids), len(prompt_ids) - cached, cached)

    def metrics(self) -> dict[str, float]:
        return {"replay/cache_misses": float(self.cache_misses)}


class FluidServer(Timing):
    """:class:`ServerModel` driven in (virtual) time by one loop task."""

    def __init__(self, params: ServerParams) -> None:
        self.params = params
        self.model = ServerModel(params)
        self._waiting: dict[int, tuple[anyio.Event, int]] = {}  # rid -> (done, start version)
        self._marks: dict[int, list[tuple[int, int]]] = {}  # rid -> (tokens decoded, new version)
        self._finished: set[int] = set()
        self._wake = anyio.Event()
        self._ids = 0
        self._running = False
        self._origin = 0.0

    # -- lifecycle ---------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The server's clock loop, while its engine is entered; waiters see it closed after."""
        self._origin = anyio.current_time()
        async with anyio.create_task_group() as tg:
            self._running = True
            tg.start_soon(self._loop, name="replay-engine")
            try:
                yield
            finally:
                self._running = False
                tg.cancel_scope.cancel()
        for event, _ in self._waiting.values():
            event.set()  # waiters see the engine closed

    def now(self) -> float:
        return anyio.current_time() - self._origin

    async def _loop(self) -> None:
        while True:
            if self._wake.is_set():  # a fresh event only once the last one fired
                self._wake = anyio.Event()
            self._settle(self.model.advance(self.now()))
            event = self.model.next_event()
            if event is None:
                await self._wake.wait()
            else:
                with anyio.move_on_after(max(event - self.now(), 0.0)):
                    await self._wake.wait()

    # -- requests ----------------------------------------------------------------------------

    async def run(self, reply: Reply, replies: Replies,
                  version: Callable[[], int]) -> tuple[int, list[int], list[int]]:
        if not self._running:
            raise EngineClosed("the replay engine is not running (use `async with engine`)")
        n = reply.length
        rid = self._ids
        self._ids += 1
        done = anyio.Event()
        start_version = version()
        self._waiting[rid] = (done, start_version)
        spec = RequestSpec(reply.prompt_tokens, reply.cached_tokens, n)
        self._settle(self.model.submit(self.now(), rid, spec))
        self._wake.set()
        try:
            await done.wait()
        finally:
            self._waiting.pop(rid, None)
            marks = self._marks.pop(rid, [])
        if rid not in self._finished:
            raise EngineClosed("the replay engine closed with the request in flight")
        self._finished.discard(rid)
        versions = [start_version] * n
        for decoded, new in marks:  # tokens decoded after an update carry its version
            if decoded < n:
                versions[decoded:] = [new] * (n - decoded)
        return start_version, replies.tokens(n), versions

    def updated(self, version: int) -> None:
        for rid in self._waiting:  # paused: what each request in flight decoded so far
            if rid not in self._finished:
                self._marks.setdefault(rid, []).append((self.model.decoded(rid), version))

    def _settle(self, finished: list[int]) -> None:
        for rid in finished:
            self._finished.add(rid)
            self._waiting[rid][0].set()

    async def pause(self) -> None:
        self._settle(self.model.advance(self.now()))
        self.model.paused = True

    async def resume(self) -> None:
        self._settle(self.model.advance(self.now()))  # no progress while paused
        self.model.paused = False
        self._wake.set()

    @property
    def resident_tokens(self) -> float:
        return self.model.resident_tokens

    def metrics(self) -> dict[str, float]:
        """Cumulative, on every step's metrics: what the bench reads a steady window from."""
        self._settle(self.model.advance(self.now()))  # the busy time up to now
        return {"replay/engine_busy_s": self.model.busy}
