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
    others = sorted({str(s.attributes["process"]) for s in spans
                     if s.attributes.get("process") is not None})
    names = {PID: process, **{i + PID + 1: name for i, name in enumerate(others)}}
    pids = {name: pid for pid, name in names.items() if pid != PID}

    def pid_of(span: Span) -> int:
        name = span.attributes.get("process")
        return PID if name is None else pids[str(name)]

    events: list[dict[str, Any]] = []
    tids: dict[tuple[int, str], int] = {}
    for pid, name in names.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": name}})
        workers = sorted({_track(s) for s in spans if pid_of(s) == pid}, key=_track_order)
        for tid, worker in enumerate(workers, start=1):
            tids[pid, worker] = tid
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": worker}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
    for span in sorted(spans, key=lambda s: (s.start, -s.end)):
        args = {k: _jsonable(v) for k, v in span.attributes.items()}
        if span.version is not None:
            args["version"] = span.version
        pid = pid_of(span)
        events.append({
            "name": span.stage, "cat": span.stage, "ph": "X", "pid": pid,
            "tid": tids[pid, _track(span)],
            "ts": round(span.start * 1e6, 3), "dur": round(max(span.duration, 0.0) * 1e6, 3),
            "args": args,
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_timeline(spans: Iterable[Span], path: Path, process: str = "polyrl") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace_events(spans, process)) + "\n")
