"""Replay at cluster scale and its scheduling policies: engine replicas behind the router, per-token
versions across weight updates, the trainer cost model, the throughput bound, and the staleness
invariant of every policy (orchestrator/engines/router.py, replay/engine.py, bound.py, run.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from envs.replay import EpisodePlan, ToolPlan, TurnPlan
from orchestrator.builders import run
from orchestrator.config.schema import ReplayConfig
from orchestrator.engines.router import EngineRouter
from orchestrator.errors import ConfigError
from orchestrator.replay import replay_parts, run_virtual
from orchestrator.replay.bound import sample_cost, workload_bound
from orchestrator.replay.engine import busy_seconds, cache_misses, replay_engine, replay_router
from orchestrator.replay.fit import EngineFit
from orchestrator.replay.model import RequestSpec, ServerModel, ServerParams
from orchestrator.replay.run import ReplayResult, TrainerModel, replay
from orchestrator.replay.tokenizer import FILL, KEY_BASE, OBS, STOP
from orchestrator.trace import SHIPPED_SAMPLE
from orchestrator.trainer.simulated import SimulatedTrainer, TokenCost
from orchestrator.types import SamplingParams, Trajectory
from orchestrator.weights.update import WeightUpdate

REPO = Path(__file__).resolve().parents[3]
PARAMS = ServerParams(step_base=0.01, step_per_seq=0.002, step_per_1k_tokens=0.001,
                      prefill_per_1k=0.1, max_running=64)
SAMPLING = SamplingParams(max_tokens=10_000, stop_token_ids=(STOP,))


def one_turn(key: int, completion: int, group: int = 0, prompt: int = 20) -> EpisodePlan:
    return EpisodePlan(key, prompt, (TurnPlan(prompt, 0, completion, "stop"),), group, key % 2)


def two_turns(key: int, group: int = 0) -> EpisodePlan:
    first = TurnPlan(40, 0, 30, "tool_calls", tools=(ToolPlan(0.5, "success", 1, 20),))
    return EpisodePlan(key, 40, (first, TurnPlan(90, 70, 10, "stop")), group, key % 2)


def prompt_of(key: int, length: int = 20, turn: int = 0) -> list[int]:
    return [KEY_BASE + key] + [FILL] * (length - 1) + [OBS] * turn


def update(version: int) -> WeightUpdate:
    return WeightUpdate.by_reference(version, {}, leased=False)


# -- the engine: per-token versions -----------------------------------------------------------


def test_tokens_decoded_after_a_weight_update_carry_its_version() -> None:
    params = ServerParams(step_base=0.01, step_per_seq=0.0, step_per_1k_tokens=0.0,
                          prefill_per_1k=0.0, max_running=8)
    engine = replay_engine({0: one_turn(0, 100), 1: one_turn(1, 30)}, params)
    out = {}

    async def main() -> None:
        async with engine, anyio.create_task_group() as tg:

            async def generate(key: int) -> None:
                out[key] = await engine.generate(prompt_of(key), SAMPLING)

            tg.start_soon(generate, 0)
            tg.start_soon(generate, 1)
            await anyio.sleep(0.405)  # 40 tokens each decoded (0.01 s an iteration)
            await engine.pause()
            await engine.update_weights(update(1))
            await engine.resume()
            await anyio.sleep(0.2)  # 20 more
            await engine.pause()
            await engine.update_weights(update(2))
            await engine.resume()

    run_virtual(main)
    long, short = out[0], out[1]
    assert long.versions == (0,) * 40 + (1,) * 20 + (2,) * 40
    assert long.start_version == 0 and long.token_ids[-1] == STOP
    assert short.versions == (0,) * 30  # finished before either update


# -- the router -----------------------------------------------------------------------------


def route(plans: dict[int, EpisodePlan], engines: int, routing: str, sticky: bool,
          calls: list[list[int]]) -> EngineRouter:
    """Run ``calls`` (rounds of prompts sent at once) through a router of ``engines`` replicas."""
    router = replay_router(plans, PARAMS, engines, routing, sticky)

    async def main() -> None:
        async with router:
            for prompts in calls:
                async with anyio.create_task_group() as tg:
                    for prompt in prompts:
                        tg.start_soon(router.generate, prompt, SAMPLING)

    run_virtual(main)
    return router


def test_least_loaded_routing_spreads_requests_over_the_replicas() -> None:
    plans = {i: one_turn(i, 50) for i in range(8)}
    router = route(plans, 4, "least_loaded", True, [[prompt_of(i) for i in range(8)]])
    assert [e.requests for e in router.engines] == [2, 2, 2, 2]  # type: ignore[attr-defined]
    # each replica decodes its own two requests: the run takes one replica's time, not 8 on one
    assert busy_seconds(router) == pytest.approx(4 * busy_seconds(router.engines[0]))


def test_round_robin_takes_replicas_in_turn() -> None:
    plans = {i: one_turn(i, 5 + 40 * (i % 2)) for i in range(6)}
    router = route(plans, 3, "round_robin", True, [[prompt_of(i)] for i in range(6)])
    assert [e.requests for e in router.engines] == [2, 2, 2]  # type: ignore[attr-defined]


def test_sticky_routing_keeps_an_episode_on_its_replica_and_its_prefix_cache() -> None:
    plans = {i: two_turns(i) for i in range(4)}
    first = [prompt_of(i, 40) for i in range(4)]
    second = [prompt_of(i, 90, turn=1) for i in range(4)]
    calls = [[p] for p in first + second[::-1]]  # one at a time: a fixed order
    sticky = route(plans, 2, "round_robin", True, calls)
    assert cache_misses(sticky) == 0
    # without it the reversed later turns land on the other replica and prefill in full
    scattered = route(plans, 2, "round_robin", False, calls)
    assert cache_misses(scattered) == 4
    assert busy_seconds(scattered) > busy_seconds(sticky)


def test_weight_sync_reaches_every_replica() -> None:
    router = replay_router({}, PARAMS, 3)

    async def main() -> None:
        async with router:
            await router.pause()
            await router.update_weights(update(5))
            await router.resume()

    run_virtual(main)
    assert router.version == 5 and [e.version for e in router.engines] == [5, 5, 5]


def test_bad_routing_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="replay.routing=random"):
        ReplayConfig(routing="random")  # type: ignore[arg-type]


# -- the bound -------------------------------------------------------------------------------


def test_a_samples_floor_is_its_latency_alone_and_its_work_what_a_full_server_spends() -> None:
    plan = one_turn(0, 200, prompt=500)
    cost = sample_cost(plan, PARAMS)
    server = ServerModel(PARAMS)
    server.submit(0.0, 0, RequestSpec(500, 0, 200))
    assert server.advance(100.0) == [0]
    assert cost.floor == pytest.approx(server.busy)  # alone: the latency is the busy time
    per_token = PARAMS.step_per_seq + PARAMS.step_base / PARAMS.max_running
    context = PARAMS.step_per_1k_tokens * (200 * 500 + 200 * 200 / 2) / 1000
    assert cost.work == pytest.approx(0.05 + 200 * per_token + context)
    assert cost.tokens == 700
    tools = sample_cost(two_turns(1), PARAMS)
    assert tools.tokens == 40 + 30 + 20 + 10 and tools.floor > 0.5  # the tool's 0.5 s


def uniform_workload(groups: int) -> list[EpisodePlan]:
    """Identical groups of a short and a long sample: any subset of groups has the
    workload's mean, so no policy can beat the bound by what it drops."""
    plans = []
    for g in range(groups):
        plans += [one_turn(2 * g, 40, g), one_turn(2 * g + 1, 600, g)]
    return plans


FIT = EngineFit(PARAMS, makespan_s=10.0, tokens_per_step=1000.0, trajectories_per_step=8)


def run_policy(plans: list[EpisodePlan], k: int, overprovision: float | None = None,
               engines: int = 2, steps: int = 6, **kwargs: Any) -> ReplayResult:
    settings = ReplayConfig(groups_per_step=4, num_steps=steps, trainer_s=1.0,
                            trainer_s_per_1k_tokens=0.5, engines=engines)
    return run_virtual(replay, plans, FIT, settings, k=k, overprovision=overprovision, **kwargs)


@pytest.mark.parametrize(("k", "overprovision"), [(0, None), (1, None), (2, None), (2, 0.5)])
def test_no_policy_beats_the_bound(k: int, overprovision: float | None) -> None:
    plans = uniform_workload(60)
    trainer = TrainerModel(1.0, 0.5)
    bound = workload_bound(plans, PARAMS, engines=2, batch_size=8,
                           train_seconds=trainer.seconds(8 * 340))
    result = run_policy(plans, k, overprovision)
    assert result.throughput <= bound.samples_per_s
    assert result.window(2).samples_per_s <= bound.samples_per_s * 1.001
    if k == 0:
        assert result.throughput <= bound.sync_samples_per_s * 1.001


# -- the staleness invariant of every policy, in replay ---------------------------------------


def long_tailed(groups: int) -> list[EpisodePlan]:
    """Groups of two; every fourth has a sample 8x longer than the rest, some two-turn."""
    plans: list[EpisodePlan] = []
    for g in range(groups):
        for i in range(2):
            key = len(plans)
            if g % 3 == 1 and i == 1:
                plans.append(EpisodePlan(key, 40, two_turns(key).turns, g, i))
            else:
                plans.append(one_turn(key, 800 if g % 4 == 0 and i == 0 else 100, g))
    return plans


def trained(result: ReplayResult) -> list[tuple[int, Trajectory]]:
    return [(r.version, t) for r in result.reports for g in r.groups for t in g.trajectories]


def generated_versions(t: Trajectory) -> list[int]:
    return [v for v, m in zip(t.versions, t.loss_mask, strict=True) if m]


@pytest.mark.parametrize(("k", "overprovision"),
                         [(0, None), (1, None), (2, None), (4, None), (1, 0.5), (4, 1.0)])
def test_every_trained_token_is_within_k_versions(k: int, overprovision: float | None) -> None:
    result = run_policy(long_tailed(80), k, overprovision, steps=8)
    assert [r.samples for r in result.reports] == [8] * 8
    pairs = trained(result)
    for version, t in pairs:
        versions = generated_versions(t)
        assert versions[0] == t.start_version and versions == sorted(versions)
        assert all(version - k <= v <= version for v in versions)
    if k == 0:  # synchronous: every token of every sample under the weights it is trained at
        assert all(set(generated_versions(t)) == {v} for v, t in pairs)
    else:  # samples carried past a weight update were trained
        assert any(v > t.start_version for v, t in pairs)
    if k >= 2:  # long ones ran across updates, their later tokens under newer weights
        assert any(len(set(generated_versions(t))) > 1 for _, t in pairs)


def test_partial_rollout_keeps_fewer_samples_in_flight_and_drops_none_here() -> None:
    plans = long_tailed(80)
    bounded = run_policy(plans, 4, None, steps=8)
    partial = run_policy(plans, 4, 0.5, steps=8)
    assert partial.policy == "partial+0.5B k=4" and bounded.policy == "k=4"
    assert partial.reports[-1].dropped_total == 0
    mean = {r.policy: sum(s for x in r.reports for s in x.staleness) / r.samples
            for r in (bounded, partial)}
    assert mean["partial+0.5B k=4"] < mean["k=4"]  # 1.5 batches in flight, not 5


# -- config -------------------------------------------------------------------------------------


def composed(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=["experiment=replay", f"trace={SHIPPED_SAMPLE}",
                                            "replay.groups_per_step=8", "pipeline.num_steps=2",
                                            "progress=false", *overrides])


def test_replay_runs_a_cluster_with_a_fixed_cost_trainer_and_partial_rollout(tmp_path: Path) -> None:
    cfg = composed("replay.engines=4", "replay.routing=round_robin", "replay.trainer_s=30",
                   "replay.trainer_s_per_1k_tokens=0.01", "pipeline.max_staleness=2",
                   "pipeline.overprovision=1")
    parts = replay_parts(cfg)
    assert isinstance(parts.trainer, SimulatedTrainer)
    assert isinstance(parts.trainer.cost, TokenCost) and parts.trainer.cost.fixed_s == 30
    assert parts.trainer.cost.per_token_s == pytest.approx(1e-5)
    assert parts.pipeline.budget == 2 * 64 and parts.pipeline.num_workers == 16
    result = run(cfg, tmp_path)
    summary = result.summary
    assert summary["engines"] == 4 and summary["policy"] == "partial+1B k=2"
    assert "30 s + 0.01 s per 1k" in summary["assumption"]
    assert 0 <= summary["engine_idle_fraction"] < 1 and summary["samples"] == 128


@pytest.mark.parametrize(("override", "message"), [
    ("replay.engines=0", "replay.engines must be >= 1"),
    ("replay.routing=random", "replay.routing=random"),
    ("replay.trainer_s=-1", "replay.trainer_s must be >= 0"),
    ("replay.trainer_s_per_1k_tokens=0.1", "needs replay.trainer_s"),
])
def test_bad_cluster_settings_are_config_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        replay_parts(composed(override))
