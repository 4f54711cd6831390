"""The run loop every run goes through, training and replay alike.

A builder (:func:`orchestrator.main.training_parts`, :func:`orchestrator.replay.replay_parts`)
turns a config into :class:`RunParts`; :func:`run_session` runs them in one event loop:

1. enter the environment's run-long resources (a sandbox pool, a search service);
2. build the engine once, from the trainer's current weights;
3. the warm start, if the parts have one (it checks greedy accuracy on that same engine);
4. a greedy evaluation, the RL pipeline with its progress bar, a second evaluation.

Every trained step goes to ``on_step`` (the run directory's writer) as it is reported.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envs.base import Clock, EnvSpec, Task
from orchestrator.engines.base import InferenceEngine
from orchestrator.evaluate import evaluate
from orchestrator.loggers.progress import StepProgress
from orchestrator.models.tokenizer import Tokenizer
from orchestrator.pipeline import Pipeline, PipelineConfig, StepReport, TaskSampler
from orchestrator.recorder import Recorder
from orchestrator.rollout import RolloutConfig
from orchestrator.trainer.base import Trainer
from orchestrator.weights import WeightUpdate

log = logging.getLogger(__name__)

# (engine, recorder) -> supervised steps taken; runs before RL with the run's one engine
WarmStart = Callable[[InferenceEngine, Recorder], Awaitable[int]]


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
    progress: bool = False
    save_checkpoint: Callable[[Path], None] | None = None
    anyio_backend: str = "asyncio"
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    # (result) -> extra summary entries: replay adds its virtual-time figures
    describe: Callable[[RunResult], dict[str, Any]] | None = None


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


async def load_into(engine: InferenceEngine, update: WeightUpdate) -> None:
    """Pause, load, resume, release: weight sync outside the pipeline (warm start, eval)."""
    await engine.pause()
    try:
        await engine.update_weights(update)
    finally:
        await engine.resume()
        update.release()


async def run_session(parts: RunParts, result: RunResult,
                      on_step: Callable[[StepReport], None] | None = None) -> None:
    """Run ``parts``, filling ``result`` as it goes (so a failed run still reports)."""
    recorder = Recorder(clock=parts.clock)
    result.recorder = recorder
    async with parts.spec.running():
        update = await parts.trainer.weights()
        engine = parts.make_engine(update, recorder)
        update.release()
        started = recorder.now()
        async with engine:
            if parts.warm_start is not None:
                result.warm_start_steps = await parts.warm_start(engine, recorder)
                await load_into(engine, await parts.trainer.weights())
            if parts.eval_tasks:
                result.eval_before = await _evaluate(engine, parts, recorder)
                log.info("eval before RL: %.3f", result.eval_before)

            def step_done(report: StepReport) -> None:
                result.reports.append(report)
                if on_step is not None:
                    on_step(report)
                progress.update(report)

            with StepProgress(parts.pipeline.num_steps, enabled=parts.progress) as progress:
                pipeline = Pipeline(parts.pipeline, parts.rollout, engine, parts.trainer,
                                    parts.tokenizer, parts.spec, parts.sampler, recorder, step_done)
                await pipeline.run()
            result.wall = recorder.now() - started
            if parts.eval_tasks:
                result.eval_after = await _evaluate(engine, parts, recorder)
                log.info("eval after RL: %.3f", result.eval_after)


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
