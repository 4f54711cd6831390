"""``env.reward=judge`` against ``exact``: what an LLM judge costs a run, and a judge that hangs.

Three runs of ``python -m orchestrator experiment=smoke env=dataset`` (subprocesses, as
``bench.dataset``'s reward part: the 1,000-row two-digit-sums file, 64-token replies, 64 samples
a step, 8 rollout workers, ``--steps`` steps, no warm start, no evaluation), each scored by:

* ``exact`` — in the run's own process, no I/O: the baseline;
* ``judge`` — the judge server of :mod:`bench.judge_server` (real HTTP on this machine, aiohttp),
  answering every call after 50 ms, grading as ``exact`` does;
* ``judge+hang`` — the same server, which never answers one call in 20
  (``env.judge.timeout_s=1``: the call is given up after 1 s and tried again).

Figures: samples/s from each run's ``summary.json``, as ratios to ``exact`` (target: judge >=
0.8: judging overlaps rollout, so a 50 ms judge should cost little); from the runs' metrics,
``judge/unscored`` (samples that got no score; target 0), ``judge/failures/timeout`` (the hung
calls counted: at least one in the hang run) and the groups dropped as stale. The judge server
runs in a thread of this process, so the two share the machine's cores with the run.

``--quick``: 4 steps a run (default 15). ``--smoke`` (the tests': the toy model and
``experiment=smoke``'s own small steps, 2 a run, a hang one call in 8, in a temporary folder) checks the bench works end to end; its figures say nothing. Last
lines: ``judge_unscored=<n>``, ``judge_hang_timeouts=<n>``, then the headline
``judge_vs_exact=<ratio>``. A hang run that counted no timeout, or a judge run with a sample
left unscored, is a refusal (exit status 3), never a figure. Needs the data extra (``pip
install -e '.[data]'``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from bench.cli import TOY_MODEL, add_smoke, headline, refuse
from bench.dataset import SMALL, run, write_rows
from bench.judge_server import Faults, in_thread
from bench.machine import machine

REPO = Path(__file__).resolve().parent.parent
DELAY_S = 0.05  # the judge's answer time
HANG_EVERY = 20  # one call in this many never answered
HANG_TIMEOUT_S = 1.0
SMOKE_HANG_EVERY = 8  # the smoke runs make few calls: hangs often enough to meet some


def last_metrics(run_dir: Path) -> dict[str, float]:
    """The last step's metrics line that has the judge's counters (or the last line)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "judge/calls" in m] or lines
    return steps[-1] if steps else {}


def convert(path: Path) -> None:
    """The file into ``datasets``' Arrow cache, once, before the timed runs (the first run
    would pay for it otherwise)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.load_dataset("parquet", data_files=[str(path)], split="train")


def measure(out: Path, steps: int, smoke: bool) -> None:
    path = write_rows(out / f"sums_{SMALL}.parquet", SMALL)
    if not smoke:  # the smoke size says nothing of rates: the first run converts it
        convert(path)
    train = f"env.train={path}"
    shape = [f"pipeline.num_steps={steps}",  # the smoke size keeps experiment=smoke's shape
             *(TOY_MODEL if smoke else ("rollout.max_tokens=64", "pipeline.batch_size=64",
                                        "pipeline.num_workers=8"))]
    hang_every = SMOKE_HANG_EVERY if smoke else HANG_EVERY
    rates: dict[str, float] = {}
    found: dict[str, dict[str, float]] = {}
    print(f"{'reward':<11} {'samples/s':>9} {'ratio':>6} {'scored':>7} {'unscored':>9} "
          f"{'timeouts':>9} {'stale':>6}", flush=True)
    variants = {"exact": (None, ["env.reward=exact"]),
                "judge": (Faults(delay_s=DELAY_S), ["env.reward=judge"]),
                "judge+hang": (Faults(delay_s=DELAY_S, hang_every=hang_every),
                               ["env.reward=judge", f"env.judge.timeout_s={HANG_TIMEOUT_S}",
                                "env.judge.backoff_s=0.05"])}
    for name, (faults, overrides) in variants.items():
        with ExitStack() as stack:
            if faults is not None:
                server = stack.enter_context(in_thread(faults))
                overrides = [*overrides, f"env.judge.url={server.url}"]
            _, _, summary = run(out, f"judge_{name.replace('+', '_')}", train, *shape, *overrides)
        metrics = last_metrics(out / f"judge_{name.replace('+', '_')}")
        rates[name], found[name] = summary["samples_per_s"], metrics
        print(f"{name:<11} {rates[name]:>9.1f} {rates[name] / rates['exact']:>6.2f} "
              f"{metrics.get('judge/scored', 0):>7.0f} {metrics.get('judge/unscored', 0):>9.0f} "
              f"{metrics.get('judge/failures/timeout', 0):>9.0f} {summary['dropped_stale']:>6}",
              flush=True)
    unscored = found["judge"].get("judge/unscored")
    timeouts = found["judge+hang"].get("judge/failures/timeout")
    if unscored is None or not found["judge"].get("judge/scored"):
        refuse("judge", "the judge run reported no judge counters")
    if timeouts is None or timeouts < 1:
        refuse("judge", "the hang run counted no timed-out call: the hangs were not met")
    print(f"judge_unscored={unscored:.0f}")
    print(f"judge_hang_timeouts={timeouts:.0f}")
    if unscored:
        refuse("judge", f"{unscored:.0f} samples of the 50 ms judge run got no score")
    headline("judge_vs_exact", rates["judge"] / rates["exact"])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="where the file and runs go (default: runs/bench_judge; --smoke: "
                             "a temporary folder)")
    parser.add_argument("--steps", type=int, default=None, help="steps a run (15)")
    parser.add_argument("--quick", action="store_true", help="4 steps a run")
    add_smoke(parser)
    args = parser.parse_args(argv)
    if missing := [m for m in ("pyarrow", "datasets") if importlib.util.find_spec(m) is None]:
        refuse("judge", f"{' and '.join(missing)} missing: pip install -e '.[data]'")
    steps = args.steps or (2 if args.smoke else 4 if args.quick else 15)
    with ExitStack() as stack:
        out = args.out or (Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="bench-judge-"))) if args.smoke else REPO / "runs" / "bench_judge")
        out.mkdir(parents=True, exist_ok=True)
        print(machine(), flush=True)
        measure(out, steps, args.smoke)


if __name__ == "__main__":
    sys.exit(main())
