"""A run's trace files and spans, compressed and rolled: read back equal to what was written,
exported byte for byte to the published layout, readable after a crash cut them anywhere,
trimmed for a resume, and the earlier plain layout still read; the timeline on demand."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from orchestrator.trace import TraceDir
from orchestrator.trace import recorder as recorder_module
from orchestrator.trace.__main__ import main
from orchestrator.trace.jsonl import finished, read_lines
from orchestrator.trace.recorder import Recorder, read_spans, spans_path
from orchestrator.trace.writer import TraceWriter, drop_steps_from
from orchestrator.types import EpisodeTiming, FinishReason, Group, GroupTiming, Trajectory

STEPS = 7


def group(step: int, i: int) -> Group:
    n = 3 + (step * 7 + i) % 5
    t = Trajectory(prompt_id=step * 10 + i, sample_index=0, token_ids=tuple(range(4 + n)),
                   loss_mask=(False,) * 4 + (True,) * n, logprobs=(0.0,) * (4 + n),
                   versions=(step,) * (4 + n), reward=float(i % 2), start_version=step,
                   finish_reason=FinishReason.STOP, prompt_tokens=4, max_tokens=16)
    return Group(step * 10 + i, (t,), step)


def timing(i: int) -> GroupTiming:
    return GroupTiming(0.0, 1.0, (EpisodeTiming(f"rollout-{i}", 0.0, 1.0),))


def write(directory: Path, codec: str, roll_steps: int = 3, crashed: Path | None = None) -> None:
    """Write STEPS steps; ``crashed`` gets a copy of the files as they are before the writer
    closes them: what a process killed after its last step leaves on disk."""
    writer = TraceWriter(directory, codec=codec, roll_steps=roll_steps)  # type: ignore[arg-type]
    for step in range(STEPS):
        writer.write_step(step, step, [group(step, i) for i in range(3)],
                          [timing(i) for i in range(3)])
    if crashed is not None:
        shutil.copytree(directory, crashed)
    writer.close()


def published(tmp_path: Path) -> dict[str, bytes]:
    write(tmp_path / "plain", "none")
    return {p.name: p.read_bytes() for p in (tmp_path / "plain").iterdir()}


@pytest.mark.parametrize("codec", ["zst", "gz"])
def test_rolled_files_read_and_export_as_the_published_layout(tmp_path: Path, codec: str) -> None:
    run = tmp_path / "run"
    write(run / "trace", codec)
    names = sorted(p.name for p in (run / "trace").iterdir())
    assert names == sorted(f"{kind}.{first:06d}.jsonl.{codec}" for first in (0, 3, 6)
                           for kind in ("multiturn_workload", "packed_lengths", "reward_timings"))
    trace = TraceDir.open(run)  # a run directory: its trace/ folder
    expected = published(tmp_path)
    plain = TraceDir.open(tmp_path / "plain")
    assert trace.steps() == plain.steps() == list(range(STEPS))
    for step in [*range(STEPS), 5, 1, 2, 6, 0]:  # in order (one pass a file), then not
        assert list(trace.workload(step)) == list(plain.workload(step))
        assert list(trace.packed_lengths(step)) == list(plain.packed_lengths(step))
    assert main(["export", str(run), "-o", str(tmp_path / "out")]) == 0
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == expected
    assert main(["export", str(run), "-o", str(tmp_path / "out")]) == 2  # not over step files


@pytest.mark.parametrize("codec", ["zst", "gz"])
def test_a_crash_loses_at_most_what_was_not_flushed(tmp_path: Path, codec: str) -> None:
    write(tmp_path / "written", codec, crashed=tmp_path / "trace")  # no frame end: killed
    trace = TraceDir.open(tmp_path)
    assert trace.steps() == list(range(STEPS))  # every flushed step decodes
    last = tmp_path / "trace" / f"multiturn_workload.000006.jsonl.{codec}"
    assert not finished(last)
    whole = last.read_bytes()
    for cut in range(1, len(whole), max(1, len(whole) // 40)):  # cut anywhere: no error
        last.write_bytes(whole[:cut])
        got = [r.step for r in TraceDir.open(tmp_path).workload(6)] if 6 in TraceDir.open(
            tmp_path).steps() else []
        assert got == [6] * len(got) and len(got) <= 3
        assert all(line.endswith("\n") for line in read_lines(last))


def test_resume_trims_rolled_files_to_the_checkpoint(tmp_path: Path) -> None:
    write(tmp_path / "written", "zst", crashed=tmp_path / "trace")  # a crashed run's files
    drop_steps_from(tmp_path, 4)
    trace = TraceDir.open(tmp_path)
    assert trace.steps() == [0, 1, 2, 3] and trace.steps("reward_timings") == [0, 1, 2, 3]
    assert not (tmp_path / "trace" / "multiturn_workload.000006.jsonl.zst").exists()
    rewritten = tmp_path / "trace" / "multiturn_workload.000003.jsonl.zst"
    assert finished(rewritten)  # safe to append after
    assert [r.step for r in trace.workload(3)] == [3, 3, 3]


def test_spans_roll_into_segments_and_a_resumed_recorder_starts_a_new_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorder_module, "ROLL_STEPS", 2)
    folder, now = tmp_path / "spans", [0.0]
    rec = Recorder(lambda: now[0], tmp_path / "written", codec="zst")
    for step in range(5):
        rec.add("train_step", "trainer", step, step + 0.5, step, step=step)
        rec.flush()
    shutil.copytree(tmp_path / "written", folder)  # killed here, before close()
    rec.close()
    # every flushed span reads back, from three segments
    assert len(list(folder.iterdir())) == 3
    assert [s.start for s in read_spans(folder)] == [0, 1, 2, 3, 4]
    resumed = Recorder(lambda: now[0], folder, append=True, codec="zst")
    assert resumed.now() == pytest.approx(4.5)  # the clock goes on from the last span
    resumed.add("eval", "eval", resumed.now(), resumed.now() + 1)
    resumed.close()
    assert max(p.name for p in folder.iterdir()) == "spans.000003.jsonl.zst"
    assert [s.stage for s in read_spans(spans_path(tmp_path))][-1] == "eval"


def spans_run(run_dir: Path, steps: int = 6) -> None:
    rec = Recorder(lambda: 0.0, run_dir / "spans", codec="zst")
    rec.add("warm_start", "trainer", -5.0, -1.0)
    for step in range(steps):
        rec.add("generate", "rollout-0", step + 0.1, step + 0.6, step, sample=0)
        rec.add("train_step", "trainer", step + 0.6, step + 1.0, step, step=step)
        rec.flush()
    rec.close()


def test_the_timeline_is_built_on_demand_for_a_window_of_steps(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spans_run(tmp_path)
    assert main(["timeline", str(tmp_path), "--steps", "2:4"]) == 0
    assert "ui.perfetto.dev" in capsys.readouterr().out
    doc = json.loads((tmp_path / "timeline-2_4.json").read_text())
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    train = [e["args"]["step"] for e in slices if e["name"] == "train_step"]
    assert train == [2, 3] and doc["otherData"] == {"steps": "2:4 of 6 steps"}
    assert min(e["ts"] for e in slices) >= 2.0e6 - 0.5e6  # from the end of step 1 on
    assert main(["timeline", str(tmp_path), "--steps=-1:"]) == 0
    last = json.loads((tmp_path / "timeline--1_.json").read_text())
    assert [e["args"]["step"] for e in last["traceEvents"] if e["name"] == "train_step"] == [5]
    assert main(["timeline", str(tmp_path)]) == 0  # the whole run, warm start included
    whole = json.loads((tmp_path / "timeline.json").read_text())
    assert sum(e["name"] == "warm_start" for e in whole["traceEvents"]) == 1
    capsys.readouterr()
    assert main(["timeline", str(tmp_path), "--steps", "10:20"]) == 2
    assert "selects none of the run's 6 steps" in capsys.readouterr().err
    assert main(["timeline", str(tmp_path), "--steps", "a:b"]) == 2
    assert main(["timeline", str(tmp_path / "nowhere")]) == 2


def test_the_earlier_plain_layout_still_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path, "none")  # step files at the run directory's top level
    rec = Recorder(lambda: 0.0, tmp_path / "spans.jsonl")
    rec.add("train_step", "trainer", 0.0, 1.0, 0, step=0)
    rec.add("generate", "rollout-0", 0.0, 0.5, 0, sample=0)
    rec.close()
    assert TraceDir.open(tmp_path).steps() == list(range(STEPS))
    assert [s.stage for s in read_spans(spans_path(tmp_path))] == ["train_step", "generate"]
    assert main(["summarize", str(tmp_path), "--no-plots"]) == 0
    assert "train_step" in capsys.readouterr().out
    assert main(["timeline", str(tmp_path)]) == 0
