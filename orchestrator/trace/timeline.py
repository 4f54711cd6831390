"""Recorder spans as a Chrome / Perfetto trace-event JSON timeline.

One process (``pid`` 1, named after the run) and one track (``tid``) per worker: every
rollout worker, the trainer, weight sync. A rollout worker runs a group's episodes
concurrently, so their spans (generate, tool call, reward: they carry a ``sample``
attribute) go on one sub-track per episode slot, ``rollout-3 #5``, right below the worker's
own track; every track's slices then nest, as the format requires. Each span is a complete event (``"ph": "X"``) with
``ts`` and ``dur`` in microseconds on the recorder's clock, its stage as ``name`` and
``cat``, and its version and attributes under ``args``; metadata events (``"ph": "M"``) name
the process and the tracks. The file is the JSON object form (``{"traceEvents": [...],
"displayTimeUnit": "ms"}``) that chrome://tracing and ui.perfetto.dev open.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from orchestrator.recorder import Span

PID = 1


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


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def trace_events(spans: Iterable[Span], process: str = "polyrl") -> dict[str, Any]:
    spans = list(spans)
    workers = sorted({_track(s) for s in spans}, key=_track_order)
    tids = {w: i + 1 for i, w in enumerate(workers)}
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": PID, "tid": 0, "args": {"name": process}},
    ]
    for worker, tid in tids.items():
        events.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": tid,
                       "args": {"name": worker}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid,
                       "args": {"sort_index": tid}})
    for span in sorted(spans, key=lambda s: (s.start, -s.end)):
        args = {k: _jsonable(v) for k, v in span.attributes.items()}
        if span.version is not None:
            args["version"] = span.version
        events.append({
            "name": span.stage, "cat": span.stage, "ph": "X", "pid": PID, "tid": tids[_track(span)],
            "ts": round(span.start * 1e6, 3), "dur": round(max(span.duration, 0.0) * 1e6, 3),
            "args": args,
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_timeline(spans: Iterable[Span], path: Path, process: str = "polyrl") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace_events(spans, process)) + "\n")
