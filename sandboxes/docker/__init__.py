"""Docker sandboxes: a warm pool of hardened containers, each episode with its own stateful
Python session, over the blocking ``docker`` SDK (calls in worker threads behind a limiter).
The backend of ``conf/sandbox/docker.yaml`` (``_target_: sandboxes.docker.DockerSandboxConfig``)::

    async with DockerSandboxConfig(pool_size=4).pool() as pool:
        async with pool.session() as sb:
            await sb.exec("x = 21")
            result = await sb.exec("print(x * 2)")      # stdout "42\\n", status "ok"

What is isolated, by default (each a :class:`DockerSandboxConfig` value):
- no network (``network_mode=none``: no egress, no DNS, no metadata endpoint);
- the root filesystem is read-only; the only writable places are size-capped tmpfs mounts
  (the work dir, ``/tmp``, ``/dev/shm``), emptied between episodes;
- code runs as a non-root uid with every capability dropped and ``no-new-privileges``;
  PID 1 (an init reaping zombies, then ``sleep <lifetime>``) runs as another uid;
- memory limit with swap equal to it, a CPU quota, a pids limit (fork and thread bombs),
  ulimits on open files and file size, output capped at N bytes;
- wall time enforced by the runner inside and by a host deadline that destroys the container;
- nothing a call starts outlives it (every process of the code's uid is killed after it).

What is not: with Docker's own runtime (``runtime: runc``) the kernel is shared with the host
(a kernel exploit escapes), as are the CPU caches, the page cache and the engine itself.
``runtime: runsc`` runs the code on gVisor, a user-space kernel, so its system calls never
reach the host's (``scripts/docker_setup.sh`` installs it and registers it with Docker, with
``--network=none``). Under gVisor a resource bomb takes the whole sandbox down, not only the
code's process (the limits are shared with gVisor's own processes): the call ends at the host
deadline as ``timeout`` or ``killed`` with the session reset, not ``oom``; ``pids_limit`` must
leave room for gVisor's threads (>= 128). A runtime the engine does not have is refused in one
line when the pool starts. Containers reused across episodes keep SysV IPC objects; set ``reuse: false`` for a
fresh container per episode. Labels and a self-destruct lifetime let :mod:`.engine`'s reaper
remove containers of a run that died, even by SIGKILL.

The interface (:mod:`sandboxes.api`), the limits every backend shares (:mod:`sandboxes.config`)
and the session runner with its protocol (:mod:`sandboxes.runner`, :mod:`sandboxes.protocol`)
live one level up; this package holds only what is Docker.
"""

from __future__ import annotations

from sandboxes.docker.pool import DockerSandboxConfig, DockerSandboxPool
from sandboxes.docker.sandbox import DockerSandbox

__all__ = ["DockerSandbox", "DockerSandboxConfig", "DockerSandboxPool"]
