"""Greedy evaluation on held-out tasks through the same episode runner as training (an agent
env's episodes through a gateway opened for the evaluation)."""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from envs.agent import AgentSpec
from envs.base import Task
from orchestrator.gateway import agent_gateway, evaluate_agents
from orchestrator.rollout import EpisodeRunner


async def evaluate(runner: EpisodeRunner, tasks: Sequence[Task]) -> float:
    """Mean reward of one greedy episode per task."""
    runner.spec.use_clock(runner.recorder.clock)  # tools report times on the recorder's clock
    greedy = runner.greedy()
    if isinstance(runner.spec, AgentSpec):
        async with agent_gateway(greedy) as gateway:
            assert gateway is not None
            return await evaluate_agents(gateway, greedy, tasks)
    rewards: list[float] = []

    async def one(task: Task) -> None:
        trajectory, _ = await greedy.episode(task, "eval")
        rewards.append(trajectory.reward)

    async with anyio.create_task_group() as tg:
        for task in tasks:
            tg.start_soon(one, task)
    return sum(rewards) / max(len(rewards), 1)
