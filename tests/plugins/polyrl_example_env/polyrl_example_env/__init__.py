"""An example environment plug-in: reverse a short lower-case word, exact-match reward.

It depends only on ``envs.base`` and is found through the ``polyrl.envs`` entry point."""

from __future__ import annotations

import random
from collections.abc import Sequence

from envs.base import Env, EnvSpec, Message, Reward, StepResult, Task


class ReverseEnv(Env):
    def __init__(self) -> None:
        self.task: Task | None = None
        self.reply = ""

    async def reset(self, task: Task) -> tuple[Message, ...]:
        self.task = task
        return task.messages

    async def step(self, reply: str) -> StepResult:
        self.reply = reply
        return StepResult(observation=(), reward=0.0, done=True)

    async def reward(self) -> Reward:
        assert self.task is not None
        correct = float(self.reply.strip() == self.task.answer)
        return Reward(total=correct, components={"exact_match": correct})


class ReverseSpec(EnvSpec):
    def __init__(self, length: int = 3, size: int = 64, seed: int = 0) -> None:
        rng = random.Random(seed)
        words = ["".join(rng.choice("abcdefgh") for _ in range(length)) for _ in range(size)]
        self._tasks = [
            Task(id=i, messages=({"role": "user", "content": f"reverse {w}"},), answer=w[::-1])
            for i, w in enumerate(words)
        ]

    def tasks(self, split: str) -> Sequence[Task]:
        return self._tasks if split == "train" else self._tasks[:8]

    def make_env(self) -> Env:
        return ReverseEnv()
