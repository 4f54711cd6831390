"""Every config group option composes and instantiates (conf/, orchestrator/config/read.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import anyio
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from envs.base import EnvSpec
from orchestrator.algo.base import Algorithm
from orchestrator.algo.build import build_algorithm
from orchestrator.builders import check_sizes
from orchestrator.config.read import build_env, explain, section, typed
from orchestrator.config.schema import PipelineConfig, RolloutConfig, WarmStartConfig
from orchestrator.engines.base import InferenceEngine
from orchestrator.errors import ConfigError
from orchestrator.launch import EngineRecipe
from orchestrator.loggers.base import Logger
from orchestrator.models.policy import Policy
from orchestrator.trainer import Trainer
from orchestrator.weights.update import WeightUpdate

CONF = Path(__file__).resolve().parents[3] / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
# a small, CPU-only policy so instantiating the rest stays cheap
SMALL_MODEL = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
               "model.intermediate_size=64", "model.device=cpu"]


def composed(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides)


def test_the_groups_design_md_names_exist() -> None:
    assert {"model", "engine", "env", "algo", "trainer", "logger", "experiment"} <= set(GROUPS)
    assert ("model", "hf") in OPTIONS and ("logger", "none") in OPTIONS


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_group_option_composes_and_instantiates(group: str, option: str,
                                                      tmp_path: Path) -> None:
    overrides = [f"{group}={option}"]
    if (group, option) == ("experiment", "replay"):
        cfg = composed(overrides)  # composes only what a replay uses, and builds from it
        for unused in ("model", "engine", "env", "algo", "trainer", "sandbox", "warmstart"):
            assert OmegaConf.select(cfg, unused) is None, unused
        from orchestrator.replay import replay_parts

        parts = replay_parts(cfg)
        assert parts.anyio_backend == "trio" and parts.warm_start is None
        return
    if (group, option) == ("model", "hf"):
        overrides += ["model.path=/nonexistent"]
    if (group, option) == ("env", "dataset"):  # env.train has no default: a file of 64 rows
        (tmp_path / "train.jsonl").write_text(
            "".join(f'{{"question": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(64)))
        overrides += [f"env.train={tmp_path / 'train.jsonl'}"]
    if (group, option) == ("env", "agent"):  # env.program has no default: bench.gateway's
        overrides += ["env.program=bench.gateway:agent", "env.tasks=bench.gateway:noop_tasks"]
    if group != "model" and (group, option) not in {("experiment", "rg_smol"),
                                                    ("experiment", "dataset_smol")}:  # the real model
        overrides += SMALL_MODEL
    cfg = composed(overrides)
    if group != "experiment":  # experiments are overlays on the global package
        assert OmegaConf.select(cfg, group) is not None
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # nothing left unset

    pipeline = typed(PipelineConfig, cfg, "pipeline")
    rollout = typed(RolloutConfig, cfg, "rollout")
    typed(WarmStartConfig, cfg, "warmstart")
    spec = build_env(cfg)
    assert isinstance(spec, EnvSpec)
    check_sizes(pipeline, rollout, spec)

    algorithm = build_algorithm(section(cfg, "algo"))
    assert isinstance(algorithm, Algorithm)
    logger = instantiate(cfg.logger)
    assert isinstance(logger, Logger)

    if (group, option) == ("model", "hf"):
        with pytest.raises(InstantiationException) as info:
            instantiate(cfg.model)
        assert isinstance(info.value.__cause__, ConfigError)
        assert "model.path=/nonexistent" in str(info.value.__cause__)
        assert explain(info.value) == str(info.value.__cause__)
        return
    policy = instantiate(cfg.model)
    assert isinstance(policy, Policy)
    trainer = instantiate(cfg.trainer, policy=policy, algorithm=algorithm,
                          temperature=rollout.temperature)
    assert isinstance(trainer, Trainer)
    recipe = EngineRecipe(engine=OmegaConf.to_container(cfg.engine, resolve=True),
                          model=OmegaConf.to_container(cfg.model, resolve=True))
    if (group, option) == ("engine", "vllm") and importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match="engine=vllm needs vLLM"):  # its tests: .venv-vllm
            recipe.build(WeightUpdate.of_module(0, policy.model))
        return
    engine = recipe.build(WeightUpdate.of_module(0, policy.model))
    assert isinstance(engine, InferenceEngine) and engine.version == 0

    async def start_and_stop() -> None:
        async with engine:
            pass

    anyio.run(start_and_stop)


@pytest.mark.parametrize("experiment", [o for g, o in OPTIONS if g == "experiment"])
def test_experiments_combine_with_a_local_checkpoint(experiment: str) -> None:
    """``model=hf`` swaps in for any experiment: the experiment must not pin tiny-model keys
    that the checkpoint loader does not take."""
    cfg = composed([f"experiment={experiment}", "model=hf", "model.path=/nonexistent"])
    with pytest.raises(InstantiationException) as info:
        instantiate(cfg.model)
    assert isinstance(info.value.__cause__, ConfigError), explain(info.value)


def test_experiment_overlays_apply() -> None:
    cfg = composed(["experiment=smoke"])
    assert cfg.pipeline.num_steps == 4 and cfg.rollout.group_size == 4
    assert cfg.model._target_.endswith("tiny_policy")
    cfg = composed(["experiment=smoke", "pipeline.max_staleness=3"])
    assert cfg.pipeline.max_staleness == 3


def test_seed_is_shared_by_the_groups() -> None:
    cfg = composed(["seed=7"])
    assert cfg.model.seed == 7 and cfg.env.seed == 7 and cfg.engine.seed == 7


# -- typed sections ----------------------------------------------------------------------------


def _cfg(section: dict[str, Any]) -> DictConfig:
    return OmegaConf.create({"pipeline": section})


def test_typed_builds_the_dataclass() -> None:
    p = typed(PipelineConfig, _cfg({"batch_size": 8, "max_staleness": 0,
                                    "inflight_update": "finish"}), "pipeline")
    assert p == PipelineConfig(batch_size=8, max_staleness=0, inflight_update="finish")


@pytest.mark.parametrize(("section", "words"), [
    ({"batch_sise": 8}, ["pipeline.batch_sise", "batch_size"]),
    ({"batch_size": "8"}, ["pipeline.batch_size=8", "whole number"]),
    ({"batch_size": 8.5}, ["pipeline.batch_size=8.5", "whole number"]),
    ({"batch_size": True}, ["pipeline.batch_size=True"]),
    ({"inflight_update": "later"}, ["pipeline.inflight_update=later", "'continue'", "'finish'"]),
])
def test_typed_rejects_bad_values_in_one_sentence(section: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        typed(PipelineConfig, _cfg(section), "pipeline")
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_typed_accepts_ints_for_floats() -> None:
    cfg = OmegaConf.create({"rollout": {"temperature": 1}})
    assert typed(RolloutConfig, cfg, "rollout").temperature == 1.0


def test_a_missing_section_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="pipeline"):
        typed(PipelineConfig, OmegaConf.create({}), "pipeline")


@pytest.mark.parametrize(("env", "words"), [
    ({"digits": 2}, ["env._target_"]),
    ({"_target_": "envs.nope.NopeSpec"}, ["envs.nope.NopeSpec"]),
    ({"_target_": "envs.arithmetic.ArithmeticSpec", "colour": "red"}, ["env.colour"]),
    ({"_target_": "envs.arithmetic.ArithmeticSpec", "digits": 1, "train_size": 100,
      "eval_size": 1}, ["train_size"]),
    ({"_target_": "orchestrator.trace.recorder.Recorder"}, ["not an environment"]),
])
def test_build_env_errors_are_config_errors(env: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        build_env(OmegaConf.create({"env": env}))
    for word in words:
        assert word in str(info.value)


def test_check_sizes_rejects_a_batch_larger_than_the_dataset() -> None:
    spec = build_env(OmegaConf.create({"env": {"_target_": "envs.arithmetic.ArithmeticSpec",
                                               "train_size": 2,
                                               "eval_size": 2}}))
    with pytest.raises(ConfigError, match="pipeline.batch_size=16"):
        check_sizes(PipelineConfig(batch_size=16), RolloutConfig(group_size=4), spec)
    check_sizes(PipelineConfig(batch_size=8), RolloutConfig(group_size=4), spec)
