"""The search QA environment (envs/search_qa.py) against the real in-process search server:
tasks only a search answers, reference episodes, rewards, and tool failures that never lose
an episode."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import anyio
import pytest
from helpers import TOK, quick_config, run_spans, scripted_engine

from envs.errors import EnvError, EnvNotRunning
from envs.registry import make_spec
from envs.search_qa import SearchQASpec, exact_match, f1, normalize, tool_call_text
from orchestrator.builders import run
from orchestrator.config.schema import RolloutConfig
from orchestrator.engines.simulated import SimulatedEngine
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.run.warmstart import demonstration_tokens
from orchestrator.trace.recorder import Recorder
from sandboxes.search import SearchClient, SearchError, SearchServer


@pytest.fixture
def spec() -> SearchQASpec:
    return SearchQASpec(train_size=40, eval_size=10, latency="empirical", time_scale=0.01)


@pytest.fixture
async def running(spec: SearchQASpec) -> AsyncIterator[SearchQASpec]:
    """The spec with its in-process search server on the test's event loop."""
    async with spec.running():
        yield spec


def test_names_never_repeat_across_splits_and_the_top_hit_holds_the_answer(spec: SearchQASpec) -> None:
    train, evals = spec.tasks("train"), spec.tasks("eval")
    assert len(train) == 40 and len(evals) == 10
    names = [t.metadata["name"] for t in (*train, *evals)]
    assert len(set(names)) == len(names)
    for task in (*train, *evals):
        (top, _), = spec.index.search(str(task.metadata["name"]), 1)
        assert task.answer in top.contents and str(task.metadata["name"]) in top.contents
    assert {t.metadata["kind"] for t in train} == {"town", "job"}
    with pytest.raises(KeyError, match="unknown split"):
        spec.tasks("test")


def test_the_registry_builds_it_by_name_and_rejects_bad_values() -> None:
    assert isinstance(make_spec("search_qa", train_size=5, eval_size=0), SearchQASpec)
    with pytest.raises(ValueError, match="env.questions"):
        SearchQASpec(questions=["colour"])
    with pytest.raises(ValueError, match="env.failure_rate"):
        SearchQASpec(failure_rate=2.0)


def test_answers_are_normalised_before_they_are_compared() -> None:
    assert normalize("  The  Solufe! ") == "solufe"
    assert exact_match("a baker.", "baker") == 1.0 and exact_match("bakers", "baker") == 0.0
    assert f1("lives in Solufe", "Solufe") == pytest.approx(0.5)
    assert f1("", "Solufe") == 0.0


@pytest.mark.anyio
async def test_a_reference_episode_searches_reads_and_is_rewarded(running: SearchQASpec) -> None:
    spec = running
    task = spec.tasks("train")[3]
    demo = spec.demonstration(task)
    async with spec.make_env() as env:
        assert await env.reset(task) == demo[:1]
        step = await env.step(demo[1]["content"])
        assert not step.done and step.observation == (demo[2],)  # what the warm start shows
        (call,) = step.tool_calls
        assert call.name == "search" and call.status == "ok" and call.latency > 0
        assert call.metadata["attempts"] == 1 and call.metadata["query_count"] == 1
        step = await env.step(task.answer)
        assert step.done
        reward = await env.reward()
    assert reward.total == 1.0
    assert reward.components == {"em": 1.0, "searched": 1.0}


@pytest.mark.anyio
async def test_an_answer_without_a_search_is_logged_as_such(running: SearchQASpec) -> None:
    spec = running
    task = spec.tasks("train")[0]
    async with spec.make_env() as env:
        await env.reset(task)
        assert (await env.step("Nobody")).done
        reward = await env.reward()
    assert reward.components["searched"] == 0.0 and reward.total == 0.0


@pytest.mark.anyio
async def test_f1_can_be_the_reward() -> None:
    spec = SearchQASpec(train_size=4, eval_size=0, reward="f1", latency="none")
    task = spec.tasks("train")[0]
    async with spec.running(), spec.make_env() as env:
        await env.reset(task)
        await env.step(f"it is {task.answer}")
        reward = await env.reward()
    assert reward.total == pytest.approx(reward.components["f1"]) and 0 < reward.total < 1
    assert "em" not in reward.components  # a term only where env.reward names it


@pytest.mark.anyio
async def test_a_search_that_keeps_failing_is_an_error_observation_not_a_lost_episode() -> None:
    spec = SearchQASpec(train_size=4, eval_size=0, latency="none", failure_rate=1.0,
                        retries=2, backoff=0.001)
    task = spec.tasks("train")[0]
    async with spec.running(), spec.make_env() as env:
        await env.reset(task)
        step = await env.step(tool_call_text("search", {"query": str(task.metadata["name"])}))
        (call,) = step.tool_calls
        assert call.status == "error" and call.error_kind == "tool_failed"
        assert call.metadata["attempts"] == 3  # the first try and two retries
        assert call.metadata["attempt_statuses"] == ["http_503"] * 3
        assert step.observation[0]["content"].startswith("[error] search: search failed after 3 attempt(s)")
        assert not step.done
        assert (await env.step(task.answer)).done  # the model may still answer
        assert (await env.reward()).total == 1.0


@pytest.mark.anyio
async def test_malformed_calls_are_observations_the_model_can_read(running: SearchQASpec) -> None:
    spec = running
    task = spec.tasks("train")[0]
    async with spec.make_env() as env:
        await env.reset(task)
        bad_json = await env.step('<tool_call>{"name":"search","arguments":{"query":}</tool_call>')
        unknown = await env.step(tool_call_text("browse", {"url": "x"}))
        bad_type = await env.step(tool_call_text("search", {"query": 7}))
    kinds = [s.tool_calls[0].error_kind for s in (bad_json, unknown, bad_type)]
    assert kinds == ["malformed_json", "unknown_tool", "bad_arguments"]
    assert all(not s.done and s.observation[0]["content"].startswith("[error]")
               for s in (bad_json, unknown, bad_type))


@pytest.mark.anyio
async def test_the_server_lives_on_the_callers_loop_inside_running_only(spec: SearchQASpec) -> None:
    name = str(spec.tasks("train")[0].metadata["name"])
    with pytest.raises(EnvNotRunning, match="inside `async with spec.running"):
        spec.make_env()
    async with spec.running():
        url = spec.url
        async with SearchClient(url, retries=0) as client:
            (hits,), _ = await client.retrieve([name], topk=1, return_scores=False)
        assert name in hits[0]["contents"]
        with pytest.raises(EnvError, match="already running"):
            async with spec.running():
                pass
    with pytest.raises(EnvNotRunning):
        spec.url  # noqa: B018
    async with SearchClient(url, retries=0) as client:  # stopped with the block, port closed
        with pytest.raises(SearchError, match="connection_error"):
            await client.retrieve([name])


@pytest.mark.anyio
async def test_an_external_server_needs_no_in_process_one() -> None:
    spec = SearchQASpec(train_size=4, eval_size=0, latency="none")
    async with SearchServer(spec.index) as server:
        external = SearchQASpec(train_size=4, eval_size=0, latency="none", search_url=server.url)
        task = external.tasks("train")[0]
        async with external.running(), external.make_env() as env:
            await env.reset(task)
            step = await env.step(tool_call_text("search", {"query": str(task.metadata["name"])}))
        assert step.tool_calls[0].status == "ok" and task.answer in step.observation[0]["content"]
        assert server.requests == 1 and external.url == server.url


def test_under_trio_it_says_to_use_asyncio_or_an_external_server() -> None:
    spec = SearchQASpec(train_size=4, eval_size=0, latency="none")

    async def enter() -> None:
        async with spec.running():
            pass

    with pytest.raises(EnvError, match="asyncio backend"):
        anyio.run(enter, backend="trio")


def reference_policy(spec: SearchQASpec) -> SimulatedEngine:
    """Plays the reference episode: search the question, then copy the answer from the hit."""

    def reply(prompt: list[int]) -> str:
        text = TOK.decode(prompt)
        hit = re.search(r"(\w+) lives in (\w+) and works as a (\w+)\.$", text)
        if hit is None:  # search with the question, as the reference episode does
            question = re.match(r"(Where does \w+ live\?|What is the job of \w+\?)", text)
            assert question is not None
            return tool_call_text("search", {"query": question.group(1)})
        return hit.group(2) if "Where does" in text else hit.group(3)

    return scripted_engine(reply)


@pytest.mark.anyio
async def test_the_runner_lays_out_exactly_the_tokens_the_warm_start_learns(running: SearchQASpec) -> None:
    spec = running
    task = spec.tasks("train")[5]
    config = RolloutConfig(max_tokens=100, max_turns=3, group_size=1)
    recorder = Recorder()
    runner = EpisodeRunner(reference_policy(spec), TOK, spec, config, recorder)
    trajectory, _ = await runner.episode(task, "w")
    ids, mask = demonstration_tokens(TOK, spec.demonstration(task))
    assert list(trajectory.token_ids) == ids and list(trajectory.loss_mask) == mask
    assert trajectory.reward == 1.0 and trajectory.end_reason == "done"
    assert trajectory.metrics["reward/searched"] == 1.0
    (span,) = [s for s in recorder.spans if s.stage == "tool_call"]
    assert span.attributes["tool"] == "search" and span.attributes["status"] == "ok"
    assert span.end > span.start


@pytest.mark.anyio
async def test_many_episodes_against_a_flaky_service_all_finish() -> None:
    spec = SearchQASpec(train_size=32, eval_size=0, latency="empirical", time_scale=0.002,
                        failure_rate=0.4, retries=1, backoff=0.001)
    config = RolloutConfig(max_tokens=100, max_turns=3, group_size=4)
    recorder = Recorder()
    groups = []
    async with spec.running(), anyio.create_task_group() as tg:
        async def one(task_index: int) -> None:
            task = spec.tasks("train")[task_index]
            runner = EpisodeRunner(reference_policy(spec), TOK, spec, config, recorder)
            groups.append((await runner.group(task, f"w{task_index}")).group)
        for i in range(32):
            tg.start_soon(one, i)
    trajectories = [t for g in groups for t in g.trajectories]
    assert len(trajectories) == 128  # no episode lost
    statuses = [s.attributes["status"] for s in recorder.spans if s.stage == "tool_call"]
    assert "error" in statuses and "ok" in statuses
    # a failed search shows an error, so the scripted policy searches again (up to max_turns)
    assert sum(t.reward for t in trajectories) > 0


def test_experiment_search_qa_trains_and_records_every_tool_call(tmp_path: Path) -> None:
    cfg = quick_config("search_qa", "env.time_scale=0.01", "rollout.max_tokens=12")
    result = run(cfg, tmp_path)
    assert len(result.reports) == 2
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for m in metrics[:-1]:
        assert 0.0 <= m["reward/searched"] <= 1.0  # the share of answers preceded by a search
        assert "reward/em" in m and "episode/turns" in m
    spans = run_spans(tmp_path)
    calls = [s for s in spans if s["stage"] == "tool_call"]
    for span in calls:
        assert span["end"] >= span["start"] and span["attributes"]["status"] in {"ok", "error", "timeout"}
    # every tool call the trainer saw is in the spans: count them from the per-episode metrics
    trained_calls = sum(m.get("tools/calls", 0.0) * 8 for m in metrics[:-1])
    assert len(calls) >= round(trained_calls)


@pytest.mark.anyio
@pytest.mark.slow  # left out of scripts/test.sh --quick
async def test_faults_turned_on_at_the_server_are_ridden_out_and_counted() -> None:
    """The server's /faults control (the chaos soak's): 500s, then held requests, then slow
    answers; the episode's searches retry through them and the spec counts each failed
    attempt, and each answer past slow_request_s, in its faults/* metrics."""
    spec = SearchQASpec(train_size=4, eval_size=0, latency="none")
    async with SearchServer(spec.index, control=True) as server:
        external = SearchQASpec(train_size=4, eval_size=0, latency="none", search_url=server.url,
                                request_timeout=0.3, retries=1, backoff=0.001,
                                slow_request_s=0.05)
        task = external.tasks("train")[0]
        query = tool_call_text("search", {"query": str(task.metadata["name"])})
        async with aiohttp.ClientSession() as http, external.running():

            async def turn_on(mode: str, seconds: float, delay_s: float = 0.0) -> dict:
                async with http.post(f"{server.url}/faults", json={
                        "mode": mode, "seconds": seconds, "delay_s": delay_s}) as response:
                    assert response.status == 200
                    return await response.json()

            assert not [k for k in external.metrics() if k.startswith("faults/")]
            statuses = []
            for mode, seconds, delay in (("error", 30, 0), ("hang", 30, 0), ("slow", 30, 0.05)):
                assert (await turn_on(mode, seconds, delay))["active"] == mode
                async with external.make_env() as env:
                    await env.reset(task)
                    step = await env.step(query)
                statuses.append(step.tool_calls[0].metadata["attempt_statuses"])
            async with http.get(f"{server.url}/faults") as response:
                served = (await response.json())["served"]
            async with http.post(f"{server.url}/faults", json={"mode": "nap", "seconds": 1}) as bad:
                assert bad.status == 400 and "mode" in (await bad.json())["error"]
    assert statuses == [["http_500"] * 2, ["timeout"] * 2, ["success"]]
    assert served == {"error": 2, "hang": 2, "slow": 1}
    # the slow answer came within the timeout (no retry) and is counted as slow
    faults = {k: v for k, v in external.metrics().items() if k.startswith("faults/")}
    assert faults == {"faults/search_errors": 2.0, "faults/search_timeouts": 2.0,
                      "faults/search_slow": 1.0}
