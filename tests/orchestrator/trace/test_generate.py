"""``python -m orchestrator.trace generate``: workloads sampled from PolyTrace's published task
distributions follow them, are clipped like real runs, are reproducible, and read back through
the reader, the report and replay."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from orchestrator.trace import TraceDir, WorkloadRecord, iter_records, read_task_distribution
from orchestrator.trace.__main__ import main
from orchestrator.trace.generate import (
    MANIFEST,
    PARAMETERS,
    Distance,
    Parameters,
    derive_parameters,
    generate_workload,
    step_records,
    tool_calling_distances,
)

PUBLISHED = Path(__file__).resolve().parents[3].parent / "shared" / "polytrace"
N = 10_000
UNCLIPPED = 10**9


def ks(values: list[int], cdf: Callable[[float], float]) -> float:
    """KS statistic of integer samples ``max(1, round(x))`` against the law of ``x``: the
    discrete CDF at ``n`` is ``cdf(n + 0.5)`` for ``n >= 1`` (the mass below one lands on 1)."""
    a = np.sort(np.asarray(values))
    uniq, last = np.unique(a, return_index=False), np.searchsorted(a, np.unique(a), side="right")
    below = np.searchsorted(a, uniq, side="left") / len(a)
    d = 0.0
    for v, above, under in zip(uniq, last / len(a), below, strict=True):
        d = max(d, abs(above - cdf(v + 0.5)), abs(under - (cdf(v - 0.5) if v > 1 else 0.0)))
    return d


def phi(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def read(out: Path) -> list[WorkloadRecord]:
    trace = TraceDir.open(out)
    return [r for step in trace.steps() for r in trace.workload(step)]


@pytest.fixture(scope="module")
def params() -> Parameters:
    return Parameters.load()


def sample(task: str, params: Parameters, group_size: int = 1, seed: int = 0,
           math_model: str = "joint") -> list[WorkloadRecord]:
    """10k records of one step, as ``generate_workload`` writes them (without the file)."""
    return step_records(task, 0, N, seed, params, UNCLIPPED, group_size, math_model)


@pytest.fixture(scope="module")
def tool_workload(params: Parameters) -> list[WorkloadRecord]:
    return sample("tool_calling", params)


@pytest.mark.parametrize("group_size", [1, 8])
def test_math_lengths_follow_the_published_mixture(params: Parameters, group_size: int) -> None:
    records = sample("math", params, group_size)
    m = params.math
    sd = np.sqrt(m.covs[:, [0, 1], [0, 1]])

    def marginal(i: int) -> Callable[[float], float]:
        return lambda x: sum(w * phi((x - mu[i]) / s[i]) for w, mu, s in zip(m.weights, m.means, sd, strict=True))

    assert ks([r.final_response_len for r in records], marginal(1)) <= 0.05
    groups: dict[int, set[int]] = {}
    for r in records:
        groups.setdefault(r.prompt_group_id, set()).add(r.prompt_len)
    assert len(groups) == N // group_size and all(len(p) == 1 for p in groups.values())
    prompts = [next(iter(p)) for p in groups.values()]
    if group_size == 1:  # 10k independent prompts
        assert ks(prompts, marginal(0)) <= 0.05
    # the joint law, not two marginals: output means of the mixture's prompt bands
    inputs = np.array([r.prompt_len for r in records])
    outputs = np.array([r.final_response_len for r in records])
    assert outputs[inputs > 220].mean() > outputs[inputs < 120].mean() + 2000


def test_math_marginal_model_follows_the_published_lognormals(params: Parameters) -> None:
    records = sample("math", params, seed=3, math_model="marginal")

    def lognorm(p: tuple[float, float, float]) -> Callable[[float], float]:
        s, loc, scale = p
        return lambda x: 0.0 if x <= loc else phi(math.log((x - loc) / scale) / s)

    assert ks([r.prompt_len for r in records], lognorm(params.math.input_lognorm)) <= 0.05
    assert ks([r.final_response_len for r in records], lognorm(params.math.output_lognorm)) <= 0.05


def test_call_counts_follow_the_published_histogram(tool_workload: list[WorkloadRecord],
                                                   params: Parameters) -> None:
    counts = Counter(r.turn_count for r in tool_workload)  # k calls: k turns, k - 1 tool calls
    assert all(r.tool_call_count == r.turn_count - 1 for r in tool_workload)
    for k, p in params.call_counts.items():
        assert abs(counts[k] / N - p) <= max(0.01, 4 * math.sqrt(p * (1 - p) / N)), k
    assert set(counts) <= set(params.call_counts)


def test_per_call_lengths_follow_the_published_moments(tool_workload: list[WorkloadRecord],
                                                       params: Parameters) -> None:
    data = json.loads(PARAMETERS.read_text())["tool_calling"]["sequences"]["3"]
    three = [r for r in tool_workload if r.turn_count == 3]  # the most common count (43%)
    assert len(three) > 4000
    features = {
        "input_1": [r.prompt_len for r in three],
        "input_2": [r.tool_calls[0].append_len for r in three],
        "input_3": [r.tool_calls[1].append_len for r in three],
        **{f"output_{i + 1}": [r.turns[i].completion_tokens for r in three] for i in range(3)},
    }
    for i, name in enumerate(data["features"]):
        mean, var = data["mean"][i], data["covariance"][i][i]
        s2 = math.log1p(var / mean**2)  # the log-normal with the published mean and variance
        mu = math.log(mean) - s2 / 2
        assert ks(features[name], lambda x, mu=mu, s2=s2: phi((math.log(x) - mu) / math.sqrt(s2))) <= 0.05, name
        assert np.mean(features[name]) == pytest.approx(mean, rel=0.1), name
    # the last call (the answer) is long, the others short tool requests
    assert np.mean(features["output_3"]) > 2 * np.mean(features["output_1"])


def test_every_per_call_length_and_the_call_counts_match_the_published_parameters(
        tool_workload: list[WorkloadRecord], params: Parameters) -> None:
    """The stated distances (docs/traces.md, "generate"): call-count histogram by total variation and
    KS; each per-call length of each call count with 200+ sessions by KS against the log-normal
    of the published mean and variance (below the 99.9% critical value 1.95 / sqrt(n), plus
    0.005 for rounding to tokens), its mean within 5 standard errors; correlations within 0.1
    of the published ones where 2,000+ sessions make the sample correlation of such heavy
    tails steady enough (the copula reproduces them exactly up to 8 calls)."""
    distances = tool_calling_distances(tool_workload, params)
    calls = distances[0]
    assert calls.quantity == "calls" and calls.tv <= 0.01 and calls.ks <= 0.01
    lengths = [d for d in distances[1:] if not d.quantity.startswith("corr")]
    assert {d.quantity.split()[0] for d in lengths} >= {"k=2", "k=3", "k=4", "k=5", "k=6"}
    for d in lengths:
        assert d.ks <= 1.95 / math.sqrt(d.n) + 0.005, d
        assert abs(d.mean_err) <= 5 * (1 + d.sd_err) * _cv(d) / math.sqrt(d.n) + 0.01, d
    for d in distances[1:]:
        if d.quantity.startswith("corr") and d.n >= 2000:
            assert d.ks <= 0.1, d


def _cv(d: Distance) -> float:
    """The published coefficient of variation of a per-call length ``d``."""
    k, name = d.quantity.split()
    seq = json.loads(PARAMETERS.read_text())["tool_calling"]["sequences"][k[2:]]
    i = seq["features"].index(name)
    return math.sqrt(seq["covariance"][i][i]) / seq["mean"][i]


def test_tool_calls_take_the_search_latency_model(tool_workload: list[WorkloadRecord]) -> None:
    calls = [c for r in tool_workload for c in r.tool_calls]
    latency = np.array([c.latency_s for c in calls])
    assert 0.1 < np.percentile(latency, 50) < 0.25 and 0.8 < np.percentile(latency, 90) < 1.6
    statuses = Counter(c.status for c in calls)
    assert statuses["success"] / len(calls) > 0.99 and set(statuses) <= {"success", "unknown", "api_error"}
    assert 0.8 < Counter(c.query_count for c in calls)[1] / len(calls) < 0.95


def test_responses_are_clipped_at_the_max(tmp_path: Path) -> None:
    math_records = read(generate_workload("math", 1, 2048, 0, tmp_path / "m", 4096))
    clipped = [r for r in math_records if r.finish_reason == "length"]
    assert 0.5 < len(clipped) / len(math_records) < 0.9  # most of the mixture lies past 4k
    assert all(r.final_response_len == 4096 and r.turns[0].finish_reason == "length" for r in clipped)
    assert all(r.final_response_len < 4096 for r in math_records if r.finish_reason == "stop")
    tool = read(generate_workload("tool_calling", 2, 512, 0, tmp_path / "t", 1500))
    assert any(r.finish_reason == "length" for r in tool)
    for r in tool:
        assert r.final_response_len <= 1500 and r.max_response_len == 1500
        assert sum(n for _, n in r.response_loss_mask_rle) == r.final_response_len
        assert r.final_response_loss_len == sum(t.completion_tokens for t in r.turns)
        assert all(t.completion_tokens <= t.max_new_tokens for t in r.turns)
        assert (r.finish_reason == "length") == (r.final_response_len == 1500 or r.turns[-1].finish_reason == "length")
        contexts = [t.prompt_tokens for t in r.turns]
        assert contexts[0] == r.prompt_len and contexts == sorted(contexts)


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    def files(out: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(out.iterdir())}

    for task in ("math", "tool_calling"):
        a = files(generate_workload(task, 2, 64, 7, tmp_path / f"{task}-a"))
        b = files(generate_workload(task, 2, 64, 7, tmp_path / f"{task}-b"))
        c = files(generate_workload(task, 2, 64, 8, tmp_path / f"{task}-c"))
        longer = files(generate_workload(task, 3, 64, 7, tmp_path / f"{task}-d"))
        assert a == b
        steps = [n for n in a if n != MANIFEST]
        assert all(a[n] != c[n] for n in steps)
        assert all(a[n] == longer[n] for n in steps)  # step N draws from (seed, N) only


def test_a_generated_dir_reads_back_unchanged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from orchestrator.replay.plans import load_plans

    out = tmp_path / "tool"
    assert main(["generate", "--task", "tool_calling", "--steps", "2", "--batch", "64", "--seed", "1",
                 "-o", str(out), "--group-size", "4"]) == 0
    for path in sorted(out.glob("multiturn_workload_step_*.jsonl")):
        lines = path.read_text().splitlines()
        assert [json.dumps(r.to_dict()) for r in iter_records(path)] == lines
    plans, per_step = load_plans(TraceDir.open(out), None, None, 0)
    assert len(plans) == 128 and per_step == 16
    assert Counter(p.group for p in plans) == {g: 4 for g in range(32)}
    records = read(out)
    for plan, r in zip(plans, records, strict=True):
        assert plan.prompt_tokens == r.prompt_len and len(plan.turns) == r.turn_count
        assert sum(len(t.tools) for t in plan.turns) == r.tool_call_count
    capsys.readouterr()
    assert main(["summarize", str(out), "--no-plots"]) == 0
    report = capsys.readouterr().out
    assert "output tokens: n=128" in report and "tool latency s: p50=" in report


def test_a_generated_dir_replays(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir

    from orchestrator.builders import run

    out = generate_workload("tool_calling", 1, 64, 0, tmp_path / "w")
    repo = Path(__file__).resolve().parents[3]
    with initialize_config_dir(config_dir=str(repo / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=replay", f"trace={out}", "pipeline.num_steps=1",
                                           "replay.groups_per_step=8"])
    run(cfg, tmp_path / "run")
    assert len(list(TraceDir.open(tmp_path / "run").workload(0))) == 64


def test_bad_arguments_get_one_sentence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--task", "math", "--steps", "1", "--batch", "60", "-o", str(tmp_path / "a")]) == 2
    assert "must be a positive multiple of --group-size 8" in capsys.readouterr().err
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "multiturn_workload_step_0.jsonl").write_text("")
    assert main(["generate", "--task", "math", "--steps", "1", "--batch", "8", "-o", str(tmp_path / "b")]) == 2
    assert "not generated here" in capsys.readouterr().err
    # a directory written here before is rewritten, with no step left over
    generate_workload("math", 3, 8, 0, tmp_path / "c")
    generate_workload("math", 1, 8, 0, tmp_path / "c")
    assert TraceDir.open(tmp_path / "c").steps() == [0]


@pytest.mark.skipif(not PUBLISHED.is_dir(), reason="the published traces are not beside the checkout")
def test_shipped_parameters_are_derived_from_the_published_file(tmp_path: Path) -> None:
    published = PUBLISHED / "task_distribution_parameters.json"
    assert derive_parameters(read_task_distribution(published)) == json.loads(PARAMETERS.read_text())
    a = generate_workload("tool_calling", 1, 16, 0, tmp_path / "a")
    b = generate_workload("tool_calling", 1, 16, 0, tmp_path / "b", parameters=published)
    assert (a / "multiturn_workload_step_0.jsonl").read_bytes() == (b / "multiturn_workload_step_0.jsonl").read_bytes()
