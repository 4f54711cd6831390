"""Engine/trainer log-prob agreement under each precision combination, on SmolLM2-135M-Instruct.

The trainer's importance ratios compare its log-probs with the engine's on the same weights;
every difference between the two (dtype, kernels, the LM head's rounding) is noise in the
ratio. This measures ``engine/logprob_diff`` (mean and max |engine - trainer| over sampled
tokens, as the trainer reports it) for each combination of:

* the engine's weights: ``float32`` or ``bfloat16`` (``model.dtype``);
* the trainer's ``trainer.precision``: ``fp32``, ``mixed`` (fp32 master weights, bf16
  autocast) or ``bf16``;
* ``model.fp32_head`` (the LM head in float32 on both sides) off or on.

Workload: ``experiment=rg_smol``'s train prompts through the chat template, ``--prompts``
of them x 4 samples at temperature 1, ``--tokens`` tokens each, sampled once per engine
setting by the torch engine (seed 0); the trainer scores the same tokens with the engine's
starting weights (the converted GGUF, float32 on disk). ``--device cuda`` runs it on a GPU
(``scripts/test_gpu.sh`` does). Last line: ``logprob_diff_bf16_fp32_head=<mean>``, the
engine in bf16 against the ``mixed`` trainer with the fp32 head (the GPU defaults that
docs/gpu.md recommends from this table). ``--quick``: 4 prompts, 16 tokens. ``--smoke``
(seconds, the tests'): every combination on the toy model (:data:`bench.cli.TOY_MODEL`,
random weights) instead of SmolLM2, 2 prompts x 4 samples x 4 tokens; its figures say
nothing about SmolLM2.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import anyio
import torch

from bench.cli import TOY_MODEL, add_smoke, headline, refuse
from bench.peers_trl import base_args, experiment
from bench.real_model import EXPERIMENT, prompts
from orchestrator.algo.grpo import GRPO
from orchestrator.config.read import section
from orchestrator.engines.torch_engine import TorchEngine
from orchestrator.models.policy import build_policy
from orchestrator.trainer.batch import token_batch
from orchestrator.trainer.logprobs import LogprobAgreement
from orchestrator.trainer.torch_trainer import TorchTrainer
from orchestrator.types import Generation, SamplingParams

PRECISIONS = ("fp32", "mixed", "bf16")
ENGINE_DTYPES = ("float32", "bfloat16")


def node(device: str, dtype: str, fp32_head: bool, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The experiment's model (``overrides``: of the experiment, the toy model's) on ``device``
    in ``dtype``."""
    model = section(experiment(*overrides, base=base_args(EXPERIMENT)), "model")
    return {**model, "device": device, "dtype": dtype, "fp32_head": fp32_head}


def sample(model: dict[str, Any], ids: Sequence[list[int]], samples: int,
           tokens: int) -> list[tuple[list[int], Generation]]:
    sampling = SamplingParams(max_tokens=tokens, temperature=1.0)

    async def run() -> list[tuple[list[int], Generation]]:
        out: list[tuple[list[int], Generation]] = []
        async with TorchEngine(model, None, max_batch_size=len(ids) * samples, seed=0) as engine:

            async def one(prompt: list[int]) -> None:
                out.append((prompt, await engine.generate(prompt, sampling)))

            async with anyio.create_task_group() as tg:
                for prompt in ids:
                    for _ in range(samples):
                        tg.start_soon(one, prompt)
        return out

    return anyio.run(run)


def agreement(model: dict[str, Any], precision: str,
              sampled: Sequence[tuple[list[int], Generation]]) -> tuple[float, float]:
    policy = build_policy({**model, "dtype": "float32"})  # the trainer's: as stored
    trainer = TorchTrainer(policy, GRPO(), precision=precision, micro_batch_size=16)
    sequences = [prompt + list(g.token_ids) for prompt, g in sampled]
    masks = [[False] * len(prompt) + [True] * len(g.token_ids) for prompt, g in sampled]
    behaviour = [[0.0] * len(prompt) + list(g.logprobs) for prompt, g in sampled]
    batch = token_batch(sequences, masks, policy.tokenizer.pad_id, behaviour=behaviour,
                        on_policy=masks)
    found = LogprobAgreement()
    with torch.no_grad():
        for part in trainer._micro_batches(batch):
            found.add(trainer._logprobs(part)[0], part)
    found.settle()
    return found.total / found.count, found.max


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="4 prompts, 16 tokens")
    add_smoke(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.tokens = 4, 16
    model = TOY_MODEL if args.smoke else ()
    if args.smoke:
        args.prompts, args.tokens = 2, 4
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        refuse("precision", f"--device {args.device}: no CUDA device is visible")
    ids = prompts(*model)[: args.prompts]
    print(("toy model" if args.smoke else "SmolLM2-135M-Instruct") + f", device {args.device}"
          + (f" ({torch.cuda.get_device_name(args.device)})" if args.device.startswith("cuda")
             else f" ({torch.get_num_threads()} threads)")
          + f"; {len(ids)} prompts x 4 samples x {args.tokens} tokens", flush=True)
    print(f"{'engine':<9} {'trainer':<7} {'fp32 head':<9} {'mean':>9} {'max':>9}")
    rows: dict[tuple[str, str, bool], float] = {}
    for head in (False, True):
        for dtype in ENGINE_DTYPES:
            sampled = sample(node(args.device, dtype, head, model), ids, 4, args.tokens)
            for precision in PRECISIONS:
                mean, worst = agreement(node(args.device, dtype, head, model), precision, sampled)
                rows[dtype, precision, head] = mean
                print(f"{dtype:<9} {precision:<7} {head!s:<9} {mean:>9.2e} {worst:>9.2e}",
                      flush=True)
    headline("logprob_diff_bf16_fp32_head", rows["bfloat16", "mixed", True], spec=".3g")


if __name__ == "__main__":
    main()
