"""The reward workers: isolated verification under a hard wall-clock limit (see
:mod:`envs.rewards` for the protocol; this module only runs functions there resolve).

Each item's isolated parts run in one worker process under ``timeout_s``: a worker past it is
killed (SIGKILL) and replaced, and the item's parts fail as ``timeout``; a worker that dies
(``os._exit``, a segfault) fails them as ``error``; a function that raises, times out by
itself (math-verify's own alarm) or returns a non-number fails its own part, its worker kept.
The caller's event loop only waits: each item's wait runs in a thread (``anyio.to_thread``),
so a slow verification delays only its own episode. A verification past a quarter of its
limit (at most 1 s) stops counting against ``processes``: the next item gets another worker,
so a hang holds only its own item. Workers are forked by a zygote, one fresh interpreter
(``python -m envs.reward_worker``, on a socket pair; not a fork of the caller, which has
threads) that imports the reward functions once, ahead of need: a replacement is ready in
milliseconds.

Limits: arguments and results cross a pipe by pickle (a dataset row's plain values are
picklable); one item's isolated parts share its time limit; a worker scores one item at a
time (an ``async`` function's pool is sized by ``env.reward_concurrency``, not ``processes``).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any, Self

from envs.base import Reward

log = logging.getLogger(__name__)

_READY_TIMEOUT_S = 120.0  # the zygote importing the reward functions (once, before any item)
_FORK_TIMEOUT_S = 10.0  # the zygote answering a fork request


@dataclass(frozen=True)
class Failure:
    """How one reward gave up on one item: ``kind`` is ``timeout`` (our hard limit),
    ``own_timeout`` (its own, e.g. math-verify's), ``error`` (it raised, or its worker died)
    or ``invalid`` (it returned no finite number)."""

    name: str
    kind: str
    message: str


@dataclass
class Outcome:
    parts: dict[str, Reward] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)


def _serve(conn: Connection, score: Callable[[str, Any], Outcome]) -> None:
    """A worker's loop: score items (a sample and the names of its functions) from ``conn``
    until it closes."""
    while True:
        try:
            sample, names = conn.recv()
        except EOFError:
            return
        conn.send(score(sample, names))


def zygote_main(fd: int, names: Sequence[str], mv_timeout: int,
                prepare: Callable[[Sequence[str], int], Callable[[Any, Sequence[str]], Outcome]]
                ) -> None:
    """The zygote (``python -m envs.reward_worker``): ``prepare`` the functions (imported once,
    here), say ready, then fork a worker for each socket the pool sends over ``fd`` (answering
    with its pid) until the pool closes ``fd``. Its children are reaped by the kernel (SIGCHLD
    ignored)."""
    control = socket.socket(fileno=fd)
    score = prepare(names, mv_timeout)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    control.sendall(b"R")
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 1, 1)
        except OSError:
            return
        if not message or not fds:  # the pool closed its end
            return
        pid = os.fork()
        if pid == 0:  # the worker
            code = 0
            try:
                control.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # a function may run subprocesses
                _serve(Connection(fds[0]), score)
            except BaseException:  # noqa: BLE001 - reported to the pool as a dead worker
                code = 1
            finally:
                os._exit(code)  # never the zygote's clean-up
        os.close(fds[0])
        control.sendall(pid.to_bytes(4, "big"))


class _Worker:
    """One worker process (forked by the zygote, so not our child) on a socket pair; killed
    through a pidfd where the platform has one, so a recycled pid is never signalled."""

    def __init__(self, pid: int, conn: Connection) -> None:
        self.pid = pid
        self.conn = conn
        self._pidfd: int | None = None
        if hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(pid)
            except OSError:  # already gone: it will read as dead
                self._pidfd = None

    def kill(self) -> None:
        """Kill it and close its socket (again: a no-op)."""
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            elif not hasattr(os, "pidfd_open"):
                os.kill(self.pid, signal.SIGKILL)
        except OSError:  # already gone
            pass
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if not self.conn.closed:
            self.conn.close()


class _Zygote:
    """A fresh interpreter (not a fork of the caller, which has threads) that imports the reward
    functions once and forks every worker from itself: a worker is ready in milliseconds, where
    a fresh interpreter spends a core for most of a second importing sympy, so a killed worker
    costs the run nothing to replace."""

    def __init__(self, names: tuple[str, ...], mv_timeout: int) -> None:
        ours, theirs = socket.socketpair()
        path = [p for p in sys.path if p and os.path.isdir(p)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "envs.reward_worker", str(theirs.fileno()),
                 str(mv_timeout), *names],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.control = ours
        self.ready = False

    def wait_ready(self) -> bool:
        if not self.ready:
            try:
                self.control.settimeout(_READY_TIMEOUT_S)
                self.ready = self.control.recv(1) == b"R"
            except OSError:
                self.ready = False
        return self.ready

    def fork(self) -> _Worker | None:
        """A new worker, or None when the zygote is gone."""
        if not self.wait_ready():
            return None
        ours, theirs = socket.socketpair()
        try:
            self.control.settimeout(_FORK_TIMEOUT_S)
            socket.send_fds(self.control, [b"F"], [theirs.fileno()])
            answer = b""
            while len(answer) < 4:
                chunk = self.control.recv(4 - len(answer))
                if not chunk:
                    raise EOFError
                answer += chunk
        except (OSError, EOFError):
            ours.close()
            return None
        finally:
            theirs.close()
        return _Worker(int.from_bytes(answer, "big"), Connection(ours.detach()))

    def close(self) -> int | None:
        """Stop it (closing its socket ends its loop); its exit code."""
        self.control.close()
        try:
            return self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(5)


class VerificationLost(Exception):
    """An item's worker timed out (``timed_out``) or died, or none could start."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class WorkerPool:
    """Workers scoring the isolated functions ``names``, each item under ``timeout_s`` of
    wall-clock time; :meth:`run` blocks and is called from threads. Use as a (sync) context
    manager.

    ``processes`` workers serve items; a worker busy past :attr:`stall_s` stops counting
    against that number, so a hung verification holds its own worker and item and nothing
    else: the next item gets a freshly forked worker. A spare left over once the stalled one
    returns is stopped. ``stall_s`` is ten times what an item has been taking (a running
    mean), at least 50 ms and at most a quarter of the limit or 1 s: a slow but sound item
    costs at most a fork."""

    def __init__(self, names: Sequence[str], processes: int, timeout_s: float) -> None:
        self.names = tuple(names)
        self.timeout_s = timeout_s
        self._stall_cap = min(1.0, timeout_s / 4)
        self._item_s = 0.0  # the running mean of an item's time
        self.processes = processes
        self._mv_timeout = max(1, int(timeout_s * 0.8))
        self._zygote: _Zygote | None = None
        self._fork_lock = threading.Lock()  # one fork request on the zygote's socket at a time
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._busy: dict[_Worker, float] = {}  # when each busy worker took its item
        self._alive = 0  # workers forked and not stopped (reserved before a fork)
        self._lock = threading.Lock()
        self._closed = False
        self.timeouts = 0
        self.errors = 0

    def __enter__(self) -> Self:
        """Start the zygote and fork ``processes`` workers: the reward functions are imported
        before the first item, not while it waits."""
        self._zygote = _Zygote(self.names, self._mv_timeout)
        workers = []
        try:  # up to 4 now (an async function's pool may allow dozens: forked as needed)
            while len(workers) < 4 and self._room():
                workers.append(self._fork())
        except VerificationLost:
            pass  # counted; the first items score 0 and say why
        for worker in workers:
            self._idle.put(worker)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers = list(self._busy)
            self._busy.clear()
        while True:
            try:
                workers.append(self._idle.get_nowait())
            except queue.Empty:
                break
        for worker in workers:
            worker.kill()
        with self._fork_lock:
            if self._zygote is not None:
                self._zygote.close()
                self._zygote = None

    @property
    def stall_s(self) -> float:
        """How long a worker is busy before it stops counting against ``processes``."""
        return min(self._stall_cap, max(0.05, 10 * self._item_s))

    def _room(self) -> bool:
        """Reserve a new worker if fewer than ``processes`` are alive and not stalled."""
        with self._lock:
            if self._alive < self.processes + self._stalled():
                self._alive += 1
                return True
            return False

    def _stalled(self) -> int:
        """Busy workers past ``stall_s`` (with the lock held)."""
        now, stall_s = time.monotonic(), self.stall_s
        return sum(1 for t in self._busy.values() if now - t >= stall_s)

    def _fork(self) -> _Worker:
        """A worker for the reservation just made (the zygote restarted once if it is gone)."""
        with self._fork_lock:
            for _ in range(2):
                if self._zygote is None:
                    break  # closed
                worker = self._zygote.fork()
                if worker is not None:
                    return worker
                code = self._zygote.close()
                log.warning("the reward workers' zygote exited (code %s); starting another", code)
                self._zygote = _Zygote(self.names, self._mv_timeout)
        with self._lock:
            self._alive -= 1
            self.errors += 1
        raise VerificationLost("reward workers cannot start (the functions fail to import?)")

    def _acquire(self) -> _Worker:
        while True:
            if self._closed:
                raise VerificationLost("the reward pool is closed")
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                worker = self._fork() if self._room() else None
            if worker is None:
                try:
                    worker = self._idle.get(timeout=0.05)
                except queue.Empty:
                    continue
            with self._lock:
                self._busy[worker] = time.monotonic()
            return worker

    def _release(self, worker: _Worker) -> None:
        """``worker`` is done with its item: idle again, or stopped if it is a spare too many."""
        with self._lock:
            took = time.monotonic() - self._busy.pop(worker)
            self._item_s += 0.1 * (took - self._item_s)
            surplus = self._closed or self._alive > self.processes + self._stalled()
            if surplus:
                self._alive -= 1
        if surplus:
            worker.kill()
        else:
            self._idle.put(worker)

    def _discard(self, worker: _Worker, timed_out: bool) -> None:
        with self._lock:
            self._busy.pop(worker, None)
            self._alive -= 1
            if timed_out:
                self.timeouts += 1
            else:
                self.errors += 1
        worker.kill()

    def run(self, sample: Any, names: Sequence[str] | None = None) -> Outcome:
        """Score one item with the functions ``names`` (all by default); VerificationLost when
        its worker timed out or died (stopped)."""
        worker = self._acquire()
        try:
            worker.conn.send((sample, tuple(names or self.names)))
            if worker.conn.poll(self.timeout_s):
                outcome: Outcome = worker.conn.recv()
                self._release(worker)
                return outcome
            reason, timed_out = f"no result within {self.timeout_s:g} s", True
        except (EOFError, OSError):
            reason, timed_out = "its worker died", False
        self._discard(worker, timed_out)
        raise VerificationLost(reason, timed_out)
