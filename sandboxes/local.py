"""DEVELOPMENT ONLY: a local process "sandbox" that ISOLATES NOTHING.

The code runs as your user, on your filesystem, with your network. Resource limits
(``setrlimit``: address space, file size, open files, no core dumps) and the runner's wall
time only stop accidents (a runaway loop, a huge allocation), never an adversary: model-written
code can read and delete your files, open connections and leave processes that escape the
runner's process-tree cleanup. Use it to develop environments on a machine without Docker
(``sandbox=local``); train on anything you did not write yourself with ``sandbox=docker``.

Same interface as the Docker pool: ``async with LocalSandboxConfig().pool() as pool``, ``async
with pool.session() as sb``, ``await sb.exec(code)``; the same session runner (a supervisor plus
a forked kernel holding the namespace) over the same protocol, on the subprocess's pipes.

It is also the example of a backend: one module that imports only the interface
(:mod:`sandboxes.api`, :mod:`sandboxes.config`, the shared runner and protocol), plus
``conf/sandbox/local.yaml`` naming :class:`LocalSandboxConfig` as its ``_target_``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Self

import anyio
import anyio.abc

from sandboxes import protocol
from sandboxes.api import (
    ExecLimits,
    ExecResult,
    Language,
    Sandbox,
    SandboxError,
    SandboxPool,
)
from sandboxes.config import SandboxConfig

log = logging.getLogger(__name__)
WARNING = ("sandbox=local ISOLATES NOTHING: model-written code runs as your user with your "
           "files and network. Development only; use sandbox=docker for training.")


@dataclass(frozen=True, kw_only=True)
class LocalSandboxConfig(SandboxConfig):
    """The limits only (see :class:`SandboxConfig`); ``memory_mb`` is an address-space limit,
    which counts reserved as well as used memory, hence the larger default."""

    memory_mb: int = 1024

    def pool(self) -> LocalSandboxPool:
        return LocalSandboxPool(self)


class LocalSandbox(Sandbox):
    def __init__(self, config: LocalSandboxConfig) -> None:
        self.config = config
        self._dir = tempfile.TemporaryDirectory(prefix="polyrl-local-sandbox-")
        self._process: anyio.abc.Process | None = None
        self._buffer = bytearray()
        self._lock = anyio.Lock()

    async def _start(self) -> anyio.abc.Process:
        cfg = self.config
        work = self._dir.name
        argv = [sys.executable, "-I", "-c", protocol.RUNNER_SOURCE, "--kill-scope", "tree",
                "--wipe", work,
                "--rlimit", f"AS={max(cfg.memory_mb, 256) << 20}",
                "--rlimit", f"FSIZE={cfg.fsize_mb << 20}",
                "--rlimit", f"NOFILE={cfg.nofile}", "--rlimit", "CORE=0"]
        env = {"HOME": work, "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
               "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        process = await anyio.open_process(argv, cwd=work, env=env, start_new_session=True)
        self._process, self._buffer = process, bytearray()
        return process

    async def _roundtrip(self, process: anyio.abc.Process, data: bytes) -> bytes:
        assert process.stdin is not None and process.stdout is not None
        await process.stdin.send(data)
        while (frame := protocol.take_frame(self._buffer)) is None:
            try:
                self._buffer += await process.stdout.receive(1 << 18)
            except (anyio.EndOfStream, anyio.BrokenResourceError) as e:
                raise SandboxError("the local runner exited") from e
        return frame

    async def exec(self, code: str, *, language: Language = "python", timeout: float | None = None,
                   limits: ExecLimits | None = None) -> ExecResult:
        timeout_s, max_output = self.config.call_limits(timeout, limits)
        async with self._lock:
            process = self._process or await self._start()
            start = time.perf_counter()
            frame = None
            try:
                with anyio.move_on_after(timeout_s + self.config.host_grace_s):
                    frame = await self._roundtrip(
                        process, protocol.exec_request(code, language, timeout_s, max_output))
            except SandboxError:
                pass
            except BaseException:
                await self._kill()
                raise
            duration = time.perf_counter() - start
            if frame is not None:
                return protocol.to_result(frame, duration)
            await self._kill()
            status = "timeout" if duration >= timeout_s else "killed"
            return ExecResult("", "", None, status, duration, session_reset=True)

    async def _kill(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        with anyio.CancelScope(shield=True):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await process.wait()
            await process.aclose()

    async def aclose(self) -> None:
        await self._kill()
        self._dir.cleanup()


class LocalSandboxPool(SandboxPool):
    """Sessions as local subprocesses (no warm pool: a process starts in ~30 ms)."""

    def __init__(self, config: LocalSandboxConfig | None = None) -> None:
        self.config = config or LocalSandboxConfig()
        self._open = False

    async def __aenter__(self) -> Self:
        log.warning(WARNING)
        print(f"WARNING: {WARNING}", file=sys.stderr, flush=True)
        self._open = True
        return self

    @asynccontextmanager
    async def session(self) -> AsyncIterator[LocalSandbox]:
        if not self._open:
            raise SandboxError("the pool is not open: use `async with LocalSandboxPool(cfg)`")
        sandbox = LocalSandbox(self.config)
        try:
            yield sandbox
        finally:
            await sandbox.aclose()

    async def aclose(self) -> None:
        self._open = False


__all__ = ["WARNING", "LocalSandbox", "LocalSandboxConfig", "LocalSandboxPool"]
