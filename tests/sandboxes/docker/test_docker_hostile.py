"""Hostile model-written code against the real engine. Each case must end on time with the
right status, leave the host and the other sandboxes alone, leave nothing running into the
next call or episode, and leave the pool healthy.

Under gVisor (``POLYRL_SANDBOX_RUNTIME=runsc``, see conftest.py) some outcomes differ and the
tests say how: a fork, thread or memory bomb exhausts the container's limits, which gVisor's
own kernel (the sentry, one set of host processes) shares with the code, so the whole sandbox
dies and the host finds it at its deadline (``timeout`` or ``killed``, the session reset)
rather than the code's process alone (``oom``, a thread cap); writes to the read-only root are
refused as "Permission denied"; ``unshare -U`` succeeds, because gVisor's user namespaces
are its own, not the host kernel's; and the code may read PID 1's environment (Docker's PATH,
HOSTNAME and HOME: nothing else is there)."""

from __future__ import annotations

import ast
import time

import anyio
import pytest
from conftest import RUNTIME, SLACK_S, STRAYS, TIMEOUT_S, small_config

from sandboxes.api import ExecResult
from sandboxes.docker import DockerSandboxPool

pytestmark = [pytest.mark.anyio, pytest.mark.docker]

DEADLINE_S = TIMEOUT_S + SLACK_S  # "on time": the limit plus generous slack for a busy CI box
GVISOR = RUNTIME == "runsc"
SANDBOX_DIED = ("timeout", "killed")  # gVisor: the whole sandbox went, found at the deadline


async def timed(sb, code: str, **kwargs) -> tuple[ExecResult, float]:
    start = time.monotonic()
    result = await sb.exec(code, **kwargs)
    took = time.monotonic() - start
    assert took < DEADLINE_S, f"{code!r} took {took:.1f} s"
    return result, took


async def assert_clean(sb) -> None:
    """Nothing of the code's uid is left running beside the runner."""
    r = await sb.exec(STRAYS)
    assert r.stdout == "[]\n", (r.stdout, r.stderr, r.status)


async def assert_healthy(pool: DockerSandboxPool) -> None:
    async with pool.session() as sb:
        r = await sb.exec("print(sum(range(10)))")
        assert (r.status, r.stdout) == ("ok", "45\n")
        await assert_clean(sb)


@pytest.fixture
async def pool(docker_client):
    async with DockerSandboxPool(small_config(pool_size=2)) as p:
        yield p
        await assert_healthy(p)


@pytest.mark.parametrize("code,language", [
    ("while True: pass", "python"),
    ("import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: pass", "python"),
    ("trap '' TERM INT; while :; do :; done", "shell"),
    ("sleep 1000", "shell"),
])
async def test_infinite_loops_time_out(pool, code: str, language: str) -> None:
    async with pool.session() as sb:
        r, took = await timed(sb, code, language=language)
        assert r.status == "timeout" and r.exit_code is None
        assert took >= TIMEOUT_S - 0.1
        await assert_clean(sb)


async def _forking(docker_client, sb, processes: int = 16) -> None:
    """Return once ``sb``'s container runs ``processes`` processes (its bomb is going off),
    read from the engine (``docker top``): the container itself can start nothing then."""
    while True:  # polls of the engine's count, bounded by the caller's fail_after
        container = sb._container  # once the call has its container
        if container is not None:
            top = await anyio.to_thread.run_sync(docker_client.api.top, container.id)
            if len(top.get("Processes") or ()) >= processes:
                return
        await anyio.sleep(0.05)


BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"


async def test_fork_bomb(docker_client) -> None:
    # the first bomb may run 60 s, so that a busy host's slow dispatch cannot outlast it: the
    # neighbour must answer while it goes off (then it is cancelled, its container removed)
    async with (DockerSandboxPool(small_config(max_timeout_s=60.0)) as pool,
                pool.session() as sb, pool.session() as neighbour):
        await neighbour.exec("v = 'untouched'")
        bomb_ended = anyio.Event()

        async def bomb() -> None:
            await sb.exec(BOMB, timeout=60.0)
            bomb_ended.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(bomb)
            with anyio.fail_after(DEADLINE_S):  # from before the call reaches the container
                await _forking(docker_client, sb)
            r, _ = await timed(neighbour, "print(v)")
            assert (r.status, r.stdout) == ("ok", "untouched\n")
            assert not bomb_ended.is_set()  # served while the bomb went off, not after it
            tg.cancel_scope.cancel()
        r, _ = await timed(sb, BOMB)  # in a fresh container, at the usual limit
        assert r.status in SANDBOX_DIED if GVISOR else r.status == "timeout"
        await assert_clean(sb)
        r, _ = await timed(sb, ":(){ :|:& };:", language="shell")
        assert r.status in ("ok", "timeout")
        await assert_clean(sb)


async def test_thread_bomb(pool) -> None:
    async with pool.session() as sb:
        code = ("import threading, time\nn = 0\ntry:\n    while True:\n"
                "        threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()\n"
                "        n += 1\nexcept RuntimeError:\n    print('capped', n)")
        r, _ = await timed(sb, code)
        if GVISOR:
            assert r.status in SANDBOX_DIED and r.session_reset
        else:
            assert r.status == "ok" and r.stdout.startswith("capped")
            assert int(r.stdout.split()[1]) < 64  # the pids limit held
        assert (await sb.exec("print('still here')")).stdout == "still here\n"


async def test_memory_bomb(pool) -> None:
    async with pool.session() as sb, pool.session() as neighbour:
        await sb.exec("keep = 1")
        await neighbour.exec("mine = list(range(1000))")
        r, _ = await timed(sb, "blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))")
        if GVISOR:
            assert r.status in SANDBOX_DIED and r.session_reset
        else:
            assert r.status == "oom" and r.exit_code == 137 and r.session_reset
        assert (await neighbour.exec("sum(mine)")).stdout == "499500\n"
        assert (await sb.exec("print('after')")).stdout == "after\n"
        r, _ = await timed(sb, "python3 -c 'x = bytearray(10**9)'", language="shell")
        assert r.status in ("oom", "ok", *(SANDBOX_DIED if GVISOR else ())) and r.exit_code != 0
        await assert_clean(sb)


@pytest.mark.parametrize("code,language", [
    ("import os\nfor _ in range(1000):\n    os.write(1, b'x' * 10**6)", "python"),  # 1 GB
    ("yes", "shell"),
    ("head -c 1000000000 /dev/zero", "shell"),
    ("import sys\nwhile True: sys.stderr.write('e' * 4096)", "python"),
])
async def test_flooding_output_is_truncated(pool, code: str, language: str) -> None:
    async with pool.session() as sb:
        r, _ = await timed(sb, code, language=language)
        assert r.status == "output_truncated"
        assert len(r.stdout.encode()) + len(r.stderr.encode()) <= 1 << 16
        await assert_clean(sb)


async def test_invalid_utf8_and_nul_bytes(pool) -> None:
    async with pool.session() as sb:
        r, _ = await timed(sb, "import os\nos.write(1, b'a\\x00b\\xff\\xfe\\xc3(c')\n"
                               "n = os.write(2, b'\\x80err\\x00')")
        assert r.status == "ok" and r.exit_code == 0
        assert r.stdout == "a\x00b\ufffd\ufffd\ufffd(c" and r.stderr == "\ufffderr\x00"
        r, _ = await timed(sb, "printf 'x\\377\\000y'", language="shell")
        assert r.stdout == "x\ufffd\x00y"


async def test_background_child_holding_stdout_and_setsid_daemon(pool) -> None:
    async with pool.session() as sb:
        r, took = await timed(sb, "echo now; (sleep 30; echo late) &", language="shell")
        assert (r.status, r.stdout) == ("ok", "now\n") and took < TIMEOUT_S
        r, took = await timed(sb, "setsid sh -c 'sleep 100' > /dev/null 2>&1 < /dev/null &"
                                  "\necho daemon", language="shell")
        assert r.stdout == "daemon\n" and took < TIMEOUT_S
        r, took = await timed(sb, "import subprocess\n"
                                  "subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
                                  "print('spawned')")
        assert r.stdout == "spawned\n" and took < TIMEOUT_S
        await assert_clean(sb)
        r, _ = await timed(sb, "import time\ntime.sleep(0.5)\nprint('quiet')")
        assert r.stdout == "quiet\n"  # nothing "late" leaks into a later call


async def test_disk_fill(pool, docker_client) -> None:
    async with pool.session() as sb:
        r, _ = await timed(sb, "dd if=/dev/zero of=/work/big bs=1M count=1000 2>&1; echo rc=$?",
                           language="shell")
        assert "rc=0" not in r.stdout  # the fsize ulimit or the tmpfs cap stopped it
        r, _ = await timed(sb, "f = open('/work/many', 'wb')\nwhile True: f.write(b'x' * 2**20)")
        assert r.status == "ok" and r.exit_code == 1
        assert "File too large" in r.stderr or "No space left" in r.stderr
        r, _ = await timed(sb, "i = 0\nwhile True:\n    open(f'/tmp/f{i}', 'wb').write(b'x' * 2**20)"
                               "\n    i += 1")
        assert "No space left" in r.stderr
        r, _ = await timed(sb, "echo x > /etc/x; echo x > /x; echo rc=$?", language="shell")
        assert ("Permission denied" if GVISOR else "Read-only file system") in r.stderr
        assert "rc=0" not in r.stdout
        # The host disk is untouched: the writes went to the container's tmpfs mounts (memory),
        # none to its writable layer or a host path. Read from the container itself: the
        # host's disk usage moves with whatever else runs (a parallel test's checkpoint).
        container = sb._container
        assert container is not None
        [info] = await anyio.to_thread.run_sync(lambda: docker_client.api.containers(
            filters={"id": container.id}, size=True))  # its writable layer's bytes (0: left out)
        assert info.get("SizeRw", 0) < 1 << 20, info
        assert all(m["Type"] == "tmpfs" for m in info["Mounts"]), info["Mounts"]


async def test_no_network(pool) -> None:
    code = """
import socket
out = []
for host, port in [('1.1.1.1', 80), ('169.254.169.254', 80), ('8.8.8.8', 53)]:
    s = socket.socket()
    s.settimeout(1)
    try:
        s.connect((host, port))
        out.append(host + ' open')
    except OSError as e:
        out.append(host + ' blocked')
    finally:
        s.close()
try:
    socket.getaddrinfo('example.com', 80)
    out.append('dns resolved')
except OSError:
    out.append('dns blocked')
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    u.sendto(b'x', ('8.8.8.8', 53))
    out.append('udp sent')
except OSError:
    out.append('udp blocked')
print(sorted(i for i in socket.if_nameindex()), out)
"""
    async with pool.session() as sb:
        r, _ = await timed(sb, code)
        assert r.status == "ok", r.stderr
        assert "open" not in r.stdout and "resolved" not in r.stdout and "sent" not in r.stdout
        assert "'eth0'" not in r.stdout  # only the loopback interface exists


async def test_privilege_probes(pool) -> None:
    probes = {
        "mount -t tmpfs none /work 2>&1; echo rc=$?": "rc=0",
        "unshare -U -r true 2>&1; echo rc=$?": "rc=0",
        "unshare -m true 2>&1; echo rc=$?": "rc=0",
        "echo 1 > /sys/kernel/mm/transparent_hugepage/enabled 2>&1; echo rc=$?": "rc=0",
        "echo c > /proc/sysrq-trigger 2>&1; echo rc=$?": "rc=0",
        "ls /var/run/docker.sock /run/docker.sock 2>&1; echo rc=$?": "rc=0",
        "kill -9 1 2>&1; echo rc=$?": "rc=0",
        "cat /proc/1/environ 2>&1; echo rc=$?": "rc=0",
        "grep CapEff /proc/self/status": "CapEff:\t00000000000001",
        "grep NoNewPrivs /proc/self/status": "NoNewPrivs:\t0",
    }
    if GVISOR:
        del probes["unshare -U -r true 2>&1; echo rc=$?"]  # gVisor's own user namespace
        # gVisor lets another uid read PID 1's environment: it must hold nothing but Docker's
        del probes["cat /proc/1/environ 2>&1; echo rc=$?"]
        async with pool.session() as sb:
            r, _ = await timed(sb, "open('/proc/1/environ').read().split(chr(0))")
            assert {v.partition("=")[0] for v in ast.literal_eval(r.stdout) if v} <= {
                "PATH", "HOSTNAME", "HOME"}
    async with pool.session() as sb:
        for cmd, forbidden in probes.items():
            r, _ = await timed(sb, cmd, language="shell")
            assert forbidden not in r.stdout, (cmd, r.stdout)
        r, _ = await timed(sb, "id -u; grep CapEff /proc/self/status", language="shell")
        assert r.stdout.split()[0] == "1000" and "0000000000000000" in r.stdout
        r, _ = await timed(sb, "import os\nprint(os.path.exists('/var/run/docker.sock'),"
                               " os.getuid(), os.geteuid())")
        assert r.stdout == "False 1000 1000\n"


async def test_overwriting_bin_is_refused_and_unseen_by_the_next_episode(pool) -> None:
    async with pool.session() as sb:
        r, _ = await timed(sb, "cp /bin/true /bin/ls 2>&1; echo 'echo pwned' > /bin/ls 2>&1;"
                               " ln -sf /bin/true /usr/bin/python3 2>&1; echo done",
                           language="shell")
        assert "done" in r.stdout and ("Read-only" in r.stdout or "denied" in r.stdout)
    async with pool.session() as sb:
        r, _ = await timed(sb, "ls / | head -3; python3 -c 'print(7)'", language="shell")
        assert "pwned" not in r.stdout and r.stdout.endswith("7\n")


async def test_tampering_with_the_runner_only_hurts_the_caller(pool) -> None:
    async with pool.session() as victim, pool.session() as attacker:
        await victim.exec("mine = 'safe'")
        r, _ = await timed(attacker, "kill -9 -1", language="shell")
        assert r.status == "killed"
        r, _ = await timed(attacker, "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")
        assert r.status == "killed"
        assert (await victim.exec("mine")).stdout == "'safe'\n"


async def test_sixty_four_episodes_in_parallel(docker_client) -> None:
    results: dict[int, tuple[str, str]] = {}

    async def episode(i: int) -> None:
        async with pool.session() as sb:
            await sb.exec(f"me = {i}")
            a = await sb.exec("import time\ntime.sleep(0.05)\nprint(me * 2)")
            b = await sb.exec(f"echo {i} > /work/id; cat /work/id", language="shell")
            results[i] = (a.stdout, b.stdout)

    start = time.monotonic()
    async with DockerSandboxPool(small_config(pool_size=4, max_containers=16)) as pool:
        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(episode, i)
        assert results == {i: (f"{2 * i}\n", f"{i}\n") for i in range(64)}
        assert len(pool._live) <= 16
        assert pool.stats["created"] <= 16 + 4  # episodes reuse reset containers
        await assert_healthy(pool)
    assert time.monotonic() - start < 240
