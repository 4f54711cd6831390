"""bench.chaos in short: one engine actor SIGKILLed, one sandbox container killed, dockerd
frozen for seconds and the driver SIGKILLed and resumed, on a real local Ray cluster and the
real Docker engine; the audit of the run's own files finds nothing lost. Then the audit is
shown to fail on the same run's files with a step taken out and a fault the run never saw."""

from __future__ import annotations

import os
import random
import shutil
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="bench.chaos runs launcher=ray: pip install -e '.[ray]'")

from bench.chaos import CODE, COUNTER, Chaos, audit, lost, soak
from sandboxes.api import EngineUnavailable
from sandboxes.docker import DockerSandboxConfig
from sandboxes.docker.engine import connect

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.docker, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def docker_engine() -> None:
    try:
        client = connect()
    except EngineUnavailable:
        pytest.skip("no Docker engine; start one with `bash scripts/docker_setup.sh`")
    try:
        image = DockerSandboxConfig().image
        if not any(image in i.tags for i in client.images.list()):
            pytest.skip(f"image {image} missing; run `python -m sandboxes.docker build-image`")
    finally:
        client.close()
    if os.geteuid() != 0 or shutil.which("pidof") is None:
        pytest.skip("freezing dockerd (kill -STOP) needs root")


def test_a_short_chaos_loses_nothing_and_the_audit_can_tell(docker_engine: None,
                                                            tmp_path: Path) -> None:
    result = soak(minutes=3.0, quick=True, seed=0, keep=tmp_path, phases=(CODE,))["code_tool"]
    assert result["injected"] == {kind: 1 for kind in CODE.kinds}, result
    assert all(result["counted"][kind] >= 1 for kind in CODE.kinds), result
    assert result["steps"] >= 8 and result["samples"] == 8 * result["steps"], result
    assert lost(result) == 0, result

    # The same files with a step's record taken out of metrics.jsonl, audited as if one more
    # engine kill had been injected than the run counted: the audit says so.
    metrics = tmp_path / "code_tool" / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    steps = [i for i, line in enumerate(lines) if '"time/step"' in line]
    del lines[steps[len(steps) // 2]]
    metrics.write_text("".join(line + "\n" for line in lines))
    injected = Counter({**result["injected"], "engine": result["counted"]["engine"] + 1})
    replayed = Chaos(tmp_path / "code_tool" / "run", [], "", random.Random(0), injected=injected)
    tampered = audit(replayed, batch=8, k=1)
    assert tampered["steps_missing"] >= 1
    assert tampered["uncounted"]["engine"] == 1 and COUNTER["engine"] in tampered["faults"]
    assert lost(tampered) >= 2
