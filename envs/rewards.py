"""Rewards by name, usable by every environment, and verification that cannot stall a run.

A reward function takes ``(completion, answer, metadata)`` — the model's reply, the reference
answer and the task's metadata (a dataset row's other columns) — and returns a float or a
:class:`~envs.base.Reward`; it may be a plain or an ``async`` function. ``env.reward`` names one
or a weighted sum (:func:`parse_terms`): ``math``, ``{math: 1.0, format: 0.1}`` or
``[math, format]`` (weight 1 each). A name is a built-in below, ``judge`` (an LLM judge:
:mod:`envs.judge`, configured by ``env.judge``) or any ``package.module:function``.

Built-ins (:data:`BUILTINS`):

* ``math`` — math-verify. The answer is taken from the reply's last ``\\boxed{…}`` (or
  ``\\fbox{…}``), else the last ``<answer>…</answer>``, else the last number in it; a reply with
  none of these scores 0: the whole text is never compared. The answer and the ground truth
  (``$…$`` stripped, each read as the content of a ``\\boxed{}``) are parsed by math-verify and
  checked for mathematical equivalence (``\\frac{3}{4}`` = ``0.75``, sets, intervals,
  equations, LaTeX or plain); equal normalised strings count too (a text answer).
* ``exact`` — the extracted answer (boxed, then tags, then the whole reply) equals the answer
  after normalising: case, white space, surrounding ``$`` and a final period.
* ``choice`` — a multiple-choice letter (A–Z): boxed, tagged, "answer is (B)", or a reply
  that is only the letter; compared with the answer's leading letter.
* ``regex`` — the reference answer is a regular expression that must match the whole
  extracted answer (boxed, then tags, then the whole reply).
* ``format`` — 1 when the reply has an extractable final answer (``\\boxed{}`` or
  ``<answer>`` tags), for a small weight beside another reward.

**Isolation.** ``math``, ``regex`` and every ``module:function`` (anything that can hang on a
model's output: sympy, a catastrophic pattern, user code) run in worker processes
(:class:`WorkerPool`), ``exact``, ``choice`` and ``format`` in the caller. Each item's isolated
parts run in one worker under a hard wall-clock limit (``timeout_s``): a worker past it is
killed (SIGKILL) and replaced by a fresh one, and the item's isolated parts score 0 (counted
in ``reward/timeouts``); a worker that dies (``os._exit``, a segfault) likewise (counted in
``reward/errors``); a function that raises scores 0 for its part and is counted in
``reward/errors``, its worker kept. The caller's event loop only waits: each item's wait runs
in a thread of the pool's own (``anyio.to_thread``), so a slow verification delays only its
own episode. A verification past a quarter of its limit (at most 1 s) stops counting against
``processes``: the next item gets another worker, so a hang holds only its own item. Workers
are forked by a zygote, one fresh interpreter (``python -m envs.reward_worker``, on a socket
pair; not a fork of the caller, which has threads) that imports the reward functions once,
ahead of need: a replacement is ready in milliseconds, and import time is billed to no item.
math-verify's own ``signal.alarm`` timeout works in a worker (its main thread) and is set
below the hard limit, so a slow sympy call usually ends gracefully first.

**The judge** (``judge``) is asynchronous and bounded by its own limits (a per-call timeout,
retries, a cap on calls in flight: :class:`envs.judge.Judge`): it is awaited in the caller's
task, never in a worker, so an episode waiting on its judge holds no worker and stops no other
episode. It needs the prompt, which the ``(completion, answer, metadata)`` functions do not
get: :meth:`Scorer.score` takes it as ``prompt`` and hands it to the judge alone. A sample the
judge could not score (``judge/unscored``) scores 0 for that term.

Limits: arguments and results cross a pipe by pickle (metadata must be picklable: a dataset
row's plain values are); one item's isolated parts share its time limit.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any, Protocol, Self

import anyio
import anyio.to_thread

from envs.answers import extract_final, extract_math, last_boxed, last_tagged, normalise
from envs.base import Reward, RewardTerm
from envs.errors import EnvConfigError
from envs.judge import Judge

log = logging.getLogger(__name__)

RewardValue = float | Reward


class RewardFunction(Protocol):
    """What a user hands in as ``package.module:function`` (or ``async def``)."""

    def __call__(self, completion: str, answer: str,
                 metadata: Mapping[str, Any]) -> RewardValue | Awaitable[RewardValue]: ...


# --- the built-ins ----------------------------------------------------------------------------


def _as_boxed(text: str) -> str:
    text = text.strip()
    if "\\boxed" in text or "\\fbox" in text:
        return text
    if len(text) >= 2 and text[0] == text[-1] == "$":
        text = text.strip("$")
    return f"\\boxed{{{text}}}"


def math_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    from math_verify import parse, verify

    extracted = extract_math(completion)
    if extracted is None:
        return 0.0
    if normalise(extracted) == normalise(answer):
        return 1.0
    limit = _MATH_VERIFY_TIMEOUT
    gold = parse(_as_boxed(answer), parsing_timeout=limit)
    guess = parse(_as_boxed(extracted), parsing_timeout=limit)
    if not gold or not guess:
        return 0.0
    return 1.0 if verify(gold, guess, timeout_seconds=limit) else 0.0


def exact_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    return 1.0 if normalise(extract_final(completion)) == normalise(answer) else 0.0


_LETTER = re.compile(r"^\(?([A-Za-z])\)?(?:[.):\s]|$)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*\(?([A-Z])\b\)?", re.IGNORECASE)


def _letter(text: str) -> str | None:
    match = _LETTER.match(text.strip())
    return match.group(1).upper() if match else None


def choice_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    reference = _letter(answer)
    if reference is None:
        return 0.0
    picked = None
    for found in (last_boxed(completion), last_tagged(completion)):
        if found:
            picked = _letter(found)
            break
    if picked is None:
        stated = _ANSWER_IS.findall(completion)
        if stated:
            picked = stated[-1].upper()
        elif len(completion.strip()) <= 3:
            picked = _letter(completion)
    return 1.0 if picked == reference else 0.0


def regex_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    return 1.0 if re.fullmatch(answer, extract_final(completion), flags=re.DOTALL) else 0.0


def format_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    return 1.0 if last_boxed(completion) or last_tagged(completion) else 0.0


_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _plain_number(text: str) -> float | None:
    text = text.strip().strip("$").strip()
    return float(text) if _PLAIN_NUMBER.fullmatch(text) else None


def math_quick(completion: str, answer: str) -> float | None:
    """``math``'s score where it needs no parser (so cannot hang): nothing extractable (0),
    the same text (1), two plain decimal numbers (compared as numbers); else None."""
    extracted = extract_math(completion)
    if extracted is None:
        return 0.0
    if normalise(extracted) == normalise(answer):
        return 1.0
    guess, gold = _plain_number(extracted), _plain_number(answer)
    if guess is None or gold is None:
        return None
    return 1.0 if math.isclose(guess, gold, rel_tol=1e-9, abs_tol=1e-12) else 0.0


@dataclass(frozen=True)
class Builtin:
    fn: Callable[[str, str, Mapping[str, Any]], float]
    isolated: bool  # may hang or crash on a model's output: runs in a worker process
    # an isolated built-in's score in the caller where it is certain without the risky part
    quick: Callable[[str, str], float | None] | None = None


BUILTINS: dict[str, Builtin] = {
    "math": Builtin(math_reward, isolated=True, quick=math_quick),
    "exact": Builtin(exact_reward, isolated=False),
    "choice": Builtin(choice_reward, isolated=False),
    "regex": Builtin(regex_reward, isolated=True),
    "format": Builtin(format_reward, isolated=False),
}
_MATH_VERIFY_TIMEOUT = 5  # seconds, math-verify's own alarm in a worker (set by the pool)
CACHE_ITEMS = 8192  # scores kept per Scorer (built-ins only)
JUDGE = "judge"  # the LLM judge's name in env.reward (envs.judge; scored by Scorer itself)


def judge_outside_scorer(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    """What ``resolve("judge")`` gives: the judge needs its endpoint and the prompt, which a
    plain call lacks; it scores through :class:`Scorer` only."""
    raise RuntimeError("the judge reward scores through envs.rewards.Scorer (with env.judge), "
                       "not as a plain function")


# --- names, weights, functions ----------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    name: str
    weight: float


def parse_terms(value: object, key: str = "env.reward") -> tuple[Term, ...]:
    """``env.reward`` as weighted terms: a name, a list of names (weight 1 each) or a mapping
    of names to weights. Every name is resolved now (EnvConfigError naming ``key``)."""
    if isinstance(value, str):
        terms = [Term(value, 1.0)]
    elif isinstance(value, Mapping):
        terms = []
        for name, weight in value.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise EnvConfigError(f"{key}.{name} must be a number (its weight), got {weight!r}")
            terms.append(Term(str(name), float(weight)))
    elif isinstance(value, Sequence):
        terms = [Term(str(name), 1.0) for name in value]
    else:
        raise EnvConfigError(f"{key} must be a reward name, a list of names or a mapping of "
                             f"names to weights, got {value!r}")
    if not terms:
        raise EnvConfigError(f"{key} names no reward; e.g. {key}=math")
    for term in terms:
        resolve(term.name, key)
    return tuple(terms)


def resolve(name: str, key: str = "env.reward") -> Callable[..., Any]:
    """The function ``name`` stands for: a built-in or ``package.module:function`` taking
    ``(completion, answer, metadata)``."""
    if name in BUILTINS:
        return BUILTINS[name].fn
    if name == JUDGE:
        return judge_outside_scorer
    if ":" not in name:
        raise EnvConfigError(f"{key} names an unknown reward {name!r}: choose from "
                             f"{', '.join(BUILTINS)}, {JUDGE} or give package.module:function")
    module_name, _, attr = name.partition(":")
    try:
        fn: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            fn = getattr(fn, part)
    except ImportError as e:
        raise EnvConfigError(f"{key}: cannot import {module_name} for reward {name}: {e}") from e
    except AttributeError as e:
        raise EnvConfigError(f"{key}: {module_name} has no {attr} (reward {name})") from e
    if not callable(fn):
        raise EnvConfigError(f"{key}: {name} is not a function")
    try:
        inspect.signature(fn).bind("completion", "answer", {})
    except TypeError as e:
        raise EnvConfigError(f"{key}: {name} must take (completion, answer, metadata): {e}") from e
    except ValueError:
        pass  # no signature to read (a builtin): trust it
    return fn


def isolated(name: str) -> bool:
    return BUILTINS[name].isolated if name in BUILTINS else name != JUDGE


def as_reward(value: object, name: str) -> Reward:
    """A function's result as a Reward; TypeError for anything else (counted as an error)."""
    if isinstance(value, Reward):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"reward {name} returned {type(value).__name__}, not a float or Reward")
    if not math.isfinite(value):
        raise TypeError(f"reward {name} returned {value}")
    return Reward(total=float(value))


def call(fn: Callable[..., Any], name: str, completion: str, answer: str,
         metadata: Mapping[str, Any]) -> Reward:
    """Call a reward function (an async one in a fresh event loop: this runs in a worker
    process or in a thread, never on the caller's loop)."""
    value = fn(completion, answer, metadata)
    if inspect.isawaitable(value):
        value = asyncio.run(_await(value))
    return as_reward(value, name)


async def _await(value: Awaitable[Any]) -> Any:
    return await value


# --- the worker processes ---------------------------------------------------------------------

_READY_TIMEOUT_S = 120.0  # the zygote importing the reward functions (once, before any item)
_FORK_TIMEOUT_S = 10.0  # the zygote answering a fork request


@dataclass
class _Outcome:
    parts: dict[str, Reward] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # "name: message" per function that raised


def _serve(conn: Connection, fns: Mapping[str, Callable[..., Any]]) -> None:
    """A worker's loop: score items from ``conn`` until it closes."""
    while True:
        try:
            completion, answer, metadata, names = conn.recv()
        except EOFError:
            return
        outcome = _Outcome()
        for name in names:
            try:
                outcome.parts[name] = call(fns[name], name, completion, answer, metadata)
            except Exception as e:  # noqa: BLE001 - a raising verification scores 0, counted
                outcome.errors.append(f"{name}: {type(e).__name__}: {e}"[:300])
        conn.send(outcome)


def zygote_main(fd: int, names: Sequence[str], mv_timeout: int) -> None:
    """The zygote (``python -m envs.reward_worker``): import the functions, say ready, then fork
    a worker for each socket the pool sends over ``fd`` (answering with its pid) until the
    pool closes ``fd``. Its children are reaped by the kernel (SIGCHLD ignored)."""
    global _MATH_VERIFY_TIMEOUT
    _MATH_VERIFY_TIMEOUT = mv_timeout
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # its per-item timeout notes
    control = socket.socket(fileno=fd)
    fns = {name: resolve(name) for name in names}
    if "math" in fns:  # math-verify imports its parsers on first use: once here, not per worker
        math_reward("\\boxed{\\frac{1}{2}}", "0.5", {})
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
                _serve(Connection(fds[0]), fns)
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
    """Internal: an item's worker timed out or died."""


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
        try:
            while self._room():
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

    def run(self, completion: str, answer: str, metadata: Mapping[str, Any],
            names: Sequence[str] | None = None) -> _Outcome:
        """Score one item with the functions ``names`` (all by default); VerificationLost when
        its worker timed out or died (stopped)."""
        worker = self._acquire()
        try:
            worker.conn.send((completion, answer, dict(metadata), tuple(names or self.names)))
            if worker.conn.poll(self.timeout_s):
                outcome: _Outcome = worker.conn.recv()
                self._release(worker)
                return outcome
            reason, timed_out = f"no result within {self.timeout_s:g} s", True
        except (EOFError, OSError):
            reason, timed_out = "its worker died", False
        self._discard(worker, timed_out)
        raise VerificationLost(reason)


# --- the scorer every environment uses --------------------------------------------------------


class Scorer:
    """``env.reward``'s weighted terms, scored: an async context manager holding the worker
    pool while any term is isolated. :meth:`score` gives the weighted total with its terms
    (each also a component, as is what a function reports beside its score); its counters go into the run's metrics (:meth:`metrics`)."""

    def __init__(self, reward: object, timeout_s: float = 10.0, processes: int = 2,
                 key: str = "env.reward", judge: Mapping[str, Any] | None = None) -> None:
        if not timeout_s > 0:
            raise EnvConfigError(f"env.reward_timeout_s must be > 0, got {timeout_s}")
        if processes < 1:
            raise EnvConfigError(f"env.reward_processes must be >= 1, got {processes}")
        self.terms = parse_terms(reward, key)
        self.timeout_s = timeout_s
        self.processes = processes
        # the judge (env.judge) when a term names it; its settings are checked now
        self._judge = Judge(judge) if any(t.name == JUDGE for t in self.terms) else None
        self._local = {t.name: resolve(t.name) for t in self.terms
                       if not isolated(t.name) and t.name != JUDGE}
        self._isolated = tuple(t.name for t in self.terms if isolated(t.name))
        self._pool: WorkerPool | None = None
        self._limiter: anyio.CapacityLimiter | None = None
        # Built-ins are functions of (completion, answer) alone: each one's score is decided
        # in the caller where that is certain, or kept for the same reply to the same answer
        # (a group's samples often repeat one). A user's function is always asked.
        self._cache: OrderedDict[tuple[str, str, str], Reward] = OrderedDict()
        self._spared = 0  # items whose isolated terms were all scored without a worker
        self._errors = 0  # raised in the caller (local terms) or in a worker
        self._timeouts = 0  # of pools closed already
        self._scored = 0
        self._last_error = 0.0

    async def __aenter__(self) -> Self:
        if self._judge is not None:  # first: an endpoint that does not answer is one line now
            await self._judge.__aenter__()
        if self._isolated:
            pool = WorkerPool(self._isolated, self.processes, self.timeout_s)
            try:
                await anyio.to_thread.run_sync(pool.__enter__)
            except BaseException:
                if self._judge is not None:
                    await self._judge.aclose()
                raise
            self._pool = pool
            # more waiting threads than workers: a waiting item holds no worker
            self._limiter = anyio.CapacityLimiter(4 * self.processes)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        pool, self._pool = self._pool, None
        if self._judge is not None:
            await self._judge.aclose()
        if pool is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(pool.close)
            self._timeouts += pool.timeouts
            self._errors += pool.errors

    async def score(self, completion: str, answer: str,
                    metadata: Mapping[str, Any] | None = None,
                    prompt: Sequence[Mapping[str, str]] | str | None = None) -> Reward:
        """``completion``'s reward; ``prompt`` (the task's messages) is the judge's question
        and reaches no other term."""
        metadata = metadata or {}
        parts: dict[str, Reward] = {}
        for name, fn in self._local.items():
            try:
                parts[name] = call(fn, name, completion, answer, metadata)
            except Exception as e:  # noqa: BLE001 - a raising reward scores 0, counted
                self._error(f"{name}: {type(e).__name__}: {e}")
        if self._judge is not None:  # awaited here, in the episode's task: others go on
            verdict = await self._judge.score(prompt if prompt is not None else "", completion,
                                              answer)
            parts[JUDGE] = Reward(verdict.score if verdict.score is not None else 0.0)
        if self._isolated:
            if self._pool is None or self._limiter is None:
                raise RuntimeError("Scorer.score() outside `async with scorer:` (the worker "
                                   "pool runs there)")
            asked = []
            for name in self._isolated:
                known = self._known(name, completion, answer)
                if known is None:
                    asked.append(name)
                else:
                    parts[name] = known
            if not asked:  # decided here, or scored before: no worker round trip
                self._spared += 1
            else:
                try:
                    outcome = await anyio.to_thread.run_sync(
                        self._pool.run, completion, answer, metadata, tuple(asked),
                        limiter=self._limiter, abandon_on_cancel=True)
                    parts.update(outcome.parts)
                    for message in outcome.errors:
                        self._error(message)
                    for name, part in outcome.parts.items():
                        if name in BUILTINS:
                            self._remember((name, completion, answer), part)
                except VerificationLost as e:
                    self._warn(f"reward verification scored 0: {e}")
        self._scored += 1
        terms: list[RewardTerm] = []
        diagnostics: dict[str, float] = {}  # what a function reports beside its score
        for term in self.terms:
            part = parts.get(term.name, Reward(0.0))
            terms.append(RewardTerm(term.name, term.weight, part.total))
            for sub, value in part.components.items():
                diagnostics[f"{term.name}/{sub}"] = value
        return Reward.weighted(terms, diagnostics)

    def _known(self, name: str, completion: str, answer: str) -> Reward | None:
        """An isolated built-in's score without a worker: decided here (``Builtin.quick``) or
        scored before; None for a user's function or a new item."""
        builtin = BUILTINS.get(name)
        if builtin is None:
            return None
        value = builtin.quick(completion, answer) if builtin.quick is not None else None
        if value is not None:
            return Reward(value)
        return self._cache.get((name, completion, answer))

    def _remember(self, key: tuple[str, str, str], part: Reward) -> None:
        self._cache[key] = part
        if len(self._cache) > CACHE_ITEMS:
            self._cache.popitem(last=False)

    def _error(self, message: str) -> None:
        self._errors += 1
        self._warn(f"reward raised, scored 0: {message}")

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_error > 10.0:  # at most one line in 10 s: a broken verifier is loud enough
            log.warning("%s (reward/timeouts and reward/errors count them)", message)
            self._last_error = now

    def metrics(self) -> dict[str, float]:
        pool = self._pool
        return {
            "reward/timeouts": float(self._timeouts + (pool.timeouts if pool else 0)),
            "reward/errors": float(self._errors + (pool.errors if pool else 0)),
            "reward/spared": float(self._spared),  # isolated scores found without a worker
            **(self._judge.metrics() if self._judge is not None else {}),
        }
