"""Timed spans and their JSONL form (orchestrator/recorder.py)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from orchestrator.recorder import Recorder, Span


def test_span_records_its_duration() -> None:
    rec = Recorder()
    with rec.span("generate", "rollout-0", 3, prompt_id=7):
        time.sleep(0.02)
    (span,) = rec.spans
    assert span.stage == "generate" and span.worker == "rollout-0" and span.version == 3
    assert 0.02 <= span.duration < 1.0
    assert span.start >= 0 and span.end == span.start + span.duration
    assert span.attributes == {"prompt_id": 7}


def test_attributes_known_at_the_end_are_collected() -> None:
    rec = Recorder()
    with rec.span("reward", "w", tag="x") as attrs:
        attrs["reward"] = 1.0
        attrs.update(tokens=5)
    assert rec.spans[0].attributes == {"tag": "x", "reward": 1.0, "tokens": 5}


def test_a_span_is_recorded_when_the_body_raises() -> None:
    rec = Recorder()
    with pytest.raises(KeyError), rec.span("train_step", "trainer") as attrs:
        attrs["before"] = True
        raise KeyError("boom")
    assert [s.stage for s in rec.spans] == ["train_step"]
    assert rec.spans[0].attributes == {"before": True}


def test_spans_share_one_clock_and_of_filters_by_stage() -> None:
    rec = Recorder()
    with rec.span("a", "w"), rec.span("b", "w"):
        pass
    rec.add("a", "v", 10.0, 11.5, version=2, n=1)
    assert [s.stage for s in rec.of("a")] == ["a", "a"]
    outer, inner = rec.of("a")[0], rec.of("b")[0]
    assert outer.start <= inner.start <= inner.end <= outer.end
    assert rec.of("a")[1].duration == 1.5
    assert rec.of("missing") == []
    assert rec.now() >= outer.end


def test_jsonl_round_trip(tmp_path: Path) -> None:
    rec = Recorder()
    with rec.span("generate", "rollout-1", 0, prompt_tokens=12) as attrs:
        attrs["finish_reason"] = "stop"
    rec.add("weight_sync", "weight_sync", 0.5, 0.75, version=1, load_seconds=0.2)
    path = tmp_path / "nested" / "spans.jsonl"
    rec.write_jsonl(path)
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    read = [Span(**json.loads(line)) for line in lines]
    assert read == rec.spans
    assert json.loads(lines[1]) == asdict(rec.spans[1])
    assert set(json.loads(lines[0])) == {"stage", "worker", "start", "end", "version", "attributes"}
