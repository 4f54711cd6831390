"""Crash and resume: a run interrupted at random points and resumed each time, audited from
its own files; and what checkpoints cost.

The default experiment (``experiment=arithmetic``, checkpoints as configured by default: one at
the end of the first step a minute after the last began, written in the background) is started
as a user would start it (``python -m orchestrator``) and SIGKILLed from outside; each time it
is resumed with ``python -m orchestrator resume=<run_dir>``, and the last resume runs to the
end. Interruptions are placed by the run's own progress, never by a clock, so the benchmark
gives its figures on a machine twice as fast or twice as slow: the first waits for the
checkpoint after the first periodic one (its distance from the one before is the checkpoint
interval, in steps, on this machine), then a uniform number of steps within one interval, then
a uniform fraction of one step's measured time; each later one comes a uniform number of steps
within one interval after the step its process resumed from. The bench notes when each step
appeared in ``metrics.jsonl`` (polled every 20 ms) and, from the run directory, counts:

* ``steps_lost``: steps recorded before a kill that the resume had to redo (its checkpoint is
  older than them), the largest over the kills;
* ``work_lost_s``: the wall seconds of those steps, from the end of the step the checkpoint
  holds to the end of the last step recorded before the kill, the largest over the kills
  (target <= 60: a crash loses the step in progress and at most a minute before it);
* the audit of ``--soak`` below (duplicated and lost prompts);
* the resume time: a resume's start to its first new step in ``metrics.jsonl``;
* what checkpoints cost the run, from its ``summary.json`` (the whole run): the seconds the
  trainer waited for snapshots and the seconds of background writes, as shares of the RL
  wall time (target <= 3%).

Then it times one checkpoint (model, optimiser, run state, manifest with checksums; written
and fsynced), snapshot and write apart, of the default model and of a 100 M-parameter Llama
config, with Adam state. Last line: ``work_lost_max_s=<s>``.

``--soak [--k K]``: the exactly-once audit. The default experiment at ``pipeline.max_staleness=K``
with a checkpoint every 50 steps (so that 20 interruptions fit in its 2,000 steps whatever the
machine's speed) is interrupted 20 times, each a SIGKILL or a SIGTERM (seeded coin), 1–100 steps
after the step its process resumed from plus a fraction of a step, and resumed each time. From
the run's files alone (metrics, PolyTrace steps, checkpoints) it checks: steps and versions
without gap or repeat; every prompt trained at most once per pass over the train split; every
prompt the sampler handed out accounted for once (trained, dropped as stale, filtered, or in
flight at the run's end); every prompt in flight at an interruption rolled out again (trained
after it, or in flight at the end) or counted as dropped; a SIGTERM loses nothing recorded and
a SIGKILL resumes from the newest complete checkpoint. Last lines
``exactly_once=<interruptions survived>/<interruptions>`` and ``lost_prompts=<n>``.

``--quick``: ``experiment=smoke`` with a checkpoint every 10 steps, 60 steps, one kill (not the
defaults; about a minute). ``--smoke``: the same with a smaller model, 30 steps, a checkpoint
every 5 and no 100 M checkpoint (seconds; what the tests run); ``--soak --smoke``: that run
interrupted twice, 1-5 steps after each resume point. A run that ends before its first interruption could be placed is
a one-line refusal (exit 3), never a figure.
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.cli import add_smoke, refuse
from bench.machine import machine
from orchestrator.algo.grpo import GRPO
from orchestrator.models.policy import tiny_policy
from orchestrator.run.checkpoint import CheckpointStore
from orchestrator.run.resume import RunState, capture_rng, find_checkpoint
from orchestrator.trace.reader import TraceDir
from orchestrator.trainer import TorchTrainer
from orchestrator.trainer.snapshot import TrainerSnapshot

REPO = Path(__file__).resolve().parents[1]
RUN = ["logger=none", "progress=false"]  # the default experiment, checkpoints as configured
SMALL = ["experiment=smoke", "logger=none", "progress=false", "model.device=cpu",
         "warmstart.steps=2", "eval.num_tasks=8", "checkpoint.every_s=0"]
QUICK = [*SMALL, "checkpoint.every=10", "pipeline.num_steps=60"]
SMOKE = [*SMALL, "checkpoint.every=5", "pipeline.num_steps=30", "model.hidden_size=32",
         "model.num_layers=1", "model.intermediate_size=64"]
SOAK = ["logger=none", "progress=false", "checkpoint.every=50", "checkpoint.every_s=0"]
BIG = {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "intermediate_size": 3072}
# orchestrator/pipeline/outcomes.py
OUTCOMES_SETTLED = ("trained", "stale", "filtered", "masked", "empty")


def start(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    return subprocess.Popen([sys.executable, "-m", "orchestrator", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def recorded_steps(run_dir: Path) -> list[dict]:
    """The step records of ``metrics.jsonl`` (complete lines; the summary line left out)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()
            if line.endswith("}") and '"summary/' not in line]


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines()
               if line.endswith("}") and '"summary/' not in line)


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of the complete checkpoints (manifest written), oldest first."""
    return CheckpointStore(run_dir / "checkpoints").steps()


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

    def until(self, proc: subprocess.Popen[str], steps: int | None = None,
              checkpoints: int | None = None) -> bool:
        """Poll until ``steps`` recorded or ``checkpoints`` complete checkpoints exist; False
        if the process ended first."""
        while True:
            done = self.poll()
            if steps is not None and done >= steps:
                return True
            if checkpoints is not None and len(checkpoint_steps(self.run_dir)) >= checkpoints:
                return True
            if proc.poll() is not None:
                return False
            time.sleep(0.02)


def step_seconds(run_dir: Path) -> float:
    """The mean wall time of the last ten steps recorded (the jitter's scale)."""
    steps = recorded_steps(run_dir)[-10:]
    return sum(m["time/step"] for m in steps) / len(steps) if steps else 0.0


@dataclass
class Interruption:
    """One interruption, as observed from outside and read back from the run's files."""

    signal: str
    recorded: int  # steps in metrics.jsonl when the process ended
    newest: int  # the newest complete checkpoint's step when it ended
    resumed_from: int  # the step of the checkpoint the next process started from
    again: set[int]  # the prompts that checkpoint lists as in flight
    exit_ok: bool  # SIGTERM: exit 2 with one line; SIGKILL: killed
    seconds_lost: float = 0.0


@dataclass
class Plan:
    """Where interruptions land, in steps: the first ``first`` steps after the first checkpoint
    past step 0 (None: after the interval measured there), each later one ``later`` steps
    after the step its process resumed from (None: within one measured interval)."""

    count: int
    first: tuple[int, int] | None = None
    later: tuple[int, int] | None = None
    sigterm_share: float = 0.0  # the chance an interruption is a SIGTERM, not a SIGKILL
    interval: int = field(default=0)


def interrupt_and_resume(run_dir: Path, run: Sequence[str], plan: Plan,
                         rng: random.Random) -> tuple[list[Interruption], list[float]]:
    """Start ``run``, interrupt it as ``plan`` says, resume each time and let the last resume
    finish. Returns the interruptions and each resume's seconds to its first new step."""
    watch = Watch(run_dir)
    proc = start(*run, f"hydra.run.dir={run_dir}")
    interruptions: list[Interruption] = []
    resume_seconds: list[float] = []
    # the first interruption's clock: the first checkpoint past the one after the warm start
    if not watch.until(proc, checkpoints=2):
        refuse("resume", f"the run ended before its second checkpoint (exit {proc.returncode}): "
                         f"nothing to interrupt; {proc.communicate()[1][-300:]!r}")
    first_two = checkpoint_steps(run_dir)[:2]
    plan.interval = max(1, first_two[1] - first_two[0])
    base = first_two[1]
    window = plan.first or (1, plan.interval)
    for _ in range(plan.count):
        target = base + rng.randint(*window)
        if not watch.until(proc, steps=target):
            break  # the run ended before this interruption
        time.sleep(rng.random() * step_seconds(run_dir))  # somewhere inside the next step
        name = "SIGTERM" if rng.random() < plan.sigterm_share else "SIGKILL"
        proc.send_signal(getattr(signal, name))
        _, stderr = proc.communicate()
        if proc.returncode == 0:
            break  # it finished before the signal landed
        recorded = steps_done(run_dir)
        newest = max(checkpoint_steps(run_dir), default=-1)
        if name == "SIGTERM":
            errors = [line for line in stderr.splitlines() if line.startswith("error:")]
            exit_ok = (proc.returncode == 2 and len(errors) == 1
                       and "stopped by SIGTERM" in errors[0] and "Traceback" not in stderr)
        else:
            exit_ok = proc.returncode == -signal.SIGKILL
        state = RunState.read(find_checkpoint(run_dir))
        interruption = Interruption(name, recorded, newest, state.step,
                                    set(state.pipeline["sampler"]["again"]), exit_ok)
        # from the end of the step the checkpoint holds to the end of the last one recorded
        # (both read conservatively: a count the polls missed takes the poll before it)
        interruption.seconds_lost = (watch.at(recorded, late=True) - watch.at(state.step)
                                     if recorded > state.step else 0.0)
        interruptions.append(interruption)
        print(f"{name} after {recorded} recorded steps; resuming from the checkpoint of step "
              f"{state.step}: {recorded - state.step} steps, {interruption.seconds_lost:.1f} s of "
              f"work to redo", flush=True)
        started = time.monotonic()
        proc = start(f"resume={run_dir}")
        while steps_done(run_dir) > state.step and proc.poll() is None:  # until it truncates
            time.sleep(0.02)
        watch.seen = {k: v for k, v in watch.seen.items() if k <= state.step}
        watch.until(proc, steps=state.step + 1)
        resume_seconds.append(time.monotonic() - started)
        base = state.step
        window = plan.later or (1, plan.interval)
    _, stderr = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the last resume failed (exit {proc.returncode}): {stderr[-2000:]}")
    if not interruptions:
        refuse("resume", f"the run ({steps_done(run_dir)} steps) ended before its first "
                         f"interruption: give it more steps (--steps)")
    return interruptions, resume_seconds


@dataclass
class Audit:
    """What the run's files say about its prompts and steps after the interruptions."""

    survived: int
    lost_prompts: int
    duplicated: int
    problems: list[str]


def audit(run_dir: Path, interruptions: Sequence[Interruption]) -> Audit:
    """Check the run's files against the exactly-once guarantees (see the module docstring)."""
    problems: list[str] = []
    steps = recorded_steps(run_dir)
    trace = TraceDir.open(run_dir)
    if [m["step"] for m in steps] != list(range(len(steps))):
        problems.append("the steps in metrics.jsonl have a gap or a repeat")
    if [m["policy/version"] for m in steps] != list(range(len(steps))):
        problems.append("the policy versions have a gap or a repeat")
    if trace.steps() != list(range(len(steps))):
        problems.append("the PolyTrace steps differ from the metrics' steps")
    trained_at: dict[int, list[int]] = {}  # prompt -> the steps that trained it
    for step in trace.steps():
        for record in trace.workload(step):
            if record.sample_id == 0:
                trained_at.setdefault(record.prompt_group_id, []).append(step)
    last = RunState.read(find_checkpoint(run_dir))
    if last.step != len(steps):
        problems.append(f"the last checkpoint is of step {last.step}, not the run's end")
    sampler = last.pipeline["sampler"]
    in_flight_end = set(sampler["again"])
    tasks = train_tasks(run_dir)
    passes = int(sampler["passes"])
    duplicated = sum(len(s) - passes for s in trained_at.values() if len(s) > passes)
    if duplicated:
        problems.append(f"{duplicated} prompt trainings beyond one per pass ({passes} passes)")
    handed_out = (passes - 1) * tasks + tasks - len(sampler["order"])
    settled = {o: sum(int(m.get(f"groups/{o}", 0)) for m in steps) for o in OUTCOMES_SETTLED}
    trained = sum(len(s) for s in trained_at.values())
    if settled["trained"] != trained:
        problems.append(f"the metrics count {settled['trained']} groups trained, the trace {trained}")
    unaccounted = handed_out - sum(settled.values()) - len(in_flight_end)
    if unaccounted:
        problems.append(f"{handed_out} prompts handed out, {sum(settled.values())} settled and "
                        f"{len(in_flight_end)} in flight at the end: {unaccounted} unaccounted")
    survived = 0
    lost_prompts = max(0, unaccounted)
    for n, i in enumerate(interruptions):
        missing = {p for p in i.again - in_flight_end
                   if not any(s >= i.resumed_from for s in trained_at.get(p, []))}
        dropped_after = sum(int(m.get(f"groups/{o}", 0)) for m in steps[i.resumed_from:]
                            for o in OUTCOMES_SETTLED if o != "trained")
        lost = max(0, len(missing) - dropped_after)
        lost_prompts += lost
        ok = i.exit_ok and not lost
        if i.signal == "SIGTERM":
            ok &= i.resumed_from == i.recorded  # nothing recorded is redone
        else:
            ok &= i.resumed_from == i.newest  # the newest complete checkpoint
        if not ok:
            problems.append(f"interruption {n + 1} ({i.signal} at {i.recorded} steps, resumed "
                            f"from {i.resumed_from}, newest checkpoint {i.newest}): "
                            f"{len(missing)} of its {len(i.again)} prompts in flight not rolled "
                            f"out again ({dropped_after} dropped after it), exit as expected: "
                            f"{i.exit_ok}")
        survived += ok
    if problems[:1] and not problems[0].startswith("interruption"):
        survived = 0  # the whole run's accounting failed: no interruption is known survived
    return Audit(survived, lost_prompts, duplicated, problems)


def train_tasks(run_dir: Path) -> int:
    """The size of the run's train split, from its own config."""
    from omegaconf import OmegaConf

    from orchestrator.config.read import build_env

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


def soak(args: argparse.Namespace) -> None:
    base, most = (SMOKE, 5) if args.smoke else (SOAK, 100)
    run = [*base, f"pipeline.max_staleness={args.k}"]
    if args.steps:
        run.append(f"pipeline.num_steps={args.steps}")
    count = args.interruptions or (2 if args.smoke else 20)
    plan = Plan(count=count, first=(1, most), later=(1, most), sigterm_share=0.5)
    print(f"bench.resume --soak: {' '.join(run)}; {plan.count} interruptions (SIGKILL or "
          f"SIGTERM) 1-{most} steps after each resume point (seed {args.seed}); {machine()}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-resume-soak-") as tmp:
        run_dir = Path(tmp) / "run"
        interruptions, _ = interrupt_and_resume(run_dir, run, plan, random.Random(args.seed))
        result = audit(run_dir, interruptions)
    kinds = Counter(i.signal for i in interruptions)
    print(f"{len(interruptions)} interruptions ({kinds['SIGKILL']} SIGKILL, {kinds['SIGTERM']} "
          f"SIGTERM) of {plan.count} planned; prompts trained beyond once a pass: "
          f"{result.duplicated}")
    for problem in result.problems:
        print(f"problem: {problem}")
    print(f"exactly_once={result.survived}/{len(interruptions)}")
    print(f"lost_prompts={result.lost_prompts}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="experiment=smoke, a checkpoint every 10 steps, one kill (not the "
                             "defaults)")
    add_smoke(parser)
    parser.add_argument("--soak", action="store_true",
                        help="the exactly-once audit: 20 SIGKILLs and SIGTERMs of the default "
                             "experiment (a checkpoint every 50 steps)")
    parser.add_argument("--k", type=int, default=1, help="--soak: pipeline.max_staleness")
    parser.add_argument("--interruptions", type=int, default=0,
                        help="--soak: how many (default 20; 2 with --smoke)")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="pipeline.num_steps (default: "
                        "the experiment's)")
    parser.add_argument("--seed", type=int, default=0, help="where the interruptions fall")
    args = parser.parse_args()
    if args.soak:
        soak(args)
        return
    small = args.quick or args.smoke
    run, kills = (SMOKE if args.smoke else QUICK, 1) if small else (RUN, args.kills)
    if args.steps:
        run = [*run, f"pipeline.num_steps={args.steps}"]
    print(f"bench.resume: {' '.join(run)}; {kills} SIGKILLs, placed by steps (seed {args.seed}); "
          f"load average {os.getloadavg()[0]:.1f}; {machine()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        run_dir = Path(tmp) / "run"
        plan = Plan(count=kills)
        interruptions, resume_seconds = interrupt_and_resume(run_dir, run, plan,
                                                             random.Random(args.seed))
        result = audit(run_dir, interruptions)
        summary = json.loads((run_dir / "summary.json").read_text())
        share = (summary["checkpoint_pause_s"] / summary["rl_seconds"],
                 summary["checkpoint_write_s"] / summary["rl_seconds"])
        print(f"{len(interruptions)} kills of {kills}; steps recorded: "
              f"{len(recorded_steps(run_dir))}; checkpoint interval: {plan.interval} steps")
        print(f"resume time (start to first new step): "
              f"{sum(resume_seconds) / len(resume_seconds):.1f} s")
        print(f"checkpoints: {summary['checkpoints']:.0f} over {summary['rl_seconds']:.0f} s of "
              f"RL; the trainer waited {100 * share[0]:.2f}% of it (snapshots), background "
              f"writes took {100 * share[1]:.2f}% (target <= 3%)")
        for problem in result.problems:
            print(f"problem: {problem}")
        models = [("default (conf/model/tiny)", {})] + ([] if args.smoke else [("100M Llama", BIG)])
        for name, model in models:
            captured, written, size, params = checkpoint_cost(model, Path(tmp) / f"ckpt-{len(model)}")
            print(f"checkpoint of the {name} model ({params / 1e6:.1f} M params, Adam state, "
                  f"{size:.1f} MB): snapshot {captured:.3f} s (the trainer waits), write "
                  f"{written:.2f} s (in the background)", flush=True)
    print(f"duplicated_samples={result.duplicated}")
    print(f"lost_prompts={result.lost_prompts}")
    print(f"steps_lost_max={max(i.recorded - i.resumed_from for i in interruptions)}")
    print(f"checkpoint_share_pct={100 * sum(share):.2f}")
    print(f"work_lost_max_s={max(i.seconds_lost for i in interruptions):.1f}")


if __name__ == "__main__":
    main()
