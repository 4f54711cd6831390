"""A multi-turn environment with tools, and rewards that score the whole episode.

Each model turn is parsed for tool calls (format by name from the parser registry). A turn
with calls runs them (see :class:`~envs.toolset.ToolSet`) and the results come back as
``tool`` messages for the next turn; a turn without calls is the final answer and ends the
episode. Per-episode tool state lives in an :class:`~envs.tools.EpisodeContext` that is
closed before the rewards are computed, and by ``aclose()`` — the runner's ``async with
env`` — also on cancellation.

The reward is an async function of the finished :class:`Episode` (``score``); an environment
built from config scores with ``env.reward`` (:mod:`envs.rewards`), the transcript handed to
the reward as :attr:`envs.reward_functions.Sample.transcript` (:func:`episode_sample`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from envs.base import Env, Message, Reward, StepResult, Task, ToolCallRecord
from envs.parsers import make_parser
from envs.reward_functions import Sample
from envs.tools import EpisodeContext
from envs.toolset import ToolSet


@dataclass
class Episode:
    task: Task
    messages: list[Message] = field(default_factory=list)  # the whole conversation
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    final_reply: str = ""


EpisodeScore = Callable[[Episode], Awaitable[Reward]]


def episode_sample(episode: Episode, data_source: str) -> Sample:
    """What a reward sees of a finished episode: its final reply, the task, the whole
    conversation."""
    task = episode.task
    return Sample(episode.final_reply, task.answer, task.metadata, task.messages, data_source,
                  tuple(episode.messages))


class ToolEnv(Env):
    def __init__(
        self,
        tools: ToolSet,
        score: EpisodeScore,
        parser: str = "hermes",
        system_prompt: str | None = None,
        describe_tools: bool = True,
    ) -> None:
        self.tools = tools
        self.score = score
        self.parser = make_parser(parser)
        self.system_prompt = system_prompt
        self.describe_tools = describe_tools
        self.context = EpisodeContext()
        self.episode: Episode | None = None

    def _system(self) -> list[Message]:
        parts = [self.system_prompt] if self.system_prompt else []
        if self.describe_tools and self.tools.tools:
            parts.append("Tools:\n" + "\n".join(json.dumps(s) for s in self.tools.schemas))
        return [{"role": "system", "content": "\n\n".join(parts)}] if parts else []

    def opening(self, task: Task) -> tuple[Message, ...]:
        """The messages an episode of ``task`` starts with (what ``reset`` returns)."""
        return (*self._system(), *task.messages)

    async def reset(self, task: Task) -> tuple[Message, ...]:
        opening = self.opening(task)
        self.episode = Episode(task=task, messages=list(opening))
        return opening

    async def step(self, reply: str) -> StepResult:
        if self.episode is None:
            raise RuntimeError("step() before reset()")
        self.episode.messages.append({"role": "assistant", "content": reply})
        parsed = self.parser.parse(reply)
        if parsed.attempted == 0:
            self.episode.final_reply = reply
            return StepResult(observation=(), reward=0.0, done=True)
        outcome = await self.tools.run_turn(parsed, self.context)
        self.episode.messages.extend(outcome.observation)
        self.episode.tool_calls.extend(outcome.records)
        return StepResult(observation=outcome.observation, reward=0.0, done=False,
                          metrics=outcome.metrics, tool_calls=outcome.records)

    async def reward(self) -> Reward:
        if self.episode is None:
            raise RuntimeError("reward() before reset()")
        # the tools are done: release their resources first, so a reward that needs one of
        # its own (a fresh sandbox to grade in) never waits on the episode's
        await self.context.aclose()
        return await self.score(self.episode)

    async def aclose(self) -> None:
        await self.context.aclose()
