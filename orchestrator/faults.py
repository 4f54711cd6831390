"""Fault injection for the crash-and-resume tests (``POLYRL_KILL_AT=<point>@<version>``), and
the run's fault counters across resumes.

A run started with that variable SIGKILLs itself the first time it passes ``point`` at policy
version ``version`` or later: no handler runs, no file is closed, exactly as when a machine
dies. ``<point>@<version>:TERM`` sends SIGTERM instead, once: the run's own handler stops it
after the step in progress, as when a scheduler preempts it; placed by the run's own progress,
never by a clock, so a test of it does not depend on the machine's speed. The points are ``generate`` (a rollout starting, other episodes in flight),
``train_step`` (between the backward pass and the optimiser step), ``weight_sync`` (the
engine paused, the weights not loaded) and ``checkpoint`` (the files written, not the
manifest). Unset, :func:`kill_point` costs one dictionary lookup.

A point may name a Ray actor: ``engine-0.generate@<version>`` SIGKILLs the engine actor
``engine-0`` as it takes a request (so a request is in flight when it dies), in the actor's
first life only: Ray restarts it with the same environment, and the restarted actor serves.
:func:`actor_environment` passes the variable to that actor alone.

Fault counters (``faults/…`` in each step's metrics: engines restarted, sandbox containers
lost, Docker outages, resumes, …) are totals of the whole run. Each process counts from zero;
:func:`add_faults` adds the earlier processes' totals, which the pipeline keeps in its state
(so a checkpoint carries them), and :func:`resumed_faults` takes, on resume, the larger of
the checkpoint's and the last ones recorded before the crash (the records of the steps being
redone are cut, but the faults they counted happened), plus this resume.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping

ENV = "POLYRL_KILL_AT"
PREFIX = "faults/"
# the run was started again (a new driver, or in-process): from a checkpoint, or from the
# beginning when it was killed before its first one
RESUMES = "faults/resumes"


def add_faults(before: Mapping[str, float], now: Mapping[str, float]) -> dict[str, float]:
    """The whole run's fault counters: ``before`` (earlier processes) plus this process's
    ``faults/…`` entries of ``now``."""
    keys = {k for k in (*before, *now) if k.startswith(PREFIX)}
    return {k: float(before.get(k, 0.0)) + float(now.get(k, 0.0)) for k in sorted(keys)}


def resumed_faults(checkpoint: Mapping[str, float],
                   recorded: Mapping[str, float]) -> dict[str, float]:
    """The counters a resumed process starts from: per counter the larger of the checkpoint's
    and those last recorded before the crash, and one more resume."""
    keys = set(checkpoint) | set(recorded)
    totals = {k: max(float(checkpoint.get(k, 0.0)), float(recorded.get(k, 0.0))) for k in keys}
    totals[RESUMES] = totals.get(RESUMES, 0.0) + 1
    return totals


def actor_environment(actor: str) -> dict[str, str]:
    """The fault variable for the Ray actor named ``actor`` when its point is one of that
    actor's (``<actor>.<point>@<version>``), else nothing."""
    target = os.environ.get(ENV, "")
    return {ENV: target} if target.startswith(f"{actor}.") else {}


_signalled = False  # a SIGTERM point fires once (the run stops after the step in progress)


def kill_point(point: str, version: int) -> None:
    global _signalled
    target = os.environ.get(ENV)
    if not target:
        return
    target, _, how = target.partition(":")
    name, _, at = target.partition("@")
    if name != point or version < int(at or 0):
        return
    if how == "TERM":
        if not _signalled:
            _signalled = True
            os.kill(os.getpid(), signal.SIGTERM)
        return
    os.kill(os.getpid(), signal.SIGKILL)
