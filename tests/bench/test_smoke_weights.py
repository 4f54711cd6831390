"""``python -m bench.weights --smoke`` as a user runs it: the toy model under ``launcher=ray``
with and without delta weight sync; every delta attested, its ratio the headline. On the test
process's Ray cluster (``--address``): a local one started for each run cost 20 s."""

from __future__ import annotations

import re
from typing import Any

import pytest
from bench_smoke import run_bench

pytest.importorskip("ray", reason="bench.weights runs launcher=ray: pip install -e '.[ray]'")

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_weights_smoke_prints_an_attested_payload_ratio(ray_nodes: Any) -> None:
    _, ratio, out = run_bench("weights", "--address", ray_nodes.address,
                              expect="delta_payload_ratio")
    assert 0 < ratio < 1
    assert re.search(r"^toy model \(float32\) lr=1e-06: delta_payload_ratio=[\d.]+ .*"
                     r"bit-identical \(attested every step\)$", out, re.MULTILINE)
    assert re.search(r"^  sync: put [\d.]+s \+ encode [\d.]+s \+ engine load [\d.]+s "
                     r"\(driver's sync [\d.]+s\) with deltas; put [\d.]+s \+ engine load "
                     r"[\d.]+s \(driver's sync [\d.]+s\) full", out, re.MULTILINE)
