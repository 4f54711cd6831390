"""An agent program's evaluation (orchestrator.gateway.evaluate_agents through
orchestrator.pipeline.evaluation): ``eval.n`` episodes per task at the evaluation's temperature,
each a sample with the episode's reward, its segments' tokens and the answer in its final reply; a
program that fails before calling the model is a sample with reward 0 and no answer."""

from __future__ import annotations

import anyio
import pytest

from envs.agent import AgentSpec
from orchestrator.config.schema import EvalConfig, RolloutConfig
from orchestrator.engines.simulated import SimulatedEngine
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.models.tokenizer import CharTokenizer
from orchestrator.pipeline.evaluation import evaluate
from orchestrator.trace.recorder import Recorder

pytestmark = pytest.mark.anyio


async def test_an_agent_programs_evaluation_has_n_samples_per_task() -> None:
    # neither task hangs: the timeout is wide, because the first episode's cold client takes
    # ~1 s on an idle 2-core machine and more on a loaded one (2.0 s here failed CI once)
    spec = AgentSpec(program="toy_agents:flaky", timeout_s=60.0, max_context=4096)
    tasks = [spec.tasks("eval")[i] for i in (0, 3)]  # ids 0 (two calls) and 3 (raises at once)
    engine = SimulatedEngine(median_tokens=6, sigma=0.3, seconds_per_token=1e-5, seed=1)
    runner = EpisodeRunner(engine, CharTokenizer(), spec, RolloutConfig(max_tokens=8), Recorder())
    with anyio.fail_after(120):
        async with engine:
            evaluation = await evaluate(runner, tasks, EvalConfig(n=3, temperature=0.5, k=[1, 3]))
    agent = evaluation.sources["agent"]
    assert agent.tasks == 2 and agent.samples == 6
    assert agent.response_tokens > 0 and set(agent.pass_at) == {1, 3}
    examples = {e.task_id: e for e in evaluation.examples}
    assert examples[3].reward == 0.0 and examples[3].tokens == 0 and examples[3].answer is None
    assert examples[0].tokens > 0 and examples[0].completion


async def test_an_agent_program_votes_by_env_reward() -> None:
    # env.reward=exact: "Paris" and "paris." are one answer; the default reading (math's)
    # finds no number in either, so nobody voted before
    from envs.votes import votes_of

    replies = ["Paris", "paris.", "Rome"]
    spec = AgentSpec(program="toy_agents:transcript", reward="exact")
    async with votes_of(spec) as votes:
        assert await votes.for_source(spec.name).groups(replies) == [0, 0, 2]
    async with spec.votes() as own:
        assert await own.groups(replies) == [None, None, None]
    # with no env.reward (the program returns its reward) the environment's reading votes
    async with votes_of(AgentSpec(program="toy_agents:transcript")) as votes:
        assert await votes.groups(["\\boxed{3}", "3"]) == [0, 0]
