"""A user's dataset files read as tasks (:mod:`envs.dataset`'s ``env=dataset``): the files a
split names (:func:`files_of`), each file's schema, its prompt and answer columns found by name
or by ``env.prompt_key`` / ``env.answer_key`` (:func:`read_segment`), the checks on its rows
(every bad row collected, :class:`BadRows`), and a split's rows as tasks built one at a time
from the memory-mapped files (:class:`Rows`, :class:`DatasetTask`)."""

from __future__ import annotations

import bisect
import glob
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, overload

from envs.base import Message, Task
from envs.errors import EnvConfigError

EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv", ".arrow")
PROMPT_KEYS = ("prompt", "messages", "question", "problem")
ANSWER_KEYS = ("reward_model.ground_truth", "answer", "solution", "ground_truth", "completion")
ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class DatasetTask(Task):
    """A row as a task: where it came from travels with it (not into the reward's metadata)."""

    source: str = ""
    split: str = ""
    file: str = ""
    row: int = 0  # 1 is the file's first row
    ground_truth: object = None  # the reference answer as the file holds it (text, number,
    # boolean, list, mapping); ``answer`` is its text

    @property
    def origin(self) -> str:
        return f"{self.file}:{self.row}"


@dataclass(frozen=True)
class Source:
    path: str | list[str]
    weight: float = 1.0


def sources_of(value: object, key: str) -> list[Source]:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [Source(str(value))]
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, Sequence):
        raise EnvConfigError(f"{key} must be a path, a glob, a list of them or a list of "
                             f"{{path: …, weight: …}}, got {value!r}")
    if all(isinstance(v, (str, os.PathLike)) for v in value):
        return [Source([str(v) for v in value])] if value else []
    sources = []
    for n, item in enumerate(value):
        if isinstance(item, (str, os.PathLike)):
            sources.append(Source(str(item)))
            continue
        if not isinstance(item, Mapping) or "path" not in item:
            raise EnvConfigError(f"{key}[{n}] must be a path or {{path: …, weight: …}}, got {item!r}")
        unknown = sorted(set(item) - {"path", "weight"})
        if unknown:
            raise EnvConfigError(f"{key}[{n}] has an unknown key {unknown[0]!r}: path and weight only")
        weight = item.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise EnvConfigError(f"{key}[{n}].weight must be a number > 0, got {weight!r}")
        path = item["path"]
        sources.append(Source(path if isinstance(path, str) else [str(p) for p in path], float(weight)))
    return sources


def files_of(paths: str | list[str], key: str) -> list[Path]:
    found: list[Path] = []
    for pattern in [paths] if isinstance(paths, str) else paths:
        pattern = os.path.expanduser(pattern)
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches or not os.path.exists(matches[0]):
            what = "no file matches" if glob.has_magic(pattern) else "no such file"
            raise EnvConfigError(f"{key}: {what} {pattern}")
        for match in matches:
            path = Path(match)
            if not path.is_dir() and path.suffix.lower() not in EXTENSIONS:
                raise EnvConfigError(f"{key}: {path} has an unknown extension {path.suffix!r}; "
                                     f"read: {', '.join(EXTENSIONS)} or a save_to_disk directory")
            found.append(path)
    return found


def _dig(row: Mapping[str, Any], path: str) -> Any:
    value: Any = row
    for part in path.split("."):
        value = value[part] if isinstance(value, Mapping) else None
    return value


@dataclass
class Segment:
    """One file: its rows, how its columns map, and where it sits in its split."""

    file: Path
    data: Any  # datasets.Dataset
    prompt_key: str
    answer_key: str | None  # None: each conversation's final assistant turn
    source: str | None  # None: each row's data_source column

    def __len__(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class Problem:
    row: int | None  # 0 is the file's first row
    column: str
    what: str


class BadRows(EnvConfigError):
    """A file's bad rows: the first :data:`SHOWN` of them (``problems``) and how many
    (``count``); its one line names the first."""

    def __init__(self, key: str, file: Path, problems: list[Problem], count: int) -> None:
        self.key, self.file, self.problems, self.count = key, file, problems, count
        more = f" ({count - 1} more bad rows: python -m orchestrator.data check lists them)" \
            if count > 1 else ""
        super().__init__(self.line(problems[0]) + more)

    def line(self, problem: Problem) -> str:
        where = f"row {problem.row + 1} " if problem.row is not None else ""
        return f"{self.key}: {self.file} {where}key {problem.column!r}: {problem.what}"


SHOWN = 20  # bad rows a file's report names


class _Checker:
    """Column checks in Arrow, a record batch at a time, collecting the file's bad rows
    (file, row (1 first), key): the first :data:`SHOWN` and their count."""

    def __init__(self, key: str, segment_file: Path) -> None:
        self.key, self.file = key, segment_file
        self.problems: list[Problem] = []
        self.count = 0

    def add(self, rows: Any, offset: int, column: str, what: Callable[[int], str]) -> None:
        """Rows ``rows`` (indices into the batch) are bad: ``what(i)`` says why."""
        self.count += len(rows)
        for i in rows[:max(0, SHOWN - len(self.problems))]:
            self.problems.append(Problem(offset + int(i), column, what(int(i))))

    def fail(self, row: int | None, column: str, what: str) -> EnvConfigError:
        return BadRows(self.key, self.file, [Problem(row, column, what)], 1)

    def done(self) -> None:
        if self.count:
            raise BadRows(self.key, self.file, sorted(self.problems, key=lambda p: p.row or 0),
                          self.count)

    def column(self, table: Any, path: str) -> Any:
        import pyarrow as pa
        import pyarrow.compute as pc

        head, *rest = path.split(".")
        column = table.column(head)
        for n, part in enumerate(rest):
            if not pa.types.is_struct(column.type) or column.type.get_field_index(part) < 0:
                raise self.fail(None, path, f"{'.'.join([head, *rest[:n]])} has no field {part!r}")
            column = pc.struct_field(column, [part])
        return column

    def prompt(self, column: Any, name: str, offset: int, answered: bool) -> None:
        """``answered``: the file has an answer column (else a conversation must end with
        the assistant's turn, its reference answer)."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        kind = column.type
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            empty = pc.fill_null(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(column)), 0), True)
            self.add(np.flatnonzero(empty.to_numpy(zero_copy_only=False)), offset, name,
                     lambda i: "the prompt is empty")
            return
        if not _is_messages(kind):
            raise self.fail(0, name, f"the prompt is neither a string nor a list of "
                            f"{{role, content}} messages (the column is {kind})")
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()  # a batch's: small
        lengths = pc.fill_null(pc.list_value_length(column), 0)
        self.add(np.flatnonzero(pc.equal(lengths, 0).to_numpy(zero_copy_only=False)), offset,
                 name, lambda i: "the prompt has no messages")
        flat = pc.list_flatten(column)
        parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
        roles = pc.struct_field(flat, ["role"])
        unknown = pc.fill_null(pc.invert(pc.is_in(roles, value_set=pa.array(sorted(ROLES)))), True)
        bad = np.flatnonzero(unknown.to_numpy(zero_copy_only=False))
        self.add(parents[bad], offset, name, lambda i: f"unknown role "
                 f"{_role(column, i)!r}; roles: {', '.join(sorted(ROLES))}")
        content = pc.is_null(pc.struct_field(flat, ["content"]))
        self.add(np.unique(parents[np.flatnonzero(content.to_numpy(zero_copy_only=False))]),
                 offset, name, lambda i: "a message has no content")
        if not answered and len(parents):  # each row's last message must be the answer
            last = np.flatnonzero(np.append(parents[1:] != parents[:-1], True))
            said = pc.fill_null(pc.not_equal(roles.take(pa.array(last)), "assistant"), True)
            self.add(parents[last][said.to_numpy(zero_copy_only=False)], offset, name,
                     lambda i: "no answer: the conversation does not end with the assistant's "
                     "turn and the file has no answer column (set env.answer_key)")

    def answer(self, column: Any, name: str, offset: int) -> None:
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        kind = column.type
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            empty = pc.fill_null(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(column)), 0), True)
        elif _is_messages(kind):  # a TRL conversational completion: it must say something
            if isinstance(column, pa.ChunkedArray):
                column = column.combine_chunks()
            empty = pc.fill_null(pc.equal(pc.list_value_length(column), 0), True)
        elif (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
              or pa.types.is_null(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind)
              or pa.types.is_struct(kind) or pa.types.is_decimal(kind)):
            empty = pc.is_null(column)
        else:
            raise self.fail(0, name, f"the answer must be text, a number, a boolean, a list or "
                            f"a struct (the column is {kind})")
        self.add(np.flatnonzero(empty.to_numpy(zero_copy_only=False)), offset, name,
                 lambda i: "the answer is empty")


def _is_messages(kind: Any) -> bool:
    import pyarrow as pa

    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return False
    item = kind.value_type
    return (pa.types.is_struct(item) and item.get_field_index("role") >= 0
            and item.get_field_index("content") >= 0)


def _role(column: Any, row: int) -> str:
    roles = [m.get("role") for m in column[row].as_py() or []]
    return next((r for r in roles if r not in ROLES), str(roles))


def _pick(columns: Sequence[str], schema: Any, wanted: str | None,
          candidates: Sequence[str]) -> str | None:
    if wanted is not None:
        return wanted
    for name in candidates:
        head, _, rest = name.partition(".")
        if head in columns:
            if not rest:
                return name
            import pyarrow as pa

            kind = schema.field(head).type
            if pa.types.is_struct(kind) and kind.get_field_index(rest) >= 0:
                return name
    return None


def read_segment(path: Path, key: str, prompt_key: str | None, answer_key: str | None) -> Segment:
    from envs import datafiles

    data = datafiles.load(path, key, answer_key, ANSWER_KEYS)
    schema = data.features.arrow_schema
    columns = list(data.column_names)
    checker = _Checker(key, path)
    prompt = _pick(columns, schema, prompt_key, PROMPT_KEYS)
    answer = _pick(columns, schema, answer_key, ANSWER_KEYS)
    have = f"its columns: {', '.join(columns) or 'none'}"
    if prompt is None or not _present(schema, prompt):
        what = f"no column for env.prompt_key={prompt}" if prompt_key else \
            f"no prompt column ({', '.join(PROMPT_KEYS)}); set env.prompt_key"
        raise EnvConfigError(f"{key}: {path} has {what}; {have}")
    conversation = _is_messages(schema.field(prompt.split(".")[0]).type) and "." not in prompt
    if answer is not None and not _present(schema, answer):
        raise EnvConfigError(f"{key}: {path} has no column for env.answer_key={answer}; {have}")
    if answer is None and not conversation:
        raise EnvConfigError(f"{key}: {path} has no answer column ({', '.join(ANSWER_KEYS)}); "
                             f"set env.answer_key; {have}")
    if len(data) == 0:
        raise EnvConfigError(f"{key}: {path} has no rows")
    offset = 0
    for batch in datafiles.batches(data):
        checker.prompt(checker.column(batch, prompt), prompt, offset, answer is not None)
        if answer is not None:
            checker.answer(checker.column(batch, answer), answer, offset)
        offset += batch.num_rows
    checker.done()
    source = None if "data_source" in columns else path.stem if path.is_file() else path.name
    return Segment(path, data, prompt, answer, source)


def _present(schema: Any, dotted: str) -> bool:
    from envs.datafiles import _has

    return _has(schema, dotted)


def prompts_of(segment: Segment) -> Iterator[Any]:
    """Each row's prompt as one string (messages joined), a batch at a time: what duplicates
    are found by."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from envs import datafiles

    checker = _Checker("", segment.file)
    for batch in datafiles.batches(segment.data):
        column = checker.column(batch, segment.prompt_key)
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            yield column
            continue
        contents = pc.struct_field(column.values, ["content"])
        yield pc.binary_join(pa.ListArray.from_arrays(column.offsets, contents), "\n")


def answer_text(value: Any) -> str:
    """A reference answer as the built-in rewards read it: text as it is (stripped); a
    number's digits; a boolean, list or mapping as JSON (``true``, ``[1, 2]``)."""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, (bool, list, dict)) or value is None:
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _completion(value: Any) -> Any:
    """A TRL conversational completion (messages): its last assistant turn's content."""
    if isinstance(value, list) and value and all(isinstance(m, Mapping) and "role" in m
                                                 and "content" in m for m in value):
        said = [m["content"] for m in value if m["role"] == "assistant"]
        return said[-1] if said else value[-1]["content"]
    return value


class Prompting(Protocol):
    """What :class:`Rows` needs of its environment (a :class:`~envs.dataset.DatasetSpec`): a
    row's prompt as the messages the model is given (the system prompt and instruction
    added)."""

    def messages(self, prompt: Any) -> tuple[Message, ...]: ...


class Rows(Sequence[Task]):
    """A split's rows as tasks, built one at a time from the memory-mapped files. With several
    weighted sources the split is a mixture: index ``i`` is slot ``i`` of an epoch
    (:func:`_slots`)."""

    def __init__(self, spec: Prompting, split: str, sources: list[list[Segment]],
                 weights: list[float]) -> None:
        self._spec, self._split = spec, split
        self._sources = sources
        self._starts = [[0] for _ in sources]  # each source's segment offsets
        for starts, segments in zip(self._starts, sources, strict=True):
            for segment in segments:
                starts.append(starts[-1] + len(segment))
        sizes = [starts[-1] for starts in self._starts]
        self.sizes = sizes
        total = sum(sizes)
        shares = [w / sum(weights) for w in weights] if weights else []
        self._slots = [max(1, round(share * total)) for share in shares] if len(sources) > 1 \
            else sizes
        self._slot_starts = [0]
        for n in self._slots:
            self._slot_starts.append(self._slot_starts[-1] + n)
        self._keep: list[int] | None = None  # after keep(): the indices left, in order

    def __len__(self) -> int:
        return len(self._keep) if self._keep is not None else self._slot_starts[-1]

    @overload
    def __getitem__(self, index: int) -> Task: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Task]: ...

    def __getitem__(self, index: int | slice) -> Task | Sequence[Task]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        slot = self._keep[index] if self._keep is not None else index
        return self._task(index, *self.locate(slot))

    def __iter__(self) -> Iterator[Task]:
        for i in range(len(self)):
            yield self[i]

    def locate(self, slot: int) -> tuple[Segment, int]:
        """The file and row of slot ``slot`` (before :meth:`keep`)."""
        source = bisect.bisect_right(self._slot_starts, slot) - 1
        within = slot - self._slot_starts[source]
        row = within * self.sizes[source] // self._slots[source]
        starts = self._starts[source]
        n = bisect.bisect_right(starts, row) - 1
        return self._sources[source][n], row - starts[n]

    def _task(self, index: int, segment: Segment, row: int) -> DatasetTask:
        values = segment.data[row]
        prompt = _dig(values, segment.prompt_key)
        if isinstance(prompt, list) and prompt and prompt[-1].get("role") == "assistant":
            *prompt, said = prompt  # the reference answer, never part of the prompt
            truth = said["content"] if segment.answer_key is None else None
        if segment.answer_key is not None:
            truth = _completion(_dig(values, segment.answer_key))
        source = segment.source or str(values.get("data_source") or segment.file.stem)
        head = segment.prompt_key.split(".")[0]
        metadata = {k: v for k, v in values.items() if k != head}
        metadata.setdefault("data_source", source)
        return DatasetTask(id=index, messages=self._spec.messages(prompt),
                           answer=answer_text(truth), metadata=metadata, source=source,
                           split=self._split, file=str(segment.file), row=row + 1,
                           ground_truth=truth)

    def keep(self, fits: Callable[[int], bool]) -> int:
        """Leave out the slots ``fits`` refuses (given each slot); the number left out. Task
        ids are renumbered so they stay positions in the split."""
        before = len(self)
        kept = [slot for slot in (self._keep if self._keep is not None else range(before))
                if fits(slot)]
        self._keep = kept
        return before - len(kept)

    def segments(self) -> Iterator[Segment]:
        for segments in self._sources:
            yield from segments
