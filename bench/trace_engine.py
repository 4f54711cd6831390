"""A trace-driven simulated engine for benchmarks: no model, no compute, only time.

:func:`trace_engine` builds the one simulated engine
(:class:`~orchestrator.engines.simulated.SimulatedEngine`) from two parts defined here. Each
request (:class:`TraceShapes`) draws one trajectory of the PolyTrace search_r1 sample shipped in
``orchestrator/trace/data/search_r1/`` (256 trajectories, steps 0-3) and generates its
recorded completion tokens (all turns summed: median 160, p99 ~720, max 3,000). Time comes
from the fitted server model (:class:`~orchestrator.replay.model.ServerParams`, the shipped
fit by default): the request first prefills its uncached prompt tokens
(``prefill_per_1k``), then decodes in chunks; every token of a chunk takes one decode
iteration, ``step_base + step_per_seq * B + step_per_1k_tokens * R / 1000`` for the ``B``
requests resident in this engine holding ``R`` tokens, read when the chunk starts. Since
every resident request advances one token per iteration, that is each request's time per
token under continuous batching (:class:`BatchedDecode`). All times are multiplied by
``time_scale``.

The engine sleeps (``anyio.sleep``): it costs no CPU while it "generates", so a benchmark
built on it measures scheduling and transport, not compute. Tokens are placeholder ids; each
chunk is stamped with the version current when it ran, and pause/resume hold a
:class:`~orchestrator.engines.rwlock.ReadWriteLock` exclusively. ``model`` and ``weights`` are
accepted so an
``EngineRecipe`` can build it like any engine; ``weights`` only sets the starting version. A
weight update from another process (bytes, a file, the object store) is pulled in a worker
thread, as a real engine would before loading it, and then dropped. Engines built from one
recipe with a ``seed`` draw the same sequence of lengths (a benchmark comparing engine counts
then compares like with like); with ``seed=None`` each draws its own.

Limits: prefill runs concurrently with decoding (the model serialises it), there is no slot
cap or KV-cache pressure, and a trajectory's turns and tool calls are folded into one
generation.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.engines.simulated import ChunkedDecode, Replies, Reply, SimulatedEngine
from orchestrator.replay.fit import EngineFit
from orchestrator.replay.model import ServerParams
from orchestrator.trace.reader import SHIPPED_SAMPLE, TraceDir
from orchestrator.types import FinishReason, SamplingParams
from orchestrator.weights.update import WeightUpdate


@dataclass(frozen=True)
class Shape:
    """What a request generates, from one trace trajectory."""

    completion_tokens: int  # all turns
    prefill_tokens: int  # uncached prompt tokens, all turns
    context_tokens: int  # the first turn's prompt: resident before the first token


def load_shapes(trace: Path | str | None = None) -> list[Shape]:
    directory = TraceDir.open(trace or SHIPPED_SAMPLE)
    shapes = []
    for step in directory.steps():
        for record in directory.workload(step):
            if not record.turns:
                continue
            shapes.append(Shape(
                completion_tokens=max(1, sum(t.completion_tokens for t in record.turns)),
                prefill_tokens=sum(max(t.prompt_tokens - t.cached_tokens, 0) for t in record.turns),
                context_tokens=record.turns[0].prompt_tokens))
    return shapes


def decode_step_seconds(params: ServerParams, batch: int, resident_tokens: float) -> float:
    """One decode iteration of ``batch`` requests holding ``resident_tokens``."""
    return (params.step_base + params.step_per_seq * batch
            + params.step_per_1k_tokens * resident_tokens / 1000.0)


def sample_seconds(params: ServerParams, shape: Shape, batch: int) -> float:
    """Unscaled time of one request at a steady ``batch`` of requests like it."""
    resident = batch * (shape.context_tokens + shape.completion_tokens / 2)
    return (params.prefill_per_1k * shape.prefill_tokens / 1000.0
            + shape.completion_tokens * decode_step_seconds(params, batch, resident))


class TraceShapes(Replies):
    """Each request generates one trajectory's recorded tokens, drawn at random."""

    def __init__(self, shapes: Sequence[Shape], seed: int | None = None) -> None:
        self.shapes = shapes
        self._rng = random.Random(seed)

    def reply(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Reply:
        shape = self._rng.choice(self.shapes)
        capped = shape.completion_tokens > sampling.max_tokens
        return Reply(min(shape.completion_tokens, sampling.max_tokens),
                     FinishReason.LENGTH if capped else FinishReason.STOP,
                     shape.context_tokens, shape.prefill_tokens)


@dataclass(frozen=True)
class BatchedDecode:
    """The fitted server's prefill and decode-iteration times, times ``time_scale``."""

    params: ServerParams
    time_scale: float

    def prefill_seconds(self, reply: Reply) -> float | None:
        return self.params.prefill_per_1k * reply.prefill_tokens / 1000.0 * self.time_scale

    def chunk_seconds(self, n: int, resident: int, resident_tokens: int) -> float:
        return n * decode_step_seconds(self.params, resident, resident_tokens) * self.time_scale


def trace_engine(
    model: Mapping[str, Any] | None = None,
    weights: WeightUpdate | None = None,
    time_scale: float = 0.01,
    chunk_tokens: int = 64,
    trace: str | None = None,
    fit: str | None = None,
    seed: int | None = None,
) -> SimulatedEngine:
    """The simulated engine of trace shapes in the fitted server's time (an ``EngineRecipe``
    names it with ``_target_``)."""
    del model  # no model: only time
    if time_scale <= 0 or chunk_tokens < 1:
        raise ValueError("engine: time_scale > 0 and chunk_tokens >= 1 are required")
    timing = ChunkedDecode(BatchedDecode(EngineFit.load(fit).server, time_scale), chunk_tokens)
    return SimulatedEngine(TraceShapes(load_shapes(trace), seed), timing,
                           version=weights.version if weights is not None else 0)
