"""The mock search service (sandboxes/search/): real HTTP on an ephemeral port, BM25 ranking,
Search-R1's response shape, injected failures, client retries, and 1,000 concurrent requests."""

from __future__ import annotations

import json
import random

import aiohttp
import anyio
import pytest

from sandboxes.search import (
    BM25Index,
    Document,
    FaultModel,
    SearchClient,
    SearchError,
    SearchServer,
)

pytestmark = pytest.mark.anyio

CORPUS = [
    Document("0", '"Paris"\nParis is the capital of France.'),
    Document("1", '"Berlin"\nBerlin is the capital of Germany.'),
    Document("2", '"Banana"\nThe banana is a yellow fruit.'),
    Document("3", '"Rome"\nRome is the capital of Italy, home of the Colosseum.'),
]


class Scripted(FaultModel):
    def __init__(self, statuses: list[str]) -> None:
        self.statuses = statuses

    def sample(self, query_count: int) -> tuple[float, str]:
        return 0.0, self.statuses.pop(0) if self.statuses else "success"


class Random(FaultModel):
    def __init__(self, failure_rate: float) -> None:
        self.rng = random.Random(0)
        self.failure_rate = failure_rate
        self.injected = 0

    def sample(self, query_count: int) -> tuple[float, str]:
        if self.rng.random() < self.failure_rate:
            self.injected += 1
            return 0.001, "api_error"
        return 0.001, "success"


def test_bm25_ranks_the_matching_document_first() -> None:
    index = BM25Index(CORPUS)
    hits = index.search("capital of Italy", 2)
    assert hits[0][0].id == "3" and hits[0][1] > hits[1][1] > 0
    assert index.search("zebra", 3) == []


async def test_retrieve_answers_in_search_r1_shape() -> None:
    async with SearchServer(BM25Index(CORPUS)) as server, SearchClient(server.url) as client:
        assert server.port > 0
        result, attempts = await client.retrieve(["banana fruit", "capital of Germany"], topk=2)
        assert [a.status for a in attempts] == ["success"]
        assert result[0][0]["document"] == {"id": "2", "contents": '"Banana"\nThe banana is a yellow fruit.'}
        assert isinstance(result[0][0]["score"], float) and result[1][0]["document"]["id"] == "1"
        plain, _ = await client.retrieve(["Paris"], topk=1, return_scores=False)
        assert plain == [[{"id": "0", "contents": '"Paris"\nParis is the capital of France.'}]]


@pytest.mark.parametrize(("body", "fragment"), [
    ({"queries": "not a list"}, '"queries" must be a list of strings'),
    ({"queries": []}, '"queries" must hold 1 to'),
    ({"queries": ["x"], "topk": 0}, '"topk" must be a whole number'),
    ([1, 2], "must be an object"),
])
async def test_bad_requests_get_400_and_one_sentence(body: object, fragment: str) -> None:
    async with SearchServer(BM25Index(CORPUS)) as server, aiohttp.ClientSession() as session:
        async with session.post(f"{server.url}/retrieve", json=body) as response:
            assert response.status == 400
            assert fragment in (await response.json())["error"]


async def test_the_client_retries_injected_failures_and_records_every_attempt() -> None:
    faults = Scripted(["api_error", "unknown"])
    async with SearchServer(BM25Index(CORPUS), faults) as server, \
            SearchClient(server.url, retries=3, backoff=0.001) as client:
        result, attempts = await client.retrieve(["Rome"], topk=1)
        assert [a.status for a in attempts] == ["http_503", "http_500", "success"]
        assert result[0][0]["document"]["id"] == "3"


async def test_the_client_gives_up_with_every_attempt_recorded() -> None:
    faults = Scripted(["api_error"] * 10)
    async with SearchServer(BM25Index(CORPUS), faults) as server, \
            SearchClient(server.url, retries=2, backoff=0.001) as client:
        with pytest.raises(SearchError) as info:
            await client.retrieve(["Rome"])
        assert [a.status for a in info.value.attempts] == ["http_503"] * 3


async def test_a_slow_server_times_out_on_the_client() -> None:
    class Slow(FaultModel):
        def sample(self, query_count: int) -> tuple[float, str]:
            return 1.0, "success"

    async with SearchServer(BM25Index(CORPUS), Slow()) as server, \
            SearchClient(server.url, timeout=0.05, retries=1, backoff=0.001) as client:
        with pytest.raises(SearchError) as info:
            await client.retrieve(["Rome"])
        assert [a.status for a in info.value.attempts] == ["timeout", "timeout"]


async def test_a_thousand_concurrent_requests_lose_nothing_to_injected_failures() -> None:
    faults = Random(failure_rate=0.05)
    failures: list[str] = []
    async with SearchServer(BM25Index(CORPUS), faults) as server, \
            SearchClient(server.url, retries=5, backoff=0.001, max_connections=1000) as client:

        async def one(i: int) -> None:
            try:
                result, attempts = await client.retrieve([f"capital {i}"], topk=1)
                assert result[0][0]["document"]["id"] in {"0", "1", "3"}
            except SearchError as e:
                failures.append(str(e))

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(1000):
                    tg.start_soon(one, i)
    assert failures == []
    assert faults.injected > 0 and server.requests == 1000 + faults.injected


async def test_the_server_runs_standalone_from_the_command_line(tmp_path) -> None:  # noqa: ANN001
    import socket
    import subprocess
    import sys

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps(d.as_json()) for d in CORPUS) + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "sandboxes.search", "--corpus", str(corpus), "--port", str(port),
         "--latency", "empirical", "--time-scale", "0.01"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert "search server on" in process.stdout.readline()
        async with SearchClient(f"http://127.0.0.1:{port}") as client:
            result, _ = await client.retrieve(["capital of Italy"], topk=1)
        assert result[0][0]["document"]["id"] == "3"
    finally:
        process.terminate()
        process.wait(timeout=10)
        process.stdout.close()
