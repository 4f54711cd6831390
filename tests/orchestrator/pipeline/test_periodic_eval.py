"""``eval.every``: held-out greedy accuracy during RL, in the metrics of the steps it finished
in (the learning curve of a run, without keeping checkpoints to evaluate afterwards)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import quick_config

from orchestrator.builders import run
from orchestrator.config.schema import EvalConfig
from orchestrator.errors import ConfigError


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


@pytest.mark.parametrize("engine", ["own", "shared"])
def test_an_evaluation_on_its_own_engine_sees_one_policy_version(tmp_path: Path,
                                                                  engine: str) -> None:
    """``eval.engine=own``: every token of an evaluation during RL comes from the weights of
    the step it began after (version N after step N), while rollout goes on with newer ones.
    ``shared`` evaluates on the rollout engine, where a run like this one shows tokens of other
    versions (the weights of the step before, updates landing mid-evaluation)."""
    from orchestrator.trace.recorder import read_spans, spans_path

    steps = 4
    cfg = quick_config("smoke", "eval.every=1", f"pipeline.num_steps={steps}",
                       f"eval.engine={engine}", "eval.num_tasks=8")
    result = run(cfg, tmp_path)
    evaluated = {int(r.metrics["eval/step"]) for r in result.reports if r.evaluation is not None}
    assert evaluated
    start = min(s.start for s in read_spans(spans_path(tmp_path), "train_step"))
    versions = {s.version for s in read_spans(spans_path(tmp_path), "generate")
                if s.worker == "eval" and s.start > start}  # not the evaluation before RL
    if engine == "own":  # each reported evaluation's version, the last one started (cut short
        # by the run's end) and the evaluation after RL's: no token of any other weights
        assert evaluated <= versions <= set(range(1, steps + 1))
        assert len(versions - evaluated - {steps}) <= 1
