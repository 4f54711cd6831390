"""How groups leave the pipeline (orchestrator/pipeline/outcomes.py) and the group filters the
pipeline applies (orchestrator/algo/filters.py), on the simulated engine and trainer in virtual
time: each outcome's bookkeeping; dynamic sampling at k = 1 refills without stalling admission,
keeps staleness within k and stops at its cap; zero-variance masking trains less with no refill; a
crash after a checkpoint and a resume neither repeat nor skip a prompt."""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pytest
from helpers import TOK, virtual_time  # noqa: F401 - anyio_backend: virtual time

from envs.arithmetic import ArithmeticSpec
from envs.base import Task
from orchestrator.algo.filters import DynamicSampling, GroupFilter, ZeroVarianceMask, equal_rewards
from orchestrator.config.schema import PipelineConfig, RolloutConfig
from orchestrator.engines.simulated import ScriptedReplies, SimulatedEngine
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.pipeline.outcomes import GroupLedger, Outcome
from orchestrator.pipeline.pipeline import OnStep, Pipeline
from orchestrator.pipeline.sampler import TaskSampler
from orchestrator.staleness import StalenessController
from orchestrator.trace.recorder import Recorder, Span
from orchestrator.trainer.simulated import SimulatedTrainer, UniformCost

pytestmark = pytest.mark.anyio

SPEC = ArithmeticSpec(digits=2, train_size=200, eval_size=0, seed=0)
TASKS = {t.messages[0]["content"]: t for t in SPEC.tasks("train")}
PROBLEM = re.compile(r"\d+\+\d+=")
GROUP, BATCH = 2, 8  # 4 groups a step


def informative(task: Task) -> bool:
    return task.id % 2 == 0


def engine(signal: Callable[[Task], bool] = informative, version: int = 0) -> SimulatedEngine:
    """Replies that give a prompt for which ``signal`` holds one right and one wrong answer per
    group (rewards 1 and 0), and any other prompt the same reward on every sample (right when
    its id is 1 mod 4, else wrong); wrong answers of different lengths, so groups take
    different times."""
    calls: Counter[int] = Counter()

    def reply(prompt: list[int]) -> str:
        match = PROBLEM.search(TOK.decode(prompt))
        assert match is not None
        task = TASKS[match.group()]
        calls[task.id] += 1
        right = calls[task.id] % 2 == 0 if signal(task) else task.id % 4 == 1
        return task.answer if right else "x" * (1 + task.id % 7)

    return SimulatedEngine(ScriptedReplies(reply, TOK), seconds_per_token=1e-3, chunk_tokens=1,
                           version=version)


class RecordingSampler(TaskSampler):
    """The task sampler, remembering every task it handed out and every one settled."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(SPEC.tasks("train"), seed=seed)
        self.handed: list[int] = []
        self.settled: list[int] = []

    def next(self) -> Task:
        task = super().next()
        self.handed.append(task.id)
        return task

    def settle(self, task_id: int) -> None:
        super().settle(task_id)
        self.settled.append(task_id)


def trainer(version: int = 0, seed: int = 0) -> SimulatedTrainer:
    return SimulatedTrainer(UniformCost(0.002, 0.008, seed), record=True, version=version)


def make_pipeline(trainer: SimulatedTrainer, engine: SimulatedEngine,
                  group_filter: GroupFilter | None, *, k: int = 1, num_steps: int = 6,
                  sampler: TaskSampler | None = None, on_step: OnStep | None = None) -> Pipeline:
    config = PipelineConfig(batch_size=BATCH, max_staleness=k, num_workers=6, num_steps=num_steps)
    runner = EpisodeRunner(engine, TOK, SPEC, RolloutConfig(group_size=GROUP, max_tokens=16),
                           Recorder(clock=anyio.current_time))
    return Pipeline(config, runner, trainer, sampler or RecordingSampler(), on_step=on_step,
                    group_filter=group_filter)


def uncovered(span: Span, covers: Sequence[Span]) -> float:
    """Seconds of ``span`` during which none of ``covers`` is open."""
    cuts = sorted((max(c.start, span.start), min(c.end, span.end)) for c in covers
                  if c.start < span.end and span.start < c.end)
    idle, at = 0.0, span.start
    for start, end in cuts:
        idle += max(0.0, start - at)
        at = max(at, end)
    return idle + max(0.0, span.end - at)


def idle_while_waiting(pipeline: Pipeline) -> float:
    """Seconds the trainer waited for a batch while no group was being rolled out and no
    weights were being loaded: what a stalled admission looks like."""
    recorder = pipeline.recorder
    busy = [*recorder.of("rollout"), *recorder.of("weight_sync")]
    return sum(uncovered(w, busy) for w in recorder.of("wait_batch"))


def check_trained_within(trained: SimulatedTrainer, k: int) -> None:
    for version, batch in trained.batches or []:
        for group in batch:
            for t in group.trajectories:
                generated = [v for v, m in zip(t.versions, t.loss_mask, strict=True) if m]
                assert all(0 <= version - v <= k for v in generated)


# -- one call per group, its outcome deciding the bookkeeping ----------------------------------


@pytest.mark.parametrize("outcome", list(Outcome))
async def test_each_outcome_settles_the_task_and_frees_the_slot_as_its_table_says(
        outcome: Outcome) -> None:
    sampler = TaskSampler(SPEC.tasks("train"), seed=0)
    staleness = StalenessController(batch_size=4, max_staleness=1)
    ledger = GroupLedger(sampler, staleness, group_size=2)
    task = sampler.next()
    await staleness.admit(2)
    await ledger.retire(task.id, outcome, rewards=(1.0, 0.0))

    assert (task.id not in sampler.outstanding) is (outcome is not Outcome.UNFINISHED)
    kept = outcome in (Outcome.TRAINED, Outcome.MASKED)
    assert staleness.admitted == (2 if kept else 0)
    assert staleness.dropped == (2 if outcome is Outcome.STALE else 0)
    counts = ledger.take_counts()
    assert counts.metrics()[f"groups/{outcome.value}"] == 1.0
    assert sum(counts.metrics().values()) == 1.0
    assert counts.reward_mean(outcome) == 0.5
    assert ledger.take_counts().metrics()[f"groups/{outcome.value}"] == 0.0  # taken once


# -- dynamic sampling ------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 0, 3])
async def test_dynamic_sampling_refills_without_stalling_admission(k: int) -> None:
    trained = trainer()
    pipeline = make_pipeline(trained, engine(), DynamicSampling(), k=k)
    with anyio.fail_after(120):
        reports = await pipeline.run()

    assert [r.version for r in reports] == list(range(6)) and trained.version == 6
    assert trained.batches is not None
    for _, batch in trained.batches:  # full batches, each group with signal
        assert len(batch) == BATCH // GROUP
        assert all(informative(SPEC.tasks("train")[g.prompt_id]) for g in batch)
        assert not any(equal_rewards(g.rewards) for g in batch)
    for report in reports:
        assert all(0 <= s <= k for s in report.staleness)
        assert report.samples == BATCH
        assert report.metrics["filter/capped"] == 0.0
        assert report.metrics["filter/refills"] == report.metrics["groups/filtered"]
        assert report.metrics["groups/trained"] == BATCH // GROUP
    check_trained_within(trained, k)
    refills = sum(r.metrics["filter/refills"] for r in reports)
    assert refills >= 6  # about one prompt in two has no signal
    # the refills took the filtered groups' admission slots: the trainer never waited on an
    # idle engine, and admission never let more than its budget run
    assert idle_while_waiting(pipeline) == 0.0
    assert pipeline.staleness.admitted - BATCH * trained.version <= pipeline.config.budget


async def test_without_giving_filtered_slots_back_admission_stalls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: a filter that forgot to free the slots starves admission."""
    monkeypatch.setattr(Outcome, "frees_slot", property(
        lambda self: self in (Outcome.STALE, Outcome.EMPTY, Outcome.UNFINISHED)))
    pipeline = make_pipeline(trainer(), engine(), DynamicSampling())
    with pytest.raises(TimeoutError), anyio.fail_after(120):
        await pipeline.run()
    assert pipeline.step < 6


async def test_dynamic_sampling_stops_at_its_cap_and_trains_what_comes(
        caplog: pytest.LogCaptureFixture) -> None:
    """No prompt has signal: each step replaces at most a batch's worth of groups
    (max_refill_batches=1), then trains full batches of what comes, with one warning."""
    trained = trainer()
    pipeline = make_pipeline(trained, engine(signal=lambda task: False),
                             DynamicSampling(max_refill_batches=1))
    with caplog.at_level(logging.WARNING), anyio.fail_after(120):
        reports = await pipeline.run()

    assert [r.version for r in reports] == list(range(6))
    assert all(r.samples == BATCH for r in reports)
    assert reports[0].metrics["filter/capped"] == 1.0
    max_refills = BATCH // GROUP
    refills = [r.metrics["filter/refills"] for r in reports]
    assert 0 < sum(refills) <= max_refills * (len(reports) + 1)
    assert trained.batches is not None
    assert all(equal_rewards(g.rewards) for _, batch in trained.batches for g in batch)
    warnings = [r for r in caplog.records if "max_refill_batches" in r.getMessage()]
    assert len(warnings) == 1
    assert idle_while_waiting(pipeline) == 0.0


# -- zero-variance masking ---------------------------------------------------------------------


async def test_zero_variance_masking_leaves_groups_out_without_a_refill() -> None:
    trained = trainer()
    pipeline = make_pipeline(trained, engine(), ZeroVarianceMask())
    with anyio.fail_after(120):
        reports = await pipeline.run()

    assert trained.batches is not None and len(trained.batches) == 6
    for report, (_, batch) in zip(reports, trained.batches, strict=True):
        masked = report.metrics["groups/masked"]
        assert report.metrics["filter/refills"] == 0.0 and "filter/capped" not in report.metrics
        assert report.metrics["filter/filtered_groups"] == masked
        assert len(batch) + masked == BATCH // GROUP  # one batch formed, some of it left out
        assert report.samples == BATCH - GROUP * masked
        assert not any(equal_rewards(g.rewards) for g in batch)
        left_out = report.metrics.get("filter/filtered_reward_mean", 0.0) * masked * GROUP
        assert report.metrics["filter/unfiltered_reward_mean"] == pytest.approx(
            (sum(report.rewards) + left_out) / BATCH)  # what the batch would have had
    assert sum(r.metrics["groups/masked"] for r in reports) > 0
    # masked prompts are all right or all wrong: their mean reward is neither 0 nor 1 overall
    means = [r.metrics["filter/filtered_reward_mean"] for r in reports
             if "filter/filtered_reward_mean" in r.metrics]
    assert means and all(0.0 <= m <= 1.0 for m in means)
    check_trained_within(trained, 1)


async def test_a_batch_masked_whole_is_a_step_that_trains_nothing() -> None:
    trained = trainer()
    pipeline = make_pipeline(trained, engine(signal=lambda task: False), ZeroVarianceMask(),
                             num_steps=3)
    with anyio.fail_after(120):
        reports = await pipeline.run()
    assert [r.version for r in reports] == [0, 1, 2] and trained.version == 3
    assert trained.batches == [(0, []), (1, []), (2, [])]
    assert all(r.samples == 0 and r.metrics["groups/masked"] == BATCH // GROUP for r in reports)


# -- a crash after a checkpoint, then a resume -----------------------------------------------------


async def test_a_resume_neither_repeats_nor_skips_a_prompt_under_dynamic_sampling() -> None:
    """Run A is cut off after the checkpoint of step 2, as a SIGKILL would leave it (what it
    did afterwards is lost); run B resumes from that checkpoint to step 6. Every prompt of the
    pass is judged (trained, filtered, dropped) once: those A judged before the checkpoint are
    never handed out again, those in flight then are handed out again first, and the pass goes
    on where it was."""
    checkpoint: dict[str, Any] = {}
    first = RecordingSampler()
    trained_a = trainer()

    with anyio.CancelScope() as killed:
        def on_step(report: Any) -> None:
            if report.step == 2:  # the checkpoint, then the kill
                checkpoint.update(state=json.loads(json.dumps(pipeline_a.state_dict())),
                                  handed=list(first.handed), settled=list(first.settled),
                                  version=trained_a.version)
                killed.cancel()

        pipeline_a = make_pipeline(trained_a, engine(), DynamicSampling(), sampler=first,
                                   on_step=on_step)
        with anyio.fail_after(120):
            await pipeline_a.run()
    assert trained_a.batches is not None
    trained_before = [g.prompt_id for _, b in trained_a.batches[:3] for g in b]
    again = checkpoint["state"]["sampler"]["again"]
    assert again, "nothing was in flight at the checkpoint: the test would prove little"
    judged_before = checkpoint["settled"]
    assert len(judged_before) > len(trained_before)  # some were filtered before the checkpoint

    second = RecordingSampler(seed=999)  # the seed comes from the checkpoint
    trained_b = trainer(version=checkpoint["version"], seed=1)
    pipeline_b = make_pipeline(trained_b, engine(version=checkpoint["version"]),
                               DynamicSampling(), sampler=second)
    pipeline_b.load_state_dict(checkpoint["state"])
    with anyio.fail_after(120):
        reports = await pipeline_b.run()
    assert [r.step for r in reports] == [3, 4, 5]
    assert trained_b.batches is not None
    trained_after = [g.prompt_id for _, b in trained_b.batches for g in b]

    trained = trained_before + trained_after
    assert len(trained) == len(set(trained)) == 6 * BATCH // GROUP  # none trained twice
    judged = judged_before + second.settled
    assert len(judged) == len(set(judged)), "a prompt was judged twice"
    assert not set(judged_before) & set(second.handed), "a judged prompt was handed out again"
    assert second.handed[:len(again)] == again  # in flight at the checkpoint: first again
    unjudged = set(checkpoint["handed"]) - set(judged_before)
    assert unjudged == set(again), "a prompt in flight at the checkpoint was lost"
    # the pass goes on where it was: what the two handed out is what one run would have
    uninterrupted = TaskSampler(SPEC.tasks("train"), seed=0)
    handed = set(checkpoint["handed"]) | set(second.handed)
    assert handed == {uninterrupted.next().id for _ in range(len(handed))}
    assert sum(r.metrics["filter/refills"] for r in reports) > 0

