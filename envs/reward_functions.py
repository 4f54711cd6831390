"""What a reward function is and how ``env.reward`` names them: the protocol, its three
conventions adapted to one call, the registry and its routes, and the calls a reward worker
makes (:class:`envs.rewards.Scorer` schedules them).

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
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from envs.base import Message, Reward
from envs.errors import EnvConfigError
from envs.reward_builtins import BUILTINS, set_math_verify_timeout, warm_up
from envs.reward_pool import Failure, Outcome

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
