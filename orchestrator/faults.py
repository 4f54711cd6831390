"""Fault injection for the crash-and-resume tests: ``POLYRL_KILL_AT=<point>@<version>``.

A run started with that variable SIGKILLs itself the first time it passes ``point`` at policy
version ``version`` or later: no handler runs, no file is closed, exactly as when a machine
dies. The points are ``generate`` (a rollout starting, other episodes in flight),
``train_step`` (between the backward pass and the optimiser step), ``weight_sync`` (the
engine paused, the weights not loaded) and ``checkpoint`` (the files written, not the
manifest). Unset, :func:`kill_point` costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "POLYRL_KILL_AT"


def kill_point(point: str, version: int) -> None:
    target = os.environ.get(ENV)
    if not target:
        return
    name, _, at = target.partition("@")
    if name == point and version >= int(at or 0):
        os.kill(os.getpid(), signal.SIGKILL)
