"""The logger interface and the metrics every logger gets from a step report."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestrator.types import Evaluation, StepReport, Trajectory


def step_metrics(report: StepReport) -> dict[str, float]:
    """Scalar metrics of one train step, under stable names."""
    elapsed = max(report.elapsed, 1e-9)
    metrics: dict[str, float] = {
        "reward/mean": report.reward_mean,
        "staleness/mean": sum(report.staleness) / max(len(report.staleness), 1),
        "staleness/max": float(max(report.staleness, default=0)),
        "staleness/dropped_total": float(report.dropped_total),
        "rollout/tokens_per_sample": report.tokens / max(report.samples, 1),
        "rollout/length_capped_fraction": report.length_capped / max(report.samples, 1),
        "throughput/samples_per_s": report.samples / elapsed,
        "throughput/tokens_per_s": report.tokens / elapsed,
        "policy/version": float(report.version),
    }
    # The trainer's metrics under train/; names that already have a namespace (the engine's
    # faults/…) as they are.
    metrics.update({k if "/" in k else f"train/{k}": v for k, v in report.metrics.items()})
    metrics.update(episode_metrics([t for g in report.groups for t in g.trajectories]))
    metrics.update({f"time/{stage}": s for stage, s in report.stage_seconds.items()})
    metrics["time/step"] = report.elapsed
    return metrics


def episode_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Per-episode metrics averaged over the batch (an episode without a key counts 0: no tool
    call, say), under the names the environment and runner gave them (``reward/<part>``,
    ``tools/…``, ``episode/turns``), and the share of each end reason (``episode/end/<reason>``)."""
    if not trajectories:
        return {}
    n = len(trajectories)
    keys = sorted({k for t in trajectories for k in t.metrics})
    metrics = {k: sum(t.metrics.get(k, 0.0) for t in trajectories) / n for k in keys}
    for reason, count in Counter(t.end_reason for t in trajectories).items():
        metrics[f"episode/end/{reason}"] = count / n
    return metrics


class Logger(ABC):
    # A resumed run's logger continues the run it logged before (``run_id`` from then).
    resume_id: str | None = None

    def start(self, config: dict[str, Any], run_dir: Path) -> None:
        pass

    @property
    def run_id(self) -> str | None:
        """The id a resumed run hands back as :attr:`resume_id` (None: nothing to continue)."""
        return None

    @abstractmethod
    def log_step(self, report: StepReport) -> None: ...

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_evaluation(self, when: str, step: int, evaluation: Evaluation) -> None:
        """An evaluation ``before`` RL, ``during`` it (its figures came with the metrics of
        step ``step``, the one it finished in) or ``after`` it, logged at ``step``: its few
        samples per source (:attr:`Evaluation.examples`) and, before and after RL, its
        figures."""

    def finish(self, failed: bool = False) -> None:
        pass


class NullLogger(Logger):
    """``logger=none``: logs nowhere."""

    def log_step(self, report: StepReport) -> None:
        pass


class JsonlMetrics(Logger):
    """Every run's own record: one JSON line per step in ``<run_dir>/metrics.jsonl``."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")

    def log_step(self, report: StepReport) -> None:
        self.log(step_metrics(report), report.step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def finish(self, failed: bool = False) -> None:
        self._file.close()
