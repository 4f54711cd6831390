"""Typed PolyTrace records: one frozen dataclass per published record shape.

Three published formats (see the PolyTrace suite, arXiv 2509.25279):

* multi-turn workload (``multiturn_workload_step_N.jsonl``): one :class:`WorkloadRecord` per
  trajectory, with its :class:`TurnRecord` generation calls and :class:`ToolCallTrace` calls;
* packed lengths (``packed_lengths_step_N.jsonl``: :class:`PackedLengthsRecord`) and reward
  timings (``reward_timings_step_N.jsonl``: :class:`RewardTimingRecord`);
* task-distribution parameters (``task_distribution_parameters.json``:
  :class:`TaskDistribution`).

Field names are the published ones. A key a record does not know is kept, in order, in
``extra`` and written back, so reading and writing a file loses nothing. This project's own
additions travel under the one namespaced key :data:`NAMESPACE` (``"polyrl"``) as
:class:`RunInfo`, so readers of the published format see only fields they already know.
Values are type-checked on the way in (an int field takes no float, a float field takes
either) and kept as read: a ``5`` stays ``5``, so equality after a round trip is exact.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Self

from orchestrator.errors import PolyRLError

NAMESPACE = "polyrl"


class RecordError(PolyRLError, ValueError):
    """A JSON object that is not the record it should be (the reader adds file and line)."""


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(name: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _convert(name, value, next(a for a in args if a is not type(None)))
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise RecordError(f"{name} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecordError(f"{name} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecordError(f"{name} must be a number, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise RecordError(f"{name} must be a string, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise RecordError(f"{name} must be a list, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(f"{name}[{i}]", v, args[0]) for i, v in enumerate(value))
        if len(value) != len(args):
            raise RecordError(f"{name} must be a list of {len(args)} values, got {value!r}")
        return tuple(_convert(f"{name}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if origin in (dict, Mapping) or hint is dict:
        if not isinstance(value, dict):
            raise RecordError(f"{name} must be an object, got {type(value).__name__}")
        return value
    if isinstance(hint, type) and issubclass(hint, Record):
        if not isinstance(value, dict):
            raise RecordError(f"{name} must be an object, got {type(value).__name__}")
        return hint.from_dict(value, where=name)
    raise TypeError(f"no conversion for {name}: {hint!r}")  # a bug in a record definition


def _plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class Record:
    """Base: ``from_dict`` checks and converts, ``to_dict`` gives the JSON object back."""

    # Keys of ``extra`` are written after the known fields; ``extra`` itself is not a key.
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "") -> Self:
        hints = _hints(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.name != "extra"]
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "extra":
                continue
            key = _key(f)
            label = f"{where}.{key}" if where else key
            if key not in data:
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                    continue
                raise RecordError(f"{cls.__name__} is missing '{label}'")
            kwargs[f.name] = _convert(label, data[key], hints[f.name])
        known = {_key(f) for f in dataclasses.fields(cls) if f.name in names}
        extra = {k: v for k, v in data.items() if k not in known}
        record = cls(**kwargs, extra=extra)  # type: ignore[call-arg]
        object.__setattr__(record, "_key_order", tuple(data))  # written back in the same order
        return record

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if value is None and f.metadata.get("omit_none"):
                continue
            out[_key(f)] = _plain(value)
        out.update(getattr(self, "extra", {}))
        order = getattr(self, "_key_order", None)
        if order is not None and set(order) == set(out):
            out = {k: out[k] for k in order}
        return out


def _key(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("key", f.name)


def _extra() -> Any:
    return field(default_factory=dict, compare=True, repr=False)


# -- this project's additions (under the "polyrl" key) ---------------------------------------


@dataclass(frozen=True)
class SegmentInfo(Record):
    """Who generated tokens ``[start, end)`` of the sequence (prompt included): the engine
    (a router's replica name; empty for a lone engine), the policy version it served and the
    fingerprint of the weights it held (None from an engine that does not attest)."""

    start: int
    end: int
    version: int
    fingerprint: str | None = None
    engine: str = ""
    extra: dict[str, Any] = _extra()


@dataclass(frozen=True)
class RunInfo(Record):
    """What a polyrl run adds to a trajectory record. Times are seconds on the run's clock
    (the recorder's: 0 at its creation); ``None`` where a value is not known."""

    start_version: int  # policy version of the first generated token
    turn_versions: tuple[int, ...]  # per turn: version at the turn's first token
    start_s: float  # episode start
    end_s: float  # episode end (reward computed)
    turn_start_s: tuple[float, ...]
    tool_start_s: tuple[float, ...]  # per tool call, in ``tool_calls`` order
    tool_error_kind: tuple[str | None, ...]
    reward: float
    reward_s: float  # time spent computing the outcome reward
    end_reason: str  # done | max_turns | max_length | tool_response_too_long
    queue_wait_s: float = 0.0  # the group's wait for admission before it started
    train_step: int | None = None  # the step that trained it (None: not trained yet / dropped)
    staleness: int | None = None  # train version - start version
    worker: str = ""
    segments: tuple[SegmentInfo, ...] = ()  # the generated tokens' engines and weights
    extra: dict[str, Any] = _extra()


# -- multi-turn workload -------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnRecord(Record):
    """One generation call of a trajectory."""

    turn: int
    generation_prompt_len: int
    prompt_tokens: int
    cached_tokens: int  # prefix-cache hits
    max_new_tokens: int
    completion_tokens: int
    generated_text_token_len: int
    assistant_append_len: int
    assistant_loss_len: int
    total_len_after: int
    finish_reason: str  # tool_calls | stop | length
    tool_call_count: int
    engine_latency_s: float
    extra: dict[str, Any] = _extra()


@dataclass(frozen=True)
class ToolCallTrace(Record):
    """One tool call of a trajectory."""

    turn: int
    tool_name: str
    query_count: int
    latency_s: float
    response_token_len: int
    append_len: int
    loss_len: int  # 0: tool output is not trained on
    status: str  # success | unknown | api_error (published); this project adds error | timeout
    total_results: int
    extra: dict[str, Any] = _extra()


@dataclass(frozen=True)
class WorkloadRecord(Record):
    """One trajectory of ``multiturn_workload_step_N.jsonl``."""

    step: int
    prompt_len: int
    max_response_len: int
    max_model_len: int
    turns: tuple[TurnRecord, ...]
    tool_calls: tuple[ToolCallTrace, ...]
    finish_reason: str
    final_total_len: int
    final_response_len: int
    final_response_attention_len: int
    final_response_loss_len: int
    response_loss_mask_rle: tuple[tuple[int, int], ...]  # [[1, n], [0, m], ...]
    turn_count: int
    tool_call_count: int
    validate: bool
    prompt_group_id: int
    sample_id: int
    polyrl: RunInfo | None = field(default=None, metadata={"key": NAMESPACE, "omit_none": True})
    extra: dict[str, Any] = _extra()

    @property
    def end_to_end_s(self) -> float:
        """Generation plus tool time: the trajectory's rollout time with no queueing before it."""
        return sum(t.engine_latency_s for t in self.turns) + sum(c.latency_s for c in self.tool_calls)


# -- packed lengths and reward timings -----------------------------------------------------------


@dataclass(frozen=True)
class PackedLengthsRecord(Record):
    """One prompt of ``packed_lengths_step_N.jsonl``: its input length and its samples' outputs."""

    step: int
    rank: int
    tp_rank: int
    dp_rank: int
    local_index: int
    input: int
    output: tuple[int, ...]
    n_sampling: int
    validate: bool
    extra: dict[str, Any] = _extra()


@dataclass(frozen=True)
class RewardTimingRecord(Record):
    """One data-parallel rank's reward computation for one step."""

    step: int
    rank: int
    tp_rank: int
    dp_rank: int
    batch_size: int
    reward_time_s: float
    response_sum: int
    response_mean: float
    response_max: int
    validate: bool
    extra: dict[str, Any] = _extra()


# -- task distribution parameters ------------------------------------------------------------------


@dataclass(frozen=True)
class TaskDistribution(Record):
    """``task_distribution_parameters.json``: fitted length distributions of a deployment.

    The nested fits are kept as the published objects; the accessors below read the parts
    this project uses.
    """

    version: str
    extraction_info: dict[str, Any]
    math_task: dict[str, Any]
    tool_calling_task: dict[str, Any]
    extra: dict[str, Any] = _extra()

    def math_lognorm(self, which: str) -> tuple[float, float, float]:
        """``(shape, loc, scale)`` of the math task's ``input`` or ``output`` length fit."""
        params = self.math_task[f"{which}_distribution"]["parameters"]
        return float(params[0]), float(params[1]), float(params[2])

    def call_count_histogram(self) -> dict[int, int]:
        counts = self.tool_calling_task["call_count_distribution"]
        return {int(k): int(v) for k, v in sorted(counts.items(), key=lambda kv: int(kv[0]))}
