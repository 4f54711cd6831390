"""A simulated engine: no model, only time. Lengths and per-token cost are drawn from a
long-tailed distribution, so pipelines can be exercised and measured without compute.

Each request draws a completion length from a log-normal (median ``median_tokens``, spread
``sigma``: with the default 1.2 about 1% of samples run past 15x the median), capped at
``max_tokens``, and decodes it in chunks of ``chunk_tokens``, sleeping
``seconds_per_token`` per token. ``max_concurrency`` bounds how many requests decode at
once (the engine's batch slots); the rest queue. Tokens are random ids from
``token_range``; each chunk is stamped with the version current when it was produced and
behaviour log-probs are a fixed ``-1.0``.

Pause/resume hold the :class:`~orchestrator.gate.Gate` exclusively, so no chunk is
mid-flight while weights change and in-flight requests continue under the new version.
The PolyTrace-calibrated engine model is a separate, later piece.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import anyio

from orchestrator.engines.base import InferenceEngine
from orchestrator.errors import ConfigError
from orchestrator.gate import Gate
from orchestrator.types import FinishReason, Generation, SamplingParams
from orchestrator.weights import WeightUpdate


class SimulatedEngine(InferenceEngine):
    def __init__(
        self,
        median_tokens: float = 64.0,
        sigma: float = 1.2,
        seconds_per_token: float = 1e-4,
        chunk_tokens: int = 16,
        max_concurrency: int | None = None,
        token_range: tuple[int, int] = (7, 100),
        seed: int = 0,
        version: int = 0,
    ) -> None:
        if median_tokens <= 0 or sigma < 0 or seconds_per_token < 0 or chunk_tokens < 1:
            raise ConfigError("engine: median_tokens > 0, sigma >= 0, seconds_per_token >= 0 "
                              "and chunk_tokens >= 1 are required")
        self.median_tokens = median_tokens
        self.sigma = sigma
        self.seconds_per_token = seconds_per_token
        self.chunk_tokens = chunk_tokens
        self.token_range = token_range
        self.version = version
        self._rng = random.Random(seed)
        self._gate = Gate()
        self._slots = anyio.Semaphore(max_concurrency) if max_concurrency else None
        self.requests = 0

    def draw_length(self) -> int:
        return max(1, round(self.median_tokens * math.exp(self._rng.gauss(0.0, self.sigma))))

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        self.requests += 1
        wanted = self.draw_length()
        length = min(wanted, sampling.max_tokens)
        finish = FinishReason.STOP if wanted <= sampling.max_tokens else FinishReason.LENGTH
        tokens: list[int] = []
        versions: list[int] = []
        start_version: int | None = None
        if self._slots is not None:
            await self._slots.acquire()
        try:
            while len(tokens) < length:
                n = min(self.chunk_tokens, length - len(tokens))
                async with self._gate:
                    if start_version is None:
                        start_version = self.version
                    version = self.version
                    await anyio.sleep(n * self.seconds_per_token)
                    tokens += [self._rng.randrange(*self.token_range) for _ in range(n)]
                    versions += [version] * n
        finally:
            if self._slots is not None:
                self._slots.release()
        if finish is FinishReason.STOP and sampling.stop_token_ids:
            tokens[-1] = sampling.stop_token_ids[0]
        return Generation(
            token_ids=tuple(tokens),
            logprobs=tuple([-1.0] * len(tokens)),
            versions=tuple(versions),
            finish_reason=finish,
            start_version=start_version if start_version is not None else self.version,
        )

    async def update_weights(self, update: WeightUpdate) -> None:
        self.version = update.version

    async def pause(self) -> None:
        await self._gate.acquire_exclusive()

    async def resume(self) -> None:
        await self._gate.release_exclusive()
