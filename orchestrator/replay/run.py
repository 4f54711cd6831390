"""Replaying a PolyTrace workload through the real pipeline, in virtual time.

``python -m orchestrator experiment=replay trace=<dir>`` (or :func:`replay` from Python)
runs the same :class:`~orchestrator.pipeline.Pipeline` as training — staleness admission,
buffer, weight sync, recorder — with

* the workload's episodes (:mod:`envs.replay`): each trajectory's turns, token counts and
  tool calls, tools taking the recorded latency or one drawn from the search latency model
  (``replay.tool_latency=model``);
* :class:`~orchestrator.engines.replay.ReplayEngine`, the calibrated server model, with
  parameters fitted by ``python -m orchestrator.trace fit`` (the shipped fit of the
  published search_r1 steps 0-2 by default);
* :class:`~orchestrator.engines.replay.SimulatedTrainer`, whose cost per token is set so that
  rollout is ``replay.rollout_share`` of a synchronous step (default 0.7: published systems
  report 50-80%, ROLL Flash, DORA — the search_r1 trace records no training time, so this is
  an assumption, printed with the results).

Time is virtual: the pipeline runs under trio with ``MockClock(autojump_threshold=0)``, which
jumps to the next timer whenever every task is waiting, and the recorder reads
``anyio.current_time()``. A 2,048-trajectory step takes a few CPU seconds whatever its
simulated length. Nothing may block a thread in this mode (the trainer steps in the loop).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio
from omegaconf import DictConfig, OmegaConf

from envs.replay import EpisodePlan, ReplaySpec, ToolPlan, TurnPlan
from orchestrator.engines.replay import ReplayEngine, ReplayTokenizer, SimulatedTrainer
from orchestrator.engines.replay_model import ServerParams
from orchestrator.errors import ConfigError
from orchestrator.pipeline import Pipeline, PipelineConfig, StepReport, TaskSampler
from orchestrator.recorder import Recorder
from orchestrator.rollout import RolloutConfig
from orchestrator.trace.reader import SHIPPED_SAMPLE, TraceDir
from orchestrator.trace.records import WorkloadRecord
from orchestrator.trace.timeline import write_timeline
from orchestrator.trace.writer import TraceWriter

log = logging.getLogger(__name__)
SHIPPED_FIT = Path(__file__).resolve().parents[1] / "trace" / "data" / "search_r1_engine.json"
ROLLOUT_SHARE_NOTE = (
    "assumption: the trace records no training time; the trainer cost model is calibrated so "
    "rollout is {share:.0%} of a synchronous step (published systems: 50-80%, ROLL Flash, DORA)")


def plans_from_records(records: Sequence[WorkloadRecord], first_key: int = 0,
                       group_offset: int = 0) -> list[EpisodePlan]:
    plans = []
    groups: dict[tuple[int, int], int] = {}
    for i, r in enumerate(records):
        group = groups.setdefault((r.step, r.prompt_group_id), group_offset + len(groups))
        tools: dict[int, list[ToolPlan]] = {}
        for c in r.tool_calls:
            tools.setdefault(c.turn, []).append(
                ToolPlan(c.latency_s, c.status, c.query_count, c.append_len))
        turns = tuple(TurnPlan(t.prompt_tokens, t.cached_tokens, t.completion_tokens,
                               t.finish_reason, t.engine_latency_s, tuple(tools.get(t.turn, ())))
                      for t in r.turns)
        plans.append(EpisodePlan(first_key + i, r.prompt_len, turns, group, r.sample_id))
    return plans


@dataclass(frozen=True)
class EngineFit:
    """What ``python -m orchestrator.trace fit`` saves."""

    server: ServerParams
    makespan_s: float  # mean observed rollout makespan of the fit steps
    tokens_per_step: float  # mean total tokens (prompt + response) per fit step
    trajectories_per_step: float
    source: str = ""
    steps: tuple[int, ...] = ()
    loss: float = 0.0

    def trainer(self, rollout_share: float = 0.7) -> SimulatedTrainer:
        if not 0.0 < rollout_share < 1.0:
            raise ConfigError(f"replay.rollout_share={rollout_share} must be between 0 and 1")
        train_seconds = self.makespan_s * (1.0 - rollout_share) / rollout_share
        return SimulatedTrainer(seconds_per_token=train_seconds / self.tokens_per_step)

    def to_dict(self) -> dict[str, Any]:
        return {"server": self.server.to_dict(), "makespan_s": self.makespan_s,
                "tokens_per_step": self.tokens_per_step,
                "trajectories_per_step": self.trajectories_per_step, "source": self.source,
                "steps": list(self.steps), "loss": self.loss}

    @classmethod
    def load(cls, path: Path | str | None = None) -> EngineFit:
        path = Path(path) if path else SHIPPED_FIT
        try:
            data = json.loads(path.read_text())
            return cls(ServerParams(**data["server"]), float(data["makespan_s"]),
                       float(data["tokens_per_step"]), float(data["trajectories_per_step"]),
                       str(data.get("source", "")), tuple(data.get("steps", ())),
                       float(data.get("loss", 0.0)))
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"replay.engine={path} is not an engine fit saved by "
                              f"`python -m orchestrator.trace fit` ({e})") from e


@dataclass
class ReplayResult:
    reports: list[StepReport]
    recorder: Recorder
    wall: float  # virtual seconds
    engine_busy: float
    trainer_busy: float
    samples: int
    rollout_share: float
    k: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.samples / self.wall

    @property
    def engine_idle(self) -> float:
        return 1.0 - self.engine_busy / self.wall

    @property
    def trainer_wait(self) -> float:
        return sum(s.duration for s in self.recorder.of("wait_batch")) / self.wall

    def summary(self) -> dict[str, Any]:
        return {"k": self.k, "steps": len(self.reports), "samples": self.samples,
                "virtual_seconds": self.wall, "samples_per_s": self.throughput,
                "engine_idle_fraction": self.engine_idle,
                "trainer_wait_fraction": self.trainer_wait,
                "dropped_stale": self.reports[-1].dropped_total if self.reports else 0,
                "rollout_share": self.rollout_share,
                "assumption": ROLLOUT_SHARE_NOTE.format(share=self.rollout_share)}


def resample_groups(plans: Sequence[EpisodePlan], groups: int, seed: int = 0) -> list[EpisodePlan]:
    """``groups`` prompt groups drawn from those of ``plans`` (with replacement once they run
    out), with fresh keys: scales a sample up to a full step's load."""
    by_group: dict[int, list[EpisodePlan]] = {}
    for p in plans:
        by_group.setdefault(p.group, []).append(p)
    names = sorted(by_group)
    rng = random.Random(seed)
    # Fewer groups: a random subset; more: every group the same number of times (round robin).
    order = rng.sample(names, groups) if groups <= len(names) else [
        names[i % len(names)] for i in range(groups)]
    out = []
    for g, name in enumerate(order[:groups]):
        for p in by_group[name]:
            out.append(EpisodePlan(len(out), p.prompt_tokens, p.turns, g, p.sample))
    return out


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
    writer: TraceWriter | None = None,
    recorder: Recorder | None = None,
) -> ReplayResult:
    """Runs the pipeline over ``plans`` (call under trio's MockClock for virtual time)."""
    spec = ReplaySpec(plans, latency_model=_latency_model(tool_latency, seed))
    group_size = max(len(g) for g in spec.groups)
    if any(len(g) != group_size for g in spec.groups):
        raise ConfigError("every prompt group of a replayed trace must have the same size")
    groups = groups_per_step or len(spec.groups)
    longest = max(t.completion_tokens for p in plans for t in p.turns)
    turns = max(len(p.turns) for p in plans)
    recorder = recorder or Recorder(clock=anyio.current_time)
    trainer = fit.trainer(rollout_share)
    config = PipelineConfig(batch_size=groups * group_size, max_staleness=k,
                            num_workers=(k + 1) * groups, num_steps=num_steps)
    rollout = RolloutConfig(group_size=group_size, max_tokens=longest, temperature=1.0,
                            max_turns=turns)

    def on_step(report: StepReport) -> None:
        if writer is not None:
            writer.write_step(report.step, report.version, report.groups)

    engine = ReplayEngine(spec.plans, fit.server, sync_seconds=sync_seconds)
    start = anyio.current_time()
    async with engine:
        pipeline = Pipeline(config, rollout, engine, trainer, ReplayTokenizer(), spec,
                            _InOrder(spec.tasks("train")), recorder, on_step)
        reports = await pipeline.run()
    wall = anyio.current_time() - start
    return ReplayResult(reports, recorder, wall, engine.busy_seconds, trainer.busy,
                        sum(r.samples for r in reports), rollout_share, k)


class _InOrder(TaskSampler):
    """Prompt groups in trace order, cycling: step after step of the recorded workload."""

    def __init__(self, tasks: Sequence[Any]) -> None:
        super().__init__(tasks)
        self._i = 0

    def next(self) -> Any:
        task = self._tasks[self._i % len(self._tasks)]
        self._i += 1
        return task


def _latency_model(mode: str, seed: int) -> Any:
    if mode == "trace":
        return None
    if mode == "model":
        from sandboxes.search.latency import TraceFaultModel

        return TraceFaultModel(seed=seed).sample
    raise ConfigError(f"replay.tool_latency={mode} must be 'trace' or 'model'")


def run_virtual(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under trio with a clock that jumps whenever all tasks wait."""
    from trio.testing import MockClock

    return anyio.run(partial(fn, *args, **kwargs), backend="trio",
                     backend_options={"clock": MockClock(autojump_threshold=0)})


def load_plans(trace: TraceDir, steps: Sequence[int] | None, groups_per_step: int | None,
               seed: int) -> tuple[list[EpisodePlan], int | None]:
    steps = list(steps) if steps else trace.steps()
    missing = [s for s in steps if s not in trace.steps()]
    if missing:
        raise ConfigError(f"replay.steps: {trace.path} has no multi-turn workload for steps "
                          f"{missing} (it has {trace.steps()})")
    plans: list[EpisodePlan] = []
    for s in steps:
        step_plans = complete_groups(plans_from_records(list(trace.workload(s)), group_offset=0))
        if not step_plans:
            continue
        if groups_per_step:
            step_plans = resample_groups(step_plans, groups_per_step, seed + s)
        base = len({p.group for p in plans})
        plans += [EpisodePlan(len(plans) + i, p.prompt_tokens, p.turns, base + p.group, p.sample)
                  for i, p in enumerate(step_plans)]
    size = max(sum(1 for p in plans if p.group == g) for g in {p.group for p in plans})
    plans = complete_groups(plans, size)  # steps agree on the group size
    plans = [EpisodePlan(i, p.prompt_tokens, p.turns, p.group, p.sample) for i, p in enumerate(plans)]
    per_step = groups_per_step or max(1, len({p.group for p in plans}) // len(steps))
    return plans, per_step


def complete_groups(plans: Sequence[EpisodePlan], size: int | None = None) -> list[EpisodePlan]:
    """The plans of groups with ``size`` samples (default: the most common size): a partial
    step (search_r1's step 5) has groups cut short, which GRPO batches cannot mix."""
    sizes: dict[int, int] = {}
    for p in plans:
        sizes[p.group] = sizes.get(p.group, 0) + 1
    if not sizes:
        return []
    size = size or max(set(sizes.values()), key=list(sizes.values()).count)
    kept = [p for p in plans if sizes[p.group] == size]
    if len(kept) < len(plans):
        log.info("replay: %d trajectories of incomplete groups left out", len(plans) - len(kept))
    return kept


def run_replay(cfg: DictConfig, run_dir: Path) -> Any:
    """The ``experiment=replay`` run: writes the usual run directory, from virtual time."""
    from orchestrator.main import RunResult

    r = OmegaConf.to_container(cfg.replay, resolve=True)
    assert isinstance(r, dict)
    trace_dir = OmegaConf.select(cfg, "trace") or str(SHIPPED_SAMPLE)
    try:
        trace = TraceDir.open(trace_dir)
    except FileNotFoundError as e:
        raise ConfigError(f"trace={trace_dir}: no such directory; point trace= at a PolyTrace "
                          f"directory (multiturn_workload_step_N.jsonl files)") from e
    if not trace.steps():
        raise ConfigError(f"trace={trace_dir} holds no multiturn_workload_step_N.jsonl files")
    k = int(cfg.pipeline.max_staleness)
    steps = r.get("steps")
    plans, per_step = load_plans(trace, steps, r.get("groups_per_step"), int(cfg.seed))
    fit = EngineFit.load(r.get("engine"))
    num_steps = int(r.get("num_steps") or cfg.pipeline.num_steps)
    writer = TraceWriter(run_dir)
    recorder_box: list[Recorder] = []

    async def go() -> ReplayResult:
        recorder = Recorder(clock=anyio.current_time)
        recorder_box.append(recorder)
        return await replay(plans, fit, k=k, num_steps=num_steps, groups_per_step=per_step,
                            rollout_share=float(r.get("rollout_share", 0.7)),
                            tool_latency=str(r.get("tool_latency", "trace")),
                            sync_seconds=float(r.get("sync_seconds", 0.0)), seed=int(cfg.seed),
                            writer=writer, recorder=recorder)

    try:
        result = run_virtual(go)
    finally:
        if recorder_box:
            recorder_box[0].write_jsonl(run_dir / "spans.jsonl")
            write_timeline(recorder_box[0].spans, run_dir / "timeline.json", process=run_dir.name)
    summary = result.summary()
    summary.update({"trace": str(trace.path), "warm_start_steps": 0, "reward_first_10pct": 0.0,
                    "reward_last_10pct": 0.0, "eval_before": None, "eval_after": None})
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with (run_dir / "metrics.jsonl").open("w") as f:
        for rep in result.reports:
            f.write(json.dumps({"step": rep.step, "time/step": rep.elapsed, "samples": rep.samples,
                                "staleness/max": max(rep.staleness, default=0),
                                "dropped_stale": rep.dropped_total, **rep.stage_seconds}) + "\n")
    print(summary["assumption"])
    print(f"replay: k={k} steps={len(result.reports)} samples={result.samples} "
          f"virtual_s={result.wall:.1f} samples_per_s={result.throughput:.2f} "
          f"engine_idle={result.engine_idle:.3f} trainer_wait={result.trainer_wait:.3f}")
    return RunResult(run_dir=run_dir, reports=result.reports, summary=summary)
