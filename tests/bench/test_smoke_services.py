"""The benchmarks of what a run leans on beside its loop, at their smoke size, as a user runs
them (``python -m bench.<name> --smoke``): the sandbox session against ``docker run`` and
``docker exec`` (Docker), ``env=dataset`` with a large file against a small one (four runs
of ``python -m orchestrator``, and an 8 MB file read) and a LoRA update into vLLM
(``.venv-vllm``); each prints its documented headline last, or, where the machine lacks what
it measures, says so in one line and exits with status 3."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import forked
import pytest
from bench_smoke import REPO, run_bench
from helpers import docker_available

from bench.cli import REFUSED


def refusal(name: str, env: dict[str, str] | None = None) -> str:
    """``python -m bench.<name> --smoke`` where it cannot measure: its one line on stderr."""
    done = forked.run([sys.executable, "-m", f"bench.{name}", "--smoke"], cwd=REPO,
                      env={**os.environ, **(env or {})}, capture_output=True, text=True,
                      timeout=120, check=False)
    assert done.returncode == REFUSED, (done.returncode, done.stdout[-1000:], done.stderr[-2000:])
    assert "=" not in done.stdout, done.stdout  # no headline it did not measure
    lines = done.stderr.strip().splitlines()
    assert lines and lines[-1].startswith(f"bench.{name}: cannot measure: "), done.stderr[-2000:]
    return lines[-1]


def test_sandbox_without_a_docker_engine_says_so(tmp_path: os.PathLike[str]) -> None:
    line = refusal("sandbox", {"DOCKER_HOST": f"unix://{tmp_path}/docker.sock"})
    assert "no Docker engine at unix://" in line


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.skipif(not docker_available(), reason="no Docker engine or sandbox image; run "
                                               "`bash scripts/docker_setup.sh`")
def test_sandbox_smoke_times_every_mode_on_runc() -> None:
    _, speedup, out = run_bench("sandbox", expect="speedup_vs_cold")
    assert speedup > 0
    cells = re.findall(r"^runc +(cold|exec|session) +(trivial|cpu50) +([12]) +\d+ ", out,
                       re.MULTILINE)
    assert len(cells) == 12  # three modes, two snippets, concurrency 1 and 2
    assert "runsc" not in out  # the smoke measures one runtime


@pytest.mark.slow
def test_dataset_smoke_measures_a_large_file_against_a_small_one() -> None:
    pytest.importorskip("pyarrow", reason="env=dataset needs the data extra")
    _, extra, out = run_bench("dataset", expect="dataset_extra_rss_mb_10k")
    assert extra > -1000  # a difference of two peaks: it may come out below 0
    rows = re.findall(r"^ +([\d,]+) +[\d.]+ +[\d.]+ +(\d+)$", out, re.MULTILINE)
    assert [r for r, _ in rows] == ["1,000", "10,000"] and all(int(mb) > 0 for _, mb in rows)
    # the load part: an 8 MB verl-schema file's first read (tests/envs reads one from the cache)
    assert len(re.findall(r"^first +[\d.]+ +\d+ +\d+ ", out, re.MULTILINE)) == 1
    assert re.search(r"^dataset_held_rss_mb_8mb=-?\d+$", out, re.MULTILINE)
    assert re.search(r"^dataset_peak_rss_mb_8mb=\d+$", out, re.MULTILINE)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_lora_smoke_updates_the_engine_three_ways() -> None:
    if importlib.util.find_spec("vllm") is None:
        assert "vLLM is not installed here" in refusal("vllm_lora")
        pytest.skip("vLLM is not installed here; scripts/test.sh runs this in .venv-vllm")
    _, ratio, out = run_bench("vllm_lora", timeout=400, expect="lora_merged_vs_full")
    assert ratio > 0
    assert re.search(r"^model=smoke r=8 .* repeats=2$", out, re.MULTILINE)
    for update in ("full", "merged", "vllm_lora"):
        assert re.search(rf"^update {update}: +[\d.]+ ms", out, re.MULTILINE)
