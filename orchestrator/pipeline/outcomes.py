"""How a group leaves the pipeline: one call, :meth:`GroupLedger.retire`, that names its outcome.

Every task the sampler hands out (:class:`~orchestrator.pipeline.sampler.TaskSampler`) is admitted
as a group of ``rollout.group_size`` samples (:class:`~orchestrator.staleness.StalenessController`)
and retired exactly once, with one :class:`Outcome`. The outcome alone decides the bookkeeping, so a
new site that retires a group cannot do half of it (settle the task and keep the slot, which starves
admission; give the slot back and leave the task outstanding, which replays the prompt after a
resume):

* ``trained``: in a train step's batch. Task settled; the slot is kept, as the step's.
* ``stale``: started more than ``k`` versions before the step that would train it. Task
  settled; slot given back, counted as dropped.
* ``filtered``: left out by a refilling group filter (``algo.filter``, dynamic sampling)
  before it joined a batch. Task settled; slot given back, so another prompt takes its place.
* ``masked``: left out of its step's batch by a filter that does not refill (zero-variance
  masking). Task settled; the slot is kept, as the step's.
* ``empty``: an agent program that never called the model. Task settled; slot given back.
* ``unfinished``: its rollout raised or was cancelled. The task is *not* settled (a resumed
  run rolls it out again); slot given back.

Why a trained or masked group keeps its slot: admission's capacity grows by one batch per
version, so a step consumes one batch of slots whatever it trained; giving a masked group's
slot back as well would start a replacement, which is what ``filtered`` means. Why a filtered
or masked task is settled: its rewards were seen and it was judged, so a resumed run must not
roll it out again within the pass (nor does an uninterrupted one).

:meth:`GroupLedger.take_counts` gives the groups (and their rewards) retired per outcome since
it was last called: the pipeline reports them with each step (``groups/<outcome>``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from orchestrator.pipeline.sampler import TaskSampler
from orchestrator.staleness import StalenessController


class Outcome(Enum):
    """Why a group left the pipeline (see the module docstring for what each one does)."""

    TRAINED = "trained"
    STALE = "stale"
    FILTERED = "filtered"
    MASKED = "masked"
    EMPTY = "empty"
    UNFINISHED = "unfinished"

    @property
    def settles(self) -> bool:
        """The task is done with (a resumed run does not hand it out again)."""
        return self is not Outcome.UNFINISHED

    @property
    def frees_slot(self) -> bool:
        """The group's admission slot goes back to admission."""
        return self not in (Outcome.TRAINED, Outcome.MASKED)


@dataclass
class Retired:
    """Groups retired per outcome over some span of the run, and the sum and count of their
    samples' rewards (those given)."""

    groups: Counter[Outcome] = field(default_factory=Counter)
    reward_sum: Counter[Outcome] = field(default_factory=Counter)
    rewards: Counter[Outcome] = field(default_factory=Counter)

    def reward_mean(self, *outcomes: Outcome) -> float | None:
        n = sum(self.rewards[o] for o in outcomes)
        return sum(self.reward_sum[o] for o in outcomes) / n if n else None

    def metrics(self) -> dict[str, float]:
        """``groups/<outcome>``: the groups retired with each outcome."""
        return {f"groups/{o.value}": float(self.groups[o]) for o in Outcome}


class GroupLedger:
    """The one place a group is retired: the sampler and admission control kept in step."""

    def __init__(self, sampler: TaskSampler, staleness: StalenessController,
                 group_size: int) -> None:
        self.sampler = sampler
        self.staleness = staleness
        self.group_size = group_size  # the samples each group was admitted for
        self._since = Retired()

    async def retire(self, task_id: int, outcome: Outcome, rewards: Sequence[float] = ()) -> None:
        """The group of ``task_id`` leaves the pipeline with ``outcome`` (``rewards``: its
        samples', where it has any)."""
        if outcome.settles:
            self.sampler.settle(task_id)
        self._since.groups[outcome] += 1
        self._since.reward_sum[outcome] += sum(rewards)
        self._since.rewards[outcome] += len(rewards)
        if outcome.frees_slot:
            await self.staleness.release(self.group_size, dropped=outcome is Outcome.STALE)

    def take_counts(self) -> Retired:
        """What was retired since the last call."""
        since, self._since = self._since, Retired()
        return since
