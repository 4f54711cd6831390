"""The benchmarks that start a local multi-node Ray cluster, at their smoke size, as a user runs
them (``python -m bench.<name> --smoke``): ``launcher=ray`` on 1 and 2 engine nodes with a
weight broadcast, and FSDP2 trainer ranks (1, 2, and 2 with LoRA) on the toy model; each
prints its headline last. Most of their time is the cluster's and the actors' start."""

from __future__ import annotations

import re

import pytest
from bench_smoke import run_bench

pytest.importorskip("ray", reason="the Ray benchmarks need the ray extra: pip install -e '.[ray]'")

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_ray_scaling_smoke_runs_one_and_two_engine_nodes() -> None:
    _, efficiency, out = run_bench("ray_scaling", expect="scaling_efficiency_2")
    assert efficiency > 0
    # each engine on a node of its own, as placement=spread puts them
    assert re.findall(r"^engines=(\d) on (\d) nodes: [\d.]+ samples/s", out, re.MULTILINE) \
        == [("1", "1"), ("2", "2")]
    assert re.search(r"^weight sync: 4 MB from the head to 2 engine nodes", out, re.MULTILINE)


def test_trainer_scaling_smoke_steps_every_row() -> None:
    _, speedup, out = run_bench("trainer_scaling", expect="trainer_scaling_2")
    assert speedup > 0
    rows = re.findall(r"^ +([12]) +(full|lora) +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +([\d.]+)$",
                      out, re.MULTILINE)
    assert [(r, m) for r, m, _ in rows] == [("1", "full"), ("2", "full"), ("2", "lora")]
    full, lora = float(rows[1][2]), float(rows[2][2])
    assert 0 < lora < full  # a LoRA update carries the adapters alone
