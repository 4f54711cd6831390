"""This project side by side with Hugging Face TRL's ``GRPOTrainer``: same model, weights, task,
hyper-parameters and cores, on CPU.

Three runs, one after the other, each in a process of its own, all from the same weights:

1. **The warm start** (once, in this process): the default experiment's supervised warm start
   (``experiment=arithmetic``: until greedy accuracy on 128 train tasks reaches 0.3, checked
   every 10 steps), through :func:`orchestrator.builders.training_parts`, the run loop's own warm
   start. Its weights are saved in ``<out>/warmstart/`` as a Hugging Face directory (the tiny
   Llama's ``config.json`` and ``model.safetensors``, plus the character tokenizer wrapped by
   :func:`bench.peers_trl.char_tokenizer_fast`, so ``model=hf model.path=<out>/warmstart
   model.dtype=float32`` loads it too). The RL runs start from these weights with fresh
   optimisers, as the default experiment's RL does (its warm start has an optimiser of its
   own).
2. **This project at k = 0 and k = 1**: ``python -m orchestrator`` with the default experiment
   and ``pipeline.max_staleness=<k>``, ``warmstart.steps=0``, ``eval.num_tasks=0`` (evaluation
   happens afterwards, below), ``logger=none``, ``progress=false``, ``checkpoint.every=<every>``
   (the default, 20) with every checkpoint kept, and ``model._target_=bench.peers_trl.warm_policy
   +model.weights=<warm start>``: the ``model=tiny`` policy (same config, eager attention,
   the character tokenizer) with the warm start's weights loaded. (``model=hf`` on the saved
   directory would also work, but it is not the default experiment's model: transformers
   picks SDPA attention, and ``HFTokenizer`` renders a prompt through the Jinja template in
   ~65 us where ``CharTokenizer`` takes ~1 us.) ``torch_threads=1`` is the
   experiment's own: the engine and the trainer take a core each. RL wall time and the reward
   curve come from ``metrics.jsonl`` (``time/step`` summed: from the pipeline's start to the
   last step's report, so set-up is excluded; the periodic checkpoints, which the default
   experiment also writes, are inside it).
3. **TRL** (``python -m bench.peers_trl``; its settings, and why, are in that module's
   docstring): ``GRPOTrainer`` on the same policy and tokenizer (prompts token-identical),
   the environment's ``exact_match`` as the reward, 16 prompts x 4 samples per step, the
   project's optimiser and warm-up, ``torch.set_num_threads(2)`` (``--trl-threads``); weights
   are copied in memory every ``<every>`` steps with their time.

Then, outside every timed region, each run's saved weights (and the warm start, at time 0) are
evaluated by the project's greedy evaluation (:func:`orchestrator.pipeline.evaluation.evaluate`, the
same engine and the same 200 eval-split tasks for all three): held-out accuracy against RL
wall time. The time to ``--target`` (0.8) is that of the first evaluated snapshot at or above
it (a resolution of ``<every>`` steps); a run that never gets there is reported with the best
accuracy it reached.

The FLOP bound: a step's FLOPs (the trainer's forward and backward, ``6 x N x tokens``, plus
the rollouts' forward passes, ``2 x N x tokens``, where ``N`` counts the weights of every
matrix multiply: the layers' and the LM head, not the embedding lookup; tokens are the
batch's real ones, prompt + completion, the mean completion length taken from the k = 1 run;
plus causal attention) over the rate a matmul microbenchmark of the model's own shapes
sustains on this machine (``torch.nn.functional.linear`` and the two backward products of
every layer at the trainer's token count, the prefill's and the decode's, float32; the better
of one process at 2 threads and twice one thread, i.e. two workers with a core each, the
project's own layout: on a busy machine 2 OpenMP threads collapse first, and a line warns
when they sustain less than 1.5x one thread): ``bound = samples per step / (step FLOPs /
sustained FLOP/s)``.

Prints a table (samples/s, time to the target, accuracy, reward over the first and last 10%
of steps), writes ``<out>/peers.png`` (reward per step, and accuracy against wall time) and
``<out>/results.json``, then ``bound_fraction=``, ``throughput_vs_trl_k0=`` and last
``speedup_vs_trl=<TRL's wall time to the target / this project's at k = 1>``. When a run does
not reach the target within its steps, the speed-up is taken at the highest accuracy all
three reached (a line says so). When that is no more than the warm start's (no run's
accuracy rose, or not every run's), there is no time to compare (each run is there at 0 s):
the speed-up is then k = 1's samples/s over TRL's, at the same batch and hyper-parameters
(equal learning per step), as ``bench.real_model`` takes it, and a line says so.
``--quick``: 100 steps per run instead of 2,000 (a few minutes in all on 2 idle cores, most
of it the warm start and TRL); the target stays 0.8, which 100 steps do not reach, so the
speed-up is then taken at a lower accuracy and says little: it is for checking that the
benchmark runs. ``--smoke`` (seconds of work, the tests'): the same three runs and their
evaluation on the toy model (:data:`bench.cli.TOY_MODEL`), 16 samples a step, a 2-step
warm start without a target, 2 RL steps a run with a snapshot after each, 8 eval tasks,
TRL on one thread (``--trl-threads``) and the FLOP bound's microbenchmark at short rounds;
its figures say nothing.

Needs TRL (``pip install -e '.[peers]'``). Limits: one seed; wall times on a shared machine;
TRL generates with ``transformers``' ``generate`` (no vLLM on CPU), which is what a CPU user
of TRL gets; the project's periodic checkpoints (model, optimiser, fsync) cost it a little
that TRL's in-memory copies do not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch
from omegaconf import DictConfig

from bench.cli import TOY_MODEL, add_smoke, headline, refuse
from bench.flops import Shapes
from bench.peers_trl import (
    BASE,
    REPO,
    NotComparable,
    RLSettings,
    arithmetic_spec,
    char_tokenizer_fast,
    experiment,
    load_weights,
)
from orchestrator.builders import training_parts
from orchestrator.config.read import build_env, scalar, section, typed
from orchestrator.config.run import run_config
from orchestrator.config.schema import RolloutConfig
from orchestrator.engines.base import sync_weights
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.launch import EngineRecipe, LocalLauncher
from orchestrator.models.policy import build_policy
from orchestrator.models.tokenizer import CharTokenizer
from orchestrator.pipeline.evaluation import evaluate
from orchestrator.trace.recorder import Recorder
from orchestrator.weights.update import WeightUpdate

STEPS, QUICK_STEPS, SMOKE_STEPS = 2000, 100, 2
# --smoke: the toy model, 16 samples a step, a 2-step warm start without a target, 8 eval tasks
SMOKE = (*TOY_MODEL, "pipeline.batch_size=16", "pipeline.num_workers=8", "warmstart.steps=2",
         "warmstart.target_accuracy=null", "eval.num_tasks=8")
SMOKE_TIMING = {"min_time": 0.002, "repeats": 2, "calls": 1}  # the FLOP bound's microbenchmark
EVERY = 20  # steps between evaluated snapshots (checkpoint.every)
TARGET = 0.8
TRL_THREADS = 2  # TRL's torch threads: both cores


# -- the warm start ----------------------------------------------------------------------------


def warm_start(out: Path, base: Sequence[str] = BASE) -> tuple[Path, dict[str, Any]]:
    """The warm start of the experiment ``base`` names (the default one), saved to ``out`` as a
    Hugging Face directory; the path of its ``model.safetensors`` and what it did."""
    from transformers.utils import logging as hf_logging

    cfg = experiment(base=base)
    parts = training_parts(run_config(cfg))
    assert parts.warm_start is not None
    recorder = Recorder()
    started = time.perf_counter()

    async def go() -> int:
        async with parts.spec.running():
            update = await parts.trainer.weights()
            engine = parts.make_engine(update, recorder)
            update.release()
            async with engine:
                runner = EpisodeRunner(engine, parts.tokenizer, parts.spec, parts.rollout, recorder)
                return await parts.warm_start(runner)

    steps = anyio.run(go)
    model = parts.trainer.policy.model  # type: ignore[attr-defined]
    shutil.rmtree(out, ignore_errors=True)
    hf_logging.disable_progress_bar()
    model.save_pretrained(out, safe_serialization=True)
    char_tokenizer_fast().save_pretrained(out)
    checks = [s.attributes.get("accuracy") for s in recorder.of("warm_start")]
    return out / "model.safetensors", {"steps": steps, "seconds": time.perf_counter() - started,
                                        "check_accuracy": checks[-1] if checks else None}


# -- the runs ----------------------------------------------------------------------------------


@dataclass
class Run:
    name: str
    rewards: list[float]  # mean training reward per step
    wall: float  # RL seconds, set-up excluded
    samples: int
    snapshots: list[tuple[int, float, Path]]  # (steps done, seconds into RL, weights)
    tokens_per_sample: float | None = None
    accuracy: list[tuple[int, float, float]] = field(default_factory=list)  # (step, seconds, acc)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall

    def time_to(self, target: float) -> float | None:
        return next((t for _, t, acc in self.accuracy if acc >= target - 1e-9), None)

    def line(self) -> str:
        return f"{self.name}: {len(self.rewards)} steps in {self.wall:.1f} s"

    @property
    def best(self) -> float:
        return max(acc for _, _, acc in self.accuracy)


def _subprocess(args: list[str], log: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    with log.open("w") as f:
        done = subprocess.run([sys.executable, *args], cwd=REPO, env=env, stdout=f,
                              stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{' '.join(args[:2])} failed (exit {done.returncode}); see {log}:\n"
                         f"{tail}")


def run_project(k: int, steps: int, every: int, out: Path, model: Sequence[str],
                base: Sequence[str] = BASE) -> Run:
    """``python -m orchestrator`` with experiment ``base`` at ``k``; ``model``: overrides of
    its model (the warm start's weights, for the default experiment)."""
    run_dir = out / f"k{k}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    _subprocess(["-m", "orchestrator", *base, f"pipeline.max_staleness={k}",
                 f"pipeline.num_steps={steps}", "warmstart.steps=0", "eval.num_tasks=0",
                 f"checkpoint.every={every}", "checkpoint.every_s=0",
                 f"checkpoint.keep={steps // every + 1}",
                 *model, f"hydra.run.dir={run_dir}"], out / f"k{k}.log")
    return read_project(run_dir, f"polyrl k={k}", every,
                        RLSettings.of(experiment(*model, base=base)))


def read_project(run_dir: Path, name: str, every: int, settings: RLSettings) -> Run:
    """A project run from its ``metrics.jsonl`` and periodic checkpoints."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = sorted((r for r in lines if "reward/mean" in r), key=lambda r: r["step"])
    ends, total = [], 0.0
    for r in records:
        total += r["time/step"]
        ends.append(total)
    checkpoints = run_dir / "checkpoints"
    last = len(records)

    def weights(n: int) -> Path:  # the last step's may be only in final/
        path = checkpoints / f"step-{n}"
        return (path if n < last or path.exists() else checkpoints / "final") / "model" / \
            "model.safetensors"

    steps = [*range(every, last + 1, every)]
    steps += [last] if last % every else []
    snapshots = [(n, ends[n - 1], weights(n)) for n in steps]
    tokens = sum(r["rollout/tokens_per_sample"] for r in records) / len(records)
    return Run(name, [r["reward/mean"] for r in records], total,
               settings.batch_size * len(records), snapshots, tokens)


def run_trl(steps: int, every: int, out: Path, threads: int = TRL_THREADS,
            weights: Path | None = None, name: str = "arithmetic",
            overrides: Sequence[str] = ()) -> Run:
    """``python -m bench.peers_trl`` on experiment ``name`` with ``overrides`` (from
    ``weights``, the tiny model's warm start, or the experiment's checkpoint)."""
    trl_dir = out / "trl"
    shutil.rmtree(trl_dir, ignore_errors=True)
    start = ["--weights", str(weights)] if weights is not None else []
    _subprocess(["-m", "bench.peers_trl", "--experiment", name, *start, "--out", str(trl_dir),
                 "--steps", str(steps), "--every", str(every), "--threads", str(threads),
                 "--", *overrides], out / "trl.log")
    return read_trl(trl_dir)


def read_trl(trl_dir: Path) -> Run:
    summary = json.loads((trl_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (trl_dir / "metrics.jsonl").read_text().splitlines()]
    snapshots = [(s["step"], s["time"], Path(s["path"])) for s in summary["snapshots"]]
    return Run(f"TRL GRPOTrainer ({summary['threads']} threads)", [r["reward"] for r in records],
               summary["rl_seconds"], summary["samples"], snapshots)


# -- evaluation (outside every timed region) ---------------------------------------------------


def evaluate_runs(runs: Sequence[Run], cfg: DictConfig) -> float:
    """Greedy accuracy of every run's snapshots (and of the weights ``cfg``'s model starts
    from, at 0 s) on the eval split, with one engine; returns the start's."""
    torch.set_num_threads(2)
    model_cfg = section(cfg, "model")
    policy = build_policy(model_cfg)
    spec = build_env(cfg)
    tasks = list(spec.tasks("eval"))[: scalar(cfg, "eval.num_tasks")]
    rollout = typed(RolloutConfig, cfg, "rollout")
    engine = LocalLauncher().engine(EngineRecipe(engine=section(cfg, "engine"), model=model_cfg),
                                    WeightUpdate.of_module(0, policy.model))
    version = 0

    async def accuracy(path: Path | None) -> float:
        nonlocal version
        if path is not None:
            version += 1
            load_weights(policy.model, path)
            await sync_weights(engine, WeightUpdate.of_module(version, policy.model))
        return (await evaluate(EpisodeRunner(engine, policy.tokenizer, spec, rollout, Recorder()),
                               tasks)).mean

    async def go() -> float:
        async with engine:
            warm = await accuracy(None)
            for run in runs:
                run.accuracy = [(0, 0.0, warm)]
                for step, at, path in run.snapshots:
                    run.accuracy.append((step, at, await accuracy(path)))
            return warm

    return anyio.run(go)


# -- the FLOP bound ----------------------------------------------------------------------------


def flop_bound(tokens_per_sample: float, batch: int, cfg: DictConfig | None = None,
               **timing: Any) -> dict[str, float]:
    """Samples/s if a step's FLOPs ran at the rate the 2 cores sustain on the model's shapes
    (``cfg``'s model, the default experiment's unless told): the better of one process at 2
    threads and twice one thread (two workers, a core each). ``timing``: the
    microbenchmark's rounds (:func:`bench.flops.best_seconds`)."""
    model = (cfg or experiment()).model
    shapes = Shapes.llama(int(model.hidden_size), int(model.intermediate_size),
                          int(model.num_layers), CharTokenizer().vocab_size)
    prompt = len(CharTokenizer().chat_prompt(arithmetic_spec().tasks("train")[0].messages))
    seq = prompt + tokens_per_sample - 1  # what the trainer (and the rollout) feeds per sample
    n = shapes.weights  # every matmul's weights, head included
    # the trainer's forward and backward, and the rollouts' forward (causal attention)
    step_flops = 4 * batch * shapes.forward_flops(seq, seq * (seq + 1) / 2)
    linear_time = shapes.linear_time

    def sustained(threads: int) -> float:
        torch.set_num_threads(threads)
        seconds = (linear_time(round(batch * seq), backward=True, **timing)  # the trainer
                   + linear_time(batch * prompt, backward=False, **timing)  # the rollouts' prefill
                   + (tokens_per_sample - 1)
                   * linear_time(batch, backward=False, **timing))  # their decode
        return 8 * n * batch * seq / seconds

    one, two = sustained(1), sustained(2)
    rate = max(two, 2 * one)  # both are rates 2 cores reach (a thread each: the project's layout)
    return {"step_gflop": step_flops / 1e9, "sustained_gflops": rate / 1e9,
            "two_threads_gflops": two / 1e9, "one_thread_gflops": one / 1e9,
            "samples_per_s": batch / (step_flops / rate),
            "params_matmul": float(n), "tokens_per_sample_fed": seq}


# -- the report --------------------------------------------------------------------------------


def _fmt_time(seconds: float | None, run: Run) -> str:
    return f"{seconds:.1f}" if seconds is not None else f"not reached (best {run.best:.3f})"


def report(runs: Sequence[Run], target: float, png: Path, **labels: str) -> float:
    """Print the table and write the plot; returns the accuracy the speed-up is taken at."""
    print(f"{'run':<30} {'steps':>6} {'samples/s':>10} {'RL s':>8} {'s to ' + str(target):>24} "
          f"{'acc last':>9} {'acc best':>9} {'reward first/last 10%':>22}")
    for run in runs:
        tenth = max(1, len(run.rewards) // 10)
        first = sum(run.rewards[:tenth]) / tenth
        last = sum(run.rewards[-tenth:]) / tenth
        print(f"{run.name:<30} {len(run.rewards):>6} {run.samples_per_s:>10.1f} {run.wall:>8.1f} "
              f"{_fmt_time(run.time_to(target), run):>24} {run.accuracy[-1][2]:>9.3f} "
              f"{run.best:>9.3f} {first:>10.3f} / {last:.3f}")
    common = min(target, *(run.best for run in runs))
    plot(runs, target, png, **labels)
    return common


def plot(runs: Sequence[Run], target: float, path: Path,
         reward: str = "training reward (exact match, T=0.85)",
         held_out: str = "accuracy on the 200 eval tasks") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    window = max(1, min(20, min(len(run.rewards) for run in runs) // 10))
    for run in runs:
        spans = [run.rewards[max(0, i - window + 1): i + 1] for i in range(len(run.rewards))]
        smooth = [sum(span) / len(span) for span in spans]
        (line,) = left.plot(range(1, len(smooth) + 1), smooth, label=run.name)
        left.plot(range(1, len(run.rewards) + 1), run.rewards, color=line.get_color(),
                  alpha=0.15, lw=0.6)
        right.plot([t for _, t, _ in run.accuracy], [a for _, _, a in run.accuracy], marker=".",
                   color=line.get_color(), label=run.name)
    left.set(xlabel="train step", ylabel=reward,
             title=f"reward per step (faint) and its {window}-step mean")
    right.axhline(target, color="grey", ls="--", lw=0.8)
    right.set(xlabel="RL wall seconds (set-up excluded)", ylabel="held-out greedy accuracy",
              title=held_out)
    left.legend(loc="lower right", fontsize=8)
    right.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="This project against TRL's GRPOTrainer: same "
                                                 "model, weights, task and cores.")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_STEPS} steps per run instead of {STEPS} (target unchanged)")
    add_smoke(parser)
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run")
    parser.add_argument("--every", type=int, default=None,
                        help=f"steps between evaluated snapshots ({EVERY})")
    parser.add_argument("--target", type=float, default=TARGET, help="held-out greedy accuracy")
    parser.add_argument("--out", type=Path, default=None,
                        help="runs/bench_peers (--smoke: a temporary directory)")
    parser.add_argument("--trl-threads", type=int, default=None,
                        help=f"torch threads of the TRL run ({TRL_THREADS}: both cores; "
                             "--smoke 1)")
    parser.add_argument("--keep-snapshots", action="store_true",
                        help="keep every run's saved weights (deleted once evaluated)")
    args = parser.parse_args(argv)
    every = args.every or (1 if args.smoke else EVERY)
    if every < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--steps and --every must be >= 1")
    if importlib.util.find_spec("trl") is None:
        refuse("peers", "it needs TRL: pip install -e '.[peers]'")
    base = [*BASE, *SMOKE] if args.smoke else BASE
    try:
        settings = RLSettings.of(experiment(base=base))
    except NotComparable as e:
        refuse("peers", str(e))
    steps = args.steps or (SMOKE_STEPS if args.smoke else QUICK_STEPS if args.quick else STEPS)
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        out = (args.out or (Path(tmp) if args.smoke else REPO / "runs" / "bench_peers")).resolve()
        out.mkdir(parents=True, exist_ok=True)
        compare(args, out, base, settings, steps, every)


def compare(args: argparse.Namespace, out: Path, base: Sequence[str], settings: RLSettings,
            steps: int, every: int) -> None:
    """The three runs into ``out``, their evaluation and the report."""
    weights, warm = warm_start(out / "warmstart", base)
    print(f"warm start: {warm['steps']} supervised steps in {warm['seconds']:.1f} s, greedy "
          f"check accuracy {warm['check_accuracy']}; weights in {weights.parent}", flush=True)
    warm = ["model._target_=bench.peers_trl.warm_policy", f"+model.weights={weights}"]
    toy = SMOKE if args.smoke else ()
    runs = [run_project(0, steps, every, out, [*toy, *warm])]
    print(runs[-1].line(), flush=True)
    runs.append(run_project(1, steps, every, out, [*toy, *warm]))
    print(runs[-1].line(), flush=True)
    trl_threads = args.trl_threads or (1 if args.smoke else TRL_THREADS)
    runs.append(run_trl(steps, every, out, trl_threads, weights, overrides=toy))
    print(runs[-1].line(), flush=True)
    k0, k1, trl = runs
    cfg = experiment(*warm, base=base)
    warm_acc = evaluate_runs(runs, cfg)
    timing = SMOKE_TIMING if args.smoke else {}
    bound = flop_bound(k1.tokens_per_sample or float(settings.max_tokens), settings.batch_size,
                       cfg, **timing)
    if not args.keep_snapshots:
        for run in (k0, k1):  # checkpoints/step-<N>/ (final/ stays)
            for _, _, path in run.snapshots:
                if path.parent.parent.name != "final":
                    shutil.rmtree(path.parent.parent, ignore_errors=True)
        shutil.rmtree(out / "trl" / "snapshots", ignore_errors=True)

    print(f"warm start greedy accuracy on the eval split: {warm_acc:.3f}; {steps} RL steps of "
          f"{settings.batch_size} samples per run, snapshots every {every} steps")
    common = report(runs, args.target, out / "peers.png",
                    held_out=f"accuracy on the {scalar(cfg, 'eval.num_tasks')} eval tasks")
    print(f"FLOP bound: {bound['step_gflop']:.2f} GFLOP per step "
          f"({bound['params_matmul'] / 1e6:.2f} M matmul weights, "
          f"{bound['tokens_per_sample_fed']:.1f} tokens fed per sample), "
          f"{bound['sustained_gflops']:.1f} GFLOP/s sustained on the model's shapes (2 threads: "
          f"{bound['two_threads_gflops']:.1f}, 1 thread: {bound['one_thread_gflops']:.1f}) -> "
          f"{bound['samples_per_s']:.0f} samples/s")
    if bound["two_threads_gflops"] < 1.5 * bound["one_thread_gflops"]:
        print("warning: 2 threads sustain less than 1.5x one thread: the machine is busy, and "
              "every figure here is slowed by it")
    k1_time, trl_time = k1.time_to(common), trl.time_to(common)
    if common > warm_acc + 1e-9 and k1_time and trl_time is not None:
        speedup = trl_time / k1_time
        if common < args.target:
            print(f"target {args.target} not reached by every run within {steps} steps: the "
                  f"speed-up is taken at accuracy {common:.3f}, the best all three reached")
    else:  # every run's time to the warm start's accuracy is 0: nothing to time
        speedup = k1.samples_per_s / trl.samples_per_s
        print(f"no accuracy above the warm start's ({warm_acc:.3f}) was reached by all three "
              f"runs within {steps} steps: the speed-up is taken as samples/s at equal learning "
              f"per step (same batch and hyper-parameters), k = 1 over TRL: "
              f"{k1.samples_per_s:.1f} / {trl.samples_per_s:.1f}")
    (out / "results.json").write_text(json.dumps({
        "steps": steps, "every": every, "target": args.target, "warm_start": warm,
        "warm_start_eval_accuracy": warm_acc, "flop_bound": bound, "speedup": speedup,
        "runs": [{"name": r.name, "samples_per_s": r.samples_per_s, "rl_seconds": r.wall,
                  "time_to_target": r.time_to(args.target), "rewards": r.rewards,
                  "accuracy": r.accuracy} for r in runs]}, indent=1) + "\n")
    print(f"plot: {out / 'peers.png'}")
    print(f"bound_fraction={k1.samples_per_s / bound['samples_per_s']:.3f}")
    print(f"throughput_vs_trl_k0={k0.samples_per_s / trl.samples_per_s:.2f}")
    headline("speedup_vs_trl", speedup, 2)


if __name__ == "__main__":
    main()
