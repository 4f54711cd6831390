"""The in-process torch engine (orchestrator/engines/torch_engine.py) on a tiny CPU policy:
batched sampling, stop tokens, lengths, behaviour log-probs against a full forward pass,
continuous batching (requests joining and leaving a running batch) against static waves, and
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
from helpers import engine_for, threads_held

from orchestrator.engines.prefix_cache import PrefixCache
from orchestrator.engines.sampling import sample
from orchestrator.engines.slot_cache import SlotCache
from orchestrator.engines.torch_engine import BATCHING, TorchEngine
from orchestrator.engines.torch_requests import Request
from orchestrator.errors import ConfigError, EngineClosed
from orchestrator.types import FinishReason, Generation, SamplingParams
from orchestrator.weights.update import WeightUpdate

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


def assert_teacher_forced(model: torch.nn.Module, prompt: Sequence[int], gen: Generation,
                          temperature: float = 1.0) -> None:
    expected = full_forward_logprobs(model, prompt, gen.token_ids, temperature)
    torch.testing.assert_close(torch.tensor(gen.logprobs), expected, atol=ATOL, rtol=0)


class SteppedEngine(TorchEngine):
    """Records the rows of every step (its forward pass); with ``stepped`` each step
    waits (in the forward thread, holding the step) until the test lets it run with
    :meth:`steps`, so a test can place arrivals and pauses at exact tokens."""

    def __init__(self, *args: Any, stepped: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.forwards = 0
        self.resident: list[int] = []  # rows of each step, the joining ones included
        self.allowed = 0 if stepped else 1 << 30
        self.held = False
        self.cond = threading.Condition()

    def _forward(self, batch: Any) -> Any:
        with self.cond:
            self.held = True
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: self.forwards < self.allowed, timeout=30)
            self.held = False
        self.resident.append(len(batch.rows) + len(batch.joining))
        out = super()._forward(batch)
        with self.cond:
            self.forwards += 1
            self.cond.notify_all()
        return out

    async def steps(self, n: int) -> None:
        """Let ``n`` more steps run; return once they have and the next one is held
        (its step has admitted what it admits)."""
        with self.cond:
            self.allowed += n
            target = self.allowed
            self.cond.notify_all()

        def wait() -> None:
            with self.cond:
                assert self.cond.wait_for(lambda: self.forwards >= target and self.held, timeout=30)

        await anyio.to_thread.run_sync(wait)

    def run_freely(self) -> None:
        with self.cond:
            self.allowed = 1 << 30
            self.cond.notify_all()


async def pause_after_held_step(engine: SteppedEngine) -> None:
    """Queue a pause behind the held step, let it run, and return once paused."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.pause)
        await anyio.wait_all_tasks_blocked()
        engine.run_freely()


@pytest.mark.parametrize("batching", BATCHING)
async def test_batched_requests_have_their_lengths_and_teacher_forced_logprobs(
        tiny: Any, batching: str) -> None:
    vocab = tiny.tokenizer.vocab_size
    requests = [(p, SamplingParams(max_tokens=4 + i % 9, temperature=1.0))
                for i, p in enumerate(prompts(12, vocab))]
    async with engine_for(tiny, max_batch_size=64, seed=0, batching=batching) as engine:
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


@pytest.mark.parametrize("batching", BATCHING)
async def test_max_batch_size_caps_the_resident_sequences(tiny: Any, batching: str) -> None:
    vocab = tiny.tokenizer.vocab_size
    requests = [(p, SamplingParams(max_tokens=5)) for p in prompts(7, vocab, seed=3)]
    async with engine_for(tiny, SteppedEngine, max_batch_size=2, seed=0, batching=batching) as engine:
        with anyio.fail_after(60):
            gens = await generate_all(engine, requests)
    assert max(engine.resident) == 2
    for (prompt, _), gen in zip(requests, gens, strict=True):
        assert len(gen.token_ids) == 5
        assert_teacher_forced(tiny.model, prompt, gen)


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


def test_draws_follow_the_distribution_and_never_take_an_impossible_token() -> None:
    """Each row's draws match its probabilities (20,000 each: every frequency within 0.015),
    and a token of probability 0 (or one that underflows) is never drawn, at either end."""
    logits = torch.tensor([[0.0, 1.0, 2.0, -float("inf")],
                           [-float("inf"), 0.5, 0.5, -200.0],
                           [3.0, -float("inf"), -float("inf"), 3.0]])
    logp = torch.log_softmax(logits, -1)
    generator, ones = torch.Generator().manual_seed(0), torch.ones(len(logits))
    drawn = [sample(logits, ones, generator) for _ in range(20_000)]
    draws = torch.stack([tokens for tokens, _ in drawn])  # [draws, rows]
    for row in range(len(logp)):
        counts = torch.bincount(draws[:, row], minlength=4).double() / len(draws)
        torch.testing.assert_close(counts, logp[row].exp().double(), atol=0.015, rtol=0)
        assert not bool((counts[logp[row].exp() == 0] > 0).any())
    # each draw's log-probability is its token's
    tokens, chosen = drawn[0]
    torch.testing.assert_close(chosen, logp.gather(-1, tokens[:, None]).squeeze(-1))
    # at a temperature, of the tempered distribution; at 0, the most likely token
    tokens, chosen = sample(logits, torch.tensor([0.5, 0.0, 2.0]), generator)
    tempered = torch.log_softmax(logits / torch.tensor([[0.5], [1.0], [2.0]]), -1)
    assert tokens[1] in (1, 2)
    torch.testing.assert_close(chosen, tempered.gather(-1, tokens[:, None]).squeeze(-1))


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


@pytest.mark.parametrize("batching", BATCHING)
async def test_stop_and_length_mixed_in_one_batch(tiny: Any, batching: str) -> None:
    vocab = tiny.tokenizer.vocab_size
    everything = tuple(range(vocab))
    requests = [
        (p, SamplingParams(max_tokens=10, stop_token_ids=everything if i % 2 else ()))
        for i, p in enumerate(prompts(6, vocab, seed=7))
    ]
    async with engine_for(tiny, seed=0, batching=batching) as engine:
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


# -- continuous batching ------------------------------------------------------------------


async def test_batching_mode_is_checked(tiny: Any) -> None:
    with pytest.raises(ConfigError, match="engine.batching"):
        engine_for(tiny, batching="static")


@pytest.mark.parametrize("batching", BATCHING)
async def test_a_request_arriving_mid_generation_joins_the_running_batch(
        tiny: Any, batching: str) -> None:
    """A short request sent while a long one decodes: continuous batching admits it at the
    next token and it finishes first; a wave makes it wait for the long one to end."""
    long_prompt, short_prompt = prompts(2, tiny.tokenizer.vocab_size, seed=11)
    finished: list[str] = []
    gens: dict[str, Generation] = {}
    async with engine_for(tiny, SteppedEngine, stepped=True, batching=batching) as engine:

        async def run(name: str, prompt: list[int], max_tokens: int) -> None:
            gens[name] = await engine.generate(prompt, SamplingParams(max_tokens=max_tokens))
            finished.append(name)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "long", long_prompt, 30)
                await engine.steps(5)  # the long one is 5 tokens in
                tg.start_soon(run, "short", short_prompt, 4)
                await anyio.wait_all_tasks_blocked()
                engine.run_freely()
    assert [len(gens[n].token_ids) for n in ("long", "short")] == [30, 4]
    if batching == "continuous":
        assert finished == ["short", "long"]
        assert max(engine.resident) == 2
        assert engine.forwards == 30  # the short one's prefill and tokens came with the long one's steps
    else:
        assert finished == ["long", "short"]
        assert max(engine.resident) == 1
        assert engine.forwards == 30 + 4
    assert_teacher_forced(tiny.model, long_prompt, gens["long"])
    assert_teacher_forced(tiny.model, short_prompt, gens["short"])


@pytest.mark.parametrize("batching", BATCHING)
async def test_a_finished_result_is_handed_out_while_others_keep_decoding(
        tiny: Any, batching: str) -> None:
    """Two requests decoding together: the short one's result comes back as soon as it stops
    (continuous) or when the whole wave has (waves)."""
    short_prompt, long_prompt = prompts(2, tiny.tokenizer.vocab_size, seed=12)
    decodes_at_result: dict[str, int] = {}
    async with engine_for(tiny, SteppedEngine, batching=batching) as engine:

        async def run(name: str, prompt: list[int], max_tokens: int) -> None:
            await engine.generate(prompt, SamplingParams(max_tokens=max_tokens))
            decodes_at_result[name] = engine.forwards

        with anyio.fail_after(60):
            await engine.pause()  # both arrive before the first step
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "short", short_prompt, 3)
                tg.start_soon(run, "long", long_prompt, 30)
                await anyio.wait_all_tasks_blocked()
                await engine.resume()
    assert engine.resident[0] == 2
    # step i gives token i - 1: the short one stops at step 3, the long one at step 30
    assert decodes_at_result["long"] == 30
    if batching == "continuous":
        assert decodes_at_result["short"] == 3
    else:
        assert decodes_at_result["short"] == 30


async def test_requests_joining_mid_batch_keep_teacher_forced_logprobs(tiny: Any) -> None:
    """Requests of different prompt lengths and temperatures join a batch at different
    tokens; every token's log-prob is still what one unpadded forward pass gives."""
    vocab = tiny.tokenizer.vocab_size
    ps = prompts(6, vocab, seed=13)  # prompt lengths 3, 8, 13, 18, 6, 11
    temperatures = [1.0, 0.7, 0.0, 1.3, 1.0, 0.5]
    lengths = [14, 16, 8, 10, 6, 12]
    requests = [(p, SamplingParams(max_tokens=n, temperature=t))
                for p, n, t in zip(ps, lengths, temperatures, strict=True)]
    gens: dict[int, Generation] = {}
    async with engine_for(tiny, SteppedEngine, stepped=True, seed=3) as engine:

        async def run(i: int) -> None:
            gens[i] = await engine.generate(*requests[i])

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, 0)
                tg.start_soon(run, 1)
                await engine.steps(2)
                for i in (2, 3):
                    tg.start_soon(run, i)
                await anyio.wait_all_tasks_blocked()
                await engine.steps(3)
                for i in (4, 5):
                    tg.start_soon(run, i)
                await anyio.wait_all_tasks_blocked()
                engine.run_freely()
    assert max(engine.resident) == 6  # all six decoded together at some step
    for i, (prompt, sampling) in enumerate(requests):
        assert len(gens[i].token_ids) == sampling.max_tokens
        temperature = sampling.temperature if sampling.temperature > 0 else 1.0  # greedy: T=1
        assert_teacher_forced(tiny.model, prompt, gens[i], temperature)


async def test_the_cache_slides_its_window_in_place_and_keeps_its_buffers(
        tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long stream through two slots: a prefill wider than the room before the window, or
    a decode at the buffers' last column, slides the window in place; drained batches hand
    their buffers to the next. Buffers are allocated only as the rows first grow, and every
    token is still what one unpadded forward pass gives."""
    slides, allocations = [], []
    reserve, moved = SlotCache.reserve, SlotCache._moved

    def watched_reserve(self: SlotCache, *args: Any) -> None:
        end, first = self.end, self.buffers[0][0] if self.buffers else None
        reserve(self, *args)
        if self.end != end and self.buffers and self.buffers[0][0] is first:
            slides.append(end)

    monkeypatch.setattr(SlotCache, "reserve", watched_reserve)
    monkeypatch.setattr(SlotCache, "_moved", lambda self, *a: allocations.append(1) or moved(self, *a))
    vocab = tiny.tokenizer.vocab_size
    requests = [(p, SamplingParams(max_tokens=n, temperature=1.0))
                for p, n in zip(prompts(40, vocab, seed=21), [12, 3, 7, 2] * 10, strict=True)]
    async with engine_for(tiny, max_batch_size=2, seed=5) as engine:
        with anyio.fail_after(120):
            gens = await generate_all(engine, requests)
    layers = len(tiny.model.model.layers)
    assert len(slides) >= 10
    assert len(allocations) <= 2 * 2 * layers  # keys and values, growing to 1 then 2 rows
    for (prompt, _), gen in zip(requests, gens, strict=True):
        assert_teacher_forced(tiny.model, prompt, gen, 1.0)


async def test_identical_prompts_are_prefilled_once_and_sampled_apart(tiny: Any) -> None:
    """A group's samples share their prompt: one prefill row serves them all, and each
    still samples its own continuation with teacher-forced log-probs."""
    vocab = tiny.tokenizer.vocab_size
    shared, other = prompts(2, vocab, seed=23)
    requests = [(shared, SamplingParams(max_tokens=12, temperature=1.5))] * 4
    requests += [(other, SamplingParams(max_tokens=12, temperature=1.5))]
    widths: list[int] = []
    async with engine_for(tiny, seed=9) as engine:
        hook = engine.model.register_forward_pre_hook(
            lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
        with anyio.fail_after(60):
            await engine.pause()  # all five join the first prefill
            done: list[list[Generation]] = []

            async def run() -> None:
                done.append(await generate_all(engine, requests))

            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await anyio.wait_all_tasks_blocked()
                await engine.resume()
        hook.remove()
    gens = done[0]
    assert widths[0] == len(shared) + len(other)  # the first pass: two distinct prompts, five rows
    assert len({g.token_ids for g in gens[:4]}) > 1
    for (prompt, sampling), gen in zip(requests, gens, strict=True):
        assert_teacher_forced(tiny.model, prompt, gen, sampling.temperature)


async def test_continuous_batching_refills_slots_as_sequences_leave(tiny: Any) -> None:
    """With room for two, a queued request takes the slot of one that stopped while the
    other still decodes; waves wait for both: fewer steps for the same tokens."""
    vocab = tiny.tokenizer.vocab_size
    requests = [(p, SamplingParams(max_tokens=n))
                for p, n in zip(prompts(5, vocab, seed=15), (12, 3, 3, 8, 5), strict=True)]
    decodes = {}
    for batching in BATCHING:
        async with engine_for(tiny, SteppedEngine, max_batch_size=2, batching=batching) as engine:
            with anyio.fail_after(60):
                await engine.pause()  # all five queue before the first step
                async with anyio.create_task_group() as tg:
                    tg.start_soon(generate_all, engine, requests)
                    await anyio.wait_all_tasks_blocked()
                    await engine.resume()
        assert max(engine.resident) == 2
        decodes[batching] = engine.forwards
    assert decodes["continuous"] < decodes["waves"]


async def test_requests_sent_while_paused_join_the_running_batch_on_resume(tiny: Any) -> None:
    vocab = tiny.tokenizer.vocab_size
    long_prompt, *short_prompts = prompts(3, vocab, seed=16)
    finished: list[int] = []
    gens: dict[int, Generation] = {}
    async with engine_for(tiny, SteppedEngine, stepped=True) as engine:

        async def run(i: int, prompt: list[int], max_tokens: int) -> None:
            gens[i] = await engine.generate(prompt, SamplingParams(max_tokens=max_tokens))
            finished.append(i)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, 0, long_prompt, 30)
                await engine.steps(3)  # step 4 is held
                await pause_after_held_step(engine)
                with threads_held() as threads:
                    for i, prompt in enumerate(short_prompts, 1):
                        tg.start_soon(run, i, prompt, 5)
                    await anyio.wait_all_tasks_blocked()
                    assert threads.statistics().tasks_waiting == 0, "a step started while paused"
                    assert engine.forwards == 4 and not finished
                await engine.resume()
    assert finished[-1] == 0  # both joined the long one's batch and finished first
    assert max(engine.resident) == 3
    assert_teacher_forced(tiny.model, long_prompt, gens[0])
    for i, prompt in enumerate(short_prompts, 1):
        assert_teacher_forced(tiny.model, prompt, gens[i])


@pytest.mark.parametrize("limit_after", [4, 0])
async def test_while_a_long_sequence_runs_new_prompts_join_within_the_prefill_limit(
        tiny: Any, limit_after: int) -> None:
    """Once a resident sequence is ``prefill_limit_after`` tokens in, a step admits new
    prompts up to ``prefill_limit_tokens`` (at least one; a group's copies free), while an
    episode's next turn, resumed from its cached prefix, joins at once; 0 lifts the limit."""
    vocab = tiny.tokenizer.vocab_size
    short, p8, p13, long_prompt = prompts(4, vocab, seed=31)  # 3, 8, 13 and 18 tokens
    gens: dict[str, Generation] = {}
    async with engine_for(tiny, SteppedEngine, stepped=True, prefill_limit_after=limit_after,
                          prefill_limit_tokens=8) as engine:

        async def run(name: str, prompt: list[int], max_tokens: int) -> None:
            gens[name] = await engine.generate(prompt, SamplingParams(max_tokens=max_tokens))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "long", long_prompt, 30)
                tg.start_soon(run, "short", short, 2)
                await anyio.wait_all_tasks_blocked()
                await engine.steps(6)  # long: 6 tokens in; short stopped at step 2; step 7
                # has admitted (nothing new) and is held: what comes now joins from step 8
                resumed = short + list(gens["short"].token_ids) + [9, 10, 11]
                tg.start_soon(run, "resumed", resumed, 5)
                tg.start_soon(run, "p8", p8, 5)
                tg.start_soon(run, "p13", p13, 5)
                tg.start_soon(run, "p13 again", p13, 5)
                await anyio.wait_all_tasks_blocked()
                engine.run_freely()
    assert engine.prefixes.hits == 1
    if limit_after:  # step 8: long, resumed and p8 (8 tokens: the limit); step 9: p13 twice
        assert engine.resident[7:9] == [3, 5]
    else:
        assert engine.resident[7] == 5
    for name, prompt in (("long", long_prompt), ("resumed", resumed), ("p8", p8),
                         ("p13", p13), ("p13 again", p13)):
        assert_teacher_forced(tiny.model, prompt, gens[name])


# -- weight updates in flight --------------------------------------------------------------


class HoldingEngine(TorchEngine):
    """At step ``at`` (from the forward thread) it signals ``reached`` and holds the
    step there until ``proceed`` is set, so a test can queue a pause at an exact token."""

    def __init__(self, *args: Any, at: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.forwards = 0
        self.at = at
        self.reached = threading.Event()
        self.proceed = threading.Event()

    def _forward(self, *args: Any) -> Any:
        out = super()._forward(*args)
        self.forwards += 1
        if self.forwards == self.at:
            self.reached.set()
            self.proceed.wait(timeout=30)
        return out


@pytest.mark.parametrize("batching", BATCHING)
async def test_weights_updated_mid_generation_continue_under_the_new_version(
        make_policy: Any, batching: str) -> None:
    old, new = make_policy(0), make_policy(1)
    new_weights = {k: v.clone() for k, v in new.model.state_dict().items()}
    prompt = prompts(1, old.tokenizer.vocab_size, seed=8)[0]
    sampling = SamplingParams(max_tokens=40, temperature=1.0)
    at = 10
    result: list[Generation] = []
    paused_at: list[int] = []
    async with engine_for(old, HoldingEngine, seed=0, at=at, batching=batching) as engine:

        async def run() -> None:
            result.append(await engine.generate(prompt, sampling))

        async def swap_weights() -> None:  # what weight sync does, in one task
            await engine.pause()
            paused_at.append(engine.forwards)
            with threads_held() as threads:
                await anyio.wait_all_tasks_blocked()
                assert threads.statistics().tasks_waiting == 0, "a step started while paused"
            assert engine.forwards == paused_at[0]
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
    # step i gave token i - 1: tokens 0..at-1 ran on the old weights
    switch = at
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


async def test_a_weight_update_reprefills_every_resident_sequence(make_policy: Any) -> None:
    """Two sequences at different points when new weights land: both continue under them
    after a fresh prefill of prompt + tokens so far, each token stamped with its version."""
    old, new = make_policy(0), make_policy(1)
    new_weights = {k: v.clone() for k, v in new.model.state_dict().items()}
    first, second = prompts(2, old.tokenizer.vocab_size, seed=14)
    gens: dict[str, Generation] = {}
    async with engine_for(old, SteppedEngine, stepped=True, seed=0) as engine:

        async def run(name: str, prompt: list[int]) -> None:
            gens[name] = await engine.generate(prompt, SamplingParams(max_tokens=30))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "first", first)
                await engine.steps(3)  # first: 3 tokens; step 4 is held
                tg.start_soon(run, "second", second)
                await anyio.wait_all_tasks_blocked()
                await engine.steps(2)  # step 4; second joins step 5; step 6 is held
                await pause_after_held_step(engine)
                await engine.update_weights(WeightUpdate.by_reference(1, new_weights, leased=False))
                await engine.resume()
    # first: token i from step i + 1, up to token 5 from step 6; second: token 0 from step 5
    # (its prefill, in the same pass as first's token 4), token 1 from step 6
    switches = {"first": 6, "second": 2}
    for name, prompt in (("first", first), ("second", second)):
        gen, switch = gens[name], switches[name]
        assert gen.start_version == 0
        assert gen.versions == (0,) * switch + (1,) * (30 - switch)
        logprobs = torch.tensor(gen.logprobs)
        before = full_forward_logprobs(old.model, prompt, gen.token_ids[:switch])
        torch.testing.assert_close(logprobs[:switch], before, atol=ATOL, rtol=0)
        after = full_forward_logprobs(new.model, prompt, gen.token_ids)[switch:]
        torch.testing.assert_close(logprobs[switch:], after, atol=ATOL, rtol=0)


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


@pytest.mark.parametrize("batching", BATCHING)
async def test_pause_blocks_new_tokens_until_resume(tiny: Any, batching: str) -> None:
    prompt = prompts(1, tiny.tokenizer.vocab_size, seed=9)[0]
    result: list[Generation] = []
    async with engine_for(tiny, batching=batching) as engine:
        await engine.pause()
        await engine.pause()  # idempotent
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:

                async def run() -> None:
                    result.append(await engine.generate(prompt, SamplingParams(max_tokens=3)))

                with threads_held() as threads:
                    tg.start_soon(run)
                    await anyio.wait_all_tasks_blocked()
                    assert threads.statistics().tasks_waiting == 0, "a step started while paused"
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



@pytest.mark.parametrize("batching", BATCHING)
async def test_an_episodes_next_turn_reuses_its_cached_prefix(tiny: Any, batching: str) -> None:
    """Turn two extends turn one's prompt and completion with an observation: only the new
    tokens go through the model, in the running batch's next step, and every log-prob is
    still what one unpadded forward pass over the whole conversation gives; episodes run
    side by side."""
    vocab = tiny.tokenizer.vocab_size
    ps = prompts(4, vocab, seed=5)
    observations = prompts(4, vocab, seed=6)  # 3 to 18 new tokens after each turn
    head_rows, drawn, fed = [], [], []
    conversations: list[list[int]] = []
    async with engine_for(tiny, max_batch_size=8, seed=1, batching=batching) as engine:
        engine.model.get_output_embeddings().register_forward_hook(
            lambda _module, args, _out: head_rows.append(args[0].shape[:-1].numel()))
        engine.model.register_forward_pre_hook(
            lambda _, args, kwargs: fed.append(kwargs["input_ids"].numel()), with_kwargs=True)

        async def episode(i: int) -> None:
            conversation = list(ps[i])
            for turn in range(3):
                sampling = SamplingParams(max_tokens=4 + turn + i, temperature=1.0)
                gen = await engine.generate(conversation, sampling)
                assert_teacher_forced(tiny.model, conversation, gen)
                drawn.append(len(gen.token_ids))
                conversation += [*gen.token_ids, *observations[(i + turn) % 4]]
            conversations.append(conversation[: -len(observations[(i + 2) % 4])])

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(episode, i)
    assert engine.prefixes.hits == 8  # turns two and three of every episode
    assert engine.prefixes.reused > 8 * 3
    # Every token of every conversation went through the model once (but the last sampled
    # one, never fed), and the LM head ran once per drawn token.
    assert sum(fed) == sum(len(c) - 1 for c in conversations)
    assert sum(head_rows) == sum(drawn)


async def test_a_weight_update_drops_the_cached_prefixes(make_policy: Any) -> None:
    first, second = make_policy(0), make_policy(1)
    prompt = prompts(1, first.tokenizer.vocab_size, seed=9)[0]
    async with engine_for(first, seed=0) as engine:
        gen = await engine.generate(prompt, SamplingParams(max_tokens=5, temperature=1.0))
        await engine.pause()
        await engine.update_weights(WeightUpdate.of_module(1, second.model))
        await engine.resume()
        follow = prompt + list(gen.token_ids) + [9, 10]
        again = await engine.generate(follow, SamplingParams(max_tokens=3, temperature=1.0))
    assert engine.prefixes.hits == 0  # the parked prefix came from the old weights
    assert_teacher_forced(second.model, follow, again)


def test_the_prefix_cache_gives_the_longest_parked_sequence_a_request_extends() -> None:
    """Parked sequences shorter and longer than the ids they are found by, of two episodes:
    a request takes the longest it extends, and an evicted or taken one is found no more."""
    def parked(ids: list[int]) -> Request:
        request = Request(ids, SamplingParams())
        request.fed = len(ids)
        return request

    def kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.zeros(1, n, 2), torch.zeros(1, n, 2))]

    episode, other = list(range(10, 30)), list(range(10, 18)) + list(range(50, 62))
    store = PrefixCache(max_tokens=60)
    keys = [episode[:3], episode[:12], episode[:16], other[:14], [7, 7]]
    store.park([parked(k) for k in keys], [kv(len(k)) for k in keys], version=0)
    assert store.tokens == 3 + 12 + 16 + 14 + 2
    assert set(store.extended(episode[:16])) == {tuple(episode[:3]), tuple(episode[:12])}
    taken = store.take(Request(episode, SamplingParams()), version=0)
    assert taken is not None and taken[0][0].shape[1] == 16
    assert store.take(Request(episode, SamplingParams()), version=0)[0][0].shape[1] == 12
    # the other episode's first 8 ids are this one's: it extends its own and the shortest
    assert set(store.extended(other[:15])) == {tuple(other[:14]), tuple(episode[:3])}
    store.park([parked(list(range(100, 142)))], [kv(42)], version=0)  # 61 > 60: the oldest goes
    assert store.tokens == 14 + 2 + 42 and store.extended(episode) == []
    assert store.extended([7, 7, 1]) == [(7, 7)]
    store.take(Request([1, 2, 3], SamplingParams()), version=1)  # other weights: all go
    assert not store and store.extended([7, 7, 1]) == []


async def test_the_prefix_cache_can_be_turned_off_and_is_checked(tiny: Any) -> None:
    with pytest.raises(ConfigError, match="engine.prefix_cache_tokens must be >= 0, got -1"):
        engine_for(tiny, prefix_cache_tokens=-1)
    with pytest.raises(ConfigError, match="engine.prefill_limit_tokens must be >= 0"):
        engine_for(tiny, prefill_limit_tokens=-1)
    prompt = prompts(1, tiny.tokenizer.vocab_size)[0]
    async with engine_for(tiny, prefix_cache_tokens=0) as engine:
        gen = await engine.generate(prompt, SamplingParams(max_tokens=3, temperature=1.0))
        await engine.generate(prompt + list(gen.token_ids) + [8], SamplingParams(max_tokens=3))
    assert engine.prefixes.hits == 0 and not engine.prefixes


def plain_truncated(probs: list[float], top_p: float, top_k: int) -> list[float]:
    """The truncated distribution written the slow obvious way: the k likeliest tokens
    (k = 0: all), then the likeliest of them until their mass reaches top_p, renormalised."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(probs[i] for i in kept)
    nucleus, total = [], 0.0
    for i in kept:
        if total >= top_p * mass - 1e-12:
            break
        nucleus.append(i)
        total += probs[i]
    return [probs[i] / total if i in nucleus else 0.0 for i in range(len(probs))]


@pytest.mark.parametrize(("top_p", "top_k"), [(1.0, 2), (0.7, 0), (0.5, 3), (0.95, 1)])
def test_top_p_and_top_k_draw_from_the_truncated_distribution_and_report_its_logprob(
        top_p: float, top_k: int) -> None:
    """Draws follow the truncated, renormalised distribution (8,000 each: within 0.02), never
    leave it, and each draw's log-probability is the token's under it (what the engine
    returns as the behaviour log-prob, as vLLM's processed_logprobs does)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 3.0, 0.1, 2.9, -2.0]])
    temperature = torch.tensor([1.0, 0.8])
    rows = len(logits)
    expected = torch.tensor([plain_truncated(torch.softmax(logits[r] / temperature[r], -1).tolist(),
                                             top_p, top_k) for r in range(rows)],
                            dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    draws = 8_000  # the rows repeated: one call draws them all
    p, k = torch.full((rows * draws,), top_p, dtype=torch.float64), torch.full((rows * draws,), top_k)
    tokens, chosen = sample(logits.repeat(draws, 1), temperature.repeat(draws), generator,
                            top_p=p, top_k=k)
    tokens, chosen = tokens.view(draws, rows), chosen.view(draws, rows)
    for row in range(rows):
        counts = torch.bincount(tokens[:, row], minlength=5).double() / draws
        torch.testing.assert_close(counts, expected[row], atol=0.02, rtol=0)
        assert not bool((counts[expected[row] == 0] > 0).any())
        torch.testing.assert_close(chosen[:, row].double(), expected[row][tokens[:, row]].log(),
                                   atol=1e-5, rtol=0)
    p, k = p[:rows], k[:rows]
    # off (top_p 1, top_k 0) is the untruncated draw; greedy stays the argmax
    off = sample(logits, temperature, torch.Generator().manual_seed(3),
                 top_p=torch.ones(rows, dtype=torch.float64), top_k=torch.zeros(rows, dtype=torch.long))
    plain = sample(logits, temperature, torch.Generator().manual_seed(3))
    assert torch.equal(off[0], plain[0])
    greedy, _ = sample(logits, torch.zeros(rows), generator, top_p=p, top_k=k)
    assert greedy.tolist() == [0, 1]


async def test_the_engine_samples_within_top_k(tiny: Any) -> None:
    """Through the engine: with top_k=1 every token is the argmax (greedy at temperature 1)
    and its log-prob is 0, the truncated distribution's; rows without it in the same batch
    sample freely."""
    prompt = prompts(1, tiny.tokenizer.vocab_size, seed=4)[0]
    async with engine_for(tiny, seed=0) as engine:
        with anyio.fail_after(60):
            top1, greedy, free = await generate_all(engine, [
                (prompt, SamplingParams(max_tokens=8, temperature=1.0, top_k=1)),
                (prompt, SamplingParams(max_tokens=8, temperature=0.0)),
                (prompt, SamplingParams(max_tokens=8, temperature=1.0))])
    assert top1.token_ids == greedy.token_ids
    assert all(abs(lp) < 1e-5 for lp in top1.logprobs)
    assert_teacher_forced(tiny.model, prompt, free)
