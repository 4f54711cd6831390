"""The calibrated replay engine: a continuously-batched server model in (virtual) time.

:class:`ReplayEngine` implements :class:`~orchestrator.engines.base.InferenceEngine` on top
of :class:`~orchestrator.replay.model.ServerModel`. A request's token counts come from the
episode plan it belongs to (see :mod:`envs.replay`): the prompt's first token names the plan,
the number of observation markers in the prompt is the turn (the id layout is
:mod:`orchestrator.replay.tokenizer`'s). The engine loop (one task, started by
``async with engine``) advances the model to the next event with ``anyio.sleep``-style waits,
so under trio's ``MockClock`` (see :func:`orchestrator.replay.run.run_virtual`) a whole step
takes no real time and a few CPU seconds; on a real clock it runs in real time.

Generated tokens are placeholders (``FILL``, then a stop token unless the turn hit its
length cap), with behaviour log-probs of ``-1.0``. Every token is stamped with the version at
the request's start except the last, stamped with the version at its end: the fluid model
does not say which token a weight update landed on. ``pause`` freezes the server; a weight
update carries no weights (the simulated trainer has none), only its version, and takes
``sync_seconds`` to load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Self

import anyio
from anyio.abc import TaskGroup

from envs.replay import EpisodePlan
from orchestrator.engines.base import InferenceEngine
from orchestrator.errors import EngineClosed
from orchestrator.replay.model import RequestSpec, ServerModel, ServerParams
from orchestrator.replay.tokenizer import FILL, plan_key, turn_of
from orchestrator.types import FinishReason, Generation, SamplingParams
from orchestrator.weights import WeightUpdate


class ReplayEngine(InferenceEngine):
    def __init__(self, plans: Mapping[int, EpisodePlan], params: ServerParams,
                 sync_seconds: float = 0.0, version: int = 0) -> None:
        self.plans = plans
        self.params = params
        self.sync_seconds = sync_seconds
        self.version = version
        self.model = ServerModel(params)
        self._waiting: dict[int, tuple[anyio.Event, int]] = {}  # rid -> (done, start version)
        self._finished: set[int] = set()
        self._wake = anyio.Event()
        self._ids = 0
        self._tg: TaskGroup | None = None
        self._origin = 0.0
        self.requests = 0

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._origin = anyio.current_time()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._loop, name="replay-engine")
        return self

    async def aclose(self) -> None:
        if self._tg is not None:
            tg, self._tg = self._tg, None
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
            for event, _ in self._waiting.values():
                event.set()  # waiters see the engine closed

    def now(self) -> float:
        return anyio.current_time() - self._origin

    async def _loop(self) -> None:
        while True:
            self._settle(self.model.advance(self.now()))
            event = self.model.next_event()
            self._wake = anyio.Event()
            if event is None:
                await self._wake.wait()
            else:
                with anyio.move_on_after(max(event - self.now(), 0.0)):
                    await self._wake.wait()

    # -- requests ----------------------------------------------------------------------------

    def _shape(self, prompt_ids: Sequence[int]) -> tuple[EpisodePlan, int]:
        key = plan_key(prompt_ids)
        if key is None or key not in self.plans:
            raise ValueError("a replay engine serves only prompts of replay plans (envs.replay)")
        plan = self.plans[key]
        return plan, min(turn_of(prompt_ids), len(plan.turns) - 1)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        if self._tg is None:
            raise EngineClosed("the replay engine is not running (use `async with engine`)")
        plan, turn = self._shape(prompt_ids)
        shape = plan.turns[turn]
        n = max(1, min(shape.completion_tokens, sampling.max_tokens))
        capped = shape.completion_tokens >= sampling.max_tokens or shape.finish_reason == "length"
        rid = self._ids
        self._ids += 1
        self.requests += 1
        done = anyio.Event()
        start_version = self.version
        self._waiting[rid] = (done, start_version)
        self._settle(self.model.submit(self.now(), rid,
                                       RequestSpec(len(prompt_ids), shape.cached_tokens, n)))
        self._wake.set()
        try:
            await done.wait()
        finally:
            self._waiting.pop(rid, None)
        if rid not in self._finished:
            raise EngineClosed("the replay engine closed with the request in flight")
        self._finished.discard(rid)
        tokens = [FILL] * n
        if not capped and sampling.stop_token_ids:
            tokens[-1] = sampling.stop_token_ids[0]
        versions = [start_version] * n
        versions[-1] = self.version
        return Generation(
            token_ids=tuple(tokens), logprobs=(-1.0,) * n, versions=tuple(versions),
            finish_reason=FinishReason.LENGTH if capped else FinishReason.STOP,
            start_version=start_version, cached_tokens=shape.cached_tokens,
        )

    async def update_weights(self, update: WeightUpdate) -> None:
        if self.sync_seconds:
            await anyio.sleep(self.sync_seconds)
        self.version = update.version

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
    def busy_seconds(self) -> float:
        return self.model.busy
