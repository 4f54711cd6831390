"""The asynchronous RL pipeline: rollout workers, the trainer and weight sync in one task group.

::

    rollout-0..N-1 ──(Group)──▶ trainer ──(WeightUpdate)──▶ weight-sync ──▶ engine
         ▲ admission                 freshness check                 │ version + 1
         └──────────────── StalenessController ◀────────────────────┘

* Each rollout worker waits for admission (see :mod:`orchestrator.staleness`), takes the
  sampler's next task and starts a group of episodes, which is sent to the trainer
  over a bounded stream when scored. The worker takes its next task once the group's
  generation has ended: scoring goes on apart, so a slow verification holds only its own
  group, and a group whose scoring outlives its freshness is dropped as stale then, not on
  arrival.
* The trainer forms a batch from the groups that arrived, dropping any too stale to train
  (:mod:`orchestrator.staleness` states the rule), awaits one :meth:`Trainer.step` and hands
  the new weights
  (:meth:`Trainer.weights`, a :class:`~orchestrator.weights.update.WeightUpdate`) to weight sync.
* Weight sync pauses the engine at a token boundary, loads the weights, resumes it, releases
  the update (an in-process trainer waits for that before changing its tensors again) and
  only then publishes the new version to admission control. With
  ``inflight_update="finish"`` it first takes a private copy of the weights (so the trainer
  goes on) and waits for in-flight episodes to finish under the old ones.
* A group leaves the pipeline through one call naming its outcome
  (:meth:`~orchestrator.pipeline.outcomes.GroupLedger.retire`: trained, stale, filtered, masked,
  empty, unfinished), which settles its task in the sampler and gives its admission slot back as
  that outcome requires; each step reports the counts (``groups/<outcome>``).
* A group filter (``algo.filter``, :mod:`orchestrator.algo.filters`) that refills judges a
  group in its worker as soon as it finishes: left out, its slot goes back and the worker
  starts another prompt at once, up to the filter's cap per step. One that does not refill
  judges the groups of a formed batch and leaves some out of the step.

``max_staleness = 0`` is the synchronous baseline through this same code: admission lets
exactly one batch start per version, so generation and training alternate, and the run is
the synchronous algorithm's, bit for bit (``tests/orchestrator/pipeline/test_synchronous.py``): a task is
taken once its group is admitted, so step ``s`` trains the sampler's next ``B / group_size``
tasks whichever workers run them; every sample is seeded by its task's draw index and its
index in the group (``sample_seed(seed, draw)``,
:func:`~orchestrator.episodes.rollout.sample_seed`), not by a random stream shared with whatever
else the engine runs; a group's samples are in episode order and a batch's groups in the sampler's
order, not in the order they finished.

Scheduling policies (``pipeline.overprovision``) differ only in the admission budget, the
samples that may be started and not yet trained (:class:`~orchestrator.staleness.StalenessController`):

* **bounded staleness** (``null``, the default; AReaL's rule): ``(k + 1) × B``, so the
  budget and the staleness bound move together;
* **partial rollout** (a number ``ρ >= 0``; APRIL, ROLL Flash): ``(1 + ρ) × B``. A step
  starts ``ρ × B`` more samples than it trains; the trainer takes the first groups to finish
  (oldest start version first), and the unfinished ones — the long samples — are carried into
  later steps rather than discarded: under ``inflight_update="continue"`` they go on under the
  new weights, every token stamped with the version that produced it, and are trained when
  they finish if they started no more than ``k`` versions before (the freshness check, so
  every trained token's version is ``>= version - k`` and the decoupled-PPO correction has
  each token's behaviour log-prob). How much is over-provisioned is thus decoupled from how
  stale a carried sample may be: a budget well below ``(k + 1) × B`` keeps long samples alive
  across many versions without filling the engines with fresh ones. It needs ``k >= 1`` (a
  carried sample is at least one version old when trained).

With ``launcher.colocate=true`` (the trainer and the engine on one GPU) the engine sleeps
through each train step (:meth:`~orchestrator.engines.base.InferenceEngine.sleep`: its requests
wait) and the weight sync wakes it; every engine but a colocated vLLM ignores it.

The trainer loop ends the run after ``num_steps`` steps: it waits for the last weight sync,
then cancels the workers. A crash anywhere cancels everything and surfaces.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream, TaskGroup

from envs.base import Task
from orchestrator.algo.filters import GroupFilter
from orchestrator.config.schema import PipelineConfig
from orchestrator.engines.base import sync_weights
from orchestrator.engines.rwlock import ReadWriteLock
from orchestrator.episodes.rollout import EpisodeRunner, sample_seed
from orchestrator.errors import RunAborted
from orchestrator.faults import add_faults, kill_point
from orchestrator.gateway import Gateway, agent_gateway, run_agent_group
from orchestrator.pipeline.outcomes import GroupLedger, Outcome
from orchestrator.pipeline.sampler import TaskSampler
from orchestrator.staleness import StalenessController
from orchestrator.trainer.base import Trainer
from orchestrator.types import Evaluation, FinishReason, StepReport, TimedGroup
from orchestrator.weights.attest import Attestor
from orchestrator.weights.update import WeightUpdate

log = logging.getLogger(__name__)


OnStep = Callable[[StepReport], Awaitable[None] | None]


@dataclass(frozen=True)
class PeriodicEval:
    """A held-out evaluation every ``every`` train steps, run alongside rollout and training.
    With ``frozen``, :attr:`run` is handed a private copy of the weights of the step just
    trained and evaluates exactly those (on an engine of its own); else it is handed None and
    runs on the rollout engine, whose weights may update under it. It goes into the step
    report during which it finished (:attr:`StepReport.evaluation`) and into its metrics: every
    figure (:meth:`Evaluation.metrics`: ``eval/pass@1``, ``eval/<source>/mean@4``, …), the
    headline mean@n as ``eval/accuracy``, and ``eval/step``, the step after which it started."""

    every: int
    run: Callable[[WeightUpdate | None], Awaitable[Evaluation]]
    frozen: bool = False


class Pipeline:
    """Rollout through ``runner`` (its engine, environment, rollout settings and recorder),
    training with ``trainer``, on tasks from ``sampler``; ``group_filter`` (``algo.filter``)
    leaves groups out (:mod:`orchestrator.algo.filters`)."""

    def __init__(
        self,
        config: PipelineConfig,
        runner: EpisodeRunner,
        trainer: Trainer,
        sampler: TaskSampler,
        on_step: OnStep | None = None,
        evaluation: PeriodicEval | None = None,
        group_filter: GroupFilter | None = None,
        seed: int = 0,
        attest: bool = False,
    ) -> None:
        config.check_group_size(runner.config.group_size)
        if group_filter is not None:
            group_filter.check(runner.config.group_size)
        self.config = config
        self.runner = runner
        self.rollout = runner.config
        self.engine = runner.engine
        self.trainer = trainer
        self.sampler = sampler
        self.seed = seed  # the run's: every sample's sampling seed derives from it
        self.recorder = runner.recorder
        runner.spec.use_clock(self.recorder.clock)  # one clock: tools report times on the recorder's
        self.on_step = on_step
        self.staleness = StalenessController(
            config.batch_size, config.max_staleness, version=trainer.version, budget=config.budget
        )
        # every group leaves through the ledger: the sampler and admission kept in step
        self.ledger = GroupLedger(sampler, self.staleness, runner.config.group_size)
        self.group_filter = group_filter
        groups_per_batch = config.batch_size // runner.config.group_size
        self._max_refills = (group_filter.max_refills(groups_per_batch)
                             if group_filter is not None and group_filter.refill else 0)
        self._refilled = 0  # groups filtered and replaced since the last batch was formed
        self._capped = False  # ... and whether that reached the filter's cap
        self._warned_cap = False
        self._reward_failed_steps = 0  # steps in a row where most samples' rewards failed
        self.gate = ReadWriteLock()  # held by episodes when inflight_update='finish'
        self.reports: list[StepReport] = []
        self.step = 0  # the next step to train
        self.stopped = False  # request_stop() ended the run before num_steps
        self._waiting: anyio.CancelScope | None = None  # the trainer waiting for a batch
        self.gateway: Gateway | None = None  # an agent env's, while the pipeline runs
        self.evaluation = evaluation
        self._evaluated: tuple[int, Evaluation] | None = None  # a finished periodic eval (and
        #                                                        its step), for the next report
        self._evaluating = False  # one periodic eval at a time: a due one is skipped
        self._scoring: dict[anyio.CancelScope, int] = {}  # groups generated and being scored,
        #                                                   by their start versions
        self._lanes: set[str] = set()  # the span names of the groups in flight (_lane)
        self._reported_seconds: Counter[str] = Counter()  # recorder.totals() at the last report
        self.faults_before: dict[str, float] = {}  # the run's earlier processes' fault counters
        self.faults: dict[str, float] = {}  # the whole run's, as of the last report
        # engine.attest: each batch's segments checked against the published fingerprints
        self.attestor = Attestor() if attest else None
        self._unpublished: list[WeightUpdate] = []  # sent, their fingerprints not yet published

    async def run(self) -> list[StepReport]:
        groups_per_batch = self.config.batch_size // self.rollout.group_size
        if self.attestor is not None:  # what the engines hold now (after a warm start, a resume)
            # before the first step's count starts: this gather is no step's
            current = await self.trainer.weights()
            current.release()
            self.attestor.publish(current.version, await current.known_fingerprint())
        self._reported_seconds = self.recorder.totals()  # not the warm start's or an evaluation's
        # Room for every group admission allows, so workers never block on a full stream
        # while holding finished work; admission is the real bound.
        capacity = math.ceil(self.config.budget / self.rollout.group_size) + groups_per_batch
        send_groups, receive_groups = anyio.create_memory_object_stream[TimedGroup](capacity)
        send_weights, receive_weights = anyio.create_memory_object_stream[WeightUpdate](1)
        async with receive_groups, agent_gateway(self.runner) as self.gateway, \
                anyio.create_task_group() as tg:
            async with send_groups:
                for i in range(self.config.num_workers):
                    tg.start_soon(self._worker, f"rollout-{i}", send_groups.clone(), tg,
                                  name=f"rollout-{i}")
            sync_done = anyio.Event()
            tg.start_soon(self._weight_sync, receive_weights, sync_done, name="weight-sync")
            await self._trainer_loop(receive_groups, send_weights, groups_per_batch, tg)
            await sync_done.wait()
            tg.cancel_scope.cancel()
        return self.reports

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs of the pipeline to go on from the end of the last step: the
        next step, the samples dropped as stale so far, the task sampler, the run's fault
        counters (:mod:`orchestrator.faults`)."""
        return {"step": self.step, "dropped": self.staleness.dropped,
                "sampler": self.sampler.state_dict(), "faults": dict(self.faults)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a checkpoint's :meth:`state_dict` (before :meth:`run`)."""
        self.step = int(state["step"])
        self.staleness.dropped = int(state["dropped"])
        self.sampler.load_state_dict(state["sampler"])
        self.carry_faults(state.get("faults", {}))

    def carry_faults(self, totals: Mapping[str, float]) -> None:
        """Count faults on from ``totals``, the run's earlier processes' (before :meth:`run`)."""
        self.faults_before = dict(totals)
        self.faults = dict(totals)

    def request_stop(self) -> None:
        """End the run after the step in progress (at once if the trainer is only waiting for
        a batch); :meth:`run` returns with :attr:`stopped` set."""
        self.stopped = True
        if self._waiting is not None:
            self._waiting.cancel()

    # -- rollout -------------------------------------------------------------------------

    async def _worker(self, name: str, send: ObjectSendStream[TimedGroup], tg: TaskGroup) -> None:
        """Wait for admission, take the next task and start its group; the worker is free
        again once the group's generation has ended, while the group is scored apart."""
        async with send:
            while True:
                lane = self._lane(name)
                waited = self.recorder.now()
                with self.recorder.span("wait_admission", lane, self.staleness.version):
                    await self.staleness.admit(self.rollout.group_size)
                waited = self.recorder.now() - waited
                # Taken once admitted (no await between): the tasks a version starts are the
                # sampler's next ones in admission order, whichever workers were waiting.
                draw = self.sampler.drawn
                task = self.sampler.next()
                generated = anyio.Event()
                tg.start_soon(self._group, task, draw, lane, waited, send.clone(), generated,
                              name=f"{lane}-group")
                await generated.wait()

    def _lane(self, worker: str) -> str:
        """The name a new group of ``worker`` records its spans under: the worker's own while
        no earlier group of it is still being scored, else the first free one past the
        workers' (``rollout-<N>``, ``rollout-<N+1>``, …), so the spans on a lane never overlap
        but nest, as the timeline needs. Freed when the group ends."""
        lane, extra = worker, self.config.num_workers
        while lane in self._lanes:
            lane, extra = f"rollout-{extra}", extra + 1
        self._lanes.add(lane)
        return lane

    async def _group(self, task: Task, draw: int, name: str, waited: float,
                     send: ObjectSendStream[TimedGroup], generated: anyio.Event) -> None:
        """One group of the sampler's ``draw``-th task, its samples seeded by
        ``sample_seed(seed, draw)``, from generation to the trainer's stream (or its outcome).
        Once generated,
        its scoring may outlive its freshness (a hung verification waits out
        ``env.reward_timeout_s``): the trainer then cancels it (:meth:`_drop_doomed`) and it
        retires as stale at once, its admission slot given back, rather than on arrival."""
        scope = anyio.CancelScope()

        def on_generated(start_version: int) -> None:
            self._scoring[scope] = start_version
            generated.set()

        episode_scope: AbstractAsyncContextManager[Any] = (
            self.gate if self.config.inflight_update == "finish" else nullcontext()
        )
        async with send:
            try:
                with scope:
                    async with episode_scope:
                        kill_point("generate", self.engine.version)
                        with self.recorder.span("rollout", name, self.engine.version,
                                                prompt_id=task.id) as attrs:
                            group = await (
                                run_agent_group(self.gateway, self.runner, task, name, waited)
                                if self.gateway is not None
                                else self.runner.group(task, name, waited, on_generated,
                                                       seed=sample_seed(self.seed, draw)))
                            group = replace(group, draw=draw)
                            attrs["start_version"] = group.start_version
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.ledger.retire(task.id, Outcome.UNFINISHED)
                raise
            finally:
                self._scoring.pop(scope, None)
                self._lanes.discard(name)
                generated.set()
            if scope.cancelled_caught:
                await self.ledger.retire(task.id, Outcome.STALE)
                return
            if not len(group):  # agent programs that never called the model
                await self.ledger.retire(task.id, Outcome.EMPTY)
                return
            if self._refills(group):  # its slot goes back: a worker starts another
                await self.ledger.retire(task.id, Outcome.FILTERED, group.group.rewards)
                return
            await send.send(group)

    def _drop_doomed(self, version: int) -> None:
        """Cancel the groups still being scored that can no longer be trained at ``version``
        (started more than ``k`` versions before it)."""
        for scope, start_version in list(self._scoring.items()):
            if not self.staleness.is_fresh(start_version, version):
                scope.cancel()

    def _refills(self, group: TimedGroup) -> bool:
        """Whether a refilling filter leaves ``group`` out, within the step's cap."""
        if not self._max_refills or self.group_filter is None or self.group_filter.keep(group.group):
            return False
        if self._refilled >= self._max_refills:  # capped: trained as it is (filters.py says why)
            self._capped = True
            return False
        self._refilled += 1
        return True

    # -- training --------------------------------------------------------------------------

    async def _trainer_loop(
        self,
        receive: ObjectReceiveStream[TimedGroup],
        send_weights: ObjectSendStream[WeightUpdate],
        groups_per_batch: int,
        tg: TaskGroup,
    ) -> None:
        """The trainer's side of the pipeline, a step at a time until ``num_steps`` or a stop:
        wait for a batch of groups no staler than k allows, check its attestation and mask
        what failed, retire its prompts, train, send the new weights to the weight-sync
        task, start a periodic evaluation when one is due, and report the step."""
        pending: list[TimedGroup] = []
        last_report = self.recorder.now()
        async with send_weights:  # closing it lets weight sync finish; receive stays open
            # until the workers are cancelled, so none of them fails on a closed stream.
            for step in range(self.step, self.config.num_steps):
                if self.stopped:
                    break
                version = self.trainer.version
                self._drop_doomed(version)
                with self.recorder.span("wait_batch", "trainer", version), \
                        anyio.CancelScope() as self._waiting:
                    batch = await self._next_batch(receive, pending, groups_per_batch, version)
                self._waiting = None
                if self.stopped:
                    break
                capped, self._capped, self._refilled = self._capped, False, 0
                batch = await self._attest(batch, send_weights)
                batch = await self._mask(batch, step)
                groups = [g.group for g in batch]  # the trainer gets no timings
                for group in groups:
                    await self.ledger.retire(group.prompt_id, Outcome.TRAINED, group.rewards)
                await self.engine.sleep()  # colocated: the GPU is the trainer's until the sync
                with self.recorder.span("train_step", "trainer", version, step=step) as attrs:
                    metrics = await self.trainer.step(groups)
                    attrs["samples"] = sum(len(g) for g in groups)
                update = await self.trainer.weights()
                if self.attestor is not None:  # its fingerprint may still be being computed
                    self._unpublished.append(update)
                periodic = self.evaluation
                due = (periodic is not None and (step + 1) % periodic.every == 0
                       and not self._evaluating)
                frozen = update.snapshot() if due and periodic is not None and periodic.frozen else None
                await send_weights.send(update)
                evaluated, self._evaluated = self._evaluated, None
                if evaluated is not None:
                    metrics = {**metrics, **evaluated[1].metrics("eval"),
                               "eval/accuracy": evaluated[1].mean, "eval/step": float(evaluated[0])}
                if due:
                    self._evaluating = True
                    tg.start_soon(self._evaluate, step + 1, frozen, name="periodic-eval")
                now = self.recorder.now()
                report = self._report(step, version, batch, metrics, last_report, now, capped)
                self._watch_rewards(step, batch)
                if evaluated is not None:
                    report = replace(report, evaluation=evaluated[1])
                last_report = now
                # Kept without its batch: a long run must not hold every trajectory it trained.
                self.reports.append(replace(report, groups=(), timings=()))
                self.step = step + 1
                if self.on_step is not None:
                    result = self.on_step(report)
                    if result is not None:
                        await result

    async def _attest(self, batch: list[TimedGroup],
                      send_weights: ObjectSendStream[WeightUpdate]) -> list[TimedGroup]:
        """The batch with the tokens of failed attestations masked; after a failure the
        engines reload the last update (the trainer's weights, sent again through weight sync)."""
        if self.attestor is None:
            return batch
        # The fingerprints this batch is checked against: the last update's is still being
        # computed beside this step unless the batch has tokens of its version already.
        versions = {a.version for g in batch for t in g.group.trajectories for a in t.attestations}
        for update in list(self._unpublished):
            if update.version in versions or update.fingerprint_known:
                self.attestor.publish(update.version, await update.known_fingerprint())
                self._unpublished.remove(update)
        groups, failed = self.attestor.check([g.group for g in batch])
        if failed:
            await send_weights.send(await self.trainer.weights())
        return [g if group is g.group else replace(g, group=group)
                for g, group in zip(batch, groups, strict=True)]

    async def _mask(self, batch: list[TimedGroup], step: int) -> list[TimedGroup]:
        """The batch less the groups a filter that does not refill leaves out (masked)."""
        if self.group_filter is None or self.group_filter.refill:
            return batch
        keep = [self.group_filter.keep(g.group) for g in batch]
        for g, kept_it in zip(batch, keep, strict=True):
            if not kept_it:
                await self.ledger.retire(g.prompt_id, Outcome.MASKED, g.group.rewards)
        kept = [g for g, kept_it in zip(batch, keep, strict=True) if kept_it]
        if not kept:
            log.info("step %d: algo.filter left out every group of the batch (all rewards equal "
                     "in each): the step trains no sample", step)
        return kept

    async def _evaluate(self, step: int, weights: WeightUpdate | None) -> None:
        assert self.evaluation is not None
        try:
            evaluation = await self.evaluation.run(weights)
        finally:
            self._evaluating = False
        self._evaluated = (step, evaluation)

    async def _next_batch(
        self,
        receive: ObjectReceiveStream[TimedGroup],
        pending: list[TimedGroup],
        groups_per_batch: int,
        version: int,
    ) -> list[TimedGroup]:
        while True:
            fresh = []
            for group in pending:
                if self.staleness.is_fresh(group.start_version, version):
                    fresh.append(group)
                else:
                    await self.ledger.retire(group.prompt_id, Outcome.STALE)
            # Oldest first: a slow group overtaken by later ones is trained before it ages
            # past k; equal versions in the sampler's order, not the order they finished in
            # (which depends on timing), so a batch's order is reproducible.
            fresh.sort(key=lambda g: (g.start_version, g.draw))
            pending[:] = fresh
            if len(pending) >= groups_per_batch:
                batch = pending[:groups_per_batch]
                del pending[:groups_per_batch]
                return batch
            pending.append(await receive.receive())

    async def _weight_sync(self, receive: ObjectReceiveStream[WeightUpdate], done: anyio.Event) -> None:
        finish_old = self.config.inflight_update == "finish"
        async with receive:
            async for update in receive:
                version = update.version
                with self.recorder.span("weight_sync", "weight_sync", version) as attrs:
                    if finish_old:  # a copy lets the trainer go on while episodes finish
                        update = update.detached()
                        with self.recorder.span("wait_inflight", "weight_sync", version):
                            await self.gate.acquire_exclusive()
                    try:
                        started = self.recorder.now()
                        await sync_weights(self.engine, update)
                        attrs.update(transport=update.transport, bytes=update.nbytes,
                                     load_seconds=self.recorder.now() - started,
                                     **update.stats)  # gather_seconds from trainer ranks
                        if update.delta is not None:  # engine.delta: what an engine at the
                            attrs["delta_bytes"] = update.delta.nbytes  # version before pulls
                    finally:
                        if finish_old:
                            await self.gate.release_exclusive()
                await self.staleness.set_version(version)
        done.set()

    # -- reporting -------------------------------------------------------------------------

    def _retired_metrics(self, step: int, capped: bool) -> dict[str, float]:
        """The groups retired since the last report, per outcome, and what the filter did."""
        retired = self.ledger.take_counts()
        metrics = retired.metrics()
        if self.group_filter is None:
            return metrics
        left_out = (Outcome.FILTERED, Outcome.MASKED)
        metrics["filter/filtered_groups"] = float(sum(retired.groups[o] for o in left_out))
        metrics["filter/refills"] = float(retired.groups[Outcome.FILTERED])
        for name, outcomes in (("filtered_reward_mean", left_out),
                               ("unfiltered_reward_mean", (Outcome.TRAINED, *left_out))):
            mean = retired.reward_mean(*outcomes)
            if mean is not None:
                metrics[f"filter/{name}"] = mean
        if self.group_filter.refill:
            metrics["filter/capped"] = float(capped)
            if capped and not self._warned_cap:
                self._warned_cap = True
                log.warning("step %d: algo.filter replaced %d groups, its cap "
                            "(max_refill_batches): the rest of the batch was trained as it "
                            "came, equal rewards and all; the task may be too easy or too hard "
                            "for the policy now", step, self._max_refills)
        return metrics

    def _watch_rewards(self, step: int, batch: Sequence[TimedGroup]) -> None:
        """Stop the run (one line naming the reward and its first failure) when the reward
        gave up on more than half of a step's samples ``env.reward_fail_steps`` steps in a
        row: it would train on zeros."""
        trajectories = [t for g in batch for t in g.group.trajectories]
        failed = sum(t.metrics.get("reward/failed", 0.0) > 0 for t in trajectories)
        most = bool(trajectories) and 2 * failed > len(trajectories)
        self._reward_failed_steps = self._reward_failed_steps + 1 if most else 0
        spec = self.runner.spec
        if self._reward_failed_steps >= spec.reward_fail_steps:
            raise RunAborted(f"the reward failed on more than half the samples for "
                             f"{self._reward_failed_steps} steps in a row (step {step}: "
                             f"{failed} of {len(trajectories)}); its first failure: "
                             f"{spec.reward_failure()}")

    def _report(
        self,
        step: int,
        version: int,
        batch: Sequence[TimedGroup],
        metrics: dict[str, float],
        since: float,
        now: float,
        capped: bool = False,
    ) -> StepReport:
        trajectories = [t for g in batch for t in g.group.trajectories]
        # the engine's, the agent gateway's and the environment's counters under their own
        # names; fault counters are the whole run's (earlier processes' added)
        counters = {**self.engine.metrics(), **self.runner.spec.metrics(),
                    **(self.attestor.metrics() if self.attestor is not None else {}),
                    **(self.gateway.metrics() if self.gateway is not None else {}),
                    **self._retired_metrics(step, capped)}
        if counters.get("weights/full_bytes"):  # engine.delta: the last sync, over the engines
            counters["weights/delta_ratio"] = (counters["weights/delta_bytes"]
                                               / counters["weights/full_bytes"])
        self.faults = add_faults(self.faults_before, counters)
        totals = self.recorder.totals()
        stage_seconds = totals - self._reported_seconds  # recorded since the last report
        self._reported_seconds = totals
        return StepReport(
            step=step,
            version=version,
            metrics={**metrics, **counters, **self.faults},
            rewards=tuple(t.reward for t in trajectories),
            staleness=tuple(version - t.start_version for t in trajectories),
            start_versions=tuple(t.start_version for t in trajectories),
            dropped_total=self.staleness.dropped,
            samples=len(trajectories),
            tokens=sum(t.num_generated for t in trajectories),
            elapsed=now - since,
            stage_seconds=dict(stage_seconds),
            length_capped=sum(t.finish_reason is FinishReason.LENGTH for t in trajectories),
            groups=tuple(g.group for g in batch),
            timings=tuple(g.timing for g in batch),
        )
