"""Chaos soak: a multi-turn tool run under Ray with two engines while a seeded injector breaks
things at random moments, then an audit of the run from its own files that nothing was lost.

The run is ``experiment=code env=code_tool`` (the model may run code in its episode's Docker
sandbox before it answers; every answer is graded in a sandbox too) under ``launcher=ray`` on a
local Ray cluster this bench starts (one node, 3 CPUs: two engine actors and the trainer), with
``resume=auto`` and a fixed ``hydra.run.dir``, started as a user would (``python -m
orchestrator``). After the first trained step the injector acts, one fault at a time, at
random moments drawn from ``--seed``, cycling through a shuffled plan of:

* ``engine``: an engine actor SIGKILLed (Ray restarts it, the router carries on with the
  other meanwhile and runs the lost requests again; ``faults/engine_restarts``);
* ``container``: ``docker kill`` of one of the run's sandbox containers (the pool runs the
  call again in a fresh one; ``faults/sandbox_lost``);
* ``docker``: the Docker engine frozen (``kill -STOP`` of dockerd, ``kill -CONT`` 3–6 s later,
  also if this bench fails; the pool's watch sees the outage and calls wait for the engine;
  ``faults/docker_unreachable``);
* ``driver``: the driver SIGKILLed and the same command started again (``resume=auto`` goes on
  from its last checkpoint; ``faults/resumes``).

After each fault it waits for two more trained steps before the next. At the end of
``--minutes`` it sends SIGTERM (the run stops after the step in progress) and audits, from the
PolyTrace step files (:class:`~orchestrator.trace.reader.TraceDir`), ``metrics.jsonl`` and
``docker ps`` only: every trained sample appears once (``prompt_group_id``, ``sample_id``),
every step 0..N-1 is there once with ``batch_size`` samples, staleness <= k for every sample,
no container of the run's drivers is left, and each kind of fault injected is counted at
least as often in the last ``faults/*`` record. ``chaos_lost`` is the sum of everything the
audit found wrong (samples missing or repeated, steps missing, staleness violations,
containers left, faults not counted). ``--quick``: one fault of each kind, about 4 minutes.
Last line: ``chaos_lost=<n>`` (target 0).

Not covered: the search service's faults (500s, hangs, slow answers) need ``env=search_qa``,
a run of its own.
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
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
KINDS = ("engine", "container", "docker", "driver")
COUNTER = {"engine": "faults/engine_restarts", "container": "faults/sandbox_lost",
           "docker": "faults/docker_unreachable", "driver": "faults/resumes"}
BATCH, K = 8, 1
RUN = ["experiment=code", "env=code_tool", "rollout.max_turns=2", "logger=none",
       "progress=false", "model.device=cpu", f"pipeline.batch_size={BATCH}",
       "pipeline.num_workers=4", f"pipeline.max_staleness={K}", "pipeline.num_steps=100000",
       "warmstart.steps=2", "warmstart.target_accuracy=null", "eval.num_tasks=0",
       "sandbox.pool_size=4", "sandbox.max_containers=8", "sandbox.max_idle=8",
       "launcher=ray", "launcher.num_engines=2", "launcher.placement=pack", "resume=auto"]
STEP_WAIT_S = 240  # a fault's handling: the next steps must come within this


def driver_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines()
               if line.endswith("}") and '"time/step"' in line)


def dockerd_pid() -> int:
    return int(subprocess.check_output(["pidof", "dockerd"], text=True).split()[0])


@dataclass
class Chaos:
    """The driver process, the Ray cluster it uses, and the faults injected so far."""

    run_dir: Path
    command: list[str]
    namespace: str
    rng: random.Random
    driver: subprocess.Popen[str] | None = None
    drivers: list[int] = field(default_factory=list)  # every driver process's pid
    injected: Counter[str] = field(default_factory=Counter)
    log: list[str] = field(default_factory=list)

    def start(self) -> None:
        stderr = (self.run_dir.parent / f"driver-{len(self.drivers)}.log").open("w")
        self.driver = subprocess.Popen(self.command, cwd=REPO, env=driver_env(),
                                       stdout=subprocess.DEVNULL, stderr=stderr, text=True)
        self.drivers.append(self.driver.pid)

    def alive(self) -> bool:
        return self.driver is not None and self.driver.poll() is None

    def wait_steps(self, count: int, deadline_s: float = STEP_WAIT_S) -> None:
        deadline = time.monotonic() + deadline_s
        while steps_done(self.run_dir) < count:
            if not self.alive():
                tail = (self.run_dir.parent / f"driver-{len(self.drivers) - 1}.log").read_text()
                raise RuntimeError(f"the driver ended early:\n{tail[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no step {count} within {deadline_s} s")
            time.sleep(0.2)

    def note(self, kind: str, what: str) -> None:
        self.injected[kind] += 1
        line = f"[{time.strftime('%H:%M:%S')}] step {steps_done(self.run_dir)}: {kind}: {what}"
        self.log.append(line)
        print(line, flush=True)

    # -- faults ----------------------------------------------------------------------------

    def kill_engine(self) -> bool:
        import ray

        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == self.namespace and "engine" in a["name"]]
        if not names:
            return False
        name = self.rng.choice(sorted(names))
        actor = ray.get_actor(name, namespace=self.namespace)
        deadline = time.monotonic() + 30  # mid-generation, when there is one
        while time.monotonic() < deadline and ray.get(actor.inflight.remote(), timeout=30) == 0:
            time.sleep(0.02)
        pid = ray.get(actor.pid.remote(), timeout=30)
        os.kill(pid, signal.SIGKILL)
        self.note("engine", f"SIGKILL {name} (pid {pid})")
        return True

    def containers(self, running: bool = True) -> list[str]:
        ids: list[str] = []
        for pid in self.drivers:
            out = subprocess.run(
                ["docker", "ps", "-q", *([] if running else ["-a"]),
                 "--filter", "label=polyrl.sandbox=1", "--filter", f"label=polyrl.owner_pid={pid}"],
                capture_output=True, text=True, check=True).stdout
            ids += out.split()
        return ids

    def kill_container(self) -> bool:
        ids = self.containers()
        if not ids:
            return False
        busy = [i for i in ids if _busy(i)]  # one executing code, when there is one
        target = self.rng.choice(busy or ids)
        subprocess.run(["docker", "kill", target], capture_output=True, check=False)
        self.note("container", f"docker kill {target[:12]}{' (mid-exec)' if busy else ''}")
        return True

    def freeze_docker(self) -> bool:
        pid, seconds = dockerd_pid(), self.rng.uniform(3.0, 6.0)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        self.note("docker", f"dockerd stopped for {seconds:.1f} s")
        return True

    def kill_driver(self) -> bool:
        assert self.driver is not None
        self.driver.send_signal(signal.SIGKILL)
        self.driver.wait()
        self.note("driver", f"SIGKILL driver (pid {self.driver.pid}); started again with "
                            "resume=auto")
        self.start()
        return True

    def inject(self, kind: str) -> bool:
        act: dict[str, Callable[[], bool]] = {
            "engine": self.kill_engine, "container": self.kill_container,
            "docker": self.freeze_docker, "driver": self.kill_driver}
        return act[kind]()

    def stop(self, timeout: float = 240) -> int:
        """SIGTERM: the run ends after the step in progress; its exit code."""
        if not self.alive():
            return self.driver.returncode if self.driver is not None else -1
        assert self.driver is not None
        self.driver.send_signal(signal.SIGTERM)
        try:
            return self.driver.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.driver.kill()
            return self.driver.wait()


def _busy(container: str) -> bool:
    """Whether the container runs a process beyond its init, keep-alive and runner."""
    out = subprocess.run(["docker", "top", container, "-eo", "pid"], capture_output=True,
                         text=True, check=False).stdout
    return len(out.split()) - 1 > 3


def audit(chaos: Chaos, batch: int, k: int) -> dict[str, Any]:
    """What the run's own files say: the counts, and everything found wrong."""
    from orchestrator.trace.reader import TraceDir

    run_dir = chaos.run_dir
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.endswith("}")]
    records = [m for m in metrics if "time/step" in m]
    steps = [int(m["step"]) for m in records]
    expected = list(range(len(steps)))
    trace = TraceDir.open(run_dir)
    samples: Counter[tuple[int, int]] = Counter()
    wrong_batch = stale = 0
    for step in trace.steps():
        workload = list(trace.workload(step))
        wrong_batch += abs(len(workload) - batch)
        for r in workload:
            samples[(r.prompt_group_id, r.sample_id)] += 1
            info = r.polyrl
            if info is None or info.staleness is None or not 0 <= info.staleness <= k:
                stale += 1
    last = records[-1] if records else {}
    counted = {kind: int(last.get(COUNTER[kind], 0)) for kind in KINDS}
    uncounted = {kind: max(0, chaos.injected[kind] - counted[kind]) for kind in KINDS}
    left = chaos.containers(running=False)
    return {
        "steps": len(steps),
        "steps_missing": len(set(expected) - set(steps)) + (len(steps) - len(set(steps))),
        "trace_steps_missing": len(set(expected) - set(trace.steps())),
        "samples": sum(samples.values()),
        "samples_repeated": sum(n - 1 for n in samples.values() if n > 1),
        "batch_size_off": wrong_batch,
        "staleness_over_k": stale,
        "containers_left": len(left),
        "injected": dict(chaos.injected),
        "counted": counted,
        "uncounted": uncounted,
        "faults": {key: v for key, v in last.items() if key.startswith("faults/")},
    }


def soak(minutes: float, quick: bool, seed: int, keep: Path | None) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster

    rng = random.Random(seed)
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": 3, "include_dashboard": False})
    tmp = tempfile.TemporaryDirectory(prefix="bench-chaos-")
    root = keep or Path(tmp.name)
    run_dir = root / "run"
    namespace = f"chaos-{uuid.uuid4().hex[:6]}"
    command = [sys.executable, "-m", "orchestrator", *RUN, f"launcher.address='{cluster.address}'",
               f"launcher.namespace={namespace}", f"hydra.run.dir={run_dir}",
               *(["checkpoint.every_s=10"] if quick else [])]
    chaos = Chaos(run_dir, command, namespace, rng)
    started = time.monotonic()
    try:
        ray.init(address=cluster.address, logging_level="ERROR", namespace=namespace)
        chaos.start()
        chaos.wait_steps(1, deadline_s=600)  # Ray, the sandbox pool, the warm start
        plan: list[str] = []
        end = started + minutes * 60
        while True:
            if not plan:
                if quick and chaos.injected:
                    break
                plan = list(KINDS)
                rng.shuffle(plan)
            time.sleep(rng.uniform(1.0, 8.0 if quick else 30.0))
            if time.monotonic() > end - (30 if quick else 90):
                break  # room for the last fault's handling
            kind = plan.pop()
            before = steps_done(run_dir)
            if chaos.inject(kind):
                chaos.wait_steps(max(steps_done(run_dir), before) + 2)
        chaos.wait_steps(steps_done(run_dir) + 1)
        code = chaos.stop()
        print(f"the driver stopped by SIGTERM (exit code {code}) after "
              f"{(time.monotonic() - started) / 60:.1f} min", flush=True)
        time.sleep(2)  # auto-remove of the last containers is asynchronous
        return audit(chaos, BATCH, K)
    finally:
        if chaos.alive():
            assert chaos.driver is not None
            chaos.driver.kill()
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        if keep is None:
            tmp.cleanup()


def lost(result: dict[str, Any]) -> int:
    return (result["steps_missing"] + result["trace_steps_missing"] + result["samples_repeated"]
            + result["batch_size_off"] + result["staleness_over_k"] + result["containers_left"]
            + sum(result["uncounted"].values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true",
                        help="one fault of each kind, within 5 minutes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the run directory under this folder")
    args = parser.parse_args()
    minutes = min(args.minutes, 4.5) if args.quick else args.minutes
    print(f"bench.chaos: {minutes:g} min, seed {args.seed}, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    result = soak(minutes, args.quick, args.seed, args.keep)
    print(f"steps {result['steps']} (missing {result['steps_missing']}, trace files missing "
          f"{result['trace_steps_missing']}); samples {result['samples']} (repeated "
          f"{result['samples_repeated']}, batch size off by {result['batch_size_off']}); "
          f"staleness > {K}: {result['staleness_over_k']}; containers left: "
          f"{result['containers_left']}")
    for kind in KINDS:
        print(f"{kind:9s} injected {result['injected'].get(kind, 0)}  counted "
              f"{result['counted'][kind]} ({COUNTER[kind]})")
    print("faults/*: " + json.dumps(result["faults"]))
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(f"chaos_lost={lost(result)}")


if __name__ == "__main__":
    main()
