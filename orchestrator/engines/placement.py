"""Where an engine runs relative to its trainer, and what follows from it: the weight-transfer
backend (``engine.weight_transfer``) and, when the two share a GPU, the engine's memory share.

Pure functions of a :class:`Placement`; nothing here touches a device. The launcher fills in
the trainer's side (is the trainer's memory in the engine's process, on which GPU, is the run
colocated) and the engine its own (does it run on CUDA, on which devices) where it is built.

Backends (vLLM's names, ``vllm.distributed.weight_transfer``):

* ``rpc``: safetensors bytes, or a file, through ``collective_rpc`` to the worker extension
  (:mod:`orchestrator.engines.vllm_worker`). Works everywhere; the only route on CPU and for a
  trainer in another process (``launcher=ray``, ``trainer.world_size`` ranks).
* ``ipc``: CUDA IPC handles of the trainer's tensors; the engine's workers read them in place.
  Needs the trainer's tensors in the engine's process and every engine worker on the trainer's
  GPU (colocation, ``tensor_parallel_size=1``).
* ``nccl``: a broadcast from the trainer's GPU to the engine's workers' over NCCL. Needs the
  trainer's tensors in the engine's process, on a GPU none of the engine's workers use (NCCL
  refuses two ranks on one device).

``auto``: ``ipc`` when the trainer shares the engine's one GPU, ``nccl`` when it has a GPU of
its own, ``rpc`` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from orchestrator.errors import ConfigError

Backend = Literal["rpc", "nccl", "ipc"]
WeightTransfer = Literal["auto", "rpc", "nccl", "ipc"]
# Colocated trainer memory left resident while the engine generates, per parameter: fp32
# weights (4), gradients (4) and AdamW's two moments (8). Its activations come and go while the
# engine sleeps.
TRAINER_BYTES_PER_PARAM = 16
MEMORY_MARGIN = 0.1  # of the GPU: CUDA contexts, allocator fragmentation, vLLM's own buffers
MIN_ENGINE_SHARE = 0.1
ALONE_SHARE = 0.9  # gpu_memory_utilization=auto on a GPU no trainer is on (vLLM's default)


@dataclass(frozen=True)
class Placement:
    cuda: bool = False  # the engine runs on CUDA
    engine_gpus: tuple[int, ...] = ()  # its workers' devices, in this process's numbering
    trainer_here: bool = True  # the trainer's tensors live in the engine's process
    trainer_gpu: int | None = None  # the trainer's (rank 0's) CUDA device; None: CPU or unknown
    colocate: bool = False  # launcher.colocate: the trainer and the engine take turns on one GPU
    # This engine's part of what its GPU has for engines: below 1 when engines share a GPU
    # (launcher=ray: launcher.engine.num_gpus below 1, or several engines colocated).
    gpu_fraction: float = 1.0

    @property
    def trainer_beside(self) -> bool:
        """A trainer keeps memory on the engine's GPU: colocated, or on one of its GPUs (the
        trainer in this process, or trainer rank 0 beside it on the same device)."""
        return self.colocate or (self.trainer_gpu is not None and self.trainer_gpu in self.engine_gpus)

    @property
    def shares_gpu(self) -> bool:
        """The trainer and every engine worker on one GPU."""
        return self.trainer_gpu is not None and set(self.engine_gpus) == {self.trainer_gpu}


def choose_weight_transfer(asked: str, placement: Placement) -> Backend:
    """The backend for ``engine.weight_transfer=asked`` at ``placement``; a
    :class:`ConfigError` naming the key when it does not fit."""
    if asked not in get_args(WeightTransfer):
        raise ConfigError(f"engine.weight_transfer={asked} must be one of "
                          f"{', '.join(get_args(WeightTransfer))}")
    if asked == "rpc":
        return "rpc"
    fit, why = _fits(placement)
    if asked == "auto":
        return fit
    if fit != asked:
        raise ConfigError(f"engine.weight_transfer={asked} does not fit this placement: {why}; "
                          f"use engine.weight_transfer=auto ({fit}) or rpc")
    return asked  # type: ignore[return-value]


def _fits(p: Placement) -> tuple[Backend, str]:
    """The one GPU backend a placement allows (or rpc), and why."""
    if not p.cuda:
        return "rpc", "the engine is not on a CUDA GPU"
    if not p.trainer_here:
        return "rpc", ("the trainer is in another process (launcher=ray or trainer.world_size "
                       "ranks), whose tensors this engine cannot reach")
    if p.trainer_gpu is None:
        return "rpc", "the trainer is not on a GPU (model.device)"
    engine = ",".join(f"cuda:{i}" for i in p.engine_gpus)
    if p.shares_gpu:
        return "ipc", f"the trainer and the engine share cuda:{p.trainer_gpu} (nccl needs two GPUs)"
    if p.trainer_gpu in p.engine_gpus:
        return "rpc", (f"the trainer's cuda:{p.trainer_gpu} is one of the engine's {engine} "
                       "(ipc needs all on one GPU, nccl all on different ones)")
    return "nccl", (f"the trainer (cuda:{p.trainer_gpu}) and the engine ({engine}) are on "
                    "different GPUs (ipc needs one shared GPU)")


def check_colocation(placement: Placement) -> None:
    """``launcher.colocate=true`` needs the trainer and the engine on one GPU."""
    if not placement.colocate:
        return
    if not placement.cuda:
        raise ConfigError("launcher.colocate=true needs a CUDA GPU for the engine; there is none "
                          "here: set launcher.colocate=false")
    if placement.trainer_here and not placement.shares_gpu:
        engine = ",".join(f"cuda:{i}" for i in placement.engine_gpus)
        trainer = "cpu" if placement.trainer_gpu is None else f"cuda:{placement.trainer_gpu}"
        raise ConfigError(f"launcher.colocate=true but the trainer ({trainer}) and the engine "
                          f"({engine}) are not on one GPU: set model.device to the engine's GPU "
                          "or launcher.colocate=false")


def engine_memory_share(placement: Placement, total_bytes: int, parameters: int) -> float:
    """vLLM's ``gpu_memory_utilization=auto`` on a GPU of ``total_bytes``: :data:`ALONE_SHARE`
    when no trainer is on it, else what is left beside a trainer of ``parameters`` parameters
    (:func:`colocated_memory_share`); times the engine's ``gpu_fraction`` of that, where
    engines share the GPU (each would otherwise claim it all, and the second fail to start).
    A trainer beside the engine without colocation is there all the time, so it needs at least
    what a colocated one keeps while the engine generates; vLLM would otherwise take 90% of
    the GPU and fail to start beside the trainer's weights, or leave the trainer's first step
    out of memory."""
    room = (colocated_memory_share(total_bytes, parameters) if placement.trainer_beside
            else ALONE_SHARE)
    return round(room * placement.gpu_fraction, 3)


def colocated_memory_share(total_bytes: int, parameters: int) -> float:
    """vLLM's ``gpu_memory_utilization`` beside a trainer of ``parameters`` parameters on a GPU
    of ``total_bytes``: what the trainer keeps resident while the engine generates
    (:data:`TRAINER_BYTES_PER_PARAM` a parameter) and a margin left out."""
    trainer = TRAINER_BYTES_PER_PARAM * parameters
    share = 1.0 - MEMORY_MARGIN - trainer / total_bytes
    if share < MIN_ENGINE_SHARE:
        raise ConfigError(
            f"engine.gpu_memory_utilization=auto: a trainer of {parameters / 1e9:.2f} B "
            f"parameters on the engine's GPU keeps about {trainer / (1 << 30):.1f} GiB of this "
            f"{total_bytes / (1 << 30):.1f} GiB GPU, too little is left for the engine: give the "
            "trainer a GPU of its own (model.device=cuda:N, launcher.colocate=false) or set "
            "engine.gpu_memory_utilization yourself")
    return round(share, 3)


def device_index(device: str, cuda: bool) -> int | None:
    """The CUDA device index ``model.device`` names where ``cuda`` says whether CUDA is
    visible (``auto`` and ``cuda``: device 0), None for the CPU."""
    if device == "auto":
        device = "cuda" if cuda else "cpu"
    if device.startswith("cuda"):
        _, _, index = device.partition(":")
        return int(index) if index else 0
    return None
