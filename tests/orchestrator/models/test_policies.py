"""Scheduling policies in real training: partial rollout (``pipeline.overprovision``) with the
torch engine and the tiny model, through the run loop a training run uses."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from helpers import peak_concurrency
from hydra import compose, initialize_config_dir

from orchestrator.builders import training_parts
from orchestrator.config.run import run_config
from orchestrator.run.loop import RunResult, run_session
from orchestrator.types import StepReport, Trajectory

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("k", "overprovision"), [(1, 0.5), (2, 0.25)])
def test_partial_rollout_trains_only_tokens_within_k_versions(k: int, overprovision: float) -> None:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            "experiment=smoke", "logger=none", "progress=false", "model.device=cpu",
            "warmstart.steps=0", "eval.num_tasks=0", "rollout.max_tokens=24",
            "pipeline.num_workers=8", "pipeline.num_steps=5", f"pipeline.max_staleness={k}",
            f"pipeline.overprovision={overprovision}"])
    parts = training_parts(run_config(cfg))
    assert parts.pipeline.budget == 16 + round(16 * overprovision)
    trained: list[tuple[int, Trajectory]] = []

    def on_step(report: StepReport) -> None:
        trained.extend((report.version, t) for g in report.groups for t in g.trajectories)

    result = RunResult(run_dir=None)

    async def main() -> None:
        with anyio.fail_after(120):
            await run_session(parts, result, on_step)

    anyio.run(main)

    assert [r.version for r in result.reports] == [0, 1, 2, 3, 4]
    assert len(trained) == 5 * 16
    for version, t in trained:
        generated = [v for v, m in zip(t.versions, t.loss_mask, strict=True) if m]
        assert generated[0] == t.start_version and generated == sorted(generated)
        assert all(version - k <= v <= version for v in generated)
    assert all(0 <= s <= k for r in result.reports for s in r.staleness)
    # the groups started beyond the first batch were carried into the next step and trained
    assert any(s >= 1 for s in result.reports[1].staleness)
    # never more groups at once than the budget admits (groups of 4), though 8 workers could
    assert result.recorder is not None
    assert peak_concurrency(result.recorder.of("rollout")) <= parts.pipeline.budget // 4
