"""How SmolLM2 answers candidate versions of ``experiment=dataset_smol``'s file before any
training: greedy held-out accuracy under ``env=dataset`` with ``env.reward=math``, per kind of
question, through the project's own episode runner and the torch engine.

    python -m bench.dataset_base_rates [--only LABEL;...] [--show 3] [--model smollm2] [--smoke]

Each candidate is a version of the generated file (``envs/data/make_arith.py``: which kinds
of one-digit question, how they are written), the instruction appended to the question and
the token budget; each is written to a temporary directory and read back by
``envs.dataset.DatasetSpec``, so the rates are the experiment's own. The RL needs a base rate
the model gets right sometimes but not often (0.1-0.6). The last line is the chosen
candidate's rate, ``base_rate_dataset_smol=`` (with ``--only`` leaving it out, the one-line
refusal: exit 3). ``--smoke`` (seconds, the tests'): the chosen candidate (unless ``--only``
names others) on the toy model (:data:`bench.cli.TOY_MODEL`, random weights) instead of
SmolLM2, 4 held-out questions of at most 4 tokens each (each candidate starts math-verify's
worker processes: a second or two); its rates say nothing.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

from bench.cli import TOY_MODEL, add_smoke, headline, refuse
from bench.peers_trl import experiment
from envs.data import make_arith
from envs.dataset import DatasetSpec, DatasetTask
from orchestrator.config.read import section
from orchestrator.config.schema import RolloutConfig
from orchestrator.engines.torch_engine import TorchEngine
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.models.policy import build_policy
from orchestrator.trace.recorder import Recorder
from orchestrator.weights.update import WeightUpdate

BOXED = "Put your final answer in \\boxed{}."
# (label, kinds, phrasing, instruction, max_tokens)
CANDIDATES: list[tuple[str, tuple[str, ...], str, str | None, int]] = [
    ("all kinds, boxed, 32 tokens", make_arith.KINDS, "ascii", BOXED, 32),
    ("all kinds, boxed, 64 tokens", make_arith.KINDS, "ascii", BOXED, 64),
    ("all kinds, just the number, 24 tokens", make_arith.KINDS, "ascii",
     "Answer with just the number.", 24),
    ("all kinds, no instruction, 32 tokens", make_arith.KINDS, "ascii", None, 32),
    ("all kinds in words, boxed, 32 tokens", make_arith.KINDS, "words", BOXED, 32),
    ("all kinds in LaTeX, boxed, 32 tokens", make_arith.KINDS, "latex", BOXED, 32),
    ("all kinds in LaTeX, boxed, 16 tokens", make_arith.KINDS, "latex", BOXED, 16),
    ("all kinds in LaTeX, boxed, 48 tokens", make_arith.KINDS, "latex", BOXED, 48),
    ("all kinds in LaTeX, just the number, 24 tokens", make_arith.KINDS, "latex",
     "Answer with just the number.", 24),
    ("all kinds in LaTeX, no instruction, 32 tokens", make_arith.KINDS, "latex", None, 32),
    ("add, sub in LaTeX, boxed, 32 tokens", ("add", "sub"), "latex", BOXED, 32),
]
CHOSEN = "all kinds in LaTeX, boxed, 32 tokens"


async def rate(engine: TorchEngine, tokenizer: Any, spec: DatasetSpec, max_tokens: int,
               show: int) -> tuple[float, dict[str, float]]:
    """Mean greedy reward over the eval split, and per kind."""
    rollout = RolloutConfig(group_size=1, max_tokens=max_tokens, temperature=0.0)
    runner = EpisodeRunner(engine, tokenizer, spec, rollout, Recorder())
    by_kind: dict[str, list[float]] = defaultdict(list)
    shown: dict[str, int] = defaultdict(int)

    async def one(task: DatasetTask) -> None:
        trajectory, _ = await runner.episode(task, "eval")
        kind = task.metadata["extra_info"]["kind"]
        by_kind[kind].append(trajectory.reward)
        if shown[kind] < show:
            shown[kind] += 1
            reply = [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask, strict=True) if m]
            print(f"    {kind} {task.answer!r} {trajectory.reward:.0f}: "
                  f"{tokenizer.decode(reply)!r}", flush=True)

    async with spec.running(), anyio.create_task_group() as tg:
        for task in spec.tasks("eval"):
            assert isinstance(task, DatasetTask)
            tg.start_soon(one, task)
    every = [r for rewards in by_kind.values() for r in rewards]
    return sum(every) / len(every), {k: sum(v) / len(v) for k, v in sorted(by_kind.items())}


async def measure(args: argparse.Namespace) -> float:
    """Every candidate's rate (of those ``--only`` names), printed; returns the chosen one's
    (nan when it was left out)."""
    model = model_node(args)
    policy = build_policy(model)
    only = set(args.only.split(";")) if args.only else None
    chosen = math.nan
    async with TorchEngine(model, WeightUpdate.of_module(0, policy.model),
                           max_batch_size=args.eval) as engine:
        for label, kinds, phrasing, instruction, max_tokens in CANDIDATES:
            if only is not None and label not in only:
                continue
            with tempfile.TemporaryDirectory() as tmp:
                paths = make_arith.write(Path(tmp), kinds, phrasing, train=len(kinds),
                                         eval=args.eval, seed=0)
                spec = DatasetSpec(train=str(paths["train"]), eval=str(paths["eval"]),
                                   instruction=instruction, reward="math")
                started = time.perf_counter()
                value, per_kind = await rate(engine, policy.tokenizer, spec,
                                             min(max_tokens, args.max_tokens or max_tokens),
                                             args.show)
            kinds_text = "  ".join(f"{k} {v:.2f}" for k, v in per_kind.items())
            print(f"{label:42s} greedy={value:.3f}  ({kinds_text}; "
                  f"{time.perf_counter() - started:.0f} s)", flush=True)
            if label == CHOSEN:
                chosen = value
    return chosen


def model_node(args: argparse.Namespace) -> dict[str, Any]:
    """The pretrained model ``--model`` names, or with ``--smoke`` the toy model."""
    if args.smoke:
        return {**section(experiment(*TOY_MODEL), "model"), "device": "cpu"}
    return {"_target_": "orchestrator.models.policy.pretrained_policy", "gguf": args.model,
            "path": None, "dtype": "float32", "device": "cpu"}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval", type=int, default=100, help="held-out questions a candidate")
    parser.add_argument("--only", default="", help="labels separated by ; (default: all)")
    parser.add_argument("--show", type=int, default=0, help="replies printed per kind")
    parser.add_argument("--model", default="smollm2", help="model.gguf: smollm2 or a .gguf path")
    parser.add_argument("--threads", type=int, default=2)
    add_smoke(parser)
    args = parser.parse_args(argv)
    args.max_tokens = 4 if args.smoke else None  # a cap on each candidate's budget
    if args.smoke:
        args.eval, args.only = 4, args.only or CHOSEN
    torch.set_num_threads(args.threads)
    chosen = anyio.run(measure, args)
    if math.isnan(chosen):
        refuse("dataset_base_rates", f"--only left out the chosen candidate ({CHOSEN!r})")
    headline("base_rate_dataset_smol", chosen)


if __name__ == "__main__":
    main()
