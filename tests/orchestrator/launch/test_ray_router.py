"""The engine router's choice of engine: least-loaded, with a shared prompt prefix kept on its
engine while that engine's load allows (orchestrator/launch/ray/engines.py). No actors: the
choice reads only the router's own bookkeeping."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="launcher=ray needs the ray extra: pip install -e '.[ray]'")

from orchestrator.launch.ray.engines import BLOCK, EngineRouter, RayEngine, prefix_blocks
from orchestrator.launch.ray.spans import SpanCollector
from orchestrator.weights import WeightUpdate

pytestmark = pytest.mark.anyio


def router(engines: int = 2, slack: int | None = 2) -> EngineRouter:
    slots = [RayEngine(actor=None, name=f"engine-{i}") for i in range(engines)]
    for slot in slots:
        slot.up = True
    return EngineRouter(slots, WeightUpdate.by_reference(0, {}, leased=False), SpanCollector(),
                        affinity_slack=slack)


async def choose(r: EngineRouter, prompt: list[int], failed: dict[str, int] | None = None) -> str:
    engine = await r._choose(prefix_blocks(prompt), failed or {})
    engine.inflight += 1  # the request is now in flight there
    return engine.name


async def test_a_groups_samples_and_an_episodes_later_turns_stay_on_one_engine() -> None:
    r = router(slack=8)
    prompt = list(range(40))
    assert {await choose(r, prompt) for _ in range(3)} == {"engine-0"}
    later_turn = prompt + [7] * 30  # the prompt extended by a reply and an observation
    assert await choose(r, later_turn) == "engine-0"
    assert await choose(r, [99] * 40) == "engine-1"  # a new prompt: the least-loaded engine


async def test_affinity_yields_to_load_beyond_the_slack() -> None:
    r = router(slack=2)
    prompt = list(range(2 * BLOCK))
    chosen = [await choose(r, prompt) for _ in range(6)]
    # engine-0 takes the prompt until it has 2 more in flight than engine-1; then the prefix
    # moves to engine-1, which keeps it while it is the least loaded
    assert chosen == ["engine-0"] * 3 + ["engine-1"] * 3
    plain = router(slack=None)  # least-loaded only
    assert [await choose(plain, prompt) for _ in range(4)] == ["engine-0", "engine-1"] * 2


async def test_a_failed_request_goes_to_another_engine_and_skips_engines_that_are_down() -> None:
    r = router(engines=3)
    prompt = list(range(20))
    first = await choose(r, prompt)
    again = await choose(r, prompt, failed={first: r.engines[0].incarnation})
    assert again != first
    r.engines[1].up = False
    assert await choose(r, [5] * 20) == "engine-2"


def test_prefix_blocks_chain_so_a_prefix_shares_its_leading_hashes() -> None:
    long = list(range(3 * BLOCK + 5))
    assert prefix_blocks(long)[:3] == prefix_blocks(long[: 3 * BLOCK])
    assert len(prefix_blocks(long)) == 4 and prefix_blocks([]) == []
