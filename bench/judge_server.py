"""A judge server for the judge bench and the tests: OpenAI-compatible, real HTTP (aiohttp),
with the faults a remote judge has.

``GET /v1/models`` and ``POST /v1/chat/completions``. It grades as ``exact`` would: it reads
the reply and the reference answer out of :data:`envs.judge.DEFAULT_TEMPLATE`'s sections and
answers ``<score>10</score>`` when they are equal after normalising (case, spaces, ``$``, a
final period; the reply's boxed or tagged answer if it has one), ``<score>0</score>`` when not.

Faults, by call number (1 is the first chat call), so a run meets them in a known proportion:
``delay_s`` before every answer; every ``hang_every``-th call never answers (until the client
goes away); every ``fail_every``-th is a 500; every ``garbage_every``-th answers text with no
score; every ``broken_every``-th answers a body that is not a chat completion. 0 turns a fault
off. Counters: ``calls``, ``hung``, ``failed``, ``garbage``, ``broken``, ``graded``, and
``max_inflight`` (the most calls it held at once).

:class:`JudgeServer` is an async context manager on the caller's loop (the tests);
:func:`in_thread` serves one from a thread of its own, for a benchmark whose runs are other
processes.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

from aiohttp import web

from envs.answers import extract_final, normalise

_SECTIONS = re.compile(r"Answer to grade:\n(?P<reply>.*)\n\nReference answer:\n(?P<answer>.*?)\n\n",
                       re.DOTALL)


@dataclass(frozen=True)
class Faults:
    delay_s: float = 0.0
    hang_every: int = 0
    fail_every: int = 0
    garbage_every: int = 0
    broken_every: int = 0


class JudgeServer:
    def __init__(self, faults: Faults | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.faults = faults or Faults()
        self.host, self.port = host, port
        self.counters: Counter[str] = Counter()
        self.url = ""
        self._inflight = 0
        self._closing = asyncio.Event()
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> Self:
        app = web.Application()
        app.add_routes([web.get("/v1/models", self._models),
                        web.post("/v1/chat/completions", self._chat)])
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}/v1"
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._closing.set()  # hung calls end
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "judge", "object": "model"}]})

    def _due(self, n: int, every: int) -> bool:
        return every > 0 and n % every == 0

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self._inflight += 1
        self.counters["max_inflight"] = max(self.counters["max_inflight"], self._inflight)
        try:
            return await self._answer(request)
        finally:
            self._inflight -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.counters["calls"] += 1
        n, f = self.counters["calls"], self.faults
        if f.delay_s:
            await asyncio.sleep(f.delay_s)
        if self._due(n, f.hang_every):
            self.counters["hung"] += 1
            await self._closing.wait()  # never answered: until the server closes
            raise web.HTTPServiceUnavailable
        if self._due(n, f.fail_every):
            self.counters["failed"] += 1
            return web.json_response({"error": {"message": "overloaded"}}, status=500)
        if self._due(n, f.broken_every):
            self.counters["broken"] += 1
            return web.json_response({"object": "chat.completion", "choices": []})
        if self._due(n, f.garbage_every):
            self.counters["garbage"] += 1
            return _completion("I am not sure how to grade this one.")
        self.counters["graded"] += 1
        return _completion(f"<score>{grade(body['messages'][-1]['content'])}</score>")


def grade(prompt: str) -> int:
    """10 when the reply in ``prompt`` (the default rubric filled) equals its reference answer
    as ``exact`` compares them, else 0."""
    match = _SECTIONS.search(prompt)
    if match is None:
        return 0
    same = normalise(extract_final(match.group("reply"))) == normalise(match.group("answer"))
    return 10 if same else 0


def _completion(content: str) -> web.Response:
    return web.json_response({
        "id": "chatcmpl-judge", "object": "chat.completion", "created": 0, "model": "judge",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": content}}]})


@contextmanager
def in_thread(faults: Faults | None = None) -> Iterator[JudgeServer]:
    """A :class:`JudgeServer` on its own event loop in a daemon thread, for the block."""
    ready = threading.Event()
    state: dict[str, Any] = {}

    def serve() -> None:
        loop = asyncio.new_event_loop()
        state["loop"] = loop
        server = JudgeServer(faults)

        async def main() -> None:
            async with server:
                state["server"] = server
                state["stop"] = asyncio.Event()
                ready.set()
                await state["stop"].wait()

        try:
            loop.run_until_complete(main())
        finally:
            loop.close()

    thread = threading.Thread(target=serve, name="judge-server", daemon=True)
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("the judge server did not start")
    try:
        yield state["server"]
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(10)
