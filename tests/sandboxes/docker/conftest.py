"""Fixtures for the Docker sandbox tests: a real engine (never a mock), small fast limits,
and a session-wide check that no container carrying the project's label outlives the tests.

``POLYRL_SANDBOX_RUNTIME=runsc`` runs every pool of these tests under that OCI runtime (gVisor)
instead of Docker's own runc: ``POLYRL_SANDBOX_RUNTIME=runsc pytest tests/sandboxes/docker``.
The tests skip in one line when the engine does not have it registered."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest

from sandboxes.api import EngineUnavailable
from sandboxes.docker import DockerSandboxConfig, DockerSandboxPool
from sandboxes.docker.engine import LABEL_PID, connect, is_leaked, labelled

# Generous for a loaded 2-core machine; the limits under test are far tighter than the slack.
TIMEOUT_S = 2.0
GRACE_S = 3.0
SLACK_S = 6.0
RUNTIME = os.environ.get("POLYRL_SANDBOX_RUNTIME", "runc")  # every test pool's OCI runtime


# the processes of the code's uid other than the runner's supervisor and kernel, as a list
# (Python source; its value is echoed)
STRAYS = ("import os\n"
          "def alive(p):\n"
          "    try:\n"
          "        stat = open(f'/proc/{p}/stat').read()\n"
          "        uid = os.stat(f'/proc/{p}').st_uid\n"
          "    except OSError:\n"
          "        return False\n"
          "    return stat[stat.rfind(')') + 2] != 'Z' and uid == os.getuid()\n"
          "([p for p in os.listdir('/proc') if p.isdigit() and alive(p) and"
          " int(p) not in (os.getpid(), os.getppid())])")


def _engine_or_none():
    try:
        return connect()
    except EngineUnavailable:
        return None


@pytest.fixture(scope="session")
def docker_client() -> Iterator:
    client = _engine_or_none()
    if client is None:
        pytest.skip("no Docker engine; start one with `bash scripts/docker_setup.sh`")
    image = DockerSandboxConfig().image
    if not any(image in i.tags for i in client.images.list()):
        pytest.skip(f"image {image} missing; run `python -m sandboxes.docker build-image`")
    if RUNTIME not in (client.info().get("Runtimes") or {}):
        pytest.skip(f"POLYRL_SANDBOX_RUNTIME={RUNTIME} is not registered with the engine; "
                    f"`bash scripts/docker_setup.sh` registers runsc")
    yield client
    client.close()


@pytest.fixture(scope="session", autouse=True)
def no_leaked_containers() -> Iterator[None]:
    """After the whole test session, zero containers carry the project's label."""
    yield
    client = _engine_or_none()
    if client is None:
        return
    try:
        import time

        deadline = time.monotonic() + 20  # auto-remove finishes asynchronously
        while time.monotonic() < deadline and any(
                c.labels.get(LABEL_PID) == str(os.getpid()) or is_leaked(c.labels)
                for c in labelled(client)):
            time.sleep(0.2)
        # ours, or anyone's leak; a concurrent live run's containers (another process on a
        # shared engine) are not this session's to judge
        left = [c.name for c in labelled(client)
                if c.labels.get(LABEL_PID) == str(os.getpid()) or is_leaked(c.labels)]
    finally:
        client.close()
    assert not left, f"containers left behind: {left}"


def small_config(**overrides) -> DockerSandboxConfig:
    values = dict(pool_size=1, max_containers=8, timeout_s=TIMEOUT_S, max_timeout_s=TIMEOUT_S,
                  host_grace_s=GRACE_S, memory_mb=192, pids_limit=128 if RUNTIME == "runsc" else 64,
                  cpus=1.0,
                  max_output_bytes=1 << 16, work_dir_mb=16, tmp_mb=8, fsize_mb=8,
                  lifetime_s=600, runtime=RUNTIME)
    values.update(overrides)
    return DockerSandboxConfig(**values)


@pytest.fixture
async def pool(docker_client) -> AsyncIterator[DockerSandboxPool]:
    async with DockerSandboxPool(small_config()) as p:
        yield p
