"""One reward system for every environment, scored: the :class:`Scorer` every environment uses,
its judge, the weighted sum and verification that cannot stall a run. What a reward function
is and how ``env.reward`` names them (the protocol, the three conventions, the registry and
the built-ins) is :mod:`envs.reward_functions`.

**The judge** (``judge``: an LLM judge, :mod:`envs.judge`, configured by ``env.judge``) is
asynchronous and bounded by its own limits (a per-call timeout, retries, a cap on calls in
flight): it is awaited in the caller's task, never in a worker, so an episode waiting on its
judge holds no worker and stops no other episode; its question is the sample's ``prompt``. A
sample it could not score after its retries is a failure (``reward/failed/judge/error``,
``judge/unscored``) and scores 0 for that term.

**The weighted sum** is :meth:`envs.base.Reward.weighted`, the only one: the terms are the
route's ``name: weight`` entries (``Reward.terms``, what GDPO normalises apart); whatever a
function reports beside its score, and ``failed``, are diagnostics.

**Isolation.** ``math``, ``regex`` and every ``module:function`` (anything that can hang on a
model's output) run in worker processes under the hard limit ``env.reward_timeout_s``
(:mod:`envs.reward_pool`); a plain function in ``env.reward_processes`` of them, an ``async``
one in up to ``env.reward_concurrency`` (each waits on its own I/O, so they overlap). The
cheap built-ins and the environment's own rewards run in the caller; a built-in registered
with ``isolated=False`` that is ``async`` (a judge waiting on an endpoint) is awaited on the
caller's event loop under the same hard limit (``envs.reward_builtins.BUILTINS`` is where a
built-in registers).

**Giving up.** Every way a reward gives up on a sample — our hard timeout (``timeout``), its
own (``own_timeout``), an exception or a dead worker (``error``), a non-number or NaN
(``invalid``) — scores that term 0, marks the sample's reward ``failed`` (a diagnostic, logged
as ``reward/failed``: the step's failed share) and is counted in
``reward/failed/<name>/<kind>``. The run loop stops a run whose rewards failed on more than
half a step's samples for ``env.reward_fail_steps`` steps in a row, naming the reward and its
first error (:attr:`Scorer.first_failure`).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from types import TracebackType
from typing import Any, Self

import anyio
import anyio.to_thread

from envs.base import Reward, RewardTerm
from envs.errors import EnvConfigError
from envs.judge import Judge
from envs.reward_batch import Batcher
from envs.reward_builtins import BUILTINS
from envs.reward_functions import (
    JUDGE,
    RewardValue,
    Sample,
    as_reward,
    failure,
    isolated,
    parse_reward,
    resolve,
)
from envs.reward_pool import Failure, Outcome, VerificationLost, WorkerPool
from sandboxes.api import EngineUnavailable

log = logging.getLogger(__name__)

CACHE_ITEMS = 8192  # scores kept per Scorer (built-ins only)


# --- the scorer every environment uses --------------------------------------------------------

OwnReward = Callable[[], Awaitable[RewardValue]]


class Scorer:
    """``env.reward``'s routes, scored: an async context manager holding the worker pools while
    any term is isolated. :meth:`score` gives the weighted total with its terms; how rewards
    gave up is counted (:meth:`metrics`) and the first time kept (:attr:`first_failure`).

    ``own``: the names of rewards the environment computes itself (handed to :meth:`score` as
    zero-argument async callables for each episode)."""

    def __init__(self, reward: object, timeout_s: float = 10.0, processes: int = 2,
                 key: str = "env.reward", own: Sequence[str] = (),
                 concurrency: int = 32, fail_steps: int = 3,
                 judge: Mapping[str, Any] | None = None) -> None:
        if not timeout_s > 0:
            raise EnvConfigError(f"env.reward_timeout_s must be > 0, got {timeout_s}")
        if processes < 1:
            raise EnvConfigError(f"env.reward_processes must be >= 1, got {processes}")
        if concurrency < 1:
            raise EnvConfigError(f"env.reward_concurrency must be >= 1, got {concurrency}")
        if fail_steps < 1:
            raise EnvConfigError(f"env.reward_fail_steps must be >= 1, got {fail_steps}")
        self.fail_steps = fail_steps  # read by the run loop (EnvSpec.reward_fail_steps)
        self.routes = parse_reward(reward, key, own)
        self.own = tuple(own)
        self.timeout_s = timeout_s
        self.processes = processes
        self.concurrency = concurrency
        names = [n for n in self.routes.names() if n not in self.own]
        self._local: dict[str, Callable[[Sample], Any]] = {
            n: resolve(n, key) for n in names if not isolated(n) and n != JUDGE}
        # the judge (env.judge) when a route names it: its settings are checked now, its
        # endpoint at the start (__aenter__); awaited in the caller under its own limits
        self._judge = Judge(judge) if JUDGE in names else None
        if self._judge is not None:
            self._local[JUDGE] = self._judged
        adapted = {n: resolve(n, key) for n in names if isolated(n)}
        # a plain function holds a worker while it runs; an async one mostly waits on I/O, so
        # those get a pool of their own, sized for overlap
        self._groups = {False: tuple(n for n, f in adapted.items() if not f.is_async),
                        True: tuple(n for n, f in adapted.items() if f.is_async)}
        self._pools: dict[bool, WorkerPool] = {}
        self._limiters: dict[bool, anyio.CapacityLimiter] = {}
        # TRL-style functions take lists: the samples scored at about the same time share one
        # call in a worker (envs.reward_batch), sync or async alike
        self._trl = {n: f.is_async for n, f in adapted.items() if f.convention == "trl"}
        self._batchers: dict[str, Batcher[Sample, Outcome]] = {}
        # Built-ins are functions of (completion, answer) alone: each one's score is decided
        # in the caller where that is certain, or kept for the same reply to the same answer
        # (a group's samples often repeat one). A user's function is always asked.
        self._cache: OrderedDict[tuple[str, str, str], Reward] = OrderedDict()
        self._spared = 0  # items whose isolated terms were all scored without a worker
        self.failed: Counter[tuple[str, str]] = Counter()  # (name, kind) -> samples
        self.first_failure: str | None = None  # "name: kind: message", the first one
        self._scored = 0
        self._last_warning = 0.0

    @property
    def judge_to_serve(self) -> str | None:
        """The ``conf/model`` entry the run must serve as this scorer's judge
        (``env.judge.serve``); None when there is no judge or it is at a URL."""
        return self._judge.config.serve if self._judge is not None else None

    def use_judge_url(self, url: str) -> None:
        """The URL of the judge the run serves (:attr:`judge_to_serve`), once it is up."""
        if self._judge is None:
            raise RuntimeError("this scorer has no judge (env.reward names none)")
        self._judge.use_url(url)

    async def __aenter__(self) -> Self:
        if self._judge is not None:  # first: an endpoint that does not answer is one line now
            await self._judge.__aenter__()
        for is_async, names in self._groups.items():
            if not names:
                continue
            size = self.concurrency if is_async else self.processes
            pool = WorkerPool(names, size, self.timeout_s)
            await anyio.to_thread.run_sync(pool.__enter__)
            self._pools[is_async] = pool
            # more waiting threads than workers: a waiting item holds no worker
            self._limiters[is_async] = anyio.CapacityLimiter(4 * size)
        self._batchers = {name: Batcher(partial(self._run_batch, name)) for name in self._trl}
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        pools, self._pools = self._pools, {}
        if self._judge is not None:
            await self._judge.aclose()
        for pool in pools.values():
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(pool.close)

    async def score(self, sample: Sample, own: Mapping[str, OwnReward] | None = None,
                    diagnostics: Mapping[str, float] | None = None) -> Reward:
        """``sample`` scored by its data source's route; ``own``: this episode's own rewards;
        ``diagnostics``: logged beside the terms, never summed."""
        terms = self.routes.terms(sample.data_source)
        wanted = {t.name for t in terms}
        parts: dict[str, Reward] = {}
        failures: list[Failure] = []
        in_caller: dict[str, Callable[[], Any]] = {}
        for name in wanted & set(self.own):
            if own is None or name not in own:
                raise RuntimeError(f"the environment did not provide its reward {name!r}")
            in_caller[name] = own[name]
        for name, fn in self._local.items():
            if name in wanted:
                in_caller[name] = lambda fn=fn: fn(sample)
        for name, make in in_caller.items():
            # in the caller: a plain built-in returns at once; an async one (a judge) waits
            # on I/O here under the hard limit; the environment's own keep their own limits
            # (a sandbox's timeouts, which include waiting for a session)
            limit = None if name in self.own or name == JUDGE else self.timeout_s
            try:
                with anyio.fail_after(limit):
                    value = make()
                    if inspect.isawaitable(value):
                        value = await value
                parts[name] = as_reward(value, name)
            except TimeoutError:
                failures.append(Failure(name, "timeout", f"no result within {self.timeout_s:g} s"))
            except EngineUnavailable:
                raise  # the sandbox engine is gone: the run stops with its own one line
            except Exception as e:  # noqa: BLE001 - a reward that gives up scores 0, counted
                failures.append(failure(name, e))
        isolated_parts = await self._isolated(sample, wanted)
        parts.update(isolated_parts.parts)
        failures += isolated_parts.failures
        self._scored += 1
        for f in failures:
            self._count(f)
        summed: list[RewardTerm] = []
        extra: dict[str, float] = {}
        for term in terms:
            part = parts.get(term.name, Reward(0.0))
            summed.append(RewardTerm(term.name, term.weight, part.total))
            for sub, value in part.components.items():
                extra[f"{term.name}/{sub}"] = value
        if failures:
            extra["failed"] = 1.0
        return Reward.weighted(summed, {**extra, **(diagnostics or {})})

    async def _judged(self, sample: Sample) -> float:
        """The judge's score of ``sample`` (its prompt is the question); one it could not give
        after its retries is a failure, counted like any reward's."""
        assert self._judge is not None
        verdict = await self._judge.score(sample.prompt or "", sample.completion, sample.answer)
        if verdict.score is None:
            raise RuntimeError(f"unscored: {self._judge.last_failure}")
        return verdict.score

    async def _isolated(self, sample: Sample, wanted: set[str]) -> Outcome:
        """The isolated terms of ``wanted``, each group in its pool, the groups at once."""
        result = Outcome()
        asked: dict[bool, list[str]] = {}
        batched: list[str] = []
        for is_async, names in self._groups.items():
            for name in names:
                if name not in wanted:
                    continue
                if name in self._trl:
                    batched.append(name)
                    continue
                known = self._known(name, sample.completion, sample.answer)
                if known is None:
                    asked.setdefault(is_async, []).append(name)
                else:
                    result.parts[name] = known
        if not asked and not batched:
            if any(n in wanted for names in self._groups.values() for n in names):
                self._spared += 1  # decided here, or scored before: no worker round trip
            return result
        if not self._pools:
            raise RuntimeError("Scorer.score() outside `async with scorer:` (the worker pools "
                               "run there)")

        async def one(is_async: bool, names: list[str]) -> None:
            try:
                outcome = await anyio.to_thread.run_sync(
                    self._pools[is_async].run, sample, tuple(names),
                    limiter=self._limiters[is_async], abandon_on_cancel=True)
            except VerificationLost as e:
                kind = "timeout" if e.timed_out else "error"
                result.failures.extend(Failure(n, kind, str(e)) for n in names)
                return
            result.parts.update(outcome.parts)
            result.failures.extend(outcome.failures)
            for name, part in outcome.parts.items():
                if name in BUILTINS:
                    self._remember((name, sample.completion, sample.answer), part)

        async def in_batch(name: str) -> None:
            outcome = await self._batchers[name].submit(sample)
            result.parts.update(outcome.parts)
            result.failures.extend(outcome.failures)

        async with anyio.create_task_group() as tg:
            for is_async, names in asked.items():
                tg.start_soon(one, is_async, names)
            for name in batched:
                tg.start_soon(in_batch, name)
        return result

    async def _run_batch(self, name: str, samples: Sequence[Sample]) -> list[Outcome]:
        """The TRL-style function ``name`` once for ``samples``, in a worker under the hard
        limit (one call, one limit); a worker that timed out or died fails every sample."""
        is_async = self._trl[name]
        try:
            outcomes: list[Outcome] = await anyio.to_thread.run_sync(
                self._pools[is_async].run, tuple(samples), (name,),
                limiter=self._limiters[is_async], abandon_on_cancel=True)
        except VerificationLost as e:
            kind = "timeout" if e.timed_out else "error"
            return [Outcome(failures=[Failure(name, kind, str(e))]) for _ in samples]
        return outcomes

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

    def _count(self, f: Failure) -> None:
        self.failed[f.name, f.kind] += 1
        line = f"{f.name}: {f.kind}: {f.message}"
        if self.first_failure is None:
            self.first_failure = line
        now = time.monotonic()
        if now - self._last_warning > 10.0:  # at most one line in 10 s; the counters have all
            log.warning("reward gave up, scored 0 (reward/failed/<name>/<kind> counts): %s", line)
            self._last_warning = now

    def metrics(self) -> dict[str, float]:
        """Totals since the start: ``reward/failed/<name>/<kind>`` per way a reward gave up,
        ``reward/timeouts`` (ours and their own) and ``reward/errors`` (the rest) summed, and
        ``reward/spared`` (isolated scores found without a worker)."""
        out = {f"reward/failed/{name}/{kind}": float(n)
               for (name, kind), n in sorted(self.failed.items())}
        timeouts = sum(n for (_, kind), n in self.failed.items() if kind.endswith("timeout"))
        out["reward/timeouts"] = float(timeouts)
        out["reward/errors"] = float(sum(self.failed.values()) - timeouts)
        out["reward/spared"] = float(self._spared)
        if self._judge is not None:
            out.update(self._judge.metrics())
        return out
