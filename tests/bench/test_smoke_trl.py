"""``bench.peers`` at its smoke size, as a user runs it (``python -m bench.peers --smoke``:
warm start, the project at k = 0 and k = 1, TRL's ``GRPOTrainer``, their evaluation, on the
toy model); and the settings TRL is given (``bench.peers_trl``, ``bench.real_model`` too),
read from the experiment's algorithm, refused where TRL cannot run it like for like
(``bench.real_model --smoke`` is in test_real_model.py)."""

from __future__ import annotations

import re

import pytest
from bench_smoke import run_bench

pytest.importorskip("trl", reason="the TRL comparison needs the peers extra (scripts/setup.sh)")

from bench.peers_trl import NotComparable, RLSettings, experiment


def test_the_default_experiments_clip_bounds_reach_trl() -> None:
    settings = RLSettings.of(experiment())
    assert (settings.eps_low, settings.eps_high) == (0.2, 0.28)  # conf/algo/grpo.yaml's loss
    assert (settings.batch_size, settings.group_size) == (64, 4)
    tighter = RLSettings.of(experiment("algo.loss.eps_high=0.3", "algo.loss.eps_low=0.1"))
    assert (tighter.eps_low, tighter.eps_high) == (0.1, 0.3)


@pytest.mark.parametrize("overrides", [
    ("algo=cispo",),  # its own loss (it has eps_low too: not PPO's clip)
    ("algo=gspo",),
    ("algo.loss.dual_clip=3.0",),
    ("algo=dr_grpo",),  # no std normalisation, a sequence-sum aggregation
])
def test_an_algorithm_trl_cannot_run_is_refused(overrides: tuple[str, ...]) -> None:
    with pytest.raises(NotComparable, match="like for like"):
        RLSettings.of(experiment(*overrides))


@pytest.mark.slow
def test_peers_smoke_runs_three_runs_and_their_evaluation() -> None:
    _, speedup, out = run_bench("peers", expect="speedup_vs_trl")
    assert speedup > 0
    assert re.search(r"^polyrl k=0: 2 steps in ", out, re.MULTILINE)
    assert re.search(r"^polyrl k=1: 2 steps in ", out, re.MULTILINE)
    assert re.search(r"^TRL GRPOTrainer \(1 threads\): 2 steps in ", out, re.MULTILINE)
    assert float(re.search(r"^bound_fraction=(\S+)$", out, re.MULTILINE).group(1)) > 0
    assert float(re.search(r"^throughput_vs_trl_k0=(\S+)$", out, re.MULTILINE).group(1)) > 0
