"""The ``InferenceEngine`` interface every backend implements (torch, vLLM, simulated).

An engine turns prompt token ids into sampled token ids, each stamped with its behaviour
log-probability and the policy version that produced it. Weight updates land while requests
are in flight: :func:`sync_weights` calls :meth:`pause`, :meth:`update_weights`,
:meth:`resume` (the pipeline's weight sync, and the warm start's and evaluations' loads).
Between ``pause`` returning and ``resume`` no token is produced; requests that were in
flight continue after ``resume`` under the new weights. (Finishing in-flight episodes under
the old weights instead is the pipeline's choice: it waits for them before pausing.)

An engine is built from config (``conf/engine/*.yaml`` plus the model's ``conf/model`` node)
and a :class:`~orchestrator.weights.update.WeightUpdate` holding its starting weights, never from a
live policy object, so the same config builds it in this process or in another one. A run
builds its engine once; warm-start checks and evaluations reuse it.

Engines are async context managers: ``async with engine:`` starts whatever loop they run and
stops it, failing any request still waiting with :class:`~orchestrator.errors.EngineClosed`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import TracebackType
from typing import ClassVar, Self

from orchestrator.faults import kill_point
from orchestrator.types import Generation, SamplingParams
from orchestrator.weights.delta import Loaded
from orchestrator.weights.update import WeightUpdate


class InferenceEngine(ABC):
    version: int = 0
    # The fingerprint (orchestrator/weights/fingerprint.py) of the weights the engine holds,
    # computed from its own tensors after every load and stamped, with the version, on what it
    # generates; None from an engine that does not attest.
    fingerprint: str | None = None
    # What the last load moved (bytes pulled, whether as a delta: orchestrator/weights/delta.py);
    # None from an engine that does not say.
    last_load: Loaded | None = None
    # Whether a second copy of this engine in the run's process is cheap on the CPU: then
    # ``eval.engine=auto`` gives evaluations during RL one of their own (a model copy in
    # memory) rather than sharing the rollout engine. An engine of processes or GPUs: no.
    cheap_copy_on_cpu: ClassVar[bool] = False

    @abstractmethod
    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation: ...

    @abstractmethod
    async def update_weights(self, update: WeightUpdate) -> None:
        """Load ``update``'s weights and serve ``update.version`` from now on.

        Called only between :meth:`pause` and :meth:`resume`. An update by reference is read
        before this returns; the caller releases it afterwards.
        """

    @abstractmethod
    async def pause(self) -> None:
        """Stop producing tokens at the next token boundary; return once stopped."""

    @abstractmethod
    async def resume(self) -> None: ...

    async def sleep(self) -> None:
        """Give the device's memory to a train step (``launcher.colocate``): requests in flight
        wait, as under :meth:`pause`, and the next weight sync (its :meth:`resume`) brings the
        engine back. Default: nothing (an engine beside its trainer, or on its own device)."""

    @property
    def attests(self) -> bool:
        """Whether this engine computes :attr:`fingerprint` (``engine.attest`` needs it)."""
        return False

    async def attested(self) -> str | None:
        """:attr:`fingerprint`, awaited: an engine that computes it after a load while it
        generates again (the torch engine) is waited for here, not blocked on."""
        return self.fingerprint

    @property
    def engines(self) -> list[InferenceEngine]:
        """The engines that serve this one's requests: itself (a router's: its replicas')."""
        return [self]

    @property
    def context_length(self) -> int | None:
        """The most positions a sequence may have (prompt + generated); None: not known here."""
        return None

    def metrics(self) -> dict[str, float]:
        """Counters the engine keeps (``faults/engine_restarts``, …), added to each step's metrics."""
        return {}

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        pass


async def sync_weights(engine: InferenceEngine, update: WeightUpdate) -> None:
    """Pause ``engine`` at a token boundary, load ``update``, resume, release the update (an
    in-process trainer waits for that before changing its tensors again)."""
    await engine.pause()
    try:
        kill_point("weight_sync", update.version)
        await engine.update_weights(update)
    finally:
        await engine.resume()
        update.release()
