"""What a run leaves on disk: bytes of the run directory per 1,000 train steps, by kind.

Runs the default experiment (``conf/``, ``experiment=arithmetic``: its logger, W&B offline,
included) through :func:`orchestrator.builders.run` in a temporary directory, for ``--steps`` RL
steps (2,000, the experiment's own; ``--quick`` 300), with the warm start cut to
``WARM_START_STEPS`` supervised steps like :mod:`bench.memory` (the RL steps are what grows
with a run's length; the warm start is a fixed cost, counted here too). Then it sizes every
file of the directory by kind — ``spans`` (``spans.jsonl`` or its segments), ``timeline``,
each PolyTrace step-file kind, ``metrics``, ``samples``, ``wandb``, the rest — and prints the
bytes per 1,000 steps of each (MB = 10^6 bytes), the file count, and the run's samples/s.

Checkpoints are listed but left out of the total: they are kept at a fixed count
(``checkpoint.keep``), so they do not grow with the run. Last line
``rundir_mb_per_1k_steps=<MB>``, the total without checkpoints; target <= 20. ``--smoke``
(seconds, the tests'): the toy model (:data:`bench.cli.TOY_MODEL`), 6 RL steps after a
2-step warm start, the logger included; its figure says nothing (a short run's fixed files
weigh on it).
"""

from __future__ import annotations

import argparse
import re
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir

from bench.cli import TOY_MODEL, add_smoke, headline
from orchestrator.builders import run

REPO = Path(__file__).resolve().parents[1]
WARM_START_STEPS = 20
SMOKE_STEPS = 6
MB = 1e6
# PolyTrace records: step files (<kind>_step_N.jsonl) or rolled ones (trace/<kind>.<first>.jsonl.zst)
STEP_KIND = re.compile(r"^(multiturn_workload|packed_lengths|reward_timings)(?:_step_\d+)?\.")


def kind(relative: Path) -> str:
    """The kind a file of a run directory counts under."""
    top = relative.parts[0]
    if top in ("checkpoints", "wandb", ".hydra"):
        return top
    if top.startswith("spans"):
        return "spans"
    if top.startswith("timeline"):
        return "timeline"
    match = STEP_KIND.match(relative.name)
    if match:
        return match.group(1)
    return relative.name.split(".")[0] if len(relative.parts) == 1 else top


def sizes(run_dir: Path) -> tuple[Counter[str], Counter[str]]:
    """Bytes and file counts per kind."""
    size: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for path in run_dir.rglob("*"):
        if path.is_file() and not path.is_symlink():
            k = kind(path.relative_to(run_dir))
            size[k] += path.stat().st_size
            count[k] += 1
    return size, count


def measure(steps: int, overrides: Sequence[str], warm_start: int = WARM_START_STEPS) -> None:
    with tempfile.TemporaryDirectory(prefix="polyrl-rundir-") as tmp:
        run_dir = Path(tmp) / "run"
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[
                "experiment=arithmetic", "progress=false", f"pipeline.num_steps={steps}",
                f"warmstart.steps={warm_start}", "warmstart.target_accuracy=null",
                *overrides])
        result = run(cfg, run_dir)
        size, count = sizes(run_dir)
    per_1k = 1000 / steps
    print(f"{steps} RL steps, {result.summary['samples_per_s']:.1f} samples/s")
    print(f"{'kind':<20} {'files':>7} {'MB':>9} {'MB/1k steps':>12}")
    for k, b in sorted(size.items(), key=lambda kv: -kv[1]):
        note = "  (fixed count: not in the total)" if k == "checkpoints" else ""
        print(f"{k:<20} {count[k]:>7} {b / MB:>9.2f} {b / MB * per_1k:>12.2f}{note}")
    total = sum(b for k, b in size.items() if k != "checkpoints")
    files = sum(n for k, n in count.items() if k != "checkpoints")
    print(f"files={files} (checkpoints excluded)")
    print(f"samples_per_s={result.summary['samples_per_s']:.1f}")
    headline("rundir_mb_per_1k_steps", total / MB * per_1k, 2)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run-directory bytes per 1,000 steps, by kind.")
    parser.add_argument("--quick", action="store_true", help="300 steps instead of 2000")
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default 2000)")
    add_smoke(parser)
    parser.add_argument("overrides", nargs="*", help="extra config overrides")
    args = parser.parse_args(argv)
    if args.smoke:
        measure(args.steps or SMOKE_STEPS, [*TOY_MODEL, *args.overrides], warm_start=2)
    else:
        measure(args.steps or (300 if args.quick else 2000), args.overrides)


if __name__ == "__main__":
    main()
