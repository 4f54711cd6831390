"""Sandbox configuration: one frozen dataclass whose fields are the keys of conf/sandbox/*.yaml.

Every limit a model's code runs under lives here; nothing an episode passes at run time can
raise it (a call's ``timeout`` and :class:`ExecLimits` only shorten). Defaults are the safe ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from sandboxes.docker.api import ExecLimits


@dataclass(frozen=True)
class SandboxConfig:
    backend: Literal["docker", "local"] = "docker"
    image: str = "polyrl-sandbox:bookworm"  # built by `python -m sandboxes.docker build-image`
    pool_size: int = 4                # warm containers kept ready
    max_containers: int = 64          # live containers at most (waiting beyond)
    max_idle: int = 16                # used containers kept ready for reuse (>= pool_size)
    reuse: bool = True                # reset and reuse a container after a clean episode
    max_uses: int = 50                # episodes per container before it is replaced
    # per call
    timeout_s: float = 10.0           # wall time of a call when none is given
    max_timeout_s: float = 30.0       # a call's own timeout is capped here
    max_output_bytes: int = 65536     # stdout + stderr; more ends the call (output_truncated)
    host_grace_s: float = 3.0         # host deadline = timeout + this; then the container goes
    # per container
    memory_mb: int = 512              # memory limit, swap limit equal (no swap)
    cpus: float = 1.0                 # CPU quota
    pids_limit: int = 128             # processes and threads
    nofile: int = 256                 # open files
    fsize_mb: int = 64                # largest file a process may write
    work_dir: str = "/work"           # the writable tmpfs home and working directory
    work_dir_mb: int = 64
    tmp_mb: int = 16                  # /tmp and /dev/shm tmpfs
    user: str = "1000:1000"           # uid:gid of the code (never root)
    keepalive_user: str = "65534:65534"  # PID 1's uid: another uid, so code cannot kill it
    network: bool = False             # True attaches the default bridge (egress!)
    read_only_root: bool = True
    lifetime_s: int = 3600            # the container exits by itself after this
    # engine
    docker_host: str | None = None    # None: $DOCKER_HOST or unix:///var/run/docker.sock
    docker_call_concurrency: int = 8  # SDK calls in worker threads at once
    reap_interval_s: float = 60.0
    run_id: str | None = None         # label of this run's containers (default: random)

    def __post_init__(self) -> None:
        checks = {
            "pool_size": self.pool_size >= 0, "max_containers": self.max_containers >= 1,
            "max_idle": self.max_idle >= 0,
            "max_uses": self.max_uses >= 1, "timeout_s": self.timeout_s > 0,
            "max_timeout_s": self.max_timeout_s > 0, "max_output_bytes": self.max_output_bytes > 0,
            "host_grace_s": self.host_grace_s >= 0, "memory_mb": self.memory_mb >= 16,
            "cpus": self.cpus > 0, "pids_limit": self.pids_limit >= 8, "nofile": self.nofile >= 16,
            "fsize_mb": self.fsize_mb >= 1, "work_dir_mb": self.work_dir_mb >= 1,
            "tmp_mb": self.tmp_mb >= 1, "lifetime_s": self.lifetime_s >= 60,
            "docker_call_concurrency": self.docker_call_concurrency >= 1,
            "reap_interval_s": self.reap_interval_s > 0,
        }
        for key, good in checks.items():
            if not good:
                raise ValueError(f"sandbox.{key} is out of range: {getattr(self, key)!r}")
        if self.backend not in ("docker", "local"):
            raise ValueError(f"sandbox.backend must be docker or local, got {self.backend!r}")
        if self.user.split(":")[0] in ("0", "root"):
            raise ValueError("sandbox.user must not be root")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SandboxConfig:
        """From a plain mapping (a Hydra node as a dict); ``_target_`` is ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in values.items() if k != "_target_"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sandbox key(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

    def call_limits(self, timeout: float | None, limits: ExecLimits | None) -> tuple[float, int]:
        """(timeout_s, max_output_bytes) of one call: what it asks for, capped by the config."""
        asked = [t for t in (timeout, limits.timeout_s if limits else None) if t is not None]
        timeout_s = min([self.max_timeout_s, *asked]) if asked else min(self.timeout_s,
                                                                         self.max_timeout_s)
        output = self.max_output_bytes
        if limits is not None and limits.max_output_bytes is not None:
            output = min(output, limits.max_output_bytes)
        return max(timeout_s, 0.001), max(output, 0)
