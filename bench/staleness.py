"""Throughput against bounded staleness: the real pipeline, the simulated engine, a fixed-cost
trainer (the simulated trainer, :func:`bench.fixed_trainer.fixed_cost_trainer`).

Model. Every sample's length is log-normal (median ``MEDIAN_TOKENS``, sigma ``SIGMA``, capped
at ``MAX_TOKENS`` = 20x the median): about 1% of samples pass 15x the median and a batch of 64
usually holds one past 10x, as RLVR rollouts do. The engine decodes at a fixed
``seconds_per_token`` with ``max_concurrency = batch_size`` slots: exactly one batch decodes at
once, so the synchronous baseline is never short of slots, and extra in-flight samples queue
as they would in vLLM. The trainer sleeps a fixed time per step (in a worker thread), set to a
multiple of the median sample's decode time so that the synchronous run spends most of its wall time
generating (about 2/3, as reported for long-tailed RLVR); ``--train-medians`` changes it.

Why asynchrony helps. With ``k = 0`` a step cannot start until the slowest sample of its batch
ends, and nothing decodes while the trainer runs: engine slots idle behind the tail, then
behind the trainer. With ``k > 0`` admission lets the next ``k`` batches start, so their
generation overlaps training and the tail of earlier ones; the trainer takes the first groups
to finish, and a long group lands in a later batch (it is staler, up to ``k``). The step time
tends to ``max(train time, batch_size * mean length / slots)`` instead of their sum plus the
tail, so the speed-up is bounded by about ``(tail + train) / train``. The trainer takes the
oldest fresh groups first, yet a group in the far tail can still outlive ``k`` train steps and
be dropped; here drops cost engine time only, since generation outpaces the trainer.

Every ``k`` runs the same :class:`~orchestrator.pipeline.pipeline.Pipeline` code with the same
parameters (including ``num_workers``, sized so admission, not workers, bounds ``k = 4``).

Limits. Decoding cost per token does not grow with the number of busy slots, weight sync is
free, there are no tool calls, and the trainer's cost does not depend on the batch's tokens,
so the numbers show the scheduling effect only, not a real engine's; timings include the
event loop's own overhead on this machine.

Sizes: 40 steps a ``k`` at a median sample of 40 ms; ``--quick`` 12 steps at 30 ms;
``--smoke`` (the tests', seconds) 4 steps at 5 ms, where the event loop's overhead is a large
part of a step: it checks the bench runs end to end, its figures say nothing. Last line:
``speedup_k2_vs_sync=<k = 2 samples/s over k = 0's>``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import anyio

from bench.cli import add_smoke, headline
from bench.fixed_trainer import fixed_cost_trainer
from envs.registry import make_spec
from orchestrator.config.schema import PipelineConfig, RolloutConfig
from orchestrator.engines.simulated import SimulatedEngine
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.models.tokenizer import CharTokenizer
from orchestrator.pipeline.pipeline import Pipeline, TaskSampler
from orchestrator.staleness import admission_budget
from orchestrator.trace.recorder import Recorder

MEDIAN_TOKENS = 64
SIGMA = 1.2
MAX_TOKENS = 20 * MEDIAN_TOKENS
GROUP_SIZE = 8
BATCH_SIZE = 64
KS = (0, 1, 2, 4)


@dataclass(frozen=True)
class Result:
    k: int
    samples: int
    wall: float
    wait_batch: float
    staleness_mean: float
    dropped: int
    lengths: tuple[int, ...]

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall


async def run_one(k: int, steps: int, seconds_per_token: float, train_seconds: float,
                  seed: int) -> Result:
    engine = SimulatedEngine(
        median_tokens=MEDIAN_TOKENS, sigma=SIGMA, seconds_per_token=seconds_per_token,
        chunk_tokens=32, max_concurrency=BATCH_SIZE, seed=seed,
    )
    spec = make_spec("arithmetic")
    config = PipelineConfig(
        batch_size=BATCH_SIZE, max_staleness=k, num_steps=steps,
        num_workers=admission_budget(BATCH_SIZE, max(KS)) // GROUP_SIZE,
    )
    recorder = Recorder()
    runner = EpisodeRunner(engine, CharTokenizer(), spec,
                           RolloutConfig(group_size=GROUP_SIZE, max_tokens=MAX_TOKENS), recorder)
    pipeline = Pipeline(config, runner, fixed_cost_trainer(train_seconds),
                        TaskSampler(spec.tasks("train"), seed=seed))
    started = time.perf_counter()
    reports = await pipeline.run()
    wall = time.perf_counter() - started
    staleness = [s for r in reports for s in r.staleness]
    return Result(
        k=k,
        samples=sum(r.samples for r in reports),
        wall=wall,
        wait_batch=sum(s.duration for s in recorder.of("wait_batch")),
        staleness_mean=statistics.fmean(staleness),
        dropped=reports[-1].dropped_total,
        lengths=tuple(s.attributes["completion_tokens"] for s in recorder.of("generate")
                      if "completion_tokens" in s.attributes),
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Pipeline throughput against max_staleness.")
    parser.add_argument("--quick", action="store_true", help="fewer steps, a faster clock")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="train steps per k")
    parser.add_argument("--train-medians", type=float, default=8.0,
                        help="trainer step cost, in median-sample decode times")
    add_smoke(parser)
    args = parser.parse_args(argv)
    steps = args.steps or (4 if args.smoke else 12 if args.quick else 40)
    median_seconds = 0.005 if args.smoke else 0.03 if args.quick else 0.04
    seconds_per_token = median_seconds / MEDIAN_TOKENS
    train_seconds = args.train_medians * median_seconds
    print(f"batch={BATCH_SIZE} group={GROUP_SIZE} steps={steps} slots={BATCH_SIZE} "
          f"median={MEDIAN_TOKENS} tok ({median_seconds * 1e3:.0f} ms) sigma={SIGMA} "
          f"max_tokens={MAX_TOKENS} train_step={train_seconds * 1e3:.0f} ms")
    results = [
        anyio.run(partial(run_one, k, steps, seconds_per_token, train_seconds, args.seed))
        for k in KS
    ]
    lengths = sorted(n for r in results for n in r.lengths)
    p50 = statistics.median(lengths)
    p99 = lengths[int(0.99 * (len(lengths) - 1))]
    print(f"sample lengths: n={len(lengths)} p50={p50:.0f} p99={p99} max={lengths[-1]} "
          f"max/p50={lengths[-1] / p50:.1f}")
    print(f"{'k':>2} {'samples/s':>10} {'wait_batch':>10} {'staleness':>9} {'dropped':>7} "
          f"{'wall_s':>7}")
    for r in results:
        print(f"{r.k:>2} {r.samples_per_s:>10.1f} {r.wait_batch / r.wall:>10.2f} "
              f"{r.staleness_mean:>9.2f} {r.dropped:>7} {r.wall:>7.1f}")
    sync, k2 = (next(r for r in results if r.k == k) for k in (0, 2))
    headline("speedup_k2_vs_sync", k2.samples_per_s / sync.samples_per_s, 2)


if __name__ == "__main__":
    main()
