"""Agent episodes through the real pipeline (simulated engine and trainer): admission and
the staleness bound hold, both in-flight update modes work, and programs that raise or hang
are failed episodes, counted, while the run goes on."""

from __future__ import annotations

from typing import Any

import pytest

from envs.agent import AgentSpec
from orchestrator.config.schema import PipelineConfig, RolloutConfig
from orchestrator.engines.simulated import SimulatedEngine
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.models.tokenizer import CharTokenizer
from orchestrator.pipeline.pipeline import Pipeline, TaskSampler
from orchestrator.trace.recorder import Recorder
from orchestrator.types import StepReport

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("inflight_update", ["continue", "finish"])
@pytest.mark.slow  # left out of scripts/test.sh --quick
async def test_agent_episodes_train_under_the_staleness_bound_and_failures_are_counted(
        fake_trainer_cls: Any, inflight_update: str) -> None:
    spec = AgentSpec(program="toy_agents:flaky", timeout_s=1.0, max_context=4096)
    engine = SimulatedEngine(median_tokens=6, sigma=0.3, seconds_per_token=1e-4, seed=1)
    trainer = fake_trainer_cls()
    config = PipelineConfig(batch_size=8, max_staleness=1, num_workers=4, num_steps=6,
                            inflight_update=inflight_update)  # type: ignore[arg-type]
    runner = EpisodeRunner(engine, CharTokenizer(), spec, RolloutConfig(group_size=2, max_tokens=8),
                           Recorder())
    seen: list[StepReport] = []
    pipeline = Pipeline(config, runner, trainer, TaskSampler(spec.tasks("train"), seed=0),
                        on_step=seen.append)
    reports = await pipeline.run()
    assert len(reports) == 6
    metrics = reports[-1].metrics
    assert metrics["agent/errors"] >= 1 and metrics["agent/timeouts"] >= 1
    assert metrics["agent/episodes"] >= 6 * 4
    groups = [g for _, batch in trainer.batches for g in batch]
    assert groups == [g for r in seen for g in r.groups]  # what the trainer got, no timings
    timings = {(g.prompt_id, t.sample_index): e for r in seen
               for g, timing in zip(r.groups, r.timings, strict=True)
               for t, e in zip(g.trajectories, timing.episodes, strict=True)}
    assert all(0 <= r.version - v <= 1 for r in reports for v in r.start_versions)
    ends = {0: "done", 1: "agent_error", 2: "agent_timeout"}
    for group in groups:
        # groups of programs that never called the model were given back, not trained
        assert 1 <= len(group) <= 2
        for t in group.trajectories:
            kind = t.prompt_id % 4
            assert kind != 3
            # (a loaded machine may time out any program: that is a failure too)
            assert t.end_reason in (ends[kind], "agent_timeout")
            turns = len(timings[group.prompt_id, t.sample_index].turns)
            assert t.metrics["agent/calls"] == turns == (2 if t.end_reason == "done" else 1)
            assert t.end_reason == "done" or t.reward == 0.0
            assert t.metrics["agent/segments"] == 1.0  # one segment per episode here
