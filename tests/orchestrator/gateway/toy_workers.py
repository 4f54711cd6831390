"""Agent programs that misbehave, for the worker-process tests (env.processes)."""

from __future__ import annotations

import os
from typing import Any

import anyio

from envs.base import Task


async def raises(task: Task, client: Any) -> float:
    raise ValueError(f"no answer for task {task.id}")


async def exits(task: Task, client: Any) -> float:
    os._exit(3)  # the worker process dies under its episode


async def hangs(task: Task, client: Any) -> float:
    await anyio.sleep_forever()
    return 0.0


async def unpicklable(task: Task, client: Any) -> Any:
    return [lambda: None]  # a "transcript" that cannot leave the worker


async def pid(task: Task, client: Any) -> float:
    """The worker's process id, as the reward: where the episode ran."""
    return float(os.getpid())


async def exits_on_task_0(task: Task, client: Any) -> float:
    """Kills its worker on task 0; the calculator on any other."""
    from toy_agents import calculator

    if task.id == 0:
        os._exit(3)
    return await calculator(task, client)
