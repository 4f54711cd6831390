"""Step metrics and the loggers that take them (orchestrator/loggers/)."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.config.schema import EvalConfig
from orchestrator.errors import ConfigError
from orchestrator.loggers.base import JsonlMetrics, NullLogger, step_metrics
from orchestrator.loggers.progress import StepProgress
from orchestrator.loggers.wandb_logger import WandbLogger
from orchestrator.pipeline.evaluation import score
from orchestrator.types import EvalSample, Evaluation, StepReport


def report(step: int = 2) -> StepReport:
    return StepReport(
        step=step, version=step, metrics={"loss": 0.5, "ratio": 1.0},
        rewards=(1.0, 0.0, 1.0, 0.0), staleness=(0, 1, 1, 0), start_versions=(2, 1, 1, 2),
        dropped_total=3, samples=4, tokens=20, elapsed=2.0,
        stage_seconds={"generate": 1.5, "train_step": 0.25},
    )


def test_step_metrics_have_stable_names_and_values() -> None:
    m = step_metrics(report())
    assert m["reward/mean"] == 0.5
    assert m["staleness/mean"] == 0.5 and m["staleness/max"] == 1.0
    assert m["staleness/dropped_total"] == 3.0
    assert m["throughput/samples_per_s"] == 2.0 and m["throughput/tokens_per_s"] == 10.0
    assert m["policy/version"] == 2.0
    assert m["train/loss"] == 0.5 and m["train/ratio"] == 1.0
    assert m["time/generate"] == 1.5 and m["time/train_step"] == 0.25 and m["time/step"] == 2.0
    assert all(isinstance(v, float) for v in m.values())


def test_jsonl_metrics_appends_one_line_per_step(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "metrics.jsonl"
    sink = JsonlMetrics(path)
    sink.log_step(report(0))
    sink.log_step(report(1))
    sink.log({"summary/steps": 2.0}, 2)
    sink.finish()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert lines[0]["reward/mean"] == 0.5 and lines[2] == {"step": 2, "summary/steps": 2.0}


def test_null_logger_accepts_everything(tmp_path: Path) -> None:
    logger = NullLogger()
    logger.start({"a": 1}, tmp_path)
    logger.log_step(report())
    logger.log({"x": 1.0}, 0)
    logger.finish()
    assert list(tmp_path.iterdir()) == []


def test_wandb_logger_rejects_an_unknown_mode() -> None:
    with pytest.raises(ConfigError, match="logger.mode=sometimes"):
        WandbLogger(mode="sometimes")
    assert WandbLogger(mode="offline", tags=None).tags == []


def test_progress_tracks_a_reward_average() -> None:
    with StepProgress(3, enabled=False) as progress:
        progress.update(report(0))
        progress.update(StepReport(**{**report(1).__dict__, "rewards": (0.0, 0.0, 0.0, 0.0)}))
    assert progress._reward_ema == pytest.approx(0.9 * 0.5)


def test_progress_without_a_terminal_logs_a_line_every_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    with caplog.at_level(logging.INFO, logger="orchestrator.progress"), \
            StepProgress(10, interactive=False, interval=5.0, clock=lambda: now[0]) as progress:
        for step in range(10):
            now[0] += 2.0  # a step every 2 s: a line at 6 s, 12 s, 18 s and the last step
            progress.update(report(step))
    lines = [r.getMessage() for r in caplog.records if r.name == "orchestrator.progress"]
    assert [line.split()[2] for line in lines] == ["3/10", "6/10", "9/10", "10/10"]
    assert "reward 0.500" in lines[0] and "ETA 0m14s" in lines[0]  # 7 steps left at 2 s each
    assert lines[-1].endswith("ETA 0m00s")
    assert "no checkpoint yet" in lines[0]
    samples = report(0).samples
    assert f"{samples * 3 / 6.0:.0f} samples/s" in lines[0]


def test_the_progress_line_says_when_the_last_checkpoint_was_written(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    with caplog.at_level(logging.INFO, logger="orchestrator.progress"), \
            StepProgress(4, interactive=False, interval=5.0, clock=lambda: now[0]) as progress:
        progress.checkpointed(0)  # the checkpoint after the warm start
        for step in range(4):
            now[0] += 20.0
            progress.update(report(step))
            if step == 1:
                progress.checkpointed(2)
    lines = [r.getMessage() for r in caplog.records if r.name == "orchestrator.progress"]
    assert "checkpoint @0 0m20s ago" in lines[0] and "checkpoint @2 0m40s ago" in lines[-1]


def test_progress_in_a_terminal_or_disabled_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="orchestrator.progress"):
        for kwargs in ({"enabled": False, "interactive": False}, {"interactive": True}):
            with StepProgress(2, interval=0.0, **kwargs) as progress:
                progress.update(report(0))
                progress.update(report(1))
    assert not [r for r in caplog.records if r.name == "orchestrator.progress"]


def evaluation() -> Evaluation:
    samples = [EvalSample(task_id=t, sample_index=i, source="math", reward=float(i == 0),
                          tokens=4, answer=str(i), prompt=f"q{t}", completion=f"{i}",
                          reference="0") for t in range(2) for i in range(4)]
    return score(samples, EvalConfig(n=4, temperature=1.0, k=[1, 4]))


def test_the_progress_line_carries_the_last_periodic_evaluation(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="orchestrator.progress"), \
            StepProgress(2, interactive=False, interval=0.0) as progress:
        progress.update(report(0))
        progress.update(replace(report(1), evaluation=evaluation()))
    lines = [r.getMessage() for r in caplog.records if r.name == "orchestrator.progress"]
    assert "eval" not in lines[0]
    assert "eval 0.250±0.000 pass@4 1.000±0.000" in lines[-1]  # each with its standard error


class FakeRun:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int]] = []

    def log(self, metrics: dict, step: int) -> None:
        self.logged.append((metrics, step))


def test_wandb_logs_an_evaluations_samples_as_a_table_and_its_figures() -> None:
    import wandb

    logger = WandbLogger(mode="disabled")
    logger._run = run = FakeRun()
    logger.log_evaluation("before", 0, evaluation())
    logger.log_evaluation("during", 7, evaluation())
    (before, step0), (during, step7) = run.logged
    assert (step0, step7) == (0, 7)
    table = before["eval/samples"]
    assert isinstance(table, wandb.Table) and len(table.data) == 2  # two tasks' first samples
    assert {"prompt", "completion", "reward", "answer"} <= set(table.columns)
    assert before["eval/pass@4"] == 1.0 and before["eval/math/mean@4"] == 0.25
    assert before["eval/accuracy"] == 0.25
    assert before["eval/pass@4_se"] == 0.0 and before["eval/math/mean@4_se"] == 0.0  # 2 alike
    assert set(during) == {"eval/samples"}  # during RL the figures came with the step's metrics
