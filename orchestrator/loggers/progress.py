"""Progress over train steps: a rich bar in a terminal, a log line every few seconds elsewhere.

When stdout is a terminal the bar shows the step, reward (an exponential average),
throughput and the time left. When it is not (CI logs, ``nohup``, a pipe into a file) a bar
would print nothing readable, so every ``interval`` seconds one line is logged instead —
step, reward, samples/s over the interval, the last periodic evaluation's headline (mean@n,
and pass@k for the largest k when n > 1), ETA, how long ago the last checkpoint was written
(:meth:`StepProgress.checkpointed`; checkpoints log nothing of their own at INFO) — and the
last step always gets its line.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
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

from orchestrator.types import Evaluation, StepReport

log = logging.getLogger("orchestrator.progress")


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def headline(evaluation: Evaluation) -> str:
    """``eval 0.520±0.031`` (mean@n and its standard error), with ``pass@8 0.800±0.040`` for
    the largest k when n > 1."""
    overall = evaluation.overall
    text = f"eval {evaluation.mean:.3f}" + _se(overall.se.get("mean"))
    k = max(overall.pass_at, default=1)
    if k > 1:
        text += f" pass@{k} {overall.pass_at[k]:.3f}" + _se(overall.se.get(f"pass@{k}"))
    return text


def _se(value: float | None) -> str:
    return "" if value is None else f"±{value:.3f}"


class StepProgress:
    def __init__(self, total: int, enabled: bool = True, description: str = "RL",
                 completed: int = 0, interactive: bool | None = None, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.description = description
        self.interactive = sys.stdout.isatty() if interactive is None else interactive
        self._lines = enabled and not self.interactive
        self._interval = interval
        self._clock = clock
        self._done = completed
        self._started = self._last_line = clock()
        self._done_at_start = completed
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]:.3f}"),
            TextColumn("{task.fields[samples_per_s]:.0f} samples/s"),
            TextColumn("{task.fields[tokens_per_s]:.0f} tok/s"),
            TextColumn("stale-dropped {task.fields[dropped]}"),
            TextColumn("{task.fields[evaluation]}"),
            TextColumn("{task.fields[checkpoint]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            disable=not (enabled and self.interactive),
        )
        self._task = self._progress.add_task(
            description, total=total, completed=completed, reward=0.0, samples_per_s=0.0, tokens_per_s=0.0, dropped=0,
            checkpoint="", evaluation=""
        )
        self._reward_ema: float | None = None
        self._samples_since_line = 0
        self._checkpoint: tuple[int, float] | None = None  # (step, when) of the last written

    def checkpointed(self, step: int) -> None:
        """A checkpoint of ``step`` steps is on disk (called from any thread)."""
        self._checkpoint = (step, self._clock())
        self._progress.update(self._task, checkpoint=f"checkpoint @{step}")

    def _checkpoint_age(self, now: float) -> str:
        if self._checkpoint is None:
            return "no checkpoint yet"
        step, at = self._checkpoint
        return f"checkpoint @{step} {_duration(now - at)} ago"

    def __enter__(self) -> Self:
        self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._progress.stop()

    def update(self, report: StepReport) -> None:
        r = report.reward_mean
        self._reward_ema = r if self._reward_ema is None else 0.9 * self._reward_ema + 0.1 * r
        self._done += 1
        elapsed = max(report.elapsed, 1e-9)
        self._progress.update(
            self._task,
            advance=1,
            reward=self._reward_ema,
            samples_per_s=report.samples / elapsed,
            tokens_per_s=report.tokens / elapsed,
            dropped=report.dropped_total,
        )
        if report.evaluation is not None:
            self._progress.update(self._task, evaluation=headline(report.evaluation))
        self._samples_since_line += report.samples
        if self._lines:
            now = self._clock()
            if now - self._last_line >= self._interval or self._done >= self.total:
                self._log_line(now)

    def _log_line(self, now: float) -> None:
        window = max(now - self._last_line, 1e-9)
        per_step = (now - self._started) / max(self._done - self._done_at_start, 1)
        fields = self._progress.tasks[0].fields
        evaluation = f"  {fields['evaluation']}" if fields["evaluation"] else ""
        log.info("%s step %d/%d (%d%%)  reward %.3f  %.0f samples/s  stale-dropped %d%s  %s  "
                 "ETA %s",
                 self.description, self._done, self.total, 100 * self._done // max(self.total, 1),
                 self._reward_ema or 0.0, self._samples_since_line / window,
                 fields["dropped"], evaluation, self._checkpoint_age(now),
                 _duration(per_step * (self.total - self._done)))
        self._last_line = now
        self._samples_since_line = 0
