"""The session runner's own logic, in this process: what it does when the kernel refuses it."""

from __future__ import annotations

import errno
import os
import time

import pytest

from sandboxes import runner


def refusing(times: float, pid: int = 4242):
    """An ``os.fork`` refused ``times`` times with EAGAIN, as under a full pids limit, then
    answering ``pid`` (no process is made)."""
    calls = []

    def fork() -> int:
        calls.append(time.monotonic())
        if len(calls) <= times:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        return pid

    return fork, calls


def test_a_fork_refused_while_killed_processes_await_reaping_is_tried_again(monkeypatch) -> None:
    # after a fork bomb, the processes killed still count against the limit until init reaps
    # them: the next request's fork fails for a few milliseconds (a flake of test_fork_bomb)
    fork, calls = refusing(3)
    monkeypatch.setattr(os, "fork", fork)
    assert runner.fork(time.monotonic() + 5) == 4242
    assert len(calls) == 4


def test_a_shell_request_that_cannot_fork_by_its_deadline_answers_an_error(monkeypatch) -> None:
    fork, calls = refusing(float("inf"))
    monkeypatch.setattr(os, "fork", fork)
    with pytest.raises(BlockingIOError):
        runner.fork(time.monotonic())
    supervisor = object.__new__(runner.Supervisor)  # its __init__ takes over stdin and stdout
    supervisor.kernel = None
    status, exit_code, flags, out, err = supervisor.run_shell(b"true", time.monotonic() + 0.05, 100)
    assert (status, exit_code, out, err) == (runner.ERROR, runner.NO_EXIT, b"", runner.NO_ROOM)
    status, _, flags, _, err = supervisor.run_python(b"1", time.monotonic() + 0.05, 100)
    assert (status, flags, err) == (runner.ERROR, 1, runner.NO_ROOM) and supervisor.kernel is None
    assert len(calls) > 2  # each waited for room until its deadline
