"""Group filters (orchestrator/algo/filters.py): what they keep, and ``algo.filter`` from the
real ``conf/`` through Hydra: it reaches the pipeline of a real run, the algorithm never sees
it, and a mistake in it is one line. (The pipeline's side, refills and masking under
staleness and across a resume, is tests/orchestrator/pipeline/test_outcomes.py.)"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from orchestrator.algo.composed import PolicyGradient
from orchestrator.algo.filters import (
    DynamicSampling,
    ZeroVarianceMask,
    build_filter,
    filter_options,
)
from orchestrator.builders import run, training_parts
from orchestrator.config.read import CONF, explain
from orchestrator.config.run import run_config
from orchestrator.errors import ConfigError
from orchestrator.trainer.torch_trainer import TorchTrainer
from orchestrator.types import FinishReason, Group, Trajectory

TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
        "model.intermediate_size=64", "model.device=cpu"]


def group(*rewards: float) -> Group:
    return Group(0, tuple(
        Trajectory(prompt_id=0, sample_index=i, token_ids=(1, 2), loss_mask=(False, True),
                   logprobs=(0.0, -1.0), versions=(-1, 0), reward=r, start_version=0,
                   finish_reason=FinishReason.STOP)
        for i, r in enumerate(rewards)), 0)


def config(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=["experiment=smoke", "logger=none", "progress=false",
                                            *TINY, *overrides])


def test_a_group_is_kept_when_its_rewards_differ_by_more_than_the_tolerance() -> None:
    for cls in (DynamicSampling, ZeroVarianceMask):
        exact, loose = cls(), cls(tolerance=0.25)
        assert not exact.keep(group(1.0, 1.0, 1.0)) and not exact.keep(group(0.0, 0.0))
        assert exact.keep(group(1.0, 0.0, 1.0)) and exact.keep(group(0.5, 0.5000001))
        assert not loose.keep(group(0.5, 0.7)) and loose.keep(group(0.5, 0.8))
    assert DynamicSampling.refill and not ZeroVarianceMask.refill
    assert DynamicSampling(max_refill_batches=2).max_refills(groups_per_batch=4) == 8
    assert ZeroVarianceMask().max_refills(groups_per_batch=4) == 0


@pytest.mark.parametrize(("overrides", "chosen"), [
    ([], None),
    (["algo/filter=dynamic_sampling"], DynamicSampling),
    (["algo=dapo"], DynamicSampling),  # the preset chooses it from conf/algo/filter/
    (["algo=dapo", "algo/filter=zero_variance"], ZeroVarianceMask),  # and it is overridable
    (["algo=dapo", "~algo/filter"], None),
    (["algo=dapo", "algo.filter=null"], None),
    (["algo=dr_grpo", "algo/filter=zero_variance"], ZeroVarianceMask),
])
def test_a_preset_or_the_command_line_chooses_the_filter(overrides: list[str],
                                                         chosen: type | None) -> None:
    algo = OmegaConf.to_container(config(*overrides).algo, resolve=True)
    assert isinstance(algo, dict)
    built = build_filter(algo["filter"])
    assert type(built) is chosen if chosen else built is None
    if chosen is not None:  # its own keys only: an option is never merged into another
        assert set(algo["filter"]) == {"_target_", *inspect.signature(chosen).parameters}
    assert filter_options() == ["dynamic_sampling", "zero_variance"]


def test_algo_filter_from_the_real_conf_reaches_a_runs_pipeline_and_not_the_algorithm(
        tmp_path: Path) -> None:
    """``algo/filter=dynamic_sampling`` on an untrained model (every reward 0: no group has
    signal) runs to its end: each step replaces groups up to its cap, then trains a full batch
    of what comes, and its metrics say so."""
    cfg = config("algo/filter=zero_variance", "algo.filter.tolerance=0.5")
    parts = training_parts(run_config(cfg))
    assert isinstance(parts.group_filter, ZeroVarianceMask)
    assert parts.group_filter.tolerance == 0.5
    assert isinstance(parts.trainer, TorchTrainer)
    assert isinstance(parts.trainer.algorithm, PolicyGradient)
    assert not hasattr(parts.trainer.algorithm, "filter")
    assert training_parts(run_config(config())).group_filter is None  # the default: no filter

    cfg = config("algo/filter=dynamic_sampling", "algo.filter.max_refill_batches=1",
                 "warmstart.steps=0", "eval.num_tasks=0", "pipeline.num_steps=2")
    result = run(cfg, tmp_path)
    assert [r.version for r in result.reports] == [0, 1]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    logged = [m for m in map(json.loads, lines) if "summary/steps" not in m]
    assert logged[0]["filter/capped"] == 1.0  # 4 groups (a batch) replaced, then the cap
    for report, record in zip(result.reports, logged, strict=True):
        assert report.samples == 16 and report.metrics["trained_tokens"] > 0
        assert record["filter/refills"] == record["groups/filtered"] == report.metrics[
            "groups/filtered"]
        assert record.get("filter/filtered_reward_mean", 0.0) == 0.0  # absent: none left out
    assert sum(r["filter/refills"] for r in logged) >= 4


@pytest.mark.parametrize(("overrides", "words"), [
    (["algo.filter=dynamic_sampling"], ["algo.filter=dynamic_sampling", "algo/filter=<name>",
                                        "zero_variance"]),
    (["algo/filter=dynamic_sampling", "algo.filter.max_refill_batches=0"],
     ["algo.filter.max_refill_batches", "0", "zero_variance"]),
    (["algo/filter=dynamic_sampling", "algo.filter.max_refill_batches=lots"],
     ["algo.filter.max_refill_batches=lots", "whole number"]),
    (["algo/filter=zero_variance", "algo.filter.tolerance=-1"], ["algo.filter.tolerance", "-1"]),
    (["algo/filter=zero_variance", "algo.filter._target_=orchestrator.algo.grpo.GRPO"],
     ["algo.filter._target_=orchestrator.algo.grpo.GRPO", "not a group filter"]),
    (["algo/filter=zero_variance", "rollout.group_size=1", "pipeline.batch_size=4"],
     ["algo/filter=zero_variance", "rollout.group_size >= 2"]),
    (["algo/filter=nope"], ["algo/filter", "nope", "dynamic_sampling, zero_variance"]),
    (["algo=dapo", "algo/filter=null"], ["~algo/filter"]),
], ids=["a-string", "no-refills", "not-a-number", "negative-tolerance", "not-a-filter",
        "groups-of-one", "unknown-option", "group-set-to-null"])
def test_a_bad_filter_config_is_one_line_naming_it(overrides: list[str], words: list[str]) -> None:
    with pytest.raises(Exception) as info:  # compose's error or ours: explain() reads both
        training_parts(run_config(config(*overrides)))
    line = explain(info.value)
    assert line is not None and "\n" not in line, info.value
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"


def test_a_filter_node_without_a_target_is_refused() -> None:
    with pytest.raises(ConfigError, match="algo.filter has no _target_"):
        build_filter({"tolerance": 0.1})
