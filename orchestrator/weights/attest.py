"""The trainer's side of weight attestation (``engine.attest``; DESIGN.md "Attested weights").

Every update the trainer publishes carries the fingerprint of its weights
(:meth:`~orchestrator.weights.update.WeightUpdate.attested`); every engine reports the fingerprint
of the weights it holds, and every generated segment of a trajectory carries the engine, version and
fingerprint that produced it (:class:`~orchestrator.types.Attestation`). :class:`Attestor` keeps the
published fingerprint of each version and checks each batch before it is trained: a segment whose
fingerprint is not the one published for its version is an attestation failure. Its tokens are
loss-masked (kept as context, never trained), the failure is counted (``faults/attestation``: one
per engine per batch it failed in) and the engine is named in the log; the pipeline then has the
engines reload the last update. Tokens the same wrong weights produced before that reload and that
reach a later batch are masked too but not counted again. An engine that fails in two batches in a
row (wrong weights it served after a reload; a batch of only its known wrong tokens in between does
not break the row, one of only good ones does) ends the run with one line
(:class:`AttestationFailed`).

A segment with no fingerprint (an engine that does not attest) is a failure too: a run with
``engine.attest=true`` refuses such an engine at start, so one here was not expected.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from orchestrator.errors import RunAborted
from orchestrator.types import Group, Trajectory

log = logging.getLogger(__name__)

FAULT = "faults/attestation"
# versions kept: a sample is trained at most k versions after it started; far more than any k
KEEP_VERSIONS = 1024


class AttestationFailed(RunAborted):
    """An engine served weights other than those published, in two batches in a row."""


class Attestor:
    def __init__(self, max_in_a_row: int = 2) -> None:
        self.max_in_a_row = max_in_a_row
        self.published: dict[int, str | None] = {}
        self.failures = 0  # engine-batches that failed (faults/attestation)
        self.masked_tokens = 0
        self._in_a_row: dict[str, int] = {}  # engine -> batches in a row it failed in
        # (engine, version, fingerprint) already counted: its later tokens (generated before
        # the reload, trained in a later batch) are masked, not counted again
        self._seen: set[tuple[str, int, str | None]] = set()

    def publish(self, version: int, fingerprint: str | None) -> None:
        """``fingerprint`` is what an engine serving ``version`` must report."""
        self.published[version] = fingerprint
        for old in [v for v in self.published if v <= version - KEEP_VERSIONS]:
            del self.published[old]

    def check(self, groups: Sequence[Group]) -> tuple[list[Group], set[str]]:
        """The groups with every failing segment's tokens masked, and the engines that failed
        anew (empty: nothing to reload). Raises :class:`AttestationFailed` for an engine that
        failed in the previous batch too."""
        failed: set[str] = set()
        clean = {a.engine for g in groups for t in g.trajectories for a in t.attestations}
        out = []
        for group in groups:
            trajectories = tuple(self._masked(t, failed, clean) for t in group.trajectories)
            changed = any(a is not b for a, b in zip(trajectories, group.trajectories, strict=True))
            out.append(replace(group, trajectories=trajectories) if changed else group)
        for engine in failed:
            self._in_a_row[engine] = self._in_a_row.get(engine, 0) + 1
            log.warning("attestation failure: engine %s served weights whose fingerprint is "
                        "not the one published for their version; its tokens are not trained "
                        "and the engines reload the last update", engine or "(the engine)")
        for engine in [e for e in self._in_a_row if e in clean]:  # served only good tokens
            del self._in_a_row[engine]
        self.failures += len(failed)
        for engine, n in self._in_a_row.items():
            if n >= self.max_in_a_row:
                raise AttestationFailed(
                    f"engine {engine or '(the engine)'} failed weight attestation in {n} batches "
                    f"in a row (it serves weights other than those published for its version, "
                    f"even after a reload); see docs/attestation.md")
        return out, failed

    def _masked(self, t: Trajectory, failed: set[str], clean: set[str]) -> Trajectory:
        """``t`` with its failing segments masked; their engines are taken out of ``clean``,
        and those failing anew put in ``failed``."""
        bad = [a for a in t.attestations
               if a.version not in self.published or a.fingerprint != self.published[a.version]]
        if not bad:
            return t
        mask = list(t.loss_mask)
        for a in bad:
            key = (a.engine, a.version, a.fingerprint)
            clean.discard(a.engine)
            if key not in self._seen:
                failed.add(a.engine)
                self._seen.add(key)
            self.masked_tokens += sum(mask[a.start:a.end])
            mask[a.start:a.end] = [False] * (a.end - a.start)
        return replace(t, loss_mask=tuple(mask))

    def metrics(self) -> dict[str, float]:
        return {FAULT: float(self.failures), "attestation/masked_tokens": float(self.masked_tokens)}
