"""Shared fixtures: the anyio backend, a tiny CPU policy and a simulated trainer."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from helpers import TINY_MODEL

from orchestrator.models.policy import Policy, tiny_policy
from orchestrator.trainer.simulated import SimulatedTrainer, UniformCost


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # scripts/test.sh runs the tests in two processes (--dist loadgroup): a test file to a
    # process, so its fixtures are built once, and every Docker test in the same one, one at a
    # time, since some stop the engine or its proxy under everything else using it.
    for item in items:
        group = "docker" if "docker" in item.keywords else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))

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


@pytest.fixture
def fake_trainer_cls() -> Callable[..., SimulatedTrainer]:
    """``fake_trainer_cls(min_s, max_s, seed)``: the simulated trainer whose step waits
    ``min_s`` to ``max_s`` seconds (seeded; virtual seconds under a mock clock) and remembers
    every batch it was given (``trainer.batches``: version and groups)."""

    def make(min_s: float = 0.001, max_s: float = 0.005, seed: int = 0) -> SimulatedTrainer:
        return SimulatedTrainer(UniformCost(min_s, max_s, seed), record=True)

    return make
