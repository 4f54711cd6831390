"""A readers-writer lock with writer preference, used around weight updates.

Holders of the shared side (episodes that must finish on the weights they started with;
simulated decode chunks) run concurrently; the exclusive side (a weight update) waits for
all of them to leave, and while it waits no new shared holder enters, so it cannot starve.
"""

from __future__ import annotations

import anyio


class ReadWriteLock:
    """``async with lock:`` holds the shared side; ``acquire_exclusive``/``release_exclusive``
    the exclusive one."""

    def __init__(self) -> None:
        self._cond = anyio.Condition()
        self._active = 0
        self._writer = False

    async def __aenter__(self) -> None:
        async with self._cond:
            while self._writer:
                await self._cond.wait()
            self._active += 1

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            async with self._cond:
                self._active -= 1
                self._cond.notify_all()

    async def acquire_exclusive(self) -> None:
        async with self._cond:
            while self._writer:
                await self._cond.wait()
            self._writer = True
            try:
                while self._active:
                    await self._cond.wait()
            except BaseException:  # cancelled while waiting: do not leave the gate shut
                self._writer = False
                self._cond.notify_all()
                raise

    async def release_exclusive(self) -> None:
        async with self._cond:
            self._writer = False
            self._cond.notify_all()
