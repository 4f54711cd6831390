"""A verifiers (0.4) environment rolled out against the gateway: its harness's calls reach the
gateway through verifiers' own interception server, one rollout is one segment of exactly
the engine's tokens, and verifiers' rubric is the episode's reward."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import TOK, scripted_engine
from test_gateway_episodes import ROLLOUT, TOOL_ID, scripted

from envs.agent import AgentSpec
from orchestrator.gateway import Gateway, GatewayConfig, run_agent_episode
from orchestrator.trace.recorder import Recorder

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("program", ["toy_verifiers:run", "toy_verifiers:run_streaming"])
@pytest.mark.slow  # left out of scripts/test.sh --quick
async def test_a_verifiers_rollout_is_one_segment_of_exactly_the_engines_tokens(
        program: str) -> None:
    """Plain calls, and streamed ones as verifiers' own chat program makes them (relayed
    by the interception server as the gateway's server-sent events)."""
    spec = AgentSpec(program=program)  # its tasks: toy_verifiers:tasks
    [task] = [t for t in spec.tasks("train") if t.messages[0]["content"] == "3+4="]
    assert task.answer == "7" and len(spec.tasks("train")) == 80 and len(spec.tasks("eval")) == 20
    async with Gateway(scripted_engine(scripted), TOK, Recorder(),
                       GatewayConfig(max_context=2048)) as gateway:
        episodes, outcome = await run_agent_episode(gateway, spec, task, ROLLOUT, "w", 0)
    # the scripted model calls `add`, then answers with the tool's result: verifiers' rubric
    # (the task's @vf.reward) scored the exact sum
    assert (outcome.status, outcome.error) == ("ok", None)
    assert outcome.reward.total == 1.0 and outcome.reward.components == {"digits": 1.0}
    engine: Any = gateway.engine
    first, second = engine.replies.prompts
    assert TOOL_ID not in first and TOOL_ID in second
    [(t, timing)] = episodes  # one segment: the relayed history extended the first call's ids
    assert second[:len(first)] == first and tuple(second) == t.token_ids[:len(second)]
    trained = [tok for tok, m in zip(t.token_ids, t.loss_mask, strict=True) if m]
    assert trained == TOK.completion(scripted(first)) + TOK.completion(scripted(second))
    assert t.reward == 1.0 and t.end_reason == "done" and t.metrics["agent/calls"] == 2.0
    assert t.metrics["reward/digits"] == 1.0
    assert [turn.finish_reason for turn in timing.turns] == ["tool_calls", "stop"]


async def test_a_failed_verifiers_rollout_is_a_failed_episode() -> None:
    """The gateway refuses the harness's call (its prompt is past max_context): verifiers
    records the 400 and fails its rollout, so the episode is failed, with reward 0."""
    spec = AgentSpec(program="toy_verifiers:run")
    task = spec.tasks("train")[0]
    async with Gateway(scripted_engine(scripted), TOK, Recorder(),
                       GatewayConfig(max_context=4)) as gateway:
        episodes, outcome = await run_agent_episode(gateway, spec, task, ROLLOUT, "w", 0)
    assert outcome.status == "error" and outcome.reward.total == 0.0
    assert outcome.error is not None and "VerifiersEpisodeError" in outcome.error
    assert "400" in outcome.error and episodes == []
    assert gateway.counters["errors"] == 1 and gateway.counters["bad_requests"] == 1


@pytest.mark.slow  # left out of scripts/test.sh --quick
async def test_a_verifiers_program_runs_in_a_worker_process() -> None:
    """env.processes: the worker imports the program afresh (it never listed the tasks) and
    finds the verifiers task by its key."""
    spec = AgentSpec(program="toy_verifiers:run", processes=1)
    tasks = {t.messages[0]["content"]: t for t in spec.tasks("train") + spec.tasks("eval")}
    async with spec.running(), Gateway(scripted_engine(scripted), TOK, Recorder(),
                                       GatewayConfig(max_context=2048)) as gateway:
        for prompt in ("3+4=", "9+9="):  # a train task and an eval task
            episodes, outcome = await run_agent_episode(gateway, spec, tasks[prompt], ROLLOUT,
                                                        "w", 0)
            assert (outcome.status, outcome.error) == ("ok", None)
            assert outcome.reward.components == {"digits": 1.0} and len(episodes) == 1
