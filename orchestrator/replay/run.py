"""Replaying a PolyTrace workload through the run loop, in virtual time.

``python -m orchestrator experiment=replay trace=<dir>`` (:func:`replay_parts`) and
:func:`replay` from Python build :class:`~orchestrator.run.loop.RunParts` and go through
:func:`~orchestrator.run.loop.run_session`, the loop training runs in — staleness admission,
buffer, weight sync, recorder — with

* the workload's episodes (:mod:`envs.replay`): each trajectory's turns, token counts and
  tool calls, tools taking the recorded latency or one drawn from the search latency model
  (``replay.tool_latency=model``);
* the simulated engine running the calibrated server model
  (:func:`~orchestrator.replay.engine.replay_engine`), with parameters fitted by
  ``python -m orchestrator.replay fit`` (the shipped fit of the published search_r1 steps 0-2
  by default); ``replay.engines=E`` runs ``E`` replicas of it behind the
  :class:`~orchestrator.engines.router.EngineRouter` (``replay.routing``, ``replay.sticky``:
  an episode's later turns on the replica of its first), so a 64-engine deployment replays
  on one core;
* :class:`~orchestrator.trainer.simulated.SimulatedTrainer`, priced by :class:`TrainerModel`:
  by default its cost per token is set so that rollout is ``replay.rollout_share`` of a
  synchronous step (0.7: published systems report 50-80%, ROLL Flash, DORA — the search_r1
  trace records no training time, so this is an assumption, logged with the results and
  written into ``summary.json``); ``replay.trainer_s`` (and ``replay.trainer_s_per_1k_tokens``)
  set a step's seconds directly, ``a + b * tokens / 1000``.

The scheduling policy is the pipeline's own (``pipeline.max_staleness``,
``pipeline.overprovision``), so a replay compares policies on the code that trains.

A replay has no warm start, evaluation or checkpoint. Its batch is ``replay.groups_per_step``
prompt groups of the trace's group size, its rollout shape (turns, lengths) comes from the
trace, and it adds its figures to the run's summary: virtual seconds, samples per second,
the engines' idle and the trainer's wait fractions (:class:`ReplayResult`; :meth:`ReplayResult.window`
for a steady-state window). Runs repeat exactly: trio's random task order is seeded
(:func:`reproducible_scheduling`).

Time is virtual: the run loop runs under trio with ``MockClock(autojump_threshold=0)``, which
jumps to the next timer whenever every task is waiting (:func:`run_virtual` for library use),
and the recorder reads ``anyio.current_time()``. A 2,048-trajectory step takes a few CPU
seconds whatever its simulated length. Nothing may block a thread in this mode.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal

import anyio
from omegaconf import DictConfig, OmegaConf

from envs.base import Task
from envs.replay import EpisodePlan, LatencyModel, ReplaySpec
from orchestrator.config.read import scalar, typed
from orchestrator.config.schema import PipelineConfig, ReplayConfig, RolloutConfig
from orchestrator.engines.base import InferenceEngine
from orchestrator.errors import ConfigError
from orchestrator.pipeline.sampler import TaskSampler
from orchestrator.replay.engine import busy_seconds, replay_engine, replay_router
from orchestrator.replay.fit import EngineFit
from orchestrator.replay.plans import load_plans, open_trace
from orchestrator.replay.tokenizer import ReplayTokenizer
from orchestrator.run.loop import RunParts, RunResult, run_session
from orchestrator.trace.recorder import Recorder
from orchestrator.trainer.simulated import SimulatedTrainer, TokenCost
from orchestrator.types import StepReport
from orchestrator.weights.update import WeightUpdate

log = logging.getLogger(__name__)
ROLLOUT_SHARE_NOTE = (
    "assumption: the trace records no training time; the trainer cost model is calibrated so "
    "rollout is {share:.0%} of a synchronous step (published systems: 50-80%, ROLL Flash, DORA)")


@dataclass(frozen=True)
class TrainerModel:
    """The simulated trainer's cost: ``fixed_s + per_1k_tokens * tokens / 1000`` seconds a
    step, ``tokens`` the batch's prompt and response tokens (what a forward and backward pass
    processes). :meth:`from_share` calibrates it on an engine fit (``replay.rollout_share``);
    ``replay.trainer_s`` / ``replay.trainer_s_per_1k_tokens`` set it directly."""

    fixed_s: float = 0.0
    per_1k_tokens: float = 0.0
    rollout_share: float | None = None  # set when calibrated on a fit

    @classmethod
    def of(cls, settings: ReplayConfig, fit: EngineFit) -> TrainerModel:
        """The trainer ``settings`` describe: ``replay.trainer_s`` if set, else calibrated on
        ``fit`` by ``replay.rollout_share``."""
        if settings.trainer_s is None:
            return cls.from_share(fit, settings.rollout_share)
        return cls(settings.trainer_s, settings.trainer_s_per_1k_tokens)

    @classmethod
    def from_share(cls, fit: EngineFit, rollout_share: float) -> TrainerModel:
        return cls(0.0, fit.train_cost(rollout_share).per_token_s * 1000.0, rollout_share)

    def build(self) -> SimulatedTrainer:
        return SimulatedTrainer(TokenCost(self.fixed_s, self.per_1k_tokens / 1000.0))

    def seconds(self, tokens: float) -> float:
        return self.fixed_s + self.per_1k_tokens * tokens / 1000.0

    def describe(self) -> str:
        if self.rollout_share is not None:
            return ROLLOUT_SHARE_NOTE.format(share=self.rollout_share)
        return (f"trainer cost model: {self.fixed_s:g} s + {self.per_1k_tokens:g} s per 1k "
                f"batch tokens a step (replay.trainer_s, replay.trainer_s_per_1k_tokens)")


@dataclass(frozen=True)
class Window:
    samples_per_s: float
    engine_idle: float  # share of replica-seconds spent neither prefilling nor decoding
    trainer_wait: float  # share of the window the trainer waited for a batch
    seconds: float
    samples: int


@dataclass
class ReplayResult:
    """A replay's figures, on the run's (virtual) clock."""

    reports: list[StepReport]
    recorder: Recorder
    wall: float  # virtual seconds, engine start to the last step
    engine_busy: float  # summed over the replicas
    trainer_busy: float
    samples: int
    trainer: TrainerModel
    k: int
    engines: int = 1
    policy: str = ""  # the pipeline's scheduling policy, as PipelineConfig.describe() says

    @property
    def rollout_share(self) -> float | None:
        return self.trainer.rollout_share

    @property
    def throughput(self) -> float:
        return self.samples / self.wall

    @property
    def engine_idle(self) -> float:
        """The share of replica-seconds no replica spent prefilling or decoding."""
        return 1.0 - self.engine_busy / (self.wall * self.engines)

    @property
    def trainer_wait(self) -> float:
        return self.recorder.seconds("wait_batch") / self.wall

    def window(self, skip: int) -> Window:
        """The figures of the steps after the first ``skip``: steady state, once the run's
        start (the first batches filling empty engines) is behind it. Reads the spans the
        recorder holds: every span of a replay run from Python (:func:`replay`)."""
        later = self.reports[skip:]
        if not later:
            raise ValueError(f"a run of {len(self.reports)} steps has none after the first {skip}")
        seconds = sum(r.elapsed for r in later)
        before = self.reports[skip - 1] if skip > 0 else None
        busy = later[-1].metrics["replay/engine_busy_s"] - (
            before.metrics["replay/engine_busy_s"] if before else 0.0)
        start = self.recorder.of("train_step")[skip - 1].end if skip > 0 else 0.0
        end = start + seconds
        waited = sum(max(0.0, min(s.end, end) - max(s.start, start))
                     for s in self.recorder.of("wait_batch"))
        samples = sum(r.samples for r in later)
        idle = max(0.0, 1.0 - busy / (seconds * self.engines))  # not -0.0 from float sums
        return Window(samples / seconds, idle, waited / seconds, seconds, samples)


    def summary(self) -> dict[str, Any]:
        return {"k": self.k, "policy": self.policy, "engines": self.engines,
                "steps": len(self.reports), "samples": self.samples,
                "virtual_seconds": self.wall, "samples_per_s": self.throughput,
                "engine_idle_fraction": self.engine_idle,
                "trainer_wait_fraction": self.trainer_wait,
                "dropped_stale": self.reports[-1].dropped_total if self.reports else 0,
                "rollout_share": self.rollout_share,
                "assumption": self.trainer.describe()}


def replay_parts(cfg: DictConfig) -> RunParts:
    """The parts of ``experiment=replay``: the trace ``trace=`` names, played in virtual time."""
    settings = typed(ReplayConfig, cfg, "replay")
    for key in ("pipeline.batch_size", "pipeline.num_workers"):
        if OmegaConf.select(cfg, key) is not None:
            raise ConfigError(f"{key} is set by the replay from replay.groups_per_step and the "
                              f"trace's group size: leave it null")
    if OmegaConf.select(cfg, "rollout") is not None:
        raise ConfigError("a replay takes its rollout shape from the trace: set rollout=null")
    seed: int = scalar(cfg, "seed")
    trace = open_trace(scalar(cfg, "trace"))
    plans, per_step = load_plans(trace, settings.steps, settings.groups_per_step, seed)
    fit = EngineFit.load(settings.engine)
    settings = replace(settings, groups_per_step=per_step,
                       num_steps=settings.num_steps or scalar(cfg, "pipeline.num_steps"))
    parts, _ = replay_session(
        plans, fit, settings,
        k=scalar(cfg, "pipeline.max_staleness"),
        overprovision=scalar(cfg, "pipeline.overprovision"),
        inflight_update=scalar(cfg, "pipeline.inflight_update"),
        seed=seed, progress=scalar(cfg, "progress"), trace=str(trace.path))
    log.info(TrainerModel.of(settings, fit).describe())
    return parts


async def replay(
    plans: Sequence[EpisodePlan],
    fit: EngineFit,
    settings: ReplayConfig,
    *,
    k: int = 0,
    overprovision: float | None = None,
    seed: int = 0,
    on_step: Callable[[StepReport], None] | None = None,
    trainer: TrainerModel | None = None,
    keep_batches: bool = True,
) -> ReplayResult:
    """Run ``plans`` through the run loop (under :func:`run_virtual` for virtual time), as
    ``settings`` (the ``replay`` section; ``groups_per_step=None``: a step's recorded groups,
    ``num_steps=None``: one) says, with staleness ``k`` and ``overprovision`` (the pipeline's
    policy). ``trainer`` prices the steps instead of ``settings``' cost model.
    ``keep_batches=False`` drops each report's trained groups once ``on_step`` has seen them:
    a long replay of long samples would otherwise hold every token it trained."""
    settings = replace(settings, num_steps=settings.num_steps or 1)
    parts, measure = replay_session(plans, fit, settings, k=k, overprovision=overprovision,
                                    seed=seed, trainer=trainer)
    parts.keep_batches = keep_batches
    result = RunResult(run_dir=None)
    await run_session(parts, result, on_step)
    return measure(result)


def replay_session(
    plans: Sequence[EpisodePlan],
    fit: EngineFit,
    settings: ReplayConfig,
    *,
    k: int,
    overprovision: float | None = None,
    inflight_update: Literal["continue", "finish"] = "continue",
    seed: int = 0,
    trainer: TrainerModel | None = None,
    progress: bool = False,
    trace: str | None = None,
) -> tuple[RunParts, Callable[[RunResult], ReplayResult]]:
    """The run parts of a replay of ``plans``, and what reads its figures once it has run.
    ``trainer`` (default: ``settings``' cost model, by default calibrated so rollout is
    ``settings.rollout_share`` of a synchronous step) prices the train steps;
    ``settings.engines`` replicas of ``fit``'s server are routed to by ``settings.routing``
    (``settings.sticky``: an episode's turns stay on one replica)."""
    from trio.testing import MockClock

    if settings.num_steps is None:
        raise ConfigError("a replay needs replay.num_steps (or pipeline.num_steps)")
    spec = ReplaySpec(plans, latency_model=_latency_model(settings.tool_latency, seed))
    group_size = max(len(g) for g in spec.groups)
    if any(len(g) != group_size for g in spec.groups):
        raise ConfigError("every prompt group of a replayed trace must have the same size")
    groups = settings.groups_per_step or len(spec.groups)
    cost = trainer or TrainerModel.of(settings, fit)
    simulated = cost.build()
    pipeline = PipelineConfig(batch_size=groups * group_size, max_staleness=k, num_workers=1,
                              num_steps=settings.num_steps, inflight_update=inflight_update,
                              overprovision=overprovision)
    # A worker per group admission may let start, so admission alone bounds what runs.
    pipeline = replace(pipeline, num_workers=math.ceil(pipeline.budget / group_size))
    engines = settings.engines
    built: list[InferenceEngine] = []

    def make_engine(update: WeightUpdate, recorder: Recorder) -> InferenceEngine:
        reproducible_scheduling(seed)  # in the run's event loop, before anything runs at once
        if engines == 1:
            built.append(replay_engine(spec.plans, fit.server, settings.sync_seconds,
                                       update.version))
        else:
            built.append(replay_router(spec.plans, fit.server, engines, settings.routing,
                                       settings.sticky, settings.sync_seconds, update.version))
        return built[-1]

    def measure(result: RunResult) -> ReplayResult:
        (engine,) = built
        assert result.recorder is not None, "measure() before the run"
        return ReplayResult(result.reports, result.recorder, result.wall, busy_seconds(engine),
                            simulated.busy, sum(r.samples for r in result.reports), cost, k,
                            engines, pipeline.describe())

    def describe(result: RunResult) -> dict[str, Any]:
        figures = measure(result)
        log.info("replay: k=%d steps=%d samples=%d virtual_s=%.1f samples_per_s=%.2f "
                 "engine_idle=%.3f trainer_wait=%.3f", k, len(figures.reports), figures.samples,
                 figures.wall, figures.throughput, figures.engine_idle, figures.trainer_wait)
        return {**figures.summary(), **({"trace": trace} if trace else {})}

    parts = RunParts(
        spec=spec, tokenizer=ReplayTokenizer(), trainer=simulated, make_engine=make_engine,
        sampler=_InOrder(spec.tasks("train")),
        pipeline=pipeline,
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


def reproducible_scheduling(seed: int) -> None:
    """Trio runs each batch of ready tasks in an order it draws at random (reversed half the
    time, to shake out ordering bugs), so two replays of one workload could differ; seeding
    that draw makes a replay repeat exactly. (Trio keeps the generator private: without it,
    nothing is seeded and replays vary by a few percent.)"""
    from trio._core import _run

    scheduler = getattr(_run, "_r", None)
    if isinstance(scheduler, random.Random):
        scheduler.seed(seed)


def run_virtual(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under trio with a clock that jumps whenever all tasks wait."""
    from trio.testing import MockClock

    return anyio.run(partial(fn, *args, **kwargs), backend="trio",
                     backend_options={"clock": MockClock(autojump_threshold=0)})
