"""Run a benchmark as a user would, at its smoke size, and read its headline."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import forked

REPO = Path(__file__).resolve().parents[2]
HEADLINE = re.compile(r"^([a-z][a-z0-9_]*)=(\S+)$")


def start_bench(name: str, *args: str, python: str = sys.executable, timeout: float = 240,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m bench.<name> --smoke *args`` as a user runs it (the test's Hydra and W&B
    variables left out, ``env`` added), whatever its exit status."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    return forked.run([python, "-m", f"bench.{name}", "--smoke", *args], cwd=REPO,
                      env={**base, **(env or {})}, capture_output=True, text=True,
                      timeout=timeout, check=False)


def run_bench(name: str, *args: str, python: str = sys.executable, timeout: float = 240,
              expect: str | None = None) -> tuple[str, float, str]:
    """``python -m bench.<name> --smoke *args``; asserts it exits 0 and that its last line is a
    ``name=value`` headline with a finite value (named ``expect`` when given). Returns the
    name, the value and the whole stdout."""
    done = start_bench(name, *args, python=python, timeout=timeout)
    assert done.returncode == 0, f"bench.{name} --smoke exited {done.returncode}:\n" \
                                 f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    lines = done.stdout.strip().splitlines()
    assert lines, f"bench.{name} --smoke printed nothing; stderr:\n{done.stderr[-2000:]}"
    match = HEADLINE.match(lines[-1])
    assert match, f"bench.{name}'s last line is not name=value: {lines[-1]!r}"
    key, value = match.group(1), float(match.group(2))
    assert math.isfinite(value), f"bench.{name}: {key}={value}"
    if expect is not None:
        assert key == expect, f"bench.{name}'s headline is {key}, expected {expect}"
    return key, value, done.stdout
