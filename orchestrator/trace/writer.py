"""A training run's trajectories and stage timings, written as PolyTrace records.

Per trained step ``N`` a :class:`TraceWriter` writes, into the run directory's ``trace/``:

* ``multiturn_workload`` — one :class:`~orchestrator.trace.records.WorkloadRecord` per trained
  trajectory, with the published field names; this project's additions (policy versions,
  staleness at train time, queue wait, per-call start times, each generated segment's engine,
  version and weights' fingerprint: ``segments``) go under ``"polyrl"``;
* ``reward_timings`` — per rollout worker: reward time and response lengths of the samples it
  contributed (the published file has one record per data-parallel rank);
* ``packed_lengths`` — per prompt group: prompt length and response lengths.

Stored compressed and rolled (:mod:`orchestrator.trace.jsonl`): each kind's records go to
``trace/<kind>.<first step>.jsonl.zst``, a new file every ``roll_steps`` steps, every record
naming its step; the reader takes them as it takes the published per-step files, and
``python -m orchestrator.trace export <run_dir>`` writes those (``<kind>_step_N.jsonl``, the
same lines). ``codec="none"`` writes the published per-step files directly. Records are
written and flushed when the step is reported, so a run that fails part-way keeps every step
it trained; :func:`drop_steps_from` removes the steps a resumed run redoes. Tool statuses keep this project's names except ``ok``, written as the published
``success``; token counts are those of the run's tokenizer. A tool call's ``query_count`` is
read here, from the metadata its tool reported (1 when it reported none): the episode runner
passes tool metadata through without reading it.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from orchestrator.trace.jsonl import (
    CODEC,
    ROLL_STEPS,
    Codec,
    CompressedFile,
    SegmentWriter,
    check_codec,
    finished,
    strip_suffix,
)
from orchestrator.trace.reader import (
    KINDS,
    ROLLED_FILE,
    RUN_TRACE,
    STEP_FILE,
    iter_lines,
    line_step,
    step_file,
)
from orchestrator.trace.records import (
    PackedLengthsRecord,
    Record,
    RewardTimingRecord,
    RunInfo,
    SegmentInfo,
    ToolCallTrace,
    TurnRecord,
    WorkloadRecord,
)
from orchestrator.types import EpisodeTiming, Group, GroupTiming, ToolTiming, Trajectory

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


def workload_record(trajectory: Trajectory, timing: EpisodeTiming, step: int,
                    train_version: int | None = None, queue_wait: float = 0.0,
                    max_total_tokens: int | None = None) -> WorkloadRecord:
    """One episode's record: its tokens from ``trajectory``, its timings from ``timing``; the
    record's ``max_model_len`` (PolyTrace's name) is the run's ``rollout.max_total_tokens``,
    else the episode's own cap (its prompt and each turn's ``max_tokens``)."""
    t, e = trajectory, timing
    prompt_len = t.prompt_tokens
    response_mask = t.loss_mask[prompt_len:]
    total_max = max_total_tokens or prompt_len + t.max_tokens * max(len(e.turns), 1)
    turns = []
    length = prompt_len
    for turn in e.turns:
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
    ) for c in e.tool_calls)
    info = RunInfo(
        start_version=t.start_version,
        turn_versions=tuple(turn.version for turn in e.turns),
        start_s=e.started_at, end_s=e.finished_at,
        turn_start_s=tuple(turn.start for turn in e.turns),
        tool_start_s=tuple(c.start for c in e.tool_calls),
        tool_error_kind=tuple(c.error_kind for c in e.tool_calls),
        reward=t.reward, reward_s=e.reward_seconds, end_reason=t.end_reason,
        queue_wait_s=queue_wait, train_step=step if train_version is not None else None,
        staleness=None if train_version is None else train_version - t.start_version,
        worker=e.worker,
        segments=tuple(SegmentInfo(a.start, a.end, a.version, a.fingerprint, a.engine)
                       for a in t.attestations),
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


def reward_timing_records(groups: Sequence[Group], timings: Sequence[GroupTiming],
                          step: int) -> list[RewardTimingRecord]:
    by_worker: dict[str, list[tuple[Trajectory, EpisodeTiming]]] = defaultdict(list)
    for group, timing in zip(groups, timings, strict=True):
        for t, e in zip(group.trajectories, timing.episodes, strict=True):
            by_worker[e.worker].append((t, e))
    records = []
    for rank, (_, episodes) in enumerate(sorted(by_worker.items())):
        lengths = [len(t.token_ids) - t.prompt_tokens for t, _ in episodes]
        records.append(RewardTimingRecord(
            step=step, rank=rank, tp_rank=0, dp_rank=rank, batch_size=len(episodes),
            reward_time_s=sum(e.reward_seconds for _, e in episodes),
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
    """Writes each trained step's PolyTrace records into ``directory``: rolled and compressed
    with ``codec`` (``zst``, ``gz``), or as the published per-step files (``none``)."""

    def __init__(self, directory: Path, max_total_tokens: int | None = None, codec: Codec = CODEC,
                 roll_steps: int = ROLL_STEPS) -> None:
        self.directory = Path(directory)
        self.max_total_tokens = max_total_tokens
        self.codec = check_codec(codec)
        if roll_steps < 1:
            raise ValueError(f"roll_steps must be >= 1, got {roll_steps}")
        self.roll_steps = roll_steps
        self._segments = {kind: SegmentWriter(self.directory, kind, codec) for kind in KINDS}
        self._first = 0  # the first step of the open segments
        self.steps = 0

    def write_step(self, step: int, version: int, groups: Sequence[Group],
                   timings: Sequence[GroupTiming]) -> None:
        """Step ``step``'s records: its trained ``groups`` (trained at ``version``) and when
        they ran (``timings``, in the groups' order)."""
        records: dict[str, list[Record]] = {
            "multiturn_workload": [
                workload_record(t, e, step, version, timing.queue_wait, self.max_total_tokens)
                for g, timing in zip(groups, timings, strict=True)
                for t, e in zip(g.trajectories, timing.episodes, strict=True)],
            "reward_timings": list(reward_timing_records(groups, timings, step)),
            "packed_lengths": list(packed_lengths_records(groups, step)),
        }
        if self.codec == "none":
            for kind, rows in records.items():
                write_records(self.directory / step_file(kind, step), rows)
        else:
            roll = not self.steps or step >= self._first + self.roll_steps or step < self._first
            if roll:
                self._first = step
            for kind, rows in records.items():
                segment = self._segments[kind]
                if roll:
                    segment.roll(step)
                segment.write("".join(json.dumps(r.to_dict()) + "\n" for r in rows))
                segment.flush()
        self.steps += 1

    def close(self) -> None:
        for segment in self._segments.values():
            segment.close()


def drop_steps_from(run_dir: Path, step: int) -> None:
    """Remove the records of steps ``step`` and later from ``run_dir``'s PolyTrace files (its
    ``trace/`` folder): step files are deleted, a
    rolled file is rewritten with the lines of earlier steps only (a line a crash cut short
    goes too), atomically, or deleted when none is left."""
    folder = run_dir / RUN_TRACE
    if folder.is_dir():
        for path in sorted(folder.iterdir()):
            if (match := STEP_FILE.match(path.name)) and int(match.group(2)) >= step:
                path.unlink()
            elif ROLLED_FILE.match(path.name):
                _keep_steps_before(path, step)


def _keep_steps_before(path: Path, step: int) -> None:
    lines = [line for _, line in iter_lines(path)]
    kept = [line for line in lines if (line_step(line) or 0) < step]
    if not kept:
        path.unlink()
        return
    if len(kept) == len(lines) and finished(path):
        return
    codec = check_codec(path.name.rsplit(".", 1)[-1] if path.name.endswith((".zst", ".gz"))
                        else "none")
    scratch = path.with_name(f".{strip_suffix(path.name)}.tmp")
    out = CompressedFile(scratch, codec)
    out.write("".join(kept))
    out.close()
    os.replace(scratch, path)


def export_plain(source: Path, target: Path) -> int:
    """A plain copy of ``source``'s PolyTrace records (a run directory, its ``trace/``, or
    any trace directory, compressed or not) in the published layout: ``target/<kind>_step_N.jsonl``,
    each line as stored (byte for byte). Returns the number of files written. ``target`` must
    not hold step files already."""
    from orchestrator.trace.reader import TASK_DISTRIBUTION, TraceDir, file_kind

    trace = TraceDir.open(source)
    if trace.empty:
        raise FileNotFoundError(f"{source} holds no PolyTrace files")
    target = Path(target)
    if target.is_dir() and any(file_kind(p) for p in target.iterdir()):
        raise ValueError(f"{target} already holds PolyTrace step files; choose an empty or new "
                         f"directory")
    target.mkdir(parents=True, exist_ok=True)
    written = 0
    for kind, steps in trace.files.items():
        for path in dict.fromkeys(steps.values()):  # each source file once, in step order
            rolled = ROLLED_FILE.match(path.name) is not None
            out, current = None, None
            try:
                for _, line in iter_lines(path):
                    step = line_step(line) if rolled else int(STEP_FILE.match(path.name).group(2))  # type: ignore[union-attr]
                    if step != current:
                        if out is not None:
                            out.close()
                        out = (target / step_file(kind, step)).open("a")
                        current = step
                        written += 1
                    out.write(line if line.endswith("\n") else line + "\n")
            finally:
                if out is not None:
                    out.close()
    if trace.task_distribution is not None:
        (target / TASK_DISTRIBUTION).write_bytes(trace.task_distribution.read_bytes())
    return written
