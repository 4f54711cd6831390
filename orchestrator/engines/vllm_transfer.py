"""vLLM's own weight-transfer engines driven from the engine's process
(``engine.weight_transfer=nccl|ipc``; chosen by :mod:`orchestrator.engines.placement`).

vLLM 0.32 splits a transfer into a trainer-side engine (``TrainerWeightTransferEngine``, built
by ``WeightTransferTrainerFactory.trainer_init(init_info, client=, source=)``) and a worker-side
one (built by vLLM from ``WeightTransferConfig(backend=...)``). The trainer side pulls tensors
from a ``WeightSource`` and drives the workers through a ``VLLMWeightSyncClient``, four
synchronous calls (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``); its ``send_weights()`` runs one round. Nothing
here moves a byte itself: this module only adapts the two ends to the run.

* :class:`LoopClient` is that client for an ``AsyncLLM`` running on this process's asyncio
  loop: each call is submitted to the loop from the calling thread and waited for. So the
  trainer side must run off the loop (``anyio.to_thread``): NCCL runs ``update_weights`` on a
  side thread while the calling thread broadcasts, and both must reach the loop.
* :class:`UpdateSource` is the ``WeightSource`` a round reads: the tensors of the current
  :class:`~orchestrator.weights.update.WeightUpdate` (the trainer's own, by reference, when the
  trainer runs in this process), moved to the trainer's GPU if they are elsewhere (a
  checkpoint loaded on the CPU, a warm start).

Limits: one trainer process (rank 0 is the only sender; FSDP ranks in other processes would
each have to join, see the field's deadlocks in docs/vllm.md); the trainer in this process
(``launcher=local``); not yet run on a GPU.
"""

from __future__ import annotations

import asyncio
import base64
import pickle
from collections.abc import Coroutine, Iterator, Mapping
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    WeightSource,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
from vllm.utils.network_utils import get_open_port


class LoopClient:
    """``VLLMWeightSyncClient`` for an ``AsyncLLM`` on ``loop``, called from other threads."""

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._llm = llm
        self._loop = loop

    def _wait(self, call: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(call, self._loop).result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._wait(self._llm.init_weight_transfer_engine(
            WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._wait(self._llm.start_weight_update())

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._wait(self._llm.update_weights(
            WeightTransferUpdateRequest(update_info=_wire(update_info))))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._wait(self._llm.finish_weight_update(weight_version))


def _wire(update_info: Any) -> Any:
    """IPC handles hold types and dtypes, which vLLM's msgpack channel to its engine core does
    not carry: they go as the documented ``ipc_handles_pickled`` field (read by the workers
    under ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which the engine sets for ``ipc``)."""
    if isinstance(update_info, list):
        return [_wire(info) for info in update_info]
    handles = update_info.get("ipc_handles")
    if handles is None:
        return update_info
    rest = {k: v for k, v in update_info.items() if k != "ipc_handles"}
    return {**rest, "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()}


class UpdateSource(WeightSource):
    """The tensors of the update being sent, on ``device`` (set before every round)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tensors: Mapping[str, torch.Tensor] = {}

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.tensors.items():
            yield name, tensor.detach().to(self.device)


class Sender:
    """The trainer side of one engine's transfers: built once (the rendezvous), then one
    :meth:`send` a weight update. Every method blocks: call it in a worker thread."""

    def __init__(self, backend: str, llm: Any, loop: asyncio.AbstractEventLoop,
                 device: torch.device, engine_ranks: int) -> None:
        self.device = device
        self.source = UpdateSource(device)
        client = LoopClient(llm, loop)
        info: IPCTrainerInitInfo | NCCLTrainerInitInfo
        if backend == "ipc":
            info = IPCTrainerInitInfo(rank=0)
        else:  # nccl: rank 0 here, the engine's workers after it
            info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=get_open_port(),
                                       world_size=1 + engine_ranks, rank=0)
        with torch.cuda.device(device):  # the trainer side reads the thread's current device
            self._engine = WeightTransferTrainerFactory.trainer_init(
                info, client=client, source=self.source)

    def send(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.source.tensors = tensors
        try:
            with torch.cuda.device(self.device):
                self._engine.send_weights()
        finally:
            self.source.tensors = {}

    def close(self) -> None:
        self._engine.shutdown()
