"""A replay runs through the run loop and run directory training uses (orchestrator/replay/run.py,
trainer.py, fit.py, __main__.py and conf/experiment/replay.yaml)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import anyio
import pytest
from helpers import run_spans
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from orchestrator.builders import run
from orchestrator.errors import ConfigError
from orchestrator.replay import replay_parts, run_virtual
from orchestrator.replay.fit import EngineFit
from orchestrator.trace import SHIPPED_SAMPLE, TraceDir
from orchestrator.trainer import SimulatedTrainer, TokenCost, Trainer
from orchestrator.types import FinishReason, Group, Trajectory

REPO = Path(__file__).resolve().parents[3]
UNUSED_BY_REPLAY = ("model", "engine", "env", "algo", "trainer", "sandbox", "warmstart", "eval",
                    "rollout")


def composed(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def replay_config(*overrides: str) -> DictConfig:
    return composed("experiment=replay", f"trace={SHIPPED_SAMPLE}", "replay.groups_per_step=16",
                    "pipeline.num_steps=2", "progress=false", *overrides)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def layout(run_dir: Path) -> set[str]:
    """The run directory's files, less what only training has (checkpoints) and Hydra's log."""
    return {str(p.relative_to(run_dir)) for p in run_dir.rglob("*")
            if p.is_file() and p.parts[len(run_dir.parts)] != "checkpoints"}


def test_the_simulated_trainer_is_a_trainer() -> None:
    trainer = SimulatedTrainer(TokenCost(fixed_s=1.0, per_token_s=0.5))
    assert isinstance(trainer, Trainer)
    trajectory = Trajectory(prompt_id=0, sample_index=0, token_ids=(1, 2, 3, 4),
                            loss_mask=(True,) * 4, logprobs=(0.0,) * 4, versions=(0,) * 4,
                            reward=0.0, start_version=0, finish_reason=FinishReason.STOP)
    groups = [Group(prompt_id=0, trajectories=(trajectory,), start_version=0)]

    async def step() -> tuple[dict[str, float], int, float]:
        stats = await trainer.step(groups)
        update = await trainer.weights()
        assert update.released and not update.tensors()  # nothing to lease: no weights
        return stats, update.version, anyio.current_time()

    stats, version, now = run_virtual(step)
    assert stats == {"simulated_seconds": 3.0} and version == 1 and now == pytest.approx(3.0)
    restored = SimulatedTrainer(TokenCost(per_token_s=0.5))
    restored.load_state_dict(trainer.state_dict())
    assert restored.version == 1 and restored.busy == pytest.approx(3.0)


def test_experiment_replay_composes_only_what_it_uses() -> None:
    cfg = replay_config()
    for key in UNUSED_BY_REPLAY:
        assert OmegaConf.select(cfg, key) is None, key
    parts = replay_parts(cfg)
    assert isinstance(parts.trainer, SimulatedTrainer)
    assert parts.warm_start is None and not parts.eval_tasks and parts.checkpoint is None
    assert parts.anyio_backend == "trio" and parts.pipeline.batch_size == 16 * 8
    # a checkpoint's model swaps in for any experiment on the command line, replay included
    assert composed("experiment=replay", "model=hf", "model.path=/x").model.path == "/x"


def test_replay_writes_the_layout_of_a_training_run(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    training = composed("experiment=smoke", "logger=none", "progress=false", "model.device=cpu",
                        "warmstart.steps=0", "eval.num_tasks=0", "pipeline.num_steps=2")
    run(training, tmp_path / "train")
    with caplog.at_level(logging.INFO, logger="orchestrator.replay"):
        result = run(replay_config(), tmp_path / "replay")
    assert "rollout is 70% of a synchronous step" in caplog.text
    assert "replay: k=0 steps=2 samples=256" in caplog.text

    replayed = tmp_path / "replay"
    assert layout(replayed) == layout(tmp_path / "train")
    assert not (replayed / "checkpoints").exists()
    config = OmegaConf.load(replayed / "config.yaml")
    assert not {"model", "engine", "env", "trainer", "sandbox"} & set(config)
    assert config.replay.groups_per_step == 16

    train_keys = set(read_jsonl(tmp_path / "train" / "metrics.jsonl")[0])
    metrics = read_jsonl(replayed / "metrics.jsonl")
    steps, last = metrics[:-1], metrics[-1]
    assert [m["step"] for m in steps] == [0, 1]
    # the same step_metrics schema, less what belongs to the torch trainer (train/*, its
    # engine/logprob_diff check), the environment (reward/<part>) or a stage the replay may
    # not have waited in (time/<stage>)
    common = {k for k in train_keys
              if not k.startswith(("train/", "reward/", "time/", "engine/logprob_diff",
                                       # weights' attestation: a replay has no weights
                                       "attestation/", "faults/attestation"))}
    assert {"staleness/max", "policy/version", "episode/turns"} <= common
    for m in steps:
        assert common | {"reward/mean", "time/step", "time/generate", "time/train_step"} <= set(m)
        assert m["train/simulated_seconds"] > 0 and m["time/step"] > 10
    assert last["summary/virtual_seconds"] == pytest.approx(result.summary["virtual_seconds"])

    summary = json.loads((replayed / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["samples"] == 256 and summary["k"] == 0
    assert summary["virtual_seconds"] > 10 and 0 < summary["engine_idle_fraction"] < 1
    assert 0 < summary["trainer_wait_fraction"] < 1 and summary["trace"] == str(SHIPPED_SAMPLE)
    assert "70%" in summary["assumption"] and summary["eval_before"] is None

    stages = {span["stage"] for span in run_spans(replayed)}
    assert {"generate", "tool_call", "train_step", "weight_sync", "wait_batch"} <= stages
    timeline = json.loads((replayed / "timeline.json").read_text())
    assert any(e["name"] == "train_step" for e in timeline["traceEvents"])


@pytest.mark.parametrize("k", [0, 1])
def test_experiment_replay_trains_the_trace_at_bounded_staleness(tmp_path: Path, k: int) -> None:
    result = run(replay_config(f"pipeline.max_staleness={k}"), tmp_path)
    assert len(result.reports) == 2 and all(r.samples == 128 for r in result.reports)
    assert result.summary["k"] == k and result.summary["samples"] == 256
    trace = TraceDir.open(tmp_path)
    assert trace.steps() == [0, 1]
    records = list(trace.workload(1))
    assert len(records) == 128 and all(r.polyrl and r.polyrl.staleness <= k for r in records)
    # the replay's episodes have the recorded shapes: tool calls with their recorded sizes
    assert any(r.tool_calls and r.tool_calls[0].append_len > 0 for r in records)


def test_a_missing_trace_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such directory"):
        run(composed("experiment=replay", f"trace={tmp_path / 'none'}"), tmp_path / "run")
    with pytest.raises(ConfigError, match="holds no multiturn_workload"):
        run(composed("experiment=replay", f"trace={tmp_path}"), tmp_path / "run")


def test_settings_a_replay_derives_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pipeline.batch_size is set by the replay"):
        replay_parts(replay_config("pipeline.batch_size=64"))
    with pytest.raises(ConfigError, match="replay.rollout_share must be > 0 and < 1, got 1.5"):
        replay_parts(replay_config("replay.rollout_share=1.5"))
    with pytest.raises(ConfigError, match="replay.engine=.* is not an engine fit"):
        replay_parts(replay_config(f"replay.engine={tmp_path / 'missing.json'}"))


def test_the_shipped_fit_loads() -> None:
    fit = EngineFit.load()
    assert fit.trajectories_per_step == 2048 and fit.steps == (0, 1, 2)
    cost = fit.train_cost(0.7)  # 30% of a synchronous step spent training
    train_seconds = cost.per_token_s * fit.tokens_per_step
    assert train_seconds == pytest.approx(fit.makespan_s * 0.3 / 0.7)


def test_engines_holds_engines_only() -> None:
    """Replay's server model, fit and driver live in orchestrator/replay/ (which way the
    packages import is the import contracts' business: ``lint-imports``)."""
    engines = REPO / "orchestrator" / "engines"
    assert sorted(p.name for p in engines.glob("*.py")) == [
        "__init__.py", "base.py", "placement.py", "prefix_cache.py", "router.py", "rwlock.py",
        "sampling.py", "simulated.py", "slot_cache.py", "torch_engine.py", "torch_requests.py",
        "vllm_engine.py", "vllm_transfer.py", "vllm_worker.py"]


def test_the_fit_command_saves_a_fit_a_replay_loads(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from orchestrator.replay.__main__ import main
    from orchestrator.trace.__main__ import main as trace_main

    out = tmp_path / "fit.json"
    assert main(["fit", str(SHIPPED_SAMPLE), "--steps", "0", "--iterations", "2",
                 "-o", str(out)]) == 0
    fit = EngineFit.load(out)
    assert fit.steps == (0,) and fit.trajectories_per_step > 0 and fit.server.max_running >= 1
    assert "fitted steps [0]" in capsys.readouterr().out
    assert trace_main(["fit", str(SHIPPED_SAMPLE)]) == 2  # the command moved; one sentence says where
    assert "python -m orchestrator.replay fit" in capsys.readouterr().err
