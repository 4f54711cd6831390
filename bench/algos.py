"""The algorithm family side by side on a real model: every ``conf/algo`` preset, and a
staleness sweep of three off-policy corrections.

    python -m bench.algos                      # both parts (about 2 hours on 2 cores)
    python -m bench.algos --parts presets      # or: staleness
    python -m bench.algos --quick              # within 10 minutes: the machinery, not a result
    python -m bench.algos --smoke              # seconds (the tests'): one preset, the toy model
    python -m bench.algos --reuse --ks 8       # read the finished runs in --out, run the rest
    python -m bench.algos --toy                # the default experiment, several seeds (~90 min)

Every run is ``python -m orchestrator experiment=dataset_smol`` (SmolLM2-135M-Instruct, the
shipped arithmetic Parquet files, math-verify; its base model's greedy held-out accuracy is
about 0.14) in its own process, as a user would start it, one after the other on the same
cores, with the same seed, batch (4 prompts x 8 samples) and evaluation (``eval.every`` steps,
the held-out file, greedy, on the rollout engine: ``eval.engine=shared``, as the runs in the
docs were measured). A preset that makes n updates a batch (its paper's schedule,
``trainer.num_minibatches``) takes the experiment's learning rate over n for each (``--no-scale-lr``:
the experiment's), as under ``--toy`` below. Periodic checkpoints are off (the same for every run). Curves are read back from each run directory by
:func:`bench.rg_smol_curve.curve`: held-out accuracy against RL wall time.

1. **Presets** (``presets``): each preset at k = 1 for ``--steps`` steps. The table gives the
   updates a batch and their learning rate, the accuracy before RL, at half the steps, the
   best within the budget, the last, the RL minutes to reach ``+--gain`` (0.15) over the
   run's own accuracy before RL, and how much the loss acted: the mean a step of the metric
   only that loss logs (its ``LossCard``'s: the clipped fraction of tokens for PPO's clip and
   CISPO's cap, of sequences for GSPO, the gate's weight for SAPO; 0 clipped at one update a
   batch, where every ratio to the proximal policy is 1). The plot (``--png``) has every
   preset's curve.
2. **Staleness** (``staleness``): k in ``--ks`` (0, 1, 4, 8) for the default decoupled loss
   (``algo=grpo``), the bypass mode with token TIS (``algo=grpo algo.mode=bypass``) and M2PO
   (``algo=stale``), each for ``--sweep-steps`` steps with ``(k + 1) x 4`` rollout workers (so
   the pipeline can run k versions ahead): held-out accuracy at equal train steps, the mean
   staleness reached, and seconds per step. Where the sweep has no k = 1 run of its own, the
   ``grpo`` preset's (the same run, at equal steps) stands for the decoupled loss at k = 1.

Last line: ``presets_learning=<share>``, the share of the presets whose curve reached
``+--gain`` within the budget (1.000: all; the line before gives the count; with ``--parts
staleness`` alone: ``stale_k8_gap=``, k = 1's final accuracy minus the best correction's at
the largest k).

``--toy``: the same two parts on the default experiment (the tiny model learning two-digit
addition, ``python -m orchestrator`` as shipped), where a run takes a minute, so each point is
``--seeds`` seeds (5; the sweep ``--sweep-seeds``, 3) and every figure is a mean ± standard
deviation: the presets at k = 1 for ``--steps`` (800) steps, held-out accuracy (200 tasks,
greedy) every ``--every`` (100) steps, at half and at all the steps, and the RL minutes to
``--target`` (0.8) accuracy; the sweep over ``--ks`` x the three corrections for
``--sweep-steps`` (300) steps, where k = 8 is far enough off-policy for corrections to matter
(16 prompts a step, so ``(k + 1) x 16`` workers). A preset that makes n updates a batch (its
paper's schedule, ``trainer.num_minibatches``) takes the experiment's learning rate over n for
each (``--no-scale-lr``: the experiment's): AdamW moves a weight about ``lr`` an update, so n
updates at the rate tuned for one move the weights n times as far a batch, and on this 64-sample
batch that collapsed ``dapo`` (16 updates) in one seed of five. A preset *learns* when every seed gains
``--gain`` (0.3) over its own accuracy before RL; a difference between two means no larger than
the larger of their standard deviations is printed as a tie. Last line ``presets_learning=``,
the share of presets that learn (the line before: the count, ``<n>/<n>``).

``--smoke`` (seconds, the tests'): the presets part alone (unless ``--parts`` names others)
with the ``grpo`` preset (or those ``--presets`` names), each run on the toy model
(:data:`bench.cli.TOY_MODEL`) for 2 steps of 2 prompts x 4 samples, evaluated every step on
4 held-out questions, in a temporary directory (unless ``--out``); its figure says nothing.
The staleness part runs the same ``launch`` with other overrides (three runs a k: ``--smoke
--parts staleness --ks 1`` runs it in seconds too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench.cli import TOY_MODEL, add_smoke, headline
from bench.rg_smol_curve import curve

if TYPE_CHECKING:
    from omegaconf import DictConfig

REPO = Path(__file__).resolve().parents[1]
PRESETS = ("grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp", "stale")
CORRECTIONS = {"decoupled": ("algo=grpo",), "bypass_tis": ("algo=grpo", "algo.mode=bypass"),
               "m2po": ("algo=stale",)}
PROMPTS_PER_STEP = 4  # dataset_smol: 32 samples a step, 8 a prompt
REAL = ("experiment=dataset_smol",)  # every run's experiment (--toy: the default one)
TOY_PROMPTS_PER_STEP = 16  # the default experiment: 64 samples a step, 4 a prompt


@dataclass(frozen=True)
class Result:
    name: str
    points: list[tuple[float, int, float]]  # (RL minutes, step, held-out accuracy)
    seconds_per_step: float
    staleness: float  # mean over the steps
    acts: tuple[str, float] = ("", 0.0)  # the loss's own metric, its mean over the steps

    @property
    def acted(self) -> str:
        """``<metric> <mean>``: how much the loss's clip, cap or gate acted a step."""
        return f"{self.acts[0]} {self.acts[1]:.3f}" if self.acts[0] else "?"

    @property
    def before(self) -> float:
        return self.points[0][2]

    def minutes_to(self, gain: float) -> float | None:
        return next((m for m, _, a in self.points if a >= self.before + gain - 1e-9), None)

    def best_within(self, minutes: float) -> float:
        return max(a for m, _, a in self.points if m <= minutes + 1e-9)

    def at_step(self, step: int) -> float:
        """The held-out accuracy of the last evaluation at or before ``step``."""
        return [a for _, s, a in self.points if s <= step][-1]

    def minutes_to_accuracy(self, target: float) -> float | None:
        return next((m for m, _, a in self.points if a >= target - 1e-9), None)


@dataclass(frozen=True)
class Spread:
    """One figure over seeds: mean ± sample standard deviation."""

    values: tuple[float, ...]

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    @property
    def sd(self) -> float:
        n = len(self.values)
        if n < 2:
            return 0.0
        return (sum((v - self.mean) ** 2 for v in self.values) / (n - 1)) ** 0.5

    def __str__(self) -> str:
        return f"{self.mean:.2f} ± {self.sd:.2f}"

    def against(self, other: Spread) -> str:
        """``tie`` when the means differ by no more than the larger standard deviation."""
        if abs(self.mean - other.mean) <= max(self.sd, other.sd):
            return "tie"
        return "higher" if self.mean > other.mean else "lower"


def launch(name: str, overrides: Sequence[str], out: Path, steps: int, every: int,
           eval_tasks: int | None, reuse: bool = False, extra: Sequence[str] = (),
           base: Sequence[str] = REAL) -> Result:
    """One run (``reuse``: a finished run directory of the same length is read instead);
    ``base``: the experiment (the default one: none)."""
    run_dir = out / name
    args = [sys.executable, "-m", "orchestrator", *base, *extra, *overrides,
            f"pipeline.num_steps={steps}", f"eval.every={every}", "eval.engine=shared",
            "checkpoint.every=0",
            "checkpoint.every_s=0", "logger=none", "progress=false", f"hydra.run.dir={run_dir}"]
    if eval_tasks is not None:
        args.append(f"eval.num_tasks={eval_tasks}")
    if reuse and finished(run_dir, args[3:], steps):
        print(f"[bench.algos] {name}: read from {run_dir}", flush=True)
        return read(run_dir, name, steps)
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    log = out / f"{name}.log"
    out.mkdir(parents=True, exist_ok=True)
    print(f"[bench.algos] {name}: {' '.join(args[3:])}", flush=True)
    with log.open("w") as f:
        done = subprocess.run(args, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                              check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed (exit {done.returncode}); see {log}:\n"
                         f"{log.read_text()[-2000:]}")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # 1 GB a run; read() needs none
    return read(run_dir, name, steps)


def finished(run_dir: Path, overrides: Sequence[str], steps: int) -> bool:
    """Whether ``run_dir`` holds a run started with exactly ``overrides`` that trained all its
    ``steps``. Hydra's ``overrides.yaml`` keeps the task's overrides alone, so ``hydra.*`` ones
    (the run directory) are left out of the comparison. A run stopped early (SIGTERM, a crash)
    writes its ``summary.json`` too, with the steps it reached: it is not finished."""
    import yaml

    saved = run_dir / ".hydra" / "overrides.yaml"
    summary = run_dir / "summary.json"
    task = [o for o in overrides if not o.startswith("hydra.")]
    return summary.is_file() and saved.is_file() \
        and yaml.safe_load(saved.read_text()) == task \
        and json.loads(summary.read_text()).get("steps") == steps


def read(run_dir: Path, name: str, steps: int) -> Result:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    points = curve(run_dir)
    if summary.get("eval_after") is not None and points[-1][1] != steps:
        points.append((summary["rl_seconds"] / 60, steps, float(summary["eval_after"])))
    staleness = sum(r.get("staleness/mean", 0.0) for r in rows) / max(len(rows), 1)
    own = own_metric(run_dir)
    values = [r[f"train/{own}"] for r in rows if f"train/{own}" in r]
    return Result(name, points, summary["rl_seconds"] / max(summary["steps"], 1), staleness,
                  (own, sum(values) / len(values)) if own and values else ("", 0.0))


def own_metric(run_dir: Path) -> str:
    """The metric only the run's policy loss logs (its ``LossCard``'s: ``clip_fraction`` for
    PPO's clip and CISPO's cap, ``sequence_clip_fraction`` for GSPO, ``gate_weight`` for SAPO);
    "" when the run's composed config is gone."""
    from orchestrator.algo.losses import LOSSES

    config = composed(run_dir)
    if config is None:
        return ""
    loss = LOSSES.get(str(config.algo.loss._target_).rsplit(".", 1)[-1])
    return loss.card.own if loss is not None else ""


def presets(names: Sequence[str], out: Path, steps: int, every: int, gain: float,
            eval_tasks: int | None, reuse: bool = False, extra: Sequence[str] = (),
            scale_lr: bool = True) -> list[Result]:
    """``extra``: overrides of every run (``--smoke``: the toy model). ``scale_lr``: each
    update at the experiment's rate over the preset's updates per batch (:func:`per_update_lr`)."""
    lrs = {n: per_update_lr(n, [*REAL, *extra]) if scale_lr else [] for n in names}
    results = [launch(n, [f"algo={n}", *lrs[n]], out / "presets", steps, every, eval_tasks,
                      reuse, extra) for n in names]
    budget = max(r.points[-1][0] for r in results)
    print(f"\npresets at k = 1, {steps} steps (budget: {budget:.1f} RL minutes, the slowest run)")
    print(f"| preset | updates (lr) | before | step {steps // 2} | best | last | RL min to "
          f"+{gain:.2f} | s/step | the loss's own metric, mean a step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        reach = r.minutes_to(gain)
        print(f"| {r.name} | {updates_and_lr(out / 'presets' / r.name)} | {r.before:.2f} | "
              f"{r.at_step(steps // 2):.2f} | {r.best_within(budget):.2f} | "
              f"{r.points[-1][2]:.2f} | {'—' if reach is None else f'{reach:.1f}'} | "
              f"{r.seconds_per_step:.1f} | {r.acted} |")
    return results


def staleness(ks: Sequence[int], out: Path, steps: int, every: int, eval_tasks: int | None,
              reuse: bool = False, extra: Sequence[str] = ()) -> dict[tuple[str, int], Result]:
    """``extra``: overrides of every run (``--smoke``: the toy model)."""
    results = {}
    for k in ks:
        for name, overrides in CORRECTIONS.items():
            results[name, k] = launch(
                f"{name}_k{k}", [*overrides, f"pipeline.max_staleness={k}",
                                 f"pipeline.num_workers={(k + 1) * PROMPTS_PER_STEP}"],
                out / "staleness", steps, every, eval_tasks, reuse, extra)
    print(f"\nstaleness sweep: held-out accuracy after {steps} steps (mean staleness, s/step)")
    print("| correction | " + " | ".join(f"k = {k}" for k in ks) + " |")
    print("| --- |" + " --- |" * len(ks))
    for name in CORRECTIONS:
        cells = [results[name, k] for k in ks]
        print(f"| {name} | " + " | ".join(
            f"{r.points[-1][2]:.2f} ({r.staleness:.1f}, {r.seconds_per_step:.1f} s)"
            for r in cells) + " |")
    return results


def updates_and_lr(run_dir: Path) -> str:
    """``trainer.num_minibatches (trainer.lr)`` as the run composed them (its
    ``.hydra/config.yaml``)."""
    config = composed(run_dir)
    if config is None:
        return "?"
    return f"{config.trainer.num_minibatches} ({config.trainer.lr:.3g})"


def composed(run_dir: Path) -> DictConfig | None:
    """The run's configuration as Hydra composed it (``.hydra/config.yaml``), or None when it
    is gone."""
    from omegaconf import OmegaConf

    path = run_dir / ".hydra" / "config.yaml"
    return OmegaConf.load(path) if path.is_file() else None  # type: ignore[return-value]


def schedule(overrides: Sequence[str]) -> tuple[int, float]:
    """``(trainer.num_minibatches, trainer.lr)`` as a run with ``overrides`` (the default
    experiment unless they name another) composes them from ``conf/``."""
    from hydra import compose, initialize_config_dir

    from orchestrator.config.read import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        trainer = compose("config", overrides=list(overrides)).trainer
    return int(trainer.num_minibatches), float(trainer.lr)


def per_update_lr(name: str, extra: Sequence[str]) -> list[str]:
    """The override that gives each of preset ``name``'s updates the experiment's learning rate
    divided by its updates per batch (none for one update): AdamW moves each weight about
    ``lr`` a step whatever the gradient's size, so n updates a batch at the rate tuned for one
    move the weights n times as far a batch."""
    updates, lr = schedule([f"algo={name}", *extra])
    return [] if updates == 1 else [f"trainer.lr={lr / updates:.6g}"]


def toy_presets(names: Sequence[str], seeds: int, out: Path, steps: int, every: int,
                target: float, gain: float, reuse: bool = False,
                extra: Sequence[str] = (), scale_lr: bool = True) -> int:
    """Each preset at k = 1 on the default experiment, ``seeds`` seeds each; prints the spread
    table and returns how many presets learn (every seed gains ``gain``). ``scale_lr``: each
    update at the experiment's rate over the preset's updates per batch (:func:`per_update_lr`)."""
    lrs = {n: per_update_lr(n, extra) if scale_lr else [] for n in names}
    runs = {n: [launch(f"{n}_s{seed}", [f"algo={n}", f"seed={seed}", *lrs[n]],
                       out / "toy_presets", steps, every, None, reuse, extra, base=())
                for seed in range(seeds)]
            for n in names}
    half = steps // 2
    spread = {n: {"before": Spread(tuple(r.before for r in rs)),
                  "half": Spread(tuple(r.at_step(half) for r in rs)),
                  "last": Spread(tuple(r.at_step(steps) for r in rs))} for n, rs in runs.items()}
    reference = spread.get("grpo")
    print(f"\npresets at k = 1 on the default experiment, {steps} steps, {seeds} seeds "
          f"(mean ± sd; held-out greedy accuracy)")
    print(f"| preset | updates (lr) | before | step {half} | step {steps} | vs grpo | RL min to "
          f"{target:g} (seeds) | learns (+{gain:g}, every seed) | the loss's own metric, mean "
          f"a step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    learning = 0
    for n, rs in runs.items():
        reached = [m for r in rs if (m := r.minutes_to_accuracy(target)) is not None]
        minutes = f"{Spread(tuple(reached))} ({len(reached)}/{len(rs)})" if reached else \
            f"— (0/{len(rs)})"
        learns = all(r.minutes_to(gain) is not None for r in rs)
        learning += learns
        versus = "—" if reference is None or n == "grpo" else \
            spread[n]["last"].against(reference["last"])
        print(f"| {n} | {updates_and_lr(out / 'toy_presets' / rs[0].name)} | "
              f"{spread[n]['before']} | {spread[n]['half']} | {spread[n]['last']} | {versus} | "
              f"{minutes} | {'yes' if learns else 'no'} | {rs[0].acts[0] or '?'} "
              f"{Spread(tuple(r.acts[1] for r in rs)).mean:.3f} |")
    return learning


def toy_staleness(ks: Sequence[int], seeds: int, out: Path, steps: int, every: int,
                  reuse: bool = False, extra: Sequence[str] = ()) -> float:
    """The three corrections at each k on the default experiment, ``seeds`` seeds each; returns
    the decoupled loss's mean at k = 1 (or the smallest k) minus the best correction's at the
    largest k, after ``steps`` steps."""
    cells: dict[tuple[str, int], list[Result]] = {}
    for k in ks:
        for name, overrides in CORRECTIONS.items():
            cells[name, k] = [launch(
                f"{name}_k{k}_s{seed}", [*overrides, f"seed={seed}", f"pipeline.max_staleness={k}",
                                         f"pipeline.num_workers={(k + 1) * TOY_PROMPTS_PER_STEP}"],
                out / "toy_staleness", steps, every, None, reuse, extra, base=())
                for seed in range(seeds)]
    final = {cell: Spread(tuple(r.at_step(steps) for r in rs)) for cell, rs in cells.items()}
    print(f"\nstaleness sweep on the default experiment: held-out accuracy after {steps} steps, "
          f"{seeds} seeds (mean ± sd; mean staleness reached)")
    print("| correction | " + " | ".join(f"k = {k}" for k in ks) + " |")
    print("| --- |" + " --- |" * len(ks))
    for name in CORRECTIONS:
        print(f"| {name} | " + " | ".join(
            f"{final[name, k]} ({sum(r.staleness for r in cells[name, k]) / seeds:.1f})"
            for k in ks) + " |")
    for k in ks:
        best = max(CORRECTIONS, key=lambda n: final[n, k].mean)
        verdicts = ", ".join(f"{n} {final[n, k].against(final[best, k])}"
                             for n in CORRECTIONS if n != best)
        print(f"k = {k}: highest mean {best}; against it: {verdicts}")
    seconds = {k: Spread(tuple(r.seconds_per_step for n in CORRECTIONS for r in cells[n, k]))
               for k in ks}
    print("seconds a step (every run at k): " + ", ".join(f"k = {k} {seconds[k]} s" for k in ks))
    base, top = (1 if 1 in ks else min(ks)), max(ks)
    gap = final["decoupled", base].mean - max(final[n, top].mean for n in CORRECTIONS)
    print(f"k = {base} (decoupled) minus the best correction at k = {top}, mean held-out accuracy "
          f"after {steps} steps: {gap:+.3f}")
    return gap


def toy(args: argparse.Namespace, parts: set[str], names: Sequence[str], ks: Sequence[int],
        out: Path, extra: Sequence[str]) -> None:
    learning = None
    if "presets" in parts:
        learning = toy_presets(names, args.seeds, out, args.steps, args.every, args.target,
                               args.gain, args.reuse, extra, scale_lr=args.scale_lr)
    gap = None
    if "staleness" in parts:
        gap = toy_staleness(ks, args.sweep_seeds, out, args.sweep_steps, args.every, args.reuse,
                            extra)
    if learning is not None:
        print(f"presets_learning: {learning}/{len(names)}")
        headline("presets_learning", learning / len(names))
    elif gap is not None:
        headline(f"stale_k{max(ks)}_gap", gap)


def plot(results: Sequence[Result], gain: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot([m for m, _, _ in r.points], [a for _, _, a in r.points], marker="o",
                markersize=3, label=r.name)
    before = min(r.before for r in results)
    ax.axhline(before + gain, color="grey", linestyle=":", label=f"+{gain:g} over base")
    ax.set_xlabel("RL wall time (min), 2 CPU cores")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("SmolLM2-135M-Instruct, experiment=dataset_smol, k = 1")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=None, help="presets,staleness (--smoke: presets)")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--steps", type=int, default=None,
                        help="RL steps per preset (20; --toy 800)")
    parser.add_argument("--every", type=int, default=None, help="eval.every (5; --toy 100)")
    parser.add_argument("--sweep-steps", type=int, default=None, help="(20; --toy 300)")
    parser.add_argument("--ks", default="0,1,4,8")
    parser.add_argument("--gain", type=float, default=None, help="(0.15; --toy 0.3)")
    parser.add_argument("--toy", action="store_true",
                        help="the default experiment (the tiny model), several seeds a point")
    parser.add_argument("--seeds", type=int, default=None, help="--toy: seeds a preset (5)")
    parser.add_argument("--sweep-seeds", type=int, default=None,
                        help="--toy: seeds a point of the sweep (3)")
    parser.add_argument("--target", type=float, default=0.8,
                        help="--toy: the accuracy whose RL minutes are given")
    parser.add_argument("--eval-tasks", type=int, default=None,
                        help="eval.num_tasks (default: the experiment's, the whole file)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the runs' directory (runs/bench_algos; --smoke: a temporary one)")
    parser.add_argument("--png", type=Path, default=None,
                        help="the presets' plot (default: docs/algos.png; none with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="two presets, and the three corrections at k = 4, two steps each")
    parser.add_argument("--scale-lr", action=argparse.BooleanOptionalAction, default=True,
                        help="each update of a preset that makes n a batch at the "
                             "experiment's trainer.lr / n (default; --no-scale-lr: trainer.lr)")
    parser.add_argument("--reuse", action="store_true",
                        help="read the finished runs already in --out instead of running them")
    add_smoke(parser)
    args = parser.parse_args(argv)
    parts = set((args.parts or ("presets" if args.smoke else "presets,staleness")).split(","))
    names = args.presets.split(",")
    extra: list[str] = []
    if args.toy:
        args.gain = args.gain if args.gain is not None else 0.3
        args.seeds, args.sweep_seeds = args.seeds or 5, args.sweep_seeds or 3
        if args.smoke:  # two seeds of one preset for 2 steps: the machinery, not a result
            names = names if args.presets != ",".join(PRESETS) else ["grpo"]
            args.seeds, args.sweep_seeds = min(args.seeds, 2), min(args.sweep_seeds, 2)
            args.steps, args.sweep_steps, args.every = args.steps or 2, args.sweep_steps or 2, 1
            extra = ["pipeline.batch_size=8", "rollout.group_size=4", "warmstart.steps=5",
                     "eval.num_tasks=8"]
        args.steps, args.every = args.steps or 800, args.every or 100
        args.sweep_steps = args.sweep_steps or 300
    args.gain = args.gain if args.gain is not None else 0.15
    if args.smoke and not args.toy:
        names = names if args.presets != ",".join(PRESETS) else ["grpo"]
        args.steps, args.every = args.steps or 2, args.every or 1
        args.eval_tasks = args.eval_tasks or 4
        extra = [*TOY_MODEL, "model.device=cpu", "pipeline.batch_size=8", "rollout.group_size=4",
                 "pipeline.num_workers=4", "rollout.max_tokens=8"]
    args.steps, args.every = args.steps or 20, args.every or 5
    args.sweep_steps = args.sweep_steps or 20
    ks = [int(k) for k in args.ks.split(",")]
    unknown = set(names) - set(PRESETS)
    if unknown:
        raise SystemExit(f"--presets: no preset {sorted(unknown)}; known: {', '.join(PRESETS)}")
    if args.quick:  # the k = 1 point of the sweep is the grpo preset's run
        names, ks = names[:2], [4]
        args.steps = args.sweep_steps = args.every = 2
        args.eval_tasks = args.eval_tasks or 12
    with tempfile.TemporaryDirectory(prefix="bench-algos-") as tmp:
        out = args.out or (Path(tmp) if args.smoke else REPO / "runs" / "bench_algos")
        if args.toy:
            toy(args, parts, names, ks, out, extra)
        else:
            measure(args, parts, names, ks, out, extra)


def measure(args: argparse.Namespace, parts: set[str], names: Sequence[str], ks: Sequence[int],
            out: Path, extra: Sequence[str]) -> None:
    results = []
    if "presets" in parts:
        results = presets(names, out, args.steps, args.every, args.gain, args.eval_tasks,
                          args.reuse, extra, scale_lr=args.scale_lr)
        if not args.quick and not args.smoke:
            plot(results, args.gain, args.png or REPO / "docs" / "algos.png")
    sweep = {}
    if "staleness" in parts:
        sweep = staleness(ks, out, args.sweep_steps, args.every, args.eval_tasks,
                          args.reuse, extra)
        at_k1 = next((r for r in results if r.name == "grpo"), None)
        if ("decoupled", 1) not in sweep and at_k1 is not None and args.steps == args.sweep_steps:
            sweep["decoupled", 1] = at_k1
        base = next((k for k in (1, *ks) if ("decoupled", k) in sweep), ks[0])
        top = max(ks)
        gap = sweep["decoupled", base].points[-1][2] - max(
            sweep[name, top].points[-1][2] for name in CORRECTIONS)
        print(f"k = {base} (decoupled) minus the best correction at k = {top}, held-out accuracy "
              f"after {args.sweep_steps} steps: {gap:+.2f} (target: at most 0.05)")
    if results:
        learning = sum(r.minutes_to(args.gain) is not None for r in results)
        print(f"{learning} of {len(results)} presets reached +{args.gain:g} within the budget")
        headline("presets_learning", learning / len(results))
    elif sweep:
        headline(f"stale_k{max(ks)}_gap", gap)


if __name__ == "__main__":
    main()
