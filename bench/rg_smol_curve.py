"""The real model's learning curve: held-out greedy accuracy against RL wall time for runs
of ``experiment=rg_smol`` (one per seed), or of another experiment, from their run
directories alone.

    python -m orchestrator experiment=rg_smol seed=0 hydra.run.dir=runs/rg_smol_s0
    python -m orchestrator experiment=rg_smol seed=1 hydra.run.dir=runs/rg_smol_s1
    python -m bench.rg_smol_curve runs/rg_smol_s0 runs/rg_smol_s1 [--budget-min 45]
    python -m bench.rg_smol_curve runs/dataset_smol_s0 --experiment dataset_smol --budget-min 30
    python -m bench.rg_smol_curve --smoke

Accuracy before RL is the run log's "eval before RL" line; the evaluations during RL are the
``eval/accuracy`` metrics (``eval.every`` steps, the experiment's held-out questions, greedy),
placed at the RL time (``time/step`` summed) of the step they were reported with (they run
alongside rollout, so the time includes them). Writes ``docs/<experiment>.png``; the last
line is ``<experiment>_gain=``: over the runs, the smallest best gain in held-out accuracy
within the budget (target >= 0.15 within 45 minutes for rg_smol, 30 for dataset_smol).

``--smoke`` (seconds, the tests'): with no run named, it first makes one, ``python -m
orchestrator experiment=<experiment>`` on the toy model (:data:`bench.cli.TOY_MODEL`) for 3
steps of 2 prompts x 4 samples with ``eval.every=1`` on 8 held-out questions, in a temporary
directory, and reads that (the plot goes there too); its gain says nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.cli import TOY_MODEL, add_smoke, headline, refuse

REPO = Path(__file__).resolve().parents[1]

BEFORE = re.compile(r"eval before RL: ([0-9.]+)")


def curve(run_dir: Path) -> list[tuple[float, int, float]]:
    """(RL minutes, step, accuracy) points, the first before RL."""
    match = BEFORE.search((run_dir / "train.log").read_text())
    if match is None:
        raise SystemExit(f"{run_dir}: no 'eval before RL' line in train.log")
    points = [(0.0, 0, float(match.group(1)))]
    elapsed = 0.0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            metrics = json.loads(line)
        except json.JSONDecodeError:  # a cut last line of a killed run
            continue
        elapsed += metrics.get("time/step", 0.0)
        if "eval/accuracy" in metrics:
            points.append((elapsed / 60, int(metrics["eval/step"]), metrics["eval/accuracy"]))
    return points


def smoke_run(experiment: str, run_dir: Path) -> None:
    """A run of seconds of ``experiment`` on the toy model, as a user starts one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", f"experiment={experiment}", *TOY_MODEL,
         "model.device=cpu", "logger=none", "progress=false", "pipeline.num_steps=3",
         "pipeline.batch_size=8", "rollout.group_size=4", "pipeline.num_workers=4",
         "eval.every=1", "eval.num_tasks=8", "checkpoint.every=0", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        refuse("rg_smol_curve", f"the smoke run failed (exit {done.returncode}): "
                                f"{done.stderr.strip().splitlines()[-1:]}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path)
    parser.add_argument("--budget-min", type=float, default=45.0)
    parser.add_argument("--experiment", default="rg_smol",
                        help="the runs' experiment: the plot's title and the last line's name")
    parser.add_argument("--plot", type=Path, default=None, help="default: docs/<experiment>.png")
    add_smoke(parser)
    args = parser.parse_args(argv)
    if not args.runs and not args.smoke:
        parser.error("name the runs' directories (or --smoke)")
    with tempfile.TemporaryDirectory(prefix="rg-smol-curve-") as tmp:
        if args.smoke and not args.runs:
            args.runs = [Path(tmp) / f"{args.experiment}_smoke"]
            smoke_run(args.experiment, args.runs[0])
            args.plot = args.plot or Path(tmp) / f"{args.experiment}.png"
        gain = report(args.runs, args.budget_min, args.experiment,
                      args.plot or REPO / "docs" / f"{args.experiment}.png")
    headline(f"{args.experiment}_gain", gain)


def report(runs: Sequence[Path], budget_min: float, experiment: str, plot: Path) -> float:
    """Each run's curve printed and plotted; returns the smallest best gain within the
    budget."""
    gains = []
    curves = {}
    for run in runs:
        points = curves[run.name] = curve(run)
        print(f"{run.name}: " + "  ".join(f"{m:.1f} min (step {s}) {a:.2f}" for m, s, a in points))
        within = [a for m, _, a in points if m <= budget_min]
        gains.append(max(within) - points[0][2])
        print(f"{run.name}: before {points[0][2]:.2f}, best within {budget_min:g} min "
              f"{max(within):.2f} (+{gains[-1]:.2f}), last {points[-1][2]:.2f}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, points in curves.items():
        ax.plot([m for m, _, _ in points], [a for _, _, a in points], marker="o", label=name)
    ax.axvline(budget_min, color="grey", linestyle=":", label=f"{budget_min:g} min")
    ax.set_xlabel("RL wall time (min), 2 CPU cores")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(f"SmolLM2-135M-Instruct, experiment={experiment}")
    ax.legend()
    fig.tight_layout()
    plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(plot, dpi=120)
    plt.close(fig)
    print(f"plot: {plot}")
    return min(gains)


if __name__ == "__main__":
    main()
