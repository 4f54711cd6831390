"""The PolyTrace reader: typed records, lossless round trips, errors that name file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.trace import (
    SHIPPED_SAMPLE,
    TraceDir,
    TraceFormatError,
    WorkloadRecord,
    find_trace_dirs,
    iter_records,
    read_task_distribution,
)

PUBLISHED = Path(__file__).resolve().parents[3].parent / "shared" / "polytrace"
SAMPLE_ROOT = SHIPPED_SAMPLE.parent


def assert_round_trips(root: Path) -> int:
    count = 0
    for trace in find_trace_dirs(root):
        for steps in trace.files.values():
            for path in steps.values():
                lines = [line for line in path.read_text().splitlines() if line.strip()]
                records = list(iter_records(path))
                assert len(records) == len(lines)
                for record, line in zip(records, lines, strict=True):
                    # Same values, same key order: the file is reproduced byte for byte.
                    assert json.dumps(record.to_dict()) == json.dumps(json.loads(line)), path
                count += len(records)
        if trace.task_distribution is not None:
            dist = read_task_distribution(trace.task_distribution)
            assert dist.to_dict() == json.loads(trace.task_distribution.read_text())
            count += 1
    return count


def test_the_shipped_sample_round_trips() -> None:
    assert 200 <= assert_round_trips(SAMPLE_ROOT) <= 400


@pytest.mark.skipif(not PUBLISHED.is_dir(), reason="the published traces are not beside the checkout")
def test_every_published_file_round_trips() -> None:
    assert assert_round_trips(PUBLISHED) > 9000


def test_typed_fields_of_a_workload_record() -> None:
    trace = TraceDir.open(SHIPPED_SAMPLE)
    assert trace.steps() == [0, 1, 2, 3]
    record = next(trace.workload(0))
    assert isinstance(record, WorkloadRecord)
    assert record.turn_count == len(record.turns) and record.tool_call_count == len(record.tool_calls)
    assert record.turns[0].finish_reason in ("tool_calls", "stop", "length")
    assert record.response_loss_mask_rle[0][0] in (0, 1)
    assert record.end_to_end_s == pytest.approx(
        sum(t.engine_latency_s for t in record.turns) + sum(c.latency_s for c in record.tool_calls))
    assert record.polyrl is None  # published records carry no project additions


def test_a_bad_record_names_file_and_line(tmp_path: Path) -> None:
    good = next(iter(SHIPPED_SAMPLE.glob("multiturn_workload_step_0.jsonl"))).read_text().splitlines()[0]
    bad = json.loads(good)
    bad["turns"][0]["completion_tokens"] = "many"
    path = tmp_path / "multiturn_workload_step_7.jsonl"
    path.write_text(good + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(TraceFormatError, match=r"multiturn_workload_step_7.jsonl:2: .*turns\[0\]\.completion_tokens must be an integer"):
        list(iter_records(path))
    path.write_text(good + "\n\n{not json\n")
    with pytest.raises(TraceFormatError, match=r"step_7.jsonl:3: not valid JSON"):
        list(iter_records(path))
    missing = json.loads(good)
    del missing["sample_id"]
    path.write_text(json.dumps(missing) + "\n")
    with pytest.raises(TraceFormatError, match=r":1: WorkloadRecord is missing 'sample_id'"):
        list(iter_records(path))


def test_unknown_keys_are_kept(tmp_path: Path) -> None:
    row = {"step": 0, "rank": 1, "tp_rank": 0, "dp_rank": 1, "local_index": 0, "input": 5,
           "output": [1, 2], "n_sampling": 2, "validate": False, "new_field": {"a": 1}}
    path = tmp_path / "packed_lengths_step_0.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (record,) = iter_records(path)
    assert record.output == (1, 2) and record.extra == {"new_field": {"a": 1}}
    assert record.to_dict() == row


def test_a_file_name_that_is_not_a_step_file(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    path.write_text("{}\n")
    with pytest.raises(TraceFormatError, match="not a PolyTrace step file"):
        list(iter_records(path))
    with pytest.raises(FileNotFoundError, match="has no multiturn_workload_step_9.jsonl"):
        TraceDir.open(SHIPPED_SAMPLE).workload(9)
