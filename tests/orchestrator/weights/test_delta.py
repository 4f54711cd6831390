"""Delta weight updates (orchestrator/weights/delta.py): a delta rebuilds the new weights bit for
bit in any dtype, special values included; an engine that holds the base loads it, one that missed a
version loads the full update; a corrupted delta fails its attestation, is never served, and the
full update replaces it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import zstandard
from helpers import TINY_MODEL

from orchestrator.engines.base import sync_weights
from orchestrator.engines.torch_engine import TorchEngine
from orchestrator.models.policy import build_policy
from orchestrator.types import SamplingParams
from orchestrator.weights.delta import DeltaEncoder, TensorDelta, apply
from orchestrator.weights.update import WeightUpdate

SPECIAL = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-45, -3.5]


def raw(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes, read the plain way (numpy has no bfloat16: through a byte view)."""
    return bytes(tensor.detach().contiguous().reshape(-1).view(torch.uint8).tolist())


def moved(tensor: torch.Tensor, seed: int, share: float) -> torch.Tensor:
    """``tensor`` with a ``share`` of its elements nudged (in its own dtype)."""
    g = torch.Generator().manual_seed(seed)
    out = tensor.clone()
    pick = torch.rand(tensor.shape, generator=g) < share
    nudged = (tensor.float() * (1 + 0.05 * torch.randn(tensor.shape, generator=g))).to(tensor.dtype)
    out[pick] = nudged[pick]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_delta_rebuilds_the_new_weights_bit_for_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    old = {"w": torch.randn(64, 33, generator=g).to(dtype),
           "special": torch.tensor(SPECIAL).to(dtype),
           "odd": torch.randn(3, generator=g).to(dtype)}  # 6 or 12 bytes: narrow words
    new = {"w": moved(old["w"], 1, 0.03),
           # NaN to -0.0 and back, inf flipped: no value arithmetic survives this
           "special": torch.tensor([-0.0, float("-inf"), float("inf"), float("nan"), 0.0,
                                    -1e-45, -3.5]).to(dtype),
           "odd": old["odd"].clone()}
    encoder = DeltaEncoder()
    assert encoder.encode(0, old) is None  # nothing to differ from: the first is sent whole
    delta = encoder.encode(1, new)
    assert delta is not None and delta.base_version == 0
    assert delta.nbytes < delta.full_nbytes
    assert delta.tensors()["w"].kind == "xor"
    rebuilt = apply(delta, old)
    for name, tensor in new.items():
        assert rebuilt[name].dtype == dtype and rebuilt[name].shape == tensor.shape
        assert raw(rebuilt[name]) == raw(tensor), name
    assert raw(old["special"]) == raw(torch.tensor(SPECIAL).to(dtype))  # the base is untouched


def noise(g: torch.Generator) -> torch.Tensor:
    """4096 float32 of random bits: an XOR of two of them does not compress."""
    return torch.randint(-2**31, 2**31 - 1, (4096,), dtype=torch.int32, generator=g).view(
        torch.float32)


def test_a_tensor_whose_xor_would_be_larger_travels_whole() -> None:
    g = torch.Generator().manual_seed(0)
    old = {"a": noise(g), "b": noise(g)}
    new = {"a": noise(g), "b": old["b"].clone()}  # a: all new bits
    encoder = DeltaEncoder()
    encoder.encode(0, old)
    delta = encoder.encode(1, new)
    assert delta is not None
    assert delta.tensors()["a"].kind == "full" and delta.tensors()["b"].kind == "xor"
    assert raw(apply(delta, old)["a"]) == raw(new["a"])
    everything = DeltaEncoder()
    everything.encode(0, old)
    assert everything.encode(1, {k: noise(g) for k in old}) is None


def trained(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``state`` after a made-up small step: a few percent of the elements moved (tied tensors
    stay tied, as a model holds them)."""
    model = build_policy(TINY_MODEL).model
    model.load_state_dict({k: moved(v, seed, 0.03) for k, v in state.items()})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def published(version: int, state: dict[str, torch.Tensor],
              encoder: DeltaEncoder) -> WeightUpdate:
    """The update of ``state`` as a sender between processes publishes it: serialised, attested,
    with its delta from the one before."""
    update = WeightUpdate.by_reference(version, state, leased=False).attested().serialised()
    return update.with_delta(encoder.encode(version, update.tensors(), update.fingerprint))


@pytest.fixture
def start() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in build_policy(TINY_MODEL).model.state_dict().items()}


@pytest.mark.anyio
async def test_an_engine_holding_the_base_loads_the_delta(start) -> None:
    encoder = DeltaEncoder()
    engine = TorchEngine(TINY_MODEL, published(0, start, encoder))
    async with engine:
        state = start
        for version in (1, 2):
            state = trained(state, version)
            update = published(version, state, encoder)
            assert update.delta is not None
            await sync_weights(engine, update)
            assert (engine.version, engine.fingerprint) == (version, update.fingerprint)
            assert engine.last_load is not None and engine.last_load.delta
            assert engine.last_load.nbytes == update.delta.nbytes < update.nbytes
            held = engine.model.state_dict()
            assert all(raw(held[k]) == raw(state[k]) for k in state)
        metrics = engine.metrics()
        assert metrics["weights/delta_loads"] == 2 and metrics["weights/delta_fallbacks"] == 0
        assert metrics["weights/delta_bytes"] < metrics["weights/full_bytes"]


@pytest.mark.anyio
async def test_an_engine_that_missed_a_version_gets_the_full_update(start) -> None:
    encoder = DeltaEncoder()
    engine = TorchEngine(TINY_MODEL, published(0, start, encoder))
    async with engine:
        one = trained(start, 1)
        published(1, one, encoder)  # never reaches the engine
        two = trained(one, 2)
        update = published(2, two, encoder)
        assert update.delta is not None and update.delta.base_version == 1
        await sync_weights(engine, update)
        assert (engine.version, engine.fingerprint) == (2, update.fingerprint)
        assert engine.last_load is not None and not engine.last_load.delta
        assert engine.last_load.nbytes == update.nbytes
        assert engine.metrics()["weights/delta_fallbacks"] == 0  # not a failure: no base


def corrupted(update: WeightUpdate) -> WeightUpdate:
    """``update`` with one bit of one element of an XOR tensor of its delta flipped: the first,
    by name, of a layer's (not the tied embedding's: a load of ``lm_head.weight``'s correct
    reconstruction into the same storage would undo it; the delta's order follows the
    serialised update's, which varies with the hash seed)."""
    assert update.delta is not None
    entries = dict(update.delta.tensors())
    name = min(n for n, e in entries.items() if e.kind == "xor" and ".layers." in n)
    entry = entries[name]
    xor = bytearray(zstandard.ZstdDecompressor().decompress(entry.data))
    xor[len(xor) // 2] ^= 0x10
    entries[name] = TensorDelta(entry.dtype, entry.shape, "xor",
                                zstandard.ZstdCompressor().compress(bytes(xor)))
    return update.with_delta(replace(update.delta, _tensors=entries))


@pytest.mark.anyio
async def test_a_corrupted_delta_is_caught_by_attestation_and_never_served(start) -> None:
    encoder = DeltaEncoder()
    engine = TorchEngine(TINY_MODEL, published(0, start, encoder))
    async with engine:
        state = trained(start, 1)
        update = corrupted(published(1, state, encoder))
        await sync_weights(engine, update)
        # what it serves is the full update: its fingerprint is the published one, bit for bit
        assert (engine.version, engine.fingerprint) == (1, update.fingerprint)
        held = engine.model.state_dict()
        assert all(raw(held[k]) == raw(state[k]) for k in state)
        assert engine.last_load is not None and engine.last_load.fallback
        assert engine.metrics()["weights/delta_fallbacks"] == 1
        out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=3, seed=1))
        assert out.fingerprints == ((1, update.fingerprint),)
