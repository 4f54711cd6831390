"""The trainer's attestation check (orchestrator/weights/attest.py) on hand-made batches: a clean
batch passes untouched; a segment whose fingerprint is not the published one is masked, counted and
its engine named; the same wrong weights' tokens reaching a later batch (generated before the
reload) are masked but not counted again; new wrong weights in the next batch end the run."""

from __future__ import annotations

import pytest

from orchestrator.types import Attestation, FinishReason, Group, Trajectory
from orchestrator.weights.attest import FAULT, AttestationFailed, Attestor


def trajectory(*segments: Attestation) -> Trajectory:
    n = 10
    mask = tuple(any(s.start <= i < s.end for s in segments) for i in range(n))
    return Trajectory(prompt_id=0, sample_index=0, token_ids=(1,) * n, loss_mask=mask,
                      logprobs=(0.0,) * n, versions=(1,) * n, reward=1.0, start_version=1,
                      finish_reason=FinishReason.STOP, attestations=segments)


def group(*trajectories: Trajectory) -> Group:
    return Group(prompt_id=0, trajectories=trajectories, start_version=1)


@pytest.fixture
def attestor() -> Attestor:
    a = Attestor()
    a.publish(1, "one")
    a.publish(2, "two")
    return a


def test_a_clean_batch_passes_untouched(attestor: Attestor) -> None:
    batch = [group(trajectory(Attestation(2, 5, 1, "one", "a"), Attestation(5, 8, 2, "two", "a")))]
    out, failed = attestor.check(batch)
    assert out == batch and failed == set()
    assert attestor.metrics() == {FAULT: 0.0, "attestation/masked_tokens": 0.0}


def test_a_wrong_fingerprint_masks_its_segment_only_and_names_its_engine(attestor: Attestor) -> None:
    t = trajectory(Attestation(2, 5, 1, "one", "a"), Attestation(5, 8, 2, "stale", "a"))
    other = trajectory(Attestation(2, 6, 2, "two", "b"))
    out, failed = attestor.check([group(t, other)])
    assert failed == {"a"}
    assert out[0].trajectories[0].loss_mask == tuple(2 <= i < 5 for i in range(10))
    assert out[0].trajectories[1] == other
    assert attestor.metrics() == {FAULT: 1.0, "attestation/masked_tokens": 3.0}


def test_an_unpublished_version_or_a_missing_fingerprint_fails(attestor: Attestor) -> None:
    _, failed = attestor.check([group(trajectory(Attestation(2, 4, 7, "seven", "a")),
                                      trajectory(Attestation(2, 4, 1, None, "b")))])
    assert failed == {"a", "b"}


def test_tokens_of_wrong_weights_from_before_the_reload_are_masked_not_counted_again(
        attestor: Attestor) -> None:
    bad = Attestation(2, 5, 2, "stale", "a")
    attestor.check([group(trajectory(bad))])
    attestor.publish(3, "three")
    out, failed = attestor.check([group(trajectory(bad, Attestation(5, 8, 3, "three", "a")))])
    assert failed == set()  # the same wrong weights, served before the reload
    assert out[0].trajectories[0].loss_mask == tuple(5 <= i < 8 for i in range(10))
    assert attestor.metrics() == {FAULT: 1.0, "attestation/masked_tokens": 6.0}


def test_new_wrong_weights_in_the_next_batch_end_the_run(attestor: Attestor) -> None:
    attestor.check([group(trajectory(Attestation(2, 5, 1, "stale", "a")))])
    with pytest.raises(AttestationFailed, match="engine a failed weight attestation in 2 batches"):
        attestor.check([group(trajectory(Attestation(2, 5, 2, "stale", "a")))])


def test_a_clean_batch_between_two_failures_resets_the_count(attestor: Attestor) -> None:
    attestor.check([group(trajectory(Attestation(2, 5, 1, "stale", "a")))])
    attestor.check([group(trajectory(Attestation(2, 5, 2, "two", "a")))])
    _, failed = attestor.check([group(trajectory(Attestation(2, 5, 2, "stale2", "a")))])
    assert failed == {"a"}


def test_a_batch_of_known_wrong_tokens_alone_is_no_recovery(attestor: Attestor) -> None:
    attestor.check([group(trajectory(Attestation(2, 5, 1, "stale", "a")))])
    attestor.check([group(trajectory(Attestation(2, 5, 1, "stale", "a")))])  # from before
    with pytest.raises(AttestationFailed):
        attestor.check([group(trajectory(Attestation(2, 5, 2, "stale2", "a")))])
