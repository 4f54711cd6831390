"""Every ``conf/algo`` preset composes from the real config and trains ``experiment=smoke``
(shrunk to seconds) end to end; each logs what its own pieces log, and takes its paper's or
recipe's update schedule (``trainer.num_minibatches``)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
from helpers import REPO, quick_config
from hydra import compose, initialize_config_dir

from orchestrator.builders import run
from orchestrator.errors import ConfigError

# a metric only the preset's own pieces log
OWN_METRIC = {
    "grpo": "truncated_fraction",
    "dr_grpo": "clip_fraction",
    "gspo": "sequence_clip_fraction",
    "cispo": "clip_fraction",
    "rloo": "clip_fraction",
    "reinforce_pp": "kl_penalty",
    "stale": "m2po_masked_fraction",
}


# optimiser updates per batch, each with the source its YAML names
SCHEDULE = {
    "grpo": 1,  # DeepSeekMath sec. 4.2: a single update per exploration stage
    "dr_grpo": 1,  # GRPO's
    "dapo": 16,  # DAPO sec. 4.1: 16 gradient updates per rollout step
    "gspo": 4,  # GSPO sec. 5.1: four mini-batches per rollout batch
    "cispo": 2,  # verl's CISPO recipe: 256 samples in mini-batches of 128
    "rloo": 1,  # REINFORCE
    "reinforce_pp": 1,  # verl's REINFORCE++-baseline recipe: the mini-batch is the batch
    "stale": 1,  # GRPO's
}


def test_every_preset_is_tested() -> None:
    presets = {p.stem for p in (REPO / "conf" / "algo").glob("*.yaml")}
    assert presets - {"dapo"} == set(OWN_METRIC)
    assert presets == set(SCHEDULE)


def composed(*overrides: str) -> int:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides)).trainer.num_minibatches


@pytest.mark.parametrize("name", sorted(SCHEDULE))
def test_a_preset_takes_its_schedule_and_the_command_line_wins(name: str) -> None:
    assert composed(f"algo={name}") == SCHEDULE[name]
    assert composed(f"algo={name}", "trainer.num_minibatches=1") == 1
    assert composed(f"algo={name}", "experiment=rg_smol", "trainer.num_minibatches=3") == 3
    assert composed(f"algo={name}", "algo/updates=minibatches_4") == 4


def test_the_default_config_keeps_one_update() -> None:
    assert composed() == 1


def cannot_act_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "cannot act" in r.getMessage()]


def test_a_loss_that_cannot_act_says_so_in_one_line_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        run(quick_config("smoke", "algo=cispo", "trainer.num_minibatches=1"), tmp_path / "one")
    lines = cannot_act_lines(caplog)
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith("algo.loss=CISPO cannot act")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="orchestrator"):  # its own schedule: it acts
        run(quick_config("smoke", "algo=cispo"), tmp_path / "two")
        run(quick_config("smoke", "algo=grpo"), tmp_path / "grpo")  # one update is GRPO's own
    assert cannot_act_lines(caplog) == []


@pytest.mark.parametrize("name", sorted(OWN_METRIC))
def test_a_preset_trains_the_smoke_experiment(tmp_path: Path, name: str) -> None:
    result = run(quick_config("smoke", f"algo={name}"), tmp_path)
    assert [r.version for r in result.reports] == [0, 1]
    for report in result.reports:
        assert OWN_METRIC[name] in report.metrics, sorted(report.metrics)
        assert all(math.isfinite(v) for v in report.metrics.values())


@pytest.mark.parametrize(("override", "named"), [
    ("algo.loss.eps_high=-1", "algo.loss.eps_low and algo.loss.eps_high must be >= 0"),
    ("algo.mode=bypassed", "algo.mode"),
    ("algo.aggregation=token_sum", "algo.aggregation"),
    ("+algo.loss.clip=0.2", "algo.loss"),
    ("algo=gspo algo.aggregation=token_mean", "algo.aggregation=sequence_mean"),
    ("algo.aggregation_constant=16", "algo.aggregation_constant=16 applies to algo"),
])
def test_a_bad_algo_setting_is_one_line_naming_it(tmp_path: Path, override: str,
                                                  named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")) as caught:
        run(quick_config("smoke", *override.split()), tmp_path)
    assert "\n" not in str(caught.value)
