"""A rich progress bar over train steps, showing reward and throughput."""

from __future__ import annotations

from types import TracebackType
from typing import Self

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from orchestrator.pipeline import StepReport


class StepProgress:
    def __init__(self, total: int, enabled: bool = True, description: str = "RL",
                 completed: int = 0) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]:.3f}"),
            TextColumn("{task.fields[samples_per_s]:.0f} samples/s"),
            TextColumn("{task.fields[tokens_per_s]:.0f} tok/s"),
            TextColumn("stale-dropped {task.fields[dropped]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            disable=not enabled,
        )
        self._task = self._progress.add_task(
            description, total=total, completed=completed, reward=0.0, samples_per_s=0.0, tokens_per_s=0.0, dropped=0
        )
        self._reward_ema: float | None = None

    def __enter__(self) -> Self:
        self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._progress.stop()

    def update(self, report: StepReport) -> None:
        r = report.reward_mean
        self._reward_ema = r if self._reward_ema is None else 0.9 * self._reward_ema + 0.1 * r
        elapsed = max(report.elapsed, 1e-9)
        self._progress.update(
            self._task,
            advance=1,
            reward=self._reward_ema,
            samples_per_s=report.samples / elapsed,
            tokens_per_s=report.tokens / elapsed,
            dropped=report.dropped_total,
        )
