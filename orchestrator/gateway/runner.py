"""Agent episodes and groups: the agent env's counterpart of :meth:`EpisodeRunner.group`.

An episode opens a key on the gateway, runs the program (:meth:`envs.agent.AgentSpec.run_episode`)
with that key and the gateway's URL, revokes the key, and turns what the gateway recorded into
trajectories: one per segment, each with the episode's reward. A program that raised, timed
out, or returned while one of its calls was still generating ends its episode as failed:
reward 0, its segments still trained, ``agent/errors`` or ``agent/timeouts`` counted. A group
is ``group_size`` such episodes of one task, run concurrently; it holds every segment of them
(possibly none, when no program called the model: the pipeline then gives its admission back).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import cast

import anyio

from envs.agent import AgentOutcome, AgentSpec
from envs.base import Reward, Task
from orchestrator.config.schema import RolloutConfig
from orchestrator.episodes.rollout import EpisodeRunner, data_source, fan_out
from orchestrator.gateway.server import Gateway, GatewayConfig
from orchestrator.types import EpisodeTiming, EvalSample, TimedGroup, Trajectory

Segments = list[tuple[Trajectory, EpisodeTiming]]


@asynccontextmanager
async def agent_gateway(runner: EpisodeRunner) -> AsyncIterator[Gateway | None]:
    """The gateway of ``runner``'s engine when its env is an agent env (None otherwise), open
    for the block."""
    if not runner.spec.runs_programs:
        yield None
        return
    async with Gateway(runner.engine, runner.tokenizer, runner.recorder,
                       GatewayConfig.of(runner.spec)) as gateway:
        yield gateway


async def run_agent_episode(gateway: Gateway, spec: AgentSpec, task: Task, rollout: RolloutConfig,
                            worker: str, sample: int,
                            numbers: Iterator[int] | None = None) -> tuple[Segments, AgentOutcome]:
    """One episode: its trajectories (one per segment, numbered from ``numbers``: the group's
    sample indices) with their timings, and how its program ended."""
    async with gateway.episode(rollout, worker, sample) as episode:
        outcome = await spec.run_episode(task, episode.endpoint)
        if episode.close() and outcome.status == "ok":
            outcome = AgentOutcome(Reward(0.0), "error", "the agent program returned while a "
                                   "call was still generating")
    if gateway.fault is not None:
        raise gateway.fault  # the engine failed under a call: the run cannot go on
    segments = episode.generated_segments
    counters = gateway.counters
    counters["episodes"] += 1
    counters["segments"] += segments
    if outcome.status != "ok":
        counters[{"error": "errors", "timeout": "timeouts"}[outcome.status]] += 1
    metrics = {"agent/calls": float(episode.calls), "agent/segments": float(segments),
               "agent/failed": float(outcome.status != "ok"),
               **{f"reward/{k}": v for k, v in outcome.reward.components.items()}}
    numbers = numbers if numbers is not None else itertools.count()
    return episode.trajectories(outcome, task.id, metrics, numbers), outcome


async def run_agent_group(gateway: Gateway, runner: EpisodeRunner, task: Task, worker: str,
                          queue_wait: float = 0.0) -> TimedGroup:
    """``group_size`` episodes of ``task``; every segment of them a sample of the group, in the
    order they finished."""
    spec = cast(AgentSpec, runner.spec)  # it runs programs: the pipeline opened a gateway
    numbers = itertools.count()  # the group's sample indices, taken as episodes finish

    async def one(index: int) -> Segments:
        segments, _ = await run_agent_episode(gateway, spec, task, runner.config, worker, index,
                                              numbers)
        return segments

    return await fan_out(runner, task, one, queue_wait)


async def evaluate_agents(gateway: Gateway, runner: EpisodeRunner, tasks: Sequence[Task],
                          n: int = 1) -> list[EvalSample]:
    """``n`` episodes of each task (``runner`` as the evaluation sets it: its temperature), each
    an evaluation sample with the episode's reward, its segments' tokens and the answer in its
    last segment's final reply. An episode whose program never called the model is a sample
    with its reward (0 when it failed), no tokens and no answer."""
    spec, rollout = cast(AgentSpec, runner.spec), runner.config  # it runs programs
    samples: list[EvalSample] = []

    async def one(task: Task, index: int) -> None:
        segments, outcome = await run_agent_episode(gateway, spec, task, rollout, "eval", index)
        reward = outcome.reward.total
        if segments:
            samples.append(runner.eval_sample(task, index, [t for t, _ in segments], reward))
        else:
            samples.append(EvalSample(task_id=task.id, sample_index=index,
                                      source=data_source(task, spec), reward=reward, tokens=0,
                                      answer=None, reference=task.answer,
                                      origin=task.origin))

    async with anyio.create_task_group() as tg:
        for task in tasks:
            for index in range(n):
                tg.start_soon(one, task, index)
    return samples
