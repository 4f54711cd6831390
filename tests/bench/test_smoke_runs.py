"""The benchmarks that measure whole runs, at their smoke size, as a user runs them
(``python -m bench.<name> --smoke``): where a step's time goes, resident memory, the run
directory's growth, the learning curve read from a run's files, the algorithm presets and
evaluation's cost, each on the toy model, each printing its documented headline last."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from bench_smoke import run_bench, start_bench


def test_step_profile_smoke_samples_the_trainer_and_the_engine() -> None:
    _, samples_per_s, out = run_bench("step_profile", expect="samples_per_s")
    assert samples_per_s > 0
    steps = int(re.search(r"^(\d+) RL steps sampled \((\d+) samples\)", out, re.MULTILINE).group(1))
    assert 1 <= steps <= 6  # between the lines of steps 2 and 8
    assert re.search(r"^  trainer +[\d.]+$", out, re.MULTILINE)
    assert re.search(r"^  engine +[\d.]+$", out, re.MULTILINE)


def test_memory_smoke_samples_rss_at_both_steps() -> None:
    _, growth, out = run_bench("memory", expect="rss_growth_2_to_6")
    assert growth > -100
    rss = [float(v) for v in re.findall(r"^rss_at_step_[26]=([\d.]+)MiB$", out, re.MULTILINE)]
    assert len(rss) == 2 and min(rss) > 0


def test_rundir_smoke_sizes_the_run_directory_by_kind() -> None:
    _, per_1k, out = run_bench("rundir", expect="rundir_mb_per_1k_steps")
    assert per_1k > 0
    kinds = set(re.findall(r"^(\w+) +\d+ +[\d.]+ +[\d.]+", out, re.MULTILINE))
    assert {"metrics", "spans", "checkpoints"} <= kinds


def test_rg_smol_curve_smoke_reads_a_real_runs_files() -> None:
    pytest.importorskip("reasoning_gym", reason="its tasks are reasoning-gym's: the tasks extra")
    _, gain, out = run_bench("rg_smol_curve", expect="rg_smol_gain")
    assert 0 <= gain <= 1  # the best within the budget, the point before RL included
    assert re.search(r"rg_smol_smoke: 0\.0 min \(step 0\) [\d.]+", out)
    assert "/docs/" not in out  # its plot went to the temporary directory, not docs/


def test_algos_smoke_runs_a_preset_and_reads_its_curve() -> None:
    pytest.importorskip("math_verify", reason="env.reward=math needs the data extra")
    _, share, out = run_bench("algos", expect="presets_learning")
    assert 0 <= share <= 1
    # one update a batch: the ratio to the proximal policy is 1, so PPO's clip never acts
    assert re.search(r"^\| grpo \| 1 \(5e-06\) \| [\d.]+ \| .* \| clip_fraction 0\.000 \|$", out,
                     re.MULTILINE), out


@pytest.mark.slow
def test_algos_toy_smoke_gives_each_figure_over_seeds(tmp_path: Path) -> None:
    args = ("--toy", "--parts", "presets,staleness", "--ks", "1", "--sweep-seeds", "1",
            "--out", str(tmp_path))
    # the first run (grpo_s0) stopped by SIGTERM in its first step, as a bench stopped by hand
    # stops it: the run writes its summary.json at step 1 of 2 and the bench exits non-zero
    stopped = start_bench("algos", *args, env={"POLYRL_KILL_AT": "train_step@0:TERM"})
    assert stopped.returncode != 0 and "grpo_s0 failed" in stopped.stderr, stopped.stderr[-2000:]
    assert json.loads((tmp_path / "toy_presets/grpo_s0/summary.json").read_text())["steps"] == 1
    # --reuse runs a stopped run again: only a run that trained all its steps is read back
    _, share, out = run_bench("algos", *args, "--reuse", expect="presets_learning")
    assert "read from" not in out
    assert 0 <= share <= 1
    # two seeds of grpo, one update a batch at the experiment's rate: each figure a mean ± sd
    assert re.search(r"^\| grpo \| 1 \(0\.0001\) \| [\d.]+ ± [\d.]+ \| [\d.]+ ± [\d.]+ \|.* \| "
                     r"clip_fraction 0\.000 \|$", out, re.MULTILINE), out
    assert re.search(r"^presets_learning: [01]/1$", out, re.MULTILINE)
    for correction in ("decoupled", "bypass_tis", "m2po"):
        assert re.search(rf"^\| {correction} \| [\d.]+ ± 0\.00 \(", out, re.MULTILINE)
    assert re.search(r"^k = 1: highest mean \w+; against it: ", out, re.MULTILINE)
    # --reuse reads each finished run back (2 grpo seeds, 3 corrections) and runs none again
    _, again, reread = run_bench("algos", *args, "--reuse", expect="presets_learning")
    assert len(re.findall(r"^\[bench\.algos\] \w+: read from ", reread, re.MULTILINE)) == 5
    assert "pipeline.num_steps" not in reread  # no run was started
    assert again == share
    assert [line for line in reread.splitlines() if line.startswith("|")] == \
        [line for line in out.splitlines() if line.startswith("|")]
    # the sweep alone prints its own headline: k = 1's decoupled mean minus the best one's
    _, gap, sweep = run_bench("algos", *args[:2], "staleness", *args[3:], "--reuse",
                              expect="stale_k1_gap")
    assert -1 <= gap <= 0  # k = 1 alone: the decoupled one is among those it is compared with
    assert re.search(r"^seconds a step \(every run at k\): k = 1 [\d.]+ ± [\d.]+ s$", sweep,
                     re.MULTILINE), sweep


@pytest.mark.slow
def test_eval_smoke_times_evaluation_against_rollout() -> None:
    pytest.importorskip("math_verify", reason="env.reward=math needs the data extra")
    _, ratio, out = run_bench("eval", expect="eval_vs_rollout_tokens")
    assert ratio > 0
    assert re.search(r"^eval_rl_cost=\S+ eval_engine_share=\S+ ", out, re.MULTILINE)
    assert len(re.findall(r"^RL (without evaluation|with eval\.every=1)", out, re.MULTILINE)) == 3


def test_algos_toy_gives_each_of_n_updates_a_batch_the_rate_over_n() -> None:
    from bench.algos import REAL, per_update_lr, schedule

    assert schedule(["algo=dapo"]) == (16, 1e-4)  # DAPO's 16 updates, the experiment's rate
    assert per_update_lr("dapo", []) == ["trainer.lr=6.25e-06"]
    assert per_update_lr("gspo", ["trainer.lr=2e-4"]) == ["trainer.lr=5e-05"]
    assert per_update_lr("grpo", []) == []  # one update: the rate as it is
    # SmolLM2's experiment: its own rate (5e-6) over the preset's updates
    assert per_update_lr("gspo", list(REAL)) == ["trainer.lr=1.25e-06"]
