"""Agent programs in worker processes: ``env=agent env.processes=N``.

A program is user code. Run in the run's own event loop, everything it spends on the CPU (the
openai SDK alone spends about 2 ms per call) and anything it blocks on delays the engines, the
gateway and the trainer's feed. With ``env.processes=N`` episodes run in N worker processes,
each with its own event loop, and the run's loop only serves their calls.

The parent sends a worker an episode's task and endpoint (plain data: a URL and a key) and gets
back what the program returned, or its error; scoring stays with the parent. Episodes go to
the worker with the fewest in flight. A worker that dies fails the episodes it held (their
programs' error names its exit code) and a fresh one takes its place. Frames on the Unix
socket between them are a 4-byte length and a pickle (both ends are this code, started by
this process).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import struct
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import ByteStream, Process
from anyio.streams.buffered import BufferedByteReceiveStream

from envs.base import Task

log = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")


class ProgramError(Exception):
    """The program raised in its worker, or its worker died: ``kind`` is the exception's type
    name, the message its ``Type: message`` and ``details`` its traceback."""

    def __init__(self, message: str, kind: str = "ProgramError", details: str = "") -> None:
        super().__init__(message)
        self.kind, self.details = kind, details


async def send(stream: ByteStream, lock: anyio.Lock, message: tuple[Any, ...] | bytes) -> None:
    data = message if isinstance(message, bytes) else pickle.dumps(message)
    async with lock:
        await stream.send(_LENGTH.pack(len(data)) + data)


async def receive(stream: BufferedByteReceiveStream) -> tuple[Any, ...]:
    """The next frame; ``anyio.IncompleteRead`` / ``EndOfStream`` when the other end is gone."""
    (length,) = _LENGTH.unpack(await stream.receive_exactly(_LENGTH.size))
    return pickle.loads(await stream.receive_exactly(length))


@dataclass
class _Worker:
    index: int
    process: Process
    stream: ByteStream
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    alive: bool = True
    pending: dict[int, list[Any]] = field(default_factory=dict)  # id -> [event, outcome]


class AgentWorkers:
    """N worker processes running ``program`` (``package.module:name``); open for an
    ``async with`` block. :meth:`run` is one episode's program run in one of them."""

    def __init__(self, program: str, processes: int, timeout_s: float = 300.0) -> None:
        self.program, self.count, self.timeout_s = program, processes, timeout_s
        self._workers: list[_Worker] = []
        self._ids = itertools.count()
        self._closing = False
        self._changed = anyio.Condition()  # a worker died or started
        self.restarts = 0

    @asynccontextmanager
    async def open(self) -> AsyncIterator[AgentWorkers]:
        with tempfile.TemporaryDirectory(prefix="polyrl-agents-") as folder:
            path = Path(folder) / "workers.sock"
            async with await anyio.create_unix_listener(path) as listener, \
                    anyio.create_task_group() as tg:
                self._listener, self._path, self._tg = listener, path, tg
                try:
                    for i in range(self.count):
                        self._workers.append(await self._start(i))
                    yield self
                finally:
                    self._closing = True
                    for worker in self._workers:
                        await _stop(worker)
                    tg.cancel_scope.cancel()

    async def _start(self, index: int) -> _Worker:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        process = await anyio.open_process(
            [sys.executable, "-m", "envs.agent_worker_process", str(self._path), self.program,
             str(self.timeout_s)],
            env=env, stdin=None, stdout=None, stderr=None)
        accepted: list[ByteStream] = []
        try:
            # importing the program (torch, an SDK) can take a while; a worker that exits
            # first (its error is on the run's stderr) ends the wait
            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:

                    async def accept() -> None:
                        accepted.append(await self._listener.accept())
                        tg.cancel_scope.cancel()

                    tg.start_soon(accept)
                    await process.wait()
                    tg.cancel_scope.cancel()
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                await _kill(process)
            if isinstance(e, TimeoutError):
                raise ProgramError(f"an agent worker process did not start within 120 s "
                                   f"(env.program={self.program})") from None
            raise
        if not accepted:
            raise ProgramError(f"an agent worker process exited with code {process.returncode} "
                               f"before it started (env.program={self.program}; its error is "
                               f"above)")
        worker = _Worker(index, process, accepted[0])
        self._tg.start_soon(self._read, worker)
        return worker

    async def _read(self, worker: _Worker) -> None:
        """Hand each reply to its episode; when the worker dies, fail what it held and start
        another in its place."""
        buffered = BufferedByteReceiveStream(worker.stream)
        try:
            while True:
                kind, eid, *rest = await receive(buffered)
                waiting = worker.pending.pop(eid, None)
                if waiting is not None:
                    waiting[1] = (kind, *rest)
                    waiting[0].set()
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError,
                anyio.ClosedResourceError):
            pass
        worker.alive = False
        if self._closing:
            return
        with anyio.CancelScope(shield=True):
            code = await worker.process.wait()
            await worker.stream.aclose()
        error = ("error", f"ProgramError: its agent worker process exited with code {code}",
                 "ProgramError", "")
        for waiting in worker.pending.values():
            waiting[1] = error
            waiting[0].set()
        worker.pending.clear()
        self.restarts += 1
        log.warning("agent worker %d exited with code %s; starting another", worker.index, code)
        self._workers[worker.index] = await self._start(worker.index)
        async with self._changed:
            self._changed.notify_all()

    async def _pick(self) -> _Worker:
        """The live worker with the fewest episodes in flight (waiting for a replacement when
        every worker has just died)."""
        async with self._changed:
            while not any(w.alive for w in self._workers):
                await self._changed.wait()
        return min((w for w in self._workers if w.alive), key=lambda w: len(w.pending))

    async def run(self, task: Task, endpoint: Any) -> Any:
        """What the program returned for ``task`` (a ProgramError when it raised or its worker
        died); cancelling this cancels the program in its worker."""
        eid, done = next(self._ids), anyio.Event()
        waiting: list[Any] = [done, None]
        while True:
            worker = await self._pick()
            worker.pending[eid] = waiting
            try:
                await send(worker.stream, worker.lock, ("run", eid, task, endpoint))
                break
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                worker.pending.pop(eid, None)  # it died before its reader saw: another one
                worker.alive = False
        try:
            await done.wait()
        except BaseException:
            if worker.pending.pop(eid, None) is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    try:
                        await send(worker.stream, worker.lock, ("cancel", eid))
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        pass  # the worker is gone; its reader starts another
            raise
        kind, *rest = waiting[1]
        if kind == "error":
            raise ProgramError(*rest)
        return rest[0]


async def _stop(worker: _Worker) -> None:
    with anyio.CancelScope(shield=True):
        await worker.stream.aclose()
        with anyio.move_on_after(5):
            await worker.process.wait()
            return
        await _kill(worker.process)


async def _kill(process: Process) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            process.kill()
    await process.wait()
