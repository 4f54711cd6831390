"""``python -m bench.weights --smoke`` as a user runs it: the toy model under ``launcher=ray``
with and without delta weight sync; every delta attested, its ratio the headline."""

from __future__ import annotations

import re

import pytest
from bench_smoke import run_bench

pytest.importorskip("ray", reason="bench.weights runs launcher=ray: pip install -e '.[ray]'")

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_weights_smoke_prints_an_attested_payload_ratio() -> None:
    _, ratio, out = run_bench("weights", expect="delta_payload_ratio")
    assert 0 < ratio < 1
    assert re.search(r"^toy model \(float32\) lr=1e-06: delta_payload_ratio=[\d.]+ .*"
                     r"bit-identical \(attested every step\)$", out, re.MULTILINE)
    assert re.search(r"^  sync: put [\d.]+s \+ encode [\d.]+s \+ engine load [\d.]+s "
                     r"\(driver's sync [\d.]+s\) with deltas; put [\d.]+s \+ engine load "
                     r"[\d.]+s \(driver's sync [\d.]+s\) full", out, re.MULTILINE)
