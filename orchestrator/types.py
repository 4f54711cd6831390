"""Typed records that travel between the pipeline's stages.

Everything here is a frozen dataclass: a record is built once by the stage that owns it and
read by the ones downstream. Token-level fields are plain tuples so a record can cross a
stream, a thread or a process without aliasing a tensor someone else mutates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from envs.base import RewardTerm


class FinishReason(StrEnum):
    STOP = "stop"  # the model emitted a stop token
    LENGTH = "length"  # max_tokens reached
    ABORTED = "aborted"  # the engine was closed under the request


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_p: float = 1.0  # the smallest set of likeliest tokens holding this much probability
    top_k: int = 0  # the k likeliest tokens (0: all)


@dataclass(frozen=True)
class Generation:
    """What an engine returns for one prompt: the sampled tokens and where they came from.

    ``versions[i]`` is the policy version whose weights produced ``token_ids[i]``, and
    ``logprobs[i]`` its behaviour log-probability under the temperature-scaled distribution.
    Versions differ within one generation only when weights changed mid-flight and the
    engine was told to continue under the new ones.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: FinishReason
    start_version: int
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache, if it has one
    # (version, fingerprint of the weights the engine held) for each version among ``versions``
    # whose engine attests (orchestrator/weights/fingerprint.py); empty from an engine that does not
    fingerprints: tuple[tuple[int, str], ...] = ()
    engine: str = ""  # the replica that produced it, named by the router (empty: a lone engine)

    def __post_init__(self) -> None:
        if not (len(self.token_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError("token_ids, logprobs and versions must have the same length")


@dataclass(frozen=True)
class Attestation:
    """Who produced a segment of a trajectory's tokens, ``[start, end)``: the engine (the
    router's replica name; empty for a lone engine), the policy version it served and the
    fingerprint of the weights it held then (None from an engine that does not attest). The
    trainer trains a segment only if the fingerprint is the one published for its version."""

    start: int
    end: int
    version: int
    fingerprint: str | None
    engine: str = ""


@dataclass(frozen=True)
class TurnTiming:
    """One generation call of an episode: its token counts and when and how long it ran.

    Times are seconds on the run's recorder clock. ``finish_reason`` uses the PolyTrace
    vocabulary: ``tool_calls`` (the turn called tools), ``stop`` or ``length``.
    """

    turn: int
    start: float
    latency: float  # the engine call, queueing inside the engine included
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    max_new_tokens: int
    text_tokens: int  # completion tokens that are not stop tokens
    finish_reason: str
    tool_call_count: int
    version: int  # policy version of the turn's first token
    observation_tokens: int = 0  # tool output appended after this turn (not trained on)


@dataclass(frozen=True)
class ToolTiming:
    """One tool call of an episode (see :class:`envs.base.ToolCallRecord`).

    ``metadata`` is what the tool reported, as it reported it; nothing on the way reads it.
    Writers pick the fields they publish from it (the PolyTrace writer: ``query_count``).
    """

    turn: int
    name: str | None
    status: str  # ok | error | timeout
    start: float  # on the recorder's timeline
    latency: float
    error_kind: str | None = None
    metadata: dict[str, object] = field(default_factory=dict)
    response_tokens: int = 0  # tokens of its observation message
    append_tokens: int = 0  # tokens appended to the sequence for it (template included)


@dataclass(frozen=True)
class EpisodeTiming:
    """When one episode ran and what each of its turns and tool calls took (recorder clock):
    the trace writers' record of it, kept apart from its :class:`Trajectory`, which is what
    the trainer is sent."""

    worker: str
    started_at: float
    finished_at: float
    reward_seconds: float = 0.0
    turns: tuple[TurnTiming, ...] = ()
    tool_calls: tuple[ToolTiming, ...] = ()


@dataclass(frozen=True)
class Trajectory:
    """One finished episode, ready to be trained on (its timings: :class:`EpisodeTiming`).

    ``token_ids`` is the whole sequence (prompt, then every turn) exactly as the engine and
    the environment produced it. ``loss_mask[i]`` is True for tokens the policy generated;
    ``logprobs``/``versions`` are only meaningful where the mask is set. ``reward`` is the
    environment's total plus any step rewards; ``reward_terms`` are the total's weighted terms
    (``env.reward``'s, empty for an environment whose reward is a single number), carried typed
    for estimators that treat terms apart; ``metrics`` has them again as ``reward/<term>``,
    for logging only.
    """

    prompt_id: int
    sample_index: int
    token_ids: tuple[int, ...]
    loss_mask: tuple[bool, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    reward: float
    start_version: int
    finish_reason: FinishReason  # of the last turn's generation
    metrics: dict[str, float] = field(default_factory=dict)
    end_reason: str = "done"  # done | max_turns | max_length | tool_response_too_long
    prompt_tokens: int = 0  # the opening prompt
    max_tokens: int = 0  # per-turn generation cap the episode ran with
    reward_terms: tuple[RewardTerm, ...] = ()
    # every generated token's segment: engine, version, fingerprint (see Attestation)
    attestations: tuple[Attestation, ...] = ()

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def end_version(self) -> int:
        generated = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return max(generated, default=self.start_version)


@dataclass(frozen=True)
class Group:
    """The samples of one prompt, as the trainer gets them; GRPO normalises rewards within
    a group."""

    prompt_id: int
    trajectories: tuple[Trajectory, ...]
    start_version: int

    @property
    def rewards(self) -> tuple[float, ...]:
        return tuple(t.reward for t in self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)


@dataclass(frozen=True)
class GroupTiming:
    """When a group ran: its wait for admission, its span, and each episode's timing (in the
    order of the group's trajectories)."""

    started_at: float
    finished_at: float
    episodes: tuple[EpisodeTiming, ...]
    queue_wait: float = 0.0  # seconds the group waited for admission before it started


@dataclass(frozen=True)
class TimedGroup:
    """What a rollout worker hands on: the group for the trainer, its timing for the traces."""

    group: Group
    timing: GroupTiming
    draw: int = 0  # its task's draw index in the sampler (the pipeline's batches are ordered by it)

    @property
    def prompt_id(self) -> int:
        return self.group.prompt_id

    @property
    def start_version(self) -> int:
        return self.group.start_version

    def __len__(self) -> int:
        return len(self.group)


@dataclass(frozen=True)
class StepReport:
    """Everything about one train step, for loggers and tests."""

    step: int
    version: int  # the version the batch was trained at (the new weights are version + 1)
    metrics: dict[str, float]
    rewards: tuple[float, ...]
    staleness: tuple[int, ...]  # per trained sample: version - start version
    start_versions: tuple[int, ...]
    dropped_total: int
    samples: int
    tokens: int  # generated (trained) tokens in the batch
    elapsed: float  # seconds since the previous step's report
    stage_seconds: dict[str, float] = field(default_factory=dict)
    length_capped: int = 0  # samples that ran into rollout.max_tokens
    groups: tuple[Group, ...] = ()  # the trained batch, for trace writers
    timings: tuple[GroupTiming, ...] = ()  # and when its groups ran (groups' order)
    # a periodic evaluation that finished during the step (it began after metrics["eval/step"])
    evaluation: Evaluation | None = None

    @property
    def reward_mean(self) -> float:
        return sum(self.rewards) / max(len(self.rewards), 1)


# -- evaluations -------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalSample:
    """One evaluation episode of a held-out task: what the scores are computed from, and a
    line of the run directory's ``eval_samples.jsonl`` (or an evaluation's samples file)."""

    task_id: int
    sample_index: int  # 0 .. n - 1 among the task's samples
    source: str  # the task's data source (``metadata["data_source"]``, else the env's name)
    reward: float
    tokens: int  # generated tokens, every turn (or agent segment) together
    answer: str | None  # the final reply's answer as the vote reads it (EnvSpec.votes); None: none
    prompt: str = ""
    completion: str = ""  # everything after the prompt: every turn and observation
    reference: str = ""  # the task's reference answer
    reply: str = ""  # the final reply, the answer read from it
    vote: int | None = None  # its maj@n group: the first sample giving its answer; None: none
    origin: str = ""  # where the task was read from (Task.origin: a dataset's file:row)


@dataclass(frozen=True)
class Scores:
    """The figures of a set of tasks (one data source's, or all), each sampled ``n`` times:
    ``mean`` (mean@n), ``std`` (std@n), ``pass_at`` (k → pass@k), ``maj`` (maj@n; None where
    no sample gave an answer to vote on) and the mean response length in tokens, and each
    one's standard error over tasks (``se``). :mod:`orchestrator.pipeline.evaluation` defines
    them."""

    tasks: int
    samples: int
    mean: float
    std: float
    pass_at: dict[int, float]
    maj: float | None
    response_tokens: float
    # each figure's standard error over tasks, by field name (``mean``, ``std``, ``maj``,
    # ``response_tokens``) or ``pass@k``
    se: dict[str, float] = field(default_factory=dict)

    def metrics(self, n: int) -> dict[str, float]:
        """The figures under the names they are logged with: ``mean@4``, ``pass@1``, …"""
        out = {f"mean@{n}": self.mean, f"std@{n}": self.std,
               **{f"pass@{k}": v for k, v in sorted(self.pass_at.items())}}
        if self.maj is not None:
            out[f"maj@{n}"] = self.maj
        out["response_tokens"] = self.response_tokens
        return out

    def errors(self, n: int) -> dict[str, float]:
        """Each figure's standard error under its logged name: ``mean@4`` → its se."""
        names = {"mean": f"mean@{n}", "std": f"std@{n}", "maj": f"maj@{n}",
                 "response_tokens": "response_tokens"}
        return {names.get(key, key): value for key, value in self.se.items()}

    def to_dict(self, n: int) -> dict[str, Any]:
        return {"tasks": self.tasks, "samples": self.samples, **self.metrics(n),
                "se": self.errors(n)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], n: int) -> Scores:
        pass_at = {int(key[5:]): float(v) for key, v in data.items() if key.startswith("pass@")}
        maj = data.get(f"maj@{n}")
        names = {f"mean@{n}": "mean", f"std@{n}": "std", f"maj@{n}": "maj"}
        se = {names.get(k, k): float(v) for k, v in data.get("se", {}).items()}
        return cls(tasks=int(data["tasks"]), samples=int(data["samples"]),
                   mean=float(data[f"mean@{n}"]), std=float(data[f"std@{n}"]), pass_at=pass_at,
                   maj=None if maj is None else float(maj),
                   response_tokens=float(data["response_tokens"]), se=se)


@dataclass(frozen=True)
class Evaluation:
    """An evaluation of held-out tasks, ``n`` samples each at ``temperature``: the figures
    over all tasks (``overall``) and per data source (``sources``), each with its standard
    error, a few samples per source (``examples``) and every sample (``samples``; neither is
    part of :meth:`to_dict`). Its headline is :attr:`mean`, the
    overall mean@n (with ``n = 1`` at temperature 0: greedy accuracy)."""

    n: int
    temperature: float
    success_threshold: float  # a sample counts as correct (pass@k) at this reward or more
    overall: Scores
    sources: dict[str, Scores] = field(default_factory=dict)
    examples: tuple[EvalSample, ...] = ()
    samples: tuple[EvalSample, ...] = ()  # every one, by source and task (not in to_dict)

    @property
    def mean(self) -> float:
        return self.overall.mean

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        """Every figure as ``<prefix>/pass@4`` (all tasks) and ``<prefix>/<source>/pass@4``,
        each with its standard error as ``<prefix>/pass@4_se``."""
        out: dict[str, float] = {}
        for path, scores in [("", self.overall),
                             *((f"{s}/", v) for s, v in sorted(self.sources.items()))]:
            out.update({f"{prefix}/{path}{k}": v for k, v in scores.metrics(self.n).items()})
            out.update({f"{prefix}/{path}{k}_se": v for k, v in scores.errors(self.n).items()})
        return out

    def figure(self, name: str) -> float | None:
        """The figure logged as ``name`` (``eval/pass@4``, ``eval/gsm8k/mean@4``; ``eval/accuracy``
        is the headline mean@n), None if this evaluation has none of that name."""
        if name == "eval/accuracy":
            return self.mean
        return self.metrics("eval").get(name)

    def describe(self) -> str:
        """The overall figures in one line: ``mean@4 0.520 ± 0.031  pass@1 0.520 ± 0.031 …``."""
        figures = self.overall.metrics(self.n)
        errors = self.overall.errors(self.n)
        figures.pop(f"std@{self.n}")
        tokens = figures.pop("response_tokens")
        return ("  ".join(f"{k} {v:.3f}" + (f" ± {errors[k]:.3f}" if k in errors else "")
                          for k, v in figures.items())
                + f"  {tokens:.1f} tokens ({self.overall.tasks} tasks)")

    def to_dict(self) -> dict[str, Any]:
        """For ``summary.json`` and checkpoints (:meth:`from_dict` reads it back)."""
        return {"n": self.n, "temperature": self.temperature,
                "success_threshold": self.success_threshold,
                "overall": self.overall.to_dict(self.n),
                "sources": {s: v.to_dict(self.n) for s, v in sorted(self.sources.items())}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Evaluation:
        n = int(data["n"])
        return cls(n=n, temperature=float(data["temperature"]),
                   success_threshold=float(data["success_threshold"]),
                   overall=Scores.from_dict(data["overall"], n),
                   sources={s: Scores.from_dict(v, n) for s, v in data["sources"].items()})

