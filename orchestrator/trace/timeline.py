"""Recorder spans as a Chrome / Perfetto trace-event JSON timeline.

One process (``pid`` 1, named after the run) and one track (``tid``) per worker: every
rollout worker, the trainer, weight sync. Spans recorded in other processes (Ray actors: they
carry a ``process`` attribute such as ``node-1a2b3c4d/engine-0``) go on a process of their
own, ``pid`` 2, 3, … in the order of their names, with a track per worker inside it. A rollout worker runs a group's episodes
concurrently, so their spans (generate, tool call, reward: they carry a ``sample``
attribute) go on one sub-track per episode slot, ``rollout-3 #5``, right below the worker's
own track; every track's slices then nest, as the format requires. Each span is a complete event (``"ph": "X"``) with
``ts`` and ``dur`` in microseconds on the recorder's clock, its stage as ``name`` and
``cat``, and its version and attributes under ``args``; metadata events (``"ph": "M"``) name
the process and the tracks. The file is the JSON object form (``{"traceEvents": [...],
"displayTimeUnit": "ms"}``) that chrome://tracing and ui.perfetto.dev open.

Events are sorted by start, longest first among equal starts: the viewers nest a slice under
the one before it, and a parent span is recorded after its children. :func:`write_timeline`
builds the file from a run's ``spans.jsonl`` without holding the run in memory: one pass
collects the tracks (memory: one entry per track), a second sorts the spans in chunks of
:data:`SORT_CHUNK` written to a scratch directory beside the output and merges them, and the
events are written one at a time. Its file is the same JSON as :func:`trace_events` of the
same spans (one event a line).

A window of steps (``steps``, a slice over the run's train steps: ``slice(-50, None)`` the
last 50) keeps the spans that overlap it: from the end of the step before the first chosen
one (the run's start for step 0) to the end of the last chosen one (the run's end for the
last step). Steps are the ``train_step`` spans, by their ``step`` attribute (a resumed run's
redone step counts once, as its last run) or in order. A run writes the window of its last
steps by default; ``python -m orchestrator.trace timeline RUN_DIR --steps A:B`` any other.
"""

from __future__ import annotations

import heapq
import json
import re
import tempfile
from collections.abc import Iterable, Iterator
from itertools import chain, islice
from pathlib import Path
from typing import Any

from orchestrator.trace.recorder import Span, read_spans, span_line

PID = 1
SORT_CHUNK = 20_000  # spans write_timeline sorts in memory at once (about 30 MB)


def _track(span: Span) -> str:
    sample = span.attributes.get("sample")
    return span.worker if sample is None else f"{span.worker} #{sample}"


def _track_order(track: str) -> tuple[int, int, int, str]:
    # The trainer and weight sync on top, then workers in numeric order, episodes below each.
    worker, _, sample = track.partition(" #")
    if worker == "trainer":
        return (0, 0, 0, track)
    if worker == "weight_sync":
        return (1, 0, 0, track)
    match = re.search(r"(\d+)$", worker)
    return (2, int(match.group(1)) if match else 0, int(sample) + 1 if sample.isdigit() else 0, track)


def _order(span: Span) -> tuple[float, float]:
    return (span.start, -span.end)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


class _Tracks:
    """The processes and tracks of some spans, numbered; built in one pass over them."""

    def __init__(self, spans: Iterable[Span], process: str) -> None:
        tracks: dict[str | None, set[str]] = {None: set()}  # process attribute -> tracks
        for span in spans:
            name = span.attributes.get("process")
            tracks.setdefault(None if name is None else str(name), set()).add(_track(span))
        others = sorted(name for name in tracks if name is not None)
        self.names = {PID: process, **{i + PID + 1: name for i, name in enumerate(others)}}
        self._pids: dict[str | None, int] = {None: PID, **{name: PID + 1 + i
                                                          for i, name in enumerate(others)}}
        self._tids = {(pid, track): tid
                      for name, pid in self._pids.items()
                      for tid, track in enumerate(sorted(tracks[name], key=_track_order), start=1)}

    def metadata(self) -> Iterator[dict[str, Any]]:
        """Each process's name, then its tracks' names and order."""
        for pid, name in self.names.items():
            yield {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}
            for (owner, track), tid in self._tids.items():
                if owner != pid:
                    continue
                yield {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"name": track}}
                yield {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"sort_index": tid}}

    def event(self, span: Span) -> dict[str, Any]:
        """``span`` as a complete event on its track."""
        args = {k: _jsonable(v) for k, v in span.attributes.items()}
        if span.version is not None:
            args["version"] = span.version
        name = span.attributes.get("process")
        pid = self._pids[None if name is None else str(name)]
        return {
            "name": span.stage, "cat": span.stage, "ph": "X", "pid": pid,
            "tid": self._tids[pid, _track(span)],
            "ts": round(span.start * 1e6, 3), "dur": round(max(span.duration, 0.0) * 1e6, 3),
            "args": args,
        }


def trace_events(spans: Iterable[Span], process: str = "polyrl") -> dict[str, Any]:
    """The timeline of spans held in memory, as one JSON-able object."""
    spans = list(spans)
    tracks = _Tracks(spans, process)
    events = [*tracks.metadata(), *map(tracks.event, sorted(spans, key=_order))]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def parse_steps(text: str) -> slice:
    """``A:B`` (Python's slice: ``-50:`` the last 50 steps, ``100:200``, ``:10``) or ``N``."""
    try:
        if ":" not in text:
            n = int(text)
            return slice(n, n + 1 if n != -1 else None)
        a, b = text.split(":")
        return slice(int(a) if a.strip() else None, int(b) if b.strip() else None)
    except ValueError:
        raise ValueError(f"--steps {text!r} must be A:B (a slice of the run's steps, e.g. 100:200 "
                         f"or -50:) or one step N") from None


def step_window(spans: Iterable[Span], steps: slice) -> tuple[float, float, str]:
    """The time window of ``steps`` (a slice over the train steps of ``spans``) and a label
    (``A:B`` of N steps); the whole run if it has no train step."""
    ends: dict[int, float] = {}
    for i, span in enumerate(s for s in spans if s.stage == "train_step"):
        step = span.attributes.get("step", i)
        ends[step if isinstance(step, int) else i] = span.end
    order = sorted(ends)
    if not order:
        return -float("inf"), float("inf"), "all (no train step)"
    chosen = range(len(order))[steps]
    if not chosen:
        raise ValueError(f"--steps {steps.start or ''}:{steps.stop or ''} selects none of the "
                         f"run's {len(order)} steps ({order[0]}..{order[-1]})")
    first, last = min(chosen), max(chosen)
    start = ends[order[first - 1]] if first > 0 else -float("inf")
    end = ends[order[last]] if last < len(order) - 1 else float("inf")
    return start, end, f"{order[first]}:{order[last] + 1} of {len(order)} steps"


def write_timeline(spans: Path, path: Path, process: str = "polyrl",
                   steps: slice | None = None) -> str:
    """The timeline of the spans at ``spans`` (a JSONL file or a folder of segments,
    :func:`read_spans`), written to ``path`` event by event; only the spans of ``steps`` (a
    slice over the run's train steps) if given. Returns which steps it holds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    start, end, label = (step_window(read_spans(spans, "train_step"), steps) if steps is not None
                         else (-float("inf"), float("inf"), "all"))

    def window() -> Iterator[Span]:
        return (s for s in read_spans(spans) if s.end > start and s.start <= end)

    tracks = _Tracks(window(), process)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".timeline-") as scratch, \
            path.open("w") as f:
        ordered = _sorted_by_start(window(), Path(scratch))
        events = chain(tracks.metadata(), map(tracks.event, ordered))
        f.write('{"traceEvents": [\n')
        for i, event in enumerate(events):
            f.write((",\n" if i else "") + json.dumps(event))
        other = "" if steps is None else ', "otherData": ' + json.dumps({"steps": label})
        f.write('\n], "displayTimeUnit": "ms"' + other + "}\n")
    return label


def _sorted_by_start(spans: Iterator[Span], scratch: Path) -> Iterator[Span]:
    """``spans`` stably sorted by :func:`_order`, holding :data:`SORT_CHUNK` at a time: each
    chunk is sorted and written to ``scratch``, then the chunks are merged (a merge sort on
    disk; equal keys keep their chunk's, then their file's order, as ``sorted`` would)."""
    chunks: list[Path] = []
    while chunk := sorted(islice(spans, SORT_CHUNK), key=_order):
        chunks.append(scratch / f"{len(chunks)}.jsonl")
        chunks[-1].write_text("".join(map(span_line, chunk)))
    yield from heapq.merge(*map(read_spans, chunks), key=_order)
