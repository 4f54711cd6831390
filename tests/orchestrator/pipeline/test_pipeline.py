"""The asynchronous pipeline (orchestrator/pipeline/pipeline.py) driven by the simulated engine and
the simulated trainer in virtual time: the staleness invariant, k = 0 alternation, drops, and
in-flight update modes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from helpers import peak_concurrency, virtual_time  # noqa: F401 - anyio_backend: virtual time

from envs.arithmetic import ArithmeticSpec
from orchestrator.config.schema import PipelineConfig, RolloutConfig
from orchestrator.engines.simulated import SimulatedEngine
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.errors import ConfigError
from orchestrator.models.tokenizer import CharTokenizer
from orchestrator.pipeline.pipeline import Pipeline, TaskSampler
from orchestrator.trace.recorder import Recorder, Span
from orchestrator.types import (
    FinishReason,
    Generation,
    Group,
    GroupTiming,
    SamplingParams,
    StepReport,
    TimedGroup,
    Trajectory,
)
from orchestrator.weights.update import WeightUpdate

pytestmark = pytest.mark.anyio

SPEC = ArithmeticSpec(digits=2, train_size=64, eval_size=4, seed=0)


def make_pipeline(
    trainer: Any,
    engine: SimulatedEngine,
    *,
    k: int,
    batch_size: int = 8,
    group_size: int = 2,
    num_workers: int = 8,
    num_steps: int = 6,
    max_tokens: int = 64,
    inflight_update: str = "continue",
    overprovision: float | None = None,
) -> Pipeline:
    config = PipelineConfig(
        batch_size=batch_size, max_staleness=k, num_workers=num_workers, num_steps=num_steps,
        inflight_update=inflight_update,  # type: ignore[arg-type]
        overprovision=overprovision,
    )
    rollout = RolloutConfig(group_size=group_size, max_tokens=max_tokens)
    runner = EpisodeRunner(engine, CharTokenizer(), SPEC, rollout,
                           Recorder(clock=anyio.current_time))
    return Pipeline(config, runner, trainer, TaskSampler(SPEC.tasks("train"), seed=0))


def overlaps(a: Span, b: Span) -> bool:
    return a.start < b.end and b.start < a.end


def overlap_seconds(generate: Sequence[Span], train: Sequence[Span]) -> float:
    return sum(max(0.0, min(g.end, t.end) - max(g.start, t.start))
               for g in generate for t in train)


def trained_trajectories(trainer: Any) -> list[tuple[int, Trajectory]]:
    return [(version, t) for version, batch in trainer.batches for g in batch for t in g.trajectories]


# -- the staleness invariant -----------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 2, 4])
async def test_staleness_is_bounded_by_k(k: int, fake_trainer_cls: Any) -> None:
    trainer = fake_trainer_cls(min_s=0.001, max_s=0.006, seed=k)
    engine = SimulatedEngine(median_tokens=16, sigma=1.2, seconds_per_token=2e-4,
                             chunk_tokens=8, seed=k)
    pipeline = make_pipeline(trainer, engine, k=k, num_steps=8)
    with anyio.fail_after(60):
        reports = await pipeline.run()

    assert [r.step for r in reports] == list(range(8))
    assert [r.version for r in reports] == list(range(8))
    assert trainer.version == 8
    for report in reports:
        assert report.samples == 8
        assert len(report.start_versions) == len(report.staleness) == 8
        for start, stale in zip(report.start_versions, report.staleness, strict=True):
            assert stale == report.version - start
            assert 0 <= report.version - start <= k
    # the trainer really got what the reports describe
    for version, trajectory in trained_trajectories(trainer):
        assert 0 <= version - trajectory.start_version <= k
        generated = [v for v, m in zip(trajectory.versions, trajectory.loss_mask, strict=True) if m]
        assert generated and generated[0] == trajectory.start_version
        assert all(0 <= version - v <= k for v in generated)

    generate = pipeline.recorder.of("generate")
    train = pipeline.recorder.of("train_step")
    assert len(train) == 8 and generate
    if k == 0:
        clashes = [(g, t) for g in generate for t in train if overlaps(g, t)]
        assert clashes == [], "with k = 0 generation and training must alternate"
        assert max(r.version - s for r in reports for s in r.start_versions) == 0
    else:
        assert overlap_seconds(generate, train) > 0, "with k >= 1 rollout must overlap training"


async def test_k0_and_k1_differ_in_overlap_on_the_same_workload(fake_trainer_cls: Any) -> None:
    """The k = 0 check above can fail: the same workload with k = 1 does overlap, and
    samples one step stale are trained on."""
    seen: dict[int, tuple[float, int]] = {}
    for k in (0, 1):
        trainer = fake_trainer_cls(min_s=0.004, max_s=0.008, seed=1)
        engine = SimulatedEngine(median_tokens=24, sigma=0.8, seconds_per_token=3e-4,
                                 chunk_tokens=4, seed=1)
        pipeline = make_pipeline(trainer, engine, k=k, num_steps=6)
        with anyio.fail_after(60):
            reports = await pipeline.run()
        seen[k] = (
            overlap_seconds(pipeline.recorder.of("generate"), pipeline.recorder.of("train_step")),
            max(s for r in reports for s in r.staleness),
        )
    assert seen[0] == (0.0, 0)
    assert seen[1][0] > 0.0
    assert seen[1][1] == 1


async def test_spans_of_every_stage_are_recorded(fake_trainer_cls: Any) -> None:
    trainer = fake_trainer_cls()
    engine = SimulatedEngine(median_tokens=8, seconds_per_token=1e-4, seed=3)
    pipeline = make_pipeline(trainer, engine, k=1, num_steps=3)
    with anyio.fail_after(60):
        reports = await pipeline.run()
    stages = {s.stage for s in pipeline.recorder.spans}
    assert {"generate", "reward", "train_step", "weight_sync", "wait_batch",
            "wait_admission", "rollout"} <= stages
    assert len(pipeline.recorder.of("weight_sync")) == 3
    for span in pipeline.recorder.spans:
        assert span.end >= span.start
    assert all(r.elapsed > 0 for r in reports)
    assert all("train_step" in r.stage_seconds for r in reports)
    # the engine ends on the weights of the last step
    assert engine.version == 3


async def test_a_step_reports_the_spans_recorded_during_it_whatever_their_times(
        fake_trainer_cls: Any) -> None:
    """Spans that arrive late with their own, earlier times (a Ray actor's, forwarded after
    the fact; a tool call's, added when it returns) count in the step they arrive in, and the
    spans before the run (a warm start) in none."""
    trainer = fake_trainer_cls()
    pipeline = make_pipeline(trainer, SimulatedEngine(median_tokens=8, seed=3), k=1, num_steps=3)
    recorder = pipeline.recorder
    recorder.add("warm_start", "trainer", 0.0, 5.0, 0)
    seen: list[StepReport] = []

    def on_step(report: StepReport) -> None:
        seen.append(report)
        # arrives now, timed long before: the next step's report must have it
        end = recorder.now() - 100.0
        recorder.add("engine_step", "node-1/engine-0", end - 0.25 * len(seen), end, 0)

    pipeline.on_step = on_step
    with anyio.fail_after(60):
        await pipeline.run()
    assert "warm_start" not in seen[0].stage_seconds
    assert "engine_step" not in seen[0].stage_seconds
    assert seen[1].stage_seconds["engine_step"] == pytest.approx(0.25)
    assert seen[2].stage_seconds["engine_step"] == pytest.approx(0.5)
    assert all(r.stage_seconds["generate"] > 0 for r in seen)


async def test_on_step_is_called_once_per_step(fake_trainer_cls: Any) -> None:
    trainer = fake_trainer_cls()
    engine = SimulatedEngine(median_tokens=8, seconds_per_token=1e-4, seed=4)
    pipeline = make_pipeline(trainer, engine, k=1, num_steps=4)
    seen: list[StepReport] = []

    async def on_step(report: StepReport) -> None:
        await anyio.lowlevel.checkpoint()
        seen.append(report)

    pipeline.on_step = on_step
    with anyio.fail_after(60):
        reports = await pipeline.run()
    assert len(seen) == 4 and all(r.groups for r in seen)  # on_step gets each batch
    # the pipeline keeps its reports without their batches (memory stays bounded)
    assert [replace(r, groups=(), timings=()) for r in seen] == reports


# -- drops -----------------------------------------------------------------------------------


class OneSlowGroupEngine(SimulatedEngine):
    """Generates normally, but the first prompt it ever sees is held back after generation
    (its tokens stamped with version 0) until the engine serves version ``release_at``."""

    def __init__(self, release_at: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.release_at = release_at
        self.slow_prompt: tuple[int, ...] | None = None
        self._released = anyio.Event()

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        if self.slow_prompt is None:
            self.slow_prompt = tuple(prompt_ids)
        gen = await super().generate(prompt_ids, sampling)
        if tuple(prompt_ids) == self.slow_prompt and gen.start_version == 0:
            await self._released.wait()
        return gen

    async def update_weights(self, update: WeightUpdate) -> None:
        await super().update_weights(update)
        if update.version >= self.release_at:
            self._released.set()


async def test_a_group_that_comes_back_too_late_is_dropped_and_counted(fake_trainer_cls: Any) -> None:
    k = 1
    trainer = fake_trainer_cls(min_s=0.001, max_s=0.002)
    engine = OneSlowGroupEngine(release_at=k + 1, median_tokens=8, sigma=0.5,
                                seconds_per_token=1e-4, seed=5)
    pipeline = make_pipeline(trainer, engine, k=k, num_steps=10, group_size=2, batch_size=4,
                             num_workers=4)
    with anyio.fail_after(60):
        reports = await pipeline.run()
    slow = engine.slow_prompt
    assert slow is not None
    # the slow group's two samples at least (others may age out too on a busy machine)
    dropped = pipeline.staleness.dropped
    assert dropped >= 2 and dropped % 2 == 0
    assert reports[-1].dropped_total == dropped
    assert not [t for _, t in trained_trajectories(trainer)
                if t.token_ids[: len(slow)] == slow and t.start_version == 0]
    totals = [r.dropped_total for r in reports]
    assert totals == sorted(totals) and totals[0] == 0
    for report in reports:
        assert all(0 <= s <= k for s in report.staleness)


def _group(prompt_id: int, start_version: int, size: int = 2) -> TimedGroup:
    trajectories = tuple(
        Trajectory(prompt_id=prompt_id, sample_index=i, token_ids=(1, 10, 11),
                   loss_mask=(False, True, True), logprobs=(0.0, -1.0, -1.0),
                   versions=(-1, start_version, start_version), reward=float(i),
                   start_version=start_version, finish_reason=FinishReason.LENGTH)
        for i in range(size)
    )
    return TimedGroup(Group(prompt_id, trajectories, start_version), GroupTiming(0.0, 0.0, ()))


async def test_next_batch_drops_stale_groups_and_gives_back_their_slots(fake_trainer_cls: Any) -> None:
    trainer = fake_trainer_cls()
    pipeline = make_pipeline(trainer, SimulatedEngine(), k=1, batch_size=4, group_size=2)
    ctl = pipeline.staleness
    await ctl.set_version(2)  # capacity (2 + 1 + 1) * 4 = 16
    groups = [_group(0, 0), _group(1, 1), _group(2, 2), _group(3, 0), _group(4, 2), _group(5, 3)]
    for g in groups:
        await ctl.admit(len(g))
    assert ctl.admitted == 12
    send, receive = anyio.create_memory_object_stream[TimedGroup](10)
    async with send, receive:
        for g in groups:
            send.send_nowait(g)
        pending: list[TimedGroup] = []
        with anyio.fail_after(5):
            batch = await pipeline._next_batch(receive, pending, 2, version=2)
        # group 0 started at version 0, older than 2 - 1: dropped, its slots given back
        assert [g.prompt_id for g in batch] == [1, 2]
        assert ctl.dropped == 2 and ctl.admitted == 10
        with anyio.fail_after(5):
            batch = await pipeline._next_batch(receive, pending, 2, version=3)
        # at version 3 nothing started before version 2 is fresh: group 3 (v0) dropped
        assert [g.prompt_id for g in batch] == [4, 5]
        assert ctl.dropped == 4 and ctl.admitted == 8
        assert pending == []


class _HangsOnce(ArithmeticSpec):
    """Arithmetic whose first scored reply never gets its reward (a verification that hangs)."""

    hung: int | None = None

    def make_env(self) -> Any:
        env = super().make_env()
        score, spec = env.score, self

        async def maybe_hang(task: Any, reply: str) -> Any:
            if spec.hung in (None, task.id):
                spec.hung = task.id
                await anyio.sleep_forever()
            return await score(task, reply)

        env.score = maybe_hang
        return env


async def test_a_group_whose_scoring_hangs_frees_its_worker_and_retires_stale(
        fake_trainer_cls: Any) -> None:
    """One rollout worker and a reward that never returns: the worker goes on once the group
    is generated, and the group is dropped as stale when it can no longer be trained."""
    spec = _HangsOnce(digits=2, train_size=64, eval_size=4, seed=0)
    trainer = fake_trainer_cls()
    pipeline = make_pipeline(trainer, SimulatedEngine(seed=2), k=1, batch_size=4, group_size=2,
                             num_workers=1, num_steps=5)
    pipeline.runner = replace(pipeline.runner, spec=spec)
    with anyio.fail_after(60):
        reports = await pipeline.run()
    assert len(reports) == 5 and spec.hung is not None
    trained = {g.prompt_id for _, batch in trainer.batches for g in batch}
    assert spec.hung not in trained
    assert pipeline.staleness.dropped == 2  # the hung group, retired as stale
    assert sum(r.metrics.get("groups/stale", 0) for r in reports) == 1
    lanes = {s.worker for s in pipeline.recorder.of("rollout")}
    assert {"rollout-0", "rollout-1"} <= lanes  # the next groups went on beside the hung one


async def test_next_batch_rechecks_pending_groups_at_the_new_version(fake_trainer_cls: Any) -> None:
    trainer = fake_trainer_cls()
    pipeline = make_pipeline(trainer, SimulatedEngine(), k=0, batch_size=4, group_size=2)
    ctl = pipeline.staleness
    for _ in range(2):
        await ctl.admit(2)
    send, receive = anyio.create_memory_object_stream[TimedGroup](10)
    async with send, receive:
        pending = [_group(7, 0)]  # left over from the previous batch, now one version old
        send.send_nowait(_group(8, 1))
        send.send_nowait(_group(9, 1))
        with anyio.fail_after(5):
            batch = await pipeline._next_batch(receive, pending, 2, version=1)
    assert [g.prompt_id for g in batch] == [8, 9]
    assert ctl.dropped == 2 and ctl.admitted == 2


async def test_next_batch_takes_the_oldest_groups_first(fake_trainer_cls: Any) -> None:
    trainer = fake_trainer_cls()
    pipeline = make_pipeline(trainer, SimulatedEngine(), k=2, batch_size=4, group_size=2)
    ctl = pipeline.staleness
    await ctl.set_version(2)
    send, receive = anyio.create_memory_object_stream[TimedGroup](10)
    async with send, receive:
        # a slow group started at version 0 arrives after newer ones that were left over
        pending = [_group(1, 2), _group(2, 1), _group(3, 1)]
        for g in pending:
            await ctl.admit(len(g))
        await ctl.admit(2)
        send.send_nowait(_group(4, 0))
        with anyio.fail_after(5):
            batch = await pipeline._next_batch(receive, pending, 4, version=2)
    assert [g.prompt_id for g in batch] == [4, 2, 3, 1]  # oldest first; ties keep arrival order
    assert pending == []
    # more left over than a batch needs: the newest wait for the next step
    pending = [_group(5, 2), _group(6, 1), _group(7, 0)]
    with anyio.fail_after(5):
        batch = await pipeline._next_batch(receive, pending, 2, version=2)
    assert [g.prompt_id for g in batch] == [7, 6]
    assert [g.prompt_id for g in pending] == [5]
    assert ctl.dropped == 0


# -- in-flight weight updates --------------------------------------------------------------


def _generated_versions(t: Trajectory) -> list[int]:
    return [v for v, m in zip(t.versions, t.loss_mask, strict=True) if m]


async def run_inflight(fake_trainer_cls: Any, mode: str) -> tuple[Any, list]:
    """Long generations and a fast trainer, so weight updates land mid-episode."""
    trainer = fake_trainer_cls(min_s=0.0005, max_s=0.001)
    engine = SimulatedEngine(median_tokens=100, sigma=0.5, seconds_per_token=1e-4,
                             chunk_tokens=4, seed=7)
    pipeline = make_pipeline(trainer, engine, k=2, num_steps=8, max_tokens=200,
                             inflight_update=mode)
    with anyio.fail_after(60):
        await pipeline.run()
    return pipeline, trained_trajectories(trainer)


async def test_finish_mode_never_lets_an_episode_span_two_versions(fake_trainer_cls: Any) -> None:
    pipeline, trained = await run_inflight(fake_trainer_cls, "finish")
    assert len(trained) == 8 * 8
    for _, t in trained:
        versions = set(_generated_versions(t))
        assert versions == {t.start_version}, f"episode spans versions {sorted(versions)}"
    assert len(pipeline.recorder.of("wait_inflight")) == 8


async def test_continue_mode_lets_long_episodes_cross_a_weight_update(fake_trainer_cls: Any) -> None:
    _, trained = await run_inflight(fake_trainer_cls, "continue")
    crossing = [t for _, t in trained if len(set(_generated_versions(t))) > 1]
    assert crossing, "no episode continued under new weights"
    for t in crossing:
        versions = _generated_versions(t)
        assert versions == sorted(versions)  # versions only go up within an episode
        assert versions[0] == t.start_version
        assert t.end_version == versions[-1] > t.start_version


# -- partial rollout (pipeline.overprovision) -------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4])
async def test_partial_rollout_carries_long_samples_and_keeps_every_trained_token_fresh(
        k: int, fake_trainer_cls: Any) -> None:
    trainer = fake_trainer_cls(min_s=0.0005, max_s=0.001, seed=k)
    engine = SimulatedEngine(median_tokens=40, sigma=1.0, seconds_per_token=1e-4,
                             chunk_tokens=4, seed=k)
    pipeline = make_pipeline(trainer, engine, k=k, num_steps=8, max_tokens=400, num_workers=16,
                             overprovision=0.5)
    with anyio.fail_after(60):
        reports = await pipeline.run()

    assert [r.step for r in reports] == list(range(8)) and all(r.samples == 8 for r in reports)
    # Admission: 1.5 batches (6 groups of 2) in flight at most, though k and the workers allow more.
    assert pipeline.staleness.budget == 12
    assert peak_concurrency(pipeline.recorder.of("rollout")) <= 6
    trained = trained_trajectories(trainer)
    for version, t in trained:  # every trained token's version is within k of the trainer's
        generated = _generated_versions(t)
        assert generated[0] == t.start_version and generated == sorted(generated)
        assert all(version - k <= v <= version for v in generated)
    for report in reports:
        assert all(0 <= s <= k for s in report.staleness)
    # Unfinished samples were carried into later steps and went on under the new weights.
    assert any(s >= 1 for r in reports for s in r.staleness)
    assert any(len(set(_generated_versions(t))) > 1 for _, t in trained)


async def test_partial_rollout_runs_fewer_groups_at_once_than_its_staleness_bound_allows(
        fake_trainer_cls: Any) -> None:
    peaks = {}
    for overprovision in (None, 0.5):
        trainer = fake_trainer_cls(min_s=0.002, max_s=0.004, seed=3)
        engine = SimulatedEngine(median_tokens=40, sigma=1.0, seconds_per_token=1e-4,
                                 chunk_tokens=4, seed=3)
        pipeline = make_pipeline(trainer, engine, k=2, num_steps=6, max_tokens=400,
                                 num_workers=16, overprovision=overprovision)
        with anyio.fail_after(60):
            await pipeline.run()
        peaks[overprovision] = peak_concurrency(pipeline.recorder.of("rollout"))
    assert peaks[0.5] <= 6 < peaks[None] <= 12  # (1 + 0.5) x 4 groups against (k + 1) x 4


def test_the_admission_budget_and_the_policy_name() -> None:
    assert PipelineConfig(batch_size=8, max_staleness=2).budget == 24
    partial = PipelineConfig(batch_size=8, max_staleness=4, overprovision=0.5)
    assert partial.budget == 12 and partial.describe() == "partial+0.5B k=4"
    assert PipelineConfig(batch_size=8, max_staleness=1, overprovision=0.0).budget == 8
    assert PipelineConfig(max_staleness=0).describe() == "sync"
    assert PipelineConfig(max_staleness=2).describe() == "k=2"


# -- config and sampler --------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "group_size", "key"), [
    ({"max_staleness": -1}, 2, "max_staleness"),
    ({"batch_size": 6}, 4, "batch_size"),
    ({"batch_size": 0}, 2, "batch_size"),
    ({"num_workers": 0}, 2, "num_workers"),
    ({"num_steps": 0}, 2, "num_steps"),
    ({"inflight_update": "later"}, 2, "inflight_update"),
    ({"overprovision": -0.5}, 2, "overprovision"),
    ({"overprovision": 1.0, "max_staleness": 0}, 2, "max_staleness >= 1"),
])
def test_pipeline_config_rejects_bad_values(kwargs: dict[str, Any], group_size: int, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        PipelineConfig(**kwargs).check_group_size(group_size)


def test_task_sampler_visits_every_task_once_per_pass() -> None:
    tasks = SPEC.tasks("train")[:10]
    sampler = TaskSampler(tasks, seed=1)
    first = [sampler.next().id for _ in range(10)]
    second = [sampler.next().id for _ in range(10)]
    assert sorted(first) == sorted(second) == sorted(t.id for t in tasks)
    again = TaskSampler(tasks, seed=1)
    assert [again.next().id for _ in range(10)] == first


def test_task_sampler_rejects_an_empty_split() -> None:
    with pytest.raises(ConfigError):
        TaskSampler([])
