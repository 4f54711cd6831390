"""Agent programs trained unchanged through `env=agent`, with real clients: the openai SDK
(async and sync from a worker thread, with tools), the OpenAI Agents SDK's Runner, and a
verifiers environment. A tiny model on a toy objective (the share of digits in its replies)
must improve within a few steps: the gateway's tokens, log-probs and versions are right
enough to learn from, through the full run (Hydra config, torch engine and trainer, run
directory)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from orchestrator.builders import run

REPO = Path(__file__).resolve().parents[3]


def agent_overrides(program: str, *overrides: str) -> list[str]:
    """The command line of a toy agent run: a tiny model, short replies, 16 steps."""
    return ["env=agent", f"env.program={program}", "logger=none", "progress=false",
            "model.device=cpu", "model.hidden_size=32", "model.num_layers=1",
            "model.intermediate_size=64", "model.max_position_embeddings=1024",
            "warmstart.steps=0", "eval.num_tasks=8", "torch_threads=1",
            "pipeline.batch_size=32", "pipeline.num_workers=4", "pipeline.num_steps=16",
            "rollout.group_size=8", "rollout.max_tokens=8", "rollout.temperature=1.0",
            "trainer.lr=2e-2", *overrides]


def agent_config(program: str, *overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=agent_overrides(program, *overrides))


def assert_learns(program: str, tmp_path: Path, *overrides: str) -> dict:
    result = run(agent_config(program, *overrides), tmp_path)
    s = result.summary
    rewards = [r.reward_mean for r in result.reports]
    print(program, [round(r, 3) for r in rewards], s["eval_before"], s["eval_after"])
    assert s["steps"] == 16
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.05, rewards
    metrics = result.reports[-1].metrics
    assert metrics["agent/episodes"] >= 16 * 32
    # a tiny model may make the Agents SDK's Runner give up (MaxTurnsExceeded): rarely
    assert metrics.get("agent/errors", 0) <= 0.05 * metrics["agent/episodes"]
    assert (tmp_path / "metrics.jsonl").exists()
    return metrics


@pytest.mark.slow
@pytest.mark.parametrize("program", ["toy_agents:calculator", "toy_agents:calculator_sync",
                                     "toy_agents:agents_sdk", "toy_verifiers:run"])
def test_an_agent_program_learns_unchanged(program: str, tmp_path: Path) -> None:
    """The openai SDK's tool loop (async; sync in a worker thread), an Agents SDK Runner, and
    a verifiers environment (its rollout, interception server and rubric)."""
    assert_learns(program, tmp_path)
    if program.startswith("toy_verifiers"):  # verifiers' own reward, by name, in the records
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert all(0 <= r["reward/digits"] <= 1 for r in records if "reward/mean" in r)
