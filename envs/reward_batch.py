"""Samples gathered into batched calls: a TRL-style reward (``fn(prompts, completions,
**columns)``, :mod:`envs.rewards`) is written for lists, so the samples that ask it for a score
at about the same time share one call.

The first sample of a new batch leads it: it waits :data:`WINDOW_S` (or until the batch holds
``size`` samples), takes every sample that came meanwhile and runs the one call; each sample's
caller gets its own outcome. A group's episodes, or an evaluation's, finish close together,
so a batch is usually a group or more. No task is started: the leader's wait is its own
episode's, and the call is shielded from cancellation so that the samples that joined it are
always answered (the call is bounded by the reward's hard limit).

Limits: a batch is what arrives within the window, not a group by construction; one slow
item delays its batch-mates (they share one call and one time limit).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio

WINDOW_S = 0.02  # how long a batch's first sample waits for others
SIZE = 64  # the most samples in one call

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass
class _Slot(Generic[Item, Result]):
    item: Item
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Result | None = None
    error: BaseException | None = None


class Batcher(Generic[Item, Result]):
    """``call`` (a batch of items -> one result per item, in order) shared by concurrent
    :meth:`submit` calls."""

    def __init__(self, call: Callable[[Sequence[Item]], Awaitable[Sequence[Result]]],
                 size: int = SIZE, window_s: float = WINDOW_S) -> None:
        self._call = call
        self.size, self.window_s = size, window_s
        self._pending: list[_Slot[Item, Result]] = []
        self._full = anyio.Event()
        self.calls = 0  # batched calls made (for tests and the record)

    async def submit(self, item: Item) -> Result:
        slot: _Slot[Item, Result] = _Slot(item)
        self._pending.append(slot)
        if len(self._pending) == 1:
            await self._lead()
        elif len(self._pending) >= self.size:
            self._full.set()
        await slot.done.wait()
        if slot.error is not None:
            raise slot.error
        assert slot.result is not None
        return slot.result

    async def _lead(self) -> None:
        with anyio.CancelScope(shield=True):  # the batch-mates wait on this call
            with anyio.move_on_after(self.window_s):
                await self._full.wait()
            batch, self._pending, self._full = self._pending, [], anyio.Event()
            self.calls += 1
            try:
                results = list(await self._call([s.item for s in batch]))
                if len(results) != len(batch):
                    raise RuntimeError(f"a batch of {len(batch)} gave {len(results)} results")
            except Exception as e:  # noqa: BLE001 - each sample of the batch gets it, none waits
                for slot in batch:
                    slot.error = e
                    slot.done.set()
                return
            for slot, result in zip(batch, results, strict=True):
                slot.result = result
                slot.done.set()
