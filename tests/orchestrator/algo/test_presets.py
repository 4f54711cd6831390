"""Every ``conf/algo`` preset composes from the real config and trains ``experiment=smoke``
(shrunk to seconds) end to end; each logs what its own pieces log."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers import REPO, quick_config

from orchestrator.errors import ConfigError
from orchestrator.main import run

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


def test_every_preset_is_tested() -> None:
    presets = {p.stem for p in (REPO / "conf" / "algo").glob("*.yaml")}
    assert presets - {"dapo"} == set(OWN_METRIC)


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
])
def test_a_bad_algo_setting_is_one_line_naming_it(tmp_path: Path, override: str,
                                                  named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")) as caught:
        run(quick_config("smoke", override), tmp_path)
    assert "\n" not in str(caught.value)
