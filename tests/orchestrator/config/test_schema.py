"""The typed schema (orchestrator/config/schema.py) is the one source of the plain sections: Hydra
composes its defaults, every shipped experiment's sections validate against it, every key
is documented, and a mistake is one line naming the key."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import forked
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from orchestrator.config import schema
from orchestrator.config.read import scalar, typed
from orchestrator.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
CONF = ROOT / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
ALL = {"": schema.RunSettings, **schema.SECTIONS, "replay": schema.ReplayConfig}


def composed(overrides: list[str]) -> Any:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides)


def test_every_key_has_a_type_a_default_and_a_meaning() -> None:
    for key, cls in {**ALL, "trace": schema.ReplaySettings}.items():
        for name, info in schema.fields(cls).items():
            assert info.annotation is not None, f"{key}.{name} has no type"
            assert not info.is_required(), f"{key}.{name} has no default"
            assert info.description and len(info.description) > 8, f"{key}.{name} is undocumented"


def test_the_composed_defaults_are_the_schemas() -> None:
    cfg = composed([])
    base = schema.defaults(schema.RunSettings)
    for name, value in base.items():
        if name not in ("torch_threads",):  # the default experiment sets it
            assert cfg[name] == value, name
    # conf/config.yaml itself restates none of them: a key there would be a second default
    own = OmegaConf.load(CONF / "config.yaml")
    assert not set(own) & ({*schema.SECTIONS, *base}), "conf/config.yaml restates a schema key"


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiments_sections_validate(experiment: str) -> None:
    cfg = composed([f"experiment={experiment}"])
    if experiment == "replay":
        typed(schema.ReplayConfig, cfg, "replay")
        assert scalar(cfg, "trace") is None
        return
    for key, cls in schema.SECTIONS.items():
        typed(cls, cfg, key)
    for name in schema.fields(schema.RunSettings):
        scalar(cfg, name)


@pytest.mark.parametrize(("override", "message"), [
    ("pipeline.batch_size=0", "pipeline.batch_size must be >= 1, got 0"),
    ("rollout.temperature=hot", "rollout.temperature=hot must be a number (>= 0)"),
    ("eval.engine=gpu", "eval.engine=gpu must be 'auto' or 'own' or 'shared'"),
    ("checkpoint.keep=0", "checkpoint.keep must be >= 1, got 0"),
    ("warmstart.target_accuracy=1.5", "warmstart.target_accuracy must be >= 0 and <= 1 or null, got 1.5"),
    ("torch_threads=0", "torch_threads must be >= 1 or null, got 0"),
    ("progress=maybe", "progress=maybe must be true or false"),
])
def test_a_mistake_is_one_line_naming_the_key(override: str, message: str) -> None:
    cfg = composed(["experiment=smoke", override])
    with pytest.raises(ConfigError) as info:
        for key, cls in schema.SECTIONS.items():
            typed(cls, cfg, key)
        for name in schema.fields(schema.RunSettings):
            scalar(cfg, name)
    assert str(info.value) == message


def test_the_command_line_prints_that_line_and_nothing_else() -> None:
    done = forked.run(
        [sys.executable, "-m", "orchestrator", "experiment=smoke", "logger=none",
         "pipeline.num_workers=-2", "hydra.run.dir=/tmp/polyrl-schema-test"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: pipeline.num_workers must be >= 1, got -2"


def test_a_section_built_in_code_is_checked_the_same_way() -> None:
    with pytest.raises(ConfigError, match=r"^rollout.max_tokens must be >= 1, got 0$"):
        schema.RolloutConfig(max_tokens=0)
    with pytest.raises(ConfigError, match=r"^eval.k=\[1, 8\] has k=8"):
        schema.EvalConfig(n=4, k=[1, 8])
    assert schema.EvalConfig(n=4, k=[4, 1, 4]).ks == (1, 4)
