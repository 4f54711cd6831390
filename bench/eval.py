"""Evaluation's speed on a real model: through the engine's continuous batching as fast as
rollout, and what periodic evaluation costs a run.

1. **Evaluation against rollout** (``throughput``). SmolLM2-135M-Instruct
   (``experiment=dataset_smol``: ``model=smollm2``, its shipped arithmetic file, 32 tokens a
   reply, one torch thread) and one engine (``engine.*`` from the command line; the torch engine by default,
   its ``max_batch_size`` 256), built by the run's own builders
   (:func:`orchestrator.builders.environment`, :func:`orchestrator.builders.engine_of`), serves, on
   the first ``--tasks`` prompts of the file (200; 12 with ``--quick``), at temperature 1:

   * **rollout**: groups of ``--n`` (16) episodes through :meth:`EpisodeRunner.group`, as the
     pipeline's rollout workers run them, with enough workers to fill the engine's batch
     (``max_batch_size / n`` groups at a time; no trainer, so nothing throttles them);
   * **evaluation**: :func:`orchestrator.pipeline.evaluation.evaluate` with ``eval.n = n``: every
     sample of every task handed to the engine at once, scored into an ``Evaluation``.

   A few samples first warm the engine (its first batches, the allocator); then the passes run
   in the order rollout, evaluation, evaluation, rollout (``--rounds`` times), so that a drift
   of the machine's speed (a shared machine, the engine's caches filling) weighs on both alike.
   Figures: generated tokens per second of each (tokens over seconds, summed over its passes),
   and their ratio (target >= 0.9).

2. **Periodic evaluation during RL** (``rl_cost``). Three runs of ``experiment=dataset_smol``
   (``--steps`` RL steps; 20, 3 with ``--quick`` at 16 samples a step): one with no evaluation
   during RL, and two with ``eval.every`` (5; 1 with ``--quick``) on ``eval.num_tasks``
   held-out questions (the experiment's 100; 8 with ``--quick``), greedy: on an engine of its
   own (``eval.engine=own``, the default here: one policy version) and on the rollout engine
   (``shared``). Figures: each run's RL samples/s (``summary.json``: trained samples over the
   steps' wall time; the evaluations before and after RL are outside it), the cost
   ``1 - with / without`` of each, and the evaluation's share of the tokens generated during
   RL (its samples' tokens over theirs and the trained batches'). The cost is expected to be
   at most about that share: shared, its episodes join rollout's batch; own, its engine takes
   its share of the cores.

Limits: 2 CPU cores run the engine (and in part 2 the trainer) of a 135M model; on a GPU the
engine's batch is cheaper per row and the share of the trainer larger. The rollout pass does
no training, so its tokens/s is the engine's ceiling for rollout, not a run's samples/s.

Overrides after ``--`` go to both parts' config (``-- engine=vllm engine.kv_cache_bytes=1GiB``).
``--smoke`` (seconds, the tests'): both parts on the toy model (:data:`bench.cli.TOY_MODEL`)
instead of SmolLM2: 4 prompts x 4 samples of at most 8 tokens, and three runs of 2 steps of
8 samples with ``eval.every=1`` on 4 held-out questions; its figures say nothing.
Last line: ``eval_vs_rollout_tokens=<evaluation tokens/s over rollout tokens/s>`` (with
``--parts rl`` alone, ``eval_rl_cost=``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from bench.cli import TOY_MODEL, add_smoke, headline
from envs.base import Task
from orchestrator.builders import engine_of, environment, first_tasks, run, torch_settings
from orchestrator.config.read import CONF
from orchestrator.config.run import run_config
from orchestrator.config.schema import EvalConfig
from orchestrator.engines.placement import Placement
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.pipeline.evaluation import evaluate
from orchestrator.trace.recorder import Recorder

EXPERIMENT = ["experiment=dataset_smol", "logger=none", "progress=false"]


def config(overrides: Sequence[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*EXPERIMENT, *overrides])


# -- 1. evaluation against rollout ------------------------------------------------------------


async def rollout_pass(runner: EpisodeRunner, tasks: Sequence[Task], workers: int) -> int:
    """Every task's group through ``workers`` rollout workers; the tokens generated."""
    queue = iter(tasks)
    tokens = 0

    async def worker(name: str) -> None:
        nonlocal tokens
        for task in queue:  # shared: each task once
            timed = await runner.group(task, name)
            tokens += sum(t.num_generated for t in timed.group.trajectories)

    async with anyio.create_task_group() as tg:
        for i in range(workers):
            tg.start_soon(worker, f"rollout-{i}")
    return tokens


async def eval_pass(runner: EpisodeRunner, tasks: Sequence[Task], n: int,
                    temperature: float) -> int:
    """One evaluation of ``tasks``, ``n`` samples each; the tokens generated."""
    config = EvalConfig(num_tasks=len(tasks), n=n, temperature=temperature)
    overall = (await evaluate(runner, tasks, config)).overall
    return round(overall.response_tokens * overall.samples)


def batch_size(engine: dict[str, Any]) -> int:
    """The most sequences the engine batches (torch's max_batch_size, vLLM's max_num_seqs)."""
    return int(engine.get("max_batch_size") or engine.get("max_num_seqs") or 256)


def throughput(tasks: int, n: int, rounds: int, overrides: Sequence[str]) -> dict[str, float]:
    # the experiment's torch_threads=1: steadier on a shared machine
    settings = run_config(config(overrides))
    torch_settings(settings)
    spec, tokenizer = environment(settings)
    prompts = first_tasks(spec.tasks("train"), tasks)
    recipe = replace(engine_of(settings), placement=Placement(trainer_here=False))
    temperature = 1.0
    sampling = replace(settings.rollout, group_size=n, temperature=temperature)
    workers = min(max(1, batch_size(settings.engine) // n), len(prompts))

    async def session() -> dict[str, float]:
        async with spec.running(), recipe.build(None) as engine:
            runner = EpisodeRunner(engine, tokenizer, spec, sampling, Recorder())
            await eval_pass(runner, prompts[:4], 4, temperature)  # warm-up
            totals = {"rollout_tokens": 0.0, "rollout_s": 0.0, "eval_tokens": 0.0, "eval_s": 0.0}
            for name in ("rollout", "eval", "eval", "rollout") * rounds:
                started = time.perf_counter()
                totals[f"{name}_tokens"] += await (
                    rollout_pass(runner, prompts, workers) if name == "rollout"
                    else eval_pass(runner, prompts, n, temperature))
                totals[f"{name}_s"] += time.perf_counter() - started
        return totals

    figures = anyio.run(session, backend="asyncio")
    samples = len(prompts) * n * 2 * rounds
    for name in ("rollout", "eval"):
        rate = figures[f"{name}_tokens"] / figures[f"{name}_s"]
        figures[f"{name}_tokens_per_s"] = rate
        how = (f"{workers} groups of {n} at a time" if name == "rollout"
               else f"all {len(prompts) * n} of a pass at once")
        print(f"{name:8s}: {samples} samples, {figures[f'{name}_tokens']:.0f} tokens in "
              f"{figures[f'{name}_s']:.1f} s: {rate:.0f} tokens/s ({how})", flush=True)
    return figures


# -- 2. periodic evaluation during RL -----------------------------------------------------------


def rl_cost(steps: int, every: int, eval_tasks: int, overrides: Sequence[str],
            out: Path) -> dict[str, float]:
    figures: dict[str, float] = {}
    for name, period, engine in (("without", 0, "own"), ("own", every, "own"),
                                 ("shared", every, "shared")):
        cfg = config([f"pipeline.num_steps={steps}", f"eval.num_tasks={eval_tasks}",
                      f"eval.every={period}", f"eval.engine={engine}", "checkpoint.every_s=0",
                      *overrides])
        result = run(cfg, out / name)
        figures[f"{name}_samples_per_s"] = result.summary["samples_per_s"]
        line = (f"RL {f'with eval.every={period} eval.engine={engine}' if period else 'without evaluation'}: "
                f"{len(result.reports)} steps, {result.summary['samples_per_s']:.2f} samples/s")
        if period:
            evaluations = [r.evaluation for r in result.reports if r.evaluation is not None]
            eval_tokens = sum(e.overall.response_tokens * e.overall.samples for e in evaluations)
            trained = sum(r.tokens for r in result.reports)
            figures[f"{name}_share"] = eval_tokens / max(eval_tokens + trained, 1)
            figures[f"{name}_cost"] = 1 - (figures[f"{name}_samples_per_s"]
                                           / figures["without_samples_per_s"])
            line += (f"; {len(evaluations)} evaluations of {eval_tasks} tasks finished during RL, "
                     f"{figures[f'{name}_share']:.0%} of the tokens generated during RL; "
                     f"cost {figures[f'{name}_cost']:.1%}")
        print(line, flush=True)
    return figures


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.eval",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="under 5 minutes")
    add_smoke(parser)
    parser.add_argument("--tasks", type=int, default=None, help="prompts (200; 12 quick)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rollout, eval, eval, rollout passes this many times")
    parser.add_argument("--n", type=int, default=None, help="samples per prompt (16)")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (20; 3 quick)")
    parser.add_argument("--every", type=int, default=None, help="eval.every (5; 1 quick)")
    parser.add_argument("--eval-tasks", type=int, default=None,
                        help="eval.num_tasks during RL (100; 8 quick)")
    parser.add_argument("--parts", default="throughput,rl", help="throughput, rl or both")
    parser.add_argument("overrides", nargs="*", help="config overrides (after --)")
    args = parser.parse_args(argv)
    quick, smoke = args.quick, args.smoke
    tasks = args.tasks or (4 if smoke else 12 if quick else 200)
    n = args.n or (4 if smoke else 16)
    parts = set(args.parts.split(","))
    overrides = [*TOY_MODEL, "model.device=cpu", "rollout.max_tokens=8",
                 *args.overrides] if smoke else args.overrides
    print(f"{'the toy model' if smoke else 'SmolLM2-135M-Instruct'}, experiment=dataset_smol "
          f"{' '.join(args.overrides)}".rstrip())
    ratio = None
    if "throughput" in parts:
        figures = throughput(tasks, n, args.rounds, overrides)
        ratio = figures["eval_tokens_per_s"] / figures["rollout_tokens_per_s"]
    if "rl" in parts:
        rl_overrides = (["pipeline.batch_size=8", "rollout.group_size=4", "pipeline.num_workers=4"]
                        if smoke else ["pipeline.batch_size=16"] if quick else [])
        with tempfile.TemporaryDirectory(prefix="bench-eval-") as out:
            cost = rl_cost(args.steps or (2 if smoke else 3 if quick else 20),
                           args.every or (1 if smoke or quick else 5),
                           args.eval_tasks or (4 if smoke else 8 if quick else 100),
                           [*rl_overrides, *overrides], Path(out))
        print(f"eval_rl_cost={cost['own_cost']:.3f} eval_engine_share={cost['own_share']:.3f} "
              f"eval_rl_cost_shared={cost['shared_cost']:.3f} "
              f"eval_engine_share_shared={cost['shared_share']:.3f}")
        if ratio is None:
            headline("eval_rl_cost", cost["own_cost"])
    if ratio is not None:
        headline("eval_vs_rollout_tokens", ratio)


if __name__ == "__main__":
    from orchestrator.allocator import keep_freed_memory

    keep_freed_memory()  # before any other thread allocates, as the run's entry point does
    main()
