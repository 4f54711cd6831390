"""bench.resume at its smoke size, as a user runs it: the kill-and-resume figures and the
exactly-once soak's audit, each from a real run SIGKILLed or SIGTERMed and resumed."""

from __future__ import annotations

import pytest
from bench_smoke import run_bench


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
