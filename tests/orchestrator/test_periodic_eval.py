"""``eval.every``: held-out greedy accuracy during RL, in the metrics of the steps it finished
in (the learning curve of a run, without keeping checkpoints to evaluate afterwards)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.main import EvalConfig, run
from helpers import quick_config


def test_evaluations_during_rl_land_in_the_step_metrics(tmp_path: Path) -> None:
    cfg = quick_config("smoke", "eval.every=1", "pipeline.num_steps=4")
    result = run(cfg, tmp_path)
    evaluated = [r.metrics for r in result.reports if "eval/accuracy" in r.metrics]
    assert evaluated, "no periodic evaluation finished during four steps"
    for metrics in evaluated:
        assert 0.0 <= metrics["eval/accuracy"] <= 1.0
        assert 1 <= metrics["eval/step"] <= 4
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/accuracy" in line for line in lines)


def test_a_negative_period_is_named() -> None:
    with pytest.raises(ConfigError, match="eval.every must be >= 0, got -1"):
        EvalConfig(every=-1)
