"""A hardened container and what makes it: the ``docker run`` arguments that confine the code
(no network, a read-only root, tmpfs work dirs, no capabilities, a non-root uid, limits on
memory, CPU, processes, files and size, a self-destruct lifetime), the session runner attached
over a long-lived ``docker exec`` (its stdin/stdout socket carries the runner's protocol), and
the host's view of the container's OOM kills."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import docker
from docker.types import Ulimit

from sandboxes import protocol
from sandboxes.docker.channel import RunnerChannel


class Hardening(Protocol):
    """The config values a container is made from (``DockerSandboxConfig``'s)."""

    lifetime_s: int
    keepalive_user: str
    user: str
    network: bool
    read_only_root: bool
    work_dir: str
    work_dir_mb: int
    tmp_mb: int
    pids_limit: int
    runtime: str
    memory_mb: int
    cpus: float
    nofile: int
    fsize_mb: int


class Container:
    """A started container with its runner attached: the unit a session holds and the pool
    resets, reuses or destroys."""

    def __init__(self, container: Any, channel: RunnerChannel, expires: float,
                 outages: int = 0) -> None:
        self.container = container
        self.id: str = container.id
        self.channel = channel
        self.expires = expires
        self.outages = outages  # the engine's outages before its runner stream was attached
        self.uses = 0
        self.broken = False
        # whether its end is accounted for: counted as lost (``faults/sandbox_lost``) or the
        # code's doing. A box that goes unaccounted (an episode cancelled mid-call) is looked
        # at once more as it goes, so a kill from outside is counted however it was found.
        self.accounted = False


def cgroup_oom_kills(container_id: str) -> int | None:
    """The container's memory-cgroup OOM-kill count as the host sees it (None: unknown)."""
    for path in (f"/sys/fs/cgroup/memory/docker/{container_id}/memory.oom_control",
                 f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/memory.events",
                 f"/sys/fs/cgroup/docker/{container_id}/memory.events"):
        try:
            for line in Path(path).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def run_kwargs(cfg: Hardening, name: str, labels: dict[str, str]) -> dict[str, Any]:
    """``containers.run``'s arguments for one sandbox container named ``name``."""
    uid, _, gid = cfg.user.partition(":")
    gid = gid or uid
    return dict(
        command=["sleep", str(cfg.lifetime_s)], detach=True, auto_remove=True, init=True,
        name=name, hostname="sandbox", labels=labels, user=cfg.keepalive_user,
        network_mode="bridge" if cfg.network else "none", read_only=cfg.read_only_root,
        tmpfs={cfg.work_dir: f"rw,nosuid,nodev,size={cfg.work_dir_mb}m,uid={uid},gid={gid},"
                             "mode=0700",
               "/tmp": f"rw,nosuid,nodev,size={cfg.tmp_mb}m,mode=1777"},
        shm_size=f"{cfg.tmp_mb}m", working_dir=cfg.work_dir,
        cap_drop=["ALL"], security_opt=["no-new-privileges"], pids_limit=cfg.pids_limit,
        runtime=cfg.runtime,
        mem_limit=f"{cfg.memory_mb}m", memswap_limit=f"{cfg.memory_mb}m",
        nano_cpus=int(cfg.cpus * 1e9),
        ulimits=[Ulimit(name="nofile", soft=cfg.nofile, hard=cfg.nofile),
                 Ulimit(name="fsize", soft=cfg.fsize_mb << 20, hard=cfg.fsize_mb << 20),
                 Ulimit(name="core", soft=0, hard=0)],
    )


def attach_runner(client: docker.DockerClient, cfg: Hardening, container_id: str) -> Any:
    """Start the session runner in the container as the code's uid: the socket of its
    ``docker exec`` (stdin and stdout), for a :class:`RunnerChannel`."""
    argv = ["python3", "-I", "-c", protocol.RUNNER_SOURCE, "--kill-scope", "uid",
            "--wipe", cfg.work_dir, "--wipe", "/tmp", "--wipe", "/dev/shm"]
    env = {"HOME": cfg.work_dir, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
           "PATH": "/usr/local/bin:/usr/bin:/bin"}
    exec_id = client.api.exec_create(container_id, argv, stdin=True, stdout=True,
                                     stderr=True, tty=False, user=cfg.user,
                                     workdir=cfg.work_dir, environment=env)["Id"]
    return client.api.exec_start(exec_id, socket=True, tty=False)
