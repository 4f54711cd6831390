"""The trace side of one episode: its spans on the run's recorder, and the turn and tool-call
timings its trajectory carries into the PolyTrace files.

The episode runner calls :meth:`EpisodeTrace.generate` around each engine call,
:meth:`EpisodeTrace.turn` once per environment step, :meth:`EpisodeTrace.reward` around the
reward, and :meth:`EpisodeTrace.finish` for the episode's :class:`EpisodeTiming`, which the
trace writers read beside its trajectory. Spans: one ``generate`` per
turn, one ``tool_call`` per call the environment reports, one ``reward``.

Tool-call start times are readings of the environment spec's clock, which the orchestrator
sets to the recorder's (``spec.use_clock(recorder.clock)``), so :meth:`Recorder.at` places
them on the same timeline as every span. A tool's metadata is carried as-is into
:class:`~orchestrator.types.ToolTiming`; writers pick out the fields they publish.

Limits: a turn's observation tokens are split over its calls by the lengths of their
messages (the last call takes the chat template's tokens); an environment whose observation is
not one message per call gets zeros. Tool calls of a turn whose observation was not appended
(the episode ended there) are spans but not timings, as nothing of theirs was trained on.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from envs.base import Reward, StepResult
from orchestrator.trace.recorder import Recorder
from orchestrator.types import EpisodeTiming, FinishReason, Generation, ToolTiming, TurnTiming

if TYPE_CHECKING:
    from orchestrator.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class _Generated:
    """The last engine call, until its environment step completes the turn."""

    turn: int
    version: int
    start: float
    latency: float
    prompt_tokens: int


class EpisodeTrace:
    def __init__(self, recorder: Recorder, worker: str, sample: int, tokenizer: Tokenizer) -> None:
        self.recorder = recorder
        self.worker = worker
        self.sample = sample
        self.tokenizer = tokenizer  # counts each tool message's tokens
        self.started_at = recorder.now()
        self.turns: list[TurnTiming] = []
        self.tool_calls: list[ToolTiming] = []
        self.reward_seconds = 0.0
        self._last: _Generated | None = None

    async def generate(self, turn: int, version: int, prompt_tokens: int,
                       call: Awaitable[Generation]) -> Generation:
        """Await the engine ``call`` inside the turn's ``generate`` span."""
        start = self.recorder.now()
        with self.recorder.span("generate", self.worker, version, turn=turn,
                                prompt_tokens=prompt_tokens, sample=self.sample) as attrs:
            gen = await call
            attrs.update(completion_tokens=len(gen.token_ids), finish_reason=str(gen.finish_reason))
        self._last = _Generated(turn, version, start, self.recorder.now() - start, prompt_tokens)
        return gen

    def turn(self, gen: Generation, result: StepResult, max_new_tokens: int, text_tokens: int,
             appended: int | None) -> None:
        """The environment's step after ``gen``: its tool calls' spans and the turn's timing;
        ``appended`` is how many observation tokens went into the sequence (None: none did,
        the episode ends here)."""
        last = self._last
        if last is None:
            raise RuntimeError("turn() before generate()")
        for call in result.tool_calls:
            start = self.recorder.at(call.started)
            self.recorder.add("tool_call", self.worker, start, start + call.latency, last.version,
                              tool=call.name, status=call.status, error_kind=call.error_kind,
                              turn=last.turn, sample=self.sample)
        self.turns.append(TurnTiming(
            turn=last.turn, start=last.start, latency=last.latency,
            prompt_tokens=last.prompt_tokens, cached_tokens=gen.cached_tokens,
            completion_tokens=len(gen.token_ids), max_new_tokens=max_new_tokens,
            text_tokens=text_tokens,
            finish_reason=_trace_finish(gen.finish_reason, result.done, len(result.tool_calls)),
            tool_call_count=len(result.tool_calls), version=gen.start_version,
            observation_tokens=appended or 0,
        ))
        if appended is not None:
            self.tool_calls += self._tool_timings(last.turn, result, appended)

    async def reward(self, version: int, call: Awaitable[Reward]) -> Reward:
        """Await the environment's reward ``call`` inside the ``reward`` span."""
        start = self.recorder.now()
        with self.recorder.span("reward", self.worker, version, sample=self.sample) as attrs:
            reward = await call
            attrs["reward"] = reward.total
        self.reward_seconds = self.recorder.now() - start
        return reward

    def finish(self) -> EpisodeTiming:
        """The episode's timings, now that it has ended."""
        return EpisodeTiming(
            worker=self.worker, started_at=self.started_at, finished_at=self.recorder.now(),
            reward_seconds=self.reward_seconds, turns=tuple(self.turns),
            tool_calls=tuple(self.tool_calls),
        )

    def _tool_timings(self, turn: int, result: StepResult, appended: int) -> list[ToolTiming]:
        calls = result.tool_calls
        sizes = [len(self.tokenizer.encode(m.get("content", ""))) for m in result.observation]
        if len(sizes) != len(calls):
            sizes = [0] * len(calls)
        return [ToolTiming(
            turn=turn, name=call.name, status=call.status, start=self.recorder.at(call.started),
            latency=call.latency, error_kind=call.error_kind, metadata=dict(call.metadata),
            response_tokens=sizes[i],
            append_tokens=sizes[i] if i < len(calls) - 1 else appended - sum(sizes[:-1]),
        ) for i, call in enumerate(calls)]


def _trace_finish(finish: FinishReason, done: bool, tool_calls: int) -> str:
    """The PolyTrace name of why a turn ended."""
    if finish is FinishReason.LENGTH:
        return "length"
    if not done and tool_calls:
        return "tool_calls"
    return "stop" if finish is FinishReason.STOP else str(finish)
