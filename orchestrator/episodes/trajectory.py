"""An episode's token sequence, built by appending: the prompt, then each turn's generation and
the observation that follows it.

:class:`TrajectoryBuilder` owns the four per-token sequences of a
:class:`~orchestrator.types.Trajectory` (token ids, loss mask, behaviour log-probs, policy
versions) and extends them together, so they cannot fall out of step. Generated tokens are
trained on: mask set, with the engine's log-probs and versions. Prompt and observation tokens
are context: mask clear, log-prob 0, version -1. Nothing appended is changed or re-tokenised
later, so what the trainer scores is exactly what the engine saw and produced. Each run of
generated tokens of one version from one engine is an
:class:`~orchestrator.types.Attestation`: the engine, version and weights' fingerprint.
"""

from __future__ import annotations

from collections.abc import Sequence

from envs.base import RewardTerm
from orchestrator.types import Attestation, FinishReason, Generation, Trajectory


class TrajectoryBuilder:
    def __init__(self) -> None:
        self._ids: list[int] = []
        self._mask: list[bool] = []
        self._logprobs: list[float] = []
        self._versions: list[int] = []
        self._attestations: list[Attestation] = []
        self.prompt_tokens = 0
        self.start_version: int | None = None  # of the first generated token
        self.finish_reason = FinishReason.LENGTH  # of the last generation

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def ids(self) -> tuple[int, ...]:
        """The sequence so far: the next generation's prompt."""
        return tuple(self._ids)

    def add_prompt(self, ids: Sequence[int]) -> None:
        if self._ids:
            raise ValueError("the prompt opens the sequence; it was already started")
        self._add_context(ids)
        self.prompt_tokens = len(ids)

    def add_generation(self, gen: Generation) -> None:
        fingerprints = dict(gen.fingerprints)
        offset, versions = len(self._ids), gen.versions
        cuts = [i for i in range(1, len(versions)) if versions[i] != versions[i - 1]]
        for start, end in zip([0, *cuts], [*cuts, len(versions)], strict=True):
            if end > start:  # one segment per run of one version
                self._attestations.append(Attestation(
                    offset + start, offset + end, versions[start],
                    fingerprints.get(versions[start]), gen.engine))
        self._ids += gen.token_ids
        self._mask += [True] * len(gen.token_ids)
        self._logprobs += gen.logprobs
        self._versions += gen.versions
        if self.start_version is None:
            self.start_version = gen.versions[0] if gen.versions else gen.start_version
        self.finish_reason = gen.finish_reason

    def add_observation(self, ids: Sequence[int]) -> None:
        self._add_context(ids)

    def _add_context(self, ids: Sequence[int]) -> None:
        self._ids += ids
        self._mask += [False] * len(ids)
        self._logprobs += [0.0] * len(ids)
        self._versions += [-1] * len(ids)

    def build(self, *, prompt_id: int, sample_index: int, reward: float, version: int,
              end_reason: str, max_tokens: int,
              metrics: dict[str, float] | None = None,
              reward_terms: tuple[RewardTerm, ...] = ()) -> Trajectory:
        """The finished trajectory; ``version`` is its start version if nothing was generated.
        Timings are left at their defaults for the episode's trace to fill in."""
        return Trajectory(
            prompt_id=prompt_id,
            sample_index=sample_index,
            token_ids=tuple(self._ids),
            loss_mask=tuple(self._mask),
            logprobs=tuple(self._logprobs),
            versions=tuple(self._versions),
            reward=reward,
            start_version=self.start_version if self.start_version is not None else version,
            finish_reason=self.finish_reason,
            metrics=dict(metrics or {}),
            end_reason=end_reason,
            prompt_tokens=self.prompt_tokens,
            max_tokens=max_tokens,
            reward_terms=reward_terms,
            attestations=tuple(self._attestations),
        )
