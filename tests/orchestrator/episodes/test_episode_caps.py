"""Multi-turn episodes in the runner (orchestrator/episodes/rollout.py): observation tokens are
appended unmasked, per-turn metrics add up, and each cap ends the episode with its reason."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from envs.base import Env, EnvSpec, Message, Reward, StepResult, Task
from orchestrator.config.schema import RolloutConfig
from orchestrator.engines.simulated import SimulatedEngine
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.models.tokenizer import CharTokenizer
from orchestrator.trace.recorder import Recorder

pytestmark = pytest.mark.anyio
TASK = Task(id=0, messages=({"role": "user", "content": "hi"},), answer="")


class EchoEnv(Env):
    """Never finishes by itself: every turn gets a tool observation of ``width`` characters."""

    def __init__(self, width: int, done_after: int | None) -> None:
        self.width, self.done_after, self.turns = width, done_after, 0

    async def reset(self, task: Task) -> tuple[Message, ...]:
        return task.messages

    async def step(self, reply: str) -> StepResult:
        self.turns += 1
        if self.done_after is not None and self.turns >= self.done_after:
            return StepResult((), 0.5, True, {"calls": 1.0})
        return StepResult(({"role": "tool", "content": "x" * self.width},), 0.0, False, {"calls": 1.0})

    async def reward(self) -> Reward:
        return Reward(1.0, {"constant": 1.0})


class EchoSpec(EnvSpec):
    def __init__(self, width: int = 5, done_after: int | None = None) -> None:
        self.width, self.done_after = width, done_after

    def tasks(self, split: str) -> Sequence[Task]:
        return [TASK]

    def make_env(self) -> Env:
        return EchoEnv(self.width, self.done_after)


async def episode(spec: EchoSpec, **config: object):
    engine = SimulatedEngine(median_tokens=4, sigma=0.0, seconds_per_token=0.0)
    rollout = RolloutConfig(group_size=1, max_tokens=4, **config)  # type: ignore[arg-type]
    trajectory, _ = await EpisodeRunner(engine, CharTokenizer(), spec, rollout,
                                        Recorder()).episode(TASK, "w")
    return trajectory


async def test_turns_append_observations_unmasked_and_sum_metrics() -> None:
    t = await episode(EchoSpec(width=5, done_after=3), max_turns=5)
    assert t.end_reason == "done" and t.metrics["episode/turns"] == 3
    assert t.metrics["calls"] == 3.0 and t.reward == 1.5
    tok = CharTokenizer()
    prompt = len(tok.chat_prompt(TASK.messages))
    observation = len(tok.chat_prompt([{"role": "tool", "content": "xxxxx"}], continuation=True))
    assert len(t.token_ids) == prompt + 3 * 4 + 2 * observation
    assert sum(t.loss_mask) == 3 * 4  # only generated tokens are trained on
    assert all(v == -1 for v, m in zip(t.versions, t.loss_mask, strict=True) if not m)


@pytest.mark.parametrize(("config", "reason"), [
    ({"max_turns": 2}, "max_turns"),
    ({"max_turns": 9, "max_total_tokens": 30}, "max_length"),
    ({"max_turns": 9, "max_tool_response_tokens": 3}, "tool_response_too_long"),
])
async def test_each_cap_ends_the_episode_with_its_reason(config: dict, reason: str) -> None:
    t = await episode(EchoSpec(width=5), **config)
    assert t.end_reason == reason
    if "max_total_tokens" in config:
        assert len(t.token_ids) <= config["max_total_tokens"]
    assert t.reward == 1.0  # the episode is still scored


async def test_every_tool_call_becomes_a_span_with_latency_and_status() -> None:
    import anyio

    from envs.base import Reward
    from envs.tool_env import ToolEnv
    from envs.tools import tool
    from envs.toolset import ToolSet

    @tool
    async def nap(seconds: float) -> str:
        """Sleep, then say so."""
        await anyio.sleep(seconds)
        return "rested"

    async def answered(episode) -> Reward:
        return Reward(float(episode.final_reply == "ok"))

    class NapSpec(EchoSpec):
        def make_env(self) -> Env:
            return ToolEnv(ToolSet([nap]), answered, describe_tools=False)

    replies = iter([
        '<tool_call>{"name": "nap", "arguments": {"seconds": 0.02}}</tool_call>'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        "ok",
    ])

    class Scripted(SimulatedEngine):
        async def generate(self, prompt_ids, sampling):
            gen = await super().generate(prompt_ids, sampling)
            ids = tuple(CharTokenizer().encode(next(replies))) + (sampling.stop_token_ids[0],)
            return type(gen)(ids, (-1.0,) * len(ids), (0,) * len(ids), gen.finish_reason, 0)

    recorder = Recorder()
    rollout = RolloutConfig(group_size=1, max_tokens=200, max_turns=3)
    t, _ = await EpisodeRunner(Scripted(median_tokens=1, sigma=0.0, seconds_per_token=0.0),
                               CharTokenizer(), NapSpec(), rollout, recorder).episode(TASK, "w")
    assert t.end_reason == "done" and t.reward == 1.0
    spans = recorder.of("tool_call")
    assert [(s.attributes["tool"], s.attributes["status"]) for s in spans] == [
        ("nap", "ok"), ("nope", "error")]
    assert spans[0].duration >= 0.02 and spans[1].attributes["error_kind"] == "unknown_tool"
    assert t.metrics["tools/calls"] == 2 and t.metrics["tools/error/unknown_tool"] == 1
