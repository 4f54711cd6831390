"""bench.resume at its smoke size, as a user runs it: the kill-and-resume figures and the
exactly-once soak's audit, each from a real run SIGKILLed or SIGTERMed and resumed."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import forked
import pytest
from bench_smoke import REPO, run_bench

from bench.resume import Interruption, audit
from orchestrator.run.resume import RunState, find_checkpoint

STEPS = 6
RUN = ["experiment=smoke", "logger=none", "progress=false", "model.device=cpu",
       "model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64",
       "warmstart.steps=2", "eval.num_tasks=8", f"pipeline.num_steps={STEPS}",
       "checkpoint.every=0"]


def orchestrator(*args: str, kill_at: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    if kill_at:
        env["POLYRL_KILL_AT"] = kill_at
    return forked.run([sys.executable, "-m", "orchestrator", *args], cwd=REPO, env=env,
                      capture_output=True, text=True, timeout=280, check=False)


@pytest.mark.slow
def test_resume_smoke_prints_work_lost_and_loses_no_prompt() -> None:
    _, value, out = run_bench("resume", expect="work_lost_max_s")
    assert value >= 0
    assert "duplicated_samples=0\n" in out and "lost_prompts=0\n" in out
    assert "problem:" not in out


@pytest.mark.slow
def test_the_soak_audits_every_interruption() -> None:
    _, value, out = run_bench("resume", "--soak", "--seed", "3", expect="lost_prompts")
    assert value == 0 and "problem:" not in out
    survived = next(line for line in out.splitlines() if line.startswith("exactly_once="))
    done, made = survived.removeprefix("exactly_once=").split("/")
    assert int(made) >= 1 and done == made


@pytest.mark.slow
def test_the_audit_finds_a_prompt_lost_at_a_resume(tmp_path: Path) -> None:
    """The soak's audit, on a real run stopped by SIGTERM during step 2 and resumed: it passes
    as the run is, and finds the prompt when the checkpoint resumed from is made to forget one
    of those in flight (what a sampler that lost them would have written)."""
    run_dir = tmp_path / "run"
    stopped = orchestrator(*RUN, f"hydra.run.dir={run_dir}", kill_at="train_step@2:TERM")
    assert stopped.returncode == 2, stopped.stderr[-2000:]
    checkpoint = find_checkpoint(run_dir)
    state = RunState.read(checkpoint)
    again = set(state.pipeline["sampler"]["again"])
    assert len(again) >= 2
    stop = Interruption("SIGTERM", recorded=state.step, newest=state.step,
                        resumed_from=state.step, again=again, exit_ok=True)
    forgotten = min(again)  # the broken sampler's checkpoint: one in-flight prompt gone
    state.pipeline["sampler"]["again"].remove(forgotten)
    path = checkpoint / "run_state.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "pipeline": state.pipeline}))
    manifest = json.loads((checkpoint / "MANIFEST.json").read_text())  # still a valid one
    manifest["files"]["run_state.json"] = {"bytes": path.stat().st_size,
                                           "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    (checkpoint / "MANIFEST.json").write_text(json.dumps(manifest))
    resumed = orchestrator(f"resume={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert RunState.read(find_checkpoint(run_dir)).step == STEPS
    result = audit(run_dir, [stop])
    assert result.lost_prompts >= 1 and result.survived == 0
    assert any("unaccounted" in p for p in result.problems), result.problems
