"""The benchmarks that run on a local multi-node Ray cluster, at their smoke size, as a user runs
them (``python -m bench.<name> --smoke``): ``launcher=ray`` on 1 and 2 engine nodes with a
weight broadcast, and FSDP2 trainer ranks (1, 2, and 2 with LoRA) on the toy model; each
prints its headline last. Both run on the test process's cluster (``--address``: its head has
``head_node``, its two workers ``engine_node`` and ``trainer_node``) rather than starting one
each, as test_chaos.py's soak does, so most of their time is the actors' start. A cluster
without the nodes a bench needs is refused in one line."""

from __future__ import annotations

import re
import sys
from typing import Any

import forked
import pytest
from bench_smoke import HEADLINE, REPO, run_bench

from bench.cli import REFUSED

pytest.importorskip("ray", reason="the Ray benchmarks need the ray extra: pip install -e '.[ray]'")

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_ray_scaling_smoke_runs_one_and_two_engine_nodes(ray_nodes: Any) -> None:
    _, efficiency, out = run_bench("ray_scaling", "--address", ray_nodes.address,
                                   expect="scaling_efficiency_2")
    assert efficiency > 0
    # each engine on a node of its own, as placement=spread puts them
    assert re.findall(r"^engines=(\d) on (\d) nodes: [\d.]+ samples/s", out, re.MULTILINE) \
        == [("1", "1"), ("2", "2")]
    assert re.search(r"^weight sync: 4 MB from the head to 2 engine nodes", out, re.MULTILINE)


def test_trainer_scaling_smoke_steps_every_row(ray_nodes: Any) -> None:
    _, speedup, out = run_bench("trainer_scaling", "--address", ray_nodes.address,
                                expect="trainer_scaling_2")
    assert speedup > 0
    rows = re.findall(r"^ +([12]) +(full|lora) +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +([\d.]+)$",
                      out, re.MULTILINE)
    assert [(r, m) for r, m, _ in rows] == [("1", "full"), ("2", "full"), ("2", "lora")]
    full, lora = float(rows[1][2]), float(rows[2][2])
    assert 0 < lora < full  # a LoRA update carries the adapters alone


def test_a_cluster_without_the_nodes_a_bench_needs_is_refused(ray_nodes: Any) -> None:
    # --quick measures 1, 2 and 4 engine nodes; the tests' cluster has 2
    done = forked.run([sys.executable, "-m", "bench.ray_scaling", "--quick", "--address",
                       ray_nodes.address], cwd=REPO, capture_output=True, text=True, timeout=120,
                      check=False)
    assert done.returncode == REFUSED, (done.stdout[-1000:], done.stderr[-2000:])
    # no headline it did not measure
    assert not any(HEADLINE.match(line) for line in done.stdout.splitlines()), done.stdout
    assert done.stderr.strip().splitlines()[-1] == (
        f"bench.ray_scaling: cannot measure: the cluster at {ray_nodes.address} has 1 node(s) "
        "with head_node and 2 with engine_node (one CPU each); it needs 1 and 4")
