"""A torch engine with one weight-loading fault, for the attestation tests: named by
``engine._target_=faulty_engines.FaultyEngine`` with ``+engine.fault=…`` and
``+engine.at_version=N`` (the first load of version N or later goes wrong; ``times`` loads in
all, the reloads after it included)."""

from __future__ import annotations

from typing import Any

from orchestrator.engines.torch_engine import TorchEngine
from orchestrator.weights import WeightUpdate

FAULTS = ("skip", "partial", "restart", "adapter")


class FaultyEngine(TorchEngine):
    """``skip``: the load is skipped but the new version reported; ``partial``: one tensor is
    left as it was; ``restart``: the engine goes back to its starting weights and is told the
    new version; ``adapter``: (LoRA) the previous update's adapters are loaded again under the
    new version."""

    def __init__(self, *args: Any, fault: str, at_version: int, times: int = 1,
                 **kwargs: Any) -> None:
        if fault not in FAULTS:
            raise ValueError(f"engine.fault must be one of {FAULTS}, got {fault!r}")
        self.fault, self.at_version, self.times = fault, at_version, times
        self._start: WeightUpdate | None = None
        self._previous: WeightUpdate | None = None
        super().__init__(*args, **kwargs)

    def _load(self, update: WeightUpdate) -> None:
        if self._start is None:
            self._start = update.snapshot()
        faulty = update.version >= self.at_version and self.times > 0
        previous, self._previous = self._previous, update.snapshot()
        if not faulty:
            return super()._load(update)
        self.times -= 1
        if self.fault == "skip":
            self.version = update.version
        elif self.fault == "partial":
            tensors = dict(update.tensors())
            name = max(n for n in tensors if n.endswith(".weight"))
            tensors[name] = self.model.state_dict()[name].clone()
            super()._load(WeightUpdate.by_reference(update.version, tensors, leased=False))
        elif self.fault == "restart":
            super()._load(self._start)
            self.version = update.version
        else:
            assert previous is not None and previous.adapters is not None
            super()._load(WeightUpdate.by_reference(update.version, previous.tensors(),
                                                    leased=False).with_adapters(previous.adapters))


class UnattestedEngine(TorchEngine):
    """A backend without the fingerprint hook (as vLLM's is today)."""

    @property
    def attests(self) -> bool:
        return False
