"""Greedy evaluation on held-out tasks through the same episode runner as training (an agent
env's episodes through a gateway opened for the evaluation)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import anyio

from envs.agent import AgentSpec
from envs.base import EnvSpec, Task
from orchestrator.engines.base import InferenceEngine
from orchestrator.gateway import agent_gateway, evaluate_agents
from orchestrator.models.tokenizer import Tokenizer
from orchestrator.recorder import Recorder
from orchestrator.rollout import RolloutConfig, run_episode


async def evaluate(
    engine: InferenceEngine,
    tokenizer: Tokenizer,
    spec: EnvSpec,
    tasks: Sequence[Task],
    rollout: RolloutConfig,
    recorder: Recorder,
) -> float:
    """Mean reward of one greedy episode per task."""
    spec.use_clock(recorder.clock)  # tools report times on the recorder's clock
    greedy = replace(rollout, temperature=0.0)
    if isinstance(spec, AgentSpec):
        async with agent_gateway(spec, engine, tokenizer, recorder) as gateway:
            assert gateway is not None
            return await evaluate_agents(gateway, spec, tasks, greedy)
    rewards: list[float] = []

    async def one(task: Task) -> None:
        trajectory = await run_episode(engine, tokenizer, spec, task, greedy, recorder, "eval")
        rewards.append(trajectory.reward)

    async with anyio.create_task_group() as tg:
        for task in tasks:
            tg.start_soon(one, task)
    return sum(rewards) / max(len(rewards), 1)
