"""Admission control and the freshness check (orchestrator/staleness.py)."""

from __future__ import annotations

import anyio
import pytest

from orchestrator.errors import ConfigError
from orchestrator.staleness import StalenessController

pytestmark = pytest.mark.anyio


async def _admit_into(ctl: StalenessController, n: int, out: list[int]) -> None:
    out.append(await ctl.admit(n))


@pytest.mark.parametrize("k", [0, 1, 2, 4])
async def test_admission_fills_exactly_the_capacity(k: int) -> None:
    batch = 8
    ctl = StalenessController(batch_size=batch, max_staleness=k)
    assert ctl.capacity == (k + 1) * batch
    for _ in range((k + 1) * batch // 4):
        with anyio.fail_after(1):
            assert await ctl.admit(4) == 0
    assert ctl.admitted == (k + 1) * batch
    # one more sample no longer fits
    started: list[int] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_admit_into, ctl, 1, started)
        await anyio.wait_all_tasks_blocked()
        assert started == []
        tg.cancel_scope.cancel()
    assert ctl.admitted == (k + 1) * batch


async def test_admit_blocks_when_over_capacity_and_unblocks_on_set_version() -> None:
    ctl = StalenessController(batch_size=4, max_staleness=1)  # capacity 8 at version 0
    await ctl.admit(4)
    await ctl.admit(2)
    started: list[int] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_admit_into, ctl, 4, started)  # 6 + 4 > 8: waits
            await anyio.wait_all_tasks_blocked()
            assert started == [] and ctl.admitted == 6
            await ctl.set_version(1)  # capacity 12
    assert started == [1]
    assert ctl.admitted == 10


async def test_admit_exactly_at_capacity_does_not_block() -> None:
    ctl = StalenessController(batch_size=4, max_staleness=0)
    await ctl.admit(3)
    with anyio.fail_after(1):
        assert await ctl.admit(1) == 0  # 3 + 1 == 4: fits
    assert ctl.admitted == 4


async def test_admit_unblocks_on_release() -> None:
    ctl = StalenessController(batch_size=4, max_staleness=0)
    await ctl.admit(4)
    started: list[int] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_admit_into, ctl, 2, started)
            await anyio.wait_all_tasks_blocked()
            assert started == []
            await ctl.release(1, dropped=True)  # 3 + 2 > 4: still waits
            await anyio.wait_all_tasks_blocked()
            assert started == []
            await ctl.release(1, dropped=False)  # 2 + 2 == 4: fits
    assert started == [0]
    assert ctl.admitted == 4
    assert ctl.dropped == 1  # only the release marked as dropped counts


async def test_waiters_that_fit_all_start_after_one_version_bump() -> None:
    ctl = StalenessController(batch_size=4, max_staleness=0)
    await ctl.admit(4)
    started: list[int] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(_admit_into, ctl, 2, started)
            await anyio.wait_all_tasks_blocked()
            await ctl.set_version(1)  # capacity 8: two of the three fit
            await anyio.wait_all_tasks_blocked()
            assert started == [1, 1]
            await ctl.set_version(2)
    assert started == [1, 1, 2]
    assert ctl.admitted == 10


async def test_a_rollout_larger_than_a_batch_is_a_config_error() -> None:
    ctl = StalenessController(batch_size=4, max_staleness=3)
    with pytest.raises(ConfigError):
        await ctl.admit(5)


@pytest.mark.parametrize(("batch", "k"), [(4, -1), (0, 1)])
def test_bad_settings_are_config_errors(batch: int, k: int) -> None:
    with pytest.raises(ConfigError):
        StalenessController(batch_size=batch, max_staleness=k)


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_is_fresh_boundary(k: int) -> None:
    ctl = StalenessController(batch_size=4, max_staleness=k)
    train = 10
    assert ctl.is_fresh(train - k, train)
    assert not ctl.is_fresh(train - k - 1, train)
    assert ctl.is_fresh(train, train)


@pytest.mark.anyio
async def test_a_resumed_run_counts_admissions_from_its_starting_version() -> None:
    # Resumed at version 3 with nothing admitted yet: still only (k + 1) batches may start.
    ctl = StalenessController(batch_size=4, max_staleness=1, version=3)
    assert ctl.capacity == (1 + 1) * 4
    await ctl.set_version(4)
    assert ctl.capacity == (1 + 1 + 1) * 4


# -- the admission budget (partial rollout: pipeline.overprovision) ---------------------------


async def test_a_budget_replaces_k_plus_one_batches_in_admission() -> None:
    # Partial rollout: 1.5 batches may be in flight, while samples stay trainable up to k = 4.
    ctl = StalenessController(batch_size=8, max_staleness=4, budget=12)
    assert ctl.capacity == 12
    for _ in range(3):
        with anyio.fail_after(1):
            await ctl.admit(4)
    started: list[int] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_admit_into, ctl, 4, started)
        await anyio.wait_all_tasks_blocked()
        assert started == []  # 12 + 4 > 12: waits, though k = 4 would allow 40
        await ctl.set_version(1)  # a batch trained: 8 more
    assert started == [1] and ctl.capacity == 20
    assert ctl.is_fresh(0, 4) and not ctl.is_fresh(0, 5)  # freshness still follows k


def test_the_default_budget_is_k_plus_one_batches() -> None:
    assert StalenessController(batch_size=8, max_staleness=2).budget == 24


def test_a_budget_below_one_batch_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot fill a batch"):
        StalenessController(batch_size=8, max_staleness=1, budget=7)
