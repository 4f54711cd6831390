"""The run writer and the Perfetto timeline: written files read back equal, timelines are valid
trace-event JSON, and a real training run leaves both in its directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from orchestrator.builders import run
from orchestrator.trace import NAMESPACE, TraceDir, iter_records
from orchestrator.trace.recorder import Recorder
from orchestrator.trace.summarize import summarize
from orchestrator.trace.timeline import trace_events
from orchestrator.trace.writer import TraceWriter, loss_mask_rle, workload_record
from orchestrator.types import (
    EpisodeTiming,
    FinishReason,
    Group,
    GroupTiming,
    ToolTiming,
    Trajectory,
    TurnTiming,
)

REPO = Path(__file__).resolve().parents[3]


def trajectory(prompt_id: int, sample: int) -> Trajectory:
    prompt, turn0, obs, turn1 = 5, 3, 4, 2
    mask = (False,) * prompt + (True,) * turn0 + (False,) * obs + (True,) * turn1
    n = len(mask)
    return Trajectory(
        prompt_id=prompt_id, sample_index=sample, token_ids=tuple(range(n)), loss_mask=mask,
        logprobs=(0.0,) * n, versions=(-1,) * n, reward=1.0, start_version=2,
        finish_reason=FinishReason.STOP, end_reason="done", prompt_tokens=prompt, max_tokens=8,
    )


def timing() -> EpisodeTiming:
    prompt, turn0, obs, turn1 = 5, 3, 4, 2
    return EpisodeTiming(
        worker="rollout-1", started_at=0.5, finished_at=3.0, reward_seconds=0.01,
        turns=(
            TurnTiming(0, 0.5, 1.25, prompt, 0, turn0, 8, turn0 - 1, "tool_calls", 1, 2, obs),
            TurnTiming(1, 2.0, 0.75, prompt + turn0 + obs, 7, turn1, 8, turn1 - 1, "stop", 0, 3),
        ),
        tool_calls=(ToolTiming(0, "search", "ok", 1.75, 0.2, None, {"query_count": 2}, 3, obs),),
    )


def test_loss_mask_rle() -> None:
    assert loss_mask_rle([True, True, False, True]) == ((1, 2), (0, 1), (1, 1))
    assert loss_mask_rle([]) == ()


def test_write_then_read_gives_equal_records(tmp_path: Path) -> None:
    groups = [Group(p, tuple(trajectory(p, s) for s in range(2)), 2) for p in range(3)]
    timings = [GroupTiming(0.0, 3.0, (timing(), timing()), queue_wait=0.25) for _ in groups]
    TraceWriter(tmp_path, codec="none").write_step(4, 3, groups, timings)
    trace = TraceDir.open(tmp_path)
    assert trace.steps() == [4] and trace.steps("reward_timings") == [4]
    written = list(trace.workload(4))
    expected = [workload_record(t, timing(), 4, 3, 0.25) for g in groups for t in g.trajectories]
    assert written == expected
    record = written[0]
    assert record.turn_count == 2 and record.tool_call_count == 1
    assert record.response_loss_mask_rle == ((1, 3), (0, 4), (1, 2))
    assert record.turns[1].cached_tokens == 7 and record.turns[0].engine_latency_s == 1.25
    assert record.tool_calls[0].status == "success" and record.tool_calls[0].query_count == 2
    assert record.polyrl is not None
    assert record.polyrl.staleness == 1 and record.polyrl.turn_versions == (2, 3)
    assert record.polyrl.queue_wait_s == 0.25
    raw = json.loads((tmp_path / "multiturn_workload_step_4.jsonl").read_text().splitlines()[0])
    published = {"step", "prompt_len", "turns", "tool_calls", "response_loss_mask_rle",
                 "prompt_group_id", "sample_id", "final_total_len", "validate"}
    assert published <= set(raw) and NAMESPACE in raw
    (rewards,) = iter_records(tmp_path / "reward_timings_step_4.jsonl")
    assert rewards.batch_size == 6 and rewards.response_max == 9
    packed = list(iter_records(tmp_path / "packed_lengths_step_4.jsonl"))
    assert [p.output for p in packed] == [(9, 9)] * 3


def check_trace_events(doc: dict) -> list[dict]:
    """The trace-event format's rules, as chrome://tracing and Perfetto apply them."""
    assert set(doc) <= {"traceEvents", "displayTimeUnit", "otherData"}
    assert doc.get("displayTimeUnit", "ms") in ("ms", "ns")
    complete = []
    for e in doc["traceEvents"]:
        assert isinstance(e["name"], str) and e["ph"] in ("X", "M")
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "thread_sort_index")
            assert isinstance(e["args"], dict)
            continue
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
        assert e["ts"] >= 0 and e["dur"] >= 0 and isinstance(e.get("args", {}), dict)
        complete.append(e)
    by_track: dict[int, list[dict]] = {}
    for e in complete:
        by_track.setdefault(e["tid"], []).append(e)
    for events in by_track.values():  # slices on one track nest or follow each other
        open_ends: list[float] = []
        for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"] + 1e-3:
                open_ends.pop()
            end = e["ts"] + e["dur"]
            assert not open_ends or end <= open_ends[-1] + 1e-3, e
            open_ends.append(end)
    return complete


def test_timeline_is_valid_trace_event_json() -> None:
    recorder = Recorder()
    recorder.add("wait_batch", "trainer", 0.0, 1.0, 0)
    recorder.add("train_step", "trainer", 1.0, 2.0, 0, samples=8)
    recorder.add("rollout", "rollout-0", 0.0, 1.0, 0)
    for sample in range(2):
        recorder.add("generate", "rollout-0", 0.0, 0.6, 0, sample=sample, turn=0)
        recorder.add("tool_call", "rollout-0", 0.6, 0.8, 0, sample=sample, status=object())
    recorder.add("weight_sync", "weight_sync", 2.0, 2.1, 0)
    doc = json.loads(json.dumps(trace_events(recorder.spans)))
    events = check_trace_events(doc)
    assert len(events) == 8
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"trainer", "weight_sync", "rollout-0", "rollout-0 #0", "rollout-0 #1"}
    train = next(e for e in events if e["name"] == "train_step")
    assert train["ts"] == 1e6 and train["dur"] == 1e6 and train["args"] == {"samples": 8, "version": 0}


def overlap(a: list[dict], b: list[dict]) -> float:
    return sum(max(0.0, min(x["ts"] + x["dur"], y["ts"] + y["dur"]) - max(x["ts"], y["ts"]))
               for x in a for y in b)


@pytest.mark.parametrize("k", [0, 1])
def test_a_training_run_writes_its_trace_and_timeline(tmp_path: Path, k: int) -> None:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            "experiment=smoke", "logger=none", "progress=false", "model.device=cpu",
            f"pipeline.max_staleness={k}", "eval.num_tasks=0", "pipeline.num_steps=3",
            "warmstart.steps=0"])
    run(cfg, tmp_path)
    trace = TraceDir.open(tmp_path)
    assert trace.steps() == [0, 1, 2]
    for step in trace.steps():
        records = list(trace.workload(step))
        assert len(records) == cfg.pipeline.batch_size
        for r in records:
            assert r.polyrl is not None and 0 <= r.polyrl.staleness <= k
            assert r.polyrl.train_step == step
            assert r.turns and all(t.engine_latency_s > 0 for t in r.turns)
            assert r.final_response_loss_len == sum(t.completion_tokens for t in r.turns)
        assert sum(r.batch_size for r in trace.reward_timings(step)) == cfg.pipeline.batch_size
    doc = json.loads((tmp_path / "timeline.json").read_text())
    events = check_trace_events(doc)
    generate = [e for e in events if e["name"] == "generate"]
    train = [e for e in events if e["name"] == "train_step"]
    assert len(train) == 3 and generate
    if k == 0:
        assert overlap(generate, train) == 0.0
    else:
        assert overlap(generate, train) > 0.0
    (summary,) = summarize(tmp_path, plots=False)  # the report reads a run directory too
    assert summary.stages["train_step"] > 0 and summary.idle and 0 <= summary.idle[0] < 1
    assert len(summary.inputs) == 3 * cfg.pipeline.batch_size
