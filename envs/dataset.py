"""A user's own files as a single-turn environment: ``env=dataset`` (the ``data`` extra).

* **Files.** ``env.train`` / ``env.eval``: a path, a glob, or a list of them; ``.jsonl``,
  ``.json``, ``.parquet``, ``.csv``, ``.arrow`` files and ``datasets.save_to_disk``
  directories, read through Hugging Face ``datasets`` from local files only (nothing from the
  hub). Files are memory-mapped Arrow (``load_dataset`` converts JSON, CSV and Parquet once,
  into its cache; ``.arrow`` files and ``save_to_disk`` directories are mapped where they lie),
  so a file of millions of rows is never turned into Python objects up front: a row becomes a
  :class:`Task` when the sampler asks for it. Checks run on whole columns in Arrow. A run
  needs ``env.train``; ``env.eval`` alone makes an environment to evaluate on
  (``python -m orchestrator.eval``). A task's :attr:`~DatasetTask.origin` is its ``file:row``.
* **Mixtures.** ``env.train`` may be a list of ``{path: …, weight: …}``; an epoch holds as many
  samples as all sources have rows, shared out by weight (a source's rows spread evenly over
  its share: repeated when it is up-sampled, the same evenly spaced subset each epoch when it
  is down-sampled). Each row keeps its ``data_source`` column, or its file's name, and
  :meth:`DatasetSpec.metrics` counts the samples each source got (``data/samples/<source>``).
* **Schemas** (per file, found by column names; ``env.prompt_key`` / ``env.answer_key``, dotted
  paths such as ``reward_model.ground_truth``, override): verl's (``prompt`` as a list of
  ``{role, content}`` messages, ``reward_model.ground_truth``, ``data_source``, ``ability``,
  ``extra_info``), TRL's (``prompt`` as a string or ``messages``, other columns passed to the
  reward by name), plain (``question`` / ``problem`` and ``answer`` / ``solution``). Every
  column but the prompt is the task's metadata and reaches the reward function.
* **Prompt.** A string becomes one user message; a message list is kept. ``env.system_prompt``
  is put first where the row has no system message; ``env.instruction`` is appended to the
  last user message where that message does not already contain it. The model's chat
  template is applied by the episode runner, as for every environment.
* **Order.** The orchestrator's ``TaskSampler`` shuffles the train split per epoch from the
  run's seed and keeps its position (and the prompts in flight) in the checkpoint, so a
  resumed run neither repeats nor skips a prompt within the epoch; the split's indices are
  stable across runs because files are read in sorted order.
* **Reward.** ``env.reward`` through :class:`envs.rewards.Scorer` (``math`` by default), in
  worker processes with ``env.reward_timeout_s`` per item; its counters join the metrics. An
  evaluation's majority vote reads and groups answers as that reward does
  (:meth:`DatasetSpec.votes`, :mod:`envs.votes`).
* **Bad input** (a missing file, an unknown extension, no prompt column, an empty answer, a
  prompt that is neither a string nor a list of messages, an unknown role, a bad reward) is an
  :class:`EnvConfigError` of one line naming the file, the row (1 is the first) and the key,
  raised by the constructor, before any training.

Limits: rows whose prompt is too long for the model are left out by the orchestrator, which
has the tokenizer (:meth:`DatasetSpec.keep`); duplicate prompts between train and eval are
reported, not removed.
"""

from __future__ import annotations

import bisect
import glob
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

from envs.base import Env, EnvSpec, Message, Reward, SingleTurnEnv, Task
from envs.errors import EnvConfigError
from envs.rewards import Scorer
from envs.votes import Votes, votes_for

log = logging.getLogger(__name__)

INSTALL_HINT = "env=dataset needs Hugging Face datasets: pip install -e .[data]"
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
EXTENSIONS = (*BUILDERS, ".arrow")
PROMPT_KEYS = ("prompt", "messages", "question", "problem")
ANSWER_KEYS = ("reward_model.ground_truth", "answer", "solution", "ground_truth")
ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class DatasetTask(Task):
    """A row as a task: where it came from travels with it (not into the reward's metadata)."""

    source: str = ""
    split: str = ""
    file: str = ""
    row: int = 0  # 1 is the file's first row

    @property
    def origin(self) -> str:
        return f"{self.file}:{self.row}"


@dataclass(frozen=True)
class Source:
    path: str | list[str]
    weight: float = 1.0


def _sources(value: object, key: str) -> list[Source]:
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


def _files(paths: str | list[str], key: str) -> list[Path]:
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


def _load(path: Path, key: str) -> Any:
    """A file as a memory-mapped ``datasets.Dataset``."""
    try:
        import datasets
    except ImportError as e:
        raise EnvConfigError(INSTALL_HINT) from e
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if len(loaded) != 1 and "train" not in loaded:
                    raise EnvConfigError(f"{key}: {path} holds splits {', '.join(loaded)}: name "
                                         "one split's directory")
                loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
            return loaded
        if path.suffix.lower() == ".arrow":
            return datasets.Dataset.from_file(str(path))
        return datasets.load_dataset(BUILDERS[path.suffix.lower()], data_files=[str(path)],
                                     split="train")
    except EnvConfigError:
        raise
    except Exception as e:  # datasets' many reader errors: one line for the user
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EnvConfigError(f"{key}: cannot read {path}: {message}") from e


def _dig(row: Mapping[str, Any], path: str) -> Any:
    value: Any = row
    for part in path.split("."):
        value = value[part] if isinstance(value, Mapping) else None
    return value


@dataclass
class _Segment:
    """One file: its rows, how its columns map, and where it sits in its split."""

    file: Path
    data: Any  # datasets.Dataset
    prompt_key: str
    answer_key: str
    source: str | None  # None: each row's data_source column

    def __len__(self) -> int:
        return len(self.data)


class _Checker:
    """Column checks in Arrow, naming the file, row (1 first) and key of the first bad row."""

    def __init__(self, key: str, segment_file: Path) -> None:
        self.key, self.file = key, segment_file

    def fail(self, row: int | None, column: str, what: str) -> EnvConfigError:
        where = f"row {row + 1} " if row is not None else ""
        return EnvConfigError(f"{self.key}: {self.file} {where}key {column!r}: {what}")

    def column(self, table: Any, path: str) -> Any:
        import pyarrow as pa
        import pyarrow.compute as pc

        head, *rest = path.split(".")
        column = table.column(head).combine_chunks()
        for n, part in enumerate(rest):
            if not pa.types.is_struct(column.type) or column.type.get_field_index(part) < 0:
                raise self.fail(None, path, f"{'.'.join([head, *rest[:n]])} has no field {part!r}")
            column = pc.struct_field(column, [part])
        return column

    def prompt(self, column: Any, name: str) -> None:
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        kind = column.type
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            empty = pc.fill_null(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(column)), 0), True)
            bad = np.flatnonzero(empty.to_numpy(zero_copy_only=False))
            if len(bad):
                raise self.fail(int(bad[0]), name, "the prompt is empty")
            return
        messages = pa.types.is_list(kind) or pa.types.is_large_list(kind)
        item = kind.value_type if messages else None
        if not (messages and pa.types.is_struct(item) and item.get_field_index("role") >= 0
                and item.get_field_index("content") >= 0):
            raise self.fail(0, name, f"the prompt is neither a string nor a list of "
                            f"{{role, content}} messages (the column is {kind})")
        missing = pc.fill_null(pc.equal(pc.list_value_length(column), 0), True)
        bad = np.flatnonzero(missing.to_numpy(zero_copy_only=False))
        if len(bad):
            raise self.fail(int(bad[0]), name, "the prompt has no messages")
        flat = pc.list_flatten(column)
        parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
        roles = pc.struct_field(flat, ["role"])
        unknown = pc.fill_null(pc.invert(pc.is_in(roles, value_set=pa.array(sorted(ROLES)))), True)
        bad = np.flatnonzero(unknown.to_numpy(zero_copy_only=False))
        if len(bad):
            role = roles[int(bad[0])].as_py()
            raise self.fail(int(parents[bad[0]]), name, f"unknown role {role!r}; roles: "
                            f"{', '.join(sorted(ROLES))}")
        content = pc.is_null(pc.struct_field(flat, ["content"]))
        bad = np.flatnonzero(content.to_numpy(zero_copy_only=False))
        if len(bad):
            raise self.fail(int(parents[bad[0]]), name, "a message has no content")

    def answer(self, column: Any, name: str) -> None:
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        kind = column.type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or pa.types.is_integer(kind) or pa.types.is_floating(kind)
                or pa.types.is_null(kind)):
            raise self.fail(0, name, f"the answer must be a string or a number (the column "
                            f"is {kind})")
        text = pc.cast(column, pa.string())
        empty = pc.fill_null(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(text)), 0), True)
        bad = np.flatnonzero(empty.to_numpy(zero_copy_only=False))
        if len(bad):
            raise self.fail(int(bad[0]), name, "the answer is empty")


def _pick(columns: Sequence[str], table: Any, wanted: str | None, candidates: Sequence[str]) -> str | None:
    if wanted is not None:
        return wanted
    for name in candidates:
        head, _, rest = name.partition(".")
        if head in columns:
            if not rest:
                return name
            import pyarrow as pa

            kind = table.schema.field(head).type
            if pa.types.is_struct(kind) and kind.get_field_index(rest) >= 0:
                return name
    return None


def _segment(path: Path, key: str, prompt_key: str | None, answer_key: str | None) -> _Segment:
    data = _load(path, key)
    table = data.data.table if hasattr(data.data, "table") else data.data
    columns = list(data.column_names)
    checker = _Checker(key, path)
    prompt = _pick(columns, table, prompt_key, PROMPT_KEYS)
    answer = _pick(columns, table, answer_key, ANSWER_KEYS)
    have = f"its columns: {', '.join(columns) or 'none'}"
    if prompt is None or prompt.split(".")[0] not in columns:
        what = f"no column for env.prompt_key={prompt}" if prompt_key else \
            f"no prompt column ({', '.join(PROMPT_KEYS)}); set env.prompt_key"
        raise EnvConfigError(f"{key}: {path} has {what}; {have}")
    if answer is None or answer.split(".")[0] not in columns:
        what = f"no column for env.answer_key={answer}" if answer_key else \
            f"no answer column ({', '.join(ANSWER_KEYS)}); set env.answer_key"
        raise EnvConfigError(f"{key}: {path} has {what}; {have}")
    if len(data) == 0:
        raise EnvConfigError(f"{key}: {path} has no rows")
    if data._indices is not None:  # a save_to_disk of a selection: map the rows it means
        data = data.flatten_indices()
        table = data.data.table if hasattr(data.data, "table") else data.data
    checker.prompt(checker.column(table, prompt), prompt)
    checker.answer(checker.column(table, answer), answer)
    source = None if "data_source" in columns else path.stem if path.is_file() else path.name
    return _Segment(path, data, prompt, answer, source)


def _prompt_keys(segment: _Segment) -> Any:
    """Each row's prompt as one string (messages joined): what duplicates are found by."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = segment.data.data.table if hasattr(segment.data.data, "table") else segment.data.data
    column = _Checker("", segment.file).column(table, segment.prompt_key)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return column
    contents = pc.struct_field(column.values, ["content"])
    return pc.binary_join(pa.ListArray.from_arrays(column.offsets, contents), "\n")


class Rows(Sequence[Task]):
    """A split's rows as tasks, built one at a time from the memory-mapped files. With several
    weighted sources the split is a mixture: index ``i`` is slot ``i`` of an epoch
    (:func:`_slots`)."""

    def __init__(self, spec: DatasetSpec, split: str, sources: list[list[_Segment]],
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

    def locate(self, slot: int) -> tuple[_Segment, int]:
        """The file and row of slot ``slot`` (before :meth:`keep`)."""
        source = bisect.bisect_right(self._slot_starts, slot) - 1
        within = slot - self._slot_starts[source]
        row = within * self.sizes[source] // self._slots[source]
        starts = self._starts[source]
        n = bisect.bisect_right(starts, row) - 1
        return self._sources[source][n], row - starts[n]

    def _task(self, index: int, segment: _Segment, row: int) -> DatasetTask:
        values = segment.data[row]
        prompt = _dig(values, segment.prompt_key)
        answer = _dig(values, segment.answer_key)
        source = segment.source or str(values.get("data_source") or segment.file.stem)
        head = segment.prompt_key.split(".")[0]
        metadata = {k: v for k, v in values.items() if k != head}
        metadata.setdefault("data_source", source)
        return DatasetTask(id=index, messages=self._spec.messages(prompt),
                           answer=str(answer).strip(), metadata=metadata, source=source,
                           split=self._split, file=str(segment.file), row=row + 1)

    def keep(self, fits: Callable[[int], bool]) -> int:
        """Leave out the slots ``fits`` refuses (given each slot); the number left out. Task
        ids are renumbered so they stay positions in the split."""
        before = len(self)
        kept = [slot for slot in (self._keep if self._keep is not None else range(before))
                if fits(slot)]
        self._keep = kept
        return before - len(kept)

    def segments(self) -> Iterator[_Segment]:
        for segments in self._sources:
            yield from segments


class DatasetEnv(SingleTurnEnv):
    def __init__(self, spec: DatasetSpec) -> None:
        super().__init__()
        self._spec = spec

    async def reset(self, task: Task) -> tuple[Message, ...]:
        if isinstance(task, DatasetTask) and task.split == "train":
            self._spec.samples[task.source] += 1
        return await super().reset(task)

    async def score(self, task: Task, reply: str) -> Reward:
        return await self._spec.scorer().score(reply, task.answer, task.metadata)


class DatasetSpec(EnvSpec):
    """``train`` / ``eval``: files (a path, glob, list, or a list of ``{path, weight}`` for
    train); ``prompt_key`` / ``answer_key``: dotted columns (None: found by name);
    ``system_prompt`` / ``instruction``: added where a row has none; ``reward``: a name, a
    list or ``{name: weight}`` (:mod:`envs.rewards`); ``reward_timeout_s`` per item;
    ``reward_processes``: verification workers."""

    name = "dataset"  # its registry name, also its tasks' data source in evaluations

    def __init__(
        self,
        train: Any = None,
        eval: Any = None,
        prompt_key: str | None = None,
        answer_key: str | None = None,
        system_prompt: str | None = None,
        instruction: str | None = None,
        reward: Any = "math",
        reward_timeout_s: float = 10.0,
        reward_processes: int = 2,
    ) -> None:
        if train == "???":
            train = None
        if train is None and eval is None:
            raise EnvConfigError("env.train (or, to evaluate only, env.eval) must name your data, "
                                 "e.g. env.train=data/train.jsonl")
        self._reward = reward
        self._reward_timeout_s = reward_timeout_s
        self.system_prompt = system_prompt
        self.instruction = instruction.strip() if instruction else None
        self._scorer = Scorer(reward, timeout_s=reward_timeout_s, processes=reward_processes)
        self.samples: Counter[str] = Counter()
        self._running = False
        splits: dict[str, Rows] = {}
        for split, value in (("train", train), ("eval", eval)):
            key = f"env.{split}"
            sources = _sources(value, key)
            if split == "eval" and len(sources) > 1:
                sources = [Source([p for s in sources for p in
                                   ([s.path] if isinstance(s.path, str) else s.path)])]
            segments = [[_segment(f, key, prompt_key, answer_key) for f in _files(s.path, key)]
                        for s in sources]
            splits[split] = Rows(self, split, segments, [s.weight for s in sources])
        self.splits = splits
        self.duplicates = self._report_duplicates()
        sizes = ", ".join(f"{segment.file.name}: {len(segment)}"
                          for segment in splits["train"].segments())
        log.info("env=dataset: %d train samples an epoch (%s), %d eval rows",
                 len(splits["train"]), sizes, len(splits["eval"]))

    def votes(self) -> Votes:
        """``env.reward``'s own reading and equivalence (:func:`envs.votes.votes_for`)."""
        return votes_for(self._reward, timeout_s=self._reward_timeout_s)

    def messages(self, prompt: Any) -> tuple[Message, ...]:
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        if self.instruction:
            last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
            if last is not None and self.instruction not in messages[last]["content"]:
                content = messages[last]["content"].rstrip()
                messages[last] = {"role": "user", "content": f"{content} {self.instruction}"}
        return tuple(messages)

    def _report_duplicates(self) -> int:
        """Train rows whose prompt is also an eval row's: counted and reported, not removed."""
        import pyarrow as pa
        import pyarrow.compute as pc

        eval_keys = [_prompt_keys(s) for s in self.splits["eval"].segments()]  # type: ignore[attr-defined]
        if not eval_keys:
            return 0
        value_set = pa.concat_arrays([k.cast(pa.large_string()) for k in eval_keys])
        found, example = 0, None
        for segment in self.splits["train"].segments():  # type: ignore[attr-defined]
            hits = pc.is_in(_prompt_keys(segment).cast(pa.large_string()), value_set=value_set)
            count = pc.sum(hits).as_py() or 0
            if count and example is None:
                example = f"{segment.file} row {pc.index(hits, True).as_py() + 1}"
            found += count
        if found:
            log.warning("env=dataset: %d train rows have the same prompt as an eval row "
                        "(first: %s)", found, example)
        return found

    def scorer(self) -> Scorer:
        if not self._running:
            from envs.errors import EnvNotRunning

            raise EnvNotRunning("env=dataset scores inside `async with spec.running():`, "
                                "which holds its verification workers")
        return self._scorer

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with self._scorer:
            self._running = True
            try:
                yield
            finally:
                self._running = False

    def make_env(self) -> Env:
        return DatasetEnv(self)

    def metrics(self) -> dict[str, float]:
        return {**self._scorer.metrics(),
                **{f"data/samples/{source}": float(n) for source, n in self.samples.items()}}

    def keep(self, fits: Callable[[tuple[Message, ...]], bool]) -> dict[str, int]:
        """Leave out the rows whose prompt ``fits`` refuses (the orchestrator asks with the
        model's tokenizer, before training); the number left out per split."""
        left_out = {}
        for split, rows in self.splits.items():
            assert isinstance(rows, Rows)
            left_out[split] = rows.keep(lambda slot, rows=rows: fits(
                rows._task(0, *rows.locate(slot)).messages))
            if split == "train" and left_out[split] and len(rows) == 0:  # none fit
                raise EnvConfigError("env.train: every prompt is too long for the model's "
                                     "context with rollout.max_tokens left for the answer")
        return left_out

