"""Shared fixtures: the anyio backend, a tiny CPU policy and a fake trainer backend."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import pytest

from orchestrator.models.policy import Policy, tiny_policy
from orchestrator.trainer import Trainer
from orchestrator.types import Group
from orchestrator.weights import WeightUpdate
from helpers import TINY_MODEL


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_tiny_policy(seed: int = 0) -> Policy:
    return tiny_policy(**{k: v for k, v in TINY_MODEL.items() if k != "_target_"}, seed=seed)


@pytest.fixture
def tiny() -> Policy:
    """A fresh tiny CPU policy (seed 0): hidden 32, one layer."""
    return make_tiny_policy(seed=0)


@pytest.fixture
def make_policy() -> Callable[[int], Policy]:
    """``make_policy(seed)``: a fresh tiny CPU policy with weights drawn from ``seed``."""
    return make_tiny_policy


class FakeTrainer(Trainer):
    """A trainer with no model: a step sleeps a few random milliseconds in a worker thread (as
    a real step computes there) and bumps the version; it remembers every batch it was given."""

    def __init__(self, min_s: float = 0.001, max_s: float = 0.005, seed: int = 0) -> None:
        self.version = 0
        self.min_s = min_s
        self.max_s = max_s
        self._rng = random.Random(seed)
        self.batches: list[tuple[int, Sequence[Group]]] = []

    async def step(self, groups: Sequence[Group]) -> dict[str, float]:
        self.batches.append((self.version, list(groups)))
        await anyio.to_thread.run_sync(time.sleep, self._rng.uniform(self.min_s, self.max_s))
        self.version += 1
        return {"loss": 0.0}

    async def weights(self) -> WeightUpdate:
        return WeightUpdate.by_reference(self.version, {}, leased=False)

    def state_dict(self) -> Mapping[str, Any]:
        return {"version": self.version}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.version = int(state["version"])


@pytest.fixture
def fake_trainer_cls() -> type[FakeTrainer]:
    return FakeTrainer
