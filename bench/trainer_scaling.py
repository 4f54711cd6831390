"""Trainer step time at 1 and 2 ranks (FSDP2 over gloo) on a local multi-node Ray cluster, the
weight gather and broadcast per step, and LoRA against full fine-tuning.

What runs. A :class:`ray.cluster_utils.Cluster` on this machine: a head (the driver and a
stand-in engine actor that pulls the weights; the custom resource ``head_node``) and two worker
nodes with one CPU and the custom resource ``trainer_node`` each, or a running cluster of that
shape (``--address``: the tests pass theirs, :mod:`bench.ray_cluster`). For each row the bench opens a :class:`RayLauncher` with
``trainer_ranks=N`` (``placement=spread``, ``trainer.resources={trainer_node: 1}``): N rank
actors, one per trainer node, one torch thread each, joined into one gloo process group with
the model sharded by FSDP2, exactly as ``python -m orchestrator launcher=ray
trainer.world_size=N`` builds them. The model is a Llama built from config (no download):
hidden 640, 10 layers, FFN 2048, about 56 M parameters, float32, the project's character
tokenizer. The engines are simulated: every step trains the same fixed global batch of
``GROUPS`` groups of ``GROUP_SIZE`` samples (a shared prompt, then a completion; random tokens,
mixed rewards), as engines would have produced them, so the ranks have the cores to
themselves.

Per step: ``trainer.step(batch)`` (all ranks), then ``trainer.weights()``: every rank takes
part in the gather, rank 0 puts the full state (or, with LoRA, the adapters) into the object
store once, and the stand-in engine on the head pulls it (``update.tensors()``, an engine
actor's ``ray.get``). Reported: the step's seconds (median of the measured steps after
``WARMUP`` steps), the gather seconds (rank 0's, from the update's stats), gather + put seen
from the driver, the pull, and the update's bytes.

Sizes: 4 measured steps a row; ``--quick`` 1. ``--smoke`` (the tests'; most of its time is the
cluster's and the rank actors' start): the toy model (hidden 32, one layer, FFN 64), 2 groups,
one measured step a row; it checks the bench runs end to end (every row, LoRA's included), its
figures say nothing. Without the ray extra the bench says so in one line and exits with
status 3.

Last line: ``trainer_scaling_2=<step seconds at 1 rank / step seconds at 2 ranks>``.

Limits. The two "nodes" are processes on one machine sharing its cores with the driver, the
head's raylet and whatever else runs (the load average is printed with the figures); gloo's
collectives go over loopback TCP. At 2 ranks each rank computes half the batch but every
minibatch also all-gathers the parameters and reduce-scatters the gradients (2 x 224 MB in
float32 here) and the optimiser steps half the parameters; with 2 cores for 2 ranks, a
driver and Ray's own processes, anything else running shows directly in the speed-up.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from bench.cli import add_smoke, headline, refuse

if __name__ == "__main__" and importlib.util.find_spec("ray") is None:  # before it is imported
    refuse("trainer_scaling", "the ray extra is missing: pip install -e '.[ray]'")

import ray

from bench.ray_cluster import HEAD, add_address, connected
from orchestrator.launch.base import TrainerRecipe
from orchestrator.launch.ray import RayLauncher
from orchestrator.types import FinishReason, Group, Trajectory
from orchestrator.weights.update import WeightUpdate

MODEL = {"_target_": "orchestrator.models.policy.tiny_policy", "hidden_size": 640,
         "num_layers": 10, "num_heads": 10, "intermediate_size": 2048,
         "max_position_embeddings": 256, "seed": 0, "device": "cpu"}
SMOKE_MODEL = {**MODEL, "hidden_size": 32, "num_layers": 1, "num_heads": 2,
               "intermediate_size": 64}  # the tests' toy model
SMOKE_GROUPS = 2
GROUPS = 16  # 64 samples, the default experiment's batch; --groups: more amortise the collectives
GROUP_SIZE = 4
PROMPT_TOKENS = 24
COMPLETION_TOKENS = (8, 40)  # uniform range of a completion's length
MICRO_BATCH = 32  # rows per forward pass (activation memory); micro-batches add no collectives
LORA = {"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
WARMUP = 1
OBJECT_STORE_BYTES = 1_000_000_000


@dataclass(frozen=True)
class Row:
    ranks: int
    lora: bool
    step: float  # median seconds per train step
    gather: float  # rank 0's gather of the full state (or the adapters)
    publish: float  # weights() seen from the driver: gather + the one put
    pull: float  # the stand-in engine's pull
    nbytes: int  # the update's bytes
    params: int


def batch(seed: int = 0, count: int = GROUPS) -> list[Group]:
    rng = random.Random(seed)
    groups = []
    for g in range(count):
        prompt = [1] + [rng.randrange(4, 100) for _ in range(PROMPT_TOKENS - 1)]
        samples = []
        for i in range(GROUP_SIZE):
            completion = [rng.randrange(4, 100) for _ in range(rng.randint(*COMPLETION_TOKENS))]
            ids = tuple(prompt + completion)
            samples.append(Trajectory(
                prompt_id=g, sample_index=i, token_ids=ids,
                loss_mask=tuple([False] * len(prompt) + [True] * len(completion)),
                logprobs=tuple(-4.6 for _ in ids), versions=(0,) * len(ids),
                reward=float(rng.random() < 0.5), start_version=0,
                finish_reason=FinishReason.LENGTH))
        groups.append(Group(g, tuple(samples), 0))
    return groups


@ray.remote(num_cpus=0, resources={HEAD: 0.5})
class Engine:
    """Stands in for an engine actor's weight load: ``update.tensors()`` is its ``ray.get``."""

    def pull(self, update: WeightUpdate) -> float:
        started = time.perf_counter()
        update.tensors()
        return time.perf_counter() - started


def measure(ranks: int, lora: bool, steps: int, count: int = GROUPS,
            model: dict[str, Any] = MODEL) -> Row:
    trainer = {"_target_": "orchestrator.trainer.TorchTrainer", "lr": 1e-5,
               "micro_batch_size": MICRO_BATCH, "world_size": ranks,
               "lora": LORA if lora else None}
    recipe = TrainerRecipe(trainer=trainer, model=model,
                           algo={"_target_": "orchestrator.algo.grpo.GRPO"}, torch_threads=1)
    engine = Engine.remote()  # type: ignore[attr-defined]
    groups = batch(count=count)
    times, gathers, publishes, pulls = [], [], [], []
    nbytes = 0
    with RayLauncher(num_engines=1, placement="spread", trainer_ranks=ranks,
                     engine={"num_cpus": 0.01, "resources": {HEAD: 0.5}},
                     trainer={"num_cpus": 1, "resources": {"trainer_node": 1}}) as launcher:
        group = launcher.trainer(recipe)
        anyio.run(group.weights)  # the engines' start (with LoRA: base weights and adapters)
        for step in range(WARMUP + steps):
            started = time.perf_counter()
            anyio.run(group.step, groups)
            took = time.perf_counter() - started
            started = time.perf_counter()
            update = anyio.run(group.weights)
            published = time.perf_counter() - started
            pulled = ray.get(engine.pull.remote(update))
            if step >= WARMUP:
                times.append(took)
                gathers.append(update.stats.get("gather_seconds", 0.0))
                publishes.append(published)
                pulls.append(pulled)
            nbytes = update.nbytes
            del update
    ray.kill(engine)
    hidden, layers, ffn = model["hidden_size"], model["num_layers"], model["intermediate_size"]
    # attention (q, k, v, o), MLP, two norms per layer; the tied embedding (103 characters)
    params = layers * (4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden) + 103 * hidden + hidden
    return Row(ranks, lora, statistics.median(times), statistics.median(gathers),
               statistics.median(publishes), statistics.median(pulls), nbytes, params)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Trainer step time at 1 and 2 FSDP2 ranks.")
    parser.add_argument("--quick", action="store_true", help="one measured step per row")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per row")
    parser.add_argument("--groups", type=int, default=None,
                        help=f"groups of {GROUP_SIZE} in the fixed global batch ({GROUPS}; "
                             f"--smoke {SMOKE_GROUPS})")
    add_address(parser)
    add_smoke(parser)
    args = parser.parse_args(argv)
    steps = args.steps or (1 if args.quick or args.smoke else 4)
    groups = args.groups or (SMOKE_GROUPS if args.smoke else GROUPS)
    model = SMOKE_MODEL if args.smoke else MODEL
    load_before = os.getloadavg()
    print(f"model: Llama hidden {model['hidden_size']}, {model['num_layers']} layers, FFN "
          f"{model['intermediate_size']}, float32; batch {groups} groups x {GROUP_SIZE} "
          f"(prompt {PROMPT_TOKENS}, completions {COMPLETION_TOKENS[0]}-{COMPLETION_TOKENS[1]} "
          f"tokens); {steps} steps after {WARMUP} warm-up; load average "
          f"{' '.join(f'{x:.2f}' for x in load_before)}", flush=True)
    # glibc's per-thread arenas grow a torch process's memory by GBs; the cluster's processes
    # inherit this (the machine's memory is shared with everything else running on it)
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")
    rows = []
    with connected("trainer_scaling", args.address, 2, "trainer_node", OBJECT_STORE_BYTES):
        for ranks, lora in ((1, False), (2, False), (2, True)):
            t0 = time.perf_counter()
            row = measure(ranks, lora, steps, groups, model)
            rows.append(row)
            print(f"ranks={ranks} {'lora' if lora else 'full'}: step {row.step:.2f} s, gather "
                  f"{row.gather:.2f} s, gather+put {row.publish:.2f} s, pull {row.pull:.2f} s, "
                  f"update {row.nbytes / 1e6:.1f} MB ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    load_after = os.getloadavg()
    print(f"params ~{rows[0].params / 1e6:.2g} M; load average after "
          f"{' '.join(f'{x:.2f}' for x in load_after)}")
    print(f"{'ranks':>5} {'mode':>5} {'step_s':>7} {'speedup':>7} {'gather_s':>8} "
          f"{'gather+put_s':>12} {'pull_s':>6} {'update_MB':>9}")
    base = rows[0].step
    for r in rows:
        print(f"{r.ranks:>5} {'lora' if r.lora else 'full':>5} {r.step:>7.2f} "
              f"{base / r.step:>7.2f} {r.gather:>8.2f} {r.publish:>12.2f} {r.pull:>6.2f} "
              f"{r.nbytes / 1e6:>9.2f}")
    headline("trainer_scaling_2", rows[0].step / rows[1].step, 3)


if __name__ == "__main__":
    main()
