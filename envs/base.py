"""What an episode is: tasks, the ``Env`` an episode runs in, and reward functions.

This package sees text and token-free chat messages only; it knows nothing of engines,
trainers or policy versions (the orchestrator drives it).

* :class:`Task` — one dataset item: the opening messages and the reference answer.
* :class:`Env` — one episode: ``reset(task)`` gives the opening messages, ``step(reply)``
  takes the model's reply and returns the next observation, a step reward and ``done``;
  ``reward()`` scores the finished episode.
* :class:`EnvSpec` — what the registry builds from config: the task splits (``splits``, or
  an own ``tasks()``), a factory for a fresh :class:`Env` per episode, and ``running()``,
  what the environment holds for the whole run (a sandbox pool, a search server).
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Any, ClassVar, Protocol, Self

from envs.answers import extract_math, normalise

Message = dict[str, str]
Clock = Callable[[], float]  # seconds; the run's one clock (its recorder's), handed to envs


@dataclass(frozen=True)
class Task:
    id: int
    messages: tuple[Message, ...]
    answer: str
    metadata: dict[str, object] = field(default_factory=dict)

    @property
    def origin(self) -> str:
        """Where the task was read from, for a record of its samples (a dataset row's
        ``file:row``); empty where it was made, not read."""
        return ""


@dataclass(frozen=True)
class ToolCallRecord:
    """What happened to one attempted tool call; the runner turns each into a trace span."""

    name: str | None  # None when the call could not even be parsed
    status: str  # ok | error | timeout
    started: float  # a reading of the spec's clock (EnvSpec.clock) when the call began
    latency: float  # seconds
    error_kind: str | None = None  # malformed_json | unknown_tool | bad_arguments | too_many | …
    metadata: dict[str, object] = field(default_factory=dict)  # what the tool reported (attempts, …)


@dataclass(frozen=True)
class StepResult:
    observation: tuple[Message, ...]  # messages to append before the model's next turn
    reward: float
    done: bool
    metrics: dict[str, float] = field(default_factory=dict)
    tool_calls: tuple[ToolCallRecord, ...] = ()


@dataclass(frozen=True)
class RewardTerm:
    """One weighted term of a reward (an ``env.reward`` entry ``name: weight``) and its value."""

    name: str
    weight: float
    value: float


@dataclass(frozen=True)
class Reward:
    """The total reward; its named components, logged as ``reward/<name>`` (each term's value
    and any diagnostics, such as a verifier error, that are not terms); and, when the total is a
    weighted sum, its ``terms``: ``total == sum(weight * value)``. An advantage estimator that
    normalises each term apart (GDPO) reads ``terms``, never the components. Build a weighted
    one with :meth:`weighted`."""

    total: float
    components: dict[str, float] = field(default_factory=dict)
    terms: tuple[RewardTerm, ...] = ()

    def __post_init__(self) -> None:
        if self.terms:
            summed = sum(t.weight * t.value for t in self.terms)
            if not math.isclose(self.total, summed, rel_tol=1e-9, abs_tol=1e-9):
                raise ValueError(f"a Reward's total ({self.total}) must be the weighted sum of "
                                 f"its terms ({summed})")

    @classmethod
    def weighted(cls, terms: Sequence[RewardTerm],
                 diagnostics: Mapping[str, float] | None = None) -> Reward:
        """The weighted sum of ``terms``; the components are each term's value, then
        ``diagnostics`` (logged, never summed)."""
        total = 0.0
        for term in terms:
            total += term.weight * term.value
        return cls(total, {**{t.name: t.value for t in terms}, **(diagnostics or {})},
                   tuple(terms))


class Scoring(Protocol):
    """What an :class:`EnvSpec` uses of its reward scorer, :class:`envs.rewards.Scorer` (named
    by its shape here: that module builds on this one)."""

    fail_steps: int
    first_failure: str | None

    @property
    def judge_to_serve(self) -> str | None: ...

    def use_judge_url(self, url: str) -> None: ...

    def metrics(self) -> dict[str, float]: ...

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None: ...


class Env(ABC):
    @abstractmethod
    async def reset(self, task: Task) -> tuple[Message, ...]: ...

    @abstractmethod
    async def step(self, reply: str) -> StepResult: ...

    @abstractmethod
    async def reward(self) -> Reward:
        """The episode's outcome reward, asked for once after ``step`` returned ``done``."""

    async def aclose(self) -> None:
        pass

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class SingleTurnEnv(Env):
    """An episode of one turn: the reply is the answer, scored by :meth:`score`."""

    def __init__(self) -> None:
        self._task: Task | None = None
        self._reply: str | None = None

    async def reset(self, task: Task) -> tuple[Message, ...]:
        self._task, self._reply = task, None
        return task.messages

    async def step(self, reply: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("step() before reset()")
        self._reply = reply
        return StepResult(observation=(), reward=0.0, done=True)

    async def reward(self) -> Reward:
        if self._task is None or self._reply is None:
            raise RuntimeError("reward() before the episode finished")
        return await self.score(self._task, self._reply)

    @abstractmethod
    async def score(self, task: Task, reply: str) -> Reward: ...


class Votes:
    """How an evaluation's majority vote reads a reply's answer (``extract``) and groups a
    task's samples by answer (:meth:`groups`). Here equal normalised text agrees; a reward's
    own equivalence is a subclass's :meth:`agree` (:mod:`envs.votes`). An async context
    manager: a reward's worker pool is held inside it."""

    def __init__(self, extract: Callable[[str], str | None]) -> None:
        self._extract = extract

    def answer(self, reply: str) -> str | None:
        """The answer ``reply`` gives; None when it gives none (no vote)."""
        return self._extract(reply) or None

    def for_source(self, source: str) -> Votes:
        """The votes of a task from data source ``source``: these, unless a route by data
        source votes each source its own way (:class:`envs.votes.Routed`)."""
        return self

    async def agree(self, reply: str, answer: str, metadata: Mapping[str, Any],
                    threshold: float) -> bool:
        """Whether ``reply`` gives ``answer`` (another sample's), beyond equal text."""
        return False

    async def groups(self, replies: Sequence[str], metadata: Mapping[str, Any] | None = None,
                     threshold: float = 1.0) -> list[int | None]:
        """Each reply's group: the index of the first reply of its answer (None: no answer).
        A reply joins the first group whose answer it agrees with, in order, so an agreement
        that is not transitive cannot merge two groups after the fact."""
        metadata = metadata or {}
        heads: list[tuple[int, str, str]] = []  # (index, answer, its normalised text)
        out: list[int | None] = []
        for index, reply in enumerate(replies):
            answer = self.answer(reply)
            if answer is None:
                out.append(None)
                continue
            key = normalise(answer)
            group = next((head for head, _, k in heads if k == key), None)
            for head, head_answer, _ in heads if group is None else ():
                if await self.agree(reply, head_answer, metadata, threshold):
                    group = head
                    break
            if group is None:
                heads.append((index, answer, key))
                group = index
            out.append(group)
        return out

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        return None


class EnvSpec(ABC):
    name: str
    # The run's clock: every time an environment or its tools report (ToolCallRecord.started)
    # is a reading of it. The runner hands in its recorder's clock with use_clock().
    clock: Clock = staticmethod(time.perf_counter)  # type: ignore[assignment]

    def use_clock(self, clock: Clock) -> None:
        self.clock = clock

    # Its episodes are programs of their own (envs.agent.AgentSpec.run_episode) that call the
    # model through the run's gateway, not turns the run drives through make_env()'s Env: the
    # run opens a gateway for it, and its training and evaluation episodes run that way.
    runs_programs: ClassVar[bool] = False

    # The tasks of each split, set by the constructor ({"train": ..., "eval": ...}); a spec that
    # makes its tasks some other way overrides tasks() instead.
    splits: Mapping[str, Sequence[Task]] = MappingProxyType({})

    def tasks(self, split: str) -> Sequence[Task]:
        """The tasks of ``split`` ("train" or "eval")."""
        if not self.splits:
            raise NotImplementedError(f"{type(self).__name__} has no task splits: set self.splits "
                                      "in its constructor or override tasks()")
        if split not in self.splits:
            raise KeyError(f"unknown split {split!r}; choose from {sorted(self.splits)}")
        return self.splits[split]

    @abstractmethod
    def make_env(self) -> Env:
        """A fresh environment for one episode."""

    def demonstration(self, task: Task) -> tuple[Message, ...]:
        """A reference episode for the supervised warm start: the opening messages as
        ``reset`` gives them, then the continuation, whose assistant turns are learned (other
        messages, such as tool results, are context). A single-turn environment answers with
        the reference answer; a tool environment shows the calls and their results too."""
        return (*task.messages, {"role": "assistant", "content": task.answer})

    def extract_answer(self, reply: str) -> str | None:
        """The final answer in ``reply`` (the episode's last assistant turn), for an
        evaluation's majority vote (maj@n); None when it gives none. The default reads it as
        ``math`` does (:func:`envs.answers.extract_math`: the last ``\\boxed{}``, else the
        last ``<answer>`` tags, else the last number); an environment with its own answer
        format overrides it, and one whose replies are not answers to vote on (``code``)
        returns None, so no maj@n is reported for it."""
        return extract_math(reply)

    # env.reward, scored (envs.rewards.Scorer): set by an environment whose reward it is
    scorer: Scoring | None = None

    def votes(self) -> Votes:
        """How an evaluation's majority vote (maj@n) reads answers and groups them when the
        environment is not scored by ``env.reward`` (a plugin's own scoring): this
        environment's :meth:`extract_answer`, equal normalised text agreeing. An environment
        scored by ``env.reward`` votes by that reward's own reading and equivalence instead,
        whatever this says (:func:`envs.votes.votes_of`, the one path the evaluation asks)."""
        return Votes(self.extract_answer)

    def own_votes(self) -> Mapping[str, Votes | None]:
        """How each of the environment's own rewards (``tests_passed``, ``verifier``, …: names
        ``env.reward`` may give beside the shared ones) reads an answer for a vote; None for
        one that reads no answer (a term like ``format``)."""
        return {}

    def keep_prompts(self, fits: Callable[[tuple[Message, ...]], bool]) -> dict[str, int] | None:
        """Leave out the tasks whose opening messages ``fits`` refuses (the run asks with the
        model's tokenizer before training, so a prompt longer than the context never fails a
        run mid-way); the number left out per split. None (the default): this environment
        makes its prompts in code, where their length is known, and has nothing to check."""
        return None

    def judge_to_serve(self) -> str | None:
        """The ``conf/model`` entry the run serves itself as this environment's LLM judge
        (``env.judge.serve``), None when there is none to serve: the orchestrator starts it
        before :meth:`running` and hands its URL to :meth:`use_judge_url`."""
        return self.scorer.judge_to_serve if self.scorer is not None else None

    def use_judge_url(self, url: str) -> None:
        """Where the judge the run serves answers (plain data: an OpenAI-compatible URL)."""
        if self.scorer is None:
            raise RuntimeError(f"{type(self).__name__} has no scorer to judge with")
        self.scorer.use_judge_url(url)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """What the environment needs for the whole run (a sandbox pool, a service; here the
        scorer's reward workers), held while the run's episodes go on; the runner enters it
        once around all of them. An override holds ``self.scorer`` too."""
        if self.scorer is None:
            yield
            return
        async with self.scorer:
            yield

    def reward_failure(self) -> str | None:
        """The first way this environment's reward gave up (``name: kind: message``), or None:
        what the run loop names when it stops a run whose rewards keep failing."""
        return self.scorer.first_failure if self.scorer is not None else None

    @property
    def reward_fail_steps(self) -> int:
        """``env.reward_fail_steps``: how many steps in a row with more than half the samples'
        rewards failed stop the run."""
        return self.scorer.fail_steps if self.scorer is not None else 3

    def metrics(self) -> dict[str, float]:
        """Counters of what the environment's services rode out (``faults/sandbox_lost``, …),
        added to each step's metrics: totals since :meth:`running` was entered (here the
        scorer's, ``reward/failed/<name>/<kind>`` …)."""
        return self.scorer.metrics() if self.scorer is not None else {}
