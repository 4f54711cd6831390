"""Torch engines that load weights wrongly on purpose: the four faults weight attestation must
catch (docs/attestation.md). A run gets one only by naming it (``engine._target_=
bench.faulty_engine.ChaosEngine`` or ``…FaultyEngine``); the production engines carry none of
this.

The faults, each applied to one load (:func:`misload`):

* ``skip``: the load is skipped but the new version reported;
* ``partial``: one tensor (the first, by name, that the update changes) is left as it was;
* ``restart``: the engine goes back to the weights it started from and is told the new version
  (an engine process restarted from the initial checkpoint);
* ``adapter``: (LoRA) the previous update's adapters are loaded again under the new version.

:class:`FaultyEngine` fails on a version fixed by config (the attestation tests).
:class:`ChaosEngine` fails when ``bench.chaos`` arms it, by events: the bench writes
``<fault_dir>/armed.json`` after a trained step; the first engine (of the run's replicas) whose
next load claims the file (an atomic rename: one engine only) misloads, and writes
``injected-<id>.json`` saying which engine, which version and what it now reports, or
``ineffective-<id>.json`` when the wrong load left it holding the published weights anyway (the
update changed nothing the fault touched): the bench arms that fault again after a step. The
files are the injector's log, as ``bench.chaos`` prints its other faults; detection is the run's
own (``faults/attestation``), audited from the run's files.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from orchestrator.engines.torch_engine import TorchEngine
from orchestrator.weights.update import WeightUpdate

FAULTS = ("skip", "partial", "restart", "adapter")
ARMED = "armed.json"


class _Misloading(TorchEngine):
    """Keeps what a fault needs: the weights it started from and the previous update."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._start: WeightUpdate | None = None
        self._previous: WeightUpdate | None = None
        super().__init__(*args, **kwargs)

    def _load(self, update: WeightUpdate) -> None:
        if self._start is None:
            self._start = update.snapshot()
        previous, self._previous = self._previous, update.snapshot()
        fault = self._fault(update)
        if fault is None:
            return super()._load(update)
        self._misload(fault, update, previous)

    def _fault(self, update: WeightUpdate) -> str | None:
        """The fault this load makes, if any."""
        return None

    def _misload(self, fault: str, update: WeightUpdate, previous: WeightUpdate | None) -> None:
        if fault == "skip":
            self.version = update.version
        elif fault == "partial":
            tensors = dict(update.tensors())
            held = self.model.state_dict()
            storages = Counter(t.untyped_storage().data_ptr() for t in held.values())
            changed = [n for n in sorted(tensors)  # not a tied one: its twin would load it
                       if n in held and storages[held[n].untyped_storage().data_ptr()] == 1
                       and not held[n].equal(tensors[n].to(held[n]))]
            if changed:  # else the update changes nothing: the full load below is right
                tensors[changed[0]] = held[changed[0]].clone()
            super()._load(WeightUpdate.by_reference(update.version, tensors, leased=False))
        elif fault == "restart":
            assert self._start is not None
            super()._load(self._start)
            self.version = update.version
        else:
            if previous is None or previous.adapters is None:
                raise ValueError("the adapter fault needs a LoRA run (trainer.lora) and an "
                                 "earlier adapter update")
            super()._load(WeightUpdate.by_reference(update.version, previous.tensors(),
                                                    leased=False).with_adapters(previous.adapters))


class FaultyEngine(_Misloading):
    """``fault`` on the first load of version ``at_version`` or later, and on the ``times - 1``
    loads after it (``+engine.fault=…``, ``+engine.at_version=N``, ``+engine.times=…``)."""

    def __init__(self, *args: Any, fault: str, at_version: int, times: int = 1,
                 **kwargs: Any) -> None:
        if fault not in FAULTS:
            raise ValueError(f"engine.fault must be one of {FAULTS}, got {fault!r}")
        self.fault, self.at_version, self.times = fault, at_version, times
        super().__init__(*args, **kwargs)

    def _fault(self, update: WeightUpdate) -> str | None:
        if update.version < self.at_version or self.times <= 0:
            return None
        self.times -= 1
        return self.fault


class ChaosEngine(_Misloading):
    """Misloads when ``bench.chaos`` arms it through ``fault_dir`` (``+engine.fault_dir=…``)."""

    def __init__(self, *args: Any, fault_dir: str, **kwargs: Any) -> None:
        self.fault_dir = Path(fault_dir)
        self._armed: dict[str, Any] | None = None
        super().__init__(*args, **kwargs)

    def _fault(self, update: WeightUpdate) -> str | None:
        claimed = self.fault_dir / f"claimed-{uuid.uuid4().hex}.json"
        try:
            os.rename(self.fault_dir / ARMED, claimed)  # atomic: one engine claims it
        except FileNotFoundError:
            return None
        self._armed = json.loads(claimed.read_text())
        return str(self._armed["kind"])

    def _misload(self, fault: str, update: WeightUpdate, previous: WeightUpdate | None) -> None:
        super()._misload(fault, update, previous)
        assert self._armed is not None
        # what it now holds (its fingerprint is computed after every load, the skipped one's is
        # the previous load's) against what the trainer published for the version
        outcome = "ineffective" if self.fingerprint == update.fingerprint else "injected"
        record = {**self._armed, "engine": _actor_name(), "pid": os.getpid(),
                  "version": update.version, "fingerprint": self.fingerprint,
                  "published": update.fingerprint}
        tmp = self.fault_dir / f".{outcome}-{self._armed['id']}.json"
        tmp.write_text(json.dumps(record))
        tmp.replace(self.fault_dir / f"{outcome}-{self._armed['id']}.json")
        self._armed = None


def _actor_name() -> str:
    """This Ray actor's name (``<run>-engine-<i>``), or the empty string outside Ray."""
    try:
        import ray

        return ray.get_runtime_context().get_actor_name() or ""
    except (ImportError, RuntimeError):
        return ""
