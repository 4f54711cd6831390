"""Weights from the trainer to the engines: the update that carries them
(:mod:`~orchestrator.weights.update`), exact deltas (:mod:`~orchestrator.weights.delta`),
the fingerprint both sides compute (:mod:`~orchestrator.weights.fingerprint`) and the check
that samples carry the version they claim (:mod:`~orchestrator.weights.attest`)."""
