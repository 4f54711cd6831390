"""The aiohttp search server (an async context manager; an ephemeral port by default).

Each request first asks the :class:`FaultModel` for its fate — a latency in seconds and a
status — then sleeps that long (times ``time_scale``) and answers: ``success`` with ranked
documents, ``api_error`` with HTTP 503, ``unknown`` with HTTP 500. The PolyTrace-fitted model
plugs in here; :class:`NoFaults` answers at once. Bad requests get HTTP 400 and one sentence.

With ``control`` (:class:`ControlledFaults`, ``python -m sandboxes.search --control``) an
operator or a chaos test turns faults on for a while: ``POST /faults`` with
``{"mode": "error" | "hang" | "slow", "seconds": s, "delay_s": d}`` answers every request in
the next ``s`` seconds with HTTP 500, holds it unanswered (``hang``), or answers ``d`` seconds
late (``slow``); ``GET /faults`` says how many requests each mode has served.
"""

from __future__ import annotations

import json
import random
import time
from abc import ABC, abstractmethod
from collections import Counter
from types import TracebackType
from typing import Any, Self

import anyio
from aiohttp import web

from sandboxes.search.bm25 import BM25Index

MAX_TOPK = 100
MAX_QUERIES = 256


class FaultModel(ABC):
    @abstractmethod
    def sample(self, query_count: int) -> tuple[float, str]:
        """(latency in seconds, status: success | unknown | api_error) for one request."""


class NoFaults(FaultModel):
    def sample(self, query_count: int) -> tuple[float, str]:
        return 0.0, "success"


class WithFailures(FaultModel):
    """Another model's latencies, plus an ``api_error`` on a ``rate`` share of requests."""

    def __init__(self, base: FaultModel, rate: float, seed: int | None = 0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"failure rate {rate} must be in [0, 1]")
        self.base, self.rate = base, rate
        self.rng = random.Random(seed)

    def sample(self, query_count: int) -> tuple[float, str]:
        latency, status = self.base.sample(query_count)
        return latency, "api_error" if self.rng.random() < self.rate else status


class ControlledFaults(FaultModel):
    """Another model's fates, overridden from outside for a while (:meth:`turn_on`)."""

    MODES = ("error", "hang", "slow")
    HANG_S = 300.0  # a held request's latency (before the server's time_scale)

    def __init__(self, base: FaultModel | None = None) -> None:
        self.base = base or NoFaults()
        self.mode: str | None = None
        self.until = 0.0  # time.monotonic() when the mode ends
        self.delay_s = 0.0
        self.served: Counter[str] = Counter()  # requests each mode has answered (or held)

    def turn_on(self, mode: str, seconds: float, delay_s: float = 2.0) -> None:
        if mode not in self.MODES:
            raise ValueError(f"fault mode {mode!r} must be one of {', '.join(self.MODES)}")
        if not 0 < seconds <= 3600 or not 0 <= delay_s <= 600:
            raise ValueError("seconds must be in (0, 3600] and delay_s in [0, 600]")
        self.mode, self.until, self.delay_s = mode, time.monotonic() + seconds, delay_s

    def active(self) -> str | None:
        return self.mode if self.mode is not None and time.monotonic() < self.until else None

    def sample(self, query_count: int) -> tuple[float, str]:
        latency, status = self.base.sample(query_count)
        mode = self.active()
        if mode is None:
            return latency, status
        self.served[mode] += 1
        if mode == "error":
            return latency, "unknown"
        return (self.HANG_S if mode == "hang" else latency + self.delay_s), status


def _bad(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


class SearchServer:
    SHUTDOWN_S = 1.0  # seconds requests in flight get to finish once the server closes

    def __init__(self, index: BM25Index, faults: FaultModel | None = None, host: str = "127.0.0.1",
                 port: int = 0, time_scale: float = 1.0, control: bool = False) -> None:
        self.index = index
        self.faults = faults or NoFaults()
        self.control = ControlledFaults(self.faults) if control else None
        if self.control is not None:
            self.faults = self.control
        self.host, self.port = host, port
        self.time_scale = time_scale
        self.requests = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def __aenter__(self) -> Self:
        app = web.Application()
        app.router.add_post("/retrieve", self._retrieve)
        if self.control is not None:
            app.router.add_post("/faults", self._set_faults)
            app.router.add_get("/faults", self._get_faults)
        # A request still held when the server closes (a hang fault's) is cancelled after
        # SHUTDOWN_S, not aiohttp's default minute.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=self.SHUTDOWN_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=2048)
        await site.start()
        sockets = site._server.sockets if site._server is not None else []  # type: ignore[union-attr]
        if sockets:
            self.port = sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._runner is not None:
            with anyio.CancelScope(shield=True):
                await self._runner.cleanup()
            self._runner = None

    async def _set_faults(self, request: web.Request) -> web.Response:
        assert self.control is not None
        try:
            body: Any = await request.json()
            self.control.turn_on(str(body["mode"]), float(body["seconds"]),
                                 float(body.get("delay_s", 2.0)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            return _bad(f'send {{"mode": "error" | "hang" | "slow", "seconds": s}} ({e})')
        return await self._get_faults(request)

    async def _get_faults(self, request: web.Request) -> web.Response:
        assert self.control is not None
        return web.json_response({"active": self.control.active(),
                                  "served": dict(self.control.served)})

    async def _retrieve(self, request: web.Request) -> web.Response:
        self.requests += 1
        try:
            body: Any = await request.json()
        except json.JSONDecodeError:
            return _bad("the request body is not JSON")
        if not isinstance(body, dict):
            return _bad('the request body must be an object {"queries": [...], "topk": k}')
        queries, topk = body.get("queries"), body.get("topk", 3)
        if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
            return _bad('"queries" must be a list of strings')
        if not 0 < len(queries) <= MAX_QUERIES:
            return _bad(f'"queries" must hold 1 to {MAX_QUERIES} strings')
        if isinstance(topk, bool) or not isinstance(topk, int) or not 0 < topk <= MAX_TOPK:
            return _bad(f'"topk" must be a whole number from 1 to {MAX_TOPK}')
        scores = bool(body.get("return_scores", False))

        latency, status = self.faults.sample(len(queries))
        await anyio.sleep(latency * self.time_scale)
        if status == "api_error":
            return web.json_response({"error": "injected api_error"}, status=503)
        if status != "success":
            return web.json_response({"error": f"injected {status}"}, status=500)
        result = []
        for query in queries:
            hits = self.index.search(query, topk)
            if scores:
                result.append([{"document": d.as_json(), "score": s} for d, s in hits])
            else:
                result.append([d.as_json() for d, _ in hits])
        return web.json_response({"result": result})
