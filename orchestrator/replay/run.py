"""Replaying a PolyTrace workload through the run loop, in virtual time.

``python -m orchestrator experiment=replay trace=<dir>`` (:func:`replay_parts`) and
:func:`replay` from Python build :class:`~orchestrator.runloop.RunParts` and go through
:func:`~orchestrator.runloop.run_session`, the loop training runs in — staleness admission,
buffer, weight sync, recorder — with

* the workload's episodes (:mod:`envs.replay`): each trajectory's turns, token counts and
  tool calls, tools taking the recorded latency or one drawn from the search latency model
  (``replay.tool_latency=model``);
* :class:`~orchestrator.replay.engine.ReplayEngine`, the calibrated server model, with
  parameters fitted by ``python -m orchestrator.replay fit`` (the shipped fit of the
  published search_r1 steps 0-2 by default);
* :class:`~orchestrator.replay.trainer.SimulatedTrainer`, whose cost per token is set so that
  rollout is ``replay.rollout_share`` of a synchronous step (default 0.7: published systems
  report 50-80%, ROLL Flash, DORA — the search_r1 trace records no training time, so this is
  an assumption, logged with the results and written into ``summary.json``).

A replay has no warm start, evaluation or checkpoint. Its batch is ``replay.groups_per_step``
prompt groups of the trace's group size, its rollout shape (turns, lengths) comes from the
trace, and it adds its figures to the run's summary: virtual seconds, samples per second,
the engine's idle and the trainer's wait fractions (:class:`ReplayResult`).

Time is virtual: the run loop runs under trio with ``MockClock(autojump_threshold=0)``, which
jumps to the next timer whenever every task is waiting (:func:`run_virtual` for library use),
and the recorder reads ``anyio.current_time()``. A 2,048-trajectory step takes a few CPU
seconds whatever its simulated length. Nothing may block a thread in this mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import anyio
from omegaconf import DictConfig, OmegaConf

from envs.base import Task
from envs.replay import EpisodePlan, LatencyModel, ReplaySpec
from orchestrator.config import scalar, typed
from orchestrator.errors import ConfigError
from orchestrator.pipeline import PipelineConfig, StepReport, TaskSampler
from orchestrator.recorder import Recorder
from orchestrator.replay.engine import ReplayEngine
from orchestrator.replay.fit import EngineFit
from orchestrator.replay.plans import load_plans, open_trace
from orchestrator.replay.tokenizer import ReplayTokenizer
from orchestrator.rollout import RolloutConfig
from orchestrator.runloop import RunParts, RunResult, run_session
from orchestrator.weights import WeightUpdate

log = logging.getLogger(__name__)
ROLLOUT_SHARE_NOTE = (
    "assumption: the trace records no training time; the trainer cost model is calibrated so "
    "rollout is {share:.0%} of a synchronous step (published systems: 50-80%, ROLL Flash, DORA)")


@dataclass(frozen=True)
class ReplayConfig:
    """The ``replay`` section of ``conf/experiment/replay.yaml``."""

    engine: str | None = None  # an engine fit file; None: the shipped fit
    steps: list[int] | None = None  # trace steps replayed, in order; None: all
    groups_per_step: int | None = 256  # None: a step's recorded groups
    num_steps: int | None = None  # None: pipeline.num_steps
    rollout_share: float = 0.7
    tool_latency: Literal["trace", "model"] = "trace"
    sync_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.rollout_share < 1.0:
            raise ConfigError(f"replay.rollout_share={self.rollout_share} must be between 0 and 1")
        for key in ("groups_per_step", "num_steps"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"replay.{key} must be >= 1 or null, got {value}")
        if self.sync_seconds < 0:
            raise ConfigError(f"replay.sync_seconds must be >= 0, got {self.sync_seconds}")


@dataclass
class ReplayResult:
    """A replay's figures, on the run's (virtual) clock."""

    reports: list[StepReport]
    recorder: Recorder
    wall: float  # virtual seconds, engine start to the last step
    engine_busy: float
    trainer_busy: float
    samples: int
    rollout_share: float
    k: int

    @property
    def throughput(self) -> float:
        return self.samples / self.wall

    @property
    def engine_idle(self) -> float:
        return 1.0 - self.engine_busy / self.wall

    @property
    def trainer_wait(self) -> float:
        return self.recorder.seconds("wait_batch") / self.wall

    def summary(self) -> dict[str, Any]:
        return {"k": self.k, "steps": len(self.reports), "samples": self.samples,
                "virtual_seconds": self.wall, "samples_per_s": self.throughput,
                "engine_idle_fraction": self.engine_idle,
                "trainer_wait_fraction": self.trainer_wait,
                "dropped_stale": self.reports[-1].dropped_total if self.reports else 0,
                "rollout_share": self.rollout_share,
                "assumption": ROLLOUT_SHARE_NOTE.format(share=self.rollout_share)}


def replay_parts(cfg: DictConfig) -> RunParts:
    """The parts of ``experiment=replay``: the trace ``trace=`` names, played in virtual time."""
    settings = typed(ReplayConfig, cfg, "replay")
    for key in ("pipeline.batch_size", "pipeline.num_workers"):
        if OmegaConf.select(cfg, key) is not None:
            raise ConfigError(f"{key} is set by the replay from replay.groups_per_step and the "
                              f"trace's group size: leave it null")
    if OmegaConf.select(cfg, "rollout") is not None:
        raise ConfigError("a replay takes its rollout shape from the trace: set rollout=null")
    seed: int = scalar(cfg, "seed", int)
    trace = open_trace(scalar(cfg, "trace", str | None))
    plans, per_step = load_plans(trace, settings.steps, settings.groups_per_step, seed)
    parts, _ = replay_session(
        plans, EngineFit.load(settings.engine),
        k=scalar(cfg, "pipeline.max_staleness", int),
        num_steps=settings.num_steps or scalar(cfg, "pipeline.num_steps", int),
        groups_per_step=per_step, rollout_share=settings.rollout_share,
        tool_latency=settings.tool_latency, sync_seconds=settings.sync_seconds, seed=seed,
        inflight_update=scalar(cfg, "pipeline.inflight_update", Literal["continue", "finish"]),
        progress=scalar(cfg, "progress", bool), trace=str(trace.path))
    log.info(ROLLOUT_SHARE_NOTE.format(share=settings.rollout_share))
    return parts


async def replay(
    plans: Sequence[EpisodePlan],
    fit: EngineFit,
    k: int = 0,
    num_steps: int = 1,
    groups_per_step: int | None = None,
    rollout_share: float = 0.7,
    tool_latency: str = "trace",
    sync_seconds: float = 0.0,
    seed: int = 0,
    on_step: Callable[[StepReport], None] | None = None,
) -> ReplayResult:
    """Run ``plans`` through the run loop (under :func:`run_virtual` for virtual time)."""
    parts, measure = replay_session(plans, fit, k=k, num_steps=num_steps,
                                    groups_per_step=groups_per_step, rollout_share=rollout_share,
                                    tool_latency=tool_latency, sync_seconds=sync_seconds, seed=seed)
    result = RunResult(run_dir=None)
    await run_session(parts, result, on_step)
    return measure(result)


def replay_session(
    plans: Sequence[EpisodePlan],
    fit: EngineFit,
    *,
    k: int,
    num_steps: int,
    groups_per_step: int | None = None,
    rollout_share: float = 0.7,
    tool_latency: str = "trace",
    sync_seconds: float = 0.0,
    seed: int = 0,
    inflight_update: Literal["continue", "finish"] = "continue",
    progress: bool = False,
    trace: str | None = None,
) -> tuple[RunParts, Callable[[RunResult], ReplayResult]]:
    """The run parts of a replay of ``plans``, and what reads its figures once it has run."""
    from trio.testing import MockClock

    spec = ReplaySpec(plans, latency_model=_latency_model(tool_latency, seed))
    group_size = max(len(g) for g in spec.groups)
    if any(len(g) != group_size for g in spec.groups):
        raise ConfigError("every prompt group of a replayed trace must have the same size")
    groups = groups_per_step or len(spec.groups)
    trainer = fit.trainer(rollout_share)
    engines: list[ReplayEngine] = []

    def make_engine(update: WeightUpdate, recorder: Recorder) -> ReplayEngine:
        engines.append(ReplayEngine(spec.plans, fit.server, sync_seconds=sync_seconds,
                                    version=update.version))
        return engines[-1]

    def measure(result: RunResult) -> ReplayResult:
        (engine,) = engines
        assert result.recorder is not None, "measure() before the run"
        return ReplayResult(result.reports, result.recorder, result.wall, engine.busy_seconds,
                            trainer.busy, sum(r.samples for r in result.reports), rollout_share, k)

    def describe(result: RunResult) -> dict[str, Any]:
        figures = measure(result)
        log.info("replay: k=%d steps=%d samples=%d virtual_s=%.1f samples_per_s=%.2f "
                 "engine_idle=%.3f trainer_wait=%.3f", k, len(figures.reports), figures.samples,
                 figures.wall, figures.throughput, figures.engine_idle, figures.trainer_wait)
        return {**figures.summary(), **({"trace": trace} if trace else {})}

    parts = RunParts(
        spec=spec, tokenizer=ReplayTokenizer(), trainer=trainer, make_engine=make_engine,
        sampler=_InOrder(spec.tasks("train")),
        pipeline=PipelineConfig(batch_size=groups * group_size, max_staleness=k,
                                num_workers=(k + 1) * groups, num_steps=num_steps,
                                inflight_update=inflight_update),
        rollout=RolloutConfig(group_size=group_size,
                              max_tokens=max(t.completion_tokens for p in plans for t in p.turns),
                              temperature=1.0, max_turns=max(len(p.turns) for p in plans)),
        clock=anyio.current_time, progress=progress,
        anyio_backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)},
        describe=describe, keep_batches=True,  # the fidelity figures read the batches
    )
    return parts, measure


class _InOrder(TaskSampler):
    """Prompt groups in trace order, cycling: step after step of the recorded workload."""

    def __init__(self, tasks: Sequence[Task]) -> None:
        super().__init__(tasks)
        self._i = 0

    def next(self) -> Task:
        task = self._tasks[self._i % len(self._tasks)]
        self._i += 1
        return task


def _latency_model(mode: str, seed: int) -> LatencyModel | None:
    if mode == "trace":
        return None
    if mode == "model":
        from sandboxes.search.latency import TraceFaultModel

        return TraceFaultModel(seed=seed).sample
    raise ConfigError(f"replay.tool_latency={mode} must be 'trace' or 'model'")


def run_virtual(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under trio with a clock that jumps whenever all tasks wait."""
    from trio.testing import MockClock

    return anyio.run(partial(fn, *args, **kwargs), backend="trio",
                     backend_options={"clock": MockClock(autojump_threshold=0)})
