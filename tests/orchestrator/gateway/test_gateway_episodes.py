"""The gateway's recording, driven by real openai clients over real HTTP: a tool loop is one
segment whose ids are exactly the engine's; a rewritten history starts a segment; keys; bad
input; streaming, n, stop strings, /v1/completions and /v1/models."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anyio
import openai
import pytest
from helpers import TOK, scripted_engine
from toy_agents import ADD_TOOL

from envs.agent import AgentSpec
from envs.base import Task
from envs.parsers import HermesParser
from orchestrator.config.schema import RolloutConfig
from orchestrator.gateway import Gateway, GatewayConfig, run_agent_episode
from orchestrator.trace.recorder import Recorder

pytestmark = pytest.mark.anyio

TOOL_ID = TOK.chat_prompt([{"role": "tool", "content": ""}], continuation=True)[0]
TASK = Task(id=7, messages=({"role": "user", "content": "3+4="},), answer="7")
ROLLOUT = RolloutConfig(group_size=1, max_tokens=100, temperature=1.0)


def scripted(prompt: list[int]) -> str:
    """Call `add` first; once a tool result is in the prompt, answer with it."""
    if TOOL_ID in prompt:
        return TOK.decode(prompt[len(prompt) - prompt[::-1].index(TOOL_ID):]).strip()
    return HermesParser.format("add", {"a": 3, "b": 4})


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    async with Gateway(scripted_engine(scripted), TOK, Recorder(),
                       GatewayConfig(max_context=2048, max_n=4)) as gw:
        yield gw


async def test_a_tool_loop_is_one_segment_of_exactly_the_engines_tokens(gateway: Gateway) -> None:
    spec = AgentSpec(program="toy_agents:calculator")
    episodes, outcome = await run_agent_episode(gateway, spec, TASK, ROLLOUT, "w", 0)
    assert (outcome.status, outcome.reward.total) == ("ok", 1.0)
    engine: Any = gateway.engine
    first, second = engine.replies.prompts  # the call with the tool's result extended the first
    [(t, timing)] = episodes
    assert second[:len(first)] == first and tuple(second) == t.token_ids[:len(second)]
    # trained: exactly the two generations; everything else (prompt, tool result) masked
    trained = [tok for tok, m in zip(t.token_ids, t.loss_mask, strict=True) if m]
    replies = [TOK.completion(scripted(p)) for p in (first, second)]
    assert trained == replies[0] + replies[1]
    assert t.token_ids[len(second):] == tuple(replies[1])
    assert t.reward == 1.0 and t.end_reason == "done" and t.metrics["agent/calls"] == 2.0
    assert {v for v, m in zip(t.versions, t.loss_mask, strict=True) if m} == {engine.version}
    # PolyTrace: two turns, the first a tool call (the program's time between the calls)
    assert [turn.finish_reason for turn in timing.turns] == ["tool_calls", "stop"]
    assert [c.name for c in timing.tool_calls] == ["agent"]
    stages = [s.stage for s in gateway.recorder.spans]
    assert stages.count("generate") == 2 and stages.count("tool_call") == 1


async def chat(gateway: Gateway, key: str, **body: Any) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.post(
            f"{gateway.base_url}/chat/completions", json=body,
            headers={"Authorization": f"Bearer {key}"} if key else {}) as r:
        return r.status, await r.json()


async def test_a_rewritten_history_starts_a_segment_and_each_is_a_sample(gateway: Gateway) -> None:
    user = {"role": "user", "content": "3+4="}
    async with gateway.episode(ROLLOUT, "w", 0) as episode:
        key = episode.endpoint.api_key
        _, first = await chat(gateway, key, model="m", messages=[user], tools=[ADD_TOOL])
        reply = first["choices"][0]["message"]
        assert first["choices"][0]["finish_reason"] == "tool_calls"
        assert json.loads(reply["tool_calls"][0]["function"]["arguments"]) == {"a": 3, "b": 4}
        tool = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "7"}
        await chat(gateway, key, model="m", messages=[user, reply, tool], tools=[ADD_TOOL])
        await chat(gateway, key, model="m", messages=[{"role": "user", "content": "summary"}])
    from envs.agent import AgentOutcome
    from envs.base import Reward
    segments = episode.trajectories(AgentOutcome(Reward(0.5)), 7, {}, itertools.count())
    assert len(segments) == 2 and all(t.reward == 0.5 for t, _ in segments)
    assert [len(timing.turns) for _, timing in segments] == [2, 1]
    assert [t.sample_index for t, _ in segments] == [0, 1]


async def test_keys_missing_unknown_or_expired_get_401_and_record_nothing(gateway: Gateway) -> None:
    user = [{"role": "user", "content": "hi"}]
    assert (await chat(gateway, "", model="m", messages=user))[0] == 401
    status, body = await chat(gateway, "sk-polyrl-guess", model="m", messages=user)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    async with gateway.episode(ROLLOUT, "w", 0) as episode:
        key = episode.endpoint.api_key
    assert (await chat(gateway, key, model="m", messages=user))[0] == 401
    assert episode.segments == [] and episode.calls == 0
    assert gateway.recorder.spans == [] and gateway.engine.replies.prompts == []  # type: ignore[attr-defined]


@pytest.mark.parametrize(("body", "param"), [
    (b"{not json", None),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temprature": 1}, "temprature"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": "2"}, "n"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 5}, "n"),
    ({"model": "m", "messages": "x"}, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": "x" * 3000}]}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
     "top_logprobs"),
])
async def test_bad_input_is_a_400_with_an_openai_error_and_the_episode_goes_on(
        gateway: Gateway, body: Any, param: str | None) -> None:
    async with gateway.episode(ROLLOUT, "w", 0) as episode, aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {episode.endpoint.api_key}"}
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with http.post(f"{gateway.base_url}/chat/completions", data=raw,
                             headers=headers) as r:
            error = (await r.json())["error"]
            assert r.status == 400, error
        assert error["type"] == "invalid_request_error" and error["param"] == param
        assert error["message"]
        assert episode.calls == 0 and episode.segments == []
        status, ok = await chat(gateway, episode.endpoint.api_key, model="m",
                                messages=[{"role": "user", "content": "x"}], tools=[ADD_TOOL])
        assert status == 200 and ok["choices"][0]["message"]["tool_calls"]
    assert gateway.metrics()["agent/bad_requests"] == 1.0


async def test_streaming_n_stop_and_logprobs_through_the_sdk(gateway: Gateway) -> None:
    async with gateway.episode(ROLLOUT, "w", 0) as episode:
        client = openai.AsyncOpenAI(base_url=episode.endpoint.base_url,
                                    api_key=episode.endpoint.api_key, max_retries=0)
        async with client:
            user = [{"role": "user", "content": "3+4="}]
            stream = await client.chat.completions.create(
                model="m", messages=user, tools=[{"type": "function", "function": {
                    "name": "add", "parameters": {"type": "object"}}}], stream=True,
                stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            assert calls[0].function.name == "add"
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
            many = await client.chat.completions.create(model="m", messages=user, n=3,
                                                        stop=['"b"'], logprobs=True)
            assert len(many.choices) == 3
            for choice in many.choices:
                assert choice.message.content == '<tool_call>{"name":"add","arguments":{"a":3,'
                assert choice.finish_reason == "stop"
                # every sampled (and trained) token, the stop string's included
                assert [t.logprob for t in choice.logprobs.content] == [-0.5] * len(
                    choice.message.content + '"b"')
            models = await client.models.list()
            assert [m.id for m in models.data] == ["policy"]
    # the stream's call and the three choices: four samples, each ending where its text does
    assert episode.generated_segments == 4


async def test_completions_extend_by_text(gateway: Gateway) -> None:
    async with gateway.episode(ROLLOUT, "w", 0) as episode:
        client = openai.AsyncOpenAI(base_url=episode.endpoint.base_url,
                                    api_key=episode.endpoint.api_key, max_retries=0)
        async with client:
            first = await client.completions.create(model="m", prompt="Q: 3+4?\nA:", max_tokens=5)
            text = "Q: 3+4?\nA:" + first.choices[0].text
            await client.completions.create(model="m", prompt=text + "\nQ: again?\nA:")
    assert episode.generated_segments == 1 and len(episode.segments[0].trace.turns) == 1


async def test_a_sync_client_from_a_worker_thread(gateway: Gateway) -> None:
    spec = AgentSpec(program="toy_agents:calculator_sync")
    segments, outcome = await run_agent_episode(gateway, spec, TASK, ROLLOUT, "w", 0)
    assert (outcome.status, outcome.reward.total, len(segments)) == ("ok", 1.0, 1)
    assert segments[0][0].metrics["agent/calls"] == 2.0


async def test_a_call_after_the_episode_or_one_left_in_flight_fails_it(gateway: Gateway) -> None:
    entered, never = anyio.Event(), anyio.Event()

    async def slow(prompt: list[int], sampling: Any) -> Any:
        entered.set()
        await never.wait()

    engine: Any = gateway.engine
    engine.generate = slow
    results: list[int] = []
    async with gateway.episode(ROLLOUT, "w", 0) as episode, anyio.create_task_group() as tg:

        async def call() -> None:
            results.append((await chat(gateway, episode.endpoint.api_key, model="m",
                                       messages=[{"role": "user", "content": "x"}]))[0])

        tg.start_soon(call)
        await entered.wait()  # the call is generating
        assert episode.close() is True  # what run_agent_episode counts as a failure
    assert results == [401]


async def test_an_agents_sdk_runner_with_a_function_tool(gateway: Gateway) -> None:
    spec = AgentSpec(program="toy_agents:agents_sdk")
    episodes, outcome = await run_agent_episode(gateway, spec, TASK, ROLLOUT, "w", 0)
    assert (outcome.status, outcome.reward.total) == ("ok", 1.0), outcome.error
    # the Runner sent the tool's result after the call it answered: one segment of two turns
    [(t, timing)] = episodes
    assert t.metrics["agent/calls"] == 2.0 and len(timing.turns) == 2


async def test_a_transcript_is_scored_by_the_envs_reward_functions(gateway: Gateway) -> None:
    spec = AgentSpec(program="toy_agents:transcript",
                     reward={"toy_agents:transcript_digits": 2.0})
    async with spec.running():  # env.reward's workers: a user's function runs isolated
        [(t, _)], outcome = await run_agent_episode(gateway, spec, TASK, ROLLOUT, "w", 0)
    # the scripted reply (no tools offered, so it stays text): a call with two digits in it
    call = HermesParser.format("add", {"a": 3, "b": 4})
    share = sum(c.isdigit() for c in call) / len(call)
    assert outcome.reward.components == {"toy_agents:transcript_digits": pytest.approx(share)}
    assert t.reward == pytest.approx(2 * share)
    assert t.metrics["reward/toy_agents:transcript_digits"] > 0


async def test_a_transcript_reward_that_hangs_is_cut_off_and_counted(gateway: Gateway) -> None:
    """It ran on the event loop with no limit before: a hang stalled the run."""
    spec = AgentSpec(program="toy_agents:transcript", reward="toy_agents:hangs",
                     reward_timeout_s=1.0)
    started = time.monotonic()
    async with spec.running():
        _, outcome = await run_agent_episode(gateway, spec, TASK, ROLLOUT, "w", 0)
    assert time.monotonic() - started < 10
    assert outcome.status == "ok" and outcome.reward.total == 0.0
    assert outcome.reward.components["failed"] == 1.0
    assert spec.metrics()["reward/failed/toy_agents:hangs/timeout"] == 1.0
    assert spec.reward_failure() == "toy_agents:hangs: timeout: no result within 1 s"


def test_a_wrong_program_or_setting_is_one_line() -> None:
    with pytest.raises(ValueError, match="env.program=toy_agents:nothing: toy_agents has no"):
        AgentSpec(program="toy_agents:nothing")
    with pytest.raises(ValueError, match="env.rewards is replaced by env.reward"):
        AgentSpec(program="toy_agents:transcript", rewards={"toy_agents:transcript_digits": 1})
    with pytest.raises(ValueError, match="fits none of the three conventions"):
        AgentSpec(program="toy_agents:transcript", reward="toy_agents:transcript")
    with pytest.raises(ValueError, match="env.timeout_s must be > 0"):
        AgentSpec(program="toy_agents:calculator", timeout_s=0)
