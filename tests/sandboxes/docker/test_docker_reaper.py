"""Leaked containers are removed: after a SIGKILL of their owner, periodically, by expiry."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import anyio
import pytest
from conftest import small_config

from sandboxes.docker import DockerSandboxConfig, DockerSandboxPool
from sandboxes.docker.engine import (
    LABEL,
    LABEL_EXPIRES,
    LABEL_HOST,
    LABEL_PID,
    LABEL_RUN,
    LABEL_START,
    Owner,
    is_leaked,
    labelled,
)

pytestmark = pytest.mark.docker
ROOT = Path(__file__).resolve().parents[3]

ORCHESTRATOR = textwrap.dedent("""
    import sys
    import anyio
    from sandboxes.docker import DockerSandboxConfig, DockerSandboxPool

    async def main():
        cfg = DockerSandboxConfig(pool_size=2, run_id=sys.argv[1], lifetime_s=600, memory_mb=128)
        async with DockerSandboxPool(cfg) as pool:
            async with pool.session() as sb:
                await sb.exec("x = 1")
                while len(pool._live) < 3:
                    await anyio.sleep(0.05)
                print("ready", flush=True)
                await anyio.sleep(600)

    anyio.run(main)
""")


def run_containers(client, run_id: str) -> list:
    return [c for c in labelled(client) if c.labels.get(LABEL_RUN) == run_id]


@pytest.mark.anyio
async def test_containers_of_a_sigkilled_orchestrator_are_reaped(docker_client) -> None:
    run_id = "sigkill-" + uuid.uuid4().hex[:8]
    process = subprocess.Popen([sys.executable, "-c", ORCHESTRATOR, run_id], cwd=ROOT,
                               stdout=subprocess.PIPE, text=True)
    try:
        with anyio.fail_after(90):
            line = await anyio.to_thread.run_sync(process.stdout.readline)
        assert line.strip() == "ready"
        assert len(run_containers(docker_client, run_id)) == 3
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
        process.stdout.close()
    leaked = run_containers(docker_client, run_id)
    assert len(leaked) == 3  # no cleanup code ran: the containers outlive their owner
    assert all(is_leaked(c.labels) for c in leaked)
    async with DockerSandboxPool(small_config(pool_size=0)) as pool:  # start-up reaping
        assert pool.stats["reaped"] >= 3
    deadline = time.monotonic() + 20
    while run_containers(docker_client, run_id) and time.monotonic() < deadline:
        await anyio.sleep(0.2)
    assert run_containers(docker_client, run_id) == []


@pytest.mark.anyio
async def test_the_periodic_reaper_removes_a_leak_while_running(docker_client) -> None:
    dead = Owner("leak-" + uuid.uuid4().hex[:8], socket.gethostname(), 2**22 + 7, "1")
    async with DockerSandboxPool(small_config(pool_size=0, reap_interval_s=0.3)) as pool:
        docker_client.containers.run(DockerSandboxConfig().image, ["sleep", "120"], detach=True,
                                     auto_remove=True, network_mode="none",
                                     labels=dead.labels(120))
        assert run_containers(docker_client, dead.run_id)
        # the count lands when the reaper's call returns, which can be after the container is
        # gone from the engine's list (its thread may still be looking at others): wait for both
        deadline = time.monotonic() + 20
        while (run_containers(docker_client, dead.run_id) or pool.stats["reaped"] < 1) \
                and time.monotonic() < deadline:
            await anyio.sleep(0.2)
        assert run_containers(docker_client, dead.run_id) == []
        assert pool.stats["reaped"] >= 1


@pytest.mark.anyio
async def test_shutdown_removes_every_container_of_the_run(docker_client) -> None:
    async with DockerSandboxPool(small_config(pool_size=3)) as pool:
        async with pool.session() as sb:
            await sb.exec("pass")
            while len(pool._live) < 4:
                await anyio.sleep(0.05)
        run_id = pool.run_id
    deadline = time.monotonic() + 20
    while run_containers(docker_client, run_id) and time.monotonic() < deadline:
        await anyio.sleep(0.2)
    assert run_containers(docker_client, run_id) == []


def test_is_leaked_rules() -> None:
    me = Owner.this_process("mine")
    labels = me.labels(600)
    assert not is_leaked(labels)
    assert is_leaked(labels, run_id="mine")
    assert is_leaked({**labels, LABEL_EXPIRES: str(int(time.time()) - 1)})
    assert is_leaked({**labels, LABEL_PID: str(2**22 + 11)})  # no such process
    assert is_leaked({**labels, LABEL_START: "0"})  # the pid was reused by another process
    assert not is_leaked({**labels, LABEL_HOST: "elsewhere", LABEL_PID: "1"})  # only expiry
    assert is_leaked({LABEL: "1"})  # unreadable labels
    assert os.getpid() == int(labels[LABEL_PID])
