"""bench.chaos at its smoke size, as a user runs it (``python -m bench.chaos --smoke``): one
engine actor SIGKILLed, one sandbox container killed, dockerd frozen for seconds and the driver
SIGKILLed and resumed, each after the next trained step, on a real local Ray cluster and the
real Docker engine, the toy model training ``code_tool``; the audit of the run's own files
finds nothing lost. Then the audit is shown to fail on the same run's files with a step taken
out and a fault the run never saw."""

from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from bench_smoke import run_bench

pytest.importorskip("ray", reason="bench.chaos runs launcher=ray: pip install -e '.[ray]'")

from bench.chaos import BATCH, CODE, COUNTER, Chaos, audit, cannot_measure, lost

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.docker, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def docker_engine() -> None:
    if why := cannot_measure():  # no engine or image, or not root: the bench would refuse
        pytest.skip(why)


def test_a_short_chaos_loses_nothing_and_the_audit_can_tell(docker_engine: None, ray_nodes: Any,
                                                            tmp_path: Path) -> None:
    # on the test process's Ray cluster (--address), as test_chaos_attestation.py's soak
    _, lost_total, out = run_bench("chaos", "--keep", str(tmp_path), "--address",
                                   ray_nodes.address, timeout=540, expect="chaos_lost")
    assert lost_total == 0, out
    found = re.search(r"^code_tool: steps (\d+) .*; samples (\d+) ", out, re.MULTILINE)
    assert found, out
    steps, samples = int(found.group(1)), int(found.group(2))
    assert steps >= 8 and samples == BATCH * steps, out  # a fault after each step, 2 after it
    rows = re.findall(r"^  (\w+) +injected (\d+)  counted (\d+) ", out, re.MULTILINE)
    assert {kind: int(n) for kind, n, _ in rows} == {kind: 1 for kind in CODE.kinds}, out
    counted = {kind: int(c) for kind, _, c in rows}
    assert all(counted[kind] >= 1 for kind in CODE.kinds), out

    # The same files with a step's record taken out of metrics.jsonl, audited as if one more
    # engine kill had been injected than the run counted: the audit says so.
    metrics = tmp_path / "code_tool" / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    records = [i for i, line in enumerate(lines) if '"time/step"' in line]
    del lines[records[len(records) // 2]]
    metrics.write_text("".join(line + "\n" for line in lines))
    injected = Counter({**{kind: 1 for kind in CODE.kinds}, "engine": counted["engine"] + 1})
    replayed = Chaos(tmp_path / "code_tool" / "run", [], "", random.Random(0), injected=injected)
    tampered = audit(replayed, batch=BATCH, k=1)
    assert tampered["steps_missing"] >= 1
    assert tampered["uncounted"]["engine"] == 1 and COUNTER["engine"] in tampered["faults"]
    assert lost(tampered) >= 2
