"""One episode's Docker sandbox: a stateful Python session on a container of the pool's. A call
is one round trip on the runner's stream, under the runner's deadline and the host's (a call
past the host's destroys the container: the unit that dies). A container lost under a call
(killed from outside, or its stream cut by an engine outage) is not the code's doing: the call
runs once more in a fresh container, ``session_reset``, counted as ``faults/sandbox_lost``."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Protocol

import anyio

from sandboxes import protocol
from sandboxes.api import ExecLimits, ExecResult, Language, Sandbox
from sandboxes.config import SandboxConfig
from sandboxes.docker.channel import RunnerGone
from sandboxes.docker.containers import Container, cgroup_oom_kills
from sandboxes.docker.outage import EngineLink

log = logging.getLogger("sandboxes.docker.pool")


class Containers(Protocol):
    """What a sandbox asks of its pool (:class:`~sandboxes.docker.pool.DockerSandboxPool`)."""

    config: SandboxConfig
    stats: dict[str, int]
    link: EngineLink

    async def _acquire(self) -> Container: ...

    def _release_soon(self, box: Container) -> None: ...

    async def _lost_box(self, box: Container) -> bool: ...


class DockerSandbox(Sandbox):
    """One episode's sandbox. If its container is lost (host-side timeout, runner killed) the
    next call transparently gets a fresh one; the result that lost it says ``session_reset``."""

    def __init__(self, pool: Containers) -> None:
        self._pool = pool
        self._container: Container | None = None
        self._lock = anyio.Lock()
        self.calls = 0

    async def exec(self, code: str, *, language: Language = "python", timeout: float | None = None,
                   limits: ExecLimits | None = None) -> ExecResult:
        timeout_s, max_output = self._pool.config.call_limits(timeout, limits)
        async with self._lock:
            result = await self._exec_once(code, language, timeout_s, max_output, retry=True)
            if result is None:  # the container was lost under the call: once more, afresh
                self._pool.stats["lost"] += 1
                log.warning("sandbox pool: a container was lost under a call (killed, or its "
                            "stream cut by the engine); running the call again in a fresh one")
                result = await self._exec_once(code, language, timeout_s, max_output, retry=False)
                assert result is not None
                result = replace(result, session_reset=True)
            return result

    async def _exec_once(self, code: str, language: Language, timeout_s: float,
                         max_output: int, retry: bool) -> ExecResult | None:
        """One call; None (with ``retry``) when its container disappeared under it."""
        if self._container is None:
            self._container = await self._pool._acquire()
        box = self._container
        self.calls += 1
        oom_before = cgroup_oom_kills(box.id)
        start = time.perf_counter()
        request = protocol.exec_request(code, language, timeout_s, max_output)
        frame: bytes | None = None
        gone: RunnerGone | None = None
        try:
            with anyio.move_on_after(timeout_s + self._pool.config.host_grace_s) as scope:
                frame = await box.channel.roundtrip(request)
        except RunnerGone as e:
            gone = e
        except BaseException:
            # cancelled mid-call: the stream is out of step, so the container goes and
            # the session's next call starts in a fresh one (unaccounted: if it was killed
            # from outside, its release counts it)
            box.broken = True
            self._container = None
            self._pool._release_soon(box)
            raise
        duration = time.perf_counter() - start
        if frame is not None and not scope.cancelled_caught:
            return protocol.to_result(frame, duration)
        # lost: the host deadline passed or the runner died; the container goes
        box.broken = True
        self._container = None
        try:  # ... unless the engine itself went away: then it is not the code's doing
            await self._pool.link.require(gone)
            if retry and gone is not None and await self._pool._lost_box(box):
                box.accounted = True  # counted by exec, which runs the call again
                return None  # killed from outside or cut: not the code's doing either
            box.accounted = True  # the code's doing (its deadline, its memory, its runner)
        finally:
            self._pool._release_soon(box)
        if scope.cancelled_caught:
            status = "timeout"
        else:
            oom_after = cgroup_oom_kills(box.id)
            grew = oom_before is not None and oom_after is not None and oom_after > oom_before
            status = "oom" if grew else "killed"
        return ExecResult("", box.channel.stderr[-2000:].decode("utf-8", "replace"), None,
                          status, duration, session_reset=True)

    async def _finish(self) -> None:
        if self._container is not None:
            self._pool._release_soon(self._container)
            self._container = None
