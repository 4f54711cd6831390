"""The PolyTrace latency model (sandboxes/search/latency.py): fitting, the shipped fit,
seeded draws, both modes, and the server answering with modelled latency and failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandboxes.search import BM25Index, Document, SearchClient, SearchServer, TraceFaultModel
from sandboxes.search.latency import CallRecord, fit, read_tool_calls


def write_trace(directory: Path, calls: list[dict]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rows = [{"tool_calls": calls[i : i + 2]} for i in range(0, len(calls), 2)]
    (directory / "multiturn_workload_step_0.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return directory


def test_reading_a_trace_and_a_bad_line_named(tmp_path: Path) -> None:
    calls = [{"query_count": 1, "latency_s": 0.2, "status": "success"},
             {"query_count": 0, "latency_s": 0.0, "status": "unknown"}]
    records = read_tool_calls(write_trace(tmp_path / "ok", calls))
    assert records == [CallRecord(1, 0.2, "success"), CallRecord(0, 0.0, "unknown")]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "multiturn_workload_step_3.jsonl").write_text('{"tool_calls": [{"latency_s": 1}]}\n')
    with pytest.raises(ValueError, match="multiturn_workload_step_3.jsonl:1"):
        read_tool_calls(bad)
    with pytest.raises(FileNotFoundError):
        read_tool_calls(tmp_path / "empty-dir-that-does-not-exist")


@pytest.mark.parametrize("mode", ["empirical", "parametric"])
def test_draws_follow_the_fit_and_are_seeded(mode: str) -> None:
    records = [CallRecord(1, 0.1 * (1 + i % 10), "success") for i in range(500)]
    records += [CallRecord(1, 0.001, "api_error") for _ in range(50)]
    fitted = fit(records)
    assert fitted["buckets"]["1"]["status"] == pytest.approx({"success": 500 / 550, "api_error": 50 / 550})
    a = [TraceFaultModel(mode, fitted, seed=3).sample(1) for _ in range(3)]
    b = [TraceFaultModel(mode, fitted, seed=3).sample(1) for _ in range(3)]
    assert a == b
    model = TraceFaultModel(mode, fitted, seed=1)
    draws = [model.sample(1) for _ in range(4000)]
    ok = sorted(d[0] for d in draws if d[1] == "success")
    assert 0.05 < ok[len(ok) // 2] < 1.05
    assert 0.06 < sum(d[1] == "api_error" for d in draws) / len(draws) < 0.12


def test_the_shipped_fit_covers_the_published_query_counts() -> None:
    model = TraceFaultModel("empirical", seed=0)
    assert set(model.fitted["buckets"]) >= {"0", "1", "2", "3+"}
    latencies = sorted(model.sample(1)[0] for _ in range(2000))
    assert 0.1 < latencies[1000] < 0.3  # the published p50 is 0.16 s


@pytest.mark.anyio
async def test_the_server_answers_with_modelled_latency_scaled_down() -> None:
    index = BM25Index([Document("0", '"A"\nalpha beta'), Document("1", '"B"\ngamma delta')])
    async with SearchServer(index, TraceFaultModel("parametric", seed=0), time_scale=0.01) as server, \
            SearchClient(server.url, retries=3, backoff=0.001) as client:
        for _ in range(20):
            result, attempts = await client.retrieve(["gamma"], topk=1)
            assert result[0][0]["document"]["id"] == "1" and attempts[-1].status == "success"
