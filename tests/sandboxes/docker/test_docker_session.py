"""The pool and its sessions against a real engine: state, statuses, limits, labels, reuse."""

from __future__ import annotations

import os
import time

import anyio
import pytest
from conftest import GRACE_S, SLACK_S, STRAYS, TIMEOUT_S, small_config

from sandboxes.api import EngineUnavailable, ExecLimits, ImageMissing, SandboxConfigError
from sandboxes.config import make_sandbox_pool, sandbox_config
from sandboxes.docker import DockerSandboxConfig, DockerSandboxPool
from sandboxes.docker.engine import LABEL, LABEL_EXPIRES, LABEL_PID, LABEL_RUN

pytestmark = [pytest.mark.anyio, pytest.mark.docker]



async def test_state_persists_within_an_episode(pool: DockerSandboxPool) -> None:
    async with pool.session() as sb:
        assert (await sb.exec("x = 20\ndef f(y):\n    return x + y")).ok
        r = await sb.exec("print('sum', f(1))\nf(2)")
        assert (r.stdout, r.status, r.exit_code) == ("sum 21\n22\n", "ok", 0)
        r = await sb.exec("1/0")
        assert r.status == "ok" and r.exit_code == 1 and "ZeroDivisionError" in r.stderr
        assert "kernel_loop" not in r.stderr  # only the user's frames
        r = await sb.exec("echo $HOME; id -u; exit 3", language="shell")
        assert (r.stdout, r.exit_code) == ("/work\n1000\n", 3)
        assert (await sb.exec("x")).stdout == "20\n"  # shell calls leave the session alone
        r = await sb.exec("raise SystemExit(4)")
        assert r.exit_code == 4 and not r.session_reset
        assert (await sb.exec("x")).stdout == "20\n"


async def test_episodes_do_not_share_state(pool: DockerSandboxPool) -> None:
    async with pool.session() as a, pool.session() as b:
        await a.exec("secret = 1")
        r = await b.exec("secret")
        assert "NameError" in r.stderr


async def test_hardening_is_applied(pool: DockerSandboxPool, docker_client) -> None:
    async with pool.session() as sb:
        await sb.exec("pass")
        box = sb._container
        attrs = docker_client.api.inspect_container(box.id)
    host = attrs["HostConfig"]
    assert host["ReadonlyRootfs"] and host["Init"] and host["AutoRemove"]
    assert host["CapDrop"] == ["ALL"] and "no-new-privileges" in host["SecurityOpt"]
    assert host["NetworkMode"] == "none" and host["PidsLimit"] == pool.config.pids_limit
    assert host["Runtime"] == pool.config.runtime
    assert host["Memory"] == host["MemorySwap"] == 192 << 20
    assert host["NanoCpus"] == 10**9 and not host["Privileged"]
    assert {u["Name"] for u in host["Ulimits"]} >= {"nofile", "fsize"}
    assert "/work" in host["Tmpfs"] and "size=16m" in host["Tmpfs"]["/work"]
    labels = attrs["Config"]["Labels"]
    assert labels[LABEL] == "1" and labels[LABEL_RUN] == pool.run_id
    assert int(labels[LABEL_PID]) > 0 and float(labels[LABEL_EXPIRES]) > time.time()
    assert attrs["Config"]["User"] == "65534:65534"


async def test_timeout_argument_is_capped_by_config(pool: DockerSandboxPool) -> None:
    """A model passing its own timeout (e.g. through tool arguments) cannot extend the limit."""
    async with pool.session() as sb:
        start = time.monotonic()
        r = await sb.exec("while True: pass", timeout=10_000,
                          limits=ExecLimits(timeout_s=10_000, max_output_bytes=10**12))
        assert r.status == "timeout" and time.monotonic() - start < TIMEOUT_S + SLACK_S
    cfg = small_config()
    assert cfg.call_limits(10_000, None) == (TIMEOUT_S, cfg.max_output_bytes)
    assert cfg.call_limits(0.5, ExecLimits(max_output_bytes=10)) == (0.5, 10)


async def test_host_deadline_destroys_a_wedged_container(pool: DockerSandboxPool) -> None:
    """The runner itself stopped (SIGSTOP): only the host-side deadline can end the call."""
    async with pool.session() as sb:
        await sb.exec("y = 1")
        start = time.monotonic()
        r = await sb.exec("import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\n"
                          "while True: pass")
        took = time.monotonic() - start
        assert r.status == "timeout" and r.session_reset
        assert TIMEOUT_S + GRACE_S - 0.5 < took < TIMEOUT_S + GRACE_S + SLACK_S
        r = await sb.exec("y")  # a fresh container, a fresh namespace
        assert "NameError" in r.stderr
        assert (await sb.exec("print('alive')")).stdout == "alive\n"


async def test_killed_runner_gives_killed_and_a_fresh_session(pool: DockerSandboxPool) -> None:
    async with pool.session() as sb:
        r = await sb.exec("kill -9 -1", language="shell")
        assert r.status == "killed" and r.session_reset
        assert (await sb.exec("print(2 + 2)")).stdout == "4\n"


async def test_clean_container_is_reset_and_reused(docker_client) -> None:
    async with DockerSandboxPool(small_config(max_containers=1)) as pool:
        async with pool.session() as sb:
            await sb.exec("open('/work/left', 'w').write('x'); open('/tmp/t', 'w').write('y')")
            await sb.exec("sleep 300 &", language="shell")
            first = sb._container.id
        async with pool.session() as sb:
            r = await sb.exec("import os\nprint(os.listdir('/work'), os.listdir('/tmp'))\n"
                              + STRAYS)
            assert sb._container.id == first  # the same container, reset
            assert r.stdout == "[] []\n[]\n"
        assert pool.stats["reused"] >= 1


async def test_run_is_a_session_of_one_call(pool: DockerSandboxPool) -> None:
    r = await pool.run("print('once')")
    assert r.ok and r.stdout == "once\n"


async def test_make_sandbox_pool_from_a_mapping(docker_client) -> None:
    target = "sandboxes.docker.DockerSandboxConfig"
    async with make_sandbox_pool({"_target_": target, "pool_size": 0, "timeout_s": 2.0}) as p:
        assert isinstance(p, DockerSandboxPool)
        assert (await p.run("6 * 7")).stdout == "42\n"
    assert isinstance(make_sandbox_pool(None), DockerSandboxPool)  # None: the Docker defaults
    with pytest.raises(SandboxConfigError, match="sandbox.memroy_mb is not a key"):
        make_sandbox_pool({"_target_": target, "memroy_mb": 1})


async def test_no_engine_is_one_clear_line() -> None:
    cfg = DockerSandboxConfig(docker_host="unix:///nonexistent/docker.sock")
    with pytest.raises(EngineUnavailable) as e:
        async with DockerSandboxPool(cfg):
            pass
    message = str(e.value)
    assert "\n" not in message and "scripts/docker_setup.sh" in message
    assert "unix:///nonexistent/docker.sock" in message


async def test_missing_image_names_the_build_command(docker_client) -> None:
    with pytest.raises(ImageMissing, match="build-image"):
        async with DockerSandboxPool(DockerSandboxConfig(image="polyrl-no-such-image:0")):
            pass


async def test_an_unknown_runtime_is_refused_in_one_line(docker_client) -> None:
    with pytest.raises(SandboxConfigError) as e:
        async with DockerSandboxPool(small_config(runtime="polyrl-no-such-runtime")):
            pass
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("sandbox.runtime=polyrl-no-such-runtime is not a runtime of the "
                              "Docker engine at ")
    assert "runc" in message and "sandbox.runtime=runc" in message


async def test_the_runtime_is_the_one_configured(docker_client) -> None:
    """Under runc the code sees the host's kernel; under runsc gVisor's, which calls itself
    Linux 4.4.0."""
    runtimes = docker_client.info().get("Runtimes") or {}
    code = "import os\nprint(os.uname().release)"
    host = os.uname().release
    for runtime in ("runc", "runsc"):
        if runtime not in runtimes:
            continue
        config = small_config(runtime=runtime, pool_size=0, pids_limit=128)
        async with DockerSandboxPool(config) as pool, pool.session() as sb:
            r = await sb.exec(code)
        assert r.status == "ok", r.stderr
        assert r.stdout == ("4.4.0\n" if runtime == "runsc" else f"{host}\n"), (runtime, r.stdout)


def test_config_rejects_root_and_nonsense() -> None:
    with pytest.raises(SandboxConfigError, match="sandbox.user must be a uid other than root"):
        DockerSandboxConfig(user="0:0")
    with pytest.raises(SandboxConfigError, match="sandbox.pids_limit must be >= 8, got 0"):
        DockerSandboxConfig(pids_limit=0)
    with pytest.raises(SandboxConfigError, match="sandbox.network must be true or false"):
        sandbox_config({"_target_": "sandboxes.docker.DockerSandboxConfig", "network": "no"})


async def test_the_image_has_the_standard_library(pool: DockerSandboxPool) -> None:
    async with pool.session() as sb:
        r = await sb.exec("import json, re, ctypes, collections, math, sqlite3\n"
                          "print(json.dumps(collections.Counter('aab')), math.isqrt(17))")
        assert (r.status, r.stdout) == ("ok", '{"a": 2, "b": 1} 4\n'), r.stderr


async def test_a_segfault_is_killed_on_time_and_the_session_goes_on(
        pool: DockerSandboxPool) -> None:
    async with pool.session() as sb:
        await sb.exec("kept = 1")
        start = time.monotonic()
        r = await sb.exec("import ctypes\nctypes.string_at(0)")
        assert time.monotonic() - start < TIMEOUT_S + SLACK_S
        assert (r.status, r.exit_code, r.session_reset) == ("killed", 128 + 11, True)
        assert "Segmentation fault" in r.stderr and '"<cell>", line 2' in r.stderr
        assert "NameError" in (await sb.exec("kept")).stderr  # a fresh namespace
        assert (await sb.exec("print('next')")).stdout == "next\n"


async def test_parallel_calls_in_one_session_are_serialised(pool: DockerSandboxPool) -> None:
    async with pool.session() as sb:
        await sb.exec("n = 0")
        async with anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(sb.exec, "n += 1")
        assert (await sb.exec("n")).stdout == "10\n"


async def test_a_kernel_that_exits_between_calls_is_replaced(pool: DockerSandboxPool) -> None:
    async with pool.session() as sb:
        r = await sb.exec("import os, threading, time\n"
                          "threading.Thread(target=lambda: (time.sleep(0.2), os._exit(3))).start()")
        assert r.ok
        await anyio.sleep(0.5)
        start = time.monotonic()
        r = await sb.exec("while True: pass")  # the fresh kernel's deadline still holds
        assert r.status == "timeout" and time.monotonic() - start < TIMEOUT_S + SLACK_S
        assert (await sb.exec("print('\ud800 ok')")).stdout.endswith(" ok\n")  # lone surrogate
