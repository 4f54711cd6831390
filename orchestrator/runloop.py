"""The run loop every run goes through, training and replay alike.

A builder (:func:`orchestrator.main.training_parts`, :func:`orchestrator.replay.replay_parts`)
turns a config into :class:`RunParts`; :func:`run_session` runs them in one event loop:

1. enter the environment's run-long resources (a sandbox pool, a search service);
2. build the engine once, from the trainer's current weights;
3. the warm start, if the parts have one (it checks greedy accuracy on that same engine);
4. a greedy evaluation, the RL pipeline with its progress bar, a second evaluation.

Every trained step goes to ``on_step`` (the run directory's writer) as it is reported, and
every ``checkpoint.every`` steps to a periodic checkpoint (:class:`Checkpointer`). A resumed
run (``parts.resume``) skips the warm start and the first evaluation, which were done, and
goes on from the checkpoint's step. SIGTERM or SIGINT ends the run after the step in
progress, with a checkpoint of it, in :class:`~orchestrator.errors.RunAborted`'s one line.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from envs.base import Clock, EnvSpec, Task
from orchestrator.checkpoint import CheckpointStore
from orchestrator.engines.base import InferenceEngine
from orchestrator.errors import ConfigError, RunAborted
from orchestrator.evaluate import evaluate
from orchestrator.loggers.progress import StepProgress
from orchestrator.models.tokenizer import Tokenizer
from orchestrator.pipeline import PeriodicEval, Pipeline, PipelineConfig, StepReport, TaskSampler
from orchestrator.recorder import Recorder
from orchestrator.resume import RunState, capture_rng
from orchestrator.rollout import RolloutConfig
from orchestrator.trainer.base import Trainer
from orchestrator.weights import WeightUpdate

log = logging.getLogger(__name__)

# (engine, recorder) -> supervised steps taken; runs before RL with the run's one engine
WarmStart = Callable[[InferenceEngine, Recorder], Awaitable[int]]


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 20  # steps between periodic checkpoints (0: none; a signal still writes one)
    keep: int = 2  # the newest periodic checkpoints kept (CheckpointStore checks it)

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"checkpoint.every must be >= 0, got {self.every}")


@dataclass
class Checkpointer:
    """The run's periodic checkpoints: every ``every`` steps, and when the run stops early.

    :meth:`capture` snapshots the run's state at the end of each step (cheap: the sampler's
    lists, the RNG states); :meth:`save` writes the trainer and that snapshot atomically.
    After a crash, :meth:`save_last` writes the last snapshot if the trainer still holds the
    weights it describes (a step that was cut short leaves them changed: then the previous
    periodic checkpoint is the one to resume from).
    """

    store: CheckpointStore
    every: int
    save_trainer: Callable[[Path], None]
    trainer: Trainer
    logger_run_id: Callable[[], str | None] = lambda: None
    last_saved: int = -1  # the step (``RunState.step``) of the newest checkpoint written
    _state: RunState | None = None
    _rng: dict[str, Any] = field(default_factory=dict)

    def capture(self, pipeline: Pipeline, result: RunResult, step: int) -> None:
        self._state = RunState(
            step=step, version=self.trainer.version, sampler=pipeline.sampler.state_dict(),
            dropped=pipeline.staleness.dropped, warm_start_steps=result.warm_start_steps,
            eval_before=result.eval_before, logger_run_id=self.logger_run_id())
        self._rng = capture_rng()

    def due(self) -> bool:
        return (self.every > 0 and self._state is not None
                and self._state.step % self.every == 0)

    async def save(self) -> Path | None:
        """The last snapshot, written (once) in a worker thread; its path, or None if no step
        has finished."""
        return await anyio.to_thread.run_sync(self._save_snapshot)

    def save_last(self) -> Path | None:
        """After a crash: the last snapshot, when the trainer is still at its version."""
        if self._state is None or self.trainer.version != self._state.version:
            return None
        return self._save_snapshot()

    def _save_snapshot(self) -> Path | None:
        state, rng = self._state, self._rng
        if state is None:
            return None
        if state.step == self.last_saved:
            return self.store.path(state.step)

        def write(directory: Path) -> None:
            self.save_trainer(directory)
            state.write(directory, rng)

        path = self.store.save(state.step, write)
        self.last_saved = state.step
        log.info("checkpoint: step %d at %s", state.step, path)
        return path


@dataclass
class RunParts:
    """What one run is made of, whoever built it."""

    spec: EnvSpec
    tokenizer: Tokenizer
    trainer: Trainer
    # (starting weights, the run's recorder) -> the engine; called once, in the event loop
    make_engine: Callable[[WeightUpdate, Recorder], InferenceEngine]
    sampler: TaskSampler
    pipeline: PipelineConfig
    rollout: RolloutConfig
    clock: Clock = time.perf_counter  # the recorder's, handed to the environment
    warm_start: WarmStart | None = None
    eval_tasks: Sequence[Task] = ()
    eval_every: int = 0  # steps between evaluations during RL (0: before and after only)
    progress: bool = False
    progress_every: float = 10.0  # seconds between progress lines when stdout is not a TTY
    save_checkpoint: Callable[[Path], None] | None = None
    anyio_backend: str = "asyncio"
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    # (result) -> extra summary entries: replay adds its virtual-time figures
    describe: Callable[[RunResult], dict[str, Any]] | None = None
    checkpoint: CheckpointConfig | None = None  # periodic checkpoints (with save_checkpoint)
    keep_batches: bool = False  # keep each report's trained groups in RunResult.reports
    resume: RunState | None = None  # the checkpoint a resumed run goes on from


@dataclass
class RunResult:
    run_dir: Path | None
    reports: list[StepReport] = field(default_factory=list)
    warm_start_steps: int = 0
    eval_before: float | None = None
    eval_after: float | None = None
    recorder: Recorder | None = None
    wall: float = 0.0  # seconds on the run's clock, engine start to the last step
    summary: dict[str, Any] = field(default_factory=dict)
    stopped_by: str | None = None  # the signal that ended the run early


async def load_into(engine: InferenceEngine, update: WeightUpdate) -> None:
    """Pause, load, resume, release: weight sync outside the pipeline (warm start, eval)."""
    await engine.pause()
    try:
        await engine.update_weights(update)
    finally:
        await engine.resume()
        update.release()


async def run_session(parts: RunParts, result: RunResult,
                      on_step: Callable[[StepReport], None] | None = None,
                      checkpointer: Checkpointer | None = None,
                      make_recorder: Callable[[Clock], Recorder] = Recorder) -> None:
    """Run ``parts``, filling ``result`` as it goes (so a failed run still reports); the
    recorder is ``make_recorder(parts.clock)`` (a run directory's streams to its spans file)."""
    recorder = make_recorder(parts.clock)
    result.recorder = recorder
    resume = parts.resume
    async with parts.spec.running():
        update = await parts.trainer.weights()
        engine = parts.make_engine(update, recorder)
        update.release()
        started = recorder.now()
        async with engine:
            if resume is not None:
                result.warm_start_steps, result.eval_before = resume.warm_start_steps, resume.eval_before
            else:
                if parts.warm_start is not None:
                    result.warm_start_steps = await parts.warm_start(engine, recorder)
                    await load_into(engine, await parts.trainer.weights())
                if parts.eval_tasks:
                    result.eval_before = await _evaluate(engine, parts, recorder)
                    log.info("eval before RL: %.3f", result.eval_before)
            async def step_done(report: StepReport) -> None:
                # The batch goes to on_step (the run directory) and is dropped here, unless the
                # parts need it afterwards (a replay's fidelity figures): memory stays bounded.
                result.reports.append(report if parts.keep_batches else replace(report, groups=()))
                if on_step is not None:
                    on_step(report)
                progress.update(report)
                if checkpointer is not None:
                    checkpointer.capture(pipeline, result, report.step + 1)
                    if checkpointer.due():
                        await checkpointer.save()

            start = resume.step if resume is not None else 0
            with StepProgress(parts.pipeline.num_steps, enabled=parts.progress,
                              completed=start, interval=parts.progress_every) as progress:
                pipeline = Pipeline(parts.pipeline, parts.rollout, engine, parts.trainer,
                                    parts.tokenizer, parts.spec, parts.sampler, recorder, step_done,
                                    start_step=start, dropped=resume.dropped if resume else 0,
                                    evaluation=PeriodicEval(
                                        parts.eval_every, partial(_evaluate, engine, parts, recorder),
                                    ) if parts.eval_every and parts.eval_tasks else None)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_stop_on_signal, pipeline, result, tg.cancel_scope)
                    await pipeline.run()
                    tg.cancel_scope.cancel()
            result.wall = recorder.now() - started
            if pipeline.stopped:
                saved = await checkpointer.save() if checkpointer is not None else None
                where = (f"resume from {saved} with: python -m orchestrator resume={saved.parent.parent}"
                         if saved is not None else "no step had finished: nothing to resume")
                raise RunAborted(f"stopped by {result.stopped_by} after "
                                 f"{start + len(result.reports)} steps; {where}")
            if parts.eval_tasks:
                result.eval_after = await _evaluate(engine, parts, recorder)
                log.info("eval after RL: %.3f", result.eval_after)


async def _stop_on_signal(pipeline: Pipeline, result: RunResult, scope: anyio.CancelScope) -> None:
    """The first SIGTERM/SIGINT ends the run after the step in progress; a second at once."""
    try:
        signals = anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT)
    except (NotImplementedError, ValueError):  # not the main thread: no signal handlers here
        return
    with signals as received:
        async for signum in received:
            if result.stopped_by is not None:
                scope.cancel()
                return
            result.stopped_by = signal.Signals(signum).name
            log.warning("%s: stopping after the step in progress (again to stop at once)",
                        result.stopped_by)
            pipeline.request_stop()


async def _evaluate(engine: InferenceEngine, parts: RunParts, recorder: Recorder) -> float:
    return await evaluate(engine, parts.tokenizer, parts.spec, parts.eval_tasks, parts.rollout,
                          recorder)


def summarise(result: RunResult) -> dict[str, Any]:
    reports = result.reports
    if not reports:
        return {}
    tenth = max(1, len(reports) // 10)
    first = sum(r.reward_mean for r in reports[:tenth]) / tenth
    last = sum(r.reward_mean for r in reports[-tenth:]) / tenth
    wall = sum(r.elapsed for r in reports)
    samples = sum(r.samples for r in reports)
    return {
        "steps": len(reports),
        "warm_start_steps": result.warm_start_steps,
        "reward_first_10pct": first,
        "reward_last_10pct": last,
        "eval_before": result.eval_before,
        "eval_after": result.eval_after,
        "dropped_stale": reports[-1].dropped_total,
        "samples_per_s": samples / max(wall, 1e-9),
        "rl_seconds": wall,
    }
