"""Shared fixtures: the anyio backend, a tiny CPU policy and a simulated trainer."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import forked
import helpers
import pytest
from filelock import FileLock
from helpers import TINY_MODEL

from orchestrator.models.policy import Policy, tiny_policy
from orchestrator.trainer.simulated import SimulatedTrainer, UniformCost

TAKE_TURNS = ("docker", "ray")  # markers whose tests never run at once


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    schedule(items)


def schedule(items: list[pytest.Item]) -> None:
    """The order and the groups scripts/test.sh's processes take the tests in
    (``--dist loadgroup --no-loadscope-reorder``). Tests that take turns (:func:`take_turns`)
    are one group each, Ray's first and Docker's second, so each runs in one process from
    start to end and never waits for the other process to let go of its lock; the tests that
    need both come last in Ray's group, when Docker's is long done. Every other test file is a
    group of its own (its fixtures built once), those with slow tests before the rest, so the
    longest work starts first and the two processes end together."""
    slow_files = {group(i) for i in items if i.get_closest_marker("slow") is not None}
    rank = {"ray": 0, "docker": 1}

    def order(item: pytest.Item) -> tuple[int, bool]:
        g = group(item)
        both = all(item.get_closest_marker(m) is not None for m in TAKE_TURNS)
        return rank.get(g, 2 if g in slow_files else 3), both

    items.sort(key=order)  # stable: a file's tests keep their order
    folder, worker = os.environ.get(GROUPS_ENV), os.environ.get("PYTEST_XDIST_WORKER")
    if folder and worker:  # for the scheduler in the controlling process (GroupScheduling)
        (Path(folder) / f"{worker}.json").write_text(json.dumps({i.nodeid: group(i) for i in items}))


GROUPS_ENV = "POLYRL_TEST_GROUPS"  # where the workers write each test's group for the controller


def pytest_configure(config: pytest.Config) -> None:
    # vLLM's engine core (a process of its own under AsyncLLM) runs the model in-process, with
    # vLLM's uni executor, as it does by default on one GPU. On CPU vLLM otherwise spawns a
    # worker process per engine (its multiproc executor, for OpenMP thread binding), a second
    # interpreter importing vLLM and torch: ~9 CPU-s and ~6 s per engine start on 2 cores, and
    # the tests start a dozen. A variable a test run sets before any engine starts, inherited
    # by the commands and Ray actors the tests start; setting it yourself overrides it.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if config.pluginmanager.hasplugin("xdist") and config.getoption("dist", "no") == "loadgroup" \
            and "PYTEST_XDIST_WORKER" not in os.environ:
        os.environ[GROUPS_ENV] = tempfile.mkdtemp(prefix="polyrl-test-groups-")  # workers inherit it


def pytest_unconfigure(config: pytest.Config) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ and (folder := os.environ.pop(GROUPS_ENV, None)):
        shutil.rmtree(folder, ignore_errors=True)


CPU_ENV = "POLYRL_TEST_CPU"  # a folder: each process writes its tests' CPU seconds there


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With ``POLYRL_TEST_CPU=<folder>``: what each test cost, set-up and teardown included:
    wall seconds and CPU seconds of this process and of the subprocesses it waited for (the
    commands tests run, forked ones included (tests/forked.py); a Ray cluster's actors are not
    among them). One JSON file per
    process, written at its end; ``python tests/cpu_report.py <folder>`` sums them by file.
    What the test command's time is made of (issue 44's figures) came from these."""
    if not os.environ.get(CPU_ENV):
        yield
        return
    import resource
    import time

    def cpu() -> tuple[float, float]:
        own, waited = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                              resource.RUSAGE_CHILDREN))
        return own.ru_utime + own.ru_stime, waited.ru_utime + waited.ru_stime + forked.children_cpu_s

    started, (own, waited) = time.perf_counter(), cpu()
    yield
    own_after, waited_after = cpu()
    _cpu_rows.append({"test": item.nodeid, "wall_s": time.perf_counter() - started,
                      "cpu_s": own_after - own, "subprocess_cpu_s": waited_after - waited})


_cpu_rows: list[dict[str, Any]] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    if (folder := os.environ.get(CPU_ENV)) and _cpu_rows:
        Path(folder).mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        (Path(folder) / f"{worker}-{os.getpid()}.json").write_text(json.dumps(_cpu_rows))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` by :func:`group`. xdist's own loadgroup reads ``xdist_group`` marks
    into node ids through an attribute pytest 9 no longer has (every test then is its own
    scope), so the workers write each test's group to a file and the scheduler reads it."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = {}
                for path in Path(os.environ[GROUPS_ENV]).glob("*.json"):
                    self.groups.update(json.loads(path.read_text()))
            return self.groups.get(nodeid) or nodeid.split("::")[0]

    return GroupScheduling(config, log)


def group(item: pytest.Item) -> str:
    """The scheduling group of a test (:func:`schedule`)."""
    for marker in TAKE_TURNS[::-1]:  # ray's group holds the tests that need both
        if item.get_closest_marker(marker) is not None:
            return marker
    return item.nodeid.split("::")[0]


@pytest.fixture(autouse=True)
def take_turns(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests marked ``docker`` take turns on the machine's Docker engine, and tests marked
    ``ray`` on its memory, across the processes scripts/test.sh runs the tests in (and across
    test runs): some stop the engine or kill containers by label, reaping counts every run's
    leftovers, and two Ray clusters (each an object store of ~30% of memory) with SmolLM2's
    actors exceed 24 GB. A test with both takes both, in this order.

    A test marked ``ray`` runs with :func:`forked.ray_workers_env` set: the Ray clusters it
    starts, directly or through the commands it runs, fork their actors' processes from this
    process's fork server (tests/ray_worker.py)."""
    with ExitStack() as held:
        for marker in TAKE_TURNS:
            if marker in request.keywords:
                held.enter_context(FileLock(Path(tempfile.gettempdir()) / f"polyrl-tests-{marker}.lock"))
        if "ray" in request.keywords:
            patch = held.enter_context(pytest.MonkeyPatch.context())
            for name, value in forked.ray_workers_env().items():
                patch.setenv(name, value)
        yield


@pytest.fixture
def ray_nodes() -> Any:
    """The process's Ray cluster (:func:`helpers.ray_nodes`), started by the first test that
    asks for it."""
    pytest.importorskip("ray", reason="launcher=ray needs the ray extra: pip install -e '.[ray]'")
    return helpers.ray_nodes()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Shut the process's Ray cluster down once the next test is not one of Ray's group (its
    daemons cost CPU while idle)."""
    if nextitem is None or group(nextitem) != "ray":
        helpers.stop_ray_nodes()


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
