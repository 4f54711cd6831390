"""A run whose reward keeps failing stops in one line naming the reward and its first error
(orchestrator/pipeline/pipeline.py, envs/rewards.py); before, it trained on zeros with a warning
every 10 s."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import REPO, quick_config

from orchestrator.builders import run
from orchestrator.errors import RunAborted, chain


@pytest.fixture(autouse=True)
def reward_fns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "tests" / "envs"))  # dataset_reward_fns


def test_a_reward_failing_on_most_samples_stops_the_run(tmp_path: Path) -> None:
    cfg = quick_config("smoke", "env.reward=dataset_reward_fns:always_raises",
                       "env.reward_fail_steps=2", "pipeline.num_steps=4")
    with pytest.raises(BaseException) as info:  # the run's task group wraps it
        run(cfg, tmp_path)
    found = [e for e in chain(info.value) if isinstance(e, RunAborted)]
    assert found, [f"{type(e).__name__}: {e}" for e in chain(info.value)]
    aborted = found[0]
    message = str(aborted)
    assert "\n" not in message and "2 steps in a row" in message
    assert ("its first failure: dataset_reward_fns:always_raises: error: RuntimeError: the "
            "verifier's service is down") in message


def test_only_more_than_half_failed_for_that_many_steps_in_a_row_stops() -> None:
    from envs.arithmetic import ArithmeticSpec
    from orchestrator.pipeline.pipeline import Pipeline

    spec = ArithmeticSpec(train_size=4, eval_size=0, reward_fail_steps=2)
    pipeline = SimpleNamespace(_reward_failed_steps=0, runner=SimpleNamespace(spec=spec))

    def step(failed: int, of: int = 8) -> None:
        trajectories = [SimpleNamespace(metrics={"reward/failed": 1.0} if i < failed else {})
                        for i in range(of)]
        batch = [SimpleNamespace(group=SimpleNamespace(trajectories=trajectories))]
        Pipeline._watch_rewards(pipeline, 0, batch)  # type: ignore[arg-type]

    step(8)
    step(4)  # half is not more than half: the count starts again
    step(5)
    with pytest.raises(RunAborted, match="for 2 steps in a row"):
        step(5)
