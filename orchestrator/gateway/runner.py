"""Agent episodes and groups: the agent env's counterpart of :func:`orchestrator.rollout.run_group`.

An episode opens a key on the gateway, runs the program (:meth:`envs.agent.AgentSpec.run_episode`)
with that key and the gateway's URL, revokes the key, and turns what the gateway recorded into
trajectories: one per segment, each with the episode's reward. A program that raised, timed
out, or returned while one of its calls was still generating ends its episode as failed:
reward 0, its segments still trained, ``agent/errors`` or ``agent/timeouts`` counted. A group
is ``group_size`` such episodes of one task, run concurrently; it holds every segment of them
(possibly none, when no program called the model: the pipeline then gives its admission back).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace

import anyio

from envs.agent import AgentOutcome, AgentSpec
from envs.base import EnvSpec, Reward, Task
from orchestrator.engines.base import InferenceEngine
from orchestrator.gateway.server import Gateway, GatewayConfig
from orchestrator.models.tokenizer import Tokenizer
from orchestrator.recorder import Recorder
from orchestrator.rollout import RolloutConfig
from orchestrator.types import Group, Trajectory


@asynccontextmanager
async def agent_gateway(spec: EnvSpec, engine: InferenceEngine, tokenizer: Tokenizer,
                        recorder: Recorder) -> AsyncIterator[Gateway | None]:
    """The run's gateway when ``spec`` is an agent env (None otherwise), open for the block."""
    if not isinstance(spec, AgentSpec):
        yield None
        return
    async with Gateway(engine, tokenizer, recorder, GatewayConfig.of(spec)) as gateway:
        yield gateway


async def run_agent_episode(gateway: Gateway, spec: AgentSpec, task: Task, rollout: RolloutConfig,
                            worker: str, sample: int) -> tuple[list[Trajectory], AgentOutcome]:
    """One episode: its trajectories (one per segment) and how its program ended."""
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
    return episode.trajectories(outcome, task.id, metrics), outcome


async def run_agent_group(gateway: Gateway, spec: AgentSpec, task: Task, rollout: RolloutConfig,
                          recorder: Recorder, worker: str) -> Group:
    started, version = recorder.now(), gateway.engine.version
    results: list[list[Trajectory]] = [[] for _ in range(rollout.group_size)]

    async def one(index: int) -> None:
        results[index], _ = await run_agent_episode(gateway, spec, task, rollout, worker, index)

    async with anyio.create_task_group() as tg:
        for i in range(rollout.group_size):
            tg.start_soon(one, i)
    trajectories = tuple(replace(t, sample_index=i)
                         for i, t in enumerate(t for episode in results for t in episode))
    return Group(
        prompt_id=task.id, trajectories=trajectories,
        start_version=min((t.start_version for t in trajectories), default=version),
        started_at=started, finished_at=recorder.now(),
    )


async def evaluate_agents(gateway: Gateway, spec: AgentSpec, tasks: Sequence[Task],
                          rollout: RolloutConfig) -> float:
    """Mean reward of one episode per task (``rollout`` as the evaluation sets it: greedy)."""
    rewards: list[float] = []

    async def one(task: Task) -> None:
        _, outcome = await run_agent_episode(gateway, spec, task, rollout, "eval", 0)
        rewards.append(outcome.reward.total)

    async with anyio.create_task_group() as tg:
        for task in tasks:
            tg.start_soon(one, task)
    return sum(rewards) / max(len(rewards), 1)
