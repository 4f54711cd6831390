"""SmolLM2-135M-Instruct on a GPU: the torch engine's tokens/s, and the trainer's tokens/s and
its fraction of the GPU's bf16 peak (``scripts/test_gpu.sh`` runs it; CUDA only).

1. **Peak**: the rate of an 8192 x 8192 x 8192 bf16 matrix product on this GPU (the mean of
   10 after 3 warm-ups), the ceiling the trainer's rate is compared with.
2. **Generation**: ``bench.real_model``'s generation rounds (``experiment=rg_smol``'s
   prompts, prefill and decode apart, best of the rounds) for the torch engine with the model
   in bf16 and in float32, at 1, 8, 32 and 64 concurrent sequences. vLLM is not measured here
   (its GPU wheel is not installed where this ran; ``bench.real_model`` measures it where it is).
3. **Training**: ``bench.real_model``'s training part on the GPU (the trainer
   ``experiment=rg_smol`` builds, batches of 4 x 8 sampled by the engine, two untimed steps,
   then ``--steps`` timed) under ``trainer.precision=mixed`` and ``fp32``: batch tokens/s,
   the useful TFLOP/s (``bench.flops``' count) and their fraction of the measured peak.

Small model, small batches: a 135 M-parameter model with ~1,500 tokens a step is far from
what saturates an H100; the figures say what this code does with the model the project's
experiments use, and where the time goes, not what a GPU can do with a 7 B model.

Last line: ``gpu_trainer_peak_fraction=<value>`` (mixed precision).
"""

from __future__ import annotations

import argparse
import contextlib
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Self

import anyio
import torch

from bench.engine import torch_engine
from bench.real_model import Budget, _engine_rows, config, print_training, prompts, training
from orchestrator.config import section
from orchestrator.engines.base import InferenceEngine
from orchestrator.trainer.torch_trainer import TorchTrainer
from orchestrator.types import Group, SamplingParams

CONCURRENCY = (1, 8, 32, 64)


def bf16_peak(size: int = 8192, repeats: int = 10) -> float:
    """FLOP/s of a bf16 matrix product of ``size`` on the current GPU."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - started)


class HostSyncs:
    """Counts, inside ``with``, the times the host waited for the GPU (CUDA's sync debug
    mode: an item(), a blocking copy, a nonzero, a synchronize), from any thread."""

    def __init__(self) -> None:
        self.count = 0
        self._caught: contextlib.AbstractContextManager[Any] = warnings.catch_warnings(record=True)

    def __enter__(self) -> Self:
        torch.cuda.synchronize()
        self._records = self._caught.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._caught.__exit__(*exc)
        self.count = sum("synchroniz" in str(w.message) for w in self._records)


def syncs(budget: Budget) -> None:
    """Host waits in a round of 8 sequences x ``decode_tokens`` (the train step's are counted
    by :func:`main`)."""
    model = {**section(config(), "model"), "device": "cuda"}
    prompt = prompts()[:8]

    sampling = SamplingParams(max_tokens=budget.decode_tokens, temperature=1.0)

    async def round_of(engine: InferenceEngine) -> None:
        async with anyio.create_task_group() as tg:
            for ids in prompt:
                tg.start_soon(engine.generate, ids, sampling)

    async def generate() -> int:
        async with torch_engine(model, None, 0, max_batch_size=8) as engine:
            await round_of(engine)  # warm-up
            with HostSyncs() as waits:
                await round_of(engine)
        return waits.count

    print(f"host waits: engine {anyio.run(generate)} in {budget.decode_tokens} steps",
          flush=True)


def train_syncs(trainer: TorchTrainer, batches: list[list[Group]]) -> dict[str, float]:
    """Host waits in one more train step, on the last batch."""
    with HostSyncs() as waits:
        trainer.train_step(batches[-1])
    return {"syncs": waits.count}


def generation(budget: Budget) -> None:
    ids = prompts()
    model = section(config(), "model")
    print(f"{'engine':<14} {'seqs':>5} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for dtype in ("bfloat16", "float32"):
        node = {**model, "device": "cuda", "dtype": dtype}
        engine = torch_engine(node, None, 0, max_batch_size=max(budget.concurrency))
        for r in anyio.run(_engine_rows, f"torch-{dtype}", engine, ids, budget):
            print(f"{r['engine']:<14} {r['concurrency']:>5} {r['prefill_tokens_per_s']:>14.1f} "
                  f"{r['decode_tokens_per_s']:>13.1f}", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed training steps")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu needs a CUDA device; none is visible")
    quick = args.quick
    steps = 2 if quick else args.steps
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    peak = bf16_peak()
    print(f"bf16 matmul 8192^3: {peak / 1e12:.0f} TFLOP/s", flush=True)
    budget = Budget(CONCURRENCY, 32 if quick else 64, 2, 2 if quick else 3, steps, None, 0, 1,
                    False, False)
    generation(budget)
    syncs(budget)
    fraction = float("nan")
    for precision in ("mixed", "fp32"):
        t = training(replace(budget, shrink=(f"trainer.precision={precision}",)), threads=4,
                     microbenchmark=False, device="cuda", after=train_syncs)
        print(f"trainer.precision={precision}:")
        print_training(t)
        share = t["gflops"] * 1e9 / peak
        print(f"  useful {t['gflops'] / 1e3:.2f} TFLOP/s (forward + backward), "
              f"{share:.4f} of the bf16 peak; the host waited for the GPU {t['syncs']:.0f} "
              f"times in a step", flush=True)
        if precision == "mixed":
            fraction = share
    print(f"gpu_trainer_peak_fraction={fraction:.4f}")


if __name__ == "__main__":
    main()
