"""Crash and resume: a run SIGKILLed at random points and resumed each time, and what
checkpoints cost.

A smoke run (``experiment=smoke``, ``checkpoint.every=1``) is started as a user would start
it (``python -m orchestrator``) and killed with SIGKILL from outside at three random moments
(after a random number of finished steps, plus a random fraction of a step); each time it is
resumed with ``python -m orchestrator resume=<run_dir>``, and the last resume runs to the end.
From the run directory it then counts:

* ``steps_lost``: steps recorded in ``metrics.jsonl`` before a kill that the resume had to
  redo (its checkpoint is older than them), the largest over the kills (target <= 1);
* ``duplicated_samples``: (prompt, sample) pairs trained more than once (target 0);
* ``skipped_prompts``: prompts handed out but untrained at a checkpoint a resume started
  from that were never trained afterwards (target 0; stale drops would be counted apart);
* the resume time: a resume's start to its first new step in ``metrics.jsonl`` (start-up,
  checkpoint load and engine start included).

Then it times one checkpoint (model, optimiser, run state, manifest with checksums; written
and fsynced) of the default model and of a 100 M-parameter Llama config, with Adam state.
Last line: ``steps_lost_max=<n>``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from orchestrator.algo.grpo import GRPO
from orchestrator.checkpoint import CheckpointStore, save_checkpoint
from orchestrator.models.policy import tiny_policy
from orchestrator.resume import RunState, capture_rng, find_checkpoint
from orchestrator.trace.reader import TraceDir
from orchestrator.trainer import TorchTrainer

REPO = Path(__file__).resolve().parents[1]
RUN = ["experiment=smoke", "logger=none", "progress=false", "model.device=cpu",
       "warmstart.steps=2", "eval.num_tasks=8", "checkpoint.every=1", "checkpoint.keep=2"]
BIG = {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "intermediate_size": 3072}


def start(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    return subprocess.Popen([sys.executable, "-m", "orchestrator", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines()
               if line.endswith("}") and '"summary/' not in line)


def wait_for_steps(proc: subprocess.Popen[str], run_dir: Path, count: int) -> float:
    """Seconds until ``metrics.jsonl`` holds ``count`` steps (the process must not end first)."""
    started = time.monotonic()
    while steps_done(run_dir) < count:
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before step {count}: {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
        time.sleep(0.02)
    return time.monotonic() - started


def kill_and_resume(run_dir: Path, steps: int, kills: int, rng: random.Random) -> dict[str, float]:
    points = sorted(rng.sample(range(2, steps - 1), kills))
    proc = start(*RUN, f"pipeline.num_steps={steps}", f"hydra.run.dir={run_dir}")
    lost: list[int] = []
    again: set[int] = set()
    resume_seconds: list[float] = []
    for point in points:
        wait_for_steps(proc, run_dir, point)
        time.sleep(rng.uniform(0.0, 0.15))  # somewhere inside the next step
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        recorded = steps_done(run_dir)
        state = RunState.read(find_checkpoint(run_dir))
        lost.append(recorded - state.step)
        again |= set(state.sampler["again"])
        print(f"killed after {recorded} recorded steps; resuming from the checkpoint of step "
              f"{state.step} ({recorded - state.step} to redo)", flush=True)
        proc = start(f"resume={run_dir}")
        resume_seconds.append(wait_for_steps(proc, run_dir, state.step + 1))
    if proc.wait() != 0:
        raise RuntimeError(f"the last resume failed: {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
    trace = TraceDir.open(run_dir)
    pairs = Counter((r.prompt_group_id, r.sample_id) for s in trace.steps() for r in trace.workload(s))
    trained = {prompt for prompt, _ in pairs}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    dropped = max(m.get("staleness/dropped_total", 0) for m in metrics)
    return {
        "steps_recorded": float(len(trace.steps())),
        "steps_lost_max": float(max(lost)),
        "duplicated_samples": float(sum(n - 1 for n in pairs.values())),
        "skipped_prompts": float(len(again - trained)) if not dropped else float("nan"),
        "dropped_stale": float(dropped),
        "resume_seconds": sum(resume_seconds) / len(resume_seconds),
    }


def checkpoint_cost(model: dict[str, int], directory: Path) -> tuple[float, float, int]:
    """Seconds to write one checkpoint of ``model`` with Adam state, its size in MB, params."""
    policy = tiny_policy(**model, device="cpu")
    trainer = TorchTrainer(policy, GRPO())
    ids = torch.randint(0, policy.tokenizer.vocab_size, (2, 16))
    policy.model(input_ids=ids, labels=ids).loss.backward()
    trainer.optimizer.step()  # Adam's moments exist, as in any real checkpoint
    params = sum(p.numel() for p in policy.model.parameters())
    store = CheckpointStore(directory, keep=1)
    state = RunState(step=1, version=1, sampler={})
    rng = capture_rng()

    def write(path: Path) -> None:
        save_checkpoint(trainer, path)
        state.write(path, rng)

    started = time.perf_counter()
    path = store.save(1, write)
    seconds = time.perf_counter() - started
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6
    return seconds, size, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 10-step run (under 90 s)")
    parser.add_argument("--steps", type=int, default=None, help="train steps of the run")
    parser.add_argument("--seed", type=int, default=0, help="where the kills fall")
    args = parser.parse_args()
    steps = args.steps or (10 if args.quick else 30)
    print(f"bench.resume: experiment=smoke, {steps} steps, checkpoint.every=1, 3 SIGKILLs "
          f"at random points (seed {args.seed})", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        figures = kill_and_resume(Path(tmp) / "run", steps, 3, random.Random(args.seed))
        print(f"steps recorded: {figures['steps_recorded']:.0f}; dropped as stale: "
              f"{figures['dropped_stale']:.0f}")
        print(f"resume time (start to first new step): {figures['resume_seconds']:.1f} s")
        for name, model in (("default (conf/model/tiny)", {}), ("100M Llama", BIG)):
            seconds, size, params = checkpoint_cost(model, Path(tmp) / f"ckpt-{len(model)}")
            print(f"checkpoint of the {name} model ({params / 1e6:.1f} M params, Adam state): "
                  f"{seconds:.2f} s, {size:.1f} MB", flush=True)
    print(f"duplicated_samples={figures['duplicated_samples']:.0f}")
    print(f"skipped_prompts={figures['skipped_prompts']:.0f}")
    print(f"steps_lost_max={figures['steps_lost_max']:.0f}")


if __name__ == "__main__":
    main()
