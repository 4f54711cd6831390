"""Crash and resume with the default checkpoints: a run SIGKILLed at random moments and
resumed each time, and what checkpoints cost.

The default experiment (``experiment=arithmetic``, checkpoints as configured by default: one
at the end of the first step a minute after the last began, written in the background) is
started as a user would start it (``python -m orchestrator``) and killed with SIGKILL from
outside at random moments (the first 0–90 s after the first checkpoint, the one after the warm
start; the later ones 20–150 s into each resumed process); each time it is resumed with ``python -m
orchestrator resume=<run_dir>``, and the last resume runs to the end. The bench notes when
each step appeared in ``metrics.jsonl`` (polled every 20 ms) and, from the run directory, counts:

* ``steps_lost``: steps recorded before a kill that the resume had to redo (its checkpoint is
  older than them), the largest over the kills;
* ``work_lost_s``: the wall seconds of those steps — from the end of the step the checkpoint
  holds to the end of the last step recorded before the kill — the largest over the kills
  (target <= 60: a crash loses the step in progress and at most a minute before it);
* ``duplicated_samples``: samples trained more often than the sampler's passes over the train
  split allow (within one pass: (prompt, sample) pairs trained twice; target 0);
* ``skipped_prompts``: prompts handed out but untrained at a checkpoint a resume started from
  that were never trained afterwards (target 0; stale drops would be counted apart);
* the resume time: a resume's start to its first new step in ``metrics.jsonl``;
* what checkpoints cost the run, from its ``summary.json`` (the whole run): the seconds the
  trainer waited for snapshots and the seconds of background writes, as shares of the RL
  wall time (target <= 3%).

Then it times one checkpoint (model, optimiser, run state, manifest with checksums; written
and fsynced), snapshot and write apart, of the default model and of a 100 M-parameter Llama
config, with Adam state. ``--quick``: ``experiment=smoke`` with ``checkpoint.every_s=5`` and
one kill (not the defaults; under two minutes). Last line: ``work_lost_max_s=<s>``.
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
from orchestrator.checkpoint import CheckpointStore
from orchestrator.models.policy import tiny_policy
from orchestrator.resume import RunState, capture_rng, find_checkpoint
from orchestrator.trace.reader import TraceDir
from orchestrator.trainer import TorchTrainer
from orchestrator.trainer.snapshot import TrainerSnapshot

REPO = Path(__file__).resolve().parents[1]
RUN = ["logger=none", "progress=false"]  # the default experiment, checkpoints as configured
QUICK = ["experiment=smoke", "logger=none", "progress=false", "model.device=cpu",
         "warmstart.steps=2", "eval.num_tasks=8", "checkpoint.every_s=5"]
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


class Watch:
    """When (monotonic) each step count first appeared in ``metrics.jsonl``."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.seen: dict[int, float] = {}

    def poll(self) -> int:
        done = steps_done(self.run_dir)
        self.seen.setdefault(done, time.monotonic())
        return done

    def at(self, count: int, late: bool = False) -> float:
        """When ``count`` steps were first seen; if the polls missed it, the last poll before
        it (or, ``late``, now: the kill came before the next poll). Count 0 (the checkpoint
        after the warm start) is when RL began: the first step's end less its duration."""
        if count == 0 and 1 in self.seen:
            first = json.loads((self.run_dir / "metrics.jsonl").read_text().splitlines()[0])
            return self.seen[1] - first["time/step"]
        if count in self.seen:
            return self.seen[count]
        if late:
            return time.monotonic()
        return max(t for k, t in self.seen.items() if k < count)

    def until(self, proc: subprocess.Popen[str], deadline: float | None = None,
              steps: int | None = None) -> bool:
        """Poll until ``deadline`` or ``steps`` recorded; False if the process ended first."""
        while True:
            done = self.poll()
            if (deadline is not None and time.monotonic() >= deadline) or (
                    steps is not None and done >= steps):
                return True
            if proc.poll() is not None:
                return False
            time.sleep(0.02)


def kill_and_resume(run_dir: Path, run: list[str], kills: int, first: tuple[float, float],
                    rng: random.Random) -> dict[str, float]:
    watch = Watch(run_dir)
    proc = start(*run, f"hydra.run.dir={run_dir}")
    lost: list[int] = []
    lost_s: list[float] = []
    again: set[int] = set()
    resume_seconds: list[float] = []
    while not list(run_dir.glob("checkpoints/step-*/MANIFEST.json")):  # the first kill's clock
        if proc.poll() is not None:                                     # starts at the first
            raise RuntimeError(f"the run ended early: {proc.communicate()[1][-2000:]}")  # one
        watch.poll()
        time.sleep(0.02)
    window = first
    for _ in range(kills):
        if not watch.until(proc, deadline=time.monotonic() + rng.uniform(*window)):
            break  # the run ended before this kill
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        recorded = steps_done(run_dir)
        state = RunState.read(find_checkpoint(run_dir))
        lost.append(recorded - state.step)
        # from the end of the step the checkpoint holds to the end of the last one recorded
        # (both read conservatively: a count the polls missed takes the poll before it)
        lost_s.append(watch.at(recorded, late=True) - watch.at(state.step))
        again |= set(state.pipeline["sampler"]["again"])
        print(f"killed after {recorded} recorded steps; resuming from the checkpoint of step "
              f"{state.step}: {recorded - state.step} steps, {lost_s[-1]:.1f} s of work to redo",
              flush=True)
        started = time.monotonic()
        proc = start(f"resume={run_dir}")
        while steps_done(run_dir) > state.step and proc.poll() is None:  # until it truncates
            time.sleep(0.02)
        watch.seen = {k: v for k, v in watch.seen.items() if k <= state.step}
        watch.until(proc, steps=state.step + 1)
        resume_seconds.append(time.monotonic() - started)
        window = (20.0, 150.0)
    _, stderr = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the last resume failed: {stderr[-2000:]}")
    trace = TraceDir.open(run_dir)
    pairs = Counter((r.prompt_group_id, r.sample_id) for s in trace.steps() for r in trace.workload(s))
    trained = {prompt for prompt, _ in pairs}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    dropped = max(m.get("staleness/dropped_total", 0) for m in metrics)
    # The sampler makes endless passes over the train split: over P prompts handed out (trained,
    # or dropped as stale) each of its T tasks is handed out at most ceil(P / T) times, and a
    # prompt trained more often is a duplicate.
    per_prompt = Counter({prompt: n for (prompt, sample), n in pairs.items() if sample == 0})
    group = max(sample for _, sample in pairs) + 1
    tasks = train_tasks(run_dir)
    most = -(-(sum(per_prompt.values()) + int(dropped) // group) // tasks)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "kills": float(len(lost)),
        "steps_recorded": float(len(trace.steps())),
        "steps_lost_max": float(max(lost, default=0)),
        "work_lost_max_s": max(lost_s, default=0.0),
        "duplicated_samples": float(sum(n - 1 for n in pairs.values() if n > 1)
                                    if tasks >= sum(per_prompt.values())
                                    else sum(max(0, n - most) for n in per_prompt.values())),
        "skipped_prompts": float(len(again - trained)) if not dropped else float("nan"),
        "dropped_stale": float(dropped),
        "resume_seconds": sum(resume_seconds) / max(len(resume_seconds), 1),
        "rl_seconds": summary["rl_seconds"],
        "checkpoints": summary["checkpoints"],
        "pause_share": summary["checkpoint_pause_s"] / summary["rl_seconds"],
        "write_share": summary["checkpoint_write_s"] / summary["rl_seconds"],
    }


def train_tasks(run_dir: Path) -> int:
    """The size of the run's train split, from its own config."""
    from omegaconf import OmegaConf

    from orchestrator.config import build_env

    return len(build_env(OmegaConf.load(run_dir / "config.yaml")).tasks("train"))


def checkpoint_cost(model: dict[str, int], directory: Path) -> tuple[float, float, float, int]:
    """Seconds to snapshot and to write one checkpoint of ``model`` with Adam state, its size
    in MB, and its parameters."""
    policy = tiny_policy(**model, device="cpu")
    trainer = TorchTrainer(policy, GRPO())
    ids = torch.randint(0, policy.tokenizer.vocab_size, (2, 16))
    policy.model(input_ids=ids, labels=ids).loss.backward()
    trainer.optimizer.step()  # Adam's moments exist, as in any real checkpoint
    params = sum(p.numel() for p in policy.model.parameters())
    store = CheckpointStore(directory, keep=1)
    state = RunState(pipeline={"step": 1, "dropped": 0, "sampler": {}}, version=1)
    rng = capture_rng()

    def capture() -> TrainerSnapshot:  # into fresh memory, as the run's first one is
        return TrainerSnapshot.capture(trainer.state_dict(), trainer.model, policy.tokenizer)

    capture()  # the first pays for imports and lazy set-up
    started = time.perf_counter()
    snapshot = capture()
    captured = time.perf_counter() - started

    def write(path: Path) -> None:
        snapshot.write(path)
        state.write(path, rng)

    started = time.perf_counter()
    path = store.save(1, write)
    written = time.perf_counter() - started
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6
    return captured, written, size, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="experiment=smoke, checkpoint.every_s=5, one kill (not the defaults)")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="pipeline.num_steps (default: "
                        "the experiment's)")
    parser.add_argument("--seed", type=int, default=0, help="where the kills fall")
    args = parser.parse_args()
    run, kills, first = (QUICK + ["pipeline.num_steps=60"], 1, (2.0, 8.0)) if args.quick else (
        RUN, args.kills, (0.0, 90.0))
    if args.steps:
        run = [*run, f"pipeline.num_steps={args.steps}"]
    print(f"bench.resume: {' '.join(run)}; {kills} SIGKILLs at random moments (seed {args.seed}); "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        f = kill_and_resume(Path(tmp) / "run", run, kills, first, random.Random(args.seed))
        print(f"{f['kills']:.0f} kills; steps recorded: {f['steps_recorded']:.0f}; dropped as "
              f"stale: {f['dropped_stale']:.0f}")
        print(f"resume time (start to first new step): {f['resume_seconds']:.1f} s")
        print(f"checkpoints: {f['checkpoints']:.0f} over {f['rl_seconds']:.0f} s of RL; the "
              f"trainer waited {100 * f['pause_share']:.2f}% of it (snapshots), background "
              f"writes took {100 * f['write_share']:.2f}% (target <= 3%)")
        for name, model in (("default (conf/model/tiny)", {}), ("100M Llama", BIG)):
            captured, written, size, params = checkpoint_cost(model, Path(tmp) / f"ckpt-{len(model)}")
            print(f"checkpoint of the {name} model ({params / 1e6:.1f} M params, Adam state, "
                  f"{size:.1f} MB): snapshot {captured:.3f} s (the trainer waits), write "
                  f"{written:.2f} s (in the background)", flush=True)
    print(f"duplicated_samples={f['duplicated_samples']:.0f}")
    print(f"skipped_prompts={f['skipped_prompts']:.0f}")
    print(f"steps_lost_max={f['steps_lost_max']:.0f}")
    print(f"checkpoint_share_pct={100 * (f['pause_share'] + f['write_share']):.2f}")
    print(f"work_lost_max_s={f['work_lost_max_s']:.1f}")


if __name__ == "__main__":
    main()
