"""One rank of a data-parallel trainer: ``torch.distributed`` and FSDP2 under :class:`TorchTrainer`.

``trainer.world_size=N`` makes the launcher start N processes (Ray actors, or local processes)
that each build a :class:`RankTrainer` from the same recipe and join one process group (gloo
when the model is on the CPU, NCCL when it is on the rank's GPU) at rank 0's address. The model
is sharded with FSDP2 (``fully_shard`` on every decoder layer, then on the whole model): at rest
each rank holds ``1/N`` of the weights and of the optimiser's state. The driver sends every
step's whole batch to every rank; the maths is the one-process trainer's:

* the groups are split across ranks by token count (:func:`balance`, largest first onto the
  least-loaded rank; a group stays whole, so advantages and shared prefixes are unchanged);
* each minibatch's loss is normalised by the trained tokens of the whole minibatch over all
  ranks (an all-reduce), and the ranks' gradients are *summed* (FSDP's divide factor is 1),
  so the sum is the gradient one process computes on the whole batch;
* the gradient norm is clipped over the full (sharded) gradient, and the metrics are
  token-weighted sums over all ranks.

How a minibatch runs. The number of forward passes a rank makes depends on its data (how many
micro-batches, and whether a micro-batch shares a prefix: one pass or two), so no collective
may happen inside them. The parameters are gathered once per minibatch (``unshard``), every
micro-batch runs forward and backward with gradient sync and resharding off, and one *sync
pass* ends it: a one-token forward whose loss is zero, whose backward reduce-scatters the
accumulated gradients on every rank at once and reshards the parameters. During a minibatch a
rank therefore holds the full parameters and gradients (ZeRO-2 memory); at rest, and for the
optimiser step, they are sharded.

Weights for the engines: :meth:`RankTrainer.gather` all-gathers the parameters once per step
(``unshard``, as a minibatch does) and rank 0 copies the full state from them
(``gather_seconds`` in the update's stats); with LoRA, only the adapters. The parameters stay
gathered, so the next step's first minibatch starts without an all-gather of its own: one
all-gather per step serves both the engines and the trainer (the state-dict route gathered
them a second time).

Checkpoints: :meth:`RankTrainer.save` writes ``torch.distributed.checkpoint`` shards (model
and optimiser, by parameter name, so they load at any world size) plus ``trainer.pt``
(version, schedule) from rank 0.
"""

from __future__ import annotations

import copy
import datetime
import heapq
import random
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from orchestrator.errors import ConfigError
from orchestrator.models.policy import Policy
from orchestrator.trainer.logprobs import LogprobAgreement
from orchestrator.trainer.lora import adapter_update
from orchestrator.trainer.snapshot import SHARDS, TRAINER_STATE, load_shards
from orchestrator.trainer.torch_trainer import TorchTrainer
from orchestrator.weights.update import WeightUpdate


@dataclass(frozen=True)
class RankSpec:
    """Where one rank stands: its index, the group's size and rank 0's rendezvous address."""

    rank: int
    world_size: int
    address: str
    port: int
    backend: str = "auto"  # auto: nccl when the model is on a GPU, else gloo (backend_for)
    timeout_s: float = 300.0  # a collective that waits longer than this fails

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside trainer.world_size={self.world_size}")


def free_port() -> int:
    """A TCP port free on this host now, for rank 0 to bind moments later. It is drawn below the
    kernel's ephemeral range, which every outgoing connection takes its local port from (and a
    port asked of the kernel with bind(0) too): on a busy host such a port may be taken again
    before rank 0 binds it. (With Linux's default range, 20000-32767: above Ray's worker ports.)"""
    low = _ephemeral_low()
    rng = random.Random()  # not the run's seeded generator: two runs must not draw alike
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12768), low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that whole range busy: any port the kernel gives
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere the range below it is as good a guess


def balance(sizes: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices of ``sizes`` for each rank, the largest first onto the least-loaded rank (ties to
    the lowest rank), each rank's in their original order: deterministic on every rank."""
    loads = [(0, rank) for rank in range(world_size)]
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(loads)
        shares[rank].append(index)
        heapq.heappush(loads, (load + sizes[index], rank))
    return [sorted(share) for share in shares]


def backend_for(spec: RankSpec, device: torch.device) -> str:
    """The collectives' backend: ``spec.backend``, or for ``auto`` NCCL when the rank's model is
    on a GPU and gloo when it is on the CPU (NCCL cannot reduce host tensors; a GPU being
    present says nothing about where ``model.device`` put the model)."""
    if spec.backend != "auto":
        return spec.backend
    return "nccl" if device.type == "cuda" else "gloo"


def join(spec: RankSpec, device: torch.device) -> None:
    """Join the process group ``spec`` names (once per process), from a rank whose model is on
    ``device``."""
    if device.type == "cuda":  # model.device=cuda (or auto) has no index: the first visible GPU
        torch.cuda.set_device(device.index if device.index is not None else 0)
    backend = backend_for(spec, device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend, init_method=f"tcp://{spec.address}:{spec.port}", rank=spec.rank,
            world_size=spec.world_size, timeout=datetime.timedelta(seconds=spec.timeout_s))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules of the classes ``transformers`` never splits."""
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(f"trainer.world_size: found no decoder layers to shard in "
                          f"{type(model).__name__} (no _no_split_modules)")
    return layers


def unsharded_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``model.state_dict()`` names, read from the modules as they stand (after
    ``unshard``: the full parameters). ``state_dict()`` itself would reshard them first (FSDP2's
    pre-save hook)."""
    state: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, param in module._parameters.items():
            if param is not None:
                state[dot + name] = param.detach()
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                state[dot + name] = buffer.detach()
    return state


class RankTrainer(TorchTrainer):
    """A :class:`TorchTrainer` that is rank ``rank.rank`` of ``rank.world_size``."""

    def __init__(self, policy: Policy, *args: Any, rank: RankSpec, **options: Any) -> None:
        self.spec = rank
        join(rank, policy.device)
        self._sharded: list[Any] = []
        self._staged: tuple[dict[str, Any], dict[str, Any]] | None = None
        super().__init__(policy, *args, **options)

    @property
    def rank(self) -> int:
        return self.spec.rank

    # -- sharding --------------------------------------------------------------------------

    def _shard(self, model: torch.nn.Module) -> list[Any]:
        """``model``'s decoder layers and itself sharded over the ranks (FSDP2)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        options: dict[str, Any] = {"reshard_after_forward": False}
        if self.precision.compute is not None:  # trainer.precision=mixed: FSDP2's, not autocast
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.precision.compute,
                                                        reduce_dtype=torch.float32)
            self._autocasts = False
        # Resharding after forward would make the collectives depend on each rank's data (see
        # the module docstring): the parameters are gathered once per minibatch instead.
        return [fully_shard(layer, **options) for layer in decoder_layers(model)] + \
            [fully_shard(model, **options)]

    def _prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        self._sharded.extend(self._shard(model))
        for module in self._sharded:
            module.set_gradient_divide_factor(1.0)  # sum the ranks' shares of the gradient
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
        return model

    def _full_weights(self) -> None:
        for module in self._sharded:
            module.unshard()

    def _prepare_reference(self, model: torch.nn.Module) -> torch.nn.Module:
        self._reference_sharded = self._shard(model)
        return model

    @contextmanager
    def _reference(self) -> Iterator[torch.nn.Module]:
        """The frozen copy gathered by every rank at once (a rank without rows too, so the
        collectives match), and sharded again after."""
        with super()._reference() as model:
            if model is not self._reference_model:
                yield model
                return
            for module in self._reference_sharded:
                module.unshard()
            try:
                yield model
            finally:
                for module in self._reference_sharded:
                    module.reshard()

    @contextmanager
    def _accumulating(self) -> Iterator[None]:
        root = self._sharded[-1]
        self._full_weights()
        root.set_requires_gradient_sync(False)
        root.set_reshard_after_backward(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)
            root.set_reshard_after_backward(True)
        # The sync pass: the same single backward on every rank, however many each ran above.
        one = torch.tensor([[self.policy.tokenizer.pad_id]], device=self.device)
        logits = self.model(input_ids=one, attention_mask=torch.ones_like(one)).logits
        (logits.float().sum() * 0.0).backward()

    # -- the batch and its sums ---------------------------------------------------------------

    def _share_sizes(self, sizes: Sequence[int]) -> list[int]:
        return balance(sizes, self.spec.world_size)[self.rank]

    def _all_sum_tensor(self, values: torch.Tensor) -> torch.Tensor:
        t = values.to(self._comm_device)
        dist.all_reduce(t)
        return t.cpu()

    def _all_sum_named(self, values: Mapping[str, float]) -> dict[str, float]:
        everyone: list[Any] = [None] * self.spec.world_size
        dist.all_gather_object(everyone, dict(values))
        out: dict[str, float] = {}
        for part in everyone:
            for k, v in part.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def _agreement(self, agreement: LogprobAgreement) -> LogprobAgreement:
        agreement.settle()
        total, count = self._all_sum([agreement.total, agreement.count])
        top = torch.tensor([agreement.max], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        agreement.total, agreement.count, agreement.max = total, count, float(top)
        return agreement

    def _clip_gradients(self) -> float:
        from torch.distributed.tensor import DTensor

        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    @property
    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    # -- weights ---------------------------------------------------------------------------

    def gather(self) -> WeightUpdate | None:
        """The full weights (or, with LoRA, the adapters) on rank 0, gathered once from every
        rank's shards; None on the other ranks. Every rank must call it."""
        started = time.perf_counter()
        self._full_weights()  # kept gathered: the next step's first minibatch uses them
        if self.rank != 0:
            return None
        # The gathered tensors' memory is freed when the parameters are sharded again (the next
        # step's end), so what the engines get is copied now.
        state = unsharded_state(self.model)
        if self.lora is not None:
            with_base = not self._base_sent
            if with_base:
                state = {k: v.clone() for k, v in state.items()}
            update = adapter_update(self.version, state, self.lora.scale, with_base=with_base)
            self._base_sent = True
        else:
            update = WeightUpdate.by_reference(
                self.version, {k: v.clone() for k, v in state.items()},
                leased=False).with_wire_dtype(self._wire_dtype)
        update = update.attested() if self.fingerprints else update
        return update.with_stats(gather_seconds=time.perf_counter() - started)

    async def weights(self) -> WeightUpdate:
        raise TypeError("a rank's weights are gathered with RankTrainer.gather by every rank")

    # -- checkpoints --------------------------------------------------------------------------

    def _checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        rest = {"version": self.version, "scheduler": self.scheduler.state_dict(),
                "world_size": self.spec.world_size}
        shards = {"model": model_state, "optimizer": optim_state}
        if self._reference_model is not None and self._reference_started:
            shards["reference"] = get_model_state_dict(self._reference_model)
        return shards, rest

    def stage(self) -> None:
        """Copy this rank's shards of the weights and optimiser state (and the schedule) now,
        for :meth:`save` to write later while training goes on."""
        from torch.utils._pytree import tree_map_only

        shards, rest = self._checkpoint_state()
        self._staged = (tree_map_only(torch.Tensor, lambda t: t.detach().clone(), shards),
                        copy.deepcopy(rest))

    def save(self, directory: Path) -> None:
        """Write this rank's shards (every rank calls it): those :meth:`stage` copied, else the
        current ones; rank 0 writes ``trainer.pt`` too."""
        import torch.distributed.checkpoint as dcp

        shards, rest = self._staged if self._staged is not None else self._checkpoint_state()
        self._staged = None
        path = Path(directory) / SHARDS
        dcp.save(shards, storage_writer=dcp.FileSystemWriter(path, overwrite=True))
        if self.rank == 0:
            torch.save(rest, Path(directory) / TRAINER_STATE)
        dist.barrier()

    def load(self, directory: Path) -> None:
        """Load a checkpoint written by :meth:`save` at any world size."""
        load_shards(self, directory)

    def state_dict(self) -> dict[str, Any]:
        raise TypeError("a rank's state is saved as shards: RankTrainer.save(directory)")

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
