"""Docker sandboxes: a warm pool of hardened containers, each episode with its own stateful
Python session, over the blocking ``docker`` SDK (calls in worker threads behind a limiter).

    async with make_sandbox_pool({"image": "polyrl-sandbox:bookworm"}) as pool:
        async with pool.session() as sb:
            await sb.exec("x = 21")
            result = await sb.exec("print(x * 2)")      # stdout "42\\n", status "ok"

What is isolated, by default (each a :class:`SandboxConfig` value):
- no network (``network_mode=none``: no egress, no DNS, no metadata endpoint);
- the root filesystem is read-only; the only writable places are size-capped tmpfs mounts
  (the work dir, ``/tmp``, ``/dev/shm``), emptied between episodes;
- code runs as a non-root uid with every capability dropped and ``no-new-privileges``;
  PID 1 (an init reaping zombies, then ``sleep <lifetime>``) runs as another uid;
- memory limit with swap equal to it, a CPU quota, a pids limit (fork and thread bombs),
  ulimits on open files and file size, output capped at N bytes;
- wall time enforced by the runner inside and by a host deadline that destroys the container;
- nothing a call starts outlives it (every process of the code's uid is killed after it).

What is not: the kernel is shared with the host (a kernel exploit escapes; use gVisor or a VM
runtime for untrusted adversaries), as are the CPU caches, the page cache and the engine
itself. Containers reused across episodes keep SysV IPC objects; set ``reuse: false`` for a
fresh container per episode. Labels and a self-destruct lifetime let :mod:`.engine`'s reaper
remove containers of a run that died, even by SIGKILL.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sandboxes.docker.api import (
    STATUSES,
    EngineUnavailable,
    ExecLimits,
    ExecResult,
    ExecStatus,
    ImageMissing,
    Sandbox,
    SandboxError,
    SandboxPool,
)
from sandboxes.docker.config import SandboxConfig
from sandboxes.docker.pool import DockerSandbox, DockerSandboxPool


def make_sandbox_pool(config: SandboxConfig | Mapping[str, Any] | None = None) -> SandboxPool:
    """The pool a config asks for (``backend: docker`` or ``local``); open it with ``async with``."""
    if config is None:
        config = SandboxConfig()
    elif not isinstance(config, SandboxConfig):
        config = SandboxConfig.from_mapping(config)
    if config.backend == "local":
        from sandboxes.local import LocalSandboxPool

        return LocalSandboxPool(config)
    return DockerSandboxPool(config)


__all__ = ["STATUSES", "DockerSandbox", "DockerSandboxPool", "EngineUnavailable", "ExecLimits",
           "ExecResult", "ExecStatus", "ImageMissing", "Sandbox", "SandboxConfig",
           "SandboxError", "SandboxPool", "make_sandbox_pool"]
