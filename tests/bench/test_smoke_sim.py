"""The benchmarks that run the pipeline on simulated engines or replay traces, at their smoke
size, as a user runs them (``python -m bench.<name> --smoke``): the search latency model
against the shipped trace sample, the replay's fidelity on a held-out step, scheduling
policies replayed against their bounds, throughput against staleness and the agent gateway's
own time per call, each printing its documented headline last."""

from __future__ import annotations

import re

from bench_smoke import run_bench


def test_search_latency_smoke_reads_the_shipped_sample() -> None:
    _, ks, out = run_bench("search_latency", expect="ks")
    assert 0 <= ks <= 1
    assert "orchestrator/trace/data/search_r1 " in out and "fit=shipped" in out
    assert {m for m in re.findall(r"^(empirical|parametric) +[\d.]+ ", out, re.MULTILINE)} \
        == {"empirical", "parametric"}
    _, refit, out = run_bench("search_latency", "--refit", expect="ks")
    assert 0 <= refit <= 1 and "fit=refit" in out


def test_replay_fidelity_smoke_replays_the_held_out_step() -> None:
    _, accuracy, out = run_bench("replay_fidelity", expect="accuracy")
    assert accuracy <= 1
    assert "eval=3 trajectories=64 replicas=1 iterations=5 " in out
    assert re.search(r"^pipeline replay \(64 trajectories", out, re.MULTILINE)
    assert re.search(r"^  rollout makespan s +[\d.]+ +[\d.]+ ", out, re.MULTILINE)


def test_async_replay_smoke_replays_every_policy_on_both_workloads() -> None:
    _, best, out = run_bench("async_replay", expect="bound_fraction_best")
    assert 0 < best <= 1  # a fraction of what no schedule can beat
    for workload in ("search_r1", "math"):
        assert f"\n== {workload}: " in out
        assert re.search(rf"^speedup_k2_vs_sync_{workload}=[\d.]+$", out, re.MULTILINE)
    rows = re.findall(r"^(sync|k=\d|partial\+\dB k=8) +[\d.]+ ", out, re.MULTILINE)
    assert len(rows) == 12  # six policies, two workloads
    assert float(re.search(r"^bound_frac_max=([\d.]+)$", out, re.MULTILINE).group(1)) <= 1


def test_staleness_smoke_runs_every_k() -> None:
    _, speedup, out = run_bench("staleness", expect="speedup_k2_vs_sync")
    assert speedup > 0
    assert re.findall(r"^ ?(\d) +[\d.]+ +[\d.]+ +[\d.]+ +\d+ +[\d.]+$", out, re.MULTILINE) \
        == ["0", "1", "2", "4"]


def test_gateway_smoke_loses_no_episode() -> None:
    _, p50, out = run_bench("gateway", expect="gateway_overhead_p50_ms")
    assert p50 >= 0
    assert "episodes lost: 0 of 8 (every call recorded: 16 of 16)" in out
    assert re.search(r"^p50: ToolEnv +[\d.]+ ms +gateway +[\d.]+ ms", out, re.MULTILINE)
