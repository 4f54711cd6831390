"""bench.chaos's weight-attestation runs, shortened (5 clean steps instead of 200), on a real
local Ray cluster (the test process's, ``ray_nodes``) with two engine actors: an engine that skips a sync, one that loads all but
one tensor, one that goes back to its starting weights (full weights) and one that loads the
previous adapters (LoRA), each armed after a trained step; the audit of the runs' own files
finds each detected in the first batch with its tokens, its engine named, none of its tokens
trained, and no failure where none was injected. Then the audit is shown to fail on the same
files: a run that counted nothing, and a fault whose tokens never reached a batch."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import forked
import pytest

pytest.importorskip("ray", reason="bench.chaos runs launcher=ray: pip install -e '.[ray]'")

from bench.chaos import ATTEST, ATTEST_LORA, ATTESTATION, ATTESTED, Chaos, audit_attestation, soak

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(600)]


def test_each_attestation_fault_is_detected_and_the_audit_can_tell(ray_nodes: Any,
                                                                   tmp_path: Path) -> None:
    with forked.routed():  # its runs fork from the tests' server, as a forked bench's do
        results = soak(0, True, 0, tmp_path, phases=(replace(ATTEST, clean_steps=5), ATTEST_LORA),
                       address=ray_nodes.address)
    faults = [f for r in results.values() for f in r["attestation"]]
    assert {f["kind"] for f in faults if f["first_trained_step"] is not None} == set(ATTESTATION)
    for result in results.values():
        assert result["attestation_missed"] == 0 and result["attestation_false"] == 0, result
        assert result["steps_missing"] == result["samples_repeated"] == 0, result
    run = results["attestation"]
    assert run["clean_steps"] >= 5
    assert run["faults"][ATTESTED] == sum(
        1 for f in run["attestation"] if f["first_trained_step"] is not None)

    run_dir = tmp_path / "attestation" / "run"
    misloads = [{"kind": f["kind"], "engine": f["engine"], "version": f["version"],
                 "fingerprint": f["fingerprint"], "steps_before": f["after_step"]}
                for f in run["attestation"]]
    replayed = Chaos(run_dir, [], "", random.Random(0), misloads=misloads, docker=False)
    assert audit_attestation(replayed)["attestation_missed"] == 0  # the files alone agree

    # a fault whose wrong weights no batch trained: nothing detected, and its kind unshown
    never = [{**m, "fingerprint": "0" * 32} for m in misloads[:1]]
    assert audit_attestation(replace(replayed, misloads=never))["attestation_missed"] == 1
    # the same files with every failure count taken out of metrics.jsonl: each fault missed
    metrics = run_dir / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps({**m, ATTESTED: 0.0} if ATTESTED in m else m) + "\n"
                               for m in lines))
    exercised = sum(1 for f in run["attestation"] if f["first_trained_step"] is not None)
    assert audit_attestation(replayed)["attestation_missed"] == exercised >= 3
