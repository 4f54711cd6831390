"""The simulated engine: no model, only time. One class for every model-free use — unit tests,
the staleness and gateway benchmarks, the Ray benchmarks, and the calibrated trace replay —
whose behaviour is set by the two objects it is given:

* **what a request generates** (:class:`Replies`): its length, finish reason and token ids.
  :class:`LogNormalReplies` (the default) draws a long-tailed length per request (median
  ``median_tokens``, spread ``sigma``: with 1.2 about 1% of samples run past 15x the median)
  and random ids from ``token_range``; :class:`ScriptedReplies` replies with a function of
  the prompt; the replay's episode plans (:mod:`orchestrator.replay.engine`) and the
  benchmarks' trace shapes (:mod:`bench.trace_engine`) give recorded token counts.
* **how time passes** (:class:`Timing`): :class:`ChunkedDecode` (the default) decodes in
  chunks of ``chunk_tokens``, each costing what its :class:`DecodeCost` says —
  :class:`PerToken` (``seconds_per_token``) or the benchmarks' batched decode — with at most
  ``max_concurrency`` requests decoding at once (the rest queue); the replay's
  continuously-batched server model (:class:`orchestrator.replay.engine.FluidServer`) runs one
  event loop for every request instead.

Waits are ``anyio.sleep``: the engine costs no CPU while it "generates", and under trio's
``MockClock`` (:func:`orchestrator.replay.run.run_virtual`) no real time either. Every token is
stamped with the version the engine served when it was produced (a chunk's tokens by the
version at the chunk's start); behaviour log-probs are the replies' fixed value. A request that
did not hit its length cap ends with the first stop token.

Pause/resume stop time at a token boundary: :class:`ChunkedDecode` holds a
:class:`~orchestrator.engines.rwlock.ReadWriteLock` exclusively, so no chunk is mid-flight while
weights change and in-flight requests continue under the new version. A weight update carries no
weights to load (``sync_seconds`` stands for the load); one sent from another process (bytes, a
file, the object store) is pulled in a worker thread, as a real engine would before loading it, and
dropped. Limits: tokens are placeholders, so rewards mean nothing; the cost models are the ones
named above (no KV-cache pressure or preemption outside the replay's server model).
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol, Self

import anyio
from anyio import AsyncContextManagerMixin

from orchestrator.engines.base import InferenceEngine
from orchestrator.engines.rwlock import ReadWriteLock
from orchestrator.errors import ConfigError
from orchestrator.types import FinishReason, Generation, SamplingParams
from orchestrator.weights.update import WeightUpdate


@dataclass(frozen=True)
class Reply:
    """What one request generates, decided before any time passes."""

    length: int  # tokens generated
    finish: FinishReason
    prompt_tokens: int  # resident before the first generated token
    prefill_tokens: int  # prompt tokens computed (not served from a prefix cache)
    cached_tokens: int = 0  # reported on the Generation
    token_ids: tuple[int, ...] | None = None  # None: the source draws ids chunk by chunk
    logprob: float = -1.0


class Replies(ABC):
    """What requests generate: a token source."""

    fill: int = 40  # a placeholder token id (a printable character of the char tokenizer)

    @abstractmethod
    def reply(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Reply: ...

    def tokens(self, n: int) -> list[int]:
        """Ids of the next ``n`` tokens of a reply without fixed ``token_ids``."""
        return [self.fill] * n

    def metrics(self) -> dict[str, float]:
        return {}


class LogNormalReplies(Replies):
    """Log-normal lengths (median ``median_tokens``, spread ``sigma``), capped at the request's
    ``max_tokens``; random ids from ``token_range``. One seeded generator draws lengths and ids
    in the order requests ask for them."""

    def __init__(self, median_tokens: float = 64.0, sigma: float = 1.2,
                 token_range: tuple[int, int] = (7, 100), seed: int = 0) -> None:
        if median_tokens <= 0 or sigma < 0:
            raise ConfigError("engine: median_tokens > 0 and sigma >= 0 are required")
        self.median_tokens = median_tokens
        self.sigma = sigma
        self.token_range = token_range
        self._rng = random.Random(seed)

    def draw_length(self) -> int:
        return max(1, round(self.median_tokens * math.exp(self._rng.gauss(0.0, self.sigma))))

    def reply(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Reply:
        wanted = self.draw_length()
        finish = FinishReason.STOP if wanted <= sampling.max_tokens else FinishReason.LENGTH
        return Reply(min(wanted, sampling.max_tokens), finish, len(prompt_ids), len(prompt_ids))

    def tokens(self, n: int) -> list[int]:
        return [self._rng.randrange(*self.token_range) for _ in range(n)]


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


class ScriptedReplies(Replies):
    """Replies ``reply(prompt)`` (cut to ``max_tokens - 1``), then the first stop token, at a
    fixed log-prob; remembers every prompt and sampling it was asked with."""

    def __init__(self, reply: Callable[[list[int]], str], tokenizer: Encoder,
                 logprob: float = -0.5) -> None:
        self.script = reply
        self.tokenizer = tokenizer
        self.logprob = logprob
        self.prompts: list[list[int]] = []
        self.sampling: list[SamplingParams] = []

    def reply(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Reply:
        self.prompts.append(list(prompt_ids))
        self.sampling.append(sampling)
        ids = self.tokenizer.encode(self.script(list(prompt_ids)))[: sampling.max_tokens - 1]
        ids.append(sampling.stop_token_ids[0])
        return Reply(len(ids), FinishReason.STOP, len(prompt_ids), len(prompt_ids),
                     token_ids=tuple(ids), logprob=self.logprob)


class Timing(ABC):
    """How a simulated engine spends a request's time, and which version each token carries."""

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """What the timing runs in the background while its engine is entered (nothing)."""
        yield

    @abstractmethod
    async def run(self, reply: Reply, replies: Replies,
                  version: Callable[[], int]) -> tuple[int, list[int], list[int]]:
        """Wait the request's time; its start version, token ids and per-token versions."""

    @abstractmethod
    async def pause(self) -> None: ...

    @abstractmethod
    async def resume(self) -> None: ...

    def updated(self, version: int) -> None:
        """Called, paused, once the engine serves ``version``."""

    def metrics(self) -> dict[str, float]:
        return {}


class DecodeCost(Protocol):
    def prefill_seconds(self, reply: Reply) -> float | None:
        """Seconds before the first chunk (None: no wait at all)."""

    def chunk_seconds(self, n: int, resident: int, resident_tokens: int) -> float:
        """Seconds to decode ``n`` tokens with ``resident`` requests holding ``resident_tokens``."""


@dataclass(frozen=True)
class PerToken:
    """A fixed cost per generated token, whatever the batch; no prefill."""

    seconds_per_token: float = 1e-4

    def prefill_seconds(self, reply: Reply) -> float | None:
        return None

    def chunk_seconds(self, n: int, resident: int, resident_tokens: int) -> float:
        return n * self.seconds_per_token


class ChunkedDecode(Timing):
    """Each request prefills (if its cost says so), then decodes chunk by chunk, holding the
    gate's shared side for each chunk; at most ``max_concurrency`` requests hold a slot."""

    def __init__(self, cost: DecodeCost, chunk_tokens: int = 16,
                 max_concurrency: int | None = None) -> None:
        if chunk_tokens < 1:
            raise ConfigError("engine: chunk_tokens >= 1 is required")
        self.cost = cost
        self.chunk_tokens = chunk_tokens
        self._gate = ReadWriteLock()
        self._slots = anyio.Semaphore(max_concurrency) if max_concurrency else None
        self.resident = 0  # requests decoding now
        self.resident_tokens = 0

    async def run(self, reply: Reply, replies: Replies,
                  version: Callable[[], int]) -> tuple[int, list[int], list[int]]:
        tokens: list[int] = []
        versions: list[int] = []
        start_version: int | None = None
        if self._slots is not None:
            await self._slots.acquire()
        try:
            prefill = self.cost.prefill_seconds(reply)
            if prefill is not None:
                await anyio.sleep(prefill)
            held = reply.prompt_tokens
            self.resident += 1
            self.resident_tokens += held
            try:
                while len(versions) < reply.length:
                    n = min(self.chunk_tokens, reply.length - len(versions))
                    async with self._gate:
                        current = version()
                        if start_version is None:
                            start_version = current
                        await anyio.sleep(self.cost.chunk_seconds(n, self.resident,
                                                                  self.resident_tokens))
                        if reply.token_ids is None:
                            tokens += replies.tokens(n)
                        versions += [current] * n
                        self.resident_tokens += n
                        held += n
            finally:
                self.resident -= 1
                self.resident_tokens -= held
        finally:
            if self._slots is not None:
                self._slots.release()
        if reply.token_ids is not None:
            tokens = list(reply.token_ids)
        return start_version if start_version is not None else version(), tokens, versions

    async def pause(self) -> None:
        await self._gate.acquire_exclusive()

    async def resume(self) -> None:
        await self._gate.release_exclusive()


class SimulatedEngine(AsyncContextManagerMixin, InferenceEngine):
    """An :class:`InferenceEngine` of ``replies`` generated in ``timing``'s time. Without
    them: log-normal replies (``median_tokens``, ``sigma``, ``token_range``, ``seed``) decoded
    at ``seconds_per_token`` in chunks of ``chunk_tokens``, ``max_concurrency`` at once."""

    def __init__(
        self,
        replies: Replies | None = None,
        timing: Timing | None = None,
        *,
        median_tokens: float = 64.0,
        sigma: float = 1.2,
        seconds_per_token: float = 1e-4,
        chunk_tokens: int = 16,
        max_concurrency: int | None = None,
        token_range: tuple[int, int] = (7, 100),
        seed: int = 0,
        version: int = 0,
        sync_seconds: float = 0.0,
    ) -> None:
        if seconds_per_token < 0 or sync_seconds < 0:
            raise ConfigError("engine: seconds_per_token >= 0 and sync_seconds >= 0 are required")
        self.replies = replies or LogNormalReplies(median_tokens, sigma, token_range, seed)
        self.timing = timing or ChunkedDecode(PerToken(seconds_per_token), chunk_tokens,
                                              max_concurrency)
        self.version = version
        self.sync_seconds = sync_seconds
        self.requests = 0
        self.pulled_bytes = 0  # of weight updates sent from another process

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncIterator[Self]:
        async with self.timing.running():
            yield self

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        self.requests += 1
        reply = self.replies.reply(prompt_ids, sampling)
        start_version, tokens, versions = await self.timing.run(
            reply, self.replies, lambda: self.version)
        if reply.finish is FinishReason.STOP and sampling.stop_token_ids:
            tokens[-1] = sampling.stop_token_ids[0]
        return Generation(
            token_ids=tuple(tokens), logprobs=(reply.logprob,) * len(tokens),
            versions=tuple(versions), finish_reason=reply.finish, start_version=start_version,
            cached_tokens=reply.cached_tokens,
        )

    async def update_weights(self, update: WeightUpdate) -> None:
        if update.transport != "reference":
            tensors = await anyio.to_thread.run_sync(update.tensors)
            self.pulled_bytes += sum(t.nbytes for t in tensors.values())
        if self.sync_seconds:
            await anyio.sleep(self.sync_seconds)
        self.version = update.version
        self.timing.updated(update.version)

    async def pause(self) -> None:
        await self.timing.pause()

    async def resume(self) -> None:
        await self.timing.resume()

    def metrics(self) -> dict[str, float]:
        return {**self.timing.metrics(), **self.replies.metrics()}
