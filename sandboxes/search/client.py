"""The search client: aiohttp with a per-attempt timeout and bounded retries with exponential
back-off. Every attempt is recorded (status, latency, error), so traces show the retries."""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import aiohttp
import anyio


class SearchError(Exception):
    """Every attempt failed; ``attempts`` says how."""

    def __init__(self, message: str, attempts: list[Attempt]) -> None:
        super().__init__(message)
        self.attempts = attempts


@dataclass(frozen=True)
class Attempt:
    status: str  # success | http_<code> | timeout | connection_error
    latency: float
    error: str | None = None


class SearchClient:
    def __init__(self, url: str, timeout: float = 10.0, retries: int = 3, backoff: float = 0.1,
                 max_connections: int = 256) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.max_connections),
            timeout=aiohttp.ClientTimeout(total=self.timeout),
        )
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._session is not None:
            with anyio.CancelScope(shield=True):
                await self._session.close()
            self._session = None

    async def retrieve(self, queries: list[str], topk: int = 3,
                       return_scores: bool = True) -> tuple[list[Any], list[Attempt]]:
        """The per-query results and the attempts it took; raises SearchError when all fail."""
        if self._session is None:
            raise RuntimeError("use the client as `async with SearchClient(url) as client:`")
        payload = {"queries": queries, "topk": topk, "return_scores": return_scores}
        attempts: list[Attempt] = []
        for attempt in range(self.retries + 1):
            if attempt:
                await anyio.sleep(self.backoff * 2 ** (attempt - 1))
            start = time.perf_counter()
            try:
                async with self._session.post(f"{self.url}/retrieve", json=payload) as response:
                    body = await response.json(content_type=None)
                    if response.status == 200:
                        attempts.append(Attempt("success", time.perf_counter() - start))
                        return body["result"], attempts
                    error = body.get("error") if isinstance(body, dict) else None
                    attempts.append(Attempt(f"http_{response.status}", time.perf_counter() - start,
                                            error))
                    if response.status == 400:  # our request is wrong: retrying will not help
                        break
            except TimeoutError:
                attempts.append(Attempt("timeout", time.perf_counter() - start, "timed out"))
            except aiohttp.ClientError as e:
                attempts.append(Attempt("connection_error", time.perf_counter() - start, str(e)))
        last = attempts[-1]
        raise SearchError(f"search failed after {len(attempts)} attempt(s): {last.status}"
                          f"{f' ({last.error})' if last.error else ''}", attempts)
