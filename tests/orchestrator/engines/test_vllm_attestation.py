"""Weight attestation on ``engine=vllm`` (the CPU build): the workers fingerprint the weights
they hold after every load, read back under the trainer's names from vLLM's fused layout, and
it equals the fingerprint the trainer publishes, bit for bit, at start and after updates; what
the engine generates carries it; a load that left one tensor old, and a version label moved
without a load (a skipped sync), leave it different. One engine serves the module (~30 s). A whole
run with ``engine=vllm engine.attest=true`` as a user starts it is test_vllm_pipeline.py's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from helpers import VLLM_ENGINE, VLLM_TINY_MODEL

from orchestrator.types import Attestation, Group, SamplingParams, Trajectory
from orchestrator.weights.attest import Attestor
from orchestrator.weights.update import WeightUpdate

pytest.importorskip("vllm", reason="vLLM is not installed here; scripts/test.sh runs these in .venv-vllm")

from orchestrator.engines.base import sync_weights
from orchestrator.engines.vllm_engine import VLLMEngine
from orchestrator.models.policy import build_policy

pytestmark = [
    pytest.mark.vllm, pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

MODEL = VLLM_TINY_MODEL
ENGINE = {**VLLM_ENGINE, "attest": True}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def policy() -> Any:
    return build_policy(MODEL)


@pytest.fixture(scope="module")
async def engine(policy: Any) -> AsyncIterator[VLLMEngine]:
    async with VLLMEngine(MODEL, WeightUpdate.of_module(1, policy.model), **ENGINE) as engine:
        yield engine


def trained(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``state`` after a made-up optimiser step, tied tensors kept tied (as a model holds it)."""
    g = torch.Generator().manual_seed(seed)
    model = build_policy(MODEL).model
    model.load_state_dict({k: v + 1e-2 * torch.randn(v.shape, generator=g) for k, v in state.items()})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def published(version: int, state: dict[str, torch.Tensor]) -> WeightUpdate:
    return WeightUpdate.by_reference(version, state, leased=False).attested()


async def test_the_workers_fingerprint_equals_the_published_one_and_tokens_carry_it(
        engine: VLLMEngine, policy: Any) -> None:
    start = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    assert engine.attests
    assert engine.fingerprint == published(1, start).fingerprint
    state = start
    for version in (2, 3):
        state = trained(state, version)
        update = published(version, state)
        await sync_weights(engine, update)
        assert (engine.version, engine.fingerprint) == (version, update.fingerprint)
        out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=4, seed=1))
        assert out.fingerprints == ((version, update.fingerprint),)
    # the weights it computes with are those it fingerprints: its log-probs are the trainer's
    model = build_policy(MODEL).model
    model.load_state_dict(state)
    out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=4, seed=2, temperature=1.0))
    ids = torch.tensor([[5, 6, 7, *out.token_ids]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    expected = logp[torch.arange(2, 2 + len(out.token_ids)), torch.tensor(out.token_ids)]
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)


async def test_a_partial_load_and_a_skipped_one_are_exposed(engine: VLLMEngine) -> None:
    held = engine.version
    state = trained(build_policy(MODEL).model.state_dict(), 7)
    full = published(held + 1, state)
    old = build_policy(MODEL).model.state_dict()
    name = "model.layers.1.self_attn.k_proj.weight"  # inside vLLM's fused qkv_proj
    partial = WeightUpdate.by_reference(held + 1, {**state, name: old[name]}, leased=False)
    await sync_weights(engine, partial)
    assert engine.version == held + 1 and engine.fingerprint != full.fingerprint
    await sync_weights(engine, full)
    assert engine.fingerprint == full.fingerprint

    # a skipped sync: the version label moves, the weights do not
    skipped = published(held + 2, trained(state, 8))
    await engine.pause()
    await engine._llm.update_weight_version(str(skipped.version))
    engine.version = skipped.version
    await engine._fingerprint()
    await engine.resume()
    assert engine.fingerprint == full.fingerprint != skipped.fingerprint
    out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=2, seed=1))
    assert out.fingerprints == ((skipped.version, full.fingerprint),)
    # the trainer's check: those tokens fail attestation and are not trained
    attestor = Attestor()
    attestor.publish(skipped.version, skipped.fingerprint)
    n = 3 + len(out.token_ids)
    sample = Trajectory(prompt_id=0, sample_index=0, token_ids=(5, 6, 7, *out.token_ids),
                        loss_mask=(False,) * 3 + (True,) * len(out.token_ids),
                        logprobs=(0.0,) * n, versions=(skipped.version,) * n, reward=1.0,
                        start_version=skipped.version, finish_reason=out.finish_reason,
                        attestations=(Attestation(3, n, skipped.version, full.fingerprint,
                                                  "vllm"),))
    [checked], failed = attestor.check([Group(prompt_id=0, trajectories=(sample,),
                                              start_version=skipped.version)])
    assert failed == {"vllm"} and not any(checked.trajectories[0].loss_mask)
