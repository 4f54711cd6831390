"""Bounded staleness: admission control at rollout start, a freshness check at batch time.

With batch size ``B`` (samples per train step) and ``k = max_staleness``:

* **Admission.** A rollout of ``n`` samples may start only while
  ``admitted + n <= (version - v0) * B + budget``, where ``admitted`` counts every sample
  started since the run began at version ``v0``, minus those dropped or lost, and ``budget``
  is how many may be started and not yet trained (:func:`admission_budget`): ``(k + 1) * B``
  by default (AReaL's rule), ``(1 + overprovision) * B`` for partial rollout
  (:mod:`orchestrator.pipeline.pipeline`).
  ``version`` is the policy version the engines serve, so with ``k = 0`` nothing new starts
  until the weights of the last step are loaded: generation and training alternate.
* **Freshness** (:func:`is_fresh`). When a batch is formed at trainer version ``v``, a sample
  whose start version is older than ``v - k`` is never trained on; it is dropped, counted, and its
  admission slot given back. A sample's first generated token carries its start version and
  later tokens only newer ones, so every trained token's version is ``>= v - k``.
"""

from __future__ import annotations

import math

import anyio

from orchestrator.errors import ConfigError


def admission_budget(batch_size: int, max_staleness: int,
                     overprovision: float | None = None) -> int:
    """Samples that may be started and not yet trained or dropped: ``(k + 1) * B`` for bounded
    staleness, ``(1 + overprovision) * B`` for partial rollout (admission rounds it down to
    whole groups)."""
    if overprovision is None:
        return (max_staleness + 1) * batch_size
    return batch_size + math.ceil(overprovision * batch_size)


def is_fresh(start_version: int, train_version: int, max_staleness: int) -> bool:
    """Whether a sample started at ``start_version`` may be trained at ``train_version``."""
    return start_version >= train_version - max_staleness


class StalenessController:
    def __init__(self, batch_size: int, max_staleness: int, version: int = 0,
                 budget: int | None = None) -> None:
        if max_staleness < 0:
            raise ConfigError(f"pipeline.max_staleness must be >= 0, got {max_staleness}")
        if batch_size < 1:
            raise ConfigError(f"pipeline.batch_size must be >= 1, got {batch_size}")
        if budget is not None and budget < batch_size:
            raise ConfigError(f"an admission budget of {budget} samples cannot fill a batch of "
                              f"{batch_size}")
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.budget = budget if budget is not None else admission_budget(batch_size, max_staleness)
        self.version = version
        self._base = version  # a resumed run starts counting admissions from here
        self.admitted = 0
        self.dropped = 0
        self._changed = anyio.Condition()

    @property
    def capacity(self) -> int:
        return (self.version - self._base) * self.batch_size + self.budget

    async def admit(self, n: int) -> int:
        """Wait until ``n`` more samples may start; return the version they start under."""
        if n > self.batch_size:
            raise ConfigError(f"a rollout of {n} samples can never fit a batch of {self.batch_size}")
        async with self._changed:
            while self.admitted + n > self.capacity:
                await self._changed.wait()
            self.admitted += n
            return self.version

    async def release(self, n: int, *, dropped: bool) -> None:
        """Give back ``n`` admission slots (samples dropped as stale, or lost)."""
        async with self._changed:
            self.admitted -= n
            if dropped:
                self.dropped += n
            self._changed.notify_all()

    async def set_version(self, version: int) -> None:
        async with self._changed:
            self.version = version
            self._changed.notify_all()

    def is_fresh(self, start_version: int, train_version: int) -> bool:
        return is_fresh(start_version, train_version, self.max_staleness)
