"""Streaming reader for PolyTrace directories.

A trace directory holds any of the published files (see :mod:`orchestrator.trace.records`)::

    multiturn_workload_step_N.jsonl   packed_lengths_step_N.jsonl
    reward_timings_step_N.jsonl       task_distribution_parameters.json

and a run directory holds the same records in its ``trace/`` folder, compressed and rolled
(:mod:`orchestrator.trace.jsonl`): ``trace/<kind>.<first step>.jsonl.zst``, each file many
steps of one kind (every record names its step). Step files may also be compressed
(``multiturn_workload_step_N.jsonl.zst`` or ``.gz``). :func:`iter_records` yields typed records one
line at a time, so a 2,048-trajectory step is never held as raw JSON; a line that is not valid
JSON or not the expected record raises :class:`TraceFormatError` naming the file and line.
:class:`TraceDir` lists what a directory holds by kind and step, whatever the layout;
``python -m orchestrator.trace export`` writes a plain copy in the published layout.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Literal, TypeVar

from orchestrator.errors import PolyRLError
from orchestrator.trace.jsonl import compressed, read_lines
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
STEP_FILE = re.compile(
    r"^(multiturn_workload|packed_lengths|reward_timings)_step_(\d+)\.jsonl(?:\.zst|\.gz)?$")
ROLLED_FILE = re.compile(
    r"^(multiturn_workload|packed_lengths|reward_timings)\.(\d+)\.jsonl(?:\.zst|\.gz)?$")
RUN_TRACE = "trace"  # a run directory's folder of PolyTrace files
_STEP_KEY = re.compile(r'^\{"step": (\d+)[,}]')
SHIPPED_SAMPLE = Path(__file__).parent / "data" / "search_r1"

R = TypeVar("R", bound=Record)


class TraceFormatError(PolyRLError, ValueError):
    """A trace file with a bad record; the message names the file and line."""


def step_file(kind: str, step: int) -> str:
    return f"{kind}_step_{step}.jsonl"


def file_kind(path: Path) -> str | None:
    """The record kind of a step file or a rolled file, by its name (None: neither)."""
    match = STEP_FILE.match(path.name) or ROLLED_FILE.match(path.name)
    return match.group(1) if match else None


def iter_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of a trace file, plain or compressed, blank lines skipped; in a
    compressed file (a run's) a last line a crash cut short is skipped too."""
    for line_no, line in enumerate(read_lines(path, cut_last=compressed(path)), 1):
        if line.strip():
            yield line_no, line


def parse_line(path: Path, line_no: int, line: str, record: type[R]) -> R:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{path}:{line_no}: not valid JSON ({e.msg})") from e
    if not isinstance(data, dict):
        raise TraceFormatError(f"{path}:{line_no}: expected a JSON object per line")
    try:
        return record.from_dict(data)
    except RecordError as e:
        raise TraceFormatError(f"{path}:{line_no}: {e}") from e


def line_step(line: str) -> int | None:
    """The ``step`` of a record's line, read without parsing the whole line when it comes
    first (as every record this project writes has it); None if the line has none."""
    match = _STEP_KEY.match(line)
    if match:
        return int(match.group(1))
    try:
        data = json.loads(line)
    except json.JSONDecodeError:
        return None
    step = data.get("step") if isinstance(data, dict) else None
    return step if isinstance(step, int) else None


def iter_records(path: Path, record: type[R] | None = None, step: int | None = None) -> Iterator[R]:
    """Typed records of one step file (``<kind>_step_<N>.jsonl``, plain or compressed) or
    rolled file (``<kind>.<first>.jsonl.zst``: only the records of ``step``, if given), one
    line at a time (blank lines skipped)."""
    path = Path(path)
    if record is None:
        kind = file_kind(path)
        if kind is None:
            raise TraceFormatError(
                f"{path}: not a PolyTrace step file (expected <kind>_step_<N>.jsonl with kind "
                f"one of {', '.join(KINDS)})")
        record = KINDS[kind]  # type: ignore[assignment]
    assert record is not None
    for line_no, line in iter_lines(path):
        if step is None or line_step(line) == step:
            yield parse_line(path, line_no, line, record)


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
    """The PolyTrace files of one directory, by kind and step. Reading a rolled file's steps in
    order decodes it once (a cursor per file goes on from the last step read)."""

    path: Path
    files: dict[str, dict[int, Path]]  # kind -> step -> file
    task_distribution: Path | None
    _cursors: dict[Path, _Cursor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def open(cls, path: Path | str) -> TraceDir:
        """The files of ``path`` and of its ``trace/`` folder (a run directory's), step files
        and rolled files alike (a rolled file's steps are read from its lines)."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"trace directory {path} does not exist")
        files: dict[str, dict[int, Path]] = {k: {} for k in KINDS}
        folders = [path, path / RUN_TRACE] if (path / RUN_TRACE).is_dir() else [path]
        for p in sorted(p for folder in folders for p in folder.iterdir()):
            match = STEP_FILE.match(p.name)
            if match:
                files[match.group(1)][int(match.group(2))] = p
            elif (match := ROLLED_FILE.match(p.name)):
                for _, line in iter_lines(p):
                    step = line_step(line)
                    if step is not None:
                        files[match.group(1)][step] = p
        files = {k: dict(sorted(v.items())) for k, v in files.items()}
        dist = path / TASK_DISTRIBUTION
        return cls(path, files, dist if dist.is_file() else None)

    def steps(self, kind: Kind = "multiturn_workload") -> list[int]:
        return list(self.files[kind])

    def workload(self, step: int) -> Iterator[WorkloadRecord]:
        return self.records("multiturn_workload", step)  # type: ignore[return-value]

    def packed_lengths(self, step: int) -> Iterator[PackedLengthsRecord]:
        return self.records("packed_lengths", step)  # type: ignore[return-value]

    def reward_timings(self, step: int) -> Iterator[RewardTimingRecord]:
        return self.records("reward_timings", step)  # type: ignore[return-value]

    def records(self, kind: str, step: int) -> Iterator[Record]:
        """The records of ``kind`` at ``step``, from its step file or its rolled file."""
        path = self._file(kind, step)
        if ROLLED_FILE.match(path.name) is None:
            return iter_records(path, KINDS[kind])
        cursor = self._cursors.get(path)
        if cursor is None or cursor.next_step > step:  # not read yet, or read past: restart
            cursor = self._cursors[path] = _Cursor(path)
        return (parse_line(path, n, line, KINDS[kind]) for n, line in cursor.lines_of(step))

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


class _Cursor:
    """Where a rolled file has been read to: its steps are in order, so the lines of a later
    step follow on from those of an earlier one."""

    def __init__(self, path: Path) -> None:
        self._lines = iter_lines(path)
        self._ahead: tuple[int, str] | None = None  # the first line of the next step
        self.next_step = -1  # the step of that line (-1: not read yet)

    def lines_of(self, step: int) -> list[tuple[int, str]]:
        """The (line number, line) of ``step``, reading on from where the cursor is."""
        out: list[tuple[int, str]] = []
        pending = [self._ahead] if self._ahead is not None else []
        self._ahead = None
        for n, line in chain(pending, self._lines):
            s = line_step(line)
            if s is None or s < step:
                continue
            if s > step:
                self._ahead, self.next_step = (n, line), s
                return out
            out.append((n, line))
        self.next_step = 1 << 62  # the end: a later request starts again
        return out


def find_trace_dirs(root: Path | str) -> list[TraceDir]:
    """``root`` and every directory below it that holds PolyTrace files (a run directory's
    ``trace/`` folder counts as part of the run directory, not as one more)."""
    root = Path(root)
    dirs = [root, *sorted(p for p in root.rglob("*") if p.is_dir())]
    found = [TraceDir.open(d) for d in dirs
             if not (d.name == RUN_TRACE and d != root and d.parent in dirs)]
    return [t for t in found if not t.empty]
