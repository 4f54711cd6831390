"""SmolLM2-135M-Instruct on a GPU: the torch engine's tokens/s, and the trainer's tokens/s and
its fraction of the GPU's bf16 peak (``scripts/test_gpu.sh`` runs it; CUDA only, but for
``--smoke``, below).

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

Last line: ``gpu_trainer_peak_fraction=<value>`` (mixed precision). Without a CUDA device it
refuses in one line (exit 3), except ``--smoke`` (seconds, the tests'): every step above on
the toy model (:data:`bench.cli.TOY_MODEL`) instead of SmolLM2, on the GPU where there is one,
else on the CPU (the peak then a 256-wide bf16 product on the CPU's cores, and no host waits
to count: the host is the device), 1 and 2 sequences of 4 tokens, one timed step of one
group of 2 samples; its figures say nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Self

import anyio
import torch

from bench.cli import TOY_MODEL, add_smoke, headline, refuse
from bench.engine import torch_engine
from bench.real_model import Budget, _engine_rows, config, print_training, prompts, training
from orchestrator.config.read import section
from orchestrator.engines.base import InferenceEngine
from orchestrator.trainer.torch_trainer import TorchTrainer
from orchestrator.types import Group, SamplingParams

CONCURRENCY = (1, 8, 32, 64)


def bf16_peak(size: int = 8192, repeats: int = 10, device: str = "cuda") -> float:
    """FLOP/s of a bf16 matrix product of ``size`` on ``device`` (the current GPU)."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - started)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


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


def syncs(budget: Budget, device: str = "cuda") -> None:
    """Host waits in a round of 8 sequences x ``decode_tokens`` (the train step's are counted
    by :func:`main`)."""
    if not device.startswith("cuda"):
        print("host waits: none to count (the model runs on the host)", flush=True)
        return
    model = {**section(config(*budget.model), "model"), "device": device}
    prompt = prompts(*budget.model)[:8]

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
    """Host waits in one more train step, on the last batch (none to count on the CPU)."""
    if not torch.cuda.is_available():
        return {"syncs": math.nan}
    with HostSyncs() as waits:
        trainer.train_step(batches[-1])
    return {"syncs": waits.count}


def generation(budget: Budget, device: str = "cuda") -> None:
    ids = prompts(*budget.model)
    model = section(config(*budget.model), "model")
    print(f"{'engine':<14} {'seqs':>5} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for dtype in ("bfloat16", "float32"):
        node = {**model, "device": device, "dtype": dtype}
        engine = torch_engine(node, None, 0, max_batch_size=max(budget.concurrency))
        for r in anyio.run(_engine_rows, f"torch-{dtype}", engine, ids, budget):
            print(f"{r['engine']:<14} {r['concurrency']:>5} {r['prefill_tokens_per_s']:>14.1f} "
                  f"{r['decode_tokens_per_s']:>13.1f}", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed training steps")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    add_smoke(parser)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        refuse("gpu", "it needs a CUDA device; none is visible (--smoke runs it on the CPU)")
    device = "cuda" if cuda else "cpu"
    quick = args.quick
    steps = 1 if args.smoke else 2 if quick else args.steps
    print(f"{torch.cuda.get_device_name() if cuda else 'CPU (no CUDA device)'}, torch "
          f"{torch.__version__}" + (", the toy model" if args.smoke else ""), flush=True)
    size = 8192 if cuda else 256
    peak = bf16_peak(size, device=device)
    print(f"bf16 matmul {size}^3: {peak / 1e12:.3g} TFLOP/s", flush=True)
    if args.smoke:
        budget = Budget((1, 2), 4, 1, 1, steps, 1, 0, 1, False, False, model=TOY_MODEL)
        shrink: tuple[str, ...] = ("rollout.group_size=2", "pipeline.batch_size=2",
                                   "rollout.max_tokens=4")
    else:
        budget = Budget(CONCURRENCY, 32 if quick else 64, 2, 2 if quick else 3, steps, None, 0,
                        1, False, False)
        shrink = ()
    generation(budget, device)
    syncs(budget, device)
    fraction = float("nan")
    for precision in ("mixed", "fp32"):
        t = training(replace(budget, shrink=(*shrink, f"trainer.precision={precision}")),
                     threads=4 if cuda else 1, microbenchmark=False, device=device,
                     after=train_syncs)
        print(f"trainer.precision={precision}:")
        print_training(t)
        share = t["gflops"] * 1e9 / peak
        waits = (f"the host waited for the GPU {t['syncs']:.0f} times in a step"
                 if math.isfinite(t["syncs"]) else "no host waits to count on the CPU")
        print(f"  useful {t['gflops'] / 1e3:.3g} TFLOP/s (forward + backward), "
              f"{share:.4f} of the bf16 peak; {waits}", flush=True)
        if precision == "mixed":
            fraction = share
    headline("gpu_trainer_peak_fraction", fraction, 4)


if __name__ == "__main__":
    main()
