"""The trainer of a replay: a cost model, not a model.

:class:`SimulatedTrainer` implements :class:`~orchestrator.trainer.base.Trainer`: a step takes
``fixed_seconds + seconds_per_token * tokens`` (the batch's prompt and response tokens),
waited with ``anyio.sleep`` so that under a virtual clock it takes no real time, and bumps the
version. There are no weights: :meth:`weights` hands out an empty update of the new version,
which the replay engine takes as a version change (and its ``sync_seconds``). Its cost per
token comes from an engine fit (:meth:`orchestrator.replay.fit.EngineFit.trainer`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from orchestrator.trainer.base import Trainer, TrainStats
from orchestrator.types import Group
from orchestrator.weights import WeightUpdate


class SimulatedTrainer(Trainer):
    def __init__(self, seconds_per_token: float, fixed_seconds: float = 0.0,
                 version: int = 0) -> None:
        self.seconds_per_token = seconds_per_token
        self.fixed_seconds = fixed_seconds
        self.version = version
        self.busy = 0.0  # seconds spent in steps

    def cost(self, groups: Sequence[Group]) -> float:
        tokens = sum(len(t.token_ids) for g in groups for t in g.trajectories)
        return self.fixed_seconds + self.seconds_per_token * tokens

    async def step(self, groups: Sequence[Group]) -> TrainStats:
        seconds = self.cost(groups)
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
