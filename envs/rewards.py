"""Rewards by name, usable by every environment, and verification that cannot stall a run.

A reward function takes ``(completion, answer, metadata)`` — the model's reply, the reference
answer and the task's metadata (a dataset row's other columns) — and returns a float or a
:class:`~envs.base.Reward`; it may be a plain or an ``async`` function. ``env.reward`` names one
or a weighted sum (:func:`parse_terms`): ``math``, ``{math: 1.0, format: 0.1}`` or
``[math, format]`` (weight 1 each). A name is a built-in below or any
``package.module:function``.

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
own episode. Each worker is a fresh interpreter (``python -m envs.reward_worker``, on a socket
pair; not a fork, since the caller has threads), started ahead of need, and it imports the
reward functions before it takes its first item (import time is not billed to an item).
math-verify's own ``signal.alarm`` timeout works in a worker (its main thread) and is set
below the hard limit, so a slow sympy call usually ends gracefully first.

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
from envs.base import Reward
from envs.errors import EnvConfigError

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
    if ":" not in name:
        raise EnvConfigError(f"{key} names an unknown reward {name!r}: choose from "
                             f"{', '.join(BUILTINS)} or give package.module:function")
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
    return BUILTINS[name].isolated if name in BUILTINS else True


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

_READY_TIMEOUT_S = 120.0  # a worker importing the reward functions (once, before any item)


@dataclass
class _Outcome:
    parts: dict[str, Reward] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # "name: message" per function that raised


def worker_main(fd: int, names: Sequence[str], mv_timeout: int) -> None:
    """A worker (``python -m envs.reward_worker``): import the functions, say ready, then
    score items from the socket ``fd`` until it closes."""
    global _MATH_VERIFY_TIMEOUT
    _MATH_VERIFY_TIMEOUT = mv_timeout
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # its per-item timeout notes
    conn = Connection(fd)
    fns = {name: resolve(name) for name in names}
    conn.send("ready")
    while True:
        try:
            completion, answer, metadata = conn.recv()
        except EOFError:
            return
        outcome = _Outcome()
        for name, fn in fns.items():
            try:
                outcome.parts[name] = call(fn, name, completion, answer, metadata)
            except Exception as e:  # noqa: BLE001 - a raising verification scores 0, counted
                outcome.errors.append(f"{name}: {type(e).__name__}: {e}"[:300])
        conn.send(outcome)


class _Worker:
    """One worker process, a fresh interpreter (not a fork: the caller has threads, and a
    multiprocessing child would re-import the caller's main module), on a socket pair."""

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
        self.conn = Connection(ours.detach())
        self.ready = False

    def wait_ready(self) -> bool:
        if not self.ready:
            try:
                self.ready = self.conn.poll(_READY_TIMEOUT_S) and self.conn.recv() == "ready"
            except (EOFError, OSError):
                self.ready = False
        return self.ready

    def kill(self) -> int | None:
        """Kill and reap it (again: a no-op); its exit code."""
        if self.process.poll() is None:
            self.process.kill()
        try:
            code = self.process.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        if not self.conn.closed:
            self.conn.close()
        return code


class VerificationLost(Exception):
    """Internal: an item's worker timed out or died."""


class WorkerPool:
    """``processes`` workers scoring the isolated functions ``names``, each item under
    ``timeout_s`` of wall-clock time. Use as a (sync) context manager; :meth:`run` blocks and
    is called from threads."""

    def __init__(self, names: Sequence[str], processes: int, timeout_s: float) -> None:
        self.names = tuple(names)
        self.timeout_s = timeout_s
        self.processes = processes
        self._mv_timeout = max(1, int(timeout_s * 0.8))
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.timeouts = 0
        self.errors = 0

    def __enter__(self) -> Self:
        for _ in range(self.processes):
            self._idle.put(self._spawn())
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._all = list(self._all), set()
        for worker in workers:
            worker.kill()

    def _spawn(self) -> _Worker:
        worker = _Worker(self.names, self._mv_timeout)
        with self._lock:
            self._all.add(worker)
        return worker

    def _replace(self, worker: _Worker) -> int | None:
        with self._lock:
            self._all.discard(worker)
            closed = self._closed
        code = worker.kill()
        if not closed:
            self._idle.put(self._spawn())
        return code

    def run(self, completion: str, answer: str, metadata: Mapping[str, Any]) -> _Outcome:
        """Score one item; VerificationLost when its worker timed out or died (replaced)."""
        while True:
            if self._closed:
                raise VerificationLost("the reward pool is closed")
            try:
                worker = self._idle.get(timeout=0.5)
                break
            except queue.Empty:
                continue
        if not worker.wait_ready():
            code = self._replace(worker)
            with self._lock:
                self.errors += 1
            raise VerificationLost(f"a reward worker failed to start (exit code {code})")
        try:
            worker.conn.send((completion, answer, dict(metadata)))
            if worker.conn.poll(self.timeout_s):
                outcome: _Outcome = worker.conn.recv()
                self._idle.put(worker)
                return outcome
            reason, timed_out = f"no result within {self.timeout_s:g} s", True
        except (EOFError, OSError, BrokenPipeError):
            reason, timed_out = "its worker died", False
        code = self._replace(worker)
        with self._lock:
            if timed_out:
                self.timeouts += 1
            else:
                self.errors += 1
        raise VerificationLost(reason if timed_out else f"{reason} (exit code {code})")


# --- the scorer every environment uses --------------------------------------------------------


class Scorer:
    """``env.reward``'s weighted terms, scored: an async context manager holding the worker
    pool while any term is isolated. :meth:`score` gives the weighted total and each term's
    value as a component; its counters go into the run's metrics (:meth:`metrics`)."""

    def __init__(self, reward: object, timeout_s: float = 10.0, processes: int = 2,
                 key: str = "env.reward") -> None:
        if not timeout_s > 0:
            raise EnvConfigError(f"env.reward_timeout_s must be > 0, got {timeout_s}")
        if processes < 1:
            raise EnvConfigError(f"env.reward_processes must be >= 1, got {processes}")
        self.terms = parse_terms(reward, key)
        self.timeout_s = timeout_s
        self.processes = processes
        self._local = {t.name: resolve(t.name) for t in self.terms if not isolated(t.name)}
        self._isolated = tuple(t.name for t in self.terms if isolated(t.name))
        self._pool: WorkerPool | None = None
        self._limiter: anyio.CapacityLimiter | None = None
        # Built-ins are functions of (completion, answer) alone: their scores are decided in
        # the caller where that is certain, or kept for the same reply to the same answer (a
        # group's samples often repeat one). A user's function is always asked.
        self._cacheable = all(name in BUILTINS for name in self._isolated)
        self._cache: OrderedDict[tuple[str, str], dict[str, Reward]] = OrderedDict()
        self._spared = 0  # items scored without a worker
        self._errors = 0  # raised in the caller (local terms) or in a worker
        self._timeouts = 0  # of pools closed already
        self._scored = 0
        self._last_error = 0.0

    async def __aenter__(self) -> Self:
        if self._isolated:
            pool = WorkerPool(self._isolated, self.processes, self.timeout_s)
            await anyio.to_thread.run_sync(pool.__enter__)
            self._pool = pool
            # more waiting threads than workers: a waiting item holds no worker
            self._limiter = anyio.CapacityLimiter(4 * self.processes)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(pool.close)
            self._timeouts += pool.timeouts
            self._errors += pool.errors

    async def score(self, completion: str, answer: str,
                    metadata: Mapping[str, Any] | None = None) -> Reward:
        metadata = metadata or {}
        parts: dict[str, Reward] = {}
        for name, fn in self._local.items():
            try:
                parts[name] = call(fn, name, completion, answer, metadata)
            except Exception as e:  # noqa: BLE001 - a raising reward scores 0, counted
                self._error(f"{name}: {type(e).__name__}: {e}")
        if self._isolated:
            if self._pool is None or self._limiter is None:
                raise RuntimeError("Scorer.score() outside `async with scorer:` (the worker "
                                   "pool runs there)")
            key = (completion, answer)
            known = self._quick(completion, answer) if self._cacheable else None
            if known is None and self._cacheable:
                known = self._cache.get(key)
            if known is not None:  # decided here, or scored before: no worker round trip
                parts.update(known)
                self._spared += 1
            else:
                try:
                    outcome = await anyio.to_thread.run_sync(
                        self._pool.run, completion, answer, metadata,
                        limiter=self._limiter, abandon_on_cancel=True)
                    parts.update(outcome.parts)
                    for message in outcome.errors:
                        self._error(message)
                    if self._cacheable and not outcome.errors:
                        self._remember(key, dict(outcome.parts))
                except VerificationLost as e:
                    self._warn(f"reward verification scored 0: {e}")
        self._scored += 1
        components: dict[str, float] = {}
        total = 0.0
        for term in self.terms:
            part = parts.get(term.name, Reward(0.0))
            total += term.weight * part.total
            components[term.name] = part.total
            for sub, value in part.components.items():
                components[f"{term.name}/{sub}"] = value
        return Reward(total=total, components=components)

    def _quick(self, completion: str, answer: str) -> dict[str, Reward] | None:
        """Every isolated term's score decided in the caller (``Builtin.quick``), or None."""
        parts = {}
        for name in self._isolated:
            quick = BUILTINS[name].quick
            value = quick(completion, answer) if quick is not None else None
            if value is None:
                return None
            parts[name] = Reward(value)
        return parts

    def _remember(self, key: tuple[str, str], parts: dict[str, Reward]) -> None:
        self._cache[key] = parts
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
        }
