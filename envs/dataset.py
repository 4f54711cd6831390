"""A user's own files as a single-turn environment: ``env=dataset`` (the ``data`` extra).

* **Files.** ``env.train`` / ``env.eval``: a path, a glob, or a list of them; ``.jsonl``,
  ``.json``, ``.parquet``, ``.csv``, ``.arrow`` files and ``datasets.save_to_disk``
  directories, local files only (nothing from the hub), read by :mod:`envs.datafiles`: JSON,
  CSV and Parquet converted once, a chunk at a time, into an Arrow file in ``datasets``'
  cache, ``.arrow`` files and ``save_to_disk`` directories mapped where they lie; each a
  memory-mapped ``datasets.Dataset``, so a file of millions of rows is never turned into
  Python objects up front: a row becomes a :class:`Task` when the sampler asks for it. Checks
  read the file a record batch at a time (never a whole column), collecting every bad row.
  A run needs ``env.train``; ``env.eval`` alone makes an environment to evaluate on
  (``python -m orchestrator.eval``). A task's :attr:`~DatasetTask.origin` is its ``file:row``.
* **Mixtures.** ``env.train`` may be a list of ``{path: …, weight: …}``; an epoch holds as many
  samples as all sources have rows, shared out by weight (a source's rows spread evenly over
  its share: repeated when it is up-sampled, the same evenly spaced subset each epoch when it
  is down-sampled). Each row keeps its ``data_source`` column, or its file's name, and
  :meth:`DatasetSpec.metrics` counts the samples each source got (``data/samples/<source>``).
* **Schemas** (per file, found by column names; ``env.prompt_key`` / ``env.answer_key``, dotted
  paths such as ``reward_model.ground_truth``, override): verl's (``prompt`` as a list of
  ``{role, content}`` messages, ``reward_model.ground_truth``, ``data_source``, ``ability``,
  ``extra_info``), TRL's (``prompt`` as a string or ``messages``; ``completion`` as the answer
  in a prompt/completion file, a conversational one's assistant turn; other columns passed to
  the reward by name), plain (``question`` / ``problem`` and ``answer`` / ``solution``). Every
  column but the prompt is the task's metadata and reaches the reward function.
* **Answers.** As the file writes them: the answer column is read as text (``2``, ``007``,
  twenty digits stay so; :mod:`envs.datafiles`). A conversation ending with the assistant's
  turn is the prompt without that turn, which is the reference answer where the file has no
  answer column. A boolean, list or mapping ground truth stays that value
  (:attr:`DatasetTask.ground_truth` and its column in the metadata); ``Task.answer`` is its
  JSON text, what the built-in rewards compare.
* **Prompt.** A string becomes one user message; a message list is kept. ``env.system_prompt``
  is put first where the row has no system message; ``env.instruction`` is appended to the
  last user message where that message does not already contain it. The model's chat
  template is applied by the episode runner, as for every environment.
* **Order.** The orchestrator's ``TaskSampler`` shuffles the train split per epoch from the
  run's seed and keeps its position (and the prompts in flight) in the checkpoint, so a
  resumed run neither repeats nor skips a prompt within the epoch; the split's indices are
  stable across runs because files are read in sorted order.
* **Reward.** ``env.reward`` through :class:`envs.rewards.Scorer` (``math`` by default), in
  worker processes with ``env.reward_timeout_s`` per item; its counters join the metrics.
  ``env.reward=judge`` asks an LLM judge (``env.judge``, :mod:`envs.judge`), handed the task's
  messages as the prompt it grades against. An evaluation's majority vote reads and groups
  answers as that reward does (:func:`envs.votes.votes_of`, as every environment).
* **Bad input** (a missing file, an unknown extension, a file with no rows, no prompt column,
  a column named by ``env.prompt_key`` / ``env.answer_key`` that the file lacks, an empty
  answer, a prompt that is neither a string nor a list of messages, an unknown role, a
  conversation with no answer, a bad reward) is an :class:`EnvConfigError` of one line naming
  the file, the row (1 is the first) and the key, raised by the constructor, before any
  training; a file's bad rows are :class:`~envs.dataset_files.BadRows`, which holds the first
  :data:`~envs.dataset_files.SHOWN` of them and their count (``python -m orchestrator.data
  check`` lists them). Reading the files is :mod:`envs.dataset_files`'s.

Limits: rows whose prompt is too long for the model are left out by the orchestrator, which
has the tokenizer (:meth:`DatasetSpec.keep_prompts`); duplicate prompts between train and eval are
reported, not removed.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from envs.base import Env, EnvSpec, Message, Reward, SingleTurnEnv, Task
from envs.dataset_files import (
    DatasetTask,
    Rows,
    Source,
    files_of,
    prompts_of,
    read_segment,
    sources_of,
)
from envs.errors import EnvConfigError
from envs.reward_functions import Sample
from envs.rewards import Scorer

log = logging.getLogger(__name__)

class DatasetEnv(SingleTurnEnv):
    def __init__(self, spec: DatasetSpec) -> None:
        super().__init__()
        self._spec = spec

    async def reset(self, task: Task) -> tuple[Message, ...]:
        if isinstance(task, DatasetTask) and task.split == "train":
            self._spec.samples[task.source] += 1
        return await super().reset(task)

    async def score(self, task: Task, reply: str) -> Reward:
        source = task.source if isinstance(task, DatasetTask) else ""
        return await self._spec.running_scorer().score(Sample(reply, task.answer, task.metadata,
                                                      task.messages, source))


class DatasetSpec(EnvSpec):
    """``train`` / ``eval``: files (a path, glob, list, or a list of ``{path, weight}`` for
    train); ``prompt_key`` / ``answer_key``: dotted columns (None: found by name);
    ``system_prompt`` / ``instruction``: added where a row has none; ``reward``: a name, a
    list, ``{name: weight}`` or ``{by_source: …, default: …}`` (:mod:`envs.rewards`);
    ``reward_timeout_s`` per item; ``reward_processes``: verification workers (plain
    functions); ``reward_concurrency``: an ``async`` function's calls at once; ``judge``: the
    LLM judge's endpoint and limits when ``reward`` names ``judge`` (:class:`envs.judge.JudgeConfig`)."""

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
        reward_concurrency: int = 32,
        reward_fail_steps: int = 3,
        judge: dict[str, Any] | None = None,
    ) -> None:
        if train == "???":
            train = None
        if train is None and eval is None:
            raise EnvConfigError("env.train (or, to evaluate only, env.eval) must name your data, "
                                 "e.g. env.train=data/train.jsonl")
        self.system_prompt = system_prompt
        self.instruction = instruction.strip() if instruction else None
        self.scorer = Scorer(reward, timeout_s=reward_timeout_s, processes=reward_processes,
                             concurrency=reward_concurrency,
                             fail_steps=reward_fail_steps, judge=judge)
        self.samples: Counter[str] = Counter()
        self._running = False
        splits: dict[str, Rows] = {}
        for split, value in (("train", train), ("eval", eval)):
            key = f"env.{split}"
            sources = sources_of(value, key)
            if split == "eval" and len(sources) > 1:
                sources = [Source([p for s in sources for p in
                                   ([s.path] if isinstance(s.path, str) else s.path)])]
            segments = [[read_segment(f, key, prompt_key, answer_key) for f in files_of(s.path, key)]
                        for s in sources]
            splits[split] = Rows(self, split, segments, [s.weight for s in sources])
        self.splits = splits
        self.duplicates = self._report_duplicates()
        sizes = ", ".join(f"{segment.file.name}: {len(segment)}"
                          for segment in splits["train"].segments())
        log.info("env=dataset: %d train samples an epoch (%s), %d eval rows",
                 len(splits["train"]), sizes, len(splits["eval"]))

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

        eval_keys = [k.cast(pa.large_string()) for s in self.splits["eval"].segments()  # type: ignore[attr-defined]
                     for k in prompts_of(s)]
        if not eval_keys:
            return 0
        value_set = pa.concat_arrays([k.combine_chunks() if isinstance(k, pa.ChunkedArray)
                                      else k for k in eval_keys])
        found, example = 0, None
        for segment in self.splits["train"].segments():  # type: ignore[attr-defined]
            offset = 0
            for keys in prompts_of(segment):
                hits = pc.is_in(keys.cast(pa.large_string()), value_set=value_set)
                count = pc.sum(hits).as_py() or 0
                if count and example is None:
                    example = f"{segment.file} row {offset + pc.index(hits, True).as_py() + 1}"
                found += count
                offset += len(keys)
        if found:
            log.warning("env=dataset: %d train rows have the same prompt as an eval row "
                        "(first: %s)", found, example)
        return found

    def running_scorer(self) -> Scorer:
        if not self._running:
            from envs.errors import EnvNotRunning

            raise EnvNotRunning("env=dataset scores inside `async with spec.running():`, "
                                "which holds its verification workers")
        assert self.scorer is not None
        return self.scorer

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        assert self.scorer is not None
        async with self.scorer:
            self._running = True
            try:
                yield
            finally:
                self._running = False

    def make_env(self) -> Env:
        return DatasetEnv(self)

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(),
                **{f"data/samples/{source}": float(n) for source, n in self.samples.items()}}

    def keep_prompts(self, fits: Callable[[tuple[Message, ...]], bool]) -> dict[str, int]:
        """Leave out the rows whose prompt ``fits`` refuses; the number left out per split."""
        left_out = {}
        for split, rows in self.splits.items():
            assert isinstance(rows, Rows)
            left_out[split] = rows.keep(lambda slot, rows=rows: fits(
                rows._task(0, *rows.locate(slot)).messages))
            if split == "train" and left_out[split] and len(rows) == 0:  # none fit
                raise EnvConfigError("env.train: every prompt is too long for the model's "
                                     "context with rollout.max_tokens left for the answer")
        return left_out

