"""``launcher=ray``: the engines and the trainer as Ray actors, the pipeline in this process.

What runs where: this process (the driver) keeps the pipeline, admission and the freshness
check, the environments and their tools, the recorder and the run directory. The trainer runs
in a :class:`~.actors.TrainerActor` and each of ``num_engines`` engines in an
:class:`~.actors.EngineActor`, all placed by one placement group: a bundle for the trainer and
one per engine (``launcher.trainer`` and ``launcher.engine``: CPUs, GPUs, custom resources),
packed onto as few nodes as possible or spread over as many (``launcher.placement``).

``launcher.address``: empty starts a Ray instance on this machine for the run (and stops it
after); ``auto`` joins the cluster ``ray start`` runs on this machine; ``host:port`` the one
whose head is there; ``ray://host:port`` goes through Ray Client. Every node needs this project
installed in the same Python environment (the actors import it). A run that cannot connect, or
that asks for resources no node has, ends with one sentence naming the key to change.

``launcher.colocate=true``: the trainer and the engines take turns on one GPU. Their bundles
ask for fractions of it (``launcher.trainer.num_gpus`` plus ``launcher.engine.num_gpus`` per
engine at most 1, each above 0) and are placed on one node (``STRICT_PACK``), where Ray gives
fractional requests the same GPU while it has room (Ray's behaviour, not checked here); a
colocated vLLM engine sleeps through each train step. Weights still travel through the object
store (``engine.weight_transfer`` rpc: the trainer actor's tensors are in another process).

Weights: after each step the trainer actor puts the new weights into the object store once and
every engine actor pulls them (see :mod:`orchestrator.weights.update`); engine faults are survived
(:mod:`~.engines`); a dead trainer actor is replaced and the run goes on from its last
checkpoint, written by the driver in its own run directory (:meth:`RayLauncher.recover`,
:mod:`~.trainer`); spans come back from every actor (:mod:`~.spans`).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any, Self

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator import allocator, faults
from orchestrator.engines.base import InferenceEngine
from orchestrator.engines.placement import Placement
from orchestrator.errors import ConfigError, chain
from orchestrator.launch.base import EngineRecipe, Launcher, TrainerRecipe
from orchestrator.launch.ranks import RankGroup, world_size
from orchestrator.launch.ray.actors import ActorInfo, EngineActor, TrainerActor, WeightsLost
from orchestrator.launch.ray.engines import RayEngine, ray_router
from orchestrator.launch.ray.ranks import RankActor, rank_name, ray_rank_group
from orchestrator.launch.ray.remote import RayActorError, result_now
from orchestrator.launch.ray.spans import SpanCollector
from orchestrator.launch.ray.trainer import RayTrainer, TrainerLost
from orchestrator.trace.recorder import Recorder
from orchestrator.trainer.base import Trainer
from orchestrator.weights.update import WeightUpdate

log = logging.getLogger(__name__)

PLACEMENTS = {"pack": "PACK", "spread": "SPREAD"}
# Ray's own bookkeeping resources, left out when the cluster is described to a user
_HIDDEN = ("memory", "object_store_memory", "node:", "accelerator_type:")


@dataclass(frozen=True)
class ActorResources:
    """What one actor reserves (``launcher.engine``, ``launcher.trainer``)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict)  # custom: {"gpu_node": 1}

    @classmethod
    def of(cls, key: str, values: Mapping[str, Any] | None) -> ActorResources:
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        for name in values:
            if name not in known:
                raise ConfigError(f"unknown key {key}.{name}: expected one of {sorted(known)}")
        made = cls(**{**values, "resources": {str(k): v for k, v in
                                              dict(values.get("resources") or {}).items()}})
        for name in ("num_cpus", "num_gpus"):
            value = getattr(made, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{key}.{name} must be a number >= 0, got {value!r}")
        for name, value in made.resources.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{key}.resources.{name} must be a number > 0, got {value!r}")
        if not made.bundle():
            raise ConfigError(f"{key} reserves nothing: give it num_cpus, num_gpus or a resource")
        return made

    def bundle(self) -> dict[str, float]:
        amounts = {"CPU": float(self.num_cpus), "GPU": float(self.num_gpus),
                   **{k: float(v) for k, v in self.resources.items()}}
        return {k: v for k, v in amounts.items() if v > 0}

    def options(self, env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Ray's options for an actor of this spec, ``env`` added to its environment."""
        env = {**allocator.environment(), **(env or {})}  # glibc's read as the process starts
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                "resources": dict(self.resources),
                **({"runtime_env": {"env_vars": env}} if env else {})}

    @property
    def threads(self) -> int:
        """Torch threads for an actor holding this many CPUs (at least one)."""
        return max(1, int(self.num_cpus))

    def key_of(self, key: str, resource: str) -> str:
        """The config key (with its value) that asks for ``resource``."""
        if resource == "CPU":
            return f"{key}.num_cpus={self.num_cpus:g}"
        if resource == "GPU":
            return f"{key}.num_gpus={self.num_gpus:g}"
        return f"{key}.resources={dict(self.resources)}"


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None
    num_engines: int = 1
    engine: ActorResources = field(default_factory=ActorResources)
    trainer: ActorResources = field(default_factory=ActorResources)
    placement: str = "pack"
    connect_timeout_s: float = 30.0
    engine_restart_timeout_s: float = 120.0
    span_flush_s: float = 5.0
    affinity_slack: int | None = 8
    namespace: str = "polyrl"
    trainer_max_restarts: int = 3  # launcher.trainer.max_restarts

    def __post_init__(self) -> None:
        if self.trainer_max_restarts < 0:
            raise ConfigError(f"launcher.trainer.max_restarts must be >= 0, got "
                              f"{self.trainer_max_restarts}")
        if self.num_engines < 1:
            raise ConfigError(f"launcher.num_engines must be >= 1, got {self.num_engines}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(
                f"launcher.placement={self.placement} must be one of {', '.join(PLACEMENTS)}")
        for key in ("connect_timeout_s", "engine_restart_timeout_s", "span_flush_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"launcher.{key} must be > 0, got {getattr(self, key)}")
        if self.affinity_slack is not None and self.affinity_slack < 0:
            raise ConfigError(
                f"launcher.affinity_slack must be >= 0 or null, got {self.affinity_slack}")


class RayLauncher(Launcher):
    """Connects to Ray and places the actors on ``__enter__``; kills them on :meth:`close`."""

    def __init__(self, address: str | None = None, num_engines: int = 1,
                 engine: Mapping[str, Any] | None = None, trainer: Mapping[str, Any] | None = None,
                 placement: str = "pack", connect_timeout_s: float = 30.0,
                 engine_restart_timeout_s: float = 120.0, span_flush_s: float = 5.0,
                 affinity_slack: int | None = 8, namespace: str = "polyrl",
                 trainer_ranks: int | None = None, colocate: bool = False) -> None:
        if trainer_ranks is not None and (not isinstance(trainer_ranks, int) or trainer_ranks < 1):
            raise ConfigError(f"trainer.world_size must be an integer >= 1 or null, got "
                              f"{trainer_ranks!r}")
        self.ranks = trainer_ranks or 1  # trainer bundles: one per rank (trainer.world_size)
        trainer = dict(trainer or {})
        max_restarts = trainer.pop("max_restarts", RayConfig.trainer_max_restarts)
        if not isinstance(max_restarts, int) or isinstance(max_restarts, bool):
            raise ConfigError(f"launcher.trainer.max_restarts must be a whole number, got "
                              f"{max_restarts!r}")
        self.config = RayConfig(
            address=str(address) if address else None, num_engines=num_engines,
            engine=ActorResources.of("launcher.engine", engine),
            trainer=ActorResources.of("launcher.trainer", trainer), placement=placement,
            connect_timeout_s=connect_timeout_s, engine_restart_timeout_s=engine_restart_timeout_s,
            span_flush_s=span_flush_s, affinity_slack=affinity_slack, namespace=namespace,
            trainer_max_restarts=max_restarts)
        self.colocate = colocate
        if colocate:
            _check_colocation(self.config, self.ranks)
        _check_rank_gpus(self.config, self.ranks)
        self.run_id = f"polyrl-{uuid.uuid4().hex[:8]}"  # names this run's actors in the cluster
        self.spans = SpanCollector()
        self._owns_ray = False
        self._group: PlacementGroup | None = None
        self._actors: list[Any] = []
        self._trainer: RayTrainer | None = None
        self.trainer_restarts = 0

    # -- connecting and placing ------------------------------------------------------------

    def __enter__(self) -> Self:
        try:
            self._connect()
            self._place()
        except BaseException:
            self.close()
            raise
        return self

    def _connect(self) -> None:
        if ray.is_initialized():  # the caller (a benchmark, a notebook) connected already
            return
        config = self.config
        options: dict[str, Any] = {"namespace": config.namespace, "logging_level": logging.WARNING}
        if config.address is None:  # a Ray of this run's own, never one that happens to run here
            ray.init(address="local", include_dashboard=False, **options)
        else:
            if config.address != "auto":
                _probe(config.address, config.connect_timeout_s)
            try:
                with _gcs_wait(config.connect_timeout_s):
                    ray.init(address=config.address, **options)
            except ConnectionError as error:
                if config.address == "auto":
                    raise ConfigError(
                        "launcher.address=auto found no Ray cluster on this machine: start one "
                        "with `ray start --head`, name its head with launcher.address=host:port, "
                        "or leave launcher.address empty to start Ray for this run") from error
                raise _unreachable(config.address, error, config.connect_timeout_s) from error
        self._owns_ray = True

    def _place(self) -> None:
        config = self.config
        bundles = [config.trainer.bundle()] * self.ranks + [config.engine.bundle()] * config.num_engines
        self._check_fits()
        strategy = "STRICT_PACK" if self.colocate else PLACEMENTS[config.placement]
        group = placement_group(bundles, strategy=strategy, name=self.run_id)
        self._group = group
        if not group.wait(timeout_seconds=config.connect_timeout_s):
            raise ConfigError(
                f"launcher.placement={config.placement}: {len(bundles)} bundles {bundles} were "
                f"not placed within launcher.connect_timeout_s={config.connect_timeout_s:g}: "
                f"other work holds the free resources (free: "
                f"{_describe(ray.available_resources())})")

    def _check_fits(self) -> None:
        """One sentence naming the key when no node, or the whole cluster, is too small."""
        config = self.config
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        totals: dict[str, float] = ray.cluster_resources()
        cluster = _describe(totals)
        for key, spec in (("launcher.trainer", config.trainer), ("launcher.engine", config.engine)):
            bundle = spec.bundle()
            for resource, amount in bundle.items():
                if not any(node.get(resource, 0.0) >= amount for node in nodes):
                    what = "it" if resource not in totals else f"{amount:g} {resource}"
                    raise ConfigError(f"{spec.key_of(key, resource)} cannot be placed: "
                                      f"no node has {what} (cluster: {cluster})")
            if not any(all(node.get(r, 0.0) >= a for r, a in bundle.items()) for node in nodes):
                raise ConfigError(f"{key} asks for {bundle}, which no single node has "
                                  f"(cluster: {cluster})")
        need: Counter[str] = Counter()
        for _ in range(self.ranks):
            need.update(config.trainer.bundle())
        for _ in range(config.num_engines):
            need.update(config.engine.bundle())
        for resource, amount in need.items():
            if amount > totals.get(resource, 0.0) + 1e-9:
                raise ConfigError(
                    f"launcher.num_engines={config.num_engines} needs {amount:g} {resource} in "
                    f"all ({config.engine.key_of('launcher.engine', resource)} per engine, "
                    f"{config.trainer.key_of('launcher.trainer', resource)}) but the cluster has "
                    f"{totals.get(resource, 0.0):g}: fewer engines or smaller requests "
                    f"(fractions are allowed, e.g. launcher.engine.num_cpus=0.5)")

    def _bundle(self, index: int) -> PlacementGroupSchedulingStrategy:
        assert self._group is not None, "use the launcher as a context manager"
        return PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=index)

    # -- Launcher --------------------------------------------------------------------------

    def trainer(self, recipe: TrainerRecipe) -> Trainer:
        recipe = replace(recipe, colocated=self.colocate)  # its engines are in other actors
        size = world_size(recipe)
        if size is not None:
            return self._rank_group(recipe, size)
        spec = self.config.trainer
        name = f"{self.run_id}-trainer" + (f"-{self.trainer_restarts}" if self.trainer_restarts else "")
        actor = ray.remote(TrainerActor).options(
            name=name, max_restarts=0, scheduling_strategy=self._bundle(0), **spec.options(),
        ).remote(recipe, "trainer", spec.threads)
        self._actors.append(actor)
        try:
            info: ActorInfo = result_now(actor.start.remote())
        except RayActorError as error:
            raise TrainerLost(f"the trainer actor died while it was built: "
                              f"{str(error).strip().splitlines()[0]}") from error
        self.spans.watch("trainer", actor)
        self._trainer = RayTrainer(actor, info, self.spans, "trainer")
        return self._trainer

    def engine(self, recipe: EngineRecipe, weights: WeightUpdate,
               recorder: Recorder | None = None) -> InferenceEngine:
        """The engines behind one router; their spans (and the trainer's) go to ``recorder``."""
        if recorder is not None:
            self.record_to(recorder)
        spec = self.config.engine
        tp = recipe.engine.get("tensor_parallel_size", 1)
        if isinstance(tp, int) and tp > 1 and spec.num_gpus < tp:
            raise ConfigError(f"engine.tensor_parallel_size={tp} splits each engine over {tp} GPUs "
                              f"of its actor, which launcher.engine.num_gpus={spec.num_gpus:g} "
                              f"does not give it: set launcher.engine.num_gpus={tp}")
        recipe = replace(recipe, placement=self.engine_placement())
        engines = []
        for i in range(self.config.num_engines):
            name = f"engine-{i}"
            actor = ray.remote(EngineActor).options(
                name=f"{self.run_id}-{name}", max_restarts=-1, max_task_retries=0,
                scheduling_strategy=self._bundle(self.ranks + i),
                **spec.options(faults.actor_environment(name)),
            ).remote(_seeded(recipe, i), name, spec.threads)
            self._actors.append(actor)
            engines.append(RayEngine(actor, name, self.spans, colocated=self.colocate))
        if weights.transport != "object_store":
            weights = weights.to_object_store()
        return ray_router(engines, weights, self.spans,
                          restart_timeout_s=self.config.engine_restart_timeout_s,
                          span_flush_s=self.config.span_flush_s,
                          affinity_slack=self.config.affinity_slack)

    def engine_placement(self) -> Placement:
        """Where each engine actor stands: the trainer is another actor (its tensors are not in
        the engines' processes); engines that share a GPU (colocated, or asking for a fraction
        of one) each plan for their part of its memory."""
        share = self.config.engine.num_gpus
        fraction = (1 / self.config.num_engines if self.colocate
                    else min(share, 1.0) if share > 0 else 1.0)
        return Placement(trainer_here=False, colocate=self.colocate, gpu_fraction=fraction)

    def record_to(self, recorder: Recorder) -> None:
        """Send the actors' spans to the run's ``recorder`` (on its clock)."""
        self.spans.record_to(recorder)

    def _rank_group(self, recipe: TrainerRecipe, size: int) -> RankGroup:
        """``trainer.world_size`` rank actors on the first bundles (:mod:`~.ranks`)."""
        if size != self.ranks:
            raise ConfigError(f"trainer.world_size={size} but the placement group has "
                              f"{self.ranks} trainer bundles (launcher.trainer_ranks)")
        spec = self.config.trainer

        def place(rank: int) -> Any:
            actor = ray.remote(RankActor).options(
                name=f"{self.run_id}-trainer-rank-{rank}", max_restarts=0,
                scheduling_strategy=self._bundle(rank), **spec.options(),
            ).remote(rank_name(rank), spec.threads)
            self._actors.append(actor)
            self.spans.watch(rank_name(rank), actor)
            return actor

        return ray_rank_group(recipe, size, place, self.spans)

    def recover(self, error: BaseException) -> bool:
        """A dead trainer actor (``error`` holds a :class:`TrainerLost` or
        :class:`WeightsLost`): every actor of the run is stopped, so that the next
        :meth:`trainer` and :meth:`engine` build them again in the same placement group, and
        the run goes on from its last checkpoint; at most ``launcher.trainer.max_restarts``
        times, after which the run ends in one line saying so."""
        lost = _trainer_lost(error)
        if lost is None:
            return False
        limit = self.config.trainer_max_restarts
        if self.trainer_restarts >= limit:
            raise TrainerLost(f"{lost}; restarted {self.trainer_restarts} times already "
                              f"(launcher.trainer.max_restarts={limit}): resume the run with "
                              f"resume=<run_dir> once the cause is fixed") from error
        self.trainer_restarts += 1
        log.warning("%s: restarting the trainer (%d of launcher.trainer.max_restarts=%d) and "
                    "the engines from the last checkpoint", lost, self.trainer_restarts, limit)
        self._kill_actors()
        # The failed attempt's recorder is closed: the new actors' spans (the first weight
        # update's come back before the engines are built) wait for the next attempt's.
        self.spans = SpanCollector()
        return True

    def _kill_actors(self) -> None:
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors.clear()
        self._trainer = None

    def close(self) -> None:
        self._kill_actors()
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False


def _check_rank_gpus(config: RayConfig, ranks: int) -> None:
    """Trainer ranks on GPUs take a whole one each: Ray packs fractions of a GPU onto one
    device, and NCCL refuses two ranks of a group on one device."""
    share = config.trainer.num_gpus
    if ranks > 1 and 0 < share < 1:
        raise ConfigError(
            f"trainer.world_size={ranks} with launcher.trainer.num_gpus={share:g}: Ray may put "
            "two ranks on one GPU, which NCCL refuses; give each rank a whole GPU "
            "(launcher.trainer.num_gpus=1) or none (0: the ranks train on CPUs over gloo)")


def _check_colocation(config: RayConfig, ranks: int) -> None:
    """``launcher.colocate=true``: fractions of one GPU that fit in it together."""
    if ranks > 1:  # NCCL: one rank of a group per device
        raise ConfigError(f"launcher.colocate=true shares one GPU, which holds one trainer rank, "
                          f"not trainer.world_size={ranks}: set trainer.world_size=1 or "
                          "launcher.colocate=false")
    trainer, engine = config.trainer.num_gpus, config.engine.num_gpus
    total = trainer + engine * config.num_engines
    if trainer <= 0 or engine <= 0 or total > 1 + 1e-9:
        raise ConfigError(
            f"launcher.colocate=true needs the trainer and the engines on one GPU: "
            f"launcher.trainer.num_gpus={trainer:g} and launcher.engine.num_gpus="
            f"{engine:g} (x{config.num_engines}) must each be above 0 and add up to at most 1, "
            "e.g. 0.5 each")


def _trainer_lost(error: BaseException) -> BaseException | None:
    """The :class:`TrainerLost` or :class:`WeightsLost` in ``error``, its causes and groups."""
    return next((e for e in chain(error) if isinstance(e, TrainerLost | WeightsLost)), None)


def _probe(address: str, timeout: float) -> None:
    """Fail in ``timeout`` seconds, naming the key, when nothing answers at ``address``."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"launcher.address={address} must be auto, host:port, ray://host:port "
                          f"or empty (start Ray for this run)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as error:
        raise _unreachable(address, error, timeout) from error


def _unreachable(address: str, error: BaseException, timeout: float) -> ConfigError:
    reason = getattr(error, "strerror", None) or str(error).strip().splitlines()[0] or "timed out"
    return ConfigError(f"launcher.address={address} is unreachable ({reason}; "
                       f"launcher.connect_timeout_s={timeout:g}): is Ray running there?")


@contextmanager
def _gcs_wait(seconds: float) -> Iterator[None]:
    """Bound how long ``ray.init`` retries a head that accepts connections but does not answer
    as Ray (a proxy, another service): about a second per try, ``seconds`` tries."""
    name = "RAY_gcs_server_port_wait_time_s"
    before = os.environ.get(name)
    if before is None:
        os.environ[name] = str(max(1, math.ceil(seconds)))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)


def _describe(resources: Mapping[str, float]) -> str:
    shown = {k: v for k, v in sorted(resources.items()) if not k.startswith(_HIDDEN)}
    return "{" + ", ".join(f"'{k}': {v:g}" for k, v in shown.items()) + "}"


def _seeded(recipe: EngineRecipe, index: int) -> EngineRecipe:
    """Engine ``index``'s recipe: its sampling seed offset, so two engines serving one group
    never draw the same random stream."""
    seed = recipe.engine.get("seed")
    if not isinstance(seed, int):
        return recipe
    return replace(recipe, engine={**recipe.engine, "seed": seed + index})
