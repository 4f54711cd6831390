"""``WeightUpdate``: a versioned handle on a set of weights, and how its tensors travel.

A trainer publishes one after every step (``await trainer.weights()``) and the pipeline hands
it to the engines (``await engine.update_weights(update)``). Four transports, one type:

* **by reference** (:meth:`WeightUpdate.by_reference`): the trainer's own tensors, no copy,
  for an engine in the same process. The trainer must not change them while an engine reads
  them, so such an update carries a *lease*: the consumer calls :meth:`release` once it has
  loaded them, and the trainer waits for that before its next optimiser step
  (:meth:`wait_released`). A consumer that cannot load promptly takes :meth:`detached`
  instead, a private copy that releases the lease at once.
* **serialised** (:meth:`serialised`): safetensors bytes, for an engine in another process
  (sent over a pipe, an object store, a socket).
* **a file** (:meth:`to_file`): a safetensors file path, for an engine on the same host that
  maps it itself.
* **the Ray object store** (:meth:`to_object_store`): put once by the trainer's actor, pulled
  by every engine actor with ``ray.get`` (zero-copy on a node: the tensors it reads share the
  store's read-only memory). Ray is imported only when this transport is used.

:attr:`wire_dtype`, when set, is the dtype the floating tensors take on the three transports
that copy them (the engines' own, ``model.dtype``): a ``mixed`` trainer's float32 master
weights of a bf16 model travel as bf16, half the bytes, cast on their device before they leave
it. By reference they stay as they are (an engine's load casts them).

:meth:`tensors` gives the weights back as a name → tensor mapping whichever way they came;
:attr:`nbytes` is what a transfer moves (the weight-sync span records it), :attr:`stats` what
producing it cost (``gather_seconds`` when trainer ranks gathered their shards).

:attr:`delta`, when set (``engine.delta``; :mod:`orchestrator.weights.delta`), is the same weights
as the bitwise difference from the version before: an engine that holds that version exactly loads
the delta instead of pulling the full tensors, which the update still offers for every other engine
and for a delta that fails its attestation.

:attr:`fingerprint` (``engine.attest``; :mod:`orchestrator.weights.fingerprint`) is that of the
weights an engine serves once it has loaded the update. :meth:`attested` computes it at once;
:meth:`attested_in` has an executor's thread compute it while the update travels (reading
:attr:`fingerprint` waits for it; :meth:`known_fingerprint` awaits it), so a trainer that does
so must not change its tensors before it is done (:meth:`wait_fingerprinted`).

A LoRA trainer's update carries :class:`Adapters`: its tensors are ``<weight>::lora_A`` and
``<weight>::lora_B`` pairs (plus, in the first update, the base weights) and an engine applies
them with an :class:`AdapterMerger`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio
import torch

if TYPE_CHECKING:
    from orchestrator.weights.delta import Delta

Transport = Literal["reference", "bytes", "file", "object_store"]


@dataclass(frozen=True)
class Adapters:
    """What the LoRA tensors of an update adapt: ``modules`` are weight names of the plain
    model, each with ``<name>::lora_A`` (r x in) and ``<name>::lora_B`` (out x r) tensors."""

    scale: float  # alpha / r
    modules: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class WeightUpdate:
    version: int
    transport: Transport
    _tensors: Mapping[str, torch.Tensor] | None = None
    _data: bytes | None = None
    _path: Path | None = None
    _ref: Any = None  # a Ray ObjectRef to the _to_arrays payload
    _nbytes: int = 0
    _lease: anyio.Event | None = field(default=None, repr=False)
    adapters: Adapters | None = None  # LoRA: the tensors are adapters (see AdapterMerger)
    stats: Mapping[str, float] = field(default_factory=dict)  # e.g. gather_seconds
    wire_dtype: torch.dtype | None = None  # floating tensors' dtype once copied (module doc)
    # of the weights an engine serves once loaded (served_tensors): :attr:`fingerprint`
    _fingerprint: str | Future[str] | None = field(default=None, repr=False)
    delta: Delta | None = None  # the same weights as a difference from the last ones (module doc)

    # -- making one --------------------------------------------------------------------------

    @classmethod
    def by_reference(cls, version: int, tensors: Mapping[str, torch.Tensor],
                     leased: bool = True) -> WeightUpdate:
        """The caller's tensors themselves; with ``leased`` (call it in the event loop), the
        caller waits for :meth:`release` before changing them again."""
        lease = anyio.Event() if leased else None
        return cls(version, "reference", _tensors=tensors, _lease=lease)

    @classmethod
    def of_module(cls, version: int, module: torch.nn.Module) -> WeightUpdate:
        """A module's current weights, copied (nothing to release): a starting point."""
        return cls.by_reference(version, _copy(module.state_dict()), leased=False)

    @classmethod
    def from_bytes(cls, version: int, data: bytes) -> WeightUpdate:
        return cls(version, "bytes", _data=data)

    @classmethod
    def from_file(cls, version: int, path: Path | str) -> WeightUpdate:
        return cls(version, "file", _path=Path(path))

    @classmethod
    def from_object_ref(cls, version: int, ref: Any, nbytes: int) -> WeightUpdate:
        return cls(version, "object_store", _ref=ref, _nbytes=nbytes)

    def with_adapters(self, adapters: Adapters) -> WeightUpdate:
        return replace(self, adapters=adapters)

    def with_stats(self, **stats: float) -> WeightUpdate:
        return replace(self, stats={**self.stats, **stats})

    def with_wire_dtype(self, dtype: torch.dtype | None) -> WeightUpdate:
        return replace(self, wire_dtype=dtype)

    def with_delta(self, delta: Delta | None) -> WeightUpdate:
        return replace(self, delta=delta)

    def attested(self) -> WeightUpdate:
        """This update with its :attr:`fingerprint`, computed where its tensors are (the
        trainer's device) from :meth:`served_tensors`: what an engine must report once loaded."""
        return replace(self, _fingerprint=self._served_fingerprint())

    def attested_in(self, executor: Executor) -> WeightUpdate:
        """This update with its :attr:`fingerprint` being computed by ``executor`` (a thread
        beside the caller's): the update can travel meanwhile. Its tensors must not change
        until :meth:`wait_fingerprinted`."""
        return replace(self, _fingerprint=executor.submit(self._served_fingerprint))

    def _served_fingerprint(self) -> str:
        from orchestrator.weights.fingerprint import fingerprint

        return fingerprint(self.served_tensors())

    @property
    def fingerprint(self) -> str | None:
        """The fingerprint of the weights an engine serves once it has loaded this update (None
        unless attested); one still being computed (:meth:`attested_in`) is waited for."""
        print_ = self._fingerprint
        return print_.result() if isinstance(print_, Future) else print_

    def wait_fingerprinted(self) -> None:
        """Return once a fingerprint being computed is done: the tensors may change then.
        Blocks (call it off the event loop)."""
        _ = self.fingerprint

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (for another process) with its fingerprint computed."""
        return {**self.__dict__, "_fingerprint": self.fingerprint}

    @property
    def fingerprint_known(self) -> bool:
        """Whether :attr:`fingerprint` can be read without waiting."""
        return not isinstance(self._fingerprint, Future) or self._fingerprint.done()

    async def known_fingerprint(self) -> str | None:
        """:attr:`fingerprint`, awaited without blocking the event loop."""
        print_ = self._fingerprint
        if isinstance(print_, Future) and not print_.done():
            await anyio.to_thread.run_sync(print_.result)
        return self.fingerprint

    def served_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors the fingerprint covers, as an engine holds them: floating ones in the
        wire dtype (the engine's); for a LoRA update, its adapter tensors alone (the base
        weights an update may carry do not change from version to version)."""
        tensors = self.tensors()
        if self.adapters is not None:
            tensors = {k: v for k, v in tensors.items() if "::" in k}
        return {k: _wire(v, self.wire_dtype) for k, v in tensors.items()}

    def _carry(self, other: WeightUpdate) -> WeightUpdate:
        """``other`` (the same weights over another transport) with this one's adapters, stats,
        wire dtype, fingerprint and delta."""
        return replace(other, adapters=self.adapters, stats=self.stats, wire_dtype=self.wire_dtype,
                       _fingerprint=self._fingerprint, delta=self.delta)

    # -- other transports ---------------------------------------------------------------------

    def serialised(self) -> WeightUpdate:
        """The same weights as safetensors bytes (for another process); releases the lease."""
        from safetensors.torch import save

        if self.transport == "bytes":
            return self
        data = save(_savable(self.tensors(), self.wire_dtype))
        self.release()
        return self._carry(WeightUpdate.from_bytes(self.version, data))

    def to_bytes(self) -> bytes:
        """The weights as safetensors bytes; releases the lease."""
        data = self.serialised()._data
        assert data is not None
        return data

    def to_file(self, path: Path | str) -> WeightUpdate:
        """The same weights written to a safetensors file at ``path``; releases the lease."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file(_savable(self.tensors(), self.wire_dtype), str(tmp))
        tmp.replace(path)
        self.release()
        return self._carry(WeightUpdate.from_file(self.version, path))

    def to_object_store(self) -> WeightUpdate:
        """The same weights put once into the Ray object store; releases the lease."""
        import ray

        arrays = _to_arrays(self.tensors(), self.wire_dtype)  # CPU views: put before the release
        ref = ray.put(arrays)
        self.release()
        return self._carry(WeightUpdate.from_object_ref(
            self.version, ref, sum(a.nbytes for _, _, a in arrays.values())))

    def unleased(self) -> WeightUpdate:
        """The same tensors by reference, with this one's adapters, stats and wire dtype but no
        lease: a view for a reader done with them before this update is released."""
        return self._carry(WeightUpdate.by_reference(self.version, self.tensors(), leased=False))

    def detached(self) -> WeightUpdate:
        """A private copy in this process; releases the lease at once."""
        if self._lease is None and self.transport != "reference":
            return self.unleased()
        copy = WeightUpdate.by_reference(self.version, _copy(self.tensors()), leased=False)
        self.release()
        return self._carry(copy)

    def snapshot(self) -> WeightUpdate:
        """A private in-memory copy that outlives whatever the producer does next; the lease
        (the producer's update, still to be consumed) is left alone."""
        return self._carry(WeightUpdate.by_reference(self.version, _copy(self.tensors()),
                                                     leased=False))

    # -- reading --------------------------------------------------------------------------------

    def tensors(self) -> Mapping[str, torch.Tensor]:
        if self._tensors is not None:
            return self._tensors
        if self._ref is not None:
            import ray

            return _from_arrays(ray.get(self._ref))
        if self._data is not None:
            from safetensors.torch import load

            return load(self._data)
        assert self._path is not None
        from safetensors.torch import load_file

        return load_file(str(self._path))

    @property
    def path(self) -> Path | None:
        """The safetensors file a file update names (None for other transports)."""
        return self._path

    @property
    def nbytes(self) -> int:
        """Bytes a transfer of this update moves (the payload's size for bytes and files)."""
        if self._data is not None:
            return len(self._data)
        if self._path is not None:
            return self._path.stat().st_size
        if self._ref is not None:
            return self._nbytes
        assert self._tensors is not None
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    # -- the lease of a by-reference update --------------------------------------------------

    def release(self) -> None:
        """The consumer is done reading; the producer may change the tensors again."""
        if self._lease is not None:
            self._lease.set()

    @property
    def released(self) -> bool:
        return self._lease is None or self._lease.is_set()

    async def wait_released(self) -> None:
        """Return once :meth:`release` was called (in the event loop that made the update)."""
        if self._lease is not None:
            await self._lease.wait()


class AdapterMerger:
    """How an engine loads updates, LoRA ones included: a full update is loaded as it is; an
    adapter update sets each adapted weight to ``W0 + scale * B @ A`` from the base weights
    ``W0`` kept from the update that carried them (the engine's first).

    ``fused`` is for an engine whose layers each hold several of the model's modules and load
    only whole (vLLM's ``packed_modules_mapping``: ``qkv_proj`` holds ``q_proj``, ``k_proj``
    and ``v_proj``): then an adapter update also carries, from the kept base, every other
    tensor of each layer it touches (the siblings an adapter leaves alone, biases), so no
    layer is loaded in part. Without it, only the adapted weights are given."""

    def __init__(self, fused: Mapping[str, Sequence[str]] | None = None) -> None:
        self._base: dict[str, torch.Tensor] = {}
        self.adapters: dict[str, torch.Tensor] = {}  # the LoRA tensors last applied, if any
        self._fused = None if fused is None else {
            part: tuple(parts) for parts in fused.values() for part in parts}

    def _layer_tensors(self, modules: Sequence[str], names: Iterable[str]) -> set[str]:
        """The tensors among ``names`` that are loaded with the adapted weights ``modules``."""
        if self._fused is None:
            return set(modules)
        layers = set()
        for weight in modules:
            parent, _, leaf = weight.rsplit(".", 1)[0].rpartition(".")
            layers.update(f"{parent}.{part}" for part in self._fused.get(leaf, (leaf,)))
        return {n for n in names if n.rsplit(".", 1)[0] in layers} | set(modules)

    def merged(self, update: WeightUpdate) -> dict[str, torch.Tensor]:
        """The weights to load for ``update``: all of a full one; for an adapter update, the
        adapted weights (with ``fused``, their layers' other tensors too), and the base
        weights it carries, if any."""
        tensors = update.tensors()
        adapters = update.adapters
        if adapters is None:
            self.forget()
            return dict(tensors)
        self.adapters = {k: v.detach().clone() for k, v in tensors.items() if "::" in k}
        plain = {k: v for k, v in tensors.items() if "::" not in k}
        for name in self._layer_tensors(adapters.modules, plain):
            if name in plain:
                self._base[name] = plain[name].detach().clone()
        missing = [m for m in adapters.modules if m not in self._base]
        if missing:
            raise RuntimeError(f"an adapter update for {missing[0]} reached an engine that never "
                               f"received its base weights")
        out = {**{n: self._base[n] for n in self._layer_tensors(adapters.modules, self._base)},
               **plain}
        with torch.no_grad():
            for name in adapters.modules:
                base = self._base[name]
                a, b = tensors[f"{name}::lora_A"], tensors[f"{name}::lora_B"]
                delta = (b.to(torch.float32) @ a.to(torch.float32)) * adapters.scale
                out[name] = (base.to(torch.float32) + delta).to(base.dtype)
        return out

    def forget(self) -> None:
        """A full update replaced the weights: the kept base is stale, so an adapter update
        after it must carry its base weights again (it fails, in one line, if not)."""
        self._base.clear()
        self.adapters = {}

    def load(self, model: torch.nn.Module, update: WeightUpdate) -> None:
        """Load ``update`` into ``model`` (all of its weights for a full update)."""
        weights = self.merged(update)
        with torch.no_grad():
            model.load_state_dict(weights, strict=update.adapters is None)

    def served(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """What an engine holding ``model`` serves, as :meth:`WeightUpdate.served_tensors`
        names it: the adapters last applied, else the model's own tensors."""
        return dict(self.adapters) if self.adapters else dict(model.state_dict())


def _wire(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` as it travels: a floating one in ``dtype`` (cast where it is), else as is."""
    tensor = tensor.detach()
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        return tensor.to(dtype)
    return tensor


def _savable(tensors: Mapping[str, torch.Tensor],
             dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """CPU tensors safetensors can write (floating ones in ``dtype``, if given): tied weights
    (one storage under two names, as a tied embedding and LM head are) become separate
    tensors."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        t = _wire(tensor, dtype).contiguous().cpu()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def _copy(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


def as_bytes_array(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], Any]:
    """(dtype name, shape, raw bytes as a uint8 numpy array) of a tensor: numpy arrays leave
    a pickle (protocol 5: Ray's object store) out of band, without a copy, and a byte view
    carries any dtype (bfloat16 has no numpy type)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
            flat.view(torch.uint8).numpy())


def from_bytes_array(dtype: str, shape: Sequence[int], array: Any) -> torch.Tensor:
    """:func:`as_bytes_array` undone, over the array's memory (read-only where it is the
    object store's: these tensors are only read unless copied)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array).view(getattr(torch, dtype)).reshape(tuple(shape))


def _to_arrays(tensors: Mapping[str, torch.Tensor],
               dtype: torch.dtype | None = None) -> dict[str, tuple[str, tuple[int, ...], Any]]:
    """Name -> :func:`as_bytes_array`, floating tensors in ``dtype`` if given."""
    return {k: as_bytes_array(_wire(v, dtype)) for k, v in tensors.items()}


def _from_arrays(arrays: Mapping[str, tuple[str, tuple[int, ...], Any]]) -> dict[str, torch.Tensor]:
    return {k: from_bytes_array(*v) for k, v in arrays.items()}
