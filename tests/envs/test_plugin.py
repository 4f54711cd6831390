"""A third-party environment package (tests/plugins/polyrl_example_env) is found through its
``polyrl.envs`` entry point with no edit to this project, and trains from the command line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import forked
import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "tests" / "plugins" / "polyrl_example_env"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plug-in installed (with its entry-point metadata) into a directory of its own."""
    target = tmp_path_factory.mktemp("plugin-site")
    source = tmp_path_factory.mktemp("plugin-src") / PLUGIN.name
    shutil.copytree(PLUGIN, source)  # the build writes next to the sources: not into the repo
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(source)],
        check=True, capture_output=True, text=True, timeout=240,
    )
    return target


@pytest.mark.slow  # left out of scripts/test.sh --quick
def test_the_plugin_trains_one_step_as_env_reverse(site: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    run_dir = tmp_path / "run"
    result = forked.run(
        [sys.executable, "-m", "orchestrator", "experiment=smoke", "env=reverse", "env.length=4",
         "pipeline.num_steps=1", "logger=none", "progress=false", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    config = (run_dir / "config.yaml").read_text()
    assert "polyrl_example_env.ReverseSpec" in config and "length: 4" in config
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1


def test_without_the_plugin_the_name_is_unknown(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    result = forked.run(
        [sys.executable, "-m", "orchestrator", "env=reverse", "logger=none",
         f"hydra.run.dir={tmp_path}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: unknown env 'reverse'; available: agent, arithmetic, code, code_tool, dataset, reasoning_gym, search_qa"]
