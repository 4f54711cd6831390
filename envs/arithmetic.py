"""Integer arithmetic with an exact-match reward: the default task a tiny model learns on CPU.

Each task is ``a+b=`` (or ``a-b=``, ``a*b=`` when enabled) with operands of up to
``digits`` digits; the reward is ``env.reward`` (:mod:`envs.rewards`), by default ``strict``:
1.0 when the reply, stripped of white space, is exactly the decimal result, else 0.0. Tasks are generated from a seed, so splits are reproducible and
disjoint (eval operands never appear in train).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from envs.base import Env, EnvSpec, Reward, SingleTurnEnv, Task
from envs.errors import EnvConfigError
from envs.reward_functions import Sample
from envs.rewards import Scorer

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticEnv(SingleTurnEnv):
    def __init__(self, scorer: Scorer) -> None:
        super().__init__()
        self.scorer = scorer

    async def score(self, task: Task, reply: str) -> Reward:
        return await self.scorer.score(Sample(reply, task.answer, task.metadata, task.messages,
                                              ArithmeticSpec.name))


class ArithmeticSpec(EnvSpec):
    name = "arithmetic"  # its registry name, also its tasks' data source in evaluations

    def __init__(
        self,
        digits: int = 2,
        ops: Sequence[str] = ("+",),
        train_size: int = 4000,
        eval_size: int = 200,
        seed: int = 0,
        zero_pad: bool = True,
        reward: Any = "strict",
        reward_timeout_s: float = 10.0,
        reward_processes: int = 2,
        reward_concurrency: int = 32,
        reward_fail_steps: int = 3,
        judge: Mapping[str, Any] | None = None,
    ) -> None:
        unknown = [op for op in ops if op not in _OPS]
        if unknown:
            raise EnvConfigError(f"env.ops has unknown operator(s) {unknown}; choose from {list(_OPS)}")
        if digits < 1:
            raise EnvConfigError("env.digits must be >= 1")
        if train_size < 1 or eval_size < 0:
            raise EnvConfigError("env.train_size must be >= 1 and env.eval_size >= 0")
        universe = (10**digits) ** 2 * len(ops)
        if train_size + eval_size > universe:
            raise EnvConfigError(
                f"env.train_size + env.eval_size = {train_size + eval_size} exceeds the "
                f"{universe} distinct problems with digits={digits}"
            )
        self.scorer = Scorer(reward, reward_timeout_s, reward_processes,
                             concurrency=reward_concurrency,
                             fail_steps=reward_fail_steps, judge=judge)
        rng = random.Random(seed)
        seen: set[tuple[int, str, int]] = set()
        problems: list[tuple[int, str, int]] = []
        while len(problems) < train_size + eval_size:
            p = (rng.randrange(10**digits), rng.choice(list(ops)), rng.randrange(10**digits))
            if p not in seen:
                seen.add(p)
                problems.append(p)
        self.digits = digits
        self.zero_pad = zero_pad
        self.splits = {
            "train": [self._task(i, p) for i, p in enumerate(problems[:train_size])],
            "eval": [self._task(i, p) for i, p in enumerate(problems[train_size:])],
        }

    def _task(self, index: int, problem: tuple[int, str, int]) -> Task:
        a, op, b = problem
        width = self.digits if self.zero_pad else 0
        return Task(
            id=index,
            messages=({"role": "user", "content": f"{a:0{width}d}{op}{b:0{width}d}="},),
            answer=str(_OPS[op](a, b)),
        )

    def make_env(self) -> Env:
        return ArithmeticEnv(self.scorer)

    def extract_answer(self, reply: str) -> str | None:
        """The reply itself, stripped: what the default reward (``strict``) compares."""
        return reply.strip() or None
