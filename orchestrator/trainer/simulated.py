"""A trainer with no model, only a cost: what the replay, the benchmarks and the tests train with.

:class:`SimulatedTrainer` implements :class:`~orchestrator.trainer.base.Trainer`: a step takes
``cost(groups)`` seconds and bumps the version. The cost is a parameter —
:class:`TokenCost` (``fixed_s + per_token_s * tokens``, the batch's prompt and response tokens:
the replay's cost model, calibrated by :meth:`orchestrator.replay.fit.EngineFit.trainer`, and a
fixed cost per step with ``per_token_s = 0``) or :class:`UniformCost` (a seeded random draw,
for tests). There are no weights: :meth:`weights` hands out an empty update of the new version,
which a simulated engine takes as a version change.

Where the step's time goes is the other parameter: by default it is waited with
``anyio.sleep``, so under a virtual clock (:func:`orchestrator.replay.run.run_virtual`) it
takes no real time; with ``in_thread=True`` a worker thread sleeps it, as a real optimiser step
computes there (benchmarks on the real clock). ``record=True`` keeps every batch it was given
(``batches``: its version and groups), for tests to read.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from orchestrator.trainer.base import Trainer, TrainStats
from orchestrator.types import Group
from orchestrator.weights.update import WeightUpdate

Cost = Callable[[Sequence[Group]], float]  # seconds one step over the batch takes


@dataclass(frozen=True)
class TokenCost:
    """``fixed_s + per_token_s * tokens`` seconds, ``tokens`` the batch's prompt and response
    tokens (what a forward and backward pass processes)."""

    fixed_s: float = 0.0
    per_token_s: float = 0.0

    def __call__(self, groups: Sequence[Group]) -> float:
        tokens = sum(len(t.token_ids) for g in groups for t in g.trajectories)
        return self.fixed_s + self.per_token_s * tokens


class UniformCost:
    """A step of ``min_s`` to ``max_s`` seconds, drawn from a generator seeded with ``seed``."""

    def __init__(self, min_s: float, max_s: float, seed: int = 0) -> None:
        self.min_s = min_s
        self.max_s = max_s
        self._rng = random.Random(seed)

    def __call__(self, groups: Sequence[Group]) -> float:
        return self._rng.uniform(self.min_s, self.max_s)


class SimulatedTrainer(Trainer):
    def __init__(self, cost: Cost, *, in_thread: bool = False, record: bool = False,
                 version: int = 0) -> None:
        self.cost = cost
        self.in_thread = in_thread
        self.version = version
        self.busy = 0.0  # seconds spent in steps
        self.batches: list[tuple[int, list[Group]]] | None = [] if record else None

    async def step(self, groups: Sequence[Group]) -> TrainStats:
        if self.batches is not None:
            self.batches.append((self.version, list(groups)))
        seconds = self.cost(groups)
        if self.in_thread:
            await anyio.to_thread.run_sync(time.sleep, seconds)
        else:
            await anyio.sleep(seconds)
        self.busy += seconds
        self.version += 1
        return {"simulated_seconds": seconds}

    async def weights(self) -> WeightUpdate:
        return WeightUpdate.by_reference(self.version, {}, leased=False)

    def state_dict(self) -> Mapping[str, Any]:
        return {"version": self.version, "busy": self.busy}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.version = int(state["version"])
        self.busy = float(state.get("busy", 0.0))
