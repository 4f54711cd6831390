"""``engine.delta`` on vLLM's CPU build: the first update reaches the workers whole and is kept;
the next ones go as deltas that the workers rebuild, check against the published fingerprint and
load (what the engine then generates has the trainer's log-probs for the new weights); a delta
whose rebuild does not match is refused by the worker and nothing of it is loaded."""

from __future__ import annotations

import pickle
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import torch

from orchestrator.types import SamplingParams
from orchestrator.weights.update import WeightUpdate

pytest.importorskip("vllm", reason="vLLM is not installed here; scripts/test.sh runs these in .venv-vllm")

import zstandard
from helpers import VLLM_ENGINE, VLLM_TINY_MODEL

from orchestrator.engines.base import sync_weights
from orchestrator.engines.vllm_engine import VLLMEngine
from orchestrator.models.policy import build_policy
from orchestrator.weights.delta import TensorDelta

pytestmark = [
    pytest.mark.vllm, pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

MODEL = VLLM_TINY_MODEL
ENGINE = {**VLLM_ENGINE, "delta": True}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def policy() -> Any:
    return build_policy(MODEL)


@pytest.fixture(scope="module")
async def engine(policy: Any) -> AsyncIterator[VLLMEngine]:
    async with VLLMEngine(MODEL, WeightUpdate.of_module(0, policy.model), **ENGINE) as engine:
        yield engine


def stepped(model: torch.nn.Module, seed: int) -> None:
    """A small step on ``model``: 3% of its elements moved."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            pick = torch.rand(p.shape, generator=g) < 0.03
            p[pick] += 0.05 * torch.randn(p.shape, generator=g)[pick]


def logprobs_of(model: torch.nn.Module, prompt: list[int], generated: tuple[int, ...]) -> torch.Tensor:
    ids = torch.tensor([prompt + list(generated)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(generated) - 1)
    return torch.log_softmax(logits, dim=-1)[positions, torch.tensor(list(generated))]


async def test_updates_after_the_first_reach_the_workers_as_attested_deltas(
        engine: VLLMEngine, policy: Any) -> None:
    model = policy.model
    prompt = [7, 9, 11, 13]
    for version in (1, 2, 3):
        stepped(model, version)
        update = WeightUpdate.by_reference(version, model.state_dict(), leased=False).attested()
        await sync_weights(engine, update)
        loaded = engine.last_load
        assert loaded is not None and loaded.delta == (version > 1), version
        if version > 1:
            assert loaded.nbytes < loaded.full_nbytes / 4
        with anyio.fail_after(60):
            out = await engine.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0,
                                                               seed=version))
        assert set(out.versions) == {version}
        torch.testing.assert_close(torch.tensor(out.logprobs),
                                   logprobs_of(model, prompt, out.token_ids), atol=1e-3, rtol=0)
    assert engine.metrics()["weights/delta_loads"] == 2
    assert engine.metrics()["weights/delta_fallbacks"] == 0


async def test_a_worker_refuses_a_delta_whose_rebuild_is_not_the_published_weights(
        engine: VLLMEngine, policy: Any) -> None:
    model = policy.model
    base = WeightUpdate.by_reference(10, model.state_dict(), leased=False).attested()
    await sync_weights(engine, base)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stepped(model, 11)
    after = WeightUpdate.by_reference(11, model.state_dict(), leased=False).attested()
    assert engine._encoder is not None
    delta = engine._encoder.encode(11, after.served_tensors(), after.fingerprint)
    assert delta is not None
    entries = dict(delta.tensors())
    name = next(n for n, e in entries.items() if e.kind == "xor")
    xor = bytearray(zstandard.ZstdDecompressor().decompress(entries[name].data))
    xor[0] ^= 0x01
    entries[name] = TensorDelta(entries[name].dtype, entries[name].shape, "xor",
                                zstandard.ZstdCompressor().compress(bytes(xor)))
    answers = await engine._llm.collective_rpc(
        "polyrl_load_delta", args=(pickle.dumps(entries), delta.base_fingerprint,
                                   delta.fingerprint))
    assert answers == ["mismatch"]
    # nothing of it was loaded: the engine still generates with the base's weights
    prompt = [7, 9, 11, 13]
    with anyio.fail_after(60):
        out = await engine.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=3))
    old = build_policy(MODEL).model
    old.load_state_dict(before)
    torch.testing.assert_close(torch.tensor(out.logprobs), logprobs_of(old, prompt, out.token_ids),
                               atol=1e-3, rtol=0)
