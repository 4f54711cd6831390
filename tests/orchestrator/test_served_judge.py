"""The judge served by the run itself (``env.judge.serve``, orchestrator.builders.served_judge):
the run builds that conf/model entry's engine from its own weights, serves it behind an
OpenAI-compatible URL in its own event loop and judges through it, every sample scored or
counted; a name that is not a model, or an engine that cannot start, is one line before any
step; a command that does not serve it says so in one line."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from helpers import quick_config

from envs.base import Task
from envs.errors import EnvConfigError
from orchestrator.builders import run, served_judge
from orchestrator.config.read import build_env
from orchestrator.config.run import run_config
from orchestrator.errors import ConfigError

JUDGED = ("env.reward={strict: 1.0, judge: 0.5}", "env.judge.serve=tiny",
          "env.judge.max_tokens=4", "env.judge.timeout_s=60", "env.judge.retries=0")


def test_a_run_serves_its_judge_and_judges_every_sample(tmp_path: Path) -> None:
    # the toy model as judge: it answers with random characters, so most verdicts are
    # unparsable; what is checked is that every sample reached the judge the run serves and
    # came back scored or counted (nothing stalls, nothing is lost)
    result = run(quick_config("arithmetic", *JUDGED, "warmstart.steps=0", "eval.num_tasks=0"),
                 tmp_path)
    assert len(result.reports) == 2
    metrics = result.reports[-1].metrics
    # two steps of 8 samples, one call each, and any sample generated ahead for a third
    # step (k = 1 admits one step ahead) before the run stopped
    assert metrics["judge/calls"] >= 2 * 8
    # every call scored, unscored or still in flight at the report (no retries): none lost
    assert (metrics["judge/scored"] + metrics["judge/unscored"] + metrics["judge/in_flight"]
            == metrics["judge/calls"])
    assert metrics["judge/failures/connection"] == 0  # the server was up for every call
    unparsable = metrics["judge/failures/unparsable"]
    assert metrics.get("reward/failed/judge/error", 0.0) == metrics["judge/unscored"] \
        == unparsable


@pytest.mark.anyio
async def test_served_judge_grades_through_the_runs_own_server() -> None:
    cfg = quick_config("arithmetic", *JUDGED)
    spec = build_env(cfg)
    serving = served_judge(run_config(cfg), spec)
    assert serving is not None and spec.judge_to_serve() == "tiny"
    env = spec.make_env()
    with anyio.fail_after(120):
        async with serving(), spec.running():
            task = Task(id=0, messages=({"role": "user", "content": "1+2="},), answer="3")
            await env.reset(task)
            await env.step("3")
            reward = await env.reward()
    assert reward.terms[0].value == 1.0  # strict
    metrics = spec.metrics()
    assert metrics["judge/calls"] == 1
    assert metrics["judge/scored"] + metrics["judge/unscored"] == 1
    cfg = quick_config("arithmetic")
    assert served_judge(run_config(cfg), build_env(cfg)) is None


def test_a_judge_that_cannot_be_served_is_one_line() -> None:
    cfg = quick_config("arithmetic", "env.reward=judge", "env.judge.serve=no_such_model")
    with pytest.raises(ConfigError, match=r"env.judge.serve=no_such_model names no model in "
                                          r"conf/model/; choose from .*tiny"):
        served_judge(run_config(cfg), build_env(cfg))
    cfg = quick_config("arithmetic", "env.reward=judge", "env.judge.serve=hf")  # no model.path
    with pytest.raises(ConfigError, match=r"env.judge.serve=hf: the judge's engine could not "
                                          r"start"):
        served_judge(run_config(cfg), build_env(cfg))
    both = quick_config("arithmetic", "env.reward=judge", "env.judge.serve=tiny",
                        "env.judge.url=http://127.0.0.1:9/v1")
    with pytest.raises(ConfigError, match="env.judge.url and env.judge.serve are both set"):
        build_env(both)


@pytest.mark.anyio
async def test_a_command_that_does_not_serve_the_judge_says_so() -> None:
    spec = build_env(quick_config("arithmetic", "env.reward=judge", "env.judge.serve=tiny"))
    with pytest.raises(EnvConfigError, match=r"env.judge.serve=tiny: the run serves this judge "
                                             r"itself"):
        async with spec.running():
            pass
