"""The order prompts are rolled out in: endless shuffled passes over the train split.

:class:`TaskSampler` is shared by every rollout worker. A task it hands out is *outstanding*
until the pipeline retires its group (:mod:`orchestrator.pipeline.outcomes`: trained, dropped as
stale, filtered, …), which *settles* it. Its position in the pass and the outstanding tasks are
pipeline state saved in checkpoints: a resumed run hands the outstanding ones out again first, then
goes on with the pass where it was, so within a pass no prompt is skipped and none is repeated
across a crash.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from envs.base import Task
from orchestrator.errors import ConfigError


class TaskSampler:
    """Endless shuffled passes over a task list, shared by every worker.

    It remembers the tasks it handed out that have not been settled yet (their group not yet
    retired: :class:`~orchestrator.pipeline.outcomes.GroupLedger`): a checkpoint saves them
    (:meth:`state_dict`), and a resumed run hands them out again first, so no prompt is skipped
    and none is repeated within a pass.
    """

    def __init__(self, tasks: Sequence[Task], seed: int = 0) -> None:
        if not tasks:
            raise ConfigError("the environment's train split is empty")
        self._tasks = tasks
        self._rng = random.Random(seed)
        self._order: list[int] = []
        self._outstanding: list[int] = []  # handed out, not settled, oldest first
        self._again: list[int] = []  # outstanding at the checkpoint a run resumed from
        self.passes = 0
        self.drawn = 0  # tasks handed out so far in the run: the next one's draw index

    def next(self) -> Task:
        if self._again:
            i = self._again.pop(0)
        else:
            if not self._order:
                self._order = list(range(len(self._tasks)))
                self._rng.shuffle(self._order)
                self.passes += 1
            i = self._order.pop()
        self._outstanding.append(i)
        self.drawn += 1
        return self._tasks[i]

    def settle(self, task_id: int) -> None:
        """The group of ``task_id`` was retired (trained, dropped, filtered): its task is done
        with. (Groups that did not come from this sampler, as in tests, settle nothing.)"""
        for n, i in enumerate(self._outstanding):
            if self._tasks[i].id == task_id:
                del self._outstanding[n]
                return

    @property
    def outstanding(self) -> list[int]:
        """The ids of the tasks handed out and not settled, oldest first."""
        return [self._tasks[i].id for i in self._outstanding]

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self._rng.getstate()
        return {"rng": [version, list(internal), gauss], "order": list(self._order),
                "again": self._again + self._outstanding, "passes": self.passes,
                "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self._order = list(state["order"])
        self._again = list(state["again"])
        self._outstanding = []
        self.passes = int(state["passes"])
        self.drawn = int(state.get("drawn", 0))  # not in checkpoints older than it
