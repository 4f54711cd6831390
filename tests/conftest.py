"""Shared fixtures: the anyio backend, a tiny CPU policy and a simulated trainer."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from filelock import FileLock
from helpers import TINY_MODEL

from orchestrator.models.policy import Policy, tiny_policy
from orchestrator.trainer.simulated import SimulatedTrainer, UniformCost


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TAKE_TURNS = ("docker", "ray")  # markers whose tests never run at once


@pytest.fixture(autouse=True)
def take_turns(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests marked ``docker`` take turns on the machine's Docker engine, and tests marked
    ``ray`` on its memory, across the processes scripts/test.sh runs the tests in (and across
    test runs): some stop the engine or kill containers by label, reaping counts every run's
    leftovers, and two Ray clusters (each an object store of ~30% of memory) with SmolLM2's
    actors exceed 24 GB. A test with both takes both, in this order."""
    with ExitStack() as held:
        for marker in TAKE_TURNS:
            if marker in request.keywords:
                held.enter_context(FileLock(Path(tempfile.gettempdir()) / f"polyrl-tests-{marker}.lock"))
        yield


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
