"""An environment that replays recorded episodes: the turn structure and token counts of a
trace, with tool calls that take the recorded time (or a time drawn from a latency model).

Each :class:`EpisodePlan` says, per turn, how many prompt tokens the engine sees (and how
many of them a prefix cache holds), how many it generates, and which tool calls follow with
their latency, status and observation size. Messages carry no real text: their content is
placeholder text of one character per token (:data:`FILLER`), so a replay tokenizer that
reads one token per character gives every message its recorded length without parsing it,
and the opening message names its plan in a field of its own (:data:`PLAN_FIELD`, read by
:func:`plan_of`), which the replay tokenizer turns into the prompt's first token id so that
the engine can look the turn's counts up.

:class:`ReplaySpec` hands out one task per recorded prompt group; the episodes of a group
take its recorded samples in turn. Tool time is waited with ``anyio.sleep``, so under a
virtual clock a replay takes no real time; ``ToolCallRecord.started`` and the latency are
readings of the spec's clock (:attr:`EnvSpec.clock`), which the orchestrator sets to its
recorder's (``anyio.current_time`` for a replay). Nothing here knows about engines or versions.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio

from envs.base import Env, EnvSpec, Message, Reward, StepResult, Task, ToolCallRecord

FILLER = "."  # one character per token of a replayed message
PLAN_FIELD = "plan"  # the opening message's field naming its plan (EpisodePlan.key)


def opening_message(key: int, prompt_tokens: int) -> Message:
    return {"role": "user", "content": FILLER * prompt_tokens, PLAN_FIELD: str(key)}


def observation_message(tokens: int) -> Message:
    return {"role": "tool", "content": FILLER * tokens}


def plan_of(message: Message) -> int | None:
    """The key of the plan an opening message starts, or None for any other message."""
    key = message.get(PLAN_FIELD)
    return int(key) if key is not None else None


@dataclass(frozen=True)
class ToolPlan:
    latency: float
    status: str  # the trace's status (success | unknown | api_error)
    query_count: int = 1
    append_tokens: int = 0


@dataclass(frozen=True)
class TurnPlan:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str  # tool_calls | stop | length
    latency: float = 0.0  # recorded engine latency (for comparison; the engine models its own)
    tools: tuple[ToolPlan, ...] = ()


@dataclass(frozen=True)
class EpisodePlan:
    key: int
    prompt_tokens: int
    turns: tuple[TurnPlan, ...]
    group: int = 0
    sample: int = 0


# (query_count) -> (latency seconds, status): a latency model, e.g. the search fault model.
LatencyModel = Callable[[int], tuple[float, str]]


class ReplayEnv(Env):
    def __init__(self, spec: ReplaySpec) -> None:
        self.spec = spec
        self.plan: EpisodePlan | None = None
        self.turn = 0

    async def reset(self, task: Task) -> tuple[Message, ...]:
        self.plan = self.spec.next_plan(task)
        self.turn = 0
        return (opening_message(self.plan.key, self.plan.prompt_tokens),)

    async def step(self, reply: str) -> StepResult:
        if self.plan is None:
            raise RuntimeError("step() before reset()")
        turn = self.plan.turns[min(self.turn, len(self.plan.turns) - 1)]
        self.turn += 1
        if not turn.tools or self.turn >= len(self.plan.turns):
            return StepResult(observation=(), reward=0.0, done=True)
        records = []
        observation = []
        for tool in turn.tools:  # sequential, as the trace's per-turn tool time is summed
            latency, status = tool.latency, tool.status
            if self.spec.latency_model is not None:
                latency, status = self.spec.latency_model(tool.query_count)
            started = self.spec.clock()
            await anyio.sleep(latency * self.spec.tool_time_scale)
            ok = status == "success"
            records.append(ToolCallRecord("search", "ok" if ok else "error", started,
                                          self.spec.clock() - started, None if ok else status,
                                          metadata={"query_count": tool.query_count}))
            observation.append(observation_message(tool.append_tokens))
        return StepResult(observation=tuple(observation), reward=0.0, done=False,
                          tool_calls=tuple(records))

    async def reward(self) -> Reward:
        return Reward(total=0.0)


class ReplaySpec(EnvSpec):
    """One task per recorded prompt group; episodes of a group take its samples in turn."""

    name = "replay"

    def __init__(self, plans: Sequence[EpisodePlan], latency_model: LatencyModel | None = None,
                 tool_time_scale: float = 1.0) -> None:
        groups: dict[int, list[EpisodePlan]] = {}
        for plan in plans:
            groups.setdefault(plan.group, []).append(plan)
        self.groups = [groups[g] for g in sorted(groups)]
        self.plans = {plan.key: plan for plan in plans}
        self.latency_model = latency_model
        self.tool_time_scale = tool_time_scale
        self._tasks = tuple(Task(id=i, messages=(), answer="") for i in range(len(self.groups)))
        self._turns = [itertools.cycle(g) for g in self.groups]

    def next_plan(self, task: Task) -> EpisodePlan:
        return next(self._turns[task.id])

    def tasks(self, split: str) -> Sequence[Task]:
        return self._tasks

    def make_env(self) -> Env:
        return ReplayEnv(self)
