"""The weights' fingerprint (orchestrator/weights/fingerprint.py): its per-tensor digest against a
plain Python reference of the same formula, and the changes it must catch (one element, one bit, a
swap of tensors, a permutation, a dtype) or must not see (the same bytes in another layout)."""

from __future__ import annotations

import struct

import pytest
import torch
from torch.overrides import TorchFunctionMode

from orchestrator.weights import fingerprint as fingerprint_module
from orchestrator.weights.fingerprint import fingerprint, tensor_digest, tensor_digests

MASK = (1 << 64) - 1


def reference_mix(x: int) -> int:
    """splitmix64's finaliser on unsigned 64-bit Python ints, forced odd."""
    x = (x * 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return (x ^ (x >> 31)) | 1


def reference_digest(tensor: torch.Tensor, chunk: int) -> int:
    """The digest the slow obvious way: the bytes unpacked by struct, the sum in Python ints."""
    raw = bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())
    if tensor.element_size() == 1:
        words = list(raw)
    elif len(raw) % 4 == 0:
        words = list(struct.unpack(f"<{len(raw) // 4}i", raw))
    else:
        words = list(struct.unpack(f"<{len(raw) // 2}h", raw))
    total = 0
    for i, w in enumerate(words):
        j, k = divmod(i, chunk)
        total += w * reference_mix(k + 1) * (reference_mix(j) if j else 1)
    total &= MASK
    return total - (1 << 64) if total >= 1 << 63 else total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.int8, torch.bool])
@pytest.mark.parametrize("numel", [0, 1, 7, 100])
def test_the_digest_is_the_formula_written_plainly(dtype: torch.dtype, numel: int) -> None:
    g = torch.Generator().manual_seed(numel)
    t = (torch.randn(numel, generator=g) * 100).to(dtype)
    assert int(tensor_digest(t, chunk=16)) == reference_digest(t, chunk=16)


def test_one_changed_element_or_bit_anywhere_changes_it() -> None:
    base = {"w": torch.randn(6, 5, dtype=torch.bfloat16), "b": torch.randn(5)}
    seen = {fingerprint(base)}
    for name, t in base.items():
        words = t.reshape(-1).view(torch.int16)
        for i in range(words.numel()):
            for bit in (0, 15):
                changed = words.clone()
                changed[i] ^= (1 << bit) if bit < 15 else -(1 << 15)
                seen.add(fingerprint({**base, name: changed.view(t.dtype).reshape(t.shape)}))
    assert len(seen) == 1 + 2 * sum(t.numel() * t.element_size() // 2 for t in base.values())


def test_swapped_tensors_permuted_elements_and_a_reinterpreted_dtype_change_it() -> None:
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    ref = fingerprint({"a": a, "b": b})
    assert fingerprint({"a": b, "b": a}) != ref
    assert fingerprint({"a": a.flip(0), "b": b}) != ref
    assert fingerprint({"a": a.view(torch.int32), "b": b}) != ref
    assert fingerprint({"a": a.reshape(2, 8), "b": b}) != ref
    assert fingerprint({"a": a, "b": b, "c": torch.zeros(0)}) != ref


def test_the_same_bytes_in_another_layout_or_order_give_the_same_fingerprint() -> None:
    a = torch.randn(8, 3, dtype=torch.bfloat16)
    b = torch.randn(300)
    ref = fingerprint({"a": a, "b": b})
    assert fingerprint({"b": b.clone(), "a": a.t().contiguous().t()}) == ref
    assert fingerprint({"a": a, "b": b}) == ref


def test_a_tensor_longer_than_a_chunk_is_read_whole() -> None:
    t = torch.randn(100)
    changed = t.clone()
    changed[-1] += 1
    assert int(tensor_digest(t, chunk=16)) != int(tensor_digest(changed, chunk=16))
    assert int(tensor_digest(t, chunk=16)) == reference_digest(t, chunk=16)


@pytest.mark.parametrize("batch", [50, 1 << 22])
def test_digests_taken_together_are_each_tensors_digest(monkeypatch: pytest.MonkeyPatch,
                                                        batch: int) -> None:
    monkeypatch.setattr(fingerprint_module, "BATCH", batch)  # 50: runs of a few tensors
    g = torch.Generator().manual_seed(1)
    tensors = [(torch.randn(n, generator=g) * 100).to(dtype)
               for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64,
                             torch.int8, torch.bool)
               for n in (0, 1, 2, 7, 8, 8, 8, 33, 100, 100)]
    tensors += [torch.randn(40, 30, generator=g).t(), torch.randn(30, 40, generator=g)]
    for chunk in (16, 64, 1 << 20):  # 16: the longer tensors take several chunks
        assert tensor_digests(tensors, chunk) == [int(tensor_digest(t, chunk)) for t in tensors]


def test_a_model_is_fingerprinted_in_a_few_operations_per_shape_not_per_tensor() -> None:
    """Each torch call lets go of the GIL and takes it back: in a thread beside the trainer's
    Python that is what a fingerprint costs (docs/attestation.md), so it must not grow with the
    count of tensors."""
    layers = {f"layer.{i}.{part}": torch.randn(*shape)
              for i in range(32) for part, shape in (("w", (16, 16)), ("norm", (16,)))}

    metadata = {"__get__", "numel", "element_size"}  # read in Python: no operation dispatched

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += getattr(func, "__name__", "") not in metadata
            return func(*args, **(kwargs or {}))

    fingerprint(layers)  # the coefficient table, made once per device
    with Count():
        fingerprint(layers)
    assert Count.calls <= 20, f"{Count.calls} torch calls for 64 tensors of 2 shapes"
