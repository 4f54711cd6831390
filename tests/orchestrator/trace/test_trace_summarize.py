"""``python -m orchestrator.trace summarize``: the report on published traces and run directories."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.trace import SHIPPED_SAMPLE
from orchestrator.trace.__main__ import main
from orchestrator.trace.summarize import tail, tail_share, union_length


def test_interval_helpers() -> None:
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert tail([1, 2, 3, 4, 100])["max/p50"] == pytest.approx(100 / 3)
    # 20 requests until t=1, then one until t=5: 4 of 5 seconds below 10% of the peak
    intervals = [(0.0, 1.0)] * 19 + [(0.0, 5.0)]
    assert tail_share(intervals, 5.0) == pytest.approx(0.8)


def test_summarize_the_shipped_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summarize", str(SHIPPED_SAMPLE.parent), "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for text in ("== search_r1", "== rllm", "== verl_video", "turns/trajectory", "tool latency s: p50=",
                 "failure rate", "engine idle fraction", "stage time", "output tokens: n="):
        assert text in out, text
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["lengths.png", "stages.png", "structure.png", "tool_latency.png"]
    assert all((tmp_path / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_summarize_a_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hydra import compose, initialize_config_dir

    from orchestrator.builders import run

    repo = Path(__file__).resolve().parents[3]
    with initialize_config_dir(config_dir=str(repo / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=replay", "replay.groups_per_step=8",
                                           "pipeline.num_steps=1", "pipeline.max_staleness=1"])
    run(cfg, tmp_path / "run")
    capsys.readouterr()
    assert main(["summarize", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "stage time (summed over concurrent spans): generate" in out
    assert "train_step" in out and "engine idle fraction" in out
    assert (tmp_path / "run" / "summary" / "lengths.png").is_file()


def test_summarize_an_empty_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summarize", str(tmp_path)]) == 2
    assert "holds no PolyTrace files" in capsys.readouterr().err
