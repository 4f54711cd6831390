"""The multi-turn tool environment (envs/tool_env.py): turns, observations, per-episode tool
state released at the end (also on cancellation), and weighted rewards."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from envs.base import Reward, RewardTerm, Task
from envs.tool_env import Episode, ToolEnv
from envs.tools import EpisodeContext, tool
from envs.toolset import ToolSet

pytestmark = pytest.mark.anyio
opened: list[str] = []
closed: list[str] = []


@asynccontextmanager
async def session() -> AsyncIterator[dict[str, int]]:
    opened.append("session")
    try:
        yield {"calls": 0}
    finally:
        closed.append("session")


@tool
async def counter(ctx: EpisodeContext) -> str:
    """Count calls within this episode."""
    state = await ctx.resource("session", session)
    state["calls"] += 1
    return str(state["calls"])


@tool
async def hang(ctx: EpisodeContext) -> str:
    """Open the session, then wait forever."""
    await ctx.resource("session", session)
    await anyio.sleep_forever()
    return ""


async def answered_two(episode: Episode) -> float:
    return 1.0 if episode.final_reply.strip() == "2" else 0.0


async def used_tools(episode: Episode) -> float:
    return float(len(episode.tool_calls))


CALL = '<tool_call>{"name": "counter", "arguments": {}}</tool_call>'
TASK = Task(id=0, messages=({"role": "user", "content": "count twice"},), answer="2")


def make_env() -> ToolEnv:
    async def score(episode: Episode) -> Reward:
        return Reward.weighted([RewardTerm("answer", 1.0, await answered_two(episode))],
                               {"tool_calls": await used_tools(episode)})

    return ToolEnv(ToolSet([counter, hang]), score, system_prompt="Use tools.")


async def test_a_multi_turn_episode_with_state_rewards_and_cleanup() -> None:
    opened.clear(), closed.clear()
    async with make_env() as env:
        opening = await env.reset(TASK)
        assert opening[0]["role"] == "system" and "counter" in opening[0]["content"]
        assert "ctx" not in json.dumps(env.tools.schemas)  # injected, not for the model
        first = await env.step(CALL)
        second = await env.step(CALL)
        assert not first.done and first.observation == ({"role": "tool", "content": "1"},)
        assert second.observation[0]["content"] == "2"  # the session persisted across turns
        assert first.metrics["tools/ok"] == 1
        final = await env.step("2")
        assert final.done
        reward = await env.reward()
        assert reward.total == 1.0 and reward.components == {"answer": 1.0, "tool_calls": 2.0}
        # released before the rewards ran, so a reward needing a sandbox never waits on it
        assert opened == ["session"] and closed == ["session"]
    assert closed == ["session"]  # and closing again at the end is harmless


async def test_tool_state_is_released_when_the_episode_is_cancelled() -> None:
    opened.clear(), closed.clear()
    env = make_env()
    with anyio.move_on_after(0.1):
        async with env:
            await env.reset(TASK)
            await env.step('<tool_call>{"name": "hang", "arguments": {}}</tool_call>')
    assert opened == ["session"] and closed == ["session"]


async def test_a_malformed_call_is_an_observation_and_the_episode_goes_on() -> None:
    async with make_env() as env:
        await env.reset(TASK)
        result = await env.step("<tool_call>{not json</tool_call>")
        assert not result.done and "not valid JSON" in result.observation[0]["content"]
        assert result.metrics["tools/error/malformed_json"] == 1
        assert (await env.step("2")).done
