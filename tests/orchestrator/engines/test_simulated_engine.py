"""The simulated engine (orchestrator/engines/simulated.py): lengths, stop tokens, versions, in
virtual time (its waits are exact)."""

from __future__ import annotations

import statistics

import anyio
import pytest
from helpers import virtual_time  # noqa: F401 - anyio_backend: virtual time

from orchestrator.engines.simulated import SimulatedEngine
from orchestrator.types import FinishReason, SamplingParams
from orchestrator.weights.update import WeightUpdate

pytestmark = pytest.mark.anyio


async def test_lengths_are_long_tailed_and_capped() -> None:
    engine = SimulatedEngine(median_tokens=20, sigma=1.2, seconds_per_token=0.0, seed=1)
    gens = [await engine.generate([1], SamplingParams(max_tokens=60, stop_token_ids=(2,)))
            for _ in range(300)]
    lengths = [len(g.token_ids) for g in gens]
    assert max(lengths) == 60 and min(lengths) >= 1
    assert 12 <= statistics.median(lengths) <= 30
    for g in gens:
        assert len(g.logprobs) == len(g.versions) == len(g.token_ids)
        assert all(lp == -1.0 for lp in g.logprobs)
        if g.finish_reason is FinishReason.STOP:
            assert g.token_ids[-1] == 2
            assert all(7 <= t < 100 for t in g.token_ids[:-1])
        else:
            assert len(g.token_ids) == 60
    assert {g.finish_reason for g in gens} == {FinishReason.STOP, FinishReason.LENGTH}
    assert engine.requests == 300


async def test_same_seed_same_draws() -> None:
    a, b = SimulatedEngine(seed=5, seconds_per_token=0), SimulatedEngine(seed=5, seconds_per_token=0)
    sampling = SamplingParams(max_tokens=200)
    for _ in range(5):
        assert (await a.generate([1], sampling)).token_ids == (await b.generate([1], sampling)).token_ids


async def test_generation_takes_simulated_time() -> None:
    engine = SimulatedEngine(median_tokens=50, sigma=0.0, seconds_per_token=1e-3, chunk_tokens=10)
    start = anyio.current_time()
    gen = await engine.generate([1], SamplingParams(max_tokens=100))
    assert len(gen.token_ids) == 50
    assert anyio.current_time() - start == pytest.approx(0.05)  # 5 chunks of 10 ms


async def test_a_weight_update_mid_flight_changes_later_chunks() -> None:
    engine = SimulatedEngine(median_tokens=100, sigma=0.0, seconds_per_token=2e-3, chunk_tokens=4)
    result = []

    async def run() -> None:
        result.append(await engine.generate([1], SamplingParams(max_tokens=100)))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await anyio.sleep(0.03)  # inside the 4th chunk (8 ms each): the pause waits for it
            await engine.pause()
            await engine.update_weights(WeightUpdate.by_reference(1, {}, leased=False))
            await engine.resume()
    (gen,) = result
    assert gen.start_version == 0 and gen.versions == (0,) * 16 + (1,) * 84


async def test_max_concurrency_queues_requests() -> None:
    engine = SimulatedEngine(median_tokens=10, sigma=0.0, seconds_per_token=2e-3, chunk_tokens=10,
                             max_concurrency=1)
    start = anyio.current_time()
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(engine.generate, [1], SamplingParams(max_tokens=10))
    assert anyio.current_time() - start == pytest.approx(3 * 0.02)  # one after another


@pytest.mark.parametrize("kwargs", [{"median_tokens": 0}, {"sigma": -1}, {"seconds_per_token": -1},
                                    {"chunk_tokens": 0}])
def test_bad_settings(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SimulatedEngine(**kwargs)
