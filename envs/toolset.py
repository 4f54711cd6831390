"""Running one turn's tool calls: checking them against the tools there are, running them
concurrently under a cap, and turning every outcome — results and model mistakes alike —
into observation messages and counted metrics.

A model mistake (malformed JSON, unknown tool, wrong argument types, too many calls) is an
``error`` observation the model reads on its next turn; the episode goes on. Calls past
``max_calls_per_turn`` are not run.

Every call is timed with the tool set's ``clock``: the environment spec's
(:attr:`envs.base.EnvSpec.clock`, which the orchestrator sets to its recorder's), so a
``ToolCallRecord.started`` is a reading of the run's one clock. A spec builds its tool set
with ``ToolSet(tools, clock=self.clock)`` in ``make_env``; the default is the default
``EnvSpec.clock``. Calls that never ran (model mistakes) are stamped with the turn's start.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import anyio

from envs.base import Clock, Message, ToolCallRecord
from envs.parsers import ParsedReply, ToolCall
from envs.tools import EpisodeContext, Tool, ToolResult, ToolStatus


@dataclass(frozen=True)
class TurnOutcome:
    observation: tuple[Message, ...]
    records: tuple[ToolCallRecord, ...]
    metrics: dict[str, float] = field(default_factory=dict)


class ToolSet:
    def __init__(self, tools: Iterable[Tool], max_calls_per_turn: int = 4,
                 max_concurrency: int = 4, clock: Clock = time.perf_counter) -> None:
        self.tools = {t.name: t for t in tools}
        self.clock = clock
        if max_calls_per_turn < 1 or max_concurrency < 1:
            raise ValueError("max_calls_per_turn and max_concurrency must be >= 1")
        self.max_calls_per_turn = max_calls_per_turn
        self._limiter = anyio.CapacityLimiter(max_concurrency)

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    async def run_turn(self, parsed: ParsedReply, context: EpisodeContext | None = None) -> TurnOutcome:
        now = self.clock()
        slots: list[tuple[str | None, ToolResult, str | None] | None] = [None] * parsed.attempted
        for error in parsed.errors:
            slots[error.index] = (None, ToolResult(ToolStatus.ERROR, error.message, now), error.kind)
        runnable: list[ToolCall] = []
        for call in sorted(parsed.calls, key=lambda c: c.index):
            if call.name not in self.tools:
                known = ", ".join(sorted(self.tools)) or "none"
                slots[call.index] = (call.name, ToolResult(
                    ToolStatus.ERROR, f"unknown tool {call.name!r}; available tools: {known}", now),
                    "unknown_tool")
            elif len(runnable) >= self.max_calls_per_turn:
                slots[call.index] = (call.name, ToolResult(
                    ToolStatus.ERROR, f"too many tool calls in one turn: at most "
                    f"{self.max_calls_per_turn} run, this one was skipped", now), "too_many")
            else:
                runnable.append(call)

        async def run(call: ToolCall) -> None:
            async with self._limiter:
                result = await self.tools[call.name](call.arguments, context, clock=self.clock)
            slots[call.index] = (call.name, result, result.metadata.get("error_kind"))

        async with anyio.create_task_group() as tg:
            for call in runnable:
                tg.start_soon(run, call)

        observation: list[Message] = []
        records: list[ToolCallRecord] = []
        for slot in slots:
            assert slot is not None
            name, result, kind = slot
            content = result.content if result.ok else f"[{result.status}] {result.content}"
            observation.append({"role": "tool", "content": content})
            records.append(ToolCallRecord(name, str(result.status), result.started, result.latency, kind,
                                          dict(result.metadata)))
        return TurnOutcome(tuple(observation), tuple(records), self._metrics(records))

    @staticmethod
    def _metrics(records: Sequence[ToolCallRecord]) -> dict[str, float]:
        kinds = Counter(r.error_kind for r in records if r.error_kind)
        metrics = {
            "tools/calls": float(len(records)),
            "tools/ok": float(sum(r.status == ToolStatus.OK for r in records)),
            "tools/errors": float(sum(r.status != ToolStatus.OK for r in records)),
        }
        metrics.update({f"tools/error/{k}": float(v) for k, v in kinds.items()})
        return metrics
