"""``launcher=ray`` on a real multi-node Ray cluster on this machine (orchestrator/launch/ray/).

One cluster for the test process (``ray_nodes`` in conftest.py): a head with the ``head_node``
resource, where the trainer goes, and two worker nodes with ``engine_node``, one engine each.
Every run goes through :func:`orchestrator.builders.run` exactly as ``python -m orchestrator
launcher=ray launcher.address=…`` would. Nothing is mocked: actors are killed with SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray", reason="launcher=ray needs the ray extra: pip install -e '.[ray]'")

from helpers import quick_config, ray_nodes, run_spans, run_step_files
from ray.cluster_utils import Cluster

from orchestrator.builders import run
from orchestrator.config.read import explain
from orchestrator.errors import ConfigError
from orchestrator.faults import ENV
from orchestrator.launch.ray import TrainerLost, WeightsLost
from orchestrator.run.loop import RunResult
from orchestrator.weights.update import WeightUpdate

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


@pytest.fixture
def cluster(ray_nodes: Cluster) -> Cluster:
    """The process's cluster (``ray_nodes``): the trainer on the head, an engine on each
    worker node."""
    return ray_nodes


def ray_config(cluster: Cluster, namespace: str, *overrides: str) -> Any:
    """The quick smoke run with two engines spread over the worker nodes, the trainer on the head."""
    return quick_config(
        "smoke", "launcher=ray", f"launcher.address='{cluster.address}'",
        f"launcher.namespace={namespace}", "launcher.num_engines=2", "launcher.placement=spread",
        "launcher.engine.resources={engine_node: 1}", "launcher.trainer.resources={head_node: 1}",
        "launcher.span_flush_s=1", *overrides)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def worker_nodes(cluster: Cluster) -> set[str]:
    return {node.node_id for node in cluster.worker_nodes}


class Killer(threading.Thread):
    """SIGKILLs the process of the run's actor named ``*-<suffix>`` once the run has reported
    ``after_steps`` steps (and written a checkpoint, if ``after_checkpoint``), from a thread
    beside the run, as an operator or the kernel would."""

    def __init__(self, run_dir: Path, namespace: str, suffix: str, after_steps: int = 1,
                 after_checkpoint: bool = False) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.namespace, self.suffix, self.after_steps = (
            run_dir, namespace, suffix, after_steps)
        self.after_checkpoint = after_checkpoint  # and a periodic checkpoint is on disk
        self.killed: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except (AssertionError, OSError, ray.exceptions.RayError) as error:  # the test shows it
            self.error = error

    def _run(self) -> None:
        metrics = self.run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (metrics.exists() and len(metrics.read_text().splitlines()) >= self.after_steps
                    and (not self.after_checkpoint
                         or list(self.run_dir.glob("checkpoints/step-*/MANIFEST.json")))):
                break
            time.sleep(0.05)
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == self.namespace and a["name"].endswith(self.suffix)]
        assert len(names) == 1, names
        actor = ray.get_actor(names[0], namespace=self.namespace)
        pid = ray.get(actor.pid.remote())
        os.kill(pid, signal.SIGKILL)
        self.killed = pid


def unique_run() -> str:
    return f"test-{uuid.uuid4().hex[:6]}"


def check_run(result: RunResult, run_dir: Path, num_steps: int, k: int, batch: int) -> None:
    """The staleness invariant, complete trace files, and every trained sample exactly once."""
    assert len(result.reports) == num_steps
    for report in result.reports:
        assert all(0 <= s <= k for s in report.staleness), report.staleness
    files = run_step_files(run_dir)  # wherever and however RunDir stores them
    for step in range(num_steps):
        for kind in ("multiturn_workload", "reward_timings", "packed_lengths"):
            assert f"{kind}_step_{step}.jsonl" in files, (kind, step)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics[:num_steps]] == list(range(num_steps))
    assert (run_dir / "timeline.json").is_file() and (run_dir / "summary.json").is_file()
    assert list((run_dir / "checkpoints" / "final" / "model").glob("*.safetensors"))
    # An episode is one worker's group member started at one time: no episode trained twice,
    # none lost.
    episodes = Counter(
        (r["polyrl"]["worker"], r["polyrl"]["start_s"], r["sample_id"])
        for step in range(num_steps)
        for r in files[f"multiturn_workload_step_{step}.jsonl"])
    assert sum(episodes.values()) == num_steps * batch
    assert max(episodes.values()) == 1


def test_weights_travel_through_the_object_store_in_any_dtype(cluster: Cluster) -> None:
    tensors = {"w": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16),
               "mask": torch.tensor([True, False]), "scale": torch.tensor(2.5, dtype=torch.float16)}
    ray.init(address=cluster.address, logging_level="WARNING")
    try:
        update = WeightUpdate.by_reference(7, tensors, leased=False).to_object_store()
        assert (update.transport, update.version) == ("object_store", 7)
        assert update.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
        back = update.tensors()
        assert set(back) == set(tensors)
        for name, tensor in tensors.items():
            assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunResult, Path]:
    cluster = ray_nodes()  # the tests that read it are of Ray's group: the cluster outlives them
    run_dir = tmp_path_factory.mktemp("smoke")
    # a preset with a reference policy (KL in the reward) and sequence-level aggregation: the
    # trainer actor builds every piece
    return run(ray_config(cluster, unique_run(), "algo=reinforce_pp",
                          "algo.aggregation=sequence_mean"), run_dir), run_dir


def test_a_run_spreads_engines_over_worker_nodes_and_the_trainer_on_the_head(
        smoke_run: tuple[RunResult, Path]) -> None:
    result, run_dir = smoke_run
    check_run(result, run_dir, num_steps=2, k=1, batch=8)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert all(m["faults/engine_restarts"] == 0 and m["faults/episodes_rerun"] == 0
               for m in metrics[:2])
    # attested: every engine actor reports the fingerprint it holds, each segment names its
    # actor, and none fails the check
    assert all(m["faults/attestation"] == 0 for m in metrics[:2])
    segments = [s for name, records in run_step_files(run_dir).items()
                if name.startswith("multiturn_workload") for r in records
                for s in r["polyrl"]["segments"]]
    assert segments and all(s["engine"] and len(s["fingerprint"]) == 32 for s in segments)
    # which engine serves a prompt is the router's choice (prefix affinity may keep them all on
    # one: their chat template is a shared prefix); each segment names one of the run's two
    assert {s["engine"] for s in segments} <= {"engine-0", "engine-1"}
    assert "train/loss" in metrics[0]
    assert metrics[0]["train/kl_penalty"] == 0.0  # the reference is the policy at step 1
    assert "train/kl_penalty" in metrics[1]


def test_lora_updates_reach_the_engine_actors_as_adapters(cluster: Cluster,
                                                         tmp_path: Path) -> None:
    """The trainer actor's update goes into the object store with its adapters marked: without
    them an engine took ``<weight>::lora_A`` tensors for whole weights and failed to load."""
    result = run(ray_config(cluster, unique_run(), "trainer.lora.r=4"), tmp_path / "run")
    check_run(result, tmp_path / "run", num_steps=2, k=1, batch=8)


def test_engine_actors_load_deltas_through_the_object_store(cluster: Cluster,
                                                            tmp_path: Path) -> None:
    """engine.delta: the trainer actor puts each update's delta beside it; both engine actors
    hold the version before, pull the delta, and rebuild the weights the trainer published
    (their fingerprints pass the trainer's check every step, with no fallback)."""
    run_dir = tmp_path / "run"
    result = run(ray_config(cluster, unique_run(), "engine.delta=true", "trainer.lr=1e-6",
                            "pipeline.num_steps=3"), run_dir)
    check_run(result, run_dir, num_steps=3, k=1, batch=8)
    metrics = read_jsonl(run_dir / "metrics.jsonl")[:3]
    assert all(m["faults/attestation"] == 0 for m in metrics)
    synced = [m for m in metrics if "weights/delta_ratio" in m]  # a step after a delta sync
    assert synced and all(m["weights/delta_fallbacks"] == 0 for m in synced)
    assert all(0 < m["weights/delta_ratio"] < 1 for m in synced)
    assert synced[-1]["weights/delta_loads"] >= 2  # both engines
    syncs = [s for s in run_spans(run_dir) if s["stage"] == "weight_sync"
             and s["worker"] != "weight_sync"]  # the engine actors' own
    pulled = [s["attributes"]["bytes"] for s in syncs if s["attributes"].get("delta")]
    assert len(pulled) >= 2 and max(pulled) < synced[0]["weights/full_bytes"]


def test_spans_come_from_every_node_onto_the_driver_timeline(
        cluster: Cluster, smoke_run: tuple[RunResult, Path]) -> None:
    _, run_dir = smoke_run
    spans = run_spans(run_dir)
    remote = [s for s in spans if "process" in s["attributes"]]
    engine_nodes = {s["attributes"]["node"] for s in remote if s["worker"].startswith("engine")}
    assert engine_nodes == worker_nodes(cluster)
    trainer_nodes = {s["attributes"]["node"] for s in remote if s["worker"] == "trainer"}
    assert trainer_nodes == {cluster.head_node.node_id}
    syncs = [s for s in remote if s["stage"] == "weight_sync"]
    assert syncs and all(s["attributes"]["bytes"] > 0 and s["attributes"]["seconds"] >= 0
                         for s in syncs)
    assert len([s for s in remote if s["stage"] == "train_compute"]) == 2
    # the warm start's steps, a forwarded trainer method, in the span its declaration names
    assert len([s for s in remote if s["stage"] == "supervised_compute"]) == 2
    end = max(s["end"] for s in spans if "process" not in s["attributes"])
    assert all(-1.0 < s["start"] <= s["end"] < end + 1.0 for s in remote)  # one clock
    timeline = json.loads((run_dir / "timeline.json").read_text())
    pids = {e["pid"] for e in timeline["traceEvents"] if e["ph"] == "X"}
    assert len(pids) >= 4  # the driver, the trainer, two engines


@pytest.mark.slow
def test_every_step_carries_the_time_its_actors_spent_on_it(cluster: Cluster,
                                                            tmp_path: Path) -> None:
    """The trainer actor's spans come back with its replies and count in their own step, as
    an in-process trainer's time does: each step's ``time/train_compute`` is its own train
    step's (the span of its policy version), ``time/weights_put`` its own update's. They used
    to wait for the periodic drain (here slower than the whole run) and land in whichever step
    reported next: in none of these. An engine's weight load counts with the driver's sync of
    the same version, and the warm start's steps, before the run, in no step."""
    steps = 6
    run(ray_config(cluster, unique_run(), f"pipeline.num_steps={steps}", "eval.num_tasks=0",
                   "launcher.span_flush_s=600"), tmp_path)
    metrics = [m for m in read_jsonl(tmp_path / "metrics.jsonl")
               if "step" in m and not any(k.startswith("summary/") for k in m)]
    assert [m["step"] for m in metrics] == list(range(steps))
    spans = run_spans(tmp_path)

    def seconds(stage: str, version: int) -> float:
        return sum(s["end"] - s["start"] for s in spans
                   if s["stage"] == stage and s["version"] == version)

    for m in metrics:
        version = int(m["policy/version"])
        for stage in ("wait_batch", "train_step", "train_compute", "weights_put"):
            assert m.get(f"time/{stage}", 0.0) > 0, (stage, m["step"])
        assert m["time/train_compute"] < m["time/train_step"]
        assert m["time/train_compute"] == pytest.approx(seconds("train_compute", version))
        assert m["time/weights_put"] == pytest.approx(seconds("weights_put", version + 1))
        assert "time/supervised_compute" not in m
    assert sum(m["time/train_compute"] for m in metrics) == pytest.approx(
        sum(s["end"] - s["start"] for s in spans if s["stage"] == "train_compute"))
    # Syncs run one at a time, each engine's load inside the driver's sync of its version, and
    # come back with its reply: the steps reported whole syncs of versions 1..n (version 0's,
    # the warm start's, came before the run), and perhaps the engines' loads of n + 1 (a
    # report may fall between those and the end of the driver's own span).
    syncs = [s for s in spans if s["stage"] == "weight_sync" and s["version"] > 0]
    assert len(syncs) == 3 * steps  # the driver's and two engines' per version

    def loads(version: int, worker: str | None = None) -> float:
        return sum(s["end"] - s["start"] for s in syncs if s["version"] == version
                   and (worker is None or s["worker"] == worker))

    reported = sum(m.get("time/weight_sync", 0.0) for m in metrics)
    possible = [sum(loads(v) for v in range(1, n + 1)) + sum(loads(n + 1, e) for e in engines)
                for n in range(steps + 1) for engines in ((), ("engine-0",), ("engine-1",),
                                                          ("engine-0", "engine-1"))]
    assert any(reported == pytest.approx(p) for p in possible), (reported, possible)


def test_a_killed_engine_is_restarted_and_its_requests_run_again_elsewhere(
        cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # engine-0 SIGKILLs itself as it takes a request at version 1 or later, so requests are in
    # flight when it dies whatever the machine's speed (a kill from outside could land between
    # two requests); Ray restarts it, and its second life serves
    monkeypatch.setenv(ENV, "engine-0.generate@1")
    # steps enough after the kill (in the second step) for the restart to be noticed and reported
    result = run(ray_config(cluster, unique_run(), "pipeline.num_steps=8",
                            "pipeline.num_workers=4", "eval.num_tasks=0"), tmp_path)
    check_run(result, tmp_path, num_steps=8, k=1, batch=8)
    last = read_jsonl(tmp_path / "metrics.jsonl")[7]
    assert last["faults/engine_restarts"] >= 1
    assert last["faults/episodes_rerun"] >= 1


def check_whole_run(run_dir: Path, num_steps: int, batch: int) -> dict[str, Any]:
    """A run that went on from a checkpoint: its records cover every step once, every trained
    sample appears once, the summary covers the whole run. Returns the summary."""
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "step" in m
               and not any(k.startswith("summary/") for k in m)]
    assert [m["step"] for m in metrics] == list(range(num_steps))
    assert [m["policy/version"] for m in metrics] == list(range(num_steps))
    files = run_step_files(run_dir)
    episodes = Counter((r["prompt_group_id"], r["sample_id"]) for step in range(num_steps)
                       for r in files[f"multiturn_workload_step_{step}.jsonl"])
    assert sum(episodes.values()) == num_steps * batch and max(episodes.values()) == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == num_steps
    return summary


def test_a_dead_trainer_is_restarted_from_the_last_checkpoint(cluster: Cluster,
                                                               tmp_path: Path) -> None:
    namespace = unique_run()
    killer = Killer(tmp_path, namespace, "trainer", after_steps=2, after_checkpoint=True)
    killer.start()
    run(ray_config(cluster, namespace, "pipeline.num_steps=5", "warmstart.steps=0",
                   "eval.num_tasks=0", "checkpoint.every=1"), tmp_path)
    killer.join(timeout=10)
    assert killer.error is None and killer.killed is not None
    summary = check_whole_run(tmp_path, num_steps=5, batch=8)
    assert summary["resumes"] == 1
    # the checkpoints were written by the driver into its run directory
    assert list((tmp_path / "checkpoints").glob("step-*/model/model.safetensors"))


def test_a_trainer_that_keeps_dying_ends_the_run_with_one_line(cluster: Cluster,
                                                               tmp_path: Path) -> None:
    namespace = unique_run()
    killer = Killer(tmp_path, namespace, "trainer", after_steps=1)
    killer.start()
    with pytest.raises(BaseException) as info:  # the run's own error, found below
        run(ray_config(cluster, namespace, "pipeline.num_steps=50", "warmstart.steps=0",
                       "eval.num_tasks=0", "launcher.trainer.max_restarts=0"), tmp_path)
    killer.join(timeout=10)
    assert killer.killed is not None
    # Whoever finds it first says so: the trainer's proxy (a step, a weight update), or an
    # engine whose weights the dead trainer owned.
    assert find(info.value, (TrainerLost, WeightsLost)) is not None, info.value
    message = explain(info.value)  # what the command line prints, and nothing else
    assert message is not None and "\n" not in message
    assert "the trainer actor" in message and "died" in message
    assert "launcher.trainer.max_restarts=0" in message and "resume=" in message


def find(error: BaseException,
         kind: type[BaseException] | tuple[type[BaseException], ...]) -> BaseException | None:
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, kind):
            return e
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None


@pytest.mark.parametrize("address", ["127.0.0.1:1", "203.0.113.1:6379"])
def test_an_unreachable_address_is_one_line_naming_the_key(tmp_path: Path, address: str) -> None:
    cfg = quick_config("smoke", "launcher=ray", f"launcher.address='{address}'",
                       "launcher.connect_timeout_s=2")
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        run(cfg, tmp_path)
    assert time.monotonic() - started < 10
    assert explain(info.value) == str(info.value)
    assert str(info.value).startswith(f"launcher.address={address} is unreachable")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("override", "key"), [
    ("launcher.engine.resources={gpu_node: 1}",
     "launcher.engine.resources={'gpu_node': 1} cannot be placed: no node has it"),
    ("launcher.trainer.num_gpus=1", "launcher.trainer.num_gpus=1 cannot be placed"),
    ("launcher.num_engines=3", "launcher.num_engines=3 needs 4 CPU in all"),
])
def test_resources_no_node_has_are_one_line_naming_the_key(
        cluster: Cluster, tmp_path: Path, override: str, key: str) -> None:
    cfg = quick_config("smoke", "launcher=ray", f"launcher.address='{cluster.address}'", override)
    with pytest.raises(ConfigError) as info:
        run(cfg, tmp_path)
    assert str(info.value).startswith(key), str(info.value)
    assert "\n" not in str(info.value) and "cluster" in str(info.value)
    assert not ray.is_initialized()  # the launcher let go of the cluster


@pytest.mark.parametrize(("override", "words"), [
    ("launcher.num_engines=0", "launcher.num_engines must be >= 1"),
    ("launcher.placement=diagonal", "launcher.placement=diagonal must be one of pack, spread"),
    ("launcher.engine.num_cpus=-1", "launcher.engine.num_cpus must be a number >= 0"),
    ("+launcher.engine.memory=3", "unknown key launcher.engine.memory"),
])
def test_bad_launcher_values_are_one_line_naming_the_key(tmp_path: Path, override: str,
                                                         words: str) -> None:
    with pytest.raises(BaseException) as info:  # Hydra wraps it; explain() finds it
        run(quick_config("smoke", "launcher=ray", override), tmp_path)
    assert explain(info.value) is not None and explain(info.value).startswith(words)
