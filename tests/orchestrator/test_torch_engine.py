"""The in-process torch engine (orchestrator/engines/torch_engine.py) on a tiny CPU policy:
batched sampling, stop tokens, lengths, behaviour log-probs against a full forward pass, and
weight updates that land mid-generation."""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
import torch

from orchestrator.engines.torch_engine import TorchEngine
from orchestrator.errors import EngineClosed
from orchestrator.types import FinishReason, Generation, SamplingParams
from orchestrator.weights import WeightUpdate
from helpers import engine_for

pytestmark = pytest.mark.anyio

ATOL = 1e-4


def full_forward_logprobs(model: torch.nn.Module, prompt: Sequence[int], generated: Sequence[int],
                          temperature: float = 1.0) -> torch.Tensor:
    """Teacher-forced log-probs of ``generated`` after ``prompt``: one unpadded forward pass."""
    ids = torch.tensor([list(prompt) + list(generated)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(generated) - 1)
    return logp[positions, torch.tensor(list(generated))]


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3 + (5 * i) % 17 for i in range(n)]  # different lengths: left padding matters
    return [torch.randint(7, vocab, (length,), generator=g).tolist() for length in lengths]


async def generate_all(engine: TorchEngine, requests: Sequence[tuple[list[int], SamplingParams]]
                       ) -> list[Generation]:
    results: list[Generation | None] = [None] * len(requests)

    async def one(i: int) -> None:
        results[i] = await engine.generate(*requests[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


async def test_batched_requests_have_their_lengths_and_teacher_forced_logprobs(tiny: Any) -> None:
    vocab = tiny.tokenizer.vocab_size
    requests = [(p, SamplingParams(max_tokens=4 + i % 9, temperature=1.0))
                for i, p in enumerate(prompts(12, vocab))]
    async with engine_for(tiny, max_batch_size=64, seed=0) as engine:
        with anyio.fail_after(60):
            gens = await generate_all(engine, requests)
    for (prompt, sampling), gen in zip(requests, gens, strict=True):
        assert gen.finish_reason is FinishReason.LENGTH
        assert len(gen.token_ids) == len(gen.logprobs) == len(gen.versions) == sampling.max_tokens
        assert gen.versions == (0,) * sampling.max_tokens and gen.start_version == 0
        assert all(0 <= t < vocab for t in gen.token_ids)
        expected = full_forward_logprobs(tiny.model, prompt, gen.token_ids)
        torch.testing.assert_close(torch.tensor(gen.logprobs), expected, atol=ATOL, rtol=0)


async def test_logprobs_follow_the_sampling_temperature(tiny: Any) -> None:
    prompt = prompts(1, tiny.tokenizer.vocab_size, seed=2)[0]
    async with engine_for(tiny, seed=1) as engine:
        with anyio.fail_after(60):
            gen = await engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.5))
    expected = full_forward_logprobs(tiny.model, prompt, gen.token_ids, temperature=0.5)
    torch.testing.assert_close(torch.tensor(gen.logprobs), expected, atol=ATOL, rtol=0)


async def test_max_batch_size_splits_requests_into_waves(tiny: Any) -> None:
    vocab = tiny.tokenizer.vocab_size
    requests = [(p, SamplingParams(max_tokens=5)) for p in prompts(7, vocab, seed=3)]
    async with engine_for(tiny, max_batch_size=2, seed=0) as engine:
        with anyio.fail_after(60):
            gens = await generate_all(engine, requests)
    for (prompt, _), gen in zip(requests, gens, strict=True):
        assert len(gen.token_ids) == 5
        expected = full_forward_logprobs(tiny.model, prompt, gen.token_ids)
        torch.testing.assert_close(torch.tensor(gen.logprobs), expected, atol=ATOL, rtol=0)


async def test_greedy_is_deterministic_and_takes_the_argmax(tiny: Any) -> None:
    prompt = prompts(1, tiny.tokenizer.vocab_size, seed=4)[0]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    async with engine_for(tiny, seed=0) as a, engine_for(tiny, seed=123) as b:
        with anyio.fail_after(60):
            first = await a.generate(prompt, greedy)
            second = await a.generate(prompt, greedy)
            other_seed = await b.generate(prompt, greedy)
    assert first.token_ids == second.token_ids == other_seed.token_ids
    ids = list(prompt)
    for token in first.token_ids:  # each token is the argmax given what came before
        with torch.no_grad():
            logits = tiny.model(input_ids=torch.tensor([ids])).logits[0, -1]
        assert token == int(logits.argmax())
        ids.append(token)


async def test_sampling_is_reproducible_for_a_seed(tiny: Any) -> None:
    prompt = prompts(1, tiny.tokenizer.vocab_size, seed=5)[0]
    sampling = SamplingParams(max_tokens=16, temperature=1.0)
    async with engine_for(tiny, seed=9) as a, engine_for(tiny, seed=9) as b:
        with anyio.fail_after(60):
            assert (await a.generate(prompt, sampling)).token_ids == (await b.generate(prompt, sampling)).token_ids


async def test_stop_token_ends_generation(tiny: Any) -> None:
    prompt = prompts(1, tiny.tokenizer.vocab_size, seed=6)[0]
    async with engine_for(tiny, seed=0) as engine:
        with anyio.fail_after(60):
            free = await engine.generate(prompt, SamplingParams(max_tokens=20, temperature=0.0))
            # stop at the greedy continuation's 6th token: generation must end exactly there
            stop = free.token_ids[5]
            cut = free.token_ids.index(stop)
            stopped = await engine.generate(
                prompt, SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(stop,))
            )
    assert free.finish_reason is FinishReason.LENGTH
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == free.token_ids[: cut + 1]
    assert stopped.token_ids[-1] == stop
    assert len(stopped.logprobs) == len(stopped.versions) == cut + 1


async def test_stop_and_length_mixed_in_one_batch(tiny: Any) -> None:
    vocab = tiny.tokenizer.vocab_size
    everything = tuple(range(vocab))
    requests = [
        (p, SamplingParams(max_tokens=10, stop_token_ids=everything if i % 2 else ()))
        for i, p in enumerate(prompts(6, vocab, seed=7))
    ]
    async with engine_for(tiny, seed=0) as engine:
        with anyio.fail_after(60):
            gens = await generate_all(engine, requests)
    for i, gen in enumerate(gens):
        if i % 2:  # every token is a stop token: one token, then STOP
            assert gen.finish_reason is FinishReason.STOP and len(gen.token_ids) == 1
        else:
            assert gen.finish_reason is FinishReason.LENGTH and len(gen.token_ids) == 10


async def test_max_tokens_is_capped_by_the_position_limit(make_policy: Any) -> None:
    policy = make_policy(0)
    limit = policy.model.config.max_position_embeddings
    prompt = [10] * (limit - 3)
    async with engine_for(policy, seed=0) as engine:
        with anyio.fail_after(60):
            gen = await engine.generate(prompt, SamplingParams(max_tokens=50))
    assert gen.finish_reason is FinishReason.LENGTH
    assert len(gen.token_ids) == 3


# -- weight updates in flight --------------------------------------------------------------


class HoldingEngine(TorchEngine):
    """At decode step ``at`` (from the forward thread) it signals ``reached`` and holds the
    step there until ``proceed`` is set, so a test can queue a pause at an exact token."""

    def __init__(self, *args: Any, at: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.decodes = 0
        self.at = at
        self.reached = threading.Event()
        self.proceed = threading.Event()

    def _decode(self, *args: Any) -> Any:
        out = super()._decode(*args)
        self.decodes += 1
        if self.decodes == self.at:
            self.reached.set()
            self.proceed.wait(timeout=30)
        return out


async def test_weights_updated_mid_generation_continue_under_the_new_version(make_policy: Any) -> None:
    old, new = make_policy(0), make_policy(1)
    new_weights = {k: v.clone() for k, v in new.model.state_dict().items()}
    prompt = prompts(1, old.tokenizer.vocab_size, seed=8)[0]
    sampling = SamplingParams(max_tokens=40, temperature=1.0)
    at = 10
    result: list[Generation] = []
    paused_at: list[int] = []
    async with engine_for(old, HoldingEngine, seed=0, at=at) as engine:

        async def run() -> None:
            result.append(await engine.generate(prompt, sampling))

        async def swap_weights() -> None:  # what weight sync does, in one task
            await engine.pause()
            paused_at.append(engine.decodes)
            await anyio.sleep(0.05)
            assert engine.decodes == paused_at[0], "a token was produced while paused"
            await engine.update_weights(WeightUpdate.by_reference(1, new_weights, leased=False))
            assert engine.version == 1
            await engine.resume()

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await anyio.to_thread.run_sync(engine.reached.wait)
                tg.start_soon(swap_weights)
                await anyio.wait_all_tasks_blocked()  # the pause is queued behind this step
                engine.proceed.set()
    assert paused_at == [at]
    (gen,) = result
    assert len(gen.token_ids) == 40 and gen.finish_reason is FinishReason.LENGTH
    assert gen.start_version == 0
    # the prefill gave token 0 and decode step i token i: tokens 0..at ran on the old weights
    switch = at + 1
    assert gen.versions == (0,) * switch + (1,) * (40 - switch)
    logprobs = torch.tensor(gen.logprobs)
    before = full_forward_logprobs(old.model, prompt, gen.token_ids[:switch])
    torch.testing.assert_close(logprobs[:switch], before, atol=ATOL, rtol=0)
    # after the switch: what the new weights give for the same prefix (a fresh prefill)
    after = full_forward_logprobs(new.model, prompt, gen.token_ids)[switch:]
    torch.testing.assert_close(logprobs[switch:], after, atol=ATOL, rtol=0)
    # and it really is different from what the old weights would have said
    stale = full_forward_logprobs(old.model, prompt, gen.token_ids)[switch:]
    assert not torch.allclose(logprobs[switch:], stale, atol=1e-2)


async def test_resume_may_come_from_another_task_than_pause(tiny: Any) -> None:
    """pause() and resume() are separate calls of the engine interface (separate requests
    for a remote engine): the task that resumes need not be the one that paused."""
    prompt = prompts(1, tiny.tokenizer.vocab_size, seed=10)[0]
    async with engine_for(tiny) as engine:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.pause)
            await engine.update_weights(WeightUpdate.by_reference(1, tiny.model.state_dict(), leased=False))
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.resume)
            gen = await engine.generate(prompt, SamplingParams(max_tokens=3))
    assert gen.versions == (1, 1, 1)


async def test_update_weights_outside_pause_is_refused(tiny: Any) -> None:
    async with engine_for(tiny) as engine:
        with pytest.raises(RuntimeError):
            await engine.update_weights(WeightUpdate.by_reference(1, tiny.model.state_dict(), leased=False))
        assert engine.version == 0


async def test_pause_blocks_new_tokens_until_resume(tiny: Any) -> None:
    prompt = prompts(1, tiny.tokenizer.vocab_size, seed=9)[0]
    result: list[Generation] = []
    async with engine_for(tiny) as engine:
        await engine.pause()
        await engine.pause()  # idempotent
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:

                async def run() -> None:
                    result.append(await engine.generate(prompt, SamplingParams(max_tokens=3)))

                tg.start_soon(run)
                await anyio.sleep(0.1)
                assert result == []
                await engine.resume()
    assert len(result[0].token_ids) == 3


async def test_a_closed_engine_refuses_requests(tiny: Any) -> None:
    engine = engine_for(tiny)
    with pytest.raises(EngineClosed):
        await engine.generate([1, 2], SamplingParams())
    async with engine:
        with pytest.raises(ValueError):
            await engine.generate([], SamplingParams())
    with pytest.raises(EngineClosed):
        await engine.generate([1, 2], SamplingParams())


async def test_engine_owns_a_copy_of_the_weights(tiny: Any) -> None:
    async with engine_for(tiny) as engine:
        with torch.no_grad():
            for p in tiny.model.parameters():
                p.add_(1.0)
        for (name, mine), theirs in zip(engine.model.state_dict().items(),
                                        tiny.model.state_dict().values(), strict=True):
            assert not torch.equal(mine, theirs), name


async def test_closing_an_engine_that_never_started_releases_its_streams(tiny: Any) -> None:
    """``aclose()`` must free every resource even when ``__aenter__`` never ran (a run that
    fails between building the engine and starting it)."""
    engine = engine_for(tiny)
    await engine.aclose()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del engine
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []

