"""An episode's trace (orchestrator/trace/episode.py) through the runner: one clock for spans
and tool calls, and tool metadata that reaches the written PolyTrace record untouched."""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from helpers import TOK, scripted_engine

import orchestrator.episodes.rollout
from envs.base import Env, EnvSpec, Reward, Task
from envs.parsers import HermesParser
from envs.tool_env import Episode, ToolEnv
from envs.tools import ToolOutput, tool
from envs.toolset import ToolSet
from orchestrator.config.schema import PipelineConfig, RolloutConfig
from orchestrator.engines.simulated import SimulatedEngine
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.pipeline.evaluation import evaluate
from orchestrator.pipeline.pipeline import Pipeline, TaskSampler
from orchestrator.trace.recorder import Recorder
from orchestrator.trace.writer import TraceWriter, workload_record
from orchestrator.types import (
    EpisodeTiming,
    FinishReason,
    Group,
    GroupTiming,
    ToolTiming,
    Trajectory,
)

pytestmark = pytest.mark.anyio
TASK = Task(id=0, messages=({"role": "user", "content": "who?"},), answer="ann")
METADATA = {"query_count": 3, "anything": "x"}


class ManualClock:
    """A clock that moves only when told to: any reading from another clock stands out."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def answered(episode: Episode) -> Reward:
    return Reward(float(episode.final_reply == "ann"))


class LookupSpec(EnvSpec):
    """One tool that takes 5 s of the clock and reports custom metadata."""

    name = "lookup"

    def __init__(self, clock: ManualClock) -> None:
        self.manual = clock
        self.envs: list[ToolEnv] = []

    def tasks(self, split: str) -> Sequence[Task]:
        return [TASK]

    def make_env(self) -> Env:
        manual = self.manual

        @tool
        async def lookup(query: str) -> ToolOutput:
            """Look a name up."""
            manual.now += 5.0
            return ToolOutput("ann", METADATA)

        env = ToolEnv(ToolSet([lookup], clock=self.clock), answered,
                      describe_tools=False)
        self.envs.append(env)
        return env


def engine(clock: ManualClock) -> SimulatedEngine:
    """Calls the tool, then answers; each generation takes 1 s of the clock."""
    replies = iter([HermesParser.format("lookup", {"query": "who"}), "ann"])

    def reply(_: list[int]) -> str:
        clock.now += 1.0
        return next(replies)

    return scripted_engine(reply)


ROLLOUT = RolloutConfig(group_size=1, max_tokens=200, max_turns=3)


async def test_tool_calls_and_spans_are_read_from_the_recorders_clock() -> None:
    clock = ManualClock()
    recorder, spec = Recorder(clock=clock), LookupSpec(clock)
    evaluation = await evaluate(EpisodeRunner(engine(clock), TOK, spec, ROLLOUT, recorder), [TASK])
    assert evaluation.mean == 1.0
    assert spec.clock is recorder.clock  # evaluate handed the recorder's clock to the spec
    (record,) = spec.envs[0].episode.tool_calls  # type: ignore[union-attr]
    (span,) = recorder.of("tool_call")
    assert record.started == 1001.0 and record.latency == 5.0
    assert span.start == recorder.at(record.started) == 1.0 and span.end == 6.0
    generate = recorder.of("generate")
    assert [(s.start, s.end) for s in generate] == [(0.0, 1.0), (6.0, 7.0)]


async def test_the_pipeline_hands_its_recorders_clock_to_the_spec() -> None:
    class Trainer:
        version = 0

    clock = ManualClock()
    recorder, spec = Recorder(clock=clock), LookupSpec(clock)
    runner = EpisodeRunner(engine(clock), TOK, spec, ROLLOUT, recorder)
    Pipeline(PipelineConfig(batch_size=1, num_workers=1), runner, Trainer(),  # type: ignore[arg-type]
             TaskSampler(spec.tasks("train")))
    assert spec.clock is recorder.clock


async def test_tool_metadata_reaches_the_written_record_untouched(tmp_path: Path) -> None:
    clock = ManualClock()
    recorder, spec = Recorder(clock=clock), LookupSpec(clock)
    spec.use_clock(recorder.clock)
    t, timing = await EpisodeRunner(engine(clock), TOK, spec, ROLLOUT, recorder).episode(TASK, "w")
    (call,) = timing.tool_calls
    assert call.metadata == METADATA and call.start == 1.0 and call.latency == 5.0
    TraceWriter(tmp_path, codec="none").write_step(0, 0, [Group(0, (t,), 0)],
                                                   [GroupTiming(0.0, 1.0, (timing,))])
    raw = json.loads((tmp_path / "multiturn_workload_step_0.jsonl").read_text())
    assert [c["query_count"] for c in raw["tool_calls"]] == [3]
    # the writer owns the published name; the runner reads no tool's keys
    assert "query_count" not in inspect.getsource(orchestrator.episodes.rollout)


def test_a_call_whose_tool_reported_no_query_count_counts_one() -> None:
    call = ToolTiming(0, "python", "ok", 0.0, 0.1, metadata={"exit_code": 0})
    trajectory = Trajectory(prompt_id=0, sample_index=0, token_ids=(1,), loss_mask=(False,),
                            logprobs=(0.0,), versions=(-1,), reward=0.0, start_version=0,
                            finish_reason=FinishReason.STOP, prompt_tokens=1)
    timing = EpisodeTiming("w", 0.0, 0.1, tool_calls=(call,))
    assert workload_record(trajectory, timing, 0).tool_calls[0].query_count == 1
