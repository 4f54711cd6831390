"""The calibrated replay's parts: the server model, the replay engine in virtual time, the
tokenizer of the replay environment's messages, and plans from a trace
(orchestrator/replay/model.py, engine.py, tokenizer.py, plans.py; envs/replay.py)."""

from __future__ import annotations

import anyio
import pytest

from envs.replay import EpisodePlan, ReplaySpec, ToolPlan, TurnPlan, observation_message
from orchestrator.config.schema import ReplayConfig
from orchestrator.replay.engine import replay_engine
from orchestrator.replay.fit import EngineFit, TurnShape, simulate
from orchestrator.replay.model import RequestSpec, ServerModel, ServerParams
from orchestrator.replay.plans import load_plans, plans_from_records
from orchestrator.replay.run import replay, run_virtual
from orchestrator.replay.tokenizer import KEY_BASE, OBS, ReplayTokenizer, plan_key
from orchestrator.trace import SHIPPED_SAMPLE, TraceDir
from orchestrator.types import SamplingParams

PARAMS = ServerParams(step_base=0.01, step_per_seq=0.002, step_per_1k_tokens=0.0,
                      prefill_per_1k=0.1, max_running=2)


def test_one_request_costs_prefill_then_one_step_per_token() -> None:
    server = ServerModel(PARAMS)
    server.submit(0.0, 7, RequestSpec(prompt_tokens=1000, cached_tokens=500, completion_tokens=10))
    assert server.next_event() == pytest.approx(0.05)  # 500 uncached tokens
    assert server.advance(0.05) == []
    expected = 0.05 + 10 * (0.01 + 0.002)
    assert server.next_event() == pytest.approx(expected)
    assert server.advance(1.0) == [7]
    assert server.busy == pytest.approx(expected)


def test_the_concurrency_cap_queues_requests() -> None:
    params = ServerParams(step_base=0.1, step_per_seq=0.0, step_per_1k_tokens=0.0,
                          prefill_per_1k=0.0, max_running=2)
    episodes = [[TurnShape(RequestSpec(1, 0, 10), 0.0, 0.0)] for _ in range(3)]
    latencies, e2e = simulate(params, episodes)
    assert sorted(latencies) == pytest.approx([1.0, 1.0, 2.0])
    assert max(e2e) == pytest.approx(2.0)


def test_resident_tokens_slow_decoding_down() -> None:
    params = ServerParams(step_base=0.0, step_per_seq=0.0, step_per_1k_tokens=1.0,
                          prefill_per_1k=0.0, max_running=8)
    server = ServerModel(params)
    server.submit(0.0, 0, RequestSpec(1000, 0, 100))
    server.advance(0.0)
    # step i takes (1000 + i) / 1000 s: 100 steps take 100 + 100^2 / 2000 s in the fluid model
    assert server.next_event() == pytest.approx(100 + 100 * 100 / 2000)


def plan(key: int, group: int, completions: tuple[int, ...], tool_latency: float) -> EpisodePlan:
    turns = []
    prompt = 100
    for i, n in enumerate(completions):
        last = i == len(completions) - 1
        tools = () if last else (ToolPlan(tool_latency, "success", 1, 50),)
        turns.append(TurnPlan(prompt, 0, n, "stop" if last else "tool_calls", 0.0, tools))
        prompt += n + 50
    return EpisodePlan(key, 100, tuple(turns), group, key % 2)


def test_the_engine_in_virtual_time_matches_the_standalone_model() -> None:
    plans = [plan(i, i // 2, (5 + i, 3 * i + 1, 4), 0.5 + i / 10) for i in range(6)]
    episodes = [[TurnShape(RequestSpec(t.prompt_tokens, t.cached_tokens, t.completion_tokens),
                           0.0, sum(c.latency for c in t.tools)) for t in p.turns] for p in plans]
    expected_latencies, expected_e2e = simulate(PARAMS, episodes)
    fit = EngineFit(PARAMS, makespan_s=10.0, tokens_per_step=1000.0, trajectories_per_step=6)

    result = run_virtual(replay, plans, fit, ReplayConfig(groups_per_step=None, num_steps=1))
    (report,) = result.reports
    trajectories = [t for g in report.groups for t in g.trajectories]
    timings = [e for g in report.timings for e in g.episodes]
    assert len(trajectories) == len(timings) == 6
    latencies = [turn.latency for e in timings for turn in e.turns]
    assert sorted(latencies) == pytest.approx(sorted(expected_latencies))
    e2e = [e.finished_at - e.started_at for e in timings]
    assert sorted(e2e) == pytest.approx(sorted(expected_e2e))
    t, e = trajectories[0], timings[0]
    assert [turn.completion_tokens for turn in e.turns] in [[5 + i, 3 * i + 1, 4] for i in range(6)]
    assert len(t.token_ids) == t.prompt_tokens + sum(x.completion_tokens + x.observation_tokens
                                                     for x in e.turns)
    # The trainer cost model: rollout share 0.7 of (makespan 10 s) -> 10 * 0.3 / 0.7 per 1000 tokens.
    train = result.recorder.of("train_step")[0]
    tokens = sum(len(t.token_ids) for t in trajectories)
    assert train.duration == pytest.approx(10 * 0.3 / 0.7 * tokens / 1000)


def test_the_engine_refuses_prompts_that_are_not_replay_plans() -> None:
    engine = replay_engine({}, PARAMS)

    async def main() -> None:
        async with engine:
            with pytest.raises(ValueError, match="replay plans"):
                await engine.generate([5, 6, 7], SamplingParams())

    run_virtual(main)


def test_tokenizer_lengths_follow_the_protocol() -> None:
    tok = ReplayTokenizer()
    spec = ReplaySpec([plan(3, 0, (2,), 0.0)])

    async def opening() -> list[int]:
        env = spec.make_env()
        return tok.chat_prompt(await env.reset(spec.tasks("train")[0]))

    ids = anyio.run(opening)
    assert len(ids) == 100 and ids[0] == KEY_BASE + 3 and plan_key(ids) == 3
    obs = tok.chat_prompt([observation_message(40)] * 2, continuation=True)
    assert len(obs) == 80 and obs.count(OBS) == 1 and plan_key(obs) is None
    assert len(tok.encode(observation_message(40)["content"])) == 40  # per-call trace sizes


def test_sample_plans_replicate_to_a_full_step() -> None:
    plans, per_step = load_plans(TraceDir.open(SHIPPED_SAMPLE), [0, 1], 32, seed=0)
    assert per_step == 32 and len(plans) == 2 * 32 * 8
    assert len({p.key for p in plans}) == len(plans)
    records = list(TraceDir.open(SHIPPED_SAMPLE).workload(0))
    assert plans_from_records(records)[0].turns[0].completion_tokens == records[0].turns[0].completion_tokens
