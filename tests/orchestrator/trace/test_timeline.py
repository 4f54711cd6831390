"""Spans recorded in other processes (Ray actors) get process tracks of their own
(orchestrator/trace/timeline.py)."""

from __future__ import annotations

import json

from orchestrator.trace.recorder import Recorder
from orchestrator.trace.timeline import PID, trace_events


def test_spans_with_a_process_go_on_their_own_process_track() -> None:
    recorder = Recorder()
    recorder.add("train_step", "trainer", 1.0, 2.0, 0)
    recorder.add("weight_sync", "weight_sync", 2.0, 2.5, 1)
    recorder.add("train_compute", "trainer", 1.1, 1.9, 0, process="node-aa/trainer", node="aa")
    for engine, node in (("engine-0", "bb"), ("engine-1", "cc")):
        process = f"node-{node}/{engine}"
        recorder.add("weight_sync", engine, 2.1, 2.4, 1, process=process, node=node, bytes=10)
        recorder.add("engine_start", engine, 0.0, 0.5, 0, process=process, node=node)
    doc = json.loads(json.dumps(trace_events(recorder.spans, process="run")))
    events = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {PID: "run", 2: "node-aa/trainer", 3: "node-bb/engine-0",
                     4: "node-cc/engine-1"}
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert threads == {(1, "trainer"), (1, "weight_sync"), (2, "trainer"), (3, "engine-0"),
                       (4, "engine-1")}
    slices = [e for e in events if e["ph"] == "X"]
    assert {(e["pid"], e["name"]) for e in slices} == {
        (1, "train_step"), (1, "weight_sync"), (2, "train_compute"), (3, "weight_sync"),
        (3, "engine_start"), (4, "weight_sync"), (4, "engine_start")}
    sync = next(e for e in slices if e["pid"] == 3 and e["name"] == "weight_sync")
    assert sync["tid"] == 1 and sync["ts"] == 2.1e6 and sync["args"]["bytes"] == 10


def test_without_process_attributes_everything_stays_on_one_process() -> None:
    recorder = Recorder()
    recorder.add("train_step", "trainer", 0.0, 1.0, 0)
    recorder.add("generate", "rollout-0", 0.0, 0.5, 0, sample=0)
    events = trace_events(recorder.spans)["traceEvents"]
    assert {e["pid"] for e in events} == {PID}
