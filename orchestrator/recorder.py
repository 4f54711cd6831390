"""A recorder of timed spans: (stage, worker, start, end, version, attributes).

Stages are free-form names ("generate", "reward", "train_step", "weight_sync",
"wait_admission", "wait_batch", …). Times are seconds of :attr:`Recorder.clock`
(``time.perf_counter`` by default; a replay in virtual time passes ``anyio.current_time``)
relative to the recorder's creation, so spans from every task share one clock.

The recorder's clock is the run's one clock. The orchestrator hands it to the environment
(``spec.use_clock(recorder.clock)``) wherever the two meet, so a time an environment or a tool
reports (``ToolCallRecord.started``) is a reading of the same clock, and :meth:`Recorder.at`
puts it on the timeline. A time read from any other clock would land on the timeline wrong,
by however far the two clocks' origins differ; nothing here can detect that.

The recorder is plain data; writers (JSONL here, PolyTrace and Perfetto in
:mod:`orchestrator.trace`) read :attr:`spans`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Span:
    stage: str
    worker: str
    start: float
    end: float
    version: int | None = None
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


class Recorder:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._origin = clock()
        self.wall_origin = time.time()
        self.spans: list[Span] = []

    @property
    def clock(self) -> Callable[[], float]:
        """The clock every span is read from; hand it to whatever reports times to the recorder."""
        return self._clock

    def now(self) -> float:
        return self._clock() - self._origin

    def at(self, reading: float) -> float:
        """A reading of :attr:`clock`, on the recorder's timeline."""
        return reading - self._origin

    def add(self, stage: str, worker: str, start: float, end: float,
            version: int | None = None, **attributes: Any) -> Span:
        span = Span(stage, worker, start, end, version, attributes)
        self.spans.append(span)
        return span

    @contextmanager
    def span(self, stage: str, worker: str, version: int | None = None,
             **attributes: Any) -> Iterator[dict[str, Any]]:
        """Time the body; the yielded dict collects attributes known only at the end."""
        start = self.now()
        extra: dict[str, Any] = dict(attributes)
        try:
            yield extra
        finally:
            self.add(stage, worker, start, self.now(), version, **extra)

    def of(self, stage: str) -> list[Span]:
        return [s for s in self.spans if s.stage == stage]

    def write_jsonl(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for span in self.spans:
                f.write(json.dumps(asdict(span)) + "\n")
