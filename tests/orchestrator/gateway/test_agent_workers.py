"""env.processes: agent programs in worker processes, recorded by the gateway exactly as in
the run's own loop; a program that raises, hangs, kills its worker or returns what cannot be
sent back fails only its episode, and a dead worker is replaced."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest
from helpers import TOK, scripted_engine
from test_gateway_episodes import ROLLOUT, TASK, scripted

from envs.agent import AgentSpec
from envs.errors import EnvError
from orchestrator.gateway import Gateway, GatewayConfig, run_agent_episode
from orchestrator.trace.recorder import Recorder

pytestmark = pytest.mark.anyio


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    async with Gateway(scripted_engine(scripted), TOK, Recorder(),
                       GatewayConfig(max_context=2048)) as gw:
        yield gw


@pytest.mark.parametrize("program", ["toy_agents:calculator", "toy_agents:calculator_sync"])
async def test_a_program_in_a_worker_process_is_recorded_token_for_token(
        gateway: Gateway, program: str) -> None:
    spec = AgentSpec(program=program, processes=2)
    async with spec.running():
        results = []

        async def one(i: int) -> None:
            results.append(await run_agent_episode(gateway, spec, TASK, ROLLOUT, "w", i))

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
    engine: Any = gateway.engine
    prompts = [tuple(p) for p in engine.replies.prompts]
    assert len(prompts) == 8  # two calls per episode, every one served
    for [(t, _)], outcome in results:
        assert (outcome.status, outcome.reward.total) == ("ok", 1.0), outcome.error
        # the episode's two prompts, the second extending the first by reply and tool result
        first, second = sorted({p for p in prompts if t.token_ids[:len(p)] == p}, key=len)
        trained = [tok for tok, m in zip(t.token_ids, t.loss_mask, strict=True) if m]
        assert trained == TOK.completion(scripted(list(first))) + TOK.completion(
            scripted(list(second)))
        assert t.metrics["agent/calls"] == 2.0


async def test_episodes_spread_over_the_workers_and_none_runs_in_the_runs_process(
        gateway: Gateway) -> None:
    spec = AgentSpec(program="toy_workers:pid", tasks="toy_agents:tasks", processes=2)
    pids: list[float] = []
    async with spec.running():

        async def one(i: int) -> None:
            _, outcome = await run_agent_episode(gateway, spec, TASK, ROLLOUT, "w", i)
            pids.append(outcome.reward.total)

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
    assert len(set(pids)) == 2 and os.getpid() not in pids


@pytest.mark.slow  # left out of scripts/test.sh --quick
async def test_a_failing_program_fails_its_episode_and_a_dead_worker_is_replaced(
        gateway: Gateway) -> None:
    outcomes = {}
    for name in ("raises", "exits", "hangs", "unpicklable"):
        spec = AgentSpec(program=f"toy_workers:{name}", tasks="toy_agents:tasks", processes=1,
                         timeout_s=0.5 if name == "hangs" else 60,
                         reward={"toy_agents:transcript_digits": 1.0})
        async with spec.running():
            _, outcomes[name] = await run_agent_episode(gateway, spec, TASK, ROLLOUT, "w", 0)
            # the worker (or its replacement) serves the next episode
            if name in ("exits", "hangs"):
                assert spec.metrics()["agent/worker_restarts"] == float(name == "exits")
    assert outcomes["raises"].status == "error"
    assert outcomes["raises"].error == "ValueError: no answer for task 7"
    assert outcomes["exits"].status == "error" and "exited with code 3" in outcomes["exits"].error
    assert outcomes["hangs"].status == "timeout"
    assert "cannot be sent back" in outcomes["unpicklable"].error
    assert all(o.reward.total == 0.0 for o in outcomes.values())


async def test_after_a_worker_died_the_next_episode_runs(gateway: Gateway) -> None:
    spec = AgentSpec(program="toy_workers:exits_on_task_0", tasks="toy_agents:tasks",
                     processes=1)
    async with spec.running():
        _, died = await run_agent_episode(gateway, spec, replace(TASK, id=0), ROLLOUT, "w", 0)
        _, outcome = await run_agent_episode(gateway, spec, TASK, ROLLOUT, "w", 1)
        assert spec.metrics() == {"agent/worker_restarts": 1.0}
    assert died.status == "error" and (outcome.status, outcome.reward.total) == ("ok", 1.0)


async def test_worker_processes_need_the_specs_running_block(gateway: Gateway) -> None:
    spec = AgentSpec(program="toy_agents:calculator", processes=1)
    with pytest.raises(EnvError, match="spec.running"):
        await run_agent_episode(gateway, spec, TASK, ROLLOUT, "w", 0)
    with pytest.raises(ValueError, match="env.processes must be >= 0"):
        AgentSpec(program="toy_agents:calculator", processes=-1)


@pytest.mark.slow  # left out of scripts/test.sh --quick
def test_a_run_with_its_programs_in_worker_processes(tmp_path: Path) -> None:
    """The whole run (Hydra config, pipeline, trainer) with env.processes=2: the run holds the
    workers for its episodes (the evaluations' too) and every trained sample was recorded."""
    from test_agent_learning import agent_config

    from orchestrator.builders import run

    result = run(agent_config("toy_agents:calculator", "env.processes=2", "pipeline.num_steps=3",
                              "pipeline.batch_size=16", "eval.num_tasks=4"), tmp_path)
    assert result.summary["steps"] == 3
    metrics = result.reports[-1].metrics
    assert metrics["agent/episodes"] >= 3 * 16 and metrics["agent/calls"] >= 1
    assert metrics.get("agent/errors", 0) == 0 and metrics["agent/worker_restarts"] == 0
