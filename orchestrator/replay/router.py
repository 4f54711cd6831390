"""A cluster of replay engines behind one ``InferenceEngine``: ``replay.engines=E`` replicas.

Each replica is a :class:`~orchestrator.replay.engine.ReplayEngine` with the fitted server
model, so each has its own batch and throughput curve (``E`` replicas are not one engine
``E`` times faster: a replica holding a long request decodes it at its own batch's speed).
:class:`ReplicaRouter` is the same abstraction as the Ray launcher's
:class:`~orchestrator.launch.ray.engines.EngineRouter` — one engine to the pipeline,
requests routed to replicas, weight sync fanned out — for in-process models with no faults:
an episode is named by its plan key (a prompt's first token), so no prefix hashing is needed.

Routing (``replay.routing``):

* ``least_loaded`` — the replica with the fewest requests in flight (routed to it and not
  yet returned), ties broken by fewest resident tokens, then by order;
* ``round_robin`` — replicas in turn.

With ``replay.sticky`` (the default) a later turn of an episode goes to the replica that
served its previous turn, as a prefix cache wants; without it every turn is routed afresh.
Replicas model their prefix caches (``cache_affinity``): a later turn served by a replica
that did not serve the turn before it prefills its whole prompt.

``pause``, ``update_weights`` and ``resume`` go to every replica at once; a weight load of
``sync_seconds`` therefore costs that once per update, on every replica.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Literal, Self

import anyio

from orchestrator.engines.base import InferenceEngine
from orchestrator.errors import ConfigError
from orchestrator.replay.engine import ReplayEngine
from orchestrator.replay.tokenizer import plan_key, turn_of
from orchestrator.types import Generation, SamplingParams
from orchestrator.weights import WeightUpdate

Routing = Literal["least_loaded", "round_robin"]
ROUTING: tuple[Routing, ...] = ("least_loaded", "round_robin")


class ReplicaRouter(InferenceEngine):
    def __init__(self, engines: Sequence[ReplayEngine], routing: str = "least_loaded",
                 sticky: bool = True) -> None:
        if not engines:
            raise ConfigError("replay.engines must be >= 1")
        if routing not in ROUTING:
            raise ConfigError(f"replay.routing={routing} must be "
                              f"{' or '.join(repr(r) for r in ROUTING)}")
        self.engines = list(engines)
        for engine in self.engines:
            engine.cache_affinity = True
        self.routing = routing
        self.sticky = sticky
        self.version = self.engines[0].version
        self._turn = 0  # round robin's next replica
        self._home: dict[int, ReplayEngine] = {}  # plan key -> the replica of its last turn
        self._index = {id(e): i for i, e in enumerate(self.engines)}
        self._inflight = [0] * len(self.engines)  # requests routed to each, not yet returned
        self._stack: AsyncExitStack | None = None

    async def __aenter__(self) -> Self:
        async with AsyncExitStack() as stack:
            for engine in self.engines:
                await stack.enter_async_context(engine)
            self._stack = stack.pop_all()
        return self

    async def aclose(self) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            await stack.aclose()

    def choose(self, prompt_ids: Sequence[int]) -> ReplayEngine:
        key = plan_key(prompt_ids)
        if self.sticky and key is not None and turn_of(prompt_ids) > 0 and key in self._home:
            return self._home[key]
        if self.routing == "round_robin":
            engine = self.engines[self._turn % len(self.engines)]
            self._turn += 1
        else:  # fewest requests; among those, fewest resident tokens
            fewest = min(self._inflight)
            engine = min((e for e, n in zip(self.engines, self._inflight, strict=True)
                          if n == fewest), key=lambda e: e.model.resident_tokens)
        if key is not None:
            self._home[key] = engine
        return engine

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        engine = self.choose(prompt_ids)
        i = self._index[id(engine)]
        self._inflight[i] += 1
        try:
            return await engine.generate(prompt_ids, sampling)
        finally:
            self._inflight[i] -= 1

    async def _each(self, call: Callable[[ReplayEngine], Awaitable[None]]) -> None:
        async with anyio.create_task_group() as tg:
            for engine in self.engines:
                tg.start_soon(call, engine)

    async def pause(self) -> None:
        await self._each(lambda e: e.pause())

    async def update_weights(self, update: WeightUpdate) -> None:
        await self._each(lambda e: e.update_weights(update))
        self.version = update.version

    async def resume(self) -> None:
        await self._each(lambda e: e.resume())

    def metrics(self) -> dict[str, float]:
        summed: dict[str, float] = {}
        for engine in self.engines:
            for key, value in engine.metrics().items():
                summed[key] = summed.get(key, 0.0) + value
        return summed

    @property
    def busy_seconds(self) -> float:
        return sum(e.busy_seconds for e in self.engines)

    @property
    def cache_misses(self) -> int:
        return sum(e.cache_misses for e in self.engines)
