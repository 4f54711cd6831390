"""The run's settings, typed: every key of ``conf/config.yaml``'s plain sections with its type,
default, allowed values and meaning, in one place.

Each section is a frozen dataclass whose fields pydantic validates as it is built (strict: a
string is not a number, a number is not true or false), ranges and choices included; what
ties keys of one section together is checked in its ``__post_init__``; a mistake, however the
section is built, is one :class:`ConfigError` line naming the key. :func:`register` gives
Hydra the defaults (``conf/config.yaml`` composes them as ``schema`` and holds only its
groups), :func:`orchestrator.config.read.typed` builds a section from a composed config, and
``python -m orchestrator.commands.config_reference`` writes the configuration reference page
(``docs/config-reference.md``) from the same fields.

The ``_target_`` groups (``model``, ``engine``, ``env``, ``algo``, ``trainer``, ``sandbox``,
``launcher``, ``logger``) are not here: each option names the class it builds, whose annotated
constructor is its schema (:func:`orchestrator.config.read.check_node`), so a plug-in brings its
own.
"""

from __future__ import annotations

import collections.abc
import functools
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass
from pydantic.fields import FieldInfo

from orchestrator.errors import ConfigError
from orchestrator.staleness import admission_budget

STRICT = ConfigDict(strict=True, extra="forbid")
T = TypeVar("T")

Routing = Literal["least_loaded", "round_robin"]  # how a replay's requests pick an engine replica


def settings(key: str) -> Callable[[type[T]], type[T]]:
    """A section of settings, the one at ``key`` in the config: a frozen dataclass pydantic
    validates, strictly, a mistake raised as one line naming the key (:class:`ConfigError`)."""

    def build(cls: type[T]) -> type[T]:
        built = dataclass(frozen=True, config=STRICT)(cls)
        init = built.__init__

        @functools.wraps(init)
        def checked(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                init(self, *args, **kwargs)
            except ValidationError as e:
                raise ConfigError(_explain(built, key, kwargs, e)) from None

        built.__init__ = checked  # type: ignore[method-assign]
        return built

    return build


@settings("")
class RunSettings:
    """The top-level keys."""

    seed: int = Field(0, description="seed of the task order, the sampling and the initial "
                                     "weights")
    torch_threads: int | None = Field(
        None, ge=1, description="torch's intra-op threads in each process (null: torch's "
                                "default); the experiments use 1, so engine and trainer each "
                                "take a core")
    progress: bool = Field(True, description="a progress bar over train steps (a log line "
                                             "instead when stdout is not a terminal)")
    progress_every: float = Field(10.0, gt=0, description="seconds between those log lines")
    resume: str | None = Field(
        None, description="a run directory to continue from its latest valid checkpoint, or "
                          "auto: continue hydra.run.dir's run if it has one, else start it")


@settings("pipeline")
class PipelineConfig:
    """``pipeline``: the scheduling of rollout against training."""

    max_staleness: int = Field(1, ge=0, description="k: a sample started at version v is "
                                                    "trained at version <= v + k (0: synchronous)")
    batch_size: int = Field(64, ge=1, description="samples per train step (a multiple of "
                                                  "rollout.group_size)")
    num_workers: int = Field(16, ge=1, description="concurrent rollout workers, each running "
                                                   "one group at a time")
    num_steps: int = Field(100, ge=1, description="train steps")
    inflight_update: Literal["continue", "finish"] = Field(
        "continue", description="what in-flight episodes do when weights change: continue "
                                "under the new weights (their later tokens carry the new "
                                "version) or finish under the old (the weight sync waits)")
    overprovision: float | None = Field(
        None, ge=0, description="null: bounded staleness, up to (k + 1) x batch_size samples in "
                                "flight; a number r: partial rollout, (1 + r) x batch_size in "
                                "flight, the first groups to finish trained and the others "
                                "carried on while no older than k (needs max_staleness >= 1)")

    def __post_init__(self) -> None:
        if self.overprovision is not None and self.max_staleness < 1:
            raise ConfigError("pipeline.overprovision carries unfinished samples into later "
                              "steps, which needs pipeline.max_staleness >= 1 (with 0 every "
                              "carried sample would be dropped as stale)")

    @property
    def budget(self) -> int:
        """Samples that may be started and not yet trained or dropped (admission rounds it
        down to whole groups)."""
        return admission_budget(self.batch_size, self.max_staleness, self.overprovision)

    def describe(self) -> str:
        """The scheduling policy in a few characters: ``sync``, ``k=2``, ``partial+1B k=4``."""
        if self.overprovision is None:
            return "sync" if self.max_staleness == 0 else f"k={self.max_staleness}"
        return f"partial+{self.overprovision:g}B k={self.max_staleness}"

    def check_group_size(self, group_size: int) -> None:
        if self.batch_size % group_size:
            raise ConfigError(
                f"pipeline.batch_size={self.batch_size} must be a positive multiple of "
                f"rollout.group_size={group_size}"
            )


@settings("rollout")
class RolloutConfig:
    """``rollout``: how an episode samples."""

    group_size: int = Field(8, ge=1, description="samples per prompt (a GRPO group)")
    max_tokens: int = Field(16, ge=1, description="tokens per assistant turn")
    temperature: float = Field(1.0, ge=0, description="sampling temperature (0: greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest set of "
                                                      "tokens holding this much probability "
                                                      "(1: off)")
    top_k: int = Field(0, ge=0, description="sample among the k likeliest tokens (0: off)")
    max_turns: int = Field(1, ge=1, description="assistant turns per episode")
    max_total_tokens: int | None = Field(
        None, ge=1, description="prompt and every turn together (null: the engine's context "
                                "length)")
    max_tool_response_tokens: int | None = Field(
        None, ge=1, description="a longer tool observation ends the episode (null: no limit)")


@settings("warmstart")
class WarmStartConfig:
    """``warmstart``: supervised steps on reference answers before RL."""

    steps: int = Field(100, ge=0, description="at most this many supervised steps (0: none)")
    batch_size: int = Field(64, ge=1, description="tasks per supervised step")
    lr: float = Field(1e-3, gt=0, description="its learning rate")
    target_accuracy: float | None = Field(
        None, ge=0, le=1, description="stop as soon as greedy accuracy on check_tasks reaches "
                                      "this, so RL starts from the same place on every machine "
                                      "and seed (null: run every step)")
    check_every: int = Field(25, ge=1, description="steps between those greedy checks")
    check_tasks: int = Field(128, ge=1, description="train tasks the greedy check runs on")


@settings("eval")
class EvalConfig:
    """``eval``: held-out evaluation."""

    num_tasks: int = Field(200, ge=0, description="tasks of each data source of the eval "
                                                  "split, drawn with eval.seed, evaluated "
                                                  "before and after RL (0: skip)")
    seed: int = Field(0, description="the draw of those tasks, and of the bootstrap of "
                                     "pass@k's and maj@n's standard errors")
    max_tokens: int | None = Field(None, ge=1, description="tokens per assistant turn in an "
                                                           "evaluation (null: rollout.max_tokens)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling of an evaluation (1: off)")
    top_k: int = Field(0, ge=0, description="its top-k sampling (0: off)")
    every: int = Field(0, ge=0, description="also every this many RL steps, alongside rollout "
                                            "(0: never): eval/<figure> and "
                                            "eval/<source>/<figure>, mean@n as eval/accuracy")
    n: int = Field(1, ge=1, description="samples per task: mean@n, std@n, maj@n")
    temperature: float = Field(0.0, ge=0, description="their temperature (0 with n=1: greedy "
                                                      "accuracy)")
    k: Sequence[int] | int | None = Field(
        None, description="pass@k for each k of this list, each from 1 to n (null: 1 and n)")
    success_threshold: float = Field(
        1.0, description="a sample counts as correct for pass@k at this reward or more (lower "
                         "it for partial credit, such as code's share of tests passed)")
    engine: Literal["auto", "own", "shared"] = Field(
        "auto", description="evaluations during RL: own (an engine of their own, loaded with "
                            "the weights of the step evaluated: one policy version, one more "
                            "model copy), shared (the rollout engine: weights may update under "
                            "them), auto (own for the in-process torch engine on the CPU, else "
                            "shared)")

    def __post_init__(self) -> None:
        ks = [1, self.n] if self.k is None else [self.k] if isinstance(self.k, int) else list(self.k)
        for k in ks:
            if not 1 <= k <= self.n:
                shown = str(list(self.k)) if isinstance(self.k, Sequence) else str(self.k)
                raise ConfigError(f"eval.k={shown} has k={k}: each k must be a whole number "
                                  f"from 1 to eval.n={self.n} (raise eval.n or drop it)")
        object.__setattr__(self, "k", tuple(sorted(set(ks))))

    @property
    def ks(self) -> tuple[int, ...]:
        assert isinstance(self.k, tuple)
        return self.k

    def ranked_figures(self, sources: Iterable[str]) -> list[str]:
        """The names ``checkpoint.keep_best`` may rank checkpoints by: the figures where higher
        is better (``eval/accuracy``, mean@n, pass@k for each k, maj@n), over all tasks and per
        data source (``eval/<source>/pass@4``)."""
        figures = [f"mean@{self.n}", *(f"pass@{k}" for k in self.ks), f"maj@{self.n}"]
        return (["eval/accuracy", *(f"eval/{f}" for f in figures)]
                + [f"eval/{s}/{f}" for s in sorted(set(sources)) for f in figures])

    def check_ranked_figure(self, name: str, sources: Iterable[str]) -> None:
        """One line unless ``name`` is one of :meth:`ranked_figures`."""
        names = self.ranked_figures(sources)
        if name not in names:
            overall = [n for n in names if n.count("/") == 1]
            raise ConfigError(
                f"checkpoint.keep_best={name} is not a figure this run's evaluation gives where "
                f"higher is better; choose one of {', '.join(overall)}, or eval/<source>/<figure> "
                f"for a data source of the eval tasks ({', '.join(sorted(set(sources)))})")


@settings("checkpoint")
class CheckpointConfig:
    """``checkpoint``: what is written to resume from."""

    every_s: float = Field(
        60.0, ge=0, description="a checkpoint at the end of the first step this many wall "
                                "seconds after the last one began, written in the background, "
                                "so a crash loses at most the step in progress and a minute "
                                "(0: not by time)")
    every: int = Field(0, ge=0, description="and/or every this many steps (0: not by count; "
                                            "with every_s=0 too, only SIGTERM/SIGINT and the "
                                            "run's end write one)")
    keep: int = Field(2, ge=1, description="the newest kept in <run_dir>/checkpoints/step-<N>/")
    keep_best: str | None = Field(
        None, description="and the best by this evaluation figure (eval/pass@1, eval/accuracy, "
                          "eval/<source>/mean@4, ...): --step best")


@settings("replay")
class ReplayConfig:
    """``replay`` (``experiment=replay``): a PolyTrace workload through the run loop in virtual
    time."""

    engine: str | None = Field(None, description="an engine fit from `python -m "
                                                 "orchestrator.replay fit` (null: the shipped "
                                                 "fit)")
    steps: list[int] | None = Field(None, description="trace steps whose prompt groups are "
                                                      "replayed, in order (null: all)")
    groups_per_step: int | None = Field(
        256, ge=1, description="prompt groups per trained step, a sample replicated up to it "
                               "(null: a step's recorded groups)")
    num_steps: int | None = Field(None, ge=1, description="null: pipeline.num_steps")
    rollout_share: float = Field(0.7, gt=0, lt=1, description="the trainer cost model: "
                                                              "rollout's share of a synchronous "
                                                              "step (an assumption)")
    trainer_s: float | None = Field(
        None, ge=0, description="or a step costs trainer_s + trainer_s_per_1k_tokens x batch "
                                "tokens / 1000 virtual seconds")
    trainer_s_per_1k_tokens: float = Field(
        0.0, ge=0, description="with trainer_s: per 1,000 prompt, generated and tool tokens")
    tool_latency: Literal["trace", "model"] = Field(
        "trace", description="trace: the recorded latencies; model: the search latency model")
    sync_seconds: float = Field(0.0, ge=0, description="virtual seconds per weight load (every "
                                                       "engine paused)")
    engines: int = Field(1, ge=1, description="engine replicas, each the fitted server with "
                                              "its own batch curve")
    routing: Routing = Field("least_loaded", description="least_loaded (fewest requests in "
                                                         "flight, then resident tokens) or "
                                                         "round_robin")
    sticky: bool = Field(True, description="an episode's later turns stay on its replica (else: "
                                           "a full prefill)")

    def __post_init__(self) -> None:
        if self.trainer_s is None and self.trainer_s_per_1k_tokens:
            raise ConfigError("replay.trainer_s_per_1k_tokens needs replay.trainer_s (0 for none): "
                              "without it the trainer follows replay.rollout_share")


@settings("")
class ReplaySettings:
    """The top-level key of ``experiment=replay``."""

    trace: str | None = Field(None, description="a PolyTrace directory (null: the sample in "
                                                "orchestrator/trace/data)")


SECTIONS: dict[str, type] = {
    "pipeline": PipelineConfig, "rollout": RolloutConfig, "warmstart": WarmStartConfig,
    "eval": EvalConfig, "checkpoint": CheckpointConfig,
}
"""The plain sections of every training run, by key."""


def fields(cls: type) -> dict[str, FieldInfo]:
    """A section's fields: each one's annotation, default, constraints and description."""
    return cls.__pydantic_fields__  # type: ignore[attr-defined,no-any-return]


def defaults(cls: type) -> dict[str, Any]:
    return {name: _plain(info.default) for name, info in fields(cls).items()}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def annotation(key: str) -> Any:
    """The type of the dotted ``key`` (``pipeline.num_steps``, ``seed``, ``trace``), with its
    bounds (``Annotated[int, Ge(1)]``)."""
    section, _, name = key.rpartition(".")
    cls = {"": RunSettings, "replay": ReplayConfig, **SECTIONS}.get(section)
    found = fields(cls) if cls is not None else {}
    if section == "" and name not in found:
        found = fields(ReplaySettings)
    if name not in found:
        raise KeyError(key)
    info = found[name]
    return Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation


def register() -> None:
    """The defaults, in Hydra's ConfigStore: ``schema`` (every training run's top-level keys and
    plain sections, the first entry of ``conf/config.yaml``'s defaults list) and
    ``schema/replay`` (``experiment=replay``'s)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="schema", node={**defaults(RunSettings),
                                     **{key: defaults(cls) for key, cls in SECTIONS.items()}})
    store.store(group="schema", name="replay", package="_global_",
                node={**defaults(ReplaySettings), "replay": defaults(ReplayConfig)})


def check(key: str, value: Any, annotation: Any) -> Any:
    """``value`` as ``annotation`` takes it (an int as a float, a list as a tuple), or one line
    naming ``key``. Only the annotations a config value can have are checked (numbers, strings,
    booleans, None, literals, sequences and their unions, with bounds); anything else is left to
    the code that uses it."""
    bounds: tuple[Any, ...] = ()
    if typing.get_origin(annotation) is Annotated:
        annotation, *bounds = typing.get_args(annotation)
    if not _checkable(annotation):
        return value
    if isinstance(value, list) and _takes_tuple(annotation):
        value = tuple(value)  # YAML has lists only
    try:
        return _adapter(Annotated[annotation, *bounds] if bounds else annotation).validate_python(value)
    except ValidationError as e:
        raise ConfigError(_one_line(key, value, annotation, e, bounds)) from None


_PRIMITIVES = (int, float, str, bool, type(None))
_SEQUENCES = (list, tuple, collections.abc.Sequence)


def _checkable(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return True
    if origin in (typing.Union, types.UnionType, *_SEQUENCES):
        return all(_checkable(a) for a in typing.get_args(annotation) if a is not Ellipsis)
    return annotation in _PRIMITIVES


def _takes_tuple(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_takes_tuple(a) for a in typing.get_args(annotation))
    return origin is tuple


@functools.cache
def _adapter(annotation: Any) -> TypeAdapter[Any]:
    return TypeAdapter(annotation, config=STRICT)


def _explain(cls: type, section: str, values: dict[str, Any], error: ValidationError) -> str:
    """One line for the first mistake pydantic found building the section ``cls``."""
    first = error.errors()[0]
    name = next((part for part in first["loc"] if isinstance(part, str)), None)
    if name is None or name not in fields(cls):  # a check of several keys: its own sentence
        return str(first["msg"]).removeprefix("Value error, ")
    info = fields(cls)[name]
    key = f"{section}.{name}" if section else name
    return _one_line(key, values.get(name), info.annotation, error, info.metadata)


_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _one_line(key: str, value: Any, annotation: Any, error: ValidationError,
              bounds: Sequence[Any] = ()) -> str:
    """``key must be >= 1, got 0`` for a bound crossed, else ``key=value must be <its type>``."""
    within = " and ".join(f"{sign} {getattr(b, kind)}" for b in bounds for kind, sign in _BOUNDS
                          if getattr(b, kind, None) is not None)
    for e in error.errors():
        ctx = e.get("ctx", {})
        crossed = next((f"{sign} {ctx[kind]}" for kind, sign in _BOUNDS if kind in ctx), None)
        if crossed is not None:
            null = " or null" if _optional(annotation) else ""
            return f"{key} must be {within or crossed}{null}, got {value}"
        if e["type"] == "value_error":
            return str(e["msg"]).removeprefix("Value error, ")
    return f"{key}={value} must be {_kind(annotation)}{f' ({within})' if within else ''}"


def _optional(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


def _kind(annotation: Any) -> str:
    """``annotation`` in words: ``a whole number or null``."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        words = " or ".join(_kind(a) for a in members)
        return f"{words} or null" if _optional(annotation) else words
    if origin in _SEQUENCES:
        item = next((a for a in typing.get_args(annotation) if a is not Ellipsis), Any)
        return f"a list of {_plural(_kind(item))}"
    return {int: "a whole number", float: "a number", bool: "true or false", str: "a string",
            type(None): "null"}.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _plural(kind: str) -> str:
    return {"a whole number": "whole numbers", "a number": "numbers",
            "a string": "strings"}.get(kind, kind)
