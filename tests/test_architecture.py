"""The import contracts in pyproject.toml hold, and they bite: a wrong-way import in a copy of
the packages makes ``lint-imports`` fail (ARCHITECTURE.md, "Dependency rule")."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "orchestrator", "envs", "sandboxes")
LINT = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"],
                          check=False,
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "data"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_contracts_hold(copy: Path) -> None:
    result = lint(copy)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "broken" not in result.stdout.split("Contracts:")[-1].lower().replace("0 broken", "")


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("sandboxes/api.py", "import envs.base", "bench -> orchestrator -> envs -> sandboxes"),
    ("envs/base.py", "import orchestrator.types", "bench -> orchestrator -> envs -> sandboxes"),
    ("orchestrator/engines/base.py", "import orchestrator.pipeline", "Inside orchestrator"),
    ("orchestrator/trace/writer.py", "import orchestrator.builders", "Inside orchestrator"),
    ("sandboxes/local.py", "import sandboxes.docker.pool", "independent"),
])
def test_a_wrong_way_import_breaks_a_contract(copy: Path, module: str, line: str, contract: str) -> None:
    path = copy / module
    path.write_text(path.read_text() + f"\n{line}  # a wrong-way import\n")
    result = lint(copy)
    assert result.returncode != 0
    assert contract in result.stdout and "BROKEN" in result.stdout
