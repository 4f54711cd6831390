"""Group filters (``algo.filter``): which finished groups a train step may use.

A group whose samples all got the same reward (every answer right, or every one wrong) has no
signal for a group-relative advantage: GRPO's is exactly zero for each of its samples. Trained
anyway, it costs the step its forward and backward passes and, under token-mean aggregation,
dilutes the gradient of the groups that do carry signal, the more so as the policy gets better
(more all-correct groups). Two ways to leave such groups out, chosen with
``algo/filter=<name>`` (default: none; ``algo=dapo`` chooses ``dynamic_sampling``, and
``~algo/filter`` or ``algo.filter=null`` switches a preset's off):

* :class:`DynamicSampling` (``algo/filter=dynamic_sampling``; DAPO, arXiv 2503.14476): the group
  is not trained and another prompt is rolled out in its place, so every step trains a full
  batch of groups with signal. It costs extra generation; a cap bounds it per step
  (``max_refill_batches``, below).
* :class:`ZeroVarianceMask` (``algo/filter=zero_variance``): the cheap form. The group is left
  out of its step's batch with no replacement, so a step trains fewer samples (none, when every
  group of its batch is left out: the step changes no weight but still counts).

"All equal" is ``max(rewards) - min(rewards) <= tolerance`` (``tolerance: 0.0``: exactly
equal), on each sample's total reward.

**The cap.** A task the policy always or never solves would otherwise make dynamic sampling
roll out prompts forever. ``max_refill_batches`` (default 3) bounds the groups one step may
filter and replace to that many batches' worth (``max_refill_batches * batch_size /
group_size``): once a step has replaced that many, filtering pauses until its batch is formed,
and the groups that finish meanwhile are trained as they are. So a step trains a full batch
whatever happens, generates at most ``max_refill_batches + 1`` batches' worth of groups, and
never waits on a condition that may not come true. The alternative, training the smaller batch
it has, would change the loss normaliser and the admission accounting (a step consumes one
batch of admission slots) and could leave nothing to train. Under a group-relative estimator
the unfiltered groups carry zero advantage: the cap costs compute, not bias. A step that hit
it logs ``filter/capped = 1`` and the first one is a warning.

**Under bounded staleness** (``pipeline.max_staleness = k``): a filtered group gives its
admission slot back (:mod:`orchestrator.pipeline.outcomes`), which is what starts the replacement,
so filtering never stalls admission; the freshness check still drops any group older than
``version - k`` when a batch is formed, so every trained sample stays within ``k``. A filtered
prompt is settled in the task sampler like a trained one: a run resumed from a checkpoint does
not roll it out again, and a prompt that was in flight at the checkpoint is rolled out again,
so across a crash no prompt of a pass is repeated or skipped.

What each logs with the step (the pipeline's report): ``filter/filtered_groups`` (groups left
out since the previous step), ``filter/refills`` (of those, replaced by another prompt),
``filter/capped`` (dynamic sampling's cap was reached), ``filter/filtered_reward_mean`` (their
mean reward: near the top, the policy solves those prompts; near the bottom, it cannot yet),
``filter/unfiltered_reward_mean`` (the mean reward of every group judged since the previous
step, left out or trained: what ``reward/mean``, the trained batch's, would be without the
filter) and ``groups/<outcome>`` for every way a group left the pipeline.

The key lives in the ``algo`` node, so a preset can choose a filter, but it is the pipeline's:
the algorithm is built without it (:mod:`orchestrator.algo.build`), :func:`build_filter`
builds it. The filters here only decide; the pipeline applies them and retires the groups they leave
out (:mod:`orchestrator.pipeline.pipeline`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from orchestrator.config.read import CONF, check_accepts
from orchestrator.errors import ConfigError
from orchestrator.types import Group

FILTER_KEY = "filter"  # algo.filter


def equal_rewards(rewards: Sequence[float], tolerance: float = 0.0) -> bool:
    """Whether every reward is within ``tolerance`` of every other (vacuously, of none)."""
    return not rewards or max(rewards) - min(rewards) <= tolerance


class GroupFilter(ABC):
    """Decides which finished groups a train step may use."""

    #: True: a group left out gives its place to another prompt (its admission slot back);
    #: False: it is left out of its step's batch with no replacement.
    refill: ClassVar[bool] = False

    @abstractmethod
    def keep(self, group: Group) -> bool:
        """Whether ``group`` may be trained."""

    def max_refills(self, groups_per_batch: int) -> int:
        """How many groups one train step may leave out and replace (refilling filters)."""
        return 0

    def check(self, group_size: int) -> None:
        """Raise :class:`ConfigError` if groups of ``group_size`` samples cannot be filtered."""


class _EqualRewards(GroupFilter):
    name: ClassVar[str]

    def __init__(self, tolerance: float = 0.0) -> None:
        if not tolerance >= 0:
            raise ConfigError(f"algo.filter.tolerance must be >= 0, got {tolerance}")
        self.tolerance = float(tolerance)

    def keep(self, group: Group) -> bool:
        return not equal_rewards(group.rewards, self.tolerance)

    def check(self, group_size: int) -> None:
        if group_size < 2:
            raise ConfigError(f"algo/filter={self.name} needs rollout.group_size >= 2: a group "
                              f"of {group_size} sample always has equal rewards")


class DynamicSampling(_EqualRewards):
    """DAPO's dynamic sampling: a group whose rewards are all equal is not trained and another
    prompt is rolled out in its place, at most ``max_refill_batches`` batches' worth per step."""

    name = "dynamic_sampling"
    refill = True

    def __init__(self, max_refill_batches: int = 3, tolerance: float = 0.0) -> None:
        super().__init__(tolerance)
        if isinstance(max_refill_batches, bool) or not isinstance(max_refill_batches, int) \
                or max_refill_batches < 1:
            raise ConfigError(
                f"algo.filter.max_refill_batches must be a whole number >= 1, got "
                f"{max_refill_batches!r} (to filter without replacing, use algo/filter="
                f"zero_variance; to filter nothing, algo.filter=null)")
        self.max_refill_batches = max_refill_batches

    def max_refills(self, groups_per_batch: int) -> int:
        return self.max_refill_batches * groups_per_batch


class ZeroVarianceMask(_EqualRewards):
    """A group whose rewards are all equal is left out of its step's batch, not replaced."""

    name = "zero_variance"


# -- from the config ---------------------------------------------------------------------------


def filter_options() -> list[str]:
    """The names ``algo/filter=<name>`` takes (``conf/algo/filter/*.yaml``)."""
    return sorted(p.stem for p in (CONF / "algo" / FILTER_KEY).glob("*.yaml"))


def build_filter(node: Any) -> GroupFilter | None:
    """The filter the ``algo.filter`` node names by ``_target_`` (None: no filter); bad input
    is one :class:`ConfigError` sentence."""
    if node is None:
        return None
    options = ", ".join(filter_options())
    if not isinstance(node, Mapping):
        raise ConfigError(f"algo.filter={node} is not a filter: choose one with "
                          f"algo/filter=<name> (a slash; one of {options}) or null for none")
    values = dict(node)
    target = values.pop("_target_", None)
    if not isinstance(target, str):
        raise ConfigError(f"algo.filter has no _target_: choose a filter with algo/filter=<name> "
                          f"(one of {options})")
    from hydra.utils import get_object

    try:
        cls = get_object(target)
    except Exception as e:  # hydra raises a bare ImportError/ValueError mix here
        raise ConfigError(f"algo.filter._target_={target} cannot be imported") from e
    if not (isinstance(cls, type) and issubclass(cls, GroupFilter)):
        raise ConfigError(f"algo.filter._target_={target} is not a group filter "
                          f"(a GroupFilter of orchestrator.algo.filters)")
    check_accepts(cls, values, "algo.filter")
    try:
        return cls(**values)
    except TypeError as e:  # a required argument left out
        raise ConfigError(f"algo.filter: {e}") from e
