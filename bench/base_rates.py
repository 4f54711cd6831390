"""How a pretrained model answers reasoning-gym tasks before any training: greedy held-out
accuracy per candidate task, through the project's own episode runner and the torch engine.

    python -m bench.base_rates [--tasks 100] [--model smollm2] [--smoke]

The RL experiment on a real model (``experiment=rg_smol``) needs a task the base model gets
right sometimes but not often (0.1-0.6): at 0 a group of samples has no signal, near 1 there
is nothing to learn. Each row is a dataset, its config, the instruction after the question and
the answer extraction; the last line is the chosen row's rate,
``base_rate_chain_sum_2_terms_1_digit=``. ``--smoke`` (seconds, the tests'): every row on the
toy model (:data:`bench.cli.TOY_MODEL`, random weights) instead of SmolLM2, 2 tasks of 4
tokens each; its rates say nothing.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from typing import Any

import anyio
import torch

from bench.cli import TOY_MODEL, add_smoke, headline
from bench.peers_trl import experiment
from envs.reasoning_gym import ReasoningGymSpec
from orchestrator.config.read import section
from orchestrator.config.schema import RolloutConfig
from orchestrator.engines.torch_engine import TorchEngine
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.models.policy import build_policy
from orchestrator.pipeline.evaluation import evaluate
from orchestrator.trace.recorder import Recorder
from orchestrator.weights.update import WeightUpdate

NUMBER = "Answer with just the number."
ONE_DIGIT_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                 "operators": ["+"], "allow_parentheses": False, "allow_negation": False}
# (label, dataset, config, instruction, answer extraction)
CANDIDATES: list[tuple[str, str, dict[str, Any], str | None, str]] = [
    ("basic_arithmetic 1-digit a+b, tagged", "basic_arithmetic", ONE_DIGIT_SUM, None, "tagged"),
    ("basic_arithmetic 1-digit a+b", "basic_arithmetic", ONE_DIGIT_SUM, NUMBER, "last_number"),
    ("basic_arithmetic 1-digit a+-b", "basic_arithmetic",
     {**ONE_DIGIT_SUM, "operators": ["+", "-"]}, NUMBER, "last_number"),
    ("basic_arithmetic 2-digit a+b", "basic_arithmetic",
     {**ONE_DIGIT_SUM, "max_digits": 2}, NUMBER, "last_number"),
    ("chain_sum 2 terms 1 digit", "chain_sum",
     {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, NUMBER, "last_number"),
    ("chain_sum 3 terms 1 digit", "chain_sum",
     {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1}, NUMBER, "last_number"),
    ("leg_counting 1-2 animals", "leg_counting", {"min_animals": 1, "max_animals": 2}, NUMBER,
     "last_number"),
]
CHOSEN = "chain_sum 2 terms 1 digit"


async def rate(engine: TorchEngine, tokenizer: Any, spec: ReasoningGymSpec, tasks: int,
               max_tokens: int) -> float:
    rollout = RolloutConfig(group_size=1, max_tokens=max_tokens, temperature=0.0)
    runner = EpisodeRunner(engine, tokenizer, spec, rollout, Recorder())
    return (await evaluate(runner, spec.tasks("eval")[:tasks])).mean


def model_node(args: argparse.Namespace) -> dict[str, Any]:
    """The pretrained model ``--model`` names, or with ``--smoke`` the toy model."""
    if args.smoke:
        return {**section(experiment(*TOY_MODEL), "model"), "device": "cpu"}
    return {"_target_": "orchestrator.models.policy.pretrained_policy", "gguf": args.model,
            "path": None, "dtype": "float32", "device": "cpu"}


async def measure(args: argparse.Namespace) -> float:
    """Every candidate's rate, printed; returns the chosen one's."""
    model = model_node(args)
    policy = build_policy(model)
    chosen = math.nan
    async with TorchEngine(model, WeightUpdate.of_module(0, policy.model),
                           max_batch_size=args.tasks) as engine:
        for label, dataset, config, instruction, answer in CANDIDATES:
            spec = ReasoningGymSpec(dataset, config, train_size=8, eval_size=args.tasks,
                                    seed=0, ascii_only=False, instruction=instruction,
                                    answer=answer)
            started = time.perf_counter()
            value = await rate(engine, policy.tokenizer, spec, args.tasks, args.max_tokens)
            print(f"{label:40s} greedy={value:.3f}  ({time.perf_counter() - started:.0f} s)",
                  flush=True)
            if label == CHOSEN:
                chosen = value
    return chosen


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--model", default="smollm2", help="model.gguf: smollm2 or a .gguf path")
    parser.add_argument("--threads", type=int, default=2)
    add_smoke(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.tasks, args.max_tokens = 2, 4
    torch.set_num_threads(args.threads)
    chosen = anyio.run(measure, args)
    headline(f"base_rate_{CHOSEN.replace(' ', '_')}", chosen)


if __name__ == "__main__":
    main()
