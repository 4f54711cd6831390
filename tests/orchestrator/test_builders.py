"""End to end: ``run(cfg)`` in process and ``python -m orchestrator experiment=smoke`` as a user
runs it, with everything a run leaves in its directory (orchestrator/builders.py, checkpoint.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import forked
import pytest
import torch
from helpers import run_spans
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from orchestrator.algo.grpo import GRPO
from orchestrator.builders import run
from orchestrator.models.policy import tiny_policy
from orchestrator.trainer import TorchTrainer

REPO = Path(__file__).resolve().parents[2]
STAGES = {"generate", "reward", "train_step", "weight_sync", "wait_batch", "wait_admission"}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_run_dir(run_dir: Path, num_steps: int) -> None:
    config = OmegaConf.load(run_dir / "config.yaml")
    assert config.pipeline.num_steps == num_steps

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert len(metrics) == num_steps + 1
    steps, summary = metrics[:-1], metrics[-1]
    assert [m["step"] for m in steps] == list(range(num_steps))
    for m in steps:
        for key in ("reward/mean", "staleness/max", "train/loss", "policy/version", "time/step"):
            assert key in m, key
    assert summary["summary/steps"] == num_steps

    samples = read_jsonl(run_dir / "samples.jsonl")
    assert {s["step"] for s in samples} == set(range(num_steps))
    assert all(s["text"] and 0.0 <= s["reward"] <= 1.0 for s in samples)

    stages = {span["stage"] for span in run_spans(run_dir)}
    assert STAGES <= stages, STAGES - stages

    assert list((run_dir / "checkpoints" / "final" / "model").glob("*.safetensors"))
    assert (run_dir / "checkpoints" / "final" / "trainer.pt").is_file()

    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == num_steps
    assert 0.0 <= s["reward_last_10pct"] <= 1.0
    assert s["samples_per_s"] > 0
    assert s["peak_rss_mb"] > 100  # the run's own high-water mark: torch alone is more


def smoke_config(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=["experiment=smoke", "logger=none", "progress=false",
                                            "model.device=cpu", *overrides])


@pytest.mark.parametrize("overrides", [
    (),
    ("pipeline.max_staleness=0",),
    ("pipeline.max_staleness=2", "pipeline.inflight_update=finish"),
], ids=["k1-continue", "k0", "k2-finish"])
def test_run_in_process(tmp_path: Path, overrides: tuple[str, ...]) -> None:
    cfg = smoke_config(*overrides)
    result = run(cfg, tmp_path)
    k = cfg.pipeline.max_staleness
    assert len(result.reports) == cfg.pipeline.num_steps == 4
    assert [r.version for r in result.reports] == [0, 1, 2, 3]
    for report in result.reports:
        assert report.samples == cfg.pipeline.batch_size
        assert all(0 <= s <= k for s in report.staleness)
        assert report.metrics["ratio"] == pytest.approx(1.0, abs=1e-6)
    assert result.eval_before is not None and result.eval_after is not None
    assert result.summary["steps"] == 4
    check_run_dir(tmp_path, 4)


def test_the_final_checkpoint_loads_back(tmp_path: Path) -> None:
    cfg = smoke_config()
    run(cfg, tmp_path)
    model = cfg.model
    policy = tiny_policy(hidden_size=model.hidden_size, num_layers=model.num_layers,
                         num_heads=model.num_heads, intermediate_size=model.intermediate_size,
                         max_position_embeddings=model.max_position_embeddings, seed=99,
                         device="cpu")
    trainer = TorchTrainer(policy, GRPO())
    final = tmp_path / "checkpoints" / "final"
    trainer.load(final)
    assert trainer.version == 4
    # the run's end wrote step-4 and links its trainer files as final: one snapshot, one copy
    last = tmp_path / "checkpoints" / "step-4"
    for name in ("trainer.pt", "model/model.safetensors"):
        assert os.stat(final / name).st_ino == os.stat(last / name).st_ino, name
    assert not (final / "run_state.json").exists() and (last / "run_state.json").is_file()
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "checkpoints" / "final" / "model" / "model.safetensors"))
    state = policy.model.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.slow  # left out of scripts/test.sh --quick
def test_smoke_from_the_command_line_with_offline_wandb(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("WANDB_API_KEY", "WANDB_MODE") and not k.startswith("HYDRA_")}
    run_dir = tmp_path / "run"
    result = forked.run(
        [sys.executable, "-m", "orchestrator", "experiment=smoke", "logger=wandb",
         "logger.mode=offline", "progress=false", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert f"run_dir={run_dir}" in result.stdout and "steps=4" in result.stdout
    check_run_dir(run_dir, 4)
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and offline[0].is_dir()
    records = list(offline[0].glob("*.wandb"))
    assert records and records[0].stat().st_size > 0


def test_one_engine_serves_the_warm_start_checks_the_evals_and_rl(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine is built once per run, from config and a WeightUpdate (never a policy), and
    the warm start's greedy checks load the trainer's weights into that same engine."""
    from orchestrator.engines.torch_engine import TorchEngine
    from orchestrator.weights.update import WeightUpdate

    built: list[tuple[dict, WeightUpdate | None]] = []
    loads: list[int] = []
    original_init, original_load = TorchEngine.__init__, TorchEngine._load

    def init(self: TorchEngine, model: dict, weights: WeightUpdate | None = None, **kw: object) -> None:
        built.append((model, weights))
        original_init(self, model, weights, **kw)  # type: ignore[arg-type]

    def load(self: TorchEngine, update: WeightUpdate) -> None:
        loads.append(update.version)
        original_load(self, update)

    monkeypatch.setattr(TorchEngine, "__init__", init)
    monkeypatch.setattr(TorchEngine, "_load", load)
    cfg = smoke_config("warmstart.steps=4", "warmstart.check_every=1",
                       "warmstart.target_accuracy=1.0")
    result = run(cfg, tmp_path)
    assert result.warm_start_steps == 4
    assert len(built) == 1
    model, weights = built[0]
    assert model["_target_"] == cfg.model._target_ and isinstance(weights, WeightUpdate)
    # the starting weights, four greedy checks, the warm-started weights, then one per RL step
    assert loads == [0] * 6 + [1, 2, 3, 4]
    syncs = [s for s in run_spans(tmp_path) if s["stage"] == "weight_sync"]
    assert len(syncs) == 4
    for span in syncs:
        assert span["attributes"]["transport"] == "reference"
        assert span["attributes"]["bytes"] > 0 and span["attributes"]["load_seconds"] >= 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto shares the engine on a GPU")
@pytest.mark.parametrize(("engine", "own"), [("torch", True), ("vllm", False)])
def test_eval_engine_auto_copies_an_engine_that_says_a_copy_is_cheap(engine: str,
                                                                     own: bool) -> None:
    # the engine class's capability (cheap_copy_on_cpu), not its name, decides
    from helpers import quick_config

    from orchestrator.builders import eval_on_own_engine
    from orchestrator.config.run import run_config
    from orchestrator.launch.local import LocalLauncher

    cfg = quick_config("smoke", f"engine={engine}", "eval.engine=auto")
    assert eval_on_own_engine(run_config(cfg), LocalLauncher()) is own
