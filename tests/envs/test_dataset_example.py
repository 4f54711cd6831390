"""The offline example that learns from a file (``experiment=dataset_smol``): the shipped
Parquet files exist, are what their generator writes, load under ``env=dataset`` and score
with ``env.reward=math``, and the experiment composes with the real conf (envs/data/,
conf/experiment/dataset_smol.yaml). The learning run itself is minutes on the real model:
docs/environments.md records it."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

pd = pytest.importorskip("pandas", reason="the data extra (scripts/setup.sh installs it)")
from helpers import REPO
from hydra import compose, initialize_config_dir

from envs.data import make_arith
from envs.dataset import DatasetSpec, DatasetTask
from envs.reward_builtins import math_reward
from orchestrator.builders import check_sizes
from orchestrator.config.read import build_env, typed
from orchestrator.config.schema import PipelineConfig, RolloutConfig

DATA = REPO / "envs" / "data"
FILES = {"train": DATA / "arith_train.parquet", "eval": DATA / "arith_eval.parquet"}
BOXED = "Put your final answer in \\boxed{}."


def test_the_shipped_files_are_verl_rows_the_generator_writes(tmp_path: Path) -> None:
    written = make_arith.write(tmp_path)  # the generator's defaults made the shipped files
    for split, path in FILES.items():
        shipped = pd.read_parquet(path)
        assert list(shipped.columns) == ["data_source", "prompt", "ability", "reward_model",
                                         "extra_info"]
        pd.testing.assert_frame_equal(shipped, pd.read_parquet(written[split]))
        assert path.stat().st_size < 50_000
    assert len(pd.read_parquet(FILES["train"])) == 224
    assert len(pd.read_parquet(FILES["eval"])) == 100


def test_rows_parse_and_ground_truths_verify_against_themselves() -> None:
    spec = DatasetSpec(train=str(FILES["train"]), eval=str(FILES["eval"]), instruction=BOXED)
    assert spec.duplicates == 0  # no question in both splits
    kinds = set()
    for split, size in (("train", 224), ("eval", 100)):
        tasks = spec.tasks(split)
        assert len(tasks) == size
        for task in tasks:
            assert isinstance(task, DatasetTask)
            (message,) = task.messages
            assert message["role"] == "user" and message["content"].startswith("What is $")
            assert message["content"].endswith(BOXED)
            kind = task.metadata["extra_info"]["kind"]
            kinds.add(kind)
            assert task.source == f"arith_{kind}" and task.metadata["ability"] == "math"
            assert math_reward(f"So the answer is \\boxed{{{task.answer}}}.", task.answer, {}) == 1.0
            assert math_reward("\\boxed{100}", task.answer, {}) == 0.0
    assert kinds == set(make_arith.KINDS)
    answers = {t.answer for t in spec.tasks("train")} | {t.answer for t in spec.tasks("eval")}
    assert "\\frac{7}{2}" in answers and any(a.startswith("-") for a in answers)
    # equivalent forms count: a decimal for a fraction, the last number of a plain reply
    assert math_reward("$7 \\div 2 = 3.5$", "\\frac{7}{2}", {}) == 1.0
    assert math_reward("$3 - 8 = -5$", "-5", {}) == 1.0
    assert math_reward("To solve this problem, we need to find", "-5", {}) == 0.0


def test_the_experiment_composes_and_scores_in_its_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the experiment's paths are relative to the repository root
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=dataset_smol", "logger=none"])
    assert cfg.model.gguf == "smollm2" and cfg.warmstart.steps == 0
    assert cfg.env.reward == "math" and cfg.env.instruction == BOXED
    spec = build_env(cfg)
    assert isinstance(spec, DatasetSpec)
    check_sizes(typed(PipelineConfig, cfg, "pipeline"), typed(RolloutConfig, cfg, "rollout"), spec)
    assert cfg.eval.num_tasks == len(spec.tasks("eval"))

    async def rewards() -> list[float]:
        task = next(t for t in spec.tasks("eval") if t.answer.startswith("\\frac"))
        replies = [f"$\\boxed{{{task.answer}}}$", "The answer is $0$.", "no answer here"]
        async with spec.running():
            scores = []
            for reply in replies:
                env = spec.make_env()
                await env.reset(task)
                await env.step(reply)
                scores.append((await env.reward()).total)
            assert spec.metrics()["reward/errors"] == spec.metrics()["reward/timeouts"] == 0
            return scores

    assert anyio.run(rewards) == [1.0, 0.0, 0.0]
