"""Resident memory of a long run: the default experiment, step 200 against its last step.

The run is the default experiment (``conf/``, ``experiment=arithmetic``) through
:func:`orchestrator.builders.run`, with its own run directory in a temporary folder, no logger, no
progress bar, and a warm start cut to ``WARM_START_STEPS`` supervised steps (no accuracy
target), so the RL steps start within seconds (``--as-configured``: the experiment's own); everything else is the experiment's own
(evaluations, periodic checkpoints, the run directory's files). A thread beside the run reads
``metrics.jsonl`` as it grows and samples the process's resident set size (``/proc/self/statm``,
so Linux only) when it sees the line of step 200 and that of the last step: what a long run
keeps in memory shows as growth between the two. ``--tracemalloc`` also diffs Python's
allocations between the same two moments and prints where they grew (it slows the run, and
the RSS figures then include its own bookkeeping).

Prints the RSS at both steps, the size of the run's spans (``spans/``), and last
``rss_growth_200_to_<N>=<growth in percent>`` (a bare number, as every headline): ``N`` is
2000 for the full run, 400 with ``--quick``. The target: within 10% for the full run.
``--smoke`` (seconds, the tests'): the toy model
(:data:`bench.cli.TOY_MODEL`), a 2-step warm start, RSS at steps 2 and 6:
``rss_growth_2_to_6=``; its figure says nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import tracemalloc
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir

from bench.cli import TOY_MODEL, add_smoke, headline, refuse
from orchestrator.builders import run
from orchestrator.trace.recorder import span_files, spans_path

REPO = Path(__file__).resolve().parents[1]
FIRST = 200  # the step measured against the last one (after warm-up, caches and pools fill)
WARM_START_STEPS = 20
POLL_SECONDS = 0.02
TOP_GROWTH = 15  # allocation sites --tracemalloc prints


def rss_bytes() -> int:
    """This process's resident set size now."""
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


class StepSampler(threading.Thread):
    """Samples RSS (and a tracemalloc snapshot, if tracing) when ``metrics.jsonl`` first shows
    each of ``steps`` done (a count of steps: the line of step index ``count - 1``)."""

    def __init__(self, metrics: Path, steps: Sequence[int]) -> None:
        super().__init__(daemon=True)
        self.metrics = metrics
        self.wanted = sorted(steps)
        self.rss: dict[int, int] = {}
        self.snapshots: dict[int, tracemalloc.Snapshot] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.metrics.exists() and not self.stop.wait(POLL_SECONDS):
            pass
        if self.stop.is_set():
            return
        with self.metrics.open() as f:
            partial = ""
            while self.wanted and not self.stop.is_set():
                partial += f.readline()
                if not partial.endswith("\n"):
                    self.stop.wait(POLL_SECONDS)
                    continue
                done = json.loads(partial)["step"] + 1
                partial = ""
                while self.wanted and done >= self.wanted[0]:
                    self._sample(self.wanted.pop(0))

    def _sample(self, step: int) -> None:
        self.rss[step] = rss_bytes()
        if tracemalloc.is_tracing():
            self.snapshots[step] = tracemalloc.take_snapshot()


def measure(steps: int, trace: bool, as_configured: bool = False, first_step: int = FIRST,
            warm_start: int = WARM_START_STEPS, overrides: Sequence[str] = ()) -> None:
    """RSS at step ``first_step`` against step ``steps``; ``overrides``: of the experiment."""
    with tempfile.TemporaryDirectory(prefix="polyrl-memory-") as tmp:
        run_dir = Path(tmp) / "run"
        short_warm_start = [] if as_configured else [
            f"warmstart.steps={warm_start}", "warmstart.target_accuracy=null"]
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[
                "experiment=arithmetic", "logger=none", "progress=false",
                f"pipeline.num_steps={steps}", *short_warm_start, *overrides])
        sampler = StepSampler(run_dir / "metrics.jsonl", [first_step, steps])
        if trace:
            tracemalloc.start(4)
        sampler.start()
        try:
            result = run(cfg, run_dir)
        finally:
            sampler.stop.set()
            sampler.join()
        if set(sampler.rss) != {first_step, steps}:
            refuse("memory", f"the run ended before step {steps}")
        if trace:
            report_growth(sampler.snapshots[first_step], sampler.snapshots[steps])
        summary = result.summary
        print(f"run: reward {summary['reward_first_10pct']:.3f} -> "
              f"{summary['reward_last_10pct']:.3f} (first/last 10% of steps), eval "
              f"{summary['eval_before']} -> {summary['eval_after']}, warm start "
              f"{summary['warm_start_steps']} steps, {summary['samples_per_s']:.1f} samples/s")
        first, last = sampler.rss[first_step], sampler.rss[steps]
        print(f"rss_at_step_{first_step}={first / 2**20:.1f}MiB")
        print(f"rss_at_step_{steps}={last / 2**20:.1f}MiB")
        spans = sum(p.stat().st_size for p in span_files(spans_path(run_dir)))
        print(f"spans={spans / 2**20:.1f}MiB (compressed)")
        headline(f"rss_growth_{first_step}_to_{steps}", 100 * (last / first - 1), 1)


def report_growth(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot) -> None:
    """The allocation sites that grew most between the two snapshots."""
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    diff = after.filter_traces(ignore).compare_to(before.filter_traces(ignore), "lineno")
    print(f"tracemalloc: top {TOP_GROWTH} growth, step {FIRST} to the last step")
    for stat in diff[:TOP_GROWTH]:
        print(f"  {stat.size_diff / 2**20:+8.2f} MiB {stat.count_diff:+8d} blocks  "
              f"{stat.traceback}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="RSS of the default experiment, step 200 "
                                                 "against the last step.")
    parser.add_argument("--quick", action="store_true", help="400 steps instead of 2000")
    parser.add_argument("--tracemalloc", action="store_true",
                        help="also print where Python's allocations grew (slow)")
    parser.add_argument("--as-configured", action="store_true",
                        help="the experiment's own warm start (to its accuracy target): the "
                             "default experiment exactly, its learning figures included")
    add_smoke(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        measure(6, args.tracemalloc, args.as_configured, first_step=2, warm_start=2,
                overrides=TOY_MODEL)
    else:
        measure(400 if args.quick else 2000, args.tracemalloc, args.as_configured)


if __name__ == "__main__":
    main()
