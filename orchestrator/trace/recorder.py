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

Memory. A recorder without a file keeps every span in :attr:`~Recorder.spans` (tests,
benchmarks). A recorder with a file writes each span as it is recorded, one JSON object a
line, and keeps in memory only the spans recorded since its last :meth:`~Recorder.flush`: the
run directory flushes once per train step, right after the step's report has summed them, so
a run of any length holds one step's spans, and a crash (even SIGKILL) loses at most the step
in progress. Whole-run totals per stage stay available (:meth:`~Recorder.seconds`).

Files. With ``codec`` (``zst`` or ``gz``; a run directory's ``spans/``), ``path`` is a folder
of compressed segments, ``spans.<n>.jsonl.zst``: each flush ends a compressed block, and a new
segment starts every :data:`~orchestrator.trace.jsonl.ROLL_STEPS` flushes
(:mod:`orchestrator.trace.jsonl`), so a crash loses at most what was written since the last
flush, inside the segment being written. Without it, ``path`` is one plain JSONL file
(``run.codec=none``, and tests).

Both are read back by :func:`read_spans`. A line counts once its newline is written: a
process killed mid-write leaves a last line without one, which the reader skips. Appending
(``append=True``, a resumed run) starts a new segment (a plain file: cuts the partial line off
first), and starts the recorder's clock at the latest span end already there, so the resumed
part of a run follows the earlier part on the timeline instead of overlapping it.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from orchestrator.trace.jsonl import ROLL_STEPS, Codec, SegmentWriter, check_codec, read_lines

SEGMENT_STEM = "spans"
SPANS_DIR = "spans"  # a run directory's folder of compressed span segments
PLAIN_SPANS = "spans.jsonl"  # an uncompressed run's
_TAIL_BLOCK = 1 << 16  # bytes read at a time when looking for the last complete line


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


def span_line(span: Span) -> str:
    """``span`` as one JSONL line; an attribute JSON cannot hold is written as its ``str``."""
    return json.dumps({"stage": span.stage, "worker": span.worker, "start": span.start,
                       "end": span.end, "version": span.version,
                       "attributes": span.attributes}, default=str) + "\n"


def span_files(path: Path) -> list[Path]:
    """The files of spans at ``path``: itself, or a folder's segments in order."""
    if not path.is_dir():
        return [path]
    found = [(int(p.name.split(".")[1]), p) for p in path.glob(f"{SEGMENT_STEM}.*.jsonl*")
             if p.name.split(".")[1].isdigit()]
    return [p for _, p in sorted(found)]


def spans_path(run_dir: Path) -> Path:
    """Where a run directory's spans are: its ``spans/`` folder, or the ``spans.jsonl`` of
    an uncompressed run."""
    folder = Path(run_dir) / SPANS_DIR
    return folder if folder.is_dir() else Path(run_dir) / PLAIN_SPANS


def read_spans(path: Path, stage: str | None = None) -> Iterator[Span]:
    """The spans of a JSONL file (plain, ``.zst`` or ``.gz``) or a folder of segments,
    streamed in the order written (only those of ``stage``, if given: other lines are not
    parsed); a last line cut short is skipped."""
    prefix = None if stage is None else f'{{"stage": {json.dumps(stage)},'
    for file in span_files(Path(path)):
        for line in read_lines(file):
            if prefix is None or line.startswith(prefix):
                yield Span(**json.loads(line))


class Recorder:
    def __init__(self, clock: Callable[[], float] = time.perf_counter, path: Path | None = None,
                 append: bool = False, codec: Codec | None = None) -> None:
        """Spans go to ``path`` as they are recorded if it is given (overwriting it, or with
        ``append`` after its spans, on a clock that starts where they end), else stay here;
        with ``codec``, ``path`` is a folder of compressed segments."""
        if append and path is None:
            raise ValueError("Recorder(append=True) needs the path of the spans to append to")
        start = _resume_point(path) if append and path is not None else 0.0
        self._clock = clock
        self._origin = clock() - start
        self.wall_origin = time.time() - start  # the wall-clock time of timeline time 0
        self.spans: list[Span] = []  # every span, or those since the last flush() with a file
        self._seconds: Counter[str] = Counter()
        self._file: IO[str] | None = None
        self._segments: SegmentWriter | None = None
        self._flushes = 0
        if path is not None and codec is not None:
            if not append and path.is_dir():
                for old in span_files(path):
                    old.unlink()
            self._segments = SegmentWriter(path, SEGMENT_STEM, check_codec(codec))
            self._part = max((int(p.name.split(".")[1]) + 1 for p in span_files(path))
                             if path.is_dir() else (), default=0)
            self._segments.roll(self._part)
        elif path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a" if append else "w")

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
        self._seconds[stage] += span.duration
        if self._file is not None:
            self._file.write(span_line(span))
        elif self._segments is not None:
            self._segments.write(span_line(span))
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
        """The spans of ``stage`` still in memory (all of them without a file)."""
        return [s for s in self.spans if s.stage == stage]

    def seconds(self, stage: str) -> float:
        """Total seconds of every span of ``stage`` this recorder recorded, flushed or not."""
        return self._seconds[stage]

    def totals(self) -> Counter[str]:
        """Seconds per stage of every span recorded so far (a copy): the difference of two
        readings is what was recorded between them, whatever the spans' own times (a Ray
        actor's or a tool's spans arrive after later ones, with their original times)."""
        return Counter(self._seconds)

    def flush(self) -> None:
        """Push the spans recorded so far to the file and let go of them (no file: a no-op).

        Once per train step: the pipeline's step report reads the spans since the previous
        report from :attr:`spans`, so flushing right after a report keeps what the next one
        needs. The data reaches the operating system, which keeps it if the process dies.
        """
        if self._file is not None:
            self._file.flush()
            self.spans = []
        elif self._segments is not None:
            self._segments.flush()
            self.spans = []
            self._flushes += 1
            if self._flushes % ROLL_STEPS == 0:
                self._part += 1
                self._segments.roll(self._part)

    def close(self) -> None:
        """Flush and close the file; recording after this is an error."""
        if self._file is not None:
            self.flush()
            self._file.close()
        elif self._segments is not None:
            self._segments.flush()
            self._segments.close()


def _resume_point(path: Path) -> float:
    """Where an appending recorder's clock starts: the latest end among the spans already in
    ``path`` (0 for none), after cutting off a line a crash left without its newline."""
    if path.is_dir():
        return max((span.end for span in read_spans(path)), default=0.0)
    if not path.is_file():
        return 0.0
    _drop_partial_line(path)
    return max((span.end for span in read_spans(path)), default=0.0)


def _drop_partial_line(path: Path) -> None:
    """Truncate ``path`` after its last newline: a span appended after a partial line would be
    glued onto it."""
    with path.open("rb+") as f:
        pos = f.seek(0, os.SEEK_END)
        while pos > 0:
            size = min(_TAIL_BLOCK, pos)
            f.seek(pos - size)
            newline = f.read(size).rfind(b"\n")
            if newline >= 0:
                pos += newline + 1 - size
                break
            pos -= size
        f.truncate(pos)
