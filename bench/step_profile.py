"""Where a train step's time goes: the default experiment, sampled thread by thread.

The run is the default experiment (``conf/``, ``experiment=arithmetic``: k = 1, 64 samples a
step, the engine and trainer one torch thread each) through :func:`orchestrator.builders.run`, in a
temporary run directory, with a short warm start (``--warm-start`` supervised steps, no
accuracy target) and no evaluations. A thread beside it samples every thread's Python stack
(``sys._current_frames``) every ``--interval`` seconds while the run is between RL steps
``--skip`` and ``--steps``: it reads ``metrics.jsonl`` as it grows at every sample, starts
when the line of step ``--skip`` is there and stops at that of step ``--steps`` (the window
is the steps whose lines arrived in between, whatever the machine's speed). It files each
sample under the innermost function it knows:

* trainer: ``forward`` (log-probs, the shared-prefix pass included), ``backward``,
  ``optimiser`` (AdamW, clipping, the scheduler), ``pack`` (the batch's tensors), ``other``;
* engine: ``prefill``, ``decode``, ``sample``, ``cache`` (slot cache bookkeeping), ``other``;
* event loop (the main thread): ``episodes`` (rollout, environments, rewards), ``trace
  files`` (the per-step PolyTrace files and metrics), ``spans`` (the recorder), ``pipeline``,
  ``other`` — and ``idle`` (waiting in ``select``);
* a worker thread waiting for work is idle and not counted.

Torch's kernels release the GIL, so a thread inside one is sampled where it is. A sample is a
thread's time running *or waiting for a core*: on 2 cores with 3 busy threads, the figures
add up to more than the wall time. Printed: milliseconds per RL step for each line, the step's
wall time, the trainer's and engine's total, and last ``samples_per_s=<RL throughput over the
sampled steps>``. Overrides after ``--`` go to the config (``-- trainer.share_prefix=false``).
``--smoke`` (seconds, the tests'): the toy model (:data:`bench.cli.TOY_MODEL`), 8 RL steps
after a 2-step warm start, sampled from step 2 at 1 ms; its figures say nothing. A run whose
window held no sample refuses (exit 3).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from hydra import compose, initialize_config_dir

from bench.cli import TOY_MODEL, add_smoke, headline, refuse
from orchestrator.builders import run

REPO = Path(__file__).resolve().parents[1]

# (qualified name, stage) from the innermost frame outwards: the first match names the sample.
STAGES = (
    ("Tensor.backward", "trainer: backward"),
    ("Optimizer.step", "trainer: optimiser"),
    ("clip_grad_norm_", "trainer: optimiser"),
    ("LRScheduler.step", "trainer: optimiser"),
    ("pack", "trainer: pack"),
    ("TorchTrainer._logprobs", "trainer: forward"),
    ("TorchTrainer.train_step", "trainer: other"),
    ("TorchEngine._forward", "engine: forward"),
    ("TorchEngine._sample", "engine: sample"),
    ("SlotCache.", "engine: cache"),
    ("TorchEngine._advance", "engine: other"),
    ("TraceWriter.", "event loop: trace files"),
    ("RunDir.", "event loop: trace files"),
    ("Recorder.", "event loop: spans"),
    ("run_episode", "event loop: episodes"),
    ("run_group", "event loop: episodes"),
    ("Pipeline.", "event loop: pipeline"),
)
IDLE = ("BaseSelector.select", "EpollSelector.select", "WorkerThread.run", "Condition.wait",
        "Queue.get")


def stage_of(frame: FrameType | None, main: bool) -> str | None:
    """The stage a thread is in, None when it is idle."""
    names = []
    while frame is not None:
        names.append(frame.f_code.co_qualname)
        frame = frame.f_back
    if names and names[0] in IDLE:
        return "event loop: idle" if main else None
    for name in names:
        for prefix, stage in STAGES:
            if name == prefix or (prefix.endswith(".") and name.startswith(prefix)):
                return stage
    return "event loop: other" if main else "worker: other"


class StackSampler(threading.Thread):
    """Samples all threads between the metrics lines of steps ``skip`` and ``steps`` (one
    line per RL step): ``window`` is the first and last line counts it sampled between."""

    def __init__(self, metrics: Path, skip: int, steps: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.metrics, self.skip, self.steps, self.interval = metrics, skip, steps, interval
        self.counts: Counter[str] = Counter()
        self.samples = 0
        self.seconds = 0.0  # the window's wall time
        self.window = (0, 0)  # metrics lines at its start and at its end
        self.stop = threading.Event()

    def run(self) -> None:
        main_id, me = threading.main_thread().ident, threading.get_ident()
        lines, partial, started, first = 0, "", None, 0
        handle = None
        while not self.stop.wait(self.interval):
            if handle is None:
                if not self.metrics.exists():
                    continue
                handle = self.metrics.open()
            while chunk := handle.readline():  # the lines written since the last sample
                partial += chunk
                if partial.endswith("\n"):
                    lines, partial = lines + 1, ""
            if started is None:
                if lines < self.skip:
                    continue
                started, first = time.perf_counter(), lines
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    stage = stage_of(frame, ident == main_id)
                    if stage is not None:
                        self.counts[stage] += 1
            self.samples += 1
            if lines >= self.steps:
                break
        if handle is not None:
            handle.close()
        if started is not None:
            self.seconds = time.perf_counter() - started
            self.window = (first, min(lines, self.steps))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="RL steps in the run")
    parser.add_argument("--skip", type=int, default=50, help="RL steps before sampling starts")
    parser.add_argument("--warm-start", type=int, default=200, help="supervised steps first")
    parser.add_argument("--interval", type=float, default=0.005, help="seconds between samples")
    parser.add_argument("overrides", nargs="*", help="config overrides (after --)")
    add_smoke(parser)
    args = parser.parse_args(argv)
    smoke = list(TOY_MODEL) if args.smoke else []
    if args.smoke:
        args.steps, args.skip, args.warm_start, args.interval = 8, 2, 2, 0.001

    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        run_dir = Path(tmp) / "run"
        cfg = compose("config", overrides=[
            f"pipeline.num_steps={args.steps}", f"warmstart.steps={args.warm_start}",
            "warmstart.target_accuracy=null", "eval.num_tasks=0", "logger=none",
            "progress=false", "checkpoint.every=0", "checkpoint.every_s=0", *smoke,
            *args.overrides,
        ])
        sampler = StackSampler(run_dir / "metrics.jsonl", args.skip, args.steps, args.interval)
        sampler.start()
        run(cfg, run_dir)
        sampler.stop.set()
        sampler.join()
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    first, last = sampler.window
    sampled = [r for r in rows if "time/step" in r][first:last]  # the summary line has none
    steps = len(sampled)
    if not steps or not sampler.samples:
        refuse("step_profile", f"no RL step between steps {args.skip} and {args.steps} was "
                               "sampled: the run ended first (give more --steps)")
    wall = sum(r["time/step"] for r in sampled)
    samples = sum(r["throughput/samples_per_s"] * r["time/step"] for r in sampled)
    dt = sampler.seconds / sampler.samples  # per sample, really
    per_step = {k: v * dt * 1000 / steps for k, v in sampler.counts.items()}
    print(f"{steps} RL steps sampled ({sampler.samples} samples), wall {1000 * wall / steps:.1f} ms "
          "a step; thread-milliseconds a step (running or waiting for a core):")
    for group in ("trainer", "engine", "event loop", "worker"):
        lines = sorted((k, v) for k, v in per_step.items() if k.startswith(group))
        if lines:
            total = sum(v for k, v in lines if not k.endswith("idle"))
            print(f"  {group:<11} {total:7.1f}")
            for k, v in lines:
                print(f"    {k.split(': ')[1]:<13} {v:7.1f}")
    headline("samples_per_s", samples / wall, 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
