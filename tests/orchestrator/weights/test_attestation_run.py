"""Weight attestation in whole runs on the toy model (orchestrator/weights/attest.py): a clean run
has no failure and records each generated segment's engine, version and fingerprint in its samples
and PolyTrace records; each fault an engine can make (a skipped load, a partial one, a restart from
the starting weights, an adapter of another version) is detected in the first batch with its tokens,
which are not trained, and the engines reload; an engine that fails twice in a row ends the run in
one line; an engine that cannot attest is refused at start."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from helpers import make_groups, quick_config, run_step_files

from orchestrator.builders import run, training_parts
from orchestrator.config.read import explain
from orchestrator.config.run import run_config
from orchestrator.errors import ConfigError, chain
from orchestrator.weights.attest import AttestationFailed
from orchestrator.weights.fingerprint import fingerprint
from orchestrator.weights.update import WeightUpdate

# weight decay: every step changes the weights, whatever the rewards (all 0 would leave them)
RUN = ("pipeline.num_steps=4", "warmstart.steps=0", "eval.num_tasks=0", "rollout.max_tokens=8",
       "pipeline.max_staleness=1", "trainer.weight_decay=0.1")


def metrics(run_dir: Path) -> list[dict[str, float]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "faults/attestation" in m]


def test_a_clean_run_has_no_failure_and_records_every_segment(tmp_path: Path) -> None:
    run(quick_config("arithmetic", *RUN), tmp_path)
    steps = metrics(tmp_path)
    assert len(steps) == 4 and all(m["faults/attestation"] == 0 for m in steps)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    segments = [s for sample in samples for s in sample["segments"]]
    assert segments and all(len(s["fingerprint"]) == 32 for s in segments)
    records = [r for name, rs in run_step_files(tmp_path).items()
               if name.startswith("multiturn_workload") for r in rs]
    traced = [s for r in records for s in r["polyrl"]["segments"]]
    assert len(traced) >= len(records)
    # a version has one fingerprint, whoever served it
    by_version: dict[int, set[str]] = {}
    for s in traced:
        by_version.setdefault(s["version"], set()).add(s["fingerprint"])
    assert all(len(f) == 1 for f in by_version.values())
    assert len(set.union(*by_version.values())) == len(by_version) > 1


FAULTY = "engine._target_=faulty_engines.FaultyEngine"


# An adapter of another version: tests/orchestrator/engines/test_attestation.py (in these
# seconds-long LoRA runs the adapters do not change from version to version)
@pytest.mark.parametrize("fault", ["skip", "partial", "restart"])
def test_each_fault_is_detected_in_its_first_batch_and_its_tokens_are_not_trained(
        tmp_path: Path, fault: str) -> None:
    run(quick_config("arithmetic", *RUN, FAULTY, f"+engine.fault={fault}",
                     "+engine.at_version=2"), tmp_path)
    counts = [m["faults/attestation"] for m in metrics(tmp_path)]
    # the faulty load is version 2's (after step 1): the failure is counted at the first step
    # whose batch has tokens of version 2, none before; the reload clears it
    files = run_step_files(tmp_path)
    trained = [{seg["version"] for r in files[f"multiturn_workload_step_{step}.jsonl"]
                for seg in r["polyrl"]["segments"]} for step in range(len(counts))]
    first = next((step for step, versions in enumerate(trained) if 2 in versions), None)
    assert first is not None, trained  # k = 1: version 2's samples are trained at step 2 or 3
    assert counts[:first] == [0] * first and counts[first] == 1, (counts, trained)
    assert counts[-1] == 1  # reloaded: clean again
    assert metrics(tmp_path)[-1]["attestation/masked_tokens"] > 0


def test_an_engine_that_fails_twice_in_a_row_ends_the_run_in_one_line(tmp_path: Path) -> None:
    cfg = quick_config("arithmetic", *RUN, FAULTY, "+engine.fault=skip", "+engine.at_version=1",
                       "+engine.times=100", "pipeline.num_steps=8")
    with pytest.raises(BaseException) as info:  # the run's own error, inside its task group's
        run(cfg, tmp_path)
    message = explain(info.value)  # what the command line prints, and nothing else
    assert message is not None and "\n" not in message
    assert "failed weight attestation in 2 batches in a row" in message
    assert any(isinstance(e, AttestationFailed) for e in chain(info.value))


def test_an_engine_that_cannot_attest_is_refused_at_start_unless_attest_is_off(
        tmp_path: Path) -> None:
    unattested = ("engine._target_=faulty_engines.UnattestedEngine", "pipeline.num_steps=1")
    with pytest.raises(BaseException) as info:
        run(quick_config("arithmetic", *RUN, *unattested), tmp_path / "refused")
    assert any(isinstance(e, ConfigError) for e in chain(info.value))
    message = explain(info.value)
    assert message is not None and "\n" not in message
    assert "UnattestedEngine" in message and "set engine.attest=false" in message
    assert not metrics(tmp_path / "refused")  # before any step
    run(quick_config("arithmetic", *RUN, *unattested, "engine.attest=false"), tmp_path / "off")
    first = json.loads((tmp_path / "off" / "metrics.jsonl").read_text().splitlines()[0])
    assert "faults/attestation" not in first  # no check


@pytest.mark.anyio
@pytest.mark.parametrize("attest", [True, False])
async def test_the_trainer_fingerprints_what_it_publishes_only_for_engines_that_attest(
        attest: bool) -> None:
    """engine.attest=false computes no fingerprint on the trainer's side either: a 135M model's
    takes a third of a second of CPU per update."""
    cfg = quick_config("smoke", f"engine.attest={str(attest).lower()}")
    trainer = training_parts(run_config(cfg)).trainer
    update = await trainer.weights()
    assert (update.fingerprint is not None) == attest
    if attest:
        assert update.fingerprint == fingerprint(update.served_tensors())


@pytest.mark.anyio
async def test_the_next_steps_update_waits_for_the_fingerprint_of_the_weights_published(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's fingerprint is computed in a thread of its own while the update travels and
    the next step's passes run; that step's optimiser update waits for it, so the fingerprint
    is of the weights published even when it takes longer than the step's passes."""
    slow = WeightUpdate._served_fingerprint

    def slower(update: WeightUpdate) -> str:
        time.sleep(0.5)  # longer than the toy model's forward and backward passes
        return slow(update)

    monkeypatch.setattr(WeightUpdate, "_served_fingerprint", slower)
    trainer = training_parts(run_config(quick_config("smoke"))).trainer
    update = await trainer.weights()
    published = {k: v.clone() for k, v in update.served_tensors().items()}
    update.release()  # the engines' copy is made
    await trainer.step(make_groups())
    assert update.fingerprint == fingerprint(published)
    changed = await trainer.weights()
    assert await changed.known_fingerprint() != update.fingerprint  # the step changed them
