"""The model-level benchmarks at their smoke size, as a user runs them (``python -m
bench.<name> --smoke``): the engine's batching modes, the precision table, the GPU benchmark
(on the CPU where there is no GPU), and the base rates of the real experiments' candidate
tasks, each on the toy model, each printing its documented headline last."""

from __future__ import annotations

import re

import pytest
import torch
from bench_smoke import run_bench


def test_engine_smoke_runs_both_modes_on_the_same_workload() -> None:
    _, ratio, out = run_bench("engine", expect="continuous_vs_waves")
    assert ratio > 0
    row = r"^1\s+(waves|continuous)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\d+)$"
    rows = {m.group(1): int(m.group(2)) for m in re.finditer(row, out, re.MULTILINE)}
    assert set(rows) == {"waves", "continuous"}
    assert rows["waves"] == rows["continuous"] > 0  # the same turns through both


def test_precision_smoke_prints_every_combination() -> None:
    _, diff, out = run_bench("precision", expect="logprob_diff_bf16_fp32_head")
    assert diff >= 0
    rows = re.findall(r"^(float32|bfloat16)\s+(fp32|mixed|bf16)\s+(True|False)\s+(\S+)\s+(\S+)$",
                      out, re.MULTILINE)
    assert len(rows) == 12
    # the engine and the trainer in float32 on the same weights: the same log-probs
    same = [float(mean) for dtype, precision, _, mean, _ in rows
            if dtype == "float32" and precision == "fp32"]
    assert max(same) < 1e-4


def test_gpu_smoke_runs_its_code_on_whatever_device_there_is() -> None:
    _, fraction, out = run_bench("gpu", expect="gpu_trainer_peak_fraction")
    assert fraction > 0
    assert "trainer.precision=mixed:" in out and "trainer.precision=fp32:" in out
    assert "torch-bfloat16" in out and "torch-float32" in out
    if not torch.cuda.is_available():
        assert "no host waits to count on the CPU" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_gpu_without_a_gpu_refuses_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.cli import REFUSED
    from bench.gpu import main

    with pytest.raises(SystemExit) as exited:
        main([])
    assert exited.value.code == REFUSED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bench.gpu: cannot measure: ")


def test_base_rates_smoke_rates_every_candidate() -> None:
    pytest.importorskip("reasoning_gym", reason="its tasks are reasoning-gym's: the tasks extra")
    _, rate, out = run_bench("base_rates", expect="base_rate_chain_sum_2_terms_1_digit")
    assert 0 <= rate <= 1
    assert len(re.findall(r" greedy=[\d.]+ ", out)) == 7


def test_dataset_base_rates_smoke_rates_the_chosen_candidate() -> None:
    pytest.importorskip("math_verify", reason="env.reward=math needs the data extra")
    _, rate, out = run_bench("dataset_base_rates", expect="base_rate_dataset_smol")
    assert 0 <= rate <= 1
    assert re.search(r"^all kinds in LaTeX, boxed, 32 tokens +greedy=", out, re.MULTILINE)
