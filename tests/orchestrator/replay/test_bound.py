"""The run bound holds by construction: no scheduling policy, on the shipped search_r1 sample or
a generated math or tool-calling workload, trains faster in its steady state than the bound
of what it trained (:class:`orchestrator.replay.bound.RunBound`); and the bound is not vacuous
(the best policy comes close to it)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from envs.replay import EpisodePlan
from orchestrator.config.schema import ReplayConfig
from orchestrator.replay import EngineFit, load_plans, replay, resample_groups, run_virtual
from orchestrator.replay.bound import BoundMeter, turn_work
from orchestrator.replay.model import RequestSpec, ServerModel, ServerParams
from orchestrator.trace import SHIPPED_SAMPLE, TraceDir
from orchestrator.trace.generate import generate_workload

POLICIES = [(0, None), (1, None), (2, None), (4, None), (8, 1.0), (8, 2.0)]  # (k, overprovision)
STEPS, SKIP = 5, 2


def workload(name: str, tmp: Path) -> tuple[list[EpisodePlan], EngineFit, int, int]:
    """Plans, fit, engines and groups a step of a small version of each workload."""
    fit = EngineFit.load(None)
    if name == "search_r1":
        groups, scale = 4, 64  # 4 groups a step of the shipped sample, on a thinned server
        fit = replace(fit, server=fit.server.thinned(scale), tokens_per_step=fit.tokens_per_step / scale)
        pool, _ = load_plans(TraceDir.open(SHIPPED_SAMPLE), None, None, 0)
        return resample_groups(pool, groups * (STEPS + 8), 0), fit, 1, groups
    batch = 64 if name == "math" else 32  # tool calling: 32 sessions of up to 10 calls a step
    out = generate_workload(name, STEPS + 8, batch, 0, tmp / name, max_response_tokens=4096,
                            group_size=8)
    plans, groups = load_plans(TraceDir.open(out), None, None, 0)
    return plans, fit, 4, groups


@pytest.mark.parametrize("name", ["search_r1", "math", "tool_calling"])
def test_no_policy_beats_its_run_bound(tmp_path: Path, name: str) -> None:
    plans, fit, engines, groups = workload(name, tmp_path)
    fractions = []
    for k, over in POLICIES:
        meter = BoundMeter(fit.server, engines)
        result = run_virtual(replay, plans, fit,
                             ReplayConfig(groups_per_step=groups, num_steps=STEPS,
                                          rollout_share=0.7, engines=engines),
                             k=k, on_step=meter, overprovision=over, keep_batches=False)
        bound = meter.bound(result.reports, result.recorder, SKIP)
        assert bound.samples == sum(r.samples for r in result.reports[SKIP:]) > 0
        # the measured steady throughput is the window's, and never above its bound
        assert result.window(SKIP).samples_per_s == pytest.approx(bound.samples / bound.seconds)
        assert 0 < bound.fraction <= 1 + 1e-9, (name, k, over, bound)
        fractions.append(bound.fraction)
    assert max(fractions) > 0.3, fractions  # and not so loose that it says nothing


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_a_turn_costs_the_server_at_least_its_work(batch: int) -> None:
    """The server model alone: ``batch`` requests served together take no less replica time
    than the sum of their :func:`turn_work` (the bound's per-turn premise)."""
    p = ServerParams(step_base=0.02, step_per_seq=5e-4, step_per_1k_tokens=1e-4,
                     prefill_per_1k=0.05, prefill_base=0.01, max_running=16)
    specs = [RequestSpec(100 + 37 * i, 13 * i, 5 + 11 * (i % 9)) for i in range(batch)]
    server = ServerModel(p)
    for rid, spec in enumerate(specs):
        server.submit(0.0, rid, spec)
    done: list[int] = []
    while len(done) < batch:
        event = server.next_event()
        assert event is not None
        done += server.advance(event)
    work = sum(turn_work(s.prompt_tokens, s.cached_tokens, s.completion_tokens, p) for s in specs)
    assert server.busy >= work * (1 - 1e-9)
    assert server.busy <= work * 2 + batch * p.step_base * 100  # and of the same order
