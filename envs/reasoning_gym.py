"""reasoning-gym's procedural datasets as single-turn environments (``env=reasoning_gym``).

``env.dataset`` names any dataset registered in the ``reasoning-gym`` package (the ``tasks``
extra: ``pip install -e .[tasks]``) and ``env.config`` holds that dataset's own keyword
arguments (``+env.config.max_terms=2``); ``seed`` and ``size`` are not among them, they come
from ``env.seed``, ``env.train_size`` and ``env.eval_size``.

* **Splits.** reasoning-gym builds item ``i`` of a dataset seeded ``s`` from ``Random(s + i)``,
  so datasets seeded ``s`` and ``s + 1`` share all but one item. The train and eval datasets
  therefore get seeds far apart (hashes of ``env.seed`` and the split's name), and questions are
  deduplicated on their text: train keeps the first ``train_size`` distinct questions, eval the
  first ``eval_size`` that are distinct and not in train. A configuration with fewer distinct
  questions than asked for is refused in one line.
* **Prompt.** The entry's question as the user message, followed by ``instruction`` when
  one is set (a pretrained model is told the answer's form: "Answer with just the number."),
  after a ``system_prompt`` when one is set; the model's chat format (its tokenizer's
  ``chat_prompt``) is applied by the episode runner as for every env.
* **Answer extraction** (``answer``). ``tagged`` (the default): the content of the last
  ``<answer>…</answer>`` in the completion when there is one, else the whole completion;
  stripped of surrounding white space either way (reasoning-gym's answers are plain strings,
  and its own ``extract_answer`` does the same). ``last_number``: the last number in the
  completion (for numeric datasets and a model that answers in a sentence).
* **Reward.** ``env.reward`` (:mod:`envs.rewards`), by default ``verifier``: the dataset's own
  verifier, ``dataset.score_answer(extracted, entry)``, in [0, 1]; some verifiers give partial
  credit. A verifier that raises on a model's garbage scores 0 (logged as
  ``verifier/error``, not a reward failure): a model mistake, not an operator's.
  ``exact_match`` and ``tagged`` are logged beside it.
* **Warm start.** Each task's reference answer is the dataset's own answer, so the supervised
  warm start learns from it (the plain answer, without tags).
* **Characters.** The default tiny model's tokenizer knows printable ASCII and newline only
  (anything else would become ``?``). With ``ascii_only`` (the default) entries whose question
  or answer has other characters are skipped while the splits are built; set it to false for a
  model with a real tokenizer.

Limits: single turn only; the dataset object of the train split scores both splits (verifiers
read the entry and the dataset's config, which the splits share); questions are not shortened.
"""

from __future__ import annotations

import difflib
import hashlib
import re
from collections.abc import Mapping
from typing import Any

from envs.base import Env, EnvSpec, Reward, SingleTurnEnv, Task, Votes
from envs.errors import EnvConfigError
from envs.reward_functions import Sample
from envs.rewards import Scorer

INSTALL_HINT = "env=reasoning_gym needs the reasoning-gym package: pip install -e .[tasks]"
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ALPHABET = frozenset("\n" + "".join(chr(c) for c in range(32, 127)))  # the char tokenizer's
_ATTEMPTS_PER_ITEM = 20  # items generated per question wanted, at most, before giving up


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
EXTRACTORS = ("tagged", "last_number")


def extract_answer(completion: str, how: str = "tagged") -> str:
    """``tagged``: the last ``<answer>…</answer>``'s content if any, else the whole completion;
    ``last_number``: the last number in it (empty when there is none). Stripped."""
    if how == "last_number":
        numbers = _NUMBER.findall(completion)
        return numbers[-1] if numbers else ""
    tagged = _ANSWER.findall(completion)
    return (tagged[-1] if tagged else completion).strip()


def _registry() -> dict[str, Any]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise EnvConfigError(INSTALL_HINT) from e
    return DATASETS


def dataset_names() -> list[str]:
    """Every dataset reasoning-gym registers (EnvConfigError naming the extra if not installed)."""
    return sorted(_registry())


def _split_seed(seed: int, split: str) -> int:
    digest = hashlib.sha256(f"polyrl/reasoning_gym/{seed}/{split}".encode()).digest()
    return int.from_bytes(digest[:4], "big")  # reasoning-gym wraps seeds at 2**32 too


def _printable(entry: dict[str, Any]) -> bool:
    return _ALPHABET.issuperset(entry["question"]) and _ALPHABET.issuperset(entry["answer"])


class ReasoningGymEnv(SingleTurnEnv):
    def __init__(self, spec: ReasoningGymSpec) -> None:
        super().__init__()
        self._spec = spec

    async def score(self, task: Task, reply: str) -> Reward:
        spec = self._spec
        answer = extract_answer(reply, spec.answer)
        entry = task.metadata["entry"]

        async def verifier() -> Reward:
            try:
                return Reward(float(spec._verifier.score_answer(answer, entry)), {"error": 0.0})
            except Exception:  # noqa: BLE001 - a verifier tripping over model output scores 0
                return Reward(0.0, {"error": 1.0})

        assert spec.scorer is not None
        return await spec.scorer.score(
            Sample(reply, task.answer, task.metadata, task.messages, spec.dataset),
            {"verifier": verifier},
            {"exact_match": 1.0 if answer == task.answer else 0.0,
             "tagged": 1.0 if _ANSWER.search(reply) else 0.0})


class ReasoningGymSpec(EnvSpec):
    """``dataset``: a reasoning-gym dataset name; ``config``: its keyword arguments;
    ``train_size``/``eval_size`` distinct questions per split; ``seed`` derives both splits'
    dataset seeds; ``ascii_only`` skips entries the char tokenizer cannot write;
    ``instruction`` follows each question, after an optional ``system_prompt``; ``answer``
    says how the answer is taken from a completion (``tagged`` or ``last_number``);
    ``reward``: ``env.reward`` (``verifier``, the dataset's own, by default)."""

    name = "reasoning_gym"  # its registry name, also its tasks' data source in evaluations

    def __init__(
        self,
        dataset: str = "basic_arithmetic",
        config: dict[str, Any] | None = None,
        train_size: int = 2000,
        eval_size: int = 200,
        seed: int = 0,
        ascii_only: bool = True,
        instruction: str | None = None,
        system_prompt: str | None = None,
        answer: str = "tagged",
        reward: Any = "verifier",
        reward_timeout_s: float = 10.0,
        reward_processes: int = 2,
        reward_concurrency: int = 32,
        reward_fail_steps: int = 3,
        judge: Mapping[str, Any] | None = None,
    ) -> None:
        registry = _registry()
        if answer not in EXTRACTORS:
            raise EnvConfigError(f"env.answer={answer} must be one of {', '.join(EXTRACTORS)}")
        if dataset not in registry:
            close = difflib.get_close_matches(dataset, registry, n=4, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}?" if close else \
                f"e.g. {', '.join(sorted(registry)[:4])} ({len(registry)} in all)"
            raise EnvConfigError(f"env.dataset={dataset} is not a reasoning-gym dataset; {hint}")
        if train_size < 1 or eval_size < 0:
            raise EnvConfigError("env.train_size must be >= 1 and env.eval_size >= 0")
        config = dict(config or {})
        reserved = sorted({"seed", "size"} & set(config))
        if reserved:
            raise EnvConfigError(f"env.config.{reserved[0]} is set by env.seed, env.train_size and "
                             "env.eval_size: remove it")
        self.dataset = dataset
        self.ascii_only = ascii_only
        self.answer = answer
        self._system = ({"role": "system", "content": system_prompt},) if system_prompt else ()
        self._instruction = f" {instruction.strip()}" if instruction else ""
        self._classes = registry[dataset]  # (dataset class, its config dataclass)
        self._config = config
        self._verifier: Any = None  # the train split's dataset object: its verifier scores
        self.scorer = Scorer(reward, reward_timeout_s, reward_processes, own=("verifier",),
                             concurrency=reward_concurrency,
                             fail_steps=reward_fail_steps, judge=judge)
        seen: set[str] = set()
        self.splits = {split: self._collect(split, size, _split_seed(seed, split), seen)
                        for split, size in (("train", train_size), ("eval", eval_size))}

    def _create(self, seed: int, size: int) -> Any:
        dataset_cls, config_cls = self._classes
        config = self._config
        try:
            return dataset_cls(config=config_cls(**config, seed=seed, size=size))
        except TypeError as e:
            fields = sorted(set(config_cls.__dataclass_fields__) - {"seed", "size"})
            unknown = sorted(set(config) - set(fields))
            if not unknown:
                raise EnvConfigError(f"env.config for {self.dataset}: {e}".splitlines()[0]) from e
            raise EnvConfigError(f"unknown config key 'env.config.{unknown[0]}' for dataset "
                             f"{self.dataset}; known: {', '.join(fields)}") from e
        except (AssertionError, ValueError) as e:  # the config's own validate()
            raise EnvConfigError(f"env.config for {self.dataset} is invalid: {e or 'a check failed'}"
                             .splitlines()[0]) from e

    def _collect(self, split: str, size: int, split_seed: int, seen: set[str]) -> list[Task]:
        """The first ``size`` distinct questions of the split's dataset not in ``seen``
        (which gains them), skipping unprintable entries under ``ascii_only``. The dataset is
        made for twice the items wanted, then, if duplicates used those up, for many more
        (same seed: for reasoning-gym's per-item seeding the first items are the same)."""
        tasks: list[Task] = []
        index = 0
        for attempts in (2 * size + 16, _ATTEMPTS_PER_ITEM * size + 100):
            source = self._create(split_seed, attempts)
            if self._verifier is None:
                self._verifier = source
            while len(tasks) < size and index < attempts:
                entry = source[index]
                index += 1
                if entry["question"] in seen or (self.ascii_only and not _printable(entry)):
                    continue
                seen.add(entry["question"])
                tasks.append(Task(
                    id=len(tasks),
                    messages=(*self._system, {"role": "user",
                                              "content": entry["question"] + self._instruction}),
                    answer=str(entry["answer"]),
                    metadata={"dataset": self.dataset, "entry": entry,
                              "data_source": self.dataset},  # per-source eval figures
                ))
            if len(tasks) == size:
                return tasks
        skipped = " (ascii_only skips entries the char tokenizer cannot write)" \
            if self.ascii_only else ""
        raise EnvConfigError(
            f"env.{split}_size={size} is more than the {len(tasks)} distinct {split} questions "
            f"{self.dataset} gave in {index} tries with this env.config{skipped}: ask for "
            "fewer or widen the config")

    def make_env(self) -> Env:
        return ReasoningGymEnv(self)

    def extract_answer(self, reply: str) -> str | None:
        """The answer as the reward takes it (``env.answer``: ``tagged`` or ``last_number``)."""
        return extract_answer(reply, self.answer) or None

    def own_votes(self) -> Mapping[str, Votes | None]:
        """``verifier`` reads the answer as ``env.answer`` says; equal text agrees (the
        dataset's verifier scores against its own entry, not against another answer)."""
        return {"verifier": Votes(self.extract_answer)}
