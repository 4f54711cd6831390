"""Timed spans, streamed to their JSONL file and read back (orchestrator/trace/recorder.py), and the
timeline a run directory builds from that file."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from itertools import pairwise
from pathlib import Path
from typing import Any

import anyio
import pytest

from envs.arithmetic import ArithmeticSpec
from orchestrator.config.schema import PipelineConfig, RolloutConfig
from orchestrator.engines.simulated import SimulatedEngine
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.models.tokenizer import CharTokenizer
from orchestrator.pipeline.pipeline import Pipeline, TaskSampler
from orchestrator.run.directory import RunDir
from orchestrator.trace import timeline
from orchestrator.trace.recorder import Recorder, read_spans
from orchestrator.trace.timeline import trace_events, write_timeline
from orchestrator.types import StepReport


def test_span_records_its_duration() -> None:
    now = [100.0]
    rec = Recorder(clock=lambda: now[0])
    with rec.span("generate", "rollout-0", 3, prompt_id=7):
        now[0] += 0.02  # the span's work, on the recorder's clock
    (span,) = rec.spans
    assert span.stage == "generate" and span.worker == "rollout-0" and span.version == 3
    assert span.duration == pytest.approx(0.02)
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


def test_spans_reach_the_file_at_each_flush_and_leave_memory(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "spans.jsonl"
    rec = Recorder(path=path)
    with rec.span("generate", "rollout-1", 0, prompt_tokens=12) as attrs:
        attrs["finish_reason"] = "stop"
    rec.add("weight_sync", "weight_sync", 0.5, 0.75, version=1, load_seconds=0.2)
    recorded = list(rec.spans)
    rec.flush()
    assert list(read_spans(path)) == recorded  # before close
    assert rec.spans == [] and rec.of("generate") == []
    lines = path.read_text().splitlines()
    assert json.loads(lines[1]) == asdict(recorded[1])
    assert set(json.loads(lines[0])) == {"stage", "worker", "start", "end", "version", "attributes"}
    rec.add("weight_sync", "weight_sync", 1.0, 1.5, version=2)
    rec.close()
    assert [s.version for s in read_spans(path)] == [0, 1, 2]
    assert rec.seconds("weight_sync") == 0.75  # whole-run totals outlive the flushes


def test_an_attribute_json_cannot_hold_is_written_as_text(tmp_path: Path) -> None:
    rec = Recorder(path=tmp_path / "spans.jsonl")
    rec.add("tool_call", "w", 0.0, 1.0, status=FakeStatus())
    rec.close()
    (span,) = read_spans(tmp_path / "spans.jsonl")
    assert span.attributes == {"status": "ok"}


class FakeStatus:
    def __str__(self) -> str:
        return "ok"


def test_a_recorder_without_a_file_keeps_every_span() -> None:
    rec = Recorder()
    for i in range(3):
        rec.add("train_step", "trainer", i, i + 1.0)
        rec.flush()
    assert len(rec.of("train_step")) == 3 and rec.seconds("train_step") == 3.0


@pytest.mark.anyio
async def test_a_long_run_holds_one_step_of_spans_and_reports_every_span(
        tmp_path: Path, fake_trainer_cls: Any) -> None:
    """The run directory's order, report then flush, through the real pipeline: memory holds
    the spans of one step, and each step's stage seconds are the spans it wrote."""
    path, steps = tmp_path / "spans.jsonl", 40
    recorder = Recorder(path=path)
    held: list[int] = []
    lines_at_step: list[int] = [0]

    def on_step(report: StepReport) -> None:
        held.append(len(recorder.spans))
        recorder.flush()
        lines_at_step.append(len(path.read_text().splitlines()))

    spec = ArithmeticSpec(digits=2, train_size=64, eval_size=4, seed=0)
    runner = EpisodeRunner(
        SimulatedEngine(median_tokens=8, sigma=0.5, seconds_per_token=1e-4, chunk_tokens=8),
        CharTokenizer(), spec, RolloutConfig(group_size=2, max_tokens=16), recorder)
    pipeline = Pipeline(
        PipelineConfig(batch_size=8, max_staleness=1, num_workers=8, num_steps=steps), runner,
        fake_trainer_cls(min_s=0.0, max_s=0.001), TaskSampler(spec.tasks("train"), seed=0),
        on_step)
    with anyio.fail_after(60):
        reports = await pipeline.run()
    recorder.close()

    spans = list(read_spans(path))
    assert len(held) == steps and lines_at_step[-1] <= len(spans)
    # memory held the spans of the step in progress, and never a tenth of the run's
    assert held == [b - a for a, b in pairwise(lines_at_step)]
    assert max(held) < len(spans) / 10
    for i, report in enumerate(reports):
        written: dict[str, float] = {}
        for span in spans[lines_at_step[i]:lines_at_step[i + 1]]:
            written[span.stage] = written.get(span.stage, 0.0) + span.duration
        assert report.stage_seconds == pytest.approx(written)


def recorded(rec: Recorder) -> None:
    """Spans that exercise the timeline: nesting with equal starts (the parent recorded
    last), episode sub-tracks, other processes, an attribute JSON cannot hold."""
    for step in range(5):
        t = float(step)
        rec.add("generate", "rollout-1", t, t + 0.4, step, sample=0, turn=0)
        rec.add("generate", "rollout-1", t, t + 0.3, step, sample=1, turn=0)
        rec.add("rollout", "rollout-1", t, t + 0.5, step, prompt_id=step)
        rec.add("wait_batch", "trainer", t, t + 0.5, step)
        rec.add("train_compute", "trainer", t + 0.5, t + 0.9, step, process="node-aa/trainer")
        rec.add("train_step", "trainer", t + 0.5, t + 1.0, step, samples=8, status=FakeStatus())
        rec.add("weight_sync", "engine-0", t + 1.0, t + 1.1, step + 1, process="node-bb/engine-0")


@pytest.mark.parametrize("chunk", [3, timeline.SORT_CHUNK])
def test_the_timeline_from_disk_is_the_one_from_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(timeline, "SORT_CHUNK", chunk)  # 3: merged from many sorted chunks
    in_memory, on_disk = Recorder(), Recorder(path=tmp_path / "spans.jsonl")
    recorded(in_memory)
    recorded(on_disk)
    on_disk.close()
    write_timeline(tmp_path / "spans.jsonl", tmp_path / "out" / "timeline.json", process="run")
    doc = json.loads((tmp_path / "out" / "timeline.json").read_text())
    assert doc == json.loads(json.dumps(trace_events(in_memory.spans, process="run")))
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["timeline.json"]  # no scratch left


def test_the_run_directory_streams_spans_and_builds_the_timeline_from_them(tmp_path: Path) -> None:
    out = RunDir(tmp_path, {"seed": 0})
    rec = out.open_recorder(time.perf_counter)
    recorded(rec)
    written = list(rec.spans)
    out.write_step(StepReport(step=0, version=0, metrics={}, rewards=(), staleness=(),
                              start_versions=(), dropped_total=0, samples=0, tokens=0,
                              elapsed=1.0), CharTokenizer())
    assert rec.spans == []
    assert [(s.stage, s.end) for s in read_spans(tmp_path / "spans")] == [
        (s.stage, s.end) for s in written]  # compressed, and readable before the run ends
    last = rec.add("eval", "eval", 6.0, 7.0)
    out.close({}, failed=False)
    doc = json.loads((tmp_path / "timeline.json").read_text())
    assert doc.pop("otherData") == {"steps": "0:5 of 5 steps"}  # the last 50 steps: all five
    assert doc == json.loads(json.dumps(trace_events([*written, last], process=tmp_path.name)))


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_appending_keeps_the_earlier_spans_and_continues_the_clock(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    first = Recorder(FakeClock(100.0), path=path)
    first.add("train_step", "trainer", 1.0, 5.0, 0)
    first.add("weight_sync", "engine-0", 4.0, 4.5, 1)  # ended earlier, recorded later (Ray)
    first.close()
    earlier = path.read_text()

    clock = FakeClock(7.0)  # a new process: its clock knows nothing of the first
    resumed = Recorder(clock, path=path, append=True)
    assert resumed.now() == 5.0  # the latest end so far
    assert time.time() - resumed.wall_origin >= 5.0  # Ray spans land on the same timeline
    clock.now = 8.0
    with resumed.span("train_step", "trainer", 1):
        clock.now = 9.5
    resumed.close()
    assert path.read_text().startswith(earlier)
    spans = list(read_spans(path))
    assert [s.version for s in spans] == [0, 1, 1]
    assert (spans[-1].start, spans[-1].end) == (6.0, 7.5)


def test_appending_to_a_missing_file_starts_at_zero(tmp_path: Path) -> None:
    rec = Recorder(FakeClock(3.0), path=tmp_path / "spans.jsonl", append=True)
    assert rec.now() == 0.0
    rec.close()
    with pytest.raises(ValueError, match="path"):
        Recorder(append=True)


def crashed_file(path: Path) -> list[str]:
    """Two whole spans and the first half of a third, as SIGKILL mid-write leaves them."""
    rec = Recorder(path=path)
    rec.add("generate", "rollout-0", 0.0, 1.0, 0)
    rec.add("reward", "rollout-0", 1.0, 2.0, 0)
    rec.close()
    whole = path.read_text().splitlines()
    with path.open("a") as f:
        f.write(whole[0][: len(whole[0]) // 2])
    return whole


def test_the_reader_skips_a_last_line_cut_short(tmp_path: Path) -> None:
    crashed_file(tmp_path / "spans.jsonl")
    assert [s.stage for s in read_spans(tmp_path / "spans.jsonl")] == ["generate", "reward"]
    write_timeline(tmp_path / "spans.jsonl", tmp_path / "timeline.json")
    slices = [e for e in json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
              if e["ph"] == "X"]
    assert len(slices) == 2


def test_appending_after_a_crash_cuts_the_partial_line_off(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    whole = crashed_file(path)
    rec = Recorder(path=path, append=True)
    assert rec.now() >= 2.0
    rec.add("generate", "rollout-0", 3.0, 4.0, 1)
    rec.close()
    lines = path.read_text().splitlines()
    assert lines[:2] == whole and len(lines) == 3
    assert [s.version for s in read_spans(path)] == [0, 0, 1]
