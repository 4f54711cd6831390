"""Delta weight updates: only the bits that changed since the version an engine holds
(``engine.delta``; ``docs/delta.md``).

At RL learning rates most of a step's weights do not change at all once rounded to the engines'
dtype (a bf16 weight moves only when the step exceeds half a unit in its last place). An update
to an engine that holds the previous version exactly can then carry, per tensor, the XOR of the
new tensor's raw bits with the previous one's, compressed with zstd: mostly zero bytes, which
compress to almost nothing. XOR of raw bits is exact for any dtype (NaN payloads, infinities,
-0.0 and subnormals included); no arithmetic on the values is ever done.

* **The sender** (:class:`DeltaEncoder`, where the bytes leave the process: the trainer actor
  under ``launcher=ray``) keeps the last published copy in the wire dtype, on the CPU, and
  encodes each new update against it. A tensor whose compressed XOR is not smaller than the
  tensor itself travels whole inside the delta (``full``); an update whose delta is not smaller
  than the full update carries none.
* **The receiver** (the engine) reconstructs from the tensors it holds itself, never from a copy
  kept for the purpose, and only when it holds the base exactly: its version is the delta's
  base version and its fingerprint the base's fingerprint (``orchestrator/weights/fingerprint.py``).
  Otherwise (a missed version, a restart, a reload after an attestation failure) it loads the
  full update the same :class:`~orchestrator.weights.update.WeightUpdate` still offers.
* **The proof** is the attestation: after loading a reconstruction the engine fingerprints what
  it holds; if that is not the published fingerprint of the new version, the reconstruction is
  discarded before any token is produced (the engine is paused), the full update is loaded
  instead and the failure is counted (``weights/delta_fallbacks``).

Limits: a LoRA update is never a delta (its adapters are small; it travels whole). The sender
keeps one copy of the weights in the wire dtype in host memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import zstandard

from orchestrator.weights.fingerprint import fingerprint

LEVEL = 1  # zstd's level: the XOR is mostly zero bytes, which its fastest level already packs
Kind = Literal["xor", "full"]


@dataclass(frozen=True)
class TensorDelta:
    """One tensor of a delta: ``xor`` (the zstd-compressed XOR of its raw bits with the base's)
    or ``full`` (its raw bits, where the XOR would not be smaller)."""

    dtype: str
    shape: tuple[int, ...]
    kind: Kind
    data: bytes


@dataclass(frozen=True, eq=False)
class Delta:
    """The difference from version ``base_version`` (whose fingerprint is ``base_fingerprint``)
    to the weights whose fingerprint is ``fingerprint``."""

    base_version: int
    base_fingerprint: str
    fingerprint: str
    nbytes: int  # what the delta moves
    full_nbytes: int  # what the full update moves
    _tensors: Mapping[str, TensorDelta] | None = None
    _ref: Any = None  # a Ray ObjectRef to the tensors

    @property
    def ratio(self) -> float:
        return self.nbytes / self.full_nbytes if self.full_nbytes else 0.0

    def tensors(self) -> Mapping[str, TensorDelta]:
        if self._tensors is not None:
            return self._tensors
        import ray

        tensors: Mapping[str, TensorDelta] = ray.get(self._ref)
        return tensors

    def to_object_store(self) -> Delta:
        """The same delta put into the Ray object store (each engine pulls it)."""
        import ray

        return replace(self, _tensors=None, _ref=ray.put(dict(self.tensors())))


class DeltaUnusable(ValueError):
    """The tensors an engine holds are not the delta's base (names, dtypes or shapes differ)."""


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes as a flat integer tensor of the widest word that divides them (XOR
    on wide words is faster, and the bytes are the same)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.storage_offset():  # a wider view needs an aligned start
        flat = flat.clone()
    raw = flat.view(torch.uint8)
    for word, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if raw.numel() % size == 0:
            return raw.view(word)
    return raw


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_tensor(new: torch.Tensor, base: torch.Tensor | None,
                  compressor: zstandard.ZstdCompressor) -> TensorDelta:
    """``new`` against ``base`` (both on the CPU): the compressed XOR, or ``new`` whole where
    there is no comparable base or the XOR would not be smaller."""
    dtype, shape = _name(new.dtype), tuple(new.shape)
    raw = _bytes(new)
    if base is not None and base.dtype == new.dtype and tuple(base.shape) == shape:
        xor = torch.bitwise_xor(bits(new), bits(base))
        packed = compressor.compress(_bytes(xor))
        if len(packed) < len(raw):
            return TensorDelta(dtype, shape, "xor", packed)
    return TensorDelta(dtype, shape, "full", raw)


def decode_tensor(entry: TensorDelta, base: torch.Tensor | None,
                  decompressor: zstandard.ZstdDecompressor) -> torch.Tensor:
    """The tensor ``entry`` describes, rebuilt from ``base`` for an ``xor`` entry (a new tensor
    on ``base``'s device; ``base`` is left as it is)."""
    dtype = getattr(torch, entry.dtype)
    if entry.kind == "full":
        raw = torch.frombuffer(bytearray(entry.data), dtype=torch.uint8)
        return raw.view(dtype).reshape(entry.shape)
    if base is None or base.dtype != dtype or tuple(base.shape) != entry.shape:
        raise DeltaUnusable(f"the engine holds no {entry.dtype} tensor of shape {entry.shape} "
                            f"to apply the delta to")
    held = bits(base)
    size = held.numel() * held.element_size()
    xor = torch.frombuffer(bytearray(decompressor.decompress(entry.data, max_output_size=size)),
                           dtype=torch.uint8)
    if xor.numel() != size:
        raise DeltaUnusable(f"a delta of {xor.numel()} bytes for a tensor of {size}")
    rebuilt = torch.bitwise_xor(held, xor.view(held.dtype).to(held.device))
    return rebuilt.view(torch.uint8).view(dtype).reshape(entry.shape)


def apply(delta: Delta, held: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The new weights: ``held`` (what the engine holds, the delta's base) with ``delta`` applied,
    as new tensors. Raises :class:`DeltaUnusable` where ``held`` cannot be the base."""
    return rebuild(delta.tensors(), held)


def rebuild(entries: Mapping[str, TensorDelta],
            held: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`apply` on a delta's tensors alone (as a process that was sent only them has)."""
    if set(entries) != set(held):
        raise DeltaUnusable("the engine's tensors are not the ones the delta names")
    decompressor = zstandard.ZstdDecompressor()
    return {name: decode_tensor(entry, held[name], decompressor) for name, entry in entries.items()}


class DeltaEncoder:
    """The sender's side: keeps the last weights it published (as the engines hold them) and
    encodes the next ones against them."""

    def __init__(self, level: int = LEVEL) -> None:
        self._compressor = zstandard.ZstdCompressor(level=level)
        self._base: dict[str, torch.Tensor] = {}
        self._version: int | None = None
        self._fingerprint: str | None = None

    def encode(self, version: int, tensors: Mapping[str, torch.Tensor],
               published: str | None = None) -> Delta | None:
        """The delta from the last published weights to ``tensors`` (version ``version``, as the
        engines hold them: the wire dtype), or None for the first, or where the delta would not
        be smaller than the full update. ``tensors`` become the base of the next delta.
        ``published``: their fingerprint, if already computed (else it is computed here)."""
        target = published or fingerprint(tensors)
        delta = None
        if self._version is not None and self._fingerprint is not None:
            entries = {name: encode_tensor(t.detach().cpu(), self._base.get(name),
                                           self._compressor) for name, t in tensors.items()}
            full = sum(t.numel() * t.element_size() for t in tensors.values())
            size = sum(len(e.data) for e in entries.values())
            if size < full:
                delta = Delta(self._version, self._fingerprint, target, size, full, entries)
        self._base = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
        self._version, self._fingerprint = version, target
        return delta

    def forget(self) -> None:
        """No base any more (the next update is sent whole)."""
        self._base, self._version, self._fingerprint = {}, None, None


@dataclass(frozen=True)
class Loaded:
    """What one weight load moved: ``nbytes`` pulled (the delta's, or the full update's),
    ``full_nbytes`` (the full update's), whether a delta was applied, and whether a delta failed
    its attestation and the full update replaced it."""

    nbytes: int
    full_nbytes: int
    delta: bool = False
    fallback: bool = False


class LoadCounter:
    """An engine's weight-load counters, for the step metrics: the last sync's bytes (delta and
    full, so the ratio can be formed over engines) and the run's delta fallbacks."""

    def __init__(self) -> None:
        self.last: Loaded | None = None
        self.fallbacks = 0
        self.deltas = 0
        self.offered = False  # any update came with a delta: the metrics mean something

    def add(self, loaded: Loaded, offered: bool) -> None:
        self.last = loaded
        self.offered = self.offered or offered
        self.deltas += loaded.delta
        self.fallbacks += loaded.fallback

    def metrics(self) -> dict[str, float]:
        if not self.offered or self.last is None:
            return {}
        return {"weights/delta_bytes": float(self.last.nbytes),
                "weights/full_bytes": float(self.last.full_nbytes),
                "weights/delta_loads": float(self.deltas),
                "weights/delta_fallbacks": float(self.fallbacks)}
