"""A training run's trajectories and stage timings, written as PolyTrace files.

Per trained step ``N`` a :class:`TraceWriter` appends, in the run directory's ``trace/``:

* ``multiturn_workload_step_N.jsonl`` — one :class:`~orchestrator.trace.records.WorkloadRecord`
  per trained trajectory, with the published field names; this project's additions (policy
  versions, staleness at train time, queue wait, per-call start times) go under ``"polyrl"``;
* ``reward_timings_step_N.jsonl`` — per rollout worker: reward time and response lengths of
  the samples it contributed (the published file has one record per data-parallel rank);
* ``packed_lengths_step_N.jsonl`` — per prompt group: prompt length and response lengths.

Files are written when the step is reported, so a run that fails part-way keeps every step
it trained. Tool statuses keep this project's names except ``ok``, written as the published
``success``; token counts are those of the run's tokenizer. A tool call's ``query_count`` is
read here, from the metadata its tool reported (1 when it reported none): the episode runner
passes tool metadata through without reading it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from orchestrator.trace.reader import step_file
from orchestrator.trace.records import (
    PackedLengthsRecord,
    Record,
    RewardTimingRecord,
    RunInfo,
    ToolCallTrace,
    TurnRecord,
    WorkloadRecord,
)
from orchestrator.types import Group, ToolTiming, Trajectory

TOOL_STATUS = {"ok": "success"}


def loss_mask_rle(mask: Sequence[bool]) -> tuple[tuple[int, int], ...]:
    runs: list[list[int]] = []
    for bit in mask:
        value = int(bit)
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return tuple((v, n) for v, n in runs)


def query_count(call: ToolTiming) -> int:
    """The published ``query_count`` of a call: what its tool reported, else 1 (one query)."""
    value = call.metadata.get("query_count", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def workload_record(trajectory: Trajectory, step: int, train_version: int | None = None,
                    queue_wait: float = 0.0, max_model_len: int | None = None) -> WorkloadRecord:
    t = trajectory
    prompt_len = t.prompt_tokens
    response_mask = t.loss_mask[prompt_len:]
    total_max = max_model_len or prompt_len + t.max_tokens * max(len(t.turns), 1)
    calls_by_turn: dict[int, int] = defaultdict(int)
    for call in t.tool_calls:
        calls_by_turn[call.turn] += 1
    turns = []
    length = prompt_len
    for turn in t.turns:
        length = turn.prompt_tokens + turn.completion_tokens
        turns.append(TurnRecord(
            turn=turn.turn, generation_prompt_len=turn.prompt_tokens,
            prompt_tokens=turn.prompt_tokens, cached_tokens=turn.cached_tokens,
            max_new_tokens=turn.max_new_tokens, completion_tokens=turn.completion_tokens,
            generated_text_token_len=turn.text_tokens,
            assistant_append_len=turn.completion_tokens,
            assistant_loss_len=turn.completion_tokens, total_len_after=length,
            finish_reason=turn.finish_reason, tool_call_count=turn.tool_call_count,
            engine_latency_s=turn.latency,
        ))
    calls = tuple(ToolCallTrace(
        turn=c.turn, tool_name=c.name or "", query_count=query_count(c), latency_s=c.latency,
        response_token_len=c.response_tokens, append_len=c.append_tokens, loss_len=0,
        status=TOOL_STATUS.get(c.status, c.status), total_results=0,
    ) for c in t.tool_calls)
    info = RunInfo(
        start_version=t.start_version,
        turn_versions=tuple(turn.version for turn in t.turns),
        start_s=t.started_at, end_s=t.finished_at,
        turn_start_s=tuple(turn.start for turn in t.turns),
        tool_start_s=tuple(c.start for c in t.tool_calls),
        tool_error_kind=tuple(c.error_kind for c in t.tool_calls),
        reward=t.reward, reward_s=t.reward_seconds, end_reason=t.end_reason,
        queue_wait_s=queue_wait, train_step=step if train_version is not None else None,
        staleness=None if train_version is None else train_version - t.start_version,
        worker=t.worker,
    )
    return WorkloadRecord(
        step=step, prompt_len=prompt_len, max_response_len=total_max - prompt_len,
        max_model_len=total_max, turns=tuple(turns), tool_calls=calls,
        finish_reason=turns[-1].finish_reason if turns else "stop",
        final_total_len=len(t.token_ids), final_response_len=len(t.token_ids) - prompt_len,
        final_response_attention_len=len(t.token_ids) - prompt_len,
        final_response_loss_len=sum(response_mask), response_loss_mask_rle=loss_mask_rle(response_mask),
        turn_count=len(turns), tool_call_count=len(calls), validate=False,
        prompt_group_id=t.prompt_id, sample_id=t.sample_index, polyrl=info,
    )


def reward_timing_records(groups: Sequence[Group], step: int) -> list[RewardTimingRecord]:
    by_worker: dict[str, list[Trajectory]] = defaultdict(list)
    for group in groups:
        for t in group.trajectories:
            by_worker[t.worker].append(t)
    records = []
    for rank, (_, trajectories) in enumerate(sorted(by_worker.items())):
        lengths = [len(t.token_ids) - t.prompt_tokens for t in trajectories]
        records.append(RewardTimingRecord(
            step=step, rank=rank, tp_rank=0, dp_rank=rank, batch_size=len(trajectories),
            reward_time_s=sum(t.reward_seconds for t in trajectories),
            response_sum=sum(lengths), response_mean=sum(lengths) / len(lengths),
            response_max=max(lengths), validate=False,
        ))
    return records


def packed_lengths_records(groups: Sequence[Group], step: int) -> list[PackedLengthsRecord]:
    return [PackedLengthsRecord(
        step=step, rank=0, tp_rank=0, dp_rank=0, local_index=i,
        input=g.trajectories[0].prompt_tokens if g.trajectories else 0,
        output=tuple(len(t.token_ids) - t.prompt_tokens for t in g.trajectories),
        n_sampling=len(g), validate=False,
    ) for i, g in enumerate(groups)]


def write_records(path: Path, records: Iterable[Record]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for record in records:
            f.write(json.dumps(record.to_dict()) + "\n")


class TraceWriter:
    """Writes each trained step's PolyTrace files into ``directory``."""

    def __init__(self, directory: Path, max_model_len: int | None = None) -> None:
        self.directory = Path(directory)
        self.max_model_len = max_model_len
        self.steps = 0

    def write_step(self, step: int, version: int, groups: Sequence[Group]) -> None:
        records = [
            workload_record(t, step, version, g.queue_wait, self.max_model_len)
            for g in groups for t in g.trajectories
        ]
        write_records(self.directory / step_file("multiturn_workload", step), records)
        write_records(self.directory / step_file("reward_timings", step),
                      reward_timing_records(groups, step))
        write_records(self.directory / step_file("packed_lengths", step),
                      packed_lengths_records(groups, step))
        self.steps += 1
