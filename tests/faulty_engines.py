"""Engines for the attestation tests, named by ``engine._target_=faulty_engines.…``: the torch
engine with one weight-loading fault (:class:`bench.faulty_engine.FaultyEngine`, shared with
``bench.chaos``: ``+engine.fault=…``, ``+engine.at_version=N``, ``+engine.times=…``) and one
without the fingerprint hook."""

from __future__ import annotations

from bench.faulty_engine import FAULTS, FaultyEngine
from orchestrator.engines.torch_engine import TorchEngine

__all__ = ["FAULTS", "FaultyEngine", "UnattestedEngine"]


class UnattestedEngine(TorchEngine):
    """A backend without the fingerprint hook."""

    @property
    def attests(self) -> bool:
        return False
