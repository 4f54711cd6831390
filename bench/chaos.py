"""Chaos soak: tool runs under Ray with two engines while a seeded injector breaks things at
random moments, then an audit of each run from its own files that nothing was lost.

Two runs, one after the other, on a local Ray cluster this bench starts (one node, 3 CPUs: two
engine actors and the trainer), each started as a user would (``python -m orchestrator
launcher=ray launcher.num_engines=2 resume=auto hydra.run.dir=…``):

* ``code_tool`` (``experiment=code env=code_tool``: the model may run code in its episode's
  Docker sandbox before it answers, and every answer is graded in a sandbox), with the faults
  ``engine``: an engine actor SIGKILLed mid-generation (Ray restarts it; the router carries on
  with the other and runs the lost requests again; ``faults/engine_restarts``),
  ``container``: ``docker kill`` of one of the running driver's sandbox containers, one a
  session has run code in when there is one (a call lost with it runs again in a fresh
  container; one killed between calls is found at its reset; ``faults/sandbox_lost``), ``docker``: the Docker engine frozen 4.5–7.5 s (``kill -STOP`` of
  dockerd, then ``kill -CONT``, also if this bench fails; the pool's watch sees the outage and
  unanswered calls wait for it; ``faults/docker_unreachable``), and ``driver``: the driver
  SIGKILLed and the same command started again (``resume=auto`` goes on from its last
  checkpoint; ``faults/resumes``);
* ``search_qa`` (``experiment=search_qa`` against the mock search server in a process of its
  own, ``python -m sandboxes.search --control``), with ``search_error`` (every request
  answered HTTP 500 for 3–6 s; ``faults/search_errors`` per failed attempt), ``search_hang``
  (requests held unanswered; ``faults/search_timeouts`` per attempt the client gave up on),
  ``search_slow`` (answers 1 s late, within the client's timeout: ridden out, and each
  answer that late counted in ``faults/search_slow``, so it may count naturally slow ones too),
  ``engine`` and ``driver``.

* ``attestation`` and ``attestation_lora`` (``experiment=arithmetic``, no Docker, weight decay so
  every version's weights differ from the last; the engines are
  :class:`bench.faulty_engine.ChaosEngine`, torch engines that load wrongly when the bench arms
  them): :data:`CLEAN_STEPS` trained steps with no fault, then weight attestation's faults, each
  armed after a trained step and taken by the next load of whichever engine claims it:
  ``attest_skip`` (the load skipped, the new version reported), ``attest_partial`` (one tensor
  left old), ``attest_restart`` (the starting weights, told the current version) and, in the
  LoRA run (``trainer.lora.r=4``), ``attest_adapter`` (the previous update's adapters under the
  new version). Runs of their own: a partial load needs full weights and an adapter one LoRA,
  and the default experiment trains 200 clean steps in seconds where ``code_tool`` would take
  many minutes. A wrong load whose weights served no token a batch trained (the other engine
  took that version's requests) has nothing to detect: it is shown and armed again.

After the first trained step the injector acts one fault at a time, cycling through a shuffled
plan of the run's kinds, and waits for two more trained steps after each. At the end of the
run's share of ``--minutes`` it sends SIGTERM (the run stops after the step in progress) and
audits, from the PolyTrace step files (:class:`~orchestrator.trace.reader.TraceDir`),
``metrics.jsonl``, ``docker ps`` and the search server's own count of the requests it failed:
every trained sample appears once (``prompt_group_id``, ``sample_id``), every step 0..N-1 is
there once with ``batch_size`` samples, staleness <= k for every sample, no container of the
run's drivers is left, and each fault injected is counted in the last ``faults/*`` record (a
search fault once per request it met). ``chaos_lost`` sums everything the audit found wrong
(samples repeated, steps or trace files missing, batch sizes off, staleness violations,
containers left, faults not counted). ``--quick``: one fault of each kind per run (about 3.5
minutes). ``--smoke`` (the tests', a minute or two: the cluster's, the actors' and the restarted
driver's start): the ``code_tool`` run alone on the toy model (:data:`bench.cli.TOY_MODEL`),
one fault of each kind, each placed by events, not seconds: after the next trained step (the
driver's kill once a checkpoint is complete too; one is written every step), so it runs the
same on a machine twice as fast or twice as slow; its audit is real, the run is short.
``--keep DIR`` keeps the run directories.

The attestation audit (:func:`audit_attestation`), from the same files and ``train.log``: each
fault is detected in the first step whose batch holds tokens of its wrong weights
(``faults/attestation`` rises there), its engine is named in ``train.log``, and none of those
tokens is trained (the loss mask of every PolyTrace record); ``attestation_missed=<n>`` counts
the faults that fail one of these (and a kind none of whose faults reached a batch). Over every
stretch with no attestation fault (the ``code_tool`` and ``search_qa`` runs, whose torch engines
attest, and the attestation runs before their first fault) no failure may be counted, nor more
than the faults detected after it: ``attestation_false=<n>``, printed only over at least
:data:`CLEAN_STEPS` such steps. Both targets 0; each figure is refused in one line at a size
that did not measure it (``--smoke`` runs ``code_tool`` alone: no attestation fault). Last line:
``chaos_lost=<n>`` (target 0; attestation's figures are not part of it).

Needs root (``kill -STOP`` of dockerd), a Docker engine with the sandbox image, and the ray
extra; without one of them the bench says so in one line and exits with status 3. Freezing
dockerd stalls every Docker client on the machine for those seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cli import TOY_MODEL, add_smoke, headline, refuse
from bench.faulty_engine import ARMED
from sandboxes.docker.outage import WATCH_PING_S, WATCH_S

REPO = Path(__file__).resolve().parents[1]
# the counter each kind of fault must show up in (None: nothing to count, only ridden out)
COUNTER: dict[str, str | None] = {
    "engine": "faults/engine_restarts", "container": "faults/sandbox_lost",
    "docker": "faults/docker_unreachable", "driver": "faults/resumes",
    "search_error": "faults/search_errors", "search_hang": "faults/search_timeouts",
    "search_slow": "faults/search_slow"}
# weight attestation's faults (bench/faulty_engine.py): each audited on its own (detected in
# the first batch with its tokens, its engine named, its tokens not trained), not by a count
ATTESTATION = {"attest_skip": "skip", "attest_partial": "partial",
               "attest_restart": "restart", "attest_adapter": "adapter"}
ATTESTED = "faults/attestation"
CLEAN_STEPS = 200  # steps with no attestation fault before the first one (--quick and longer)
BATCH, K = 8, 1
COMMON = ["logger=none", "progress=false", "model.device=cpu", f"pipeline.batch_size={BATCH}",
          "pipeline.num_workers=4", f"pipeline.max_staleness={K}", "pipeline.num_steps=100000",
          "warmstart.target_accuracy=null", "eval.num_tasks=0", "launcher=ray",
          "launcher.num_engines=2", "launcher.placement=pack", "resume=auto"]
SEARCH_PEOPLE = (2000, 200, 0)  # env.train_size, env.eval_size, seed: the corpus the run asks
STEP_WAIT_S = 240  # a fault's handling: the next steps must come within this
SMOKE_TRIES = 5  # --smoke, and attestation's faults: one that found nothing to act on is tried
# again after a step
ATTEST_AFTER = 3  # trained steps after an attestation fault: its tokens reach a batch (k = 1)
REMOVED_WAIT_S = 60  # the run's containers' removal after it ends (auto-remove is asynchronous)


@dataclass(frozen=True)
class Phase:
    """One run of the soak: its overrides, the faults injected into it, its share of the time."""

    name: str
    run: tuple[str, ...]
    kinds: tuple[str, ...]
    share: float
    clean_steps: int = 0  # trained before the first fault: a stretch with none injected

    @property
    def attests(self) -> bool:
        """Whether its faults are attestation's (its engines are bench.faulty_engine's)."""
        return any(kind in ATTESTATION for kind in self.kinds)


CODE = Phase("code_tool", (
    "experiment=code", "env=code_tool", "rollout.max_turns=2", "warmstart.steps=2",
    "sandbox.pool_size=4", "sandbox.max_containers=8", "sandbox.max_idle=8", *COMMON),
    ("engine", "container", "docker", "driver"), 0.6)
# the tiny model learns to call the search tool in ~50 supervised steps (2 steps: it never does)
SEARCH = Phase("search_qa", (
    "experiment=search_qa", "warmstart.steps=50", "warmstart.lr=3e-3", "warmstart.batch_size=32",
    f"env.train_size={SEARCH_PEOPLE[0]}", f"env.eval_size={SEARCH_PEOPLE[1]}",
    f"seed={SEARCH_PEOPLE[2]}", "env.request_timeout=2", "env.retries=3", *COMMON),
    ("search_error", "search_hang", "search_slow", "engine", "driver"), 0.4)
# Weight attestation's faults in runs of their own: they need the engines that misload on
# cue (bench/faulty_engine.py), a partial load needs full weights and an adapter one LoRA, and
# the default experiment (no Docker) trains 200 clean steps in seconds. Every step changes
# the weights (weight decay), so a version's weights differ from the previous one's.
_ATTEST_RUN = ("experiment=arithmetic", "warmstart.steps=0", "trainer.weight_decay=0.1",
               "rollout.max_tokens=8", "checkpoint.every=50",
               "engine._target_=bench.faulty_engine.ChaosEngine", *COMMON)
ATTEST = Phase("attestation", _ATTEST_RUN, ("attest_skip", "attest_partial", "attest_restart"),
               0.0, clean_steps=CLEAN_STEPS)
ATTEST_LORA = Phase("attestation_lora", (*_ATTEST_RUN, "trainer.lora.r=4"), ("attest_adapter",),
                    0.0)
PHASES = (CODE, SEARCH, ATTEST, ATTEST_LORA)
KINDS = tuple(dict.fromkeys(k for phase in PHASES for k in phase.kinds))


def driver_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines()
               if line.endswith("}") and '"time/step"' in line)


def attested(run_dir: Path) -> int:
    """The run's count of attestation failures so far (its last step's)."""
    last = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.endswith("}") and '"time/step"' in line][-1:]
    return int(json.loads(last[0]).get(ATTESTED, 0)) if last else 0


# The shortest dockerd freeze: the pool's watch starts a ping at most WATCH_S after the last
# one answered and counts an outage once one goes WATCH_PING_S unanswered, so a freeze
# shorter than their sum may go unseen; 1.5 s more for a loaded host's event-loop lag (a
# freeze drawn from 3-6 s could end as its first unanswered ping was still waiting).
FREEZE_MIN_S = WATCH_S + WATCH_PING_S + 1.5


def dockerd_pid() -> int:
    return int(subprocess.check_output(["pidof", "dockerd"], text=True).split()[0])


@dataclass
class Chaos:
    """The driver process, the Ray cluster it uses, and the faults injected so far."""

    run_dir: Path
    command: list[str]
    namespace: str
    rng: random.Random
    search_url: str | None = None  # the search server's, with its /faults control
    fault_dir: Path | None = None  # where attestation faults are armed (bench/faulty_engine.py)
    docker: bool = True  # whether its run has sandbox containers to look for
    driver: subprocess.Popen[str] | None = None
    drivers: list[int] = field(default_factory=list)  # every driver process's pid
    injected: Counter[str] = field(default_factory=Counter)
    log: list[str] = field(default_factory=list)
    # each attestation fault injected: the engine's record (its engine, version, the
    # fingerprint it reported) and the trained steps before it
    misloads: list[dict[str, Any]] = field(default_factory=list)

    def start(self) -> None:
        with (self.run_dir.parent / f"driver-{len(self.drivers)}.log").open("w") as stderr:
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

    def wait_checkpoint(self, deadline_s: float = STEP_WAIT_S) -> None:
        """Until the run has a complete checkpoint (a driver killed before one starts over)."""
        from orchestrator.run.checkpoint import CheckpointStore

        store = CheckpointStore(self.run_dir / "checkpoints")
        deadline = time.monotonic() + deadline_s
        while not store.steps():
            if not self.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"no checkpoint within {deadline_s} s (the driver "
                                   f"{'runs' if self.alive() else 'ended'})")
            time.sleep(0.2)

    def wait_removed(self, deadline_s: float = REMOVED_WAIT_S) -> None:
        """Until no container of the run's drivers is left, or the deadline: the audit counts
        what is left then."""
        deadline = time.monotonic() + deadline_s
        while self.containers(running=False) and time.monotonic() < deadline:
            time.sleep(0.5)

    def note(self, kind: str, what: str, count: int = 1) -> None:
        self.injected[kind] += count
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

    def containers(self, running: bool = True, live: bool = False) -> list[str]:
        """The sandbox containers of the run's drivers (``live``: of the driver running now)."""
        ids: list[str] = []
        if not self.docker:
            return ids
        pids = self.drivers[-1:] if live else self.drivers
        for pid in pids:
            out = subprocess.run(
                ["docker", "ps", "-q", *([] if running else ["-a"]),
                 "--filter", "label=polyrl.sandbox=1", "--filter", f"label=polyrl.owner_pid={pid}"],
                capture_output=True, text=True, check=True).stdout
            ids += out.split()
        return ids

    def kill_container(self) -> bool:
        # the running driver's: a killed driver's containers are its successor's reaper's to
        # remove, and a kill of one of them is a fault no run sees
        if not self.alive() or not (ids := self.containers(live=True)):
            return False
        used = [i for i in ids if _used(i)]  # one a session has run code in, when there is one
        target = self.rng.choice(used or ids)
        if subprocess.run(["docker", "kill", target], capture_output=True,
                          check=False).returncode != 0:
            return False  # gone already (removed by the pool): nothing injected
        self.note("container", f"docker kill {target[:12]}{' (it has run code)' if used else ''}")
        return True

    def freeze_docker(self) -> bool:
        pid, seconds = dockerd_pid(), self.rng.uniform(FREEZE_MIN_S, FREEZE_MIN_S + 3.0)
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

    def search_fault(self, mode: str) -> bool:
        """500s, held requests or slow answers for 3–6 s; True when a request met them."""
        seconds = self.rng.uniform(3.0, 6.0)
        served = _faults(self.search_url, mode=mode, seconds=seconds, delay_s=1.0)
        time.sleep(seconds)
        met = _faults(self.search_url)[mode] - served[mode]
        if not met:
            print(f"search {mode} for {seconds:.1f} s met no request: not counted as injected",
                  flush=True)
            return False
        # each request the server failed is one fault the run must count (a failed attempt)
        self.note(f"search_{mode}", f"{mode} for {seconds:.1f} s ({met} requests)", count=met)
        return True

    def misload(self, kind: str) -> bool:
        """Arm an attestation fault: the next weight load of one engine (the first to claim
        it) goes wrong; True once the engine says its wrong load left it holding weights
        other than those published for the version, False when it changed nothing."""
        assert self.fault_dir is not None
        number = len(list(self.fault_dir.glob("claimed-*")))
        before, counted = steps_done(self.run_dir), attested(self.run_dir)
        tmp = self.fault_dir / ".armed.json"
        tmp.write_text(json.dumps({"kind": ATTESTATION[kind], "id": number}))
        tmp.replace(self.fault_dir / ARMED)
        deadline = time.monotonic() + STEP_WAIT_S
        while True:  # until an engine's next load (after the next step) has taken it
            if (done := self.fault_dir / f"injected-{number}.json").is_file():
                record = json.loads(done.read_text())
                self.misloads.append({**record, "kind": kind, "steps_before": before,
                                      "counted_before": counted})
                self.note(kind, f"{replica(record['engine'])} loaded version "
                                f"{record['version']} wrongly ({ATTESTATION[kind]})")
                return True
            if (self.fault_dir / f"ineffective-{number}.json").is_file():
                print(f"{kind}: the wrong load changed nothing the engine serves (the update "
                      "left those weights alone): not counted as injected", flush=True)
                return False
            if not self.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{kind}: no engine loaded weights within {STEP_WAIT_S} s "
                                   f"(the driver {'runs' if self.alive() else 'ended'})")
            time.sleep(0.1)

    def unseen(self) -> bool:
        """Whether the last attestation fault's wrong weights reached no batch (the run counted
        no failure since): an engine that served no trained token in that version's window."""
        return attested(self.run_dir) <= self.misloads[-1]["counted_before"]

    def inject(self, kind: str) -> bool:
        if kind in ATTESTATION:
            return self.misload(kind)
        act: dict[str, Callable[[], bool]] = {
            "engine": self.kill_engine, "container": self.kill_container,
            "docker": self.freeze_docker, "driver": self.kill_driver,
            "search_error": lambda: self.search_fault("error"),
            "search_hang": lambda: self.search_fault("hang"),
            "search_slow": lambda: self.search_fault("slow")}
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


def replica(actor: str) -> str:
    """The router's name of an engine (``engine-0``) from its actor's (``<run>-engine-0``)."""
    return "engine-" + actor.rsplit("-engine-", 1)[-1] if "-engine-" in actor else actor


def _faults(url: str | None, **turn_on: Any) -> Counter[str]:
    """The search server's served-fault counts (after turning a mode on, with ``turn_on``)."""
    assert url is not None
    data = json.dumps(turn_on).encode() if turn_on else None
    request = urllib.request.Request(f"{url}/faults", data=data, method="POST" if data else "GET",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return Counter(json.loads(response.read())["served"])


def search_server(root: Path) -> tuple[subprocess.Popen[str], str]:
    """The mock search server in a process of its own, on the corpus the run's questions are
    about, with its fault control; its URL once it answers."""
    from envs.search_qa import SearchQASpec

    train, eval_, seed = SEARCH_PEOPLE
    spec = SearchQASpec(train_size=train, eval_size=eval_, seed=seed, latency="none")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": d.id, "contents": d.contents}) + "\n"
                              for d in spec.documents))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "sandboxes.search", "--corpus", str(corpus), "--port", str(port),
         "--latency", "none", "--control"], cwd=REPO, stdout=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            _faults(url)
            return server, url
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError("the search server did not start") from None
            time.sleep(0.2)


def _used(container: str) -> bool:
    """Whether the container runs a process beyond its init, keep-alive and runner supervisor:
    the session kernel the runner forks for the first code it runs, so a container a session
    has run code in (running code now or not: a call runs in that kernel)."""
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
    # a trained sample: its group and index, and who rolled it out when (a prompt comes back
    # on every pass over the train split, so its id alone repeats in a long run)
    samples: Counter[tuple[int, int, str, float]] = Counter()
    wrong_batch = stale = 0
    for step in trace.steps():
        workload = list(trace.workload(step))
        wrong_batch += abs(len(workload) - batch)
        for r in workload:
            info = r.polyrl
            samples[(r.prompt_group_id, r.sample_id, info.worker if info else "",
                     info.start_s if info else 0.0)] += 1
            if info is None or info.staleness is None or not 0 <= info.staleness <= k:
                stale += 1
    last = records[-1] if records else {}
    counters = {kind: c for kind, c in COUNTER.items() if c is not None and kind in chaos.injected}
    counted = {kind: int(last.get(c, 0)) for kind, c in counters.items()}
    uncounted = {kind: max(0, chaos.injected[kind] - counted[kind]) for kind in counters}
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


def audit_attestation(chaos: Chaos, clean_steps: int = 0) -> dict[str, Any]:
    """Weight attestation, from the run's files: each fault injected (:attr:`Chaos.misloads`)
    is detected in the first batch that trains tokens of its wrong weights (``faults/
    attestation`` rises at that step), its engine is named in ``train.log`` and none of those
    tokens is trained (loss-masked in every PolyTrace record); the stretch before the first
    fault (the whole run if none) counts no failure, and no failure is counted beyond the
    faults injected."""
    from orchestrator.trace.reader import TraceDir

    run_dir = chaos.run_dir
    counts = {int(m["step"]): int(m.get(ATTESTED, 0))
              for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if line.endswith("}") and "time/step" in (m := json.loads(line))}
    log = run_dir / "train.log"
    named = Counter(line.split("attestation failure: engine ", 1)[1].split()[0]
                    for line in (log.read_text().splitlines() if log.is_file() else ())
                    if "attestation failure: engine " in line)
    trace = TraceDir.open(run_dir)
    records = [(step, r) for step in trace.steps() for r in trace.workload(step)]
    faults = []
    for fault in chaos.misloads:
        engine = replica(fault["engine"])
        wrong = (engine, fault["version"], fault["fingerprint"])
        steps, trained = set(), 0
        for step, r in records:
            mask = [bool(v) for v, n in r.response_loss_mask_rle for _ in range(n)]
            for seg in r.polyrl.segments if r.polyrl else ():
                if (seg.engine, seg.version, seg.fingerprint) == wrong:
                    steps.add(step)
                    trained += sum(mask[max(seg.start - r.prompt_len, 0):seg.end - r.prompt_len])
        first = min(steps, default=None)
        detected = first is not None and counts.get(first, 0) > counts.get(first - 1, 0)
        if first is not None:
            named[engine] -= 1
        faults.append({"kind": fault["kind"], "engine": engine, "version": fault["version"],
                       "fingerprint": fault["fingerprint"],
                       "after_step": fault["steps_before"], "first_trained_step": first,
                       "detected": detected, "named": first is not None and named[engine] >= 0,
                       "tokens_trained": trained})
    # a fault whose wrong weights served no trained token has nothing to detect: it is shown,
    # not audited; a kind with none that did is a miss (the bench did not show it detected)
    exercised = [f for f in faults if f["first_trained_step"] is not None]
    missed = sum(1 for f in exercised
                 if not (f["detected"] and f["named"]) or f["tokens_trained"])
    missed += len({f["kind"] for f in faults} - {f["kind"] for f in exercised})
    clean = chaos.misloads[0]["steps_before"] if chaos.misloads else len(counts)
    last = counts[max(counts)] if counts else 0
    before = counts.get(clean - 1, 0) if clean else 0
    false = before + max(0, last - before - sum(1 for f in faults if f["detected"]))
    return {"attestation": faults, "attestation_missed": missed, "attestation_false": false,
            "clean_steps": clean, "clean_steps_asked": clean_steps}


def soak(minutes: float, quick: bool, seed: int, keep: Path | None,
         phases: tuple[Phase, ...] = PHASES, smoke: bool = False,
         address: str | None = None) -> dict[str, dict[str, Any]]:
    """Run each phase in turn on one Ray cluster (``quick``: one fault of each kind; ``smoke``:
    so too, on the toy model, each fault after the next step) and return :func:`audit`'s
    findings per phase; run directories stay under ``keep`` if given. The cluster is one this
    starts (one node, 3 CPUs) and shuts down, or the running one at ``address`` (3 CPUs free:
    the trainer and two engines)."""
    import ray
    from ray.cluster_utils import Cluster

    rng = random.Random(seed)
    cluster = None if address is not None else Cluster(
        initialize_head=True, connect=False,
        head_node_args={"num_cpus": 3, "include_dashboard": False})
    address = cluster.address if cluster is not None else address
    tmp = tempfile.TemporaryDirectory(prefix="bench-chaos-") if keep is None else None
    root = Path(tmp.name) if tmp is not None else keep
    assert root is not None
    results: dict[str, dict[str, Any]] = {}
    server: subprocess.Popen[str] | None = None
    try:
        ray.init(address=address, logging_level="ERROR")
        for phase in phases:
            search_url = None
            if any(kind.startswith("search_") for kind in phase.kinds):
                server, search_url = search_server(root)
            share = phase.share / (sum(p.share for p in phases) or 1)
            results[phase.name] = run_phase(phase, root / phase.name, address, rng,
                                            minutes * share, quick or smoke, search_url, smoke)
            if server is not None:
                server.kill()
                server.wait()
                server = None
        return results
    finally:
        if server is not None:
            server.kill()
            server.wait()
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        if tmp is not None:
            tmp.cleanup()


def run_phase(phase: Phase, root: Path, address: str, rng: random.Random, minutes: float,
              quick: bool, search_url: str | None, smoke: bool = False) -> dict[str, Any]:
    run_dir = root / "run"
    root.mkdir(parents=True, exist_ok=True)
    fault_dir = root / "faults" if phase.attests else None
    if fault_dir is not None:
        fault_dir.mkdir(exist_ok=True)
    # attestation's faults: one of each, by events, whatever the size (they take seconds)
    quick = quick or phase.attests
    by_events = smoke or phase.attests
    namespace = f"chaos-{uuid.uuid4().hex[:6]}"
    command = [sys.executable, "-m", "orchestrator", *phase.run, f"launcher.address='{address}'",
               f"launcher.namespace={namespace}", f"hydra.run.dir={run_dir}",
               *([f"env.search_url={search_url}"] if search_url else []),
               *(["checkpoint.every_s=10"] if quick and not smoke else []),
               *([*TOY_MODEL, "checkpoint.every=1"] if smoke else []),
               *([f"+engine.fault_dir={fault_dir}"] if fault_dir is not None else [])]
    chaos = Chaos(run_dir, command, namespace, rng, search_url=search_url, fault_dir=fault_dir,
                  docker=not phase.attests)
    started = time.monotonic()
    length = ("one fault of each kind, each after the next step" if by_events
              else "one fault of each kind" if quick else f"{minutes:.1f} min")
    clean = f"{phase.clean_steps} clean steps, then " if phase.clean_steps else ""
    print(f"-- {phase.name}: {clean}{length}; faults: {', '.join(phase.kinds)}", flush=True)
    try:
        chaos.start()
        chaos.wait_steps(1, deadline_s=600)  # Ray actors, the sandbox pool, the warm start
        chaos.wait_steps(phase.clean_steps, deadline_s=STEP_WAIT_S + phase.clean_steps)
        plan: list[str] = []
        tries: Counter[str] = Counter()
        end = started + minutes * 60
        while True:
            if not plan:
                if quick and chaos.injected:
                    break
                plan = list(phase.kinds)
                rng.shuffle(plan)
            if by_events:  # after the next trained step (and a checkpoint, for the driver)
                chaos.wait_steps(steps_done(run_dir) + 1)
                if plan[-1] == "driver":
                    chaos.wait_checkpoint()
            else:  # at a random moment
                time.sleep(rng.uniform(1.0, 5.0 if quick else 20.0))
            if not quick and time.monotonic() > end - 60:
                break  # room for the last fault's handling
            kind = plan.pop()
            before = steps_done(run_dir)
            if chaos.inject(kind):
                after = ATTEST_AFTER if kind in ATTESTATION else 2
                chaos.wait_steps(max(steps_done(run_dir), before) + after)
                if kind in ATTESTATION and chaos.unseen() and tries[kind] < SMOKE_TRIES:
                    tries[kind] += 1  # no batch had its tokens (the audit tells): once more
                    plan.append(kind)
            # nothing to act on (no container yet; a wrong load that changed nothing): again
            # after the next step
            elif (smoke or kind in ATTESTATION) and tries[kind] < SMOKE_TRIES:
                tries[kind] += 1
                plan.append(kind)
        chaos.wait_steps(steps_done(run_dir) + 1)
        code = chaos.stop()
        print(f"   stopped by SIGTERM (exit code {code}) after "
              f"{(time.monotonic() - started) / 60:.1f} min", flush=True)
        chaos.wait_removed()  # auto-remove of the last containers is asynchronous
        return {**audit(chaos, BATCH, K), **audit_attestation(chaos, phase.clean_steps)}
    finally:
        if chaos.alive():
            assert chaos.driver is not None
            chaos.driver.kill()
            chaos.driver.wait()


def lost(result: dict[str, Any]) -> int:
    return (result["steps_missing"] + result["trace_steps_missing"] + result["samples_repeated"]
            + result["batch_size_off"] + result["staleness_over_k"] + result["containers_left"]
            + sum(result["uncounted"].values()))


def cannot_measure() -> str | None:
    """Why this machine cannot run the soak (root, Docker with the image, the ray extra)."""
    if importlib.util.find_spec("ray") is None:
        return "the ray extra is missing: pip install -e '.[ray]'"
    if os.geteuid() != 0 or shutil.which("pidof") is None:
        return "freezing dockerd (kill -STOP) needs root and pidof"
    from sandboxes.api import EngineUnavailable
    from sandboxes.docker import DockerSandboxConfig
    from sandboxes.docker.engine import connect

    try:
        client = connect()
    except EngineUnavailable as e:
        return str(e)
    try:
        image = DockerSandboxConfig().image
        if not any(image in i.tags for i in client.images.list()):
            return f"the sandbox image {image} is missing: python -m sandboxes.docker build-image"
    finally:
        client.close()
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true",
                        help="one fault of each kind per run, within 5 minutes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the run directories under this folder")
    parser.add_argument("--address", default=None,
                        help="run on this running Ray cluster (3 CPUs free) instead of "
                             "starting one")
    add_smoke(parser)
    args = parser.parse_args(argv)
    if why := cannot_measure():
        refuse("chaos", why)
    size = "smoke" if args.smoke else "quick" if args.quick else f"{args.minutes:g} min"
    print(f"bench.chaos: {size}, seed {args.seed}, load average {os.getloadavg()[0]:.1f}",
          flush=True)
    started = time.monotonic()
    results = soak(args.minutes, args.quick, args.seed, args.keep,
                   phases=(CODE,) if args.smoke else PHASES, smoke=args.smoke,
                   address=args.address)
    total = missed = false = clean = 0
    for name, result in results.items():
        print(f"{name}: steps {result['steps']} (missing {result['steps_missing']}, trace files "
              f"missing {result['trace_steps_missing']}); samples {result['samples']} (repeated "
              f"{result['samples_repeated']}, batch size off by {result['batch_size_off']}); "
              f"staleness > {K}: {result['staleness_over_k']}; containers left: "
              f"{result['containers_left']}")
        for kind, n in result["injected"].items():
            counter = COUNTER.get(kind)
            seen = f"counted {result['counted'][kind]} ({counter})" if counter else "not counted"
            if kind in ATTESTATION:
                seen = "audited below"
            print(f"  {kind:13s} injected {n}  {seen}")
        for f in result["attestation"]:
            head = (f"  {f['kind']:13s} {f['engine']} version {f['version']} (armed after step "
                    f"{f['after_step']}): ")
            if f["first_trained_step"] is None:
                print(head + "its tokens reached no batch (nothing to detect; armed again)")
                continue
            print(head + f"first trained at step {f['first_trained_step']}, "
                  f"{'detected' if f['detected'] else 'NOT detected'} there, "
                  f"{'named' if f['named'] else 'NOT named'} in train.log, "
                  f"{f['tokens_trained']} of its tokens trained")
        print(f"  {ATTESTED} over {result['clean_steps']} steps with no attestation fault: "
              f"{result['attestation_false']} false")
        print("  faults/*: " + json.dumps(result["faults"]))
        total += lost(result)
        missed += result["attestation_missed"]
        false += result["attestation_false"]
        clean += result["clean_steps"]
    print(f"wall {(time.monotonic() - started) / 60:.1f} min; load average "
          f"{os.getloadavg()[0]:.1f}")
    injected = sum(len(r["attestation"]) for r in results.values())
    if injected:
        headline("attestation_missed", missed, 0)
    else:
        print("attestation_missed: not measured (no attestation fault at this size)", flush=True)
    if clean >= CLEAN_STEPS:
        headline("attestation_false", false, 0)
    else:
        print(f"attestation_false: not measured ({clean} clean steps, fewer than {CLEAN_STEPS})",
              flush=True)
    headline("chaos_lost", total, 0)


if __name__ == "__main__":
    main()
