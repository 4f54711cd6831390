"""Every ``conf/algo`` preset composes from the real config and trains ``experiment=smoke``
(shrunk to seconds) end to end; each logs what its own pieces log (its loss's metric read from
the losses' registry), and takes the update schedule (``trainer.num_minibatches``) its YAML
states with its source. A new preset (a new loss's YAML) needs no edit here."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
from helpers import REPO, quick_config
from hydra import compose, initialize_config_dir
from hydra.utils import get_class

from orchestrator.algo.losses import LOSSES
from orchestrator.builders import run
from orchestrator.errors import ConfigError

PRESETS = sorted(p.stem for p in (REPO / "conf" / "algo").glob("*.yaml"))
# what a preset's pieces other than its loss log, where they log something of their own
OTHER_PIECES = {"grpo": "truncated_fraction", "reinforce_pp": "kl_penalty",
                "stale": "m2po_masked_fraction"}
NOT_SMOKE_RUN = {"dapo"}  # its dynamic sampling refills groups: not in a 2-step smoke run


def composed_algo(*overrides: str) -> tuple[int, str]:
    """``trainer.num_minibatches`` and ``algo.loss._target_`` as the config composes them."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return cfg.trainer.num_minibatches, cfg.algo.loss._target_


def composed(*overrides: str) -> int:
    return composed_algo(*overrides)[0]


def own_metrics(name: str) -> list[str]:
    """What a run of preset ``name`` logs every step: its loss's own metric (from the losses'
    registry) and its other pieces' (:data:`OTHER_PIECES`)."""
    loss = get_class(composed_algo(f"algo={name}")[1])
    assert loss in LOSSES.values(), f"{loss.__name__} is not a registered loss (policy_loss)"
    return [loss.card.own, *([OTHER_PIECES[name]] if name in OTHER_PIECES else [])]


def stated_schedule(name: str) -> tuple[int, str] | None:
    """The updates a preset's YAML states (``updates: minibatches_N``) and the comment that
    names its source, or None where it inherits its parent's."""
    lines = (REPO / "conf" / "algo" / f"{name}.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if "updates: minibatches_" in line:
            number = int(line.split("minibatches_")[1].split()[0])
            comment = " ".join(text.split("#", 1)[1] for text in lines[i:i + 4] if "#" in text)
            return number, comment
    return None


def test_every_preset_states_its_schedule_with_a_source() -> None:
    """A preset's YAML states its updates per batch (or inherits them from its parent, GRPO's)
    and names where they come from: a paper's section or a recipe."""
    for name in PRESETS:
        stated = stated_schedule(name) or stated_schedule("grpo")
        assert stated is not None, name
        number, source = stated
        assert composed(f"algo={name}") == number, name
        assert "trainer.num_minibatches" in source and len(source.split()) >= 6, (name, source)


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_takes_its_schedule_and_the_command_line_wins(name: str) -> None:
    assert composed(f"algo={name}") == (stated_schedule(name) or stated_schedule("grpo"))[0]
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


@pytest.mark.parametrize("name", [p for p in PRESETS if p not in NOT_SMOKE_RUN])
def test_a_preset_trains_the_smoke_experiment(tmp_path: Path, name: str) -> None:
    result = run(quick_config("smoke", f"algo={name}"), tmp_path)
    assert [r.version for r in result.reports] == [0, 1]
    for report in result.reports:
        assert set(own_metrics(name)) <= set(report.metrics), sorted(report.metrics)
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
