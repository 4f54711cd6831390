"""The pool's calls to the Docker engine, and what happens when it stops answering.

The engine going away mid-run is the operator's problem, not the model's. A watch pings it
every second; an engine that does not answer (a ping, or a container create, exec or remove
with no answer) is an outage, counted once (``faults/docker_unreachable``). Calls that got no
answer wait for it and run again once it answers, for up to ``engine_grace_s``; past that the
engine is lost: the call and every later one raise :class:`~sandboxes.api.EngineUnavailable`
with one sentence naming the engine's URL and the fix, and nothing is retried.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import docker

from sandboxes.api import EngineUnavailable
from sandboxes.docker import engine

log = logging.getLogger("sandboxes.docker.pool")
T = TypeVar("T")
ENGINE_ERRORS = engine.ENGINE_ERRORS
WATCH_S = 1.0          # between pings of the engine by the watch
WATCH_PING_S = 2.0     # a ping unanswered this long is an outage


class EngineLink:
    """SDK calls to the engine at ``url`` in worker threads (``concurrency`` at once), behind
    a breaker: an outage is waited out for ``grace_s``, then the engine is lost for good
    (``on_lost`` tells the owner, whose waiters hear it at once)."""

    def __init__(self, url: str, grace_s: float, concurrency: int,
                 on_lost: Callable[[], None]) -> None:
        self.url = url
        self.grace_s = grace_s
        self.client: docker.DockerClient | None = None  # set once connected
        self.lost: str | None = None  # why the engine is gone (then nothing calls it again)
        self.down = False  # in an outage: the engine's last ping or call went unanswered
        self.outages = 0
        self._limiter = anyio.CapacityLimiter(concurrency)
        self._on_lost = on_lost

    async def thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn`` in a worker thread behind the call limiter, as it is: no waiting out."""
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs),
                                              limiter=self._limiter)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """An SDK call in a worker thread. No answer waits for the engine (up to ``grace_s``)
        and calls again; past that it is :class:`EngineUnavailable` (the engine is then lost).
        An answer that is an error stays a :class:`docker.errors.APIError`."""
        while True:
            self.check()
            if self.down:  # a known outage: wait for the engine before calling it (docker-py
                await self.wait(None)  # leaks the socket of a failed connection)
            try:
                return await self.thread(fn, *args, **kwargs)
            except ENGINE_ERRORS as e:
                if not engine.unanswered(e):
                    raise
                await self.wait(e)

    def check(self, error: BaseException | None = None) -> None:
        """:class:`EngineUnavailable` once the engine is lost."""
        if self.lost is not None:
            raise EngineUnavailable(self.lost) from error

    async def watch(self) -> None:
        """Ping the engine every :data:`WATCH_S` until it is lost: an unanswered ping is an
        outage."""
        while self.lost is None:
            await anyio.sleep(WATCH_S)
            await self.ping()

    async def ping(self) -> BaseException | None:
        """Ping the engine (not behind the call limiter, which calls stuck on a hung engine may
        fill); None when it answered. Notes an outage's start and end."""
        failed = await anyio.to_thread.run_sync(
            functools.partial(engine.probe, self.client, self.url, WATCH_PING_S))
        if failed is None:
            if self.down:
                log.warning("sandbox pool: the Docker engine at %s answers again", self.url)
            self.down = False
        elif not self.down:
            self.down = True
            self.outages += 1
            log.warning("sandbox pool: the Docker engine at %s does not answer (%s); waiting "
                        "up to sandbox.engine_grace_s=%g for it", self.url, failed, self.grace_s)
        return failed

    async def wait(self, error: BaseException | None) -> None:
        """The engine did not answer: return once it does, within ``grace_s``; else the engine
        is lost (:class:`EngineUnavailable`)."""
        self.check(error)
        deadline = time.monotonic() + self.grace_s
        while True:
            failed = await self.ping()
            if failed is None:
                return
            if time.monotonic() >= deadline:
                raise self.lose(failed) from error
            await anyio.sleep(min(WATCH_S, max(deadline - time.monotonic(), 0.0)))

    def lose(self, error: BaseException) -> EngineUnavailable:
        if self.lost is None:
            self.lost = engine.stopped_answering(self.url, error)
            log.error("sandbox pool: %s", self.lost)
            self._on_lost()
        return EngineUnavailable(self.lost)

    async def require(self, error: BaseException | None) -> None:
        """After a lost runner stream: :class:`EngineUnavailable` unless the engine answers."""
        self.check(error)
        failed = await self.thread(engine.probe, self.client, self.url)  # bounded in time
        if failed is not None:
            await self.wait(failed)
