"""``experiment=rg`` (conf/experiment/rg.yaml): a reasoning-gym dataset through the real
config, built as the experiment describes and run end to end in a version shrunk to seconds
(the learning curve itself is measured in docs/environments.md, not here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")

from helpers import REPO, quick_config
from hydra import compose, initialize_config_dir

from envs.reasoning_gym import ReasoningGymSpec
from orchestrator.builders import check_sizes, run
from orchestrator.config.read import build_env, typed
from orchestrator.config.schema import PipelineConfig, RolloutConfig


def test_the_experiment_composes_and_builds_its_environment() -> None:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=rg", "logger=none"])
    assert cfg.env._target_ == "envs.reasoning_gym.ReasoningGymSpec"
    assert cfg.warmstart.target_accuracy is not None and cfg.warmstart.target_accuracy <= 0.25
    spec = build_env(cfg)
    assert isinstance(spec, ReasoningGymSpec) and spec.dataset == cfg.env.dataset
    check_sizes(typed(PipelineConfig, cfg, "pipeline"), typed(RolloutConfig, cfg, "rollout"), spec)
    prompt = spec.tasks("train")[0].messages[0]["content"]
    assert len(prompt) < 40  # short enough for the tiny model's context and the CPU budget


def test_a_short_run_completes_and_writes_metrics(tmp_path: Path) -> None:
    result = run(quick_config("rg"), tmp_path)
    assert result.summary["steps"] == 2 and result.summary["samples_per_s"] > 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics[:-1]] == [0, 1]
    for key in ("reward/mean", "reward/verifier", "reward/exact_match", "train/loss"):
        assert key in metrics[0], key
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["eval_before"] is not None
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["text"].startswith("Calculate ") for s in samples)
