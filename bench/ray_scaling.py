"""Throughput against engine nodes on a local multi-node Ray cluster, and weight broadcast.

What runs. A :class:`ray.cluster_utils.Cluster` on this machine: a head node (the driver and
the trainer; one CPU and the custom resource ``head_node``) and four worker nodes (one CPU
and ``engine_node`` each), or a running cluster of that shape (``--address``: the tests pass
theirs, :mod:`bench.ray_cluster`). For 1, 2 and 4 engines the bench runs the real run loop
(:func:`orchestrator.run.loop.run_session`: admission, rollout workers, the freshness check,
weight sync, the recorder) through ``launcher=ray`` (:class:`~orchestrator.launch.ray.
RayLauncher`, ``placement=spread``, ``engine.resources={engine_node: 1}``,
``trainer.resources={head_node: 1}``): one engine actor per worker node behind the
launcher's router, the trainer in an actor on the head.

The engine (:func:`bench.trace_engine.trace_engine`, named by ``_target_`` in the
``EngineRecipe``) draws each sample's completion length from the PolyTrace search_r1 sample
and takes its time from the fitted server model (decode iterations at the engine's own
concurrency and resident tokens, prefill of uncached prompt tokens), scaled so that a sample
of mean length at ``PER_ENGINE_BATCH`` concurrent requests takes ``SAMPLE_SECONDS``; a step
then takes about a second. It sleeps: it costs no CPU while it "generates". Every engine draws
the same sequence of lengths, so each node count sees the same workload per engine. The
trainer (:mod:`bench.fixed_trainer`) sleeps ``TRAIN_SECONDS`` per step, less than a step's
generation, so the engines are the bottleneck (it runs in a trainer actor on the head); staleness ``k = 1``, groups of 8, one-turn
episodes (the arithmetic environment, whose reward is always 0 here). Scaling is weak: the
batch is ``PER_ENGINE_BATCH`` samples per engine, so with perfect scaling the step time stays
put and samples/s grows with the engines. Samples/s counts trained samples (stale ones dropped
do not count) over the steps after the first ``WARMUP_STEPS``.

Weight sync. With the same cluster, the driver (on the head, where the trainer runs) puts a
100 M-parameter weight set (float32, 400 MB) into the object store once, the way
``launcher=ray`` does (:meth:`~orchestrator.weights.update.WeightUpdate.to_object_store`: byte
views, one ``ray.put``), and one actor on each engine node pulls it (``update.tensors()``: its
``ray.get``, as an engine actor's weight load does). The bench reports the put, each pull and
the put to the last pull, with GB/s per engine and in all, as the median of a few broadcasts
after a first one that warms the stores (pages first touched, connections opened), shown
apart. A run's weight sync adds the pause and resume of the engines to this.

Sizes: 30 steps per node count and 8 broadcasts; ``--quick`` 10 steps and 2. ``--smoke``
(the tests'; most of its time is the cluster's and the actors' start): a head and 2 engine
nodes, 1 and 2 engines, 3 steps each (a step timed after the warm-up), samples of 0.1 s and a
trainer of 0.04 s, a broadcast of 1 M parameters (4 MB) after its warm-up; it checks the bench
runs end to end, its figures say nothing.

Last line: ``scaling_efficiency_4=<samples/s at 4 nodes / (4 x samples/s at 1 node)>``
(``scaling_efficiency_2`` at ``--smoke``, its largest node count). Without the ray extra the
bench says so in one line and exits with status 3.

Limits. Every "node" is a set of processes on this one machine: they share its two cores (a
raylet, agents and an actor per node, besides the driver), and objects cross between nodes
over loopback TCP, not a network. The engines sleep, so the bench measures scheduling, routing
and Ray overhead in the driver and the actors, not compute, which on a real cluster runs on
each engine's own GPU. The trainer's cost does not grow with the batch. The pulled weights are
not copied into a model (a torch engine copies them once more). Anything else running on the
machine shows in the figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import anyio
import torch

from bench.cli import add_smoke, headline, refuse

if __name__ == "__main__" and importlib.util.find_spec("ray") is None:  # before it is imported
    refuse("ray_scaling", "the ray extra is missing: pip install -e '.[ray]'")

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from bench import fixed_trainer
from bench.ray_cluster import HEAD, add_address, connected
from bench.trace_engine import load_shapes, sample_seconds, trace_engine
from envs.registry import make_spec
from orchestrator.config.schema import PipelineConfig, RolloutConfig
from orchestrator.launch.base import EngineRecipe
from orchestrator.launch.ray import RayLauncher
from orchestrator.models.tokenizer import CharTokenizer
from orchestrator.pipeline.pipeline import TaskSampler
from orchestrator.replay.fit import EngineFit
from orchestrator.run.loop import RunParts, RunResult, run_session
from orchestrator.staleness import admission_budget
from orchestrator.weights.update import WeightUpdate

GROUP_SIZE = 8
PER_ENGINE_BATCH = 32
SAMPLE_SECONDS = 0.75  # a mean-length sample at PER_ENGINE_BATCH concurrency
K = 1
TRAIN_SECONDS = 0.3
MAX_TOKENS = 3000  # the trace's max_response_len
CHUNK_TOKENS = 16  # decode chunk: a pause waits for at most one
NODES = (1, 2, 4)
WARMUP_STEPS = 2
WEIGHT_PARAMS = 100_000_000  # float32: 400 MB
WEIGHT_TENSORS = 100
OBJECT_STORE_BYTES = 1_500_000_000  # per node: room for a weight set or two and slack


@dataclass(frozen=True)
class Size:
    """What a run of the bench measures, and at what scale."""

    steps: int  # per node count, WARMUP_STEPS of them not timed
    repeats: int  # broadcasts after the warm-up one
    nodes: tuple[int, ...] = NODES  # engine node counts, the last the headline's
    sample_seconds: float = SAMPLE_SECONDS
    train_seconds: float = TRAIN_SECONDS
    weight_params: int = WEIGHT_PARAMS
    object_store_bytes: int = OBJECT_STORE_BYTES


SMOKE = Size(steps=WARMUP_STEPS + 1, repeats=1, nodes=(1, 2), sample_seconds=0.1,
             train_seconds=0.04, weight_params=1_000_000, object_store_bytes=100_000_000)


@dataclass(frozen=True)
class Result:
    engines: int
    nodes: int  # distinct nodes the engines ran on (from their spans)
    samples: int
    seconds: float
    step_seconds: float
    dropped: int
    driver_cpu: float  # the driver's CPU seconds per wall second over the run

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds


def time_scale(seconds: float = SAMPLE_SECONDS) -> float:
    """The engine's time scale: a mean-length sample at ``PER_ENGINE_BATCH`` concurrency
    takes ``seconds``."""
    params = EngineFit.load().server
    shapes = load_shapes()
    mean = statistics.fmean(sample_seconds(params, s, PER_ENGINE_BATCH) for s in shapes)
    return seconds / mean


def run(engines: int, steps: int, scale: float, train_seconds: float = TRAIN_SECONDS) -> Result:
    """One run through ``launcher=ray``: ``engines`` engine actors spread over the engine
    nodes, the trainer actor on the head."""
    batch = engines * PER_ENGINE_BATCH
    spec = make_spec("arithmetic")
    engine = EngineRecipe(engine={"_target_": f"{trace_engine.__module__}.trace_engine",
                                  "time_scale": scale, "chunk_tokens": CHUNK_TOKENS, "seed": 0},
                          model={})
    result = RunResult(run_dir=None)
    with RayLauncher(num_engines=engines, placement="spread",
                     engine={"num_cpus": 1, "resources": {"engine_node": 1}},
                     trainer={"num_cpus": 1, "resources": {HEAD: 1}}) as launcher:
        parts = RunParts(
            spec=spec, tokenizer=CharTokenizer(),
            trainer=launcher.trainer(fixed_trainer.recipe(train_seconds)),
            make_engine=partial(launcher.engine, engine), sampler=TaskSampler(spec.tasks("train")),
            pipeline=PipelineConfig(batch_size=batch, max_staleness=K, num_steps=steps,
                                    num_workers=admission_budget(batch, K) // GROUP_SIZE),
            rollout=RolloutConfig(group_size=GROUP_SIZE, max_tokens=MAX_TOKENS))
        wall, cpu = time.perf_counter(), time.process_time()
        anyio.run(partial(run_session, parts, result))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert result.recorder is not None
    spans = result.recorder.spans
    timed = result.reports[WARMUP_STEPS:] or result.reports
    return Result(
        engines=engines,
        nodes=len({s.attributes["node"] for s in spans
                   if s.stage == "engine_start" and "node" in s.attributes}),
        samples=sum(r.samples for r in timed),
        seconds=sum(r.elapsed for r in timed),
        step_seconds=statistics.fmean(r.elapsed for r in timed),
        dropped=result.reports[-1].dropped_total,
        driver_cpu=cpu / wall,
    )


@ray.remote(num_cpus=0)
class Puller:
    """Stands in for an engine actor's weight load: ``update.tensors()`` is its ``ray.get``."""

    def pull(self, update: WeightUpdate) -> tuple[int, float]:
        started = time.perf_counter()
        tensors = update.tensors()
        return sum(t.nbytes for t in tensors.values()), time.perf_counter() - started


@dataclass(frozen=True)
class Broadcast:
    nbytes: int
    put: float  # the one ray.put
    pulls: tuple[float, ...]  # each actor's pull
    wall: float  # the put to the last pull

    @property
    def gbps_per_engine(self) -> float:
        return self.nbytes / statistics.median(self.pulls) / 1e9

    @property
    def gbps_total(self) -> float:
        return self.nbytes * len(self.pulls) / self.wall / 1e9


def broadcasts(nodes: int, repeats: int, params: int = WEIGHT_PARAMS) -> list[Broadcast]:
    """``repeats + 1`` broadcasts of the weight set from the driver (on the head) to one actor on
    each of ``nodes`` engine nodes; the first warms the stores (pages first touched,
    connections opened)."""
    group = placement_group([{"engine_node": 1}] * nodes, strategy="STRICT_SPREAD")
    ray.get(group.ready(), timeout=60)
    actors = [Puller.options(  # type: ignore[attr-defined]
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
    ).remote() for i in range(nodes)]
    per = params // WEIGHT_TENSORS
    tensors = {f"layer.{i}.weight": torch.zeros(per, dtype=torch.float32)
               for i in range(WEIGHT_TENSORS)}
    out = []
    try:
        for version in range(repeats + 1):
            started = time.perf_counter()
            # the launcher's transport: byte views of the tensors, one ray.put
            update = WeightUpdate.by_reference(version, tensors, leased=False).to_object_store()
            put = time.perf_counter() - started
            pulled = ray.get([a.pull.remote(update) for a in actors])
            wall = time.perf_counter() - started
            del update  # frees the object before the next put
            out.append(Broadcast(nbytes=pulled[0][0], put=put,
                                 pulls=tuple(s for _, s in pulled), wall=wall))
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Samples/s against engine nodes on local Ray.")
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--steps", type=int, default=None, help="train steps per node count")
    add_address(parser)
    add_smoke(parser)
    args = parser.parse_args(argv)
    size = SMOKE if args.smoke else Size(steps=10 if args.quick else 30,
                                         repeats=2 if args.quick else 8)
    steps = args.steps or size.steps
    if steps <= WARMUP_STEPS:
        refuse("ray_scaling", f"--steps {steps}: the first {WARMUP_STEPS} are warm-up, none "
                              "would be timed")
    nodes = max(size.nodes)
    scale = time_scale(size.sample_seconds)
    print(f"engine: search_r1 lengths, fitted server model x{scale:.4f}; "
          f"{PER_ENGINE_BATCH} samples/engine/step, group {GROUP_SIZE}, k={K}, "
          f"train step {size.train_seconds:.2f} s; {steps} steps, {WARMUP_STEPS} warm-up",
          flush=True)
    started = time.perf_counter()
    with connected("ray_scaling", args.address, nodes, "engine_node", size.object_store_bytes):
        results = []
        for count in size.nodes:
            t0 = time.perf_counter()
            result = run(count, steps, scale, size.train_seconds)
            results.append(result)
            print(f"engines={count} on {result.nodes} nodes: {result.samples_per_s:.1f} samples/s, "
                  f"step {result.step_seconds:.2f} s, {result.dropped} dropped, driver CPU "
                  f"{result.driver_cpu:.0%} ({time.perf_counter() - t0:.1f} s)", flush=True)
        t0 = time.perf_counter()
        first, *sync = broadcasts(nodes, size.repeats, size.weight_params)
        typical = sorted(sync, key=lambda b: b.wall)[len(sync) // 2]  # the median broadcast
        print(f"weight sync: {typical.nbytes / 1e6:.0f} MB from the head to {len(typical.pulls)} "
              f"engine nodes, median of {len(sync)}: put {typical.put:.2f} s, pull "
              f"{statistics.median(typical.pulls):.2f} s median ({typical.gbps_per_engine:.2f} "
              f"GB/s per engine), put to the last pull {typical.wall:.2f} s "
              f"({typical.gbps_total:.2f} GB/s in all); each: {[round(b.wall, 2) for b in sync]} s, "
              f"after a first (warm-up) of {first.wall:.2f} s ({time.perf_counter() - t0:.1f} s)",
              flush=True)
    print(f"{'engines':>7} {'nodes':>5} {'samples/s':>10} {'step_s':>7} {'dropped':>7} "
          f"{'driver_cpu':>10} {'efficiency':>10}")
    base = results[0].samples_per_s
    for r in results:
        print(f"{r.engines:>7} {r.nodes:>5} {r.samples_per_s:>10.1f} {r.step_seconds:>7.2f} "
              f"{r.dropped:>7} {r.driver_cpu:>10.0%} {r.samples_per_s / (r.engines * base):>10.2f}")
    print(f"elapsed {time.perf_counter() - started:.0f} s")
    most = results[-1]
    headline(f"scaling_efficiency_{most.engines}", most.samples_per_s / (most.engines * base), 2)


if __name__ == "__main__":
    main()
