"""``launcher=ray trainer.world_size=2`` on a real multi-node Ray cluster on this machine: one
rank actor per trainer node in the run's placement group, one gathered update per step, sharded
checkpoints; a killed rank ends the run in one line and the run resumes at one rank."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="launcher=ray needs the ray extra: pip install -e '.[ray]'")

from helpers import quick_config, run_spans
from ray.cluster_utils import Cluster

from orchestrator.builders import run
from orchestrator.config.read import explain
from orchestrator.launch.ranks import RankLost
from orchestrator.run.resume import RunState

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture
def cluster(ray_nodes: Cluster) -> Cluster:
    """The process's cluster (``ray_nodes``): the engine on the head, a trainer rank on each
    worker node."""
    return ray_nodes


def ranks_config(cluster: Cluster, namespace: str, *overrides: str):  # type: ignore[no-untyped-def]
    return quick_config(
        "smoke", "launcher=ray", f"launcher.address='{cluster.address}'",
        f"launcher.namespace={namespace}", "launcher.placement=spread", "trainer.world_size=2",
        "launcher.engine.resources={head_node: 1}", "launcher.trainer.resources={trainer_node: 1}",
        "launcher.span_flush_s=1", *overrides)


def test_two_rank_actors_train_as_one_trainer(cluster: Cluster, tmp_path: Path) -> None:
    result = run(ranks_config(cluster, f"test-{uuid.uuid4().hex[:6]}", "checkpoint.every=1"),
                 tmp_path)
    assert len(result.reports) == 2 and result.reports[-1].metrics["trained_tokens"] > 0
    spans = run_spans(tmp_path)
    computed = {s["worker"]: s["attributes"]["node"] for s in spans if s["stage"] == "train_compute"}
    assert set(computed) == {"trainer-0", "trainer-1"}
    assert len(set(computed.values())) == 2  # one rank per trainer node
    gathers = [s for s in spans if s["stage"] == "weights_gather"]
    assert gathers and {s["worker"] for s in gathers} == {"trainer-0"}  # once per update
    assert all(s["attributes"]["gather_seconds"] > 0 and s["attributes"]["bytes"] > 0
               for s in gathers)
    syncs = [s for s in spans if s["stage"] == "weight_sync" and s["worker"] == "weight_sync"]
    assert len(syncs) == 2 and all(s["attributes"]["gather_seconds"] > 0 for s in syncs)
    # both ranks' compute and rank 0's gather come back with their replies: in their own step
    for report in result.reports:
        for stage, version in (("train_compute", report.version),
                               ("weights_gather", report.version + 1)):
            recorded = sum(s["end"] - s["start"] for s in spans
                           if s["stage"] == stage and s["version"] == version)
            assert recorded > 0, (stage, report.step)
            assert report.stage_seconds.get(stage) == pytest.approx(recorded), (stage, report.step)
    final = tmp_path / "checkpoints" / "final"
    assert (final / "shards" / ".metadata").is_file() and (final / "trainer.pt").is_file()

    # the sharded checkpoint resumes in one trainer actor (trainer.world_size unset), whose
    # node reads it from the files the driver ships
    last = tmp_path / "checkpoints" / "step-2"
    assert (last / "shards" / ".metadata").is_file()
    version = RunState.read(last).version
    resumed = run(quick_config(
        "smoke", "launcher=ray", f"launcher.address='{cluster.address}'",
        f"launcher.namespace=test-{uuid.uuid4().hex[:6]}", "launcher.placement=spread",
        "launcher.engine.resources={head_node: 1}",
        "launcher.trainer.resources={trainer_node: 1}", "pipeline.num_steps=3"),
        tmp_path / "resumed", resume_from=last)
    assert [r.step for r in resumed.reports] == [2]
    assert resumed.reports[0].version == version  # restored from the ranks' trainer.pt


class RankKiller(threading.Thread):
    """SIGKILLs trainer rank 1's actor once the run has checkpointed a step."""

    def __init__(self, run_dir: Path, namespace: str) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.namespace = run_dir, namespace
        self.killed: int | None = None

    def run(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list(self.run_dir.glob("checkpoints/step-*")):
            time.sleep(0.05)
        name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["namespace"] == self.namespace and a["name"].endswith("trainer-rank-1"))
        actor = ray.get_actor(name, namespace=self.namespace)
        self.killed = ray.get(actor.pid.remote())
        os.kill(self.killed, signal.SIGKILL)


def test_a_dead_rank_ends_the_run_in_one_line_and_it_resumes_at_one_rank(
        cluster: Cluster, tmp_path: Path) -> None:
    namespace = f"test-{uuid.uuid4().hex[:6]}"
    killer = RankKiller(tmp_path, namespace)
    killer.start()
    with pytest.raises(BaseException) as info:
        run(ranks_config(cluster, namespace, "pipeline.num_steps=40", "warmstart.steps=0",
                         "eval.num_tasks=0", "checkpoint.every=1"), tmp_path)
    killer.join(timeout=10)
    assert killer.killed is not None
    message = explain(info.value)  # what the command line prints
    assert message is not None and "\n" not in message, message
    assert "trainer rank" in message and "resume=" in message, message
    assert isinstance(info.value, RankLost) or "RankLost" in repr(info.value) or message

    checkpoints = sorted(tmp_path.glob("checkpoints/step-*"),
                         key=lambda p: int(p.name.removeprefix("step-")))
    last = checkpoints[-1]
    step = RunState.read(last).step
    resumed = run(quick_config("smoke", "launcher=local", "trainer.world_size=1",
                               f"pipeline.num_steps={step + 1}", "warmstart.steps=0",
                               "eval.num_tasks=0"), tmp_path, resume_from=last)
    assert len(resumed.reports) == 1 and resumed.reports[0].step == step
