"""The command line (orchestrator/__main__.py): configuration mistakes end the process with
exit status 2 and one line on stderr that starts with ``error:`` and names what to change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import forked
import pytest

REPO = Path(__file__).resolve().parents[2]

# case id -> (overrides, words the error line must contain)
MISTAKES: dict[str, tuple[list[str], list[str]]] = {
    "unknown-experiment": (["experiment=nope"], ["experiment", "nope", "smoke"]),
    "unknown-key": (["experiment=smoke", "pipeline.batch_sise=8"], ["pipeline.batch_sise"]),
    "unknown-group-key": (["experiment=smoke", "nosuch.key=1"], ["nosuch.key"]),
    "negative-staleness": (["experiment=smoke", "pipeline.max_staleness=-1"],
                           ["pipeline.max_staleness", "-1"]),
    "batch-larger-than-dataset": (
        ["experiment=smoke", "env.train_size=2", "env.eval_size=2", "pipeline.batch_size=16"],
        ["pipeline.batch_size=16", "2 train tasks"],
    ),
    "batch-not-multiple-of-group": (["experiment=smoke", "pipeline.batch_size=10"],
                                    ["pipeline.batch_size=10", "group_size"]),
    "non-integer-num-steps": (["experiment=smoke", "pipeline.num_steps=many"],
                              ["pipeline.num_steps", "many"]),
    "fractional-max-tokens": (["experiment=smoke", "rollout.max_tokens=2.5"],
                              ["rollout.max_tokens", "2.5"]),
    "non-integer-seed": (["experiment=smoke", "seed=abc"], ["seed", "abc"]),
    "non-integer-eval-tasks": (["experiment=smoke", "eval.num_tasks=some"],
                               ["eval.num_tasks", "some"]),
    "non-integer-env-size": (["experiment=smoke", "env.train_size=1.5"], ["train_size", "1.5"]),
    "non-number-lr": (["experiment=smoke", "trainer.lr=fast"], ["lr", "fast"]),
    "bad-inflight-mode": (["experiment=smoke", "pipeline.inflight_update=later"],
                          ["pipeline.inflight_update", "later"]),
    "bad-logger-mode": (["experiment=smoke", "logger=wandb", "logger.mode=sometimes"],
                        ["logger.mode", "sometimes"]),
    "filter-named-not-chosen": (["experiment=smoke", "algo.filter=dynamic_sampling"],
                                ["algo.filter=dynamic_sampling", "algo/filter=<name>"]),
    "hf-model-path-missing": (["experiment=smoke", "model=hf"], ["model.path"]),
    "hf-model-path-not-a-directory": (["model=hf", "model.path=/nonexistent"],
                                      ["model.path=/nonexistent"]),
}


def cli(args: list[str], run_dir: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    return forked.run(
        [sys.executable, "-m", "orchestrator", *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )


# Runs every mistake through the command line's entry point in one process, each with its own
# stderr, exit status and run directory: one interpreter start (torch's import) for them all.
DRIVER = """
import contextlib, io, json, runpy, sys
from hydra.core.global_hydra import GlobalHydra
results = {}
for case, args in json.loads(sys.argv[1]).items():
    sys.argv = ["orchestrator", *args]
    err = io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_module("orchestrator", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException as e:  # a bug: its traceback is what the test shows
            import traceback
            traceback.print_exc(file=err)
            code = 1
    GlobalHydra.instance().clear()
    results[case] = [code, err.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every mistake, as ``python -m orchestrator`` would meet it."""
    base = tmp_path_factory.mktemp("cli")
    cases = {}
    for case, (overrides, _) in MISTAKES.items():
        if not any(o.startswith("logger=") for o in overrides):
            overrides = [*overrides, "logger=none"]  # never reach for the network
        cases[case] = [*overrides, "progress=false", f"hydra.run.dir={base / case}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(cases)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    return {case: subprocess.CompletedProcess(cases[case], code, "", stderr)
            for case, (code, stderr) in results.items()}


@pytest.mark.parametrize("case", list(MISTAKES))
@pytest.mark.slow  # left out of scripts/test.sh --quick
def test_a_config_mistake_is_one_line_naming_it(
    case: str, mistakes: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    result = mistakes[case]
    _, words = MISTAKES[case]
    stderr = result.stderr
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    assert lines[0].startswith("error: ")
    for word in words:
        assert word in lines[0], f"{word!r} not named in: {lines[0]}"
    assert result.returncode == 2, stderr


def test_help_lists_the_config_groups(tmp_path: Path) -> None:
    result = cli(["--help"], tmp_path)
    assert result.returncode == 0, result.stderr
    for group in ("model", "engine", "env", "algo", "trainer", "logger", "experiment"):
        assert f"{group}:" in result.stdout


def test_third_party_request_logs_stay_at_warning_unless_asked() -> None:
    import logging

    from orchestrator.__main__ import QUIET_LOGGERS, _quiet_third_party

    logging.getLogger("httpcore").setLevel(logging.DEBUG)  # asked for: kept
    try:
        _quiet_third_party()
        assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING
        assert logging.getLogger("httpcore").level == logging.DEBUG
        assert "openai" in QUIET_LOGGERS
    finally:
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.NOTSET)
