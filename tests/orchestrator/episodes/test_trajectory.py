"""The trajectory builder (orchestrator/episodes/trajectory.py): token ids, loss mask, behaviour
log-probs and versions grow together; only generated tokens are trained on."""

from __future__ import annotations

import pytest

from orchestrator.episodes.trajectory import TrajectoryBuilder
from orchestrator.types import Attestation, FinishReason, Generation


def test_the_four_sequences_stay_aligned_and_only_generations_are_trained_on() -> None:
    tokens = TrajectoryBuilder()
    tokens.add_prompt([1, 2, 3])
    tokens.add_generation(Generation((4, 5), (-0.1, -0.2), (7, 8), FinishReason.STOP, 7))
    tokens.add_observation([9])
    tokens.add_generation(Generation((10,), (-0.3,), (8,), FinishReason.LENGTH, 8))
    assert len(tokens) == 7 and tokens.ids == (1, 2, 3, 4, 5, 9, 10)
    t = tokens.build(prompt_id=5, sample_index=1, reward=1.0, version=99, end_reason="max_turns",
                     max_tokens=4, metrics={"m": 1.0})
    assert t.token_ids == (1, 2, 3, 4, 5, 9, 10)
    assert t.loss_mask == (False, False, False, True, True, False, True)
    assert t.logprobs == (0.0, 0.0, 0.0, -0.1, -0.2, 0.0, -0.3)
    assert t.versions == (-1, -1, -1, 7, 8, -1, 8)
    assert t.start_version == 7 and t.end_version == 8 and t.num_generated == 3
    assert t.finish_reason is FinishReason.LENGTH  # of the last generation
    assert t.prompt_tokens == 3 and t.max_tokens == 4 and t.end_reason == "max_turns"
    assert (t.prompt_id, t.sample_index, t.reward, t.metrics) == (5, 1, 1.0, {"m": 1.0})


def test_each_run_of_one_version_from_one_engine_is_one_attested_segment() -> None:
    tokens = TrajectoryBuilder()
    tokens.add_prompt([1, 2])
    tokens.add_generation(Generation((3, 4, 5), (0.0,) * 3, (7, 7, 8), FinishReason.LENGTH, 7,
                                     fingerprints=((7, "f7"), (8, "f8")), engine="a"))
    tokens.add_observation([6])
    tokens.add_generation(Generation((7, 8), (0.0,) * 2, (8, 8), FinishReason.STOP, 8,
                                     fingerprints=((8, "g8"),), engine="b"))
    tokens.add_generation(Generation((9,), (0.0,), (9,), FinishReason.STOP, 9))  # no attestation
    t = tokens.build(prompt_id=0, sample_index=0, reward=0.0, version=7, end_reason="done",
                     max_tokens=4)
    assert t.attestations == (Attestation(2, 4, 7, "f7", "a"), Attestation(4, 5, 8, "f8", "a"),
                              Attestation(6, 8, 8, "g8", "b"), Attestation(8, 9, 9, None, ""))


def test_an_episode_that_generated_nothing_starts_at_the_given_version() -> None:
    tokens = TrajectoryBuilder()
    tokens.add_prompt([1, 2])
    t = tokens.build(prompt_id=0, sample_index=0, reward=0.0, version=4, end_reason="max_length",
                     max_tokens=8)
    assert t.start_version == 4 and t.num_generated == 0 and t.loss_mask == (False, False)
    assert t.finish_reason is FinishReason.LENGTH


def test_the_prompt_opens_the_sequence() -> None:
    tokens = TrajectoryBuilder()
    tokens.add_prompt([1])
    with pytest.raises(ValueError, match="prompt"):
        tokens.add_prompt([2])
