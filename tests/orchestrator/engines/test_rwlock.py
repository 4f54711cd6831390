"""The shared/exclusive lock around weight updates (orchestrator/engines/rwlock.py): the pipeline's
gate."""

from __future__ import annotations

import anyio
import pytest

from orchestrator.engines.rwlock import ReadWriteLock

pytestmark = pytest.mark.anyio


async def test_shared_holders_run_together_and_exclusive_waits_for_them() -> None:
    gate = ReadWriteLock()
    log: list[str] = []
    leave = anyio.Event()

    async def reader(name: str) -> None:
        async with gate:
            log.append(f"{name} in")
            await leave.wait()
            log.append(f"{name} out")

    async def writer() -> None:
        await gate.acquire_exclusive()
        log.append("writer in")
        await gate.release_exclusive()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader, "a")
            tg.start_soon(reader, "b")
            await anyio.wait_all_tasks_blocked()
            assert log == ["a in", "b in"]
            tg.start_soon(writer)
            await anyio.wait_all_tasks_blocked()
            assert "writer in" not in log
            leave.set()
    assert log[-1] == "writer in"


async def test_a_waiting_writer_blocks_new_readers() -> None:
    gate = ReadWriteLock()
    log: list[str] = []
    leave = anyio.Event()

    async def first_reader() -> None:
        async with gate:
            await leave.wait()
            log.append("first out")

    async def writer() -> None:
        await gate.acquire_exclusive()
        log.append("writer in")
        await gate.release_exclusive()

    async def late_reader() -> None:
        async with gate:
            log.append("late in")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(first_reader)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(writer)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(late_reader)
            await anyio.wait_all_tasks_blocked()
            assert log == []  # the late reader queues behind the writer
            leave.set()
    assert log == ["first out", "writer in", "late in"]


async def test_exclusive_holder_keeps_readers_out_until_released() -> None:
    gate = ReadWriteLock()
    entered: list[int] = []

    async def reader() -> None:
        async with gate:
            entered.append(1)

    await gate.acquire_exclusive()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await anyio.wait_all_tasks_blocked()
            assert entered == []
            await gate.release_exclusive()
    assert entered == [1]


async def test_a_cancelled_writer_does_not_leave_the_gate_shut() -> None:
    gate = ReadWriteLock()
    leave = anyio.Event()
    entered: list[int] = []

    async def holder() -> None:
        async with gate:
            await leave.wait()

    async def reader() -> None:
        async with gate:
            entered.append(1)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(holder)
            await anyio.wait_all_tasks_blocked()
            with anyio.move_on_after(0.05):
                await gate.acquire_exclusive()  # cannot get it while the holder is in
            tg.start_soon(reader)
            await anyio.wait_all_tasks_blocked()
            assert entered == [1]  # the abandoned writer no longer blocks readers
            leave.set()
    await gate.acquire_exclusive()  # and the gate still works
    await gate.release_exclusive()
