"""``python -m orchestrator.eval … engine=vllm`` (the CPU build in .venv-vllm), as a user runs it:
a run's checkpoint (its weights loaded into vLLM) and its export (served as it is on disk)
give the greedy completions and figures the torch engine gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, quick_config

from orchestrator.eval import evaluate_target
from orchestrator.export import export
from orchestrator.main import run

pytest.importorskip("vllm", reason="vLLM is not installed here; scripts/test.sh runs these in .venv-vllm")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,  # about 55 s: two evaluations, a vLLM engine each; slow files start first (tests/conftest.py: schedule)
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

VLLM = ["engine=vllm", "engine.kv_cache_bytes=256MiB", "engine.enforce_eager=true",
        "progress=false"]


def completions(path: Path) -> list[tuple[int, str]]:
    return [(e["task_id"], e["completion"]) for e in json.loads(path.read_text())["examples"]]


def evaluate_with_vllm(target: Path, out: Path, *overrides: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    done = subprocess.run([sys.executable, "-m", "orchestrator.eval", str(target), *VLLM,
                           *overrides, "-o", str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_engine_vllm_evaluates_a_checkpoint_and_an_export_as_the_torch_engine(
        tmp_path: Path) -> None:
    # head size 32: vLLM's CPU attention rejects 16
    run(quick_config("smoke", "model.hidden_size=64", "model.num_heads=2", "checkpoint.every=1",
                     "warmstart.steps=12", "warmstart.lr=3e-3"), tmp_path / "run")
    torch_engine, _ = evaluate_target(tmp_path / "run", out=tmp_path / "torch.json")
    assert any(c.strip() for _, c in completions(tmp_path / "torch.json"))

    line = evaluate_with_vllm(tmp_path / "run", tmp_path / "vllm.json")
    assert line == f"eval_mean={torch_engine.evaluation.mean:.4f} " \
                   f"pass_at_1={torch_engine.evaluation.overall.pass_at[1]:.4f}"
    assert completions(tmp_path / "vllm.json") == completions(tmp_path / "torch.json")

    hf = export(tmp_path / "run", tmp_path / "hf")
    evaluate_with_vllm(hf, tmp_path / "hf.json", "experiment=smoke", "model.dtype=float32",
                       "env.train_size=32", "env.eval_size=4", "eval.num_tasks=4")
    assert completions(tmp_path / "hf.json") == completions(tmp_path / "torch.json")
