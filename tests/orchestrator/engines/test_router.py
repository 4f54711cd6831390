"""The engine router (orchestrator/engines/router.py): least-loaded with a shared prompt prefix
kept on its engine while that engine's load allows (the Ray launcher's routing), round robin
with an episode kept on its replica (the replay's), and a request that failed on a lost replica
run again elsewhere. The choice reads only the router's own bookkeeping."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from orchestrator.engines.router import (
    BLOCK,
    EngineRouter,
    EpisodeAffinity,
    Keeper,
    PrefixAffinity,
    Replica,
    prefix_blocks,
)
from orchestrator.engines.simulated import SimulatedEngine
from orchestrator.errors import ConfigError
from orchestrator.types import SamplingParams
from orchestrator.weights.update import WeightUpdate

pytestmark = pytest.mark.anyio


def router(engines: int = 2, slack: int | None = 2) -> EngineRouter:
    r = EngineRouter([SimulatedEngine(seconds_per_token=0.0) for _ in range(engines)],
                     affinity=PrefixAffinity(slack))
    for replica in r.replicas:
        replica.up = True
    return r


async def choose(r: EngineRouter, prompt: list[int], failed: dict[str, int] | None = None) -> str:
    replica = await r.choose(prompt, failed)
    replica.inflight += 1  # the request is now in flight there
    return replica.name


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
    again = await choose(r, prompt, failed={first: r.replicas[0].incarnation})
    assert again != first
    r.replicas[1].up = False
    assert await choose(r, [5] * 20) == "engine-2"


def test_prefix_blocks_chain_so_a_prefix_shares_its_leading_hashes() -> None:
    long = list(range(3 * BLOCK + 5))
    assert prefix_blocks(long)[:3] == prefix_blocks(long[: 3 * BLOCK])
    assert len(prefix_blocks(long)) == 4 and prefix_blocks([]) == []


async def test_round_robin_keeps_an_episodes_later_turns_on_its_replica() -> None:
    def episode(prompt: Sequence[int]) -> tuple[int | None, int]:
        return prompt[0], len(prompt) - 1  # the first token names it; one token a turn

    r = EngineRouter([SimulatedEngine(seconds_per_token=0.0) for _ in range(3)],
                     routing="round_robin", affinity=EpisodeAffinity(episode))
    async with r:
        assert [await choose(r, [key]) for key in (10, 11, 12, 13)] == [
            "engine-0", "engine-1", "engine-2", "engine-0"]
        assert await choose(r, [11, 0]) == "engine-1"  # a later turn: its episode's replica
        assert await choose(r, [14]) == "engine-1"  # the turn did not advance round robin


class Lost(Exception):
    """The test's replica loss."""


class Flaky(SimulatedEngine):
    """Fails its first request as lost, then serves."""

    def __init__(self) -> None:
        super().__init__(median_tokens=4, sigma=0.0, seconds_per_token=0.0)
        self.failed = False

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams):
        if not self.failed:
            self.failed = True
            raise Lost("gone")
        return await super().generate(prompt_ids, sampling)


class CountingKeeper(Keeper):
    lost_errors = (Lost,)

    def __init__(self) -> None:
        super().__init__()
        self.lost: list[tuple[str, bool]] = []

    def lose(self, replica: Replica, incarnation: int, error: BaseException,
             rerun: bool) -> None:
        self.lost.append((replica.name, rerun))
        replica.up = False


async def test_a_request_on_a_lost_replica_runs_again_on_another_and_sync_skips_it() -> None:
    keeper = CountingKeeper()
    engines = [Flaky(), SimulatedEngine(median_tokens=4, sigma=0.0, seconds_per_token=0.0)]
    async with EngineRouter(engines, keeper=keeper) as r:
        gen = await r.generate([1, 2], SamplingParams(max_tokens=8))
        assert len(gen.token_ids) == 4 and keeper.lost == [("engine-0", True)]
        assert [e.requests for e in engines] == [0, 1]
        await r.pause()
        await r.update_weights(WeightUpdate.by_reference(2, {}, leased=False))
        await r.resume()
    assert r.version == 2 and [e.version for e in engines] == [0, 2]  # the lost one skipped


async def test_with_every_replica_down_a_request_waits_for_one_to_come_back() -> None:
    async with EngineRouter([SimulatedEngine(seconds_per_token=0.0)]) as r:
        (replica,) = r.replicas
        replica.up = False
        chosen: list[Replica] = []

        async def request() -> None:
            chosen.append(await r.choose([1]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(request)
            await anyio.wait_all_tasks_blocked()
            assert not chosen  # waiting
            r.joined(replica)
        assert chosen == [replica] and replica.incarnation == 2


def test_bad_routing_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="routing=random"):
        EngineRouter([SimulatedEngine()], routing="random")
