"""The code environments (envs/code.py): tasks with hidden tests, grading in a sandbox (the
local development one for the logic, the real Docker engine for the rest), the multi-turn
``python`` tool on a stateful session, and a short ``experiment=code`` run."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import forked
import pytest
from helpers import REPO, TOK, docker_available, quick_config, scripted_engine

from envs.code import CodeSpec, CodeToolSpec, extract_code
from envs.parsers import HermesParser
from orchestrator.builders import run
from orchestrator.config.schema import RolloutConfig
from orchestrator.engines.simulated import SimulatedEngine
from orchestrator.episodes.rollout import EpisodeRunner
from orchestrator.run.warmstart import demonstration_tokens
from orchestrator.trace.recorder import Recorder

LOCAL = {"_target_": "sandboxes.local.LocalSandboxConfig", "timeout_s": 2.0, "max_timeout_s": 2.0}
DOCKER = "sandboxes.docker.DockerSandboxConfig"


def needs_docker(test: Callable[..., Any]) -> Callable[..., Any]:
    """Marked ``docker`` (left out of --quick, run with the other Docker tests) and skipped
    without an engine and the image."""
    skip = pytest.mark.skipif(not docker_available(),
                              reason="no Docker engine or image; run `bash scripts/docker_setup.sh`")
    return pytest.mark.docker(skip(test))


def test_tasks_are_reproducible_disjoint_and_their_reference_answers_pass() -> None:
    a, b = CodeSpec(sandbox=LOCAL, train_size=50, eval_size=10), CodeSpec(sandbox=LOCAL, train_size=50, eval_size=10)
    assert a.tasks("train") == b.tasks("train")
    prompts = [t.messages[0]["content"] for t in (*a.tasks("train"), *a.tasks("eval"))]
    assert len(set(prompts)) == 60
    for task in a.tasks("train"):
        namespace: dict = {}
        exec(task.answer, namespace)  # our own reference code, not a model's
        assert all(namespace["f"](x) == y for x, y in task.metadata["tests"])


def test_bad_config_values_are_named() -> None:
    with pytest.raises(ValueError, match="env.ops"):
        CodeSpec(sandbox=LOCAL, ops=["divide"])
    with pytest.raises(ValueError, match="sandbox.timeout is not a key of "
                                         "sandboxes.local.LocalSandboxConfig"):
        CodeSpec(sandbox={"_target_": "sandboxes.local.LocalSandboxConfig", "timeout": 3})
    with pytest.raises(ValueError, match="env.train_size"):
        CodeSpec(sandbox=LOCAL, ops=["plus"], max_constant=2, train_size=5)


def test_code_is_taken_from_a_fence_when_there_is_one() -> None:
    assert extract_code("Here:\n```python\ndef f(x):\n    return x\n```\nDone") == "def f(x):\n    return x\n"
    assert extract_code("def f(x): return 1") == "def f(x): return 1"


@pytest.fixture
async def local_spec() -> AsyncIterator[CodeSpec]:
    spec = CodeSpec(sandbox=LOCAL, train_size=10, eval_size=0, test_timeout=1.0)
    async with spec.running():
        yield spec


@pytest.mark.anyio
async def test_grading_counts_passed_tests_and_cannot_be_faked(local_spec: CodeSpec) -> None:
    task = local_spec.tasks("train")[0]
    assert (await local_spec.grade(task, task.answer))[0] == 1.0
    # a function right on some inputs only earns that share
    x0, y0 = task.metadata["tests"][0]
    partial = f"def f(x):\n    return {y0} if x == {x0} else None"
    assert (await local_spec.grade(task, partial))[0] == pytest.approx(1 / len(task.metadata["tests"]))
    assert (await local_spec.grade(task, "def f(x) return"))[0] == 0.0
    score, info = await local_spec.grade(task, "import sys\nprint('x', 5)\nsys.stdout.write('0 5 1\\n')")
    assert score == 0.0 and info["status"] == "ok"
    # what a model could try against the grader: each earns nothing, and none breaks the run
    attacks = [
        "class A:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return A()",
        "int = lambda v: 99\ndef f(x):\n    return 0",
        "import builtins\nbuiltins.print = lambda *a: None\ndef f(x):\n    return 0",
        "def print(m, n, k):\n    pass\ndef f(x):\n    return 0",
        "import os\nos._exit(0)",
    ]
    for attack in attacks:
        score, _ = await local_spec.grade(task, attack)
        assert score == 0.0, attack
    assert (await local_spec.grade(task, task.answer + "\nprint = None"))[0] == 1.0
    started = time.monotonic()
    score, info = await local_spec.grade(task, "while True:\n    pass")
    assert score == 0.0 and info["status"] == "timeout"
    assert time.monotonic() - started < 10


def test_episodes_need_the_running_pool() -> None:
    spec = CodeSpec(sandbox=LOCAL, train_size=4, eval_size=0)
    with pytest.raises(RuntimeError, match=r"async with spec.running\(\)"):
        spec.make_env()


def tool_policy() -> SimulatedEngine:
    """Defines a helper in the session, uses it in a second call, then answers."""

    def reply(prompt: list[int]) -> str:
        text = TOK.decode(prompt)
        m = re.search(r"returns \(x (\w+) (\d+)\) (\w+) (\d+)\.", text)
        assert m is not None
        symbol = {"plus": "+", "minus": "-", "times": "*", "mod": "%"}
        body = f"(x{symbol[m.group(1)]}{m.group(2)}){symbol[m.group(3)]}{m.group(4)}"
        calls = text.count("<tool_call>")
        if calls == 0:
            return HermesParser.format("python", {"code": f"g = lambda x: {body}"})
        if calls == 1:
            return HermesParser.format("python", {"code": "print(g(0), g(1))"})
        return f"def f(x):\n    return {body}"

    return scripted_engine(reply)


@needs_docker
@pytest.mark.anyio
async def test_the_python_tool_keeps_state_across_calls_in_a_docker_session() -> None:
    # one container in all: the episode's session must be released before grading takes one
    spec = CodeToolSpec(sandbox={"_target_": DOCKER, "pool_size": 1, "max_containers": 1},
                        train_size=4, eval_size=0)
    task = spec.tasks("train")[0]
    recorder = Recorder()
    async with spec.running():
        with anyio.fail_after(120):
            runner = EpisodeRunner(tool_policy(), TOK, spec,
                                   RolloutConfig(max_tokens=120, max_turns=4), recorder)
            trajectory, _ = await runner.episode(task, "w")
        # a reference episode is laid out exactly as the runner lays out the real one
        ids, mask = demonstration_tokens(TOK, spec.demonstration(task))
        assert mask.count(True) > 0 and len(ids) == len(mask)
    assert trajectory.end_reason == "done"
    assert trajectory.reward == 1.0
    assert trajectory.metrics["reward/used_python"] == 1.0
    calls = [s for s in recorder.spans if s.stage == "tool_call"]
    assert [c.attributes["status"] for c in calls] == ["ok", "ok"]  # g survived between calls
    text = TOK.decode(list(trajectory.token_ids))
    assert re.search(r"-?\d+ -?\d+", text.split("print(g(0), g(1))")[-1])


@needs_docker
def test_experiment_code_runs_against_docker(tmp_path: Path) -> None:
    cfg = quick_config("code", "sandbox.pool_size=2")
    result = run(cfg, tmp_path)
    assert len(result.reports) == 2
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for m in metrics[:-1]:
        assert 0.0 <= m["reward/tests_passed"] <= 1.0 and m["reward/tests_passed/exec_s"] > 0


@needs_docker
def test_a_missing_image_is_one_line_naming_the_build_command() -> None:
    result = forked.run(
        [sys.executable, "-m", "orchestrator", "experiment=code", "sandbox.image=polyrl-missing:0",
         "logger=none", "warmstart.steps=0", "eval.num_tasks=0", "pipeline.num_steps=1"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "python -m sandboxes.docker build-image" in errors[0]
