"""Streaming reader for PolyTrace directories.

A trace directory holds any of the published files (see :mod:`orchestrator.trace.records`)::

    multiturn_workload_step_N.jsonl   packed_lengths_step_N.jsonl
    reward_timings_step_N.jsonl       task_distribution_parameters.json

:func:`iter_records` yields typed records one line at a time, so a 2,048-trajectory step is
never held as raw JSON; a line that is not valid JSON or not the expected record raises
:class:`TraceFormatError` naming the file and line. :class:`TraceDir` lists what a directory
holds by kind and step.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from orchestrator.trace.records import (
    PackedLengthsRecord,
    Record,
    RecordError,
    RewardTimingRecord,
    TaskDistribution,
    WorkloadRecord,
)

Kind = Literal["multiturn_workload", "packed_lengths", "reward_timings"]
KINDS: dict[str, type[Record]] = {
    "multiturn_workload": WorkloadRecord,
    "packed_lengths": PackedLengthsRecord,
    "reward_timings": RewardTimingRecord,
}
TASK_DISTRIBUTION = "task_distribution_parameters.json"
STEP_FILE = re.compile(r"^(multiturn_workload|packed_lengths|reward_timings)_step_(\d+)\.jsonl$")
SHIPPED_SAMPLE = Path(__file__).parent / "data" / "search_r1"

R = TypeVar("R", bound=Record)


class TraceFormatError(ValueError):
    """A trace file with a bad record; the message names the file and line."""


def step_file(kind: str, step: int) -> str:
    return f"{kind}_step_{step}.jsonl"


def iter_records(path: Path, record: type[R] | None = None) -> Iterator[R]:
    """Typed records of one ``*_step_N.jsonl`` file, one line at a time (blank lines skipped)."""
    path = Path(path)
    if record is None:
        match = STEP_FILE.match(path.name)
        if match is None:
            raise TraceFormatError(
                f"{path}: not a PolyTrace step file (expected <kind>_step_<N>.jsonl with kind "
                f"one of {', '.join(KINDS)})")
        record = KINDS[match.group(1)]  # type: ignore[assignment]
    assert record is not None
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"{path}:{line_no}: not valid JSON ({e.msg})") from e
            if not isinstance(data, dict):
                raise TraceFormatError(f"{path}:{line_no}: expected a JSON object per line")
            try:
                yield record.from_dict(data)
            except RecordError as e:
                raise TraceFormatError(f"{path}:{line_no}: {e}") from e


def read_task_distribution(path: Path) -> TaskDistribution:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from e
    try:
        return TaskDistribution.from_dict(data)
    except RecordError as e:
        raise TraceFormatError(f"{path}: {e}") from e


@dataclass(frozen=True)
class TraceDir:
    """The PolyTrace files of one directory, by kind and step."""

    path: Path
    files: dict[str, dict[int, Path]]  # kind -> step -> file
    task_distribution: Path | None

    @classmethod
    def open(cls, path: Path | str) -> TraceDir:
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"trace directory {path} does not exist")
        files: dict[str, dict[int, Path]] = {k: {} for k in KINDS}
        for p in path.iterdir():
            match = STEP_FILE.match(p.name)
            if match:
                files[match.group(1)][int(match.group(2))] = p
        files = {k: dict(sorted(v.items())) for k, v in files.items()}
        dist = path / TASK_DISTRIBUTION
        return cls(path, files, dist if dist.is_file() else None)

    def steps(self, kind: Kind = "multiturn_workload") -> list[int]:
        return list(self.files[kind])

    def workload(self, step: int) -> Iterator[WorkloadRecord]:
        return iter_records(self._file("multiturn_workload", step), WorkloadRecord)

    def packed_lengths(self, step: int) -> Iterator[PackedLengthsRecord]:
        return iter_records(self._file("packed_lengths", step), PackedLengthsRecord)

    def reward_timings(self, step: int) -> Iterator[RewardTimingRecord]:
        return iter_records(self._file("reward_timings", step), RewardTimingRecord)

    def _file(self, kind: str, step: int) -> Path:
        try:
            return self.files[kind][step]
        except KeyError:
            have = ", ".join(map(str, self.files[kind])) or "none"
            raise FileNotFoundError(
                f"{self.path} has no {step_file(kind, step)} (steps with {kind}: {have})") from None

    @property
    def empty(self) -> bool:
        return not any(self.files.values()) and self.task_distribution is None


def find_trace_dirs(root: Path | str) -> list[TraceDir]:
    """``root`` and every directory below it that holds PolyTrace files."""
    root = Path(root)
    found = [TraceDir.open(d) for d in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]]
    return [t for t in found if not t.empty]
