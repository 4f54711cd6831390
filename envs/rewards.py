"""One reward system for every environment: the protocol, the registry, the weighted sum and
verification that cannot stall a run.

**The protocol.** A reward scores one :class:`Sample` — the model's reply (``completion``),
the reference ``answer``, the row's other columns (``metadata``), the ``prompt`` messages, the
``data_source`` and, for a multi-turn episode, its ``transcript`` — and returns a float or a
:class:`~envs.base.Reward` (its ``components`` are logged as diagnostics, never summed). It is a
plain or an ``async`` function written in one of three conventions, told apart by its signature
(:func:`adapt`):

* **ours**: ``fn(completion, answer, metadata)``; it may also declare any of the keywords
  ``prompt`` (the opening messages), ``data_source`` and ``transcript`` (every message of the
  episode; empty for a single turn), or ``**kwargs`` for all three.
* **TRL's**: ``fn(prompts, completions, **columns)`` (any function with a ``completions``
  parameter) — batched lists, returning a list of one score per completion. It is called
  batched: the samples scored at about the same time (within 20 ms, at most 64; a group's
  episodes, an evaluation's) share one call in a reward worker (:mod:`envs.reward_batch`), by
  keyword: ``prompts`` (each the prompt text when it is a single user message, else its
  messages), ``completions`` (the text, or ``[{"role": "assistant", "content": c}]`` with a
  conversational prompt), ``answer`` and each column of the rows (None where a row lacks it;
  only those it declares, unless it takes ``**kwargs``). The batch shares one hard limit. A
  call that fails (raises, times out, or returns anything but one value per completion) fails
  every sample of its batch, each counted once under its kind; a value that is no number fails
  its own sample only (``invalid``).
* **verl's**: ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``,
  called by keyword; ``extra_info`` is the row's ``extra_info`` column when it has one, else
  all its columns. A returned dict gives its ``score``; its other numbers are diagnostics.

A signature that fits none is refused when the run starts, in one line naming the function and
the three conventions.

**The registry.** ``env.reward`` names one reward, a weighted sum or a route by data source
(:func:`parse_reward`): ``math``; ``{math: 1.0, format: 0.1}``; ``[math, format]`` (weight 1
each); or ``{by_source: {gsm8k: math, mmlu: {choice: 1, format: 0.1}}, default: exact}`` (each
value any of the former; ``default``, required, scores every other source). A name is a
built-in below, ``package.module:function``, or a reward the environment itself provides (code's
``tests``, reasoning_gym's ``verifier``, search_qa's ``searched``: they need the episode's
sandbox or dataset object, so they run in the caller).

Built-ins (:data:`envs.reward_builtins.BUILTINS`):

* ``math`` — math-verify. The answer is taken from the reply's last ``\\boxed{…}`` (or
  ``\\fbox{…}``), else the last ``<answer>…</answer>``, else the last number in it; a reply with
  none of these scores 0: the whole text is never compared. The answer and the ground truth
  (``$…$`` stripped, each read as the content of a ``\\boxed{}``) are parsed by math-verify and
  checked for mathematical equivalence (``\\frac{3}{4}`` = ``0.75``, sets, intervals,
  equations, LaTeX or plain); equal normalised strings count too (a text answer). Its own
  timeout (0.8 × ``env.reward_timeout_s``) is a failure (``own_timeout``), not a 0.
* ``exact`` — the extracted answer (boxed, then tags, then the whole reply) equals the answer
  after normalising: case, white space, surrounding ``$`` and a final period.
* ``strict`` — the whole reply, stripped of surrounding white space, is the answer (the
  arithmetic environment's default).
* ``em`` / ``f1`` — SQuAD-style exact match and token F1 of the whole reply (lower case, no
  punctuation or articles; search_qa's).
* ``choice`` — a multiple-choice letter (A–Z): boxed, tagged, "answer is (B)", or a reply
  that is only the letter; compared with the answer's leading letter.
* ``regex`` — the reference answer is a regular expression that must match the whole
  extracted answer (boxed, then tags, then the whole reply).
* ``format`` — 1 when the reply has an extractable final answer (``\\boxed{}`` or
  ``<answer>`` tags), for a small weight beside another reward.

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

import asyncio
import importlib
import inspect
import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import TracebackType
from typing import Any, Protocol, Self

import anyio
import anyio.to_thread

from envs.base import Message, Reward, RewardTerm
from envs.errors import EnvConfigError
from envs.judge import Judge
from envs.reward_batch import Batcher
from envs.reward_builtins import BUILTINS, set_math_verify_timeout, warm_up
from envs.reward_pool import Failure, Outcome, VerificationLost, WorkerPool
from sandboxes.api import EngineUnavailable

log = logging.getLogger(__name__)

RewardValue = float | Reward


@dataclass(frozen=True)
class Sample:
    """What a reward sees of one episode (picklable: it crosses to the reward workers)."""

    completion: str
    answer: str
    metadata: Mapping[str, Any] = field(default_factory=dict)
    prompt: tuple[Message, ...] = ()
    data_source: str = ""
    transcript: tuple[Message, ...] = ()


class RewardFunction(Protocol):
    """Our convention (see the module docstring for TRL's and verl's, adapted as they are)."""

    def __call__(self, completion: str, answer: str,
                 metadata: Mapping[str, Any]) -> RewardValue | Awaitable[RewardValue]: ...


class InvalidReward(TypeError):
    """A reward returned no finite number: counted as ``invalid``."""


CACHE_ITEMS = 8192  # scores kept per Scorer (built-ins only)


# --- the three conventions, adapted -----------------------------------------------------------

CONVENTIONS = ("(completion, answer, metadata[, prompt=, data_source=, transcript=]), "
               "TRL's (prompts, completions, **columns) or verl's compute_score(data_source, "
               "solution_str, ground_truth, extra_info)")
_EXTRAS = ("prompt", "data_source", "transcript")
_VERL = ("data_source", "solution_str", "ground_truth", "extra_info")


@dataclass(frozen=True)
class Adapted:
    """A reward function and how to call it with a :class:`Sample`."""

    name: str
    fn: Callable[..., Any]
    convention: str  # ours | trl | verl
    is_async: bool
    keywords: frozenset[str] = frozenset()  # what it declares (or _EXTRAS... with **kwargs)
    any_keyword: bool = False

    def __call__(self, sample: Sample) -> Any:
        if self.convention == "trl":
            return self.fn(**self._take({"answer": sample.answer, **sample.metadata,
                                         "prompts": _trl_prompt(sample),
                                         "completions": _trl_completion(sample)}, listed=True))
        if self.convention == "verl":
            extra = sample.metadata.get("extra_info")
            values = {"data_source": sample.data_source, "solution_str": sample.completion,
                      "ground_truth": sample.answer,
                      "extra_info": extra if isinstance(extra, Mapping) else dict(sample.metadata)}
            return self.fn(**self._take(values))
        extras = {"prompt": list(sample.prompt), "data_source": sample.data_source,
                  "transcript": list(sample.transcript)}
        return self.fn(sample.completion, sample.answer, sample.metadata, **self._take(extras))

    def batch(self, samples: Sequence[Sample]) -> Any:
        """A TRL-style function called once for ``samples``: each argument a list with one
        entry per sample (a column a row lacks is None in its place)."""
        columns = dict.fromkeys(k for s in samples for k in s.metadata)
        values = {"answer": [s.answer for s in samples],
                  **{k: [s.metadata.get(k) for s in samples] for k in columns},
                  "prompts": [_trl_prompt(s) for s in samples],
                  "completions": [_trl_completion(s) for s in samples]}
        return self.fn(**self._take(values))

    def _take(self, values: Mapping[str, Any], listed: bool = False) -> dict[str, Any]:
        return {k: [v] if listed else v for k, v in values.items()
                if self.any_keyword or k in self.keywords}


def _trl_prompt(sample: Sample) -> Any:
    if len(sample.prompt) == 1 and sample.prompt[0]["role"] == "user":
        return sample.prompt[0]["content"]
    return [dict(m) for m in sample.prompt]


def _trl_completion(sample: Sample) -> Any:
    if len(sample.prompt) == 1 and sample.prompt[0]["role"] == "user":
        return sample.completion
    return [{"role": "assistant", "content": sample.completion}]


def adapt(fn: Callable[..., Any], name: str, key: str = "env.reward") -> Adapted:
    """``fn`` with the adapter its signature calls for; EnvConfigError (one line naming the
    function and the three conventions) when it fits none."""
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        type(fn).__call__)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a C function): ours, trusted
        return Adapted(name, fn, "ours", is_async)
    params = signature.parameters
    named = frozenset(n for n, p in params.items()
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())

    def fits(*args: Any, **kwargs: Any) -> bool:
        try:
            signature.bind(*args, **kwargs)
            return True
        except TypeError:
            return False

    if "completions" in named:  # the columns it names are the data's: checked by the call
        return Adapted(name, fn, "trl", is_async, named, any_keyword)
    if {"solution_str", "ground_truth"} <= named and fits(
            **{k: None for k in _VERL if k in named}):
        return Adapted(name, fn, "verl", is_async, named, any_keyword)
    if fits("completion", "answer", {}, **{k: None for k in _EXTRAS if k in named}):
        return Adapted(name, fn, "ours", is_async, named & frozenset(_EXTRAS), any_keyword)
    raise EnvConfigError(f"{key}: reward {name}{signature} fits none of the three conventions: "
                         f"{CONVENTIONS}")


JUDGE = "judge"  # the LLM judge's name in env.reward (envs.judge; scored by the Scorer itself)


def judge_outside_scorer(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    """What ``resolve("judge")`` gives: the judge needs its endpoint (``env.judge``) and the
    prompt, so it scores through :class:`Scorer` only."""
    raise RuntimeError("the judge reward scores through envs.rewards.Scorer (with env.judge), "
                       "not as a plain function")


def resolve(name: str, key: str = "env.reward") -> Adapted:
    """The function ``name`` stands for, adapted: a built-in or ``package.module:function``."""
    if name in BUILTINS:
        return adapt(BUILTINS[name].fn, name, key)
    if name == JUDGE:
        return adapt(judge_outside_scorer, name, key)
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
    return adapt(fn, name, key)


def isolated(name: str) -> bool:
    return BUILTINS[name].isolated if name in BUILTINS else name != JUDGE


# --- names, weights, routes -------------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    name: str
    weight: float


@dataclass(frozen=True)
class Routes:
    """``env.reward`` parsed: the terms for each data source, and for every other one."""

    default: tuple[Term, ...]
    by_source: Mapping[str, tuple[Term, ...]] = field(default_factory=dict)

    def terms(self, data_source: str) -> tuple[Term, ...]:
        return self.by_source.get(data_source, self.default)

    def names(self) -> list[str]:
        """Every name, once, in order."""
        seen: dict[str, None] = {}
        for terms in (self.default, *self.by_source.values()):
            seen.update((t.name, None) for t in terms)
        return list(seen)


def parse_terms(value: object, key: str = "env.reward",
                own: Sequence[str] = ()) -> tuple[Term, ...]:
    """One route's weighted terms: a name, a list of names (weight 1 each) or a mapping of
    names to weights. Every name is resolved now (EnvConfigError naming ``key``); ``own``:
    the names of the environment's own rewards."""
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
        raise EnvConfigError(f"{key} must be a reward name, a list of names, a mapping of "
                             f"names to weights or {{by_source: …, default: …}}, got {value!r}")
    if not terms:
        raise EnvConfigError(f"{key} names no reward; e.g. {key}=math")
    for term in terms:
        if term.name not in own:
            resolve(term.name, key)
    return tuple(terms)


def parse_reward(value: object, key: str = "env.reward", own: Sequence[str] = ()) -> Routes:
    """``env.reward``: one route (:func:`parse_terms`) or ``{by_source: {source: route, …},
    default: route}``."""
    if isinstance(value, Mapping) and "by_source" in value:
        unknown = sorted(set(value) - {"by_source", "default"})
        if unknown:
            raise EnvConfigError(f"{key} has an unknown key {unknown[0]!r}: by_source and "
                                 f"default only")
        if "default" not in value:
            raise EnvConfigError(f"{key}.default must name the reward of every other data "
                                 f"source, e.g. {key}.default=exact")
        routes = value["by_source"]
        if not isinstance(routes, Mapping) or not routes:
            raise EnvConfigError(f"{key}.by_source must map data sources to rewards, e.g. "
                                 f"{{gsm8k: math, mmlu: choice}}")
        return Routes(parse_terms(value["default"], f"{key}.default", own),
                      {str(s): parse_terms(v, f"{key}.by_source.{s}", own)
                       for s, v in routes.items()})
    return Routes(parse_terms(value, key, own))


# --- calling ----------------------------------------------------------------------------------


def as_reward(value: object, name: str) -> Reward:
    """A function's result as a Reward; InvalidReward for anything else. A list (TRL's) gives
    its one item; a dict (verl's) its ``score``, its other numbers diagnostics."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, Mapping) and "score" in value:
        extra = {str(k): float(v) for k, v in value.items() if k != "score"
                 and isinstance(v, (int, float)) and not isinstance(v, bool)}
        value = Reward(as_reward(value["score"], name).total, extra)
    if isinstance(value, Reward):
        if not math.isfinite(value.total):
            raise InvalidReward(f"returned a Reward of {value.total}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidReward(f"returned {type(value).__name__}, not a number")
    if not math.isfinite(value):
        raise InvalidReward(f"returned {value}")
    return Reward(total=float(value))


def call(fn: Adapted, sample: Sample) -> Reward:
    """Call a reward function (an async one in a fresh event loop: this runs in a worker
    process, never on the caller's loop)."""
    value = fn(sample)
    if inspect.isawaitable(value):
        value = asyncio.run(_await(value))
    return as_reward(value, fn.name)


async def _await(value: Awaitable[Any]) -> Any:
    return await value


def call_batch(fn: Adapted, samples: Sequence[Sample]) -> list[Any]:
    """A TRL-style function's values for ``samples``, one call; InvalidReward when it returns
    anything but one value per sample."""
    value = fn.batch(samples)
    if inspect.isawaitable(value):
        value = asyncio.run(_await(value))
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) \
            or len(value) != len(samples):
        got = f"{len(value)} values" if isinstance(value, Sequence) else type(value).__name__
        raise InvalidReward(f"returned {got} for a batch of {len(samples)} completions, not "
                            f"one score each")
    return list(value)


def score_batch(fns: Mapping[str, Adapted], samples: Sequence[Sample],
                names: Sequence[str]) -> list[Outcome]:
    """Each of ``names`` (TRL-style) called once for all ``samples``: each sample's Reward, or
    how it gave up. A call that fails (raises, or returns no list of one value per sample)
    fails every sample of the batch, each counted once; a value that is not a number fails
    its own sample only."""
    outcomes = [Outcome() for _ in samples]
    for name in names:
        try:
            values = call_batch(fns[name], samples)
        except Exception as e:  # noqa: BLE001 - a reward that gives up scores 0, counted
            for outcome in outcomes:
                outcome.failures.append(failure(name, e))
            continue
        for outcome, value in zip(outcomes, values, strict=True):
            try:
                outcome.parts[name] = as_reward(value, name)
            except InvalidReward as e:
                outcome.failures.append(failure(name, e))
    return outcomes


def failure(name: str, error: BaseException) -> Failure:
    """How ``error`` (raised by reward ``name``) is counted."""
    if isinstance(error, InvalidReward):
        kind = "invalid"
    elif isinstance(error, TimeoutError) or "Timeout" in type(error).__name__:
        kind = "own_timeout"
    else:
        kind = "error"
    return Failure(name, kind, f"{type(error).__name__}: {error}"[:300])


def score_parts(fns: Mapping[str, Adapted], sample: Sample, names: Sequence[str]) -> Outcome:
    """Each of ``names`` on ``sample``: its Reward, or how it gave up."""
    outcome = Outcome()
    for name in names:
        try:
            outcome.parts[name] = call(fns[name], sample)
        except Exception as e:  # noqa: BLE001 - a reward that gives up scores 0, counted
            outcome.failures.append(failure(name, e))
    return outcome


def prepare_worker(names: Sequence[str], mv_timeout: int
                   ) -> Callable[[Sample, Sequence[str]], Outcome]:
    """In the workers' zygote: resolve ``names`` and import what they need, once; the function
    a worker scores an item with."""
    set_math_verify_timeout(mv_timeout)
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # its per-item timeout notes
    fns = {name: resolve(name) for name in names}
    warm_up(names)

    def score(sample: Sample | tuple[Sample, ...], asked: Sequence[str]) -> Any:
        if isinstance(sample, tuple):  # a batch, for TRL-style functions (Scorer._run_batch)
            return score_batch(fns, sample, asked)
        return score_parts(fns, sample, asked)

    return score


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
