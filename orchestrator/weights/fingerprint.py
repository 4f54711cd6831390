"""A fingerprint of a set of weights, computed where they are: the proof an engine gives of which
weights it serves (``docs/attestation.md``, DESIGN.md "Attested weights").

:func:`fingerprint` maps name → tensor to a 128-bit hex string. Each tensor is reduced on its
own device (GPU or CPU, the same code, no copy to the host): its raw bytes are read as signed
32-bit words (16-bit where the byte count is not a multiple of 4, bytes for 1-byte dtypes),
each word sign-extended to 64 bits and multiplied by a 64-bit odd coefficient that depends on
its position, and the products summed modulo 2^64 (integer arithmetic: exact and independent of
the order of the reduction, so a GPU and a CPU, or two GPUs, agree bit for bit). The host then
hashes, with BLAKE2b, each tensor's name, dtype, shape and 64-bit digest, in name order: 8 bytes
per tensor cross to the host, never the weights.

Coefficients: word ``i`` of chunk ``j`` (chunks of :data:`CHUNK` words) of a tensor has
``table[i] * m_j`` where ``table`` is a fixed pseudo-random table of odd 64-bit numbers (made
once per device) and ``m_j`` an odd number mixed from ``j`` (1 for the first chunk). Every
coefficient is odd.

What it catches, and why:

* **one element changed** (any bit of it): the digest moves by ``δ·c`` with ``0 < |δ| < 2^32``
  and ``c`` odd, never 0 modulo 2^64: always caught, not just probably.
* **one tensor left old, an adapter of another version, weights restarted from the initial
  ones**: many words differ by unrelated amounts; the sum ``Σ δ_i·c_i`` is 0 modulo 2^64 by
  chance with probability about 2^-64 per tensor (the coefficients are fixed, not secret: this
  guards against faults, not an adversary who picks weights to collide).
* **two tensors swapped** (same shape): names enter the host hash with their digests, so a
  swap changes it unless the two tensors are equal. **Elements permuted within a tensor**:
  the coefficients differ by position.
* **a dtype or shape changed** with the same bytes: dtype and shape enter the host hash.

Not caught: a difference in how the engine *uses* the weights it holds (a kernel bug); for a
LoRA update, the fingerprint covers the adapters an engine applied (its merge of them into the
base weights is not re-checked).

Cost: a widening copy of each tensor's words into a buffer, a multiply and a sum over it.
Tensors of up to a chunk are taken together by size (:func:`tensor_digests`), so a model costs
a few operations per shape rather than a few per tensor (a transformer has a handful of
shapes); the extra memory is that buffer (8 MiB, reused) and the table (8 MiB per device).
Measured in ``docs/attestation.md``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence

import torch

CHUNK = 1 << 20  # words per chunk: the coefficient table's length
_M1 = 0x9E3779B97F4A7C15 - (1 << 64)  # golden-ratio and splitmix64 constants, as signed int64
_M2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M3 = 0x94D049BB133111EB - (1 << 64)
_MASK = (1 << 64) - 1
BATCH = 1 << 20  # words digested at once: an 8 MiB int64 buffer, reused (it stays in the cache)
ROW_COPY = 1 << 16  # words from which a tensor is copied into the buffer on its own
_tables: dict[tuple[torch.device, int], torch.Tensor] = {}


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic; logical shifts by masking), forced
    odd."""
    def shr(v: torch.Tensor, s: int) -> torch.Tensor:
        return (v >> s) & ((1 << (64 - s)) - 1)

    x = x * _M1
    x = (x ^ shr(x, 30)) * _M2
    x = (x ^ shr(x, 27)) * _M3
    return (x ^ shr(x, 31)) | 1


def _table(device: torch.device, chunk: int) -> torch.Tensor:
    table = _tables.get((device, chunk))
    if table is None:
        table = _tables[device, chunk] = _mix(torch.arange(1, chunk + 1, dtype=torch.int64,
                                                           device=device))
    return table


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat tensor of signed words (32-bit where they divide evenly)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    nbytes = flat.numel() * flat.element_size()
    if flat.element_size() == 1 or nbytes == 0:
        return flat.view(torch.uint8)
    if nbytes % 4 == 0:
        return flat.view(torch.int32)
    return flat.view(torch.int16)


def tensor_digest(tensor: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """A 0-d int64 tensor on the tensor's device: the position-weighted sum of its words."""
    words = _words(tensor)
    table = _table(words.device, chunk)
    n = words.numel()
    if n <= chunk:  # most tensors: one chunk, whose multiplier is 1
        return torch.mul(words, table[:n]).sum()
    total = None
    for j, start in enumerate(range(0, n, chunk)):
        part = words[start:start + chunk]
        digest = torch.mul(part, table[:part.numel()]).sum() * _chunk_multiplier(j)
        total = digest if total is None else total + digest
    assert total is not None
    return total


def _chunk_multiplier(j: int) -> int:
    """``m_j``: 1 for the first chunk, then splitmix64 of ``j`` (odd), as a signed int64."""
    if j == 0:
        return 1
    x = (j * 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    x = (x ^ (x >> 31)) | 1
    return x - (1 << 64) if x >= 1 << 63 else x


def fingerprint(tensors: Mapping[str, torch.Tensor]) -> str:
    """The fingerprint of ``tensors`` (names, dtypes, shapes, bytes): 32 hex digits."""
    names = sorted(tensors)
    digests = tensor_digests([tensors[n] for n in names])
    host = hashlib.blake2b(digest_size=16)
    host.update(len(names).to_bytes(8, "little"))
    for name, digest in zip(names, digests, strict=True):
        t = tensors[name]
        meta = f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{tuple(t.shape)}\0".encode()
        host.update(len(meta).to_bytes(4, "little") + meta)
        host.update(struct.pack("<q", digest))
    return host.hexdigest()


def tensor_digests(tensors: Sequence[torch.Tensor], chunk: int = CHUNK) -> list[int]:
    """Each tensor's :func:`tensor_digest`, as Python ints, in a few operations per shape
    rather than a few per tensor.

    Tensors of 32-bit words that fit in one chunk (most of a model's) are taken together by
    device, dtype and size, at most :data:`BATCH` words at a time: widened to 64 bits into the
    rows of a buffer, multiplied in place by ``table[:n]`` and summed by row. Small tensors are
    flattened together and widened (a few calls per batch); large ones (:data:`ROW_COPY` words
    or more) are widened by one copy each into a buffer reused from batch to batch, so it stays
    in the cache: SmolLM2-135M in float32 takes half the time a fresh copy per batch took
    (``docs/attestation.md``). Longer tensors go through that buffer a chunk at a time; 1-byte,
    16-bit and empty ones take :func:`tensor_digest`. The count of operations matters where
    the fingerprint runs beside the engine's or the trainer's Python: each operation lets go of
    the GIL and takes it back."""
    parts: list[tuple[list[int], torch.Tensor]] = []  # (indices, their digests as a 1-d tensor)
    alike: dict[tuple[torch.device, torch.dtype, int], list[int]] = {}
    long: list[int] = []
    buffers: dict[torch.device, torch.Tensor] = {}

    def buffer(device: torch.device, size: int) -> torch.Tensor:
        """``size`` 64-bit words of this call's buffer on ``device``."""
        held = buffers.get(device)
        if held is None or held.numel() < size:
            held = buffers[device] = torch.empty(max(size, BATCH), dtype=torch.int64,
                                                 device=device)
        return held[:size]

    with torch.no_grad():
        for i, t in enumerate(tensors):
            nbytes = t.numel() * t.element_size()
            if t.element_size() == 1 or nbytes % 4 != 0 or nbytes == 0:
                parts.append(([i], tensor_digest(t, chunk).reshape(1)))
            elif nbytes // 4 <= chunk:
                alike.setdefault((t.device, t.dtype, nbytes // 4), []).append(i)
            else:
                long.append(i)
        for (device, _, n), indices in alike.items():
            table = _table(device, chunk)[:n]
            rows = max(1, BATCH // n)
            for start in range(0, len(indices), rows):
                run = indices[start:start + rows]
                if n >= ROW_COPY:
                    words = buffer(device, len(run) * n).view(len(run), n)
                    for row, i in zip(words, run, strict=True):
                        row.copy_(_words(tensors[i]))
                else:  # a few calls for the batch, however many tensors
                    flat = torch._utils._flatten_dense_tensors([tensors[i] for i in run])
                    words = flat.view(torch.int32).to(torch.int64).view(len(run), n)
                parts.append((run, words.mul_(table).sum(1)))
        for i in long:
            words = _words(tensors[i])
            table = _table(words.device, chunk)
            total = None
            for j, start in enumerate(range(0, words.numel(), chunk)):
                part = words[start:start + chunk]
                widened = buffer(part.device, part.numel())
                widened.copy_(part)
                digest = widened.mul_(table[:part.numel()]).sum() * _chunk_multiplier(j)
                total = digest if total is None else total + digest
            assert total is not None
            parts.append(([i], total.reshape(1)))
    return _to_host(parts, len(tensors))


def _to_host(parts: list[tuple[list[int], torch.Tensor]], count: int) -> list[int]:
    """The digests as Python ints, in the tensors' order: one transfer per device (8 bytes a
    tensor)."""
    out: list[int] = [0] * count
    by_device: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}
    for part in parts:
        by_device.setdefault(part[1].device, []).append(part)
    for device_parts in by_device.values():
        values = torch.cat([d for _, d in device_parts]).cpu().tolist()
        indices = [i for batch, _ in device_parts for i in batch]
        for i, v in zip(indices, values, strict=True):
            out[i] = v
    return out
