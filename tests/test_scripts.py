"""``scripts/test_gpu.sh`` on a machine without an NVIDIA GPU (every CI machine): one line, exit
status 0, nothing set up or written. (On a GPU it runs the GPU checks: docs/gpu.md.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NO_GPU = "test_gpu: no NVIDIA GPU on this machine (nvidia-smi finds none): nothing to run\n"


def run_test_gpu(path: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(REPO / "scripts" / "test_gpu.sh")], check=False,
                          env={"PATH": path, "TEST_GPU_OUT": str(out)}, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.skipif(shutil.which("nvidia-smi", path="/usr/bin:/bin") is not None,
                    reason="this machine has nvidia-smi")
def test_without_nvidia_smi_it_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    done = run_test_gpu("/usr/bin:/bin", tmp_path / "out")
    assert (done.returncode, done.stdout, done.stderr) == (0, NO_GPU, "")
    assert not (tmp_path / "out").exists()


def test_an_nvidia_smi_that_finds_no_gpu_is_no_gpu(tmp_path: Path) -> None:
    """The tools installed but no device or driver: ``nvidia-smi -L`` fails."""
    tools = tmp_path / "bin"
    tools.mkdir()
    fake = tools / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed: no driver' >&2\nexit 9\n")
    fake.chmod(0o755)
    done = run_test_gpu(f"{tools}:/usr/bin:/bin", tmp_path / "out")
    assert (done.returncode, done.stdout) == (0, NO_GPU)
    assert not (tmp_path / "out").exists()
