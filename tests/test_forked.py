"""The fork server the tests start commands from (tests/forked.py) gives a command what a new
interpreter would: the same output, exit status, working directory, environment, ``sys.path``
and ``__main__``, and a real process to signal. Each case runs both ways and compares."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import forked
import pytest

PROBE = textwrap.dedent("""
    import atexit, json, os, random, sys, threading, time
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread ended"))).start()
    atexit.register(print, "atexit ran")
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[:2],
                      "probe": os.environ.get("PROBE"), "name": __name__,
                      "main": sys.modules["__main__"].__file__, "stdin": sys.stdin.read(),
                      "random": random.random()}))
    print("to stderr", file=sys.stderr)
    if "--sleep" in sys.argv:
        print("ready", flush=True)
        time.sleep(60)
    raise SystemExit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
""")


@pytest.fixture
def probe(tmp_path: Path) -> tuple[list[str], dict[str, str], Path]:
    """``python -m probe`` with the module on PYTHONPATH, run from another directory."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "probe.py").write_text(PROBE)
    (tmp_path / "cwd").mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib"), "PROBE": "yes"}
    return [sys.executable, "-m", "probe"], env, tmp_path / "cwd"


def both(args: list[str], **kwargs: object) -> tuple[subprocess.CompletedProcess[str], ...]:
    plain = subprocess.run(args, check=False, capture_output=True, text=True, timeout=60,  # type: ignore[call-overload]
                           **kwargs)
    fork = forked.run(args, capture_output=True, text=True, timeout=60, **kwargs)
    return plain, fork


Probe = tuple[list[str], dict[str, str], Path]


def test_a_forked_command_is_what_a_new_interpreter_runs(probe: Probe) -> None:
    args, env, cwd = probe
    plain, fork = both([*args, "3", "x"], env=env, cwd=cwd, input="typed")
    assert fork.returncode == plain.returncode == 3
    assert fork.stderr == plain.stderr == "to stderr\n"
    assert fork.stdout.splitlines()[1:] == plain.stdout.splitlines()[1:] == ["thread ended", "atexit ran"]
    ran, expected = (json.loads(p.stdout.splitlines()[0]) for p in (fork, plain))
    assert ran.pop("random") != expected.pop("random")  # each process draws its own
    assert ran == expected
    assert ran["path0"] == [str(cwd), env["PYTHONPATH"]] and ran["name"] == "__main__"
    assert ran["argv"] == ["3", "x"] and ran["probe"] == "yes" and ran["stdin"] == "typed"


def test_a_forked_command_is_a_process_signals_reach(probe: Probe) -> None:
    args, env, cwd = probe
    process = forked.Popen([*args, "--sleep"], env=env, cwd=cwd, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    assert isinstance(process, forked.Popen)
    assert process.stdout is not None and process.stdout.readline().startswith("{")
    assert process.stdout.readline() == "ready\n"
    assert process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.01)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=30)
    assert process.returncode == -signal.SIGTERM and err == "to stderr\n"
    with pytest.raises(subprocess.TimeoutExpired):  # killed, as subprocess.run kills
        forked.run([*args, "--sleep"], env=env, cwd=cwd, capture_output=True, timeout=0.5)


def test_other_commands_and_fork_0_run_a_new_interpreter(
        probe: Probe, monkeypatch: pytest.MonkeyPatch) -> None:
    args, env, cwd = probe
    script = forked.Popen([sys.executable, "-c", "pass"])
    assert isinstance(script, subprocess.Popen) and script.wait(timeout=60) == 0
    monkeypatch.setenv(forked.ENABLE_ENV, "0")
    module = forked.Popen(args, env=env, cwd=cwd, stdout=subprocess.DEVNULL)
    assert isinstance(module, subprocess.Popen) and module.wait(timeout=60) == 0


OUTER = textwrap.dedent("""
    import json, os, subprocess, sys
    done = subprocess.run([sys.executable, "-m", "bench.inner"], capture_output=True, text=True,
                          timeout=60)
    print(json.dumps({"pid": os.getpid(), "inner_parent": int(done.stdout),
                      "inner_exit": done.returncode, "popen": subprocess.Popen.__name__}))
""")


@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_forked_command_forks_the_projects_commands_it_starts(tmp_path: Path, fork: str) -> None:
    """A benchmark's ``python -m orchestrator`` runs come from the server too (the server's
    children, not the benchmark's), unless the command's environment says POLYRL_TEST_FORK=0."""
    (tmp_path / "bench").mkdir()  # a package named as the project's benchmarks, in the cwd
    (tmp_path / "bench" / "__init__.py").write_text("")
    (tmp_path / "bench" / "inner.py").write_text("import os\nprint(os.getppid())\nraise SystemExit(4)\n")
    (tmp_path / "bench" / "outer.py").write_text(OUTER)
    env = {**os.environ, forked.ENABLE_ENV: fork}
    done = forked.run([sys.executable, "-m", "bench.outer"], cwd=tmp_path, env=env,
                      capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    ran = json.loads(done.stdout)
    assert ran["inner_exit"] == 4 and ran["popen"] == "Routed"
    assert (ran["inner_parent"] != ran["pid"]) == (fork == "1"), ran


WORKER = textwrap.dedent("""
    import json, os, sys, time
    print(json.dumps({"pid": os.getpid(), "parent": os.getppid(), "argv": sys.argv[1:], "cwd": os.getcwd(),
                      "probe": os.environ.get("PROBE"), "path0": sys.path[0]}), flush=True)
    if "--sleep" in sys.argv:
        time.sleep(60)
    raise SystemExit(5)
""")


def start_worker(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    """tests/ray_worker.py as the raylet starts it: ``python ray_worker.py <server> <script> …``."""
    (tmp_path / "worker.py").write_text(WORKER)
    client = Path(forked.__file__).with_name("ray_worker.py")
    return subprocess.Popen([sys.executable, str(client), forked._server_path(),
                             str(tmp_path / "worker.py"), *args], cwd=tmp_path,
                            env={**os.environ, "PROBE": "yes"}, stdout=subprocess.PIPE, text=True)


def test_a_ray_worker_is_forked_from_the_server_and_exits_as_it_did(tmp_path: Path) -> None:
    client = start_worker(tmp_path, "--flag")
    out, _ = client.communicate(timeout=60)
    ran = json.loads(out)
    assert client.returncode == 5
    assert forked._server is not None and ran["parent"] == forked._server.process.pid
    assert ran["argv"] == ["--flag"] and ran["probe"] == "yes" and ran["cwd"] == str(tmp_path)
    assert ran["path0"] == str(tmp_path)  # as `python script` sets it


def test_a_ray_worker_ends_when_the_process_the_raylet_started_is_killed(tmp_path: Path) -> None:
    """The raylet may SIGKILL the process it started, which cannot pass the signal on."""
    client = start_worker(tmp_path, "--sleep")
    assert client.stdout is not None
    worker = json.loads(client.stdout.readline())
    assert worker["parent"] != client.pid
    try:
        ended = os.pidfd_open(worker["pid"])
    except ProcessLookupError:
        pytest.fail("the worker ended before its client was killed")
    client.kill()
    assert client.wait(timeout=60) == -signal.SIGKILL
    client.stdout.close()
    assert select.select([ended], [], [], 60)[0] == [ended], "the worker outlived its client"
    os.close(ended)


@pytest.mark.ray
def test_the_tests_ray_actors_are_forked_from_the_server(ray_nodes: object) -> None:
    """Under a test marked ``ray`` (conftest.py: take_turns), an actor's process comes from this
    process's fork server, with the job's and the actor's own environment."""
    import ray

    assert forked.RAY_JOB_ENV in os.environ
    ray.init(address=ray_nodes.address, logging_level="warning",  # type: ignore[attr-defined]
             runtime_env={"env_vars": {"JOB_SET": "job"}})
    try:
        @ray.remote(num_cpus=0, resources={"engine_node": 0.01})
        class Probe:
            def ran(self) -> tuple[int, str | None, str | None]:
                return os.getppid(), os.environ.get("JOB_SET"), os.environ.get("ACTOR_SET")

        actor = Probe.options(runtime_env={"env_vars": {"ACTOR_SET": "actor"}}).remote()
        parent, job, own = ray.get(actor.ran.remote(), timeout=120)
        assert forked._server is not None and parent == forked._server.process.pid
        assert (job, own) == ("job", "actor")
    finally:
        ray.shutdown()
