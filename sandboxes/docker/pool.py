"""The Docker backend's config and its warm container pool. ``DockerSandboxConfig`` sits here,
beside the pool its ``pool()`` builds, as a backend's config does (see :mod:`sandboxes.config`).
The pool's parts live beside it: a container and its hardening (:mod:`.containers`), an
episode's sandbox (:mod:`.sandbox`) and the breaker around the engine's outages
(:mod:`.outage`).

``DockerSandboxPool`` keeps ``pool_size`` hardened containers started, each with the session
runner attached over a long-lived ``docker exec`` whose stdin/stdout socket carries the
runner's length-prefixed protocol; a call is one round trip on that socket (no new exec, no
thread), which is why a session call costs milliseconds instead of a ``docker exec``'s ~70 ms.
``pool.session()`` hands an episode its own container; afterwards the container is reset
(every process of the code's uid killed, the tmpfs dirs emptied, a fresh interpreter) and
reused, or destroyed when anything about it is in doubt: a lost runner, a host-side timeout,
a failed reset, ``max_uses`` reached, less than half its lifetime left.

Time is enforced twice. The runner kills a call at its deadline; the host waits for the answer
``host_grace_s`` longer and then destroys the container (docker-py's exec has no timeout and
killing an exec's client leaves its process running, so the container is the unit that dies).
OOM kills of exec'd processes do not set Docker's ``OOMKilled``; the runner reads the memory
cgroup's ``oom_kill`` counter inside, and the host reads the container's cgroup when the
runner itself was lost.

An engine outage is waited out for ``engine_grace_s`` (:mod:`.outage`); past that the pool
is lost, and shutdown leaves the containers to the reaper of the next start (and to their own
lifetime) instead of waiting on a dead engine.

A container that disappears under a call (``docker kill``: not the code's doing, since its
PID 1 runs as another uid), or whose runner stream an engine outage cut, is lost, not a
``killed`` result: the call runs once more in a fresh container (the session's state is gone:
``session_reset``), counted as ``faults/sandbox_lost``. So is one killed between an
episode's calls (found at its reset), after its last call (found when it goes), or while it
waits warm (the pool looks at its containers every ``warm_check_s`` and replaces a dead one
before an episode meets it): a fault no call met is still a fault the run reports. :meth:`DockerSandboxPool.metrics`
has both counters.
"""

from __future__ import annotations

import itertools
import logging
import re
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Self

import anyio
import anyio.lowlevel
import docker
import docker.errors

from sandboxes import protocol
from sandboxes.api import EngineUnavailable, SandboxError, SandboxPool
from sandboxes.config import SandboxConfig
from sandboxes.docker import engine
from sandboxes.docker.channel import RunnerChannel, RunnerGone
from sandboxes.docker.containers import Container, attach_runner, run_kwargs
from sandboxes.docker.image import DEFAULT_IMAGE
from sandboxes.docker.outage import ENGINE_ERRORS, EngineLink
from sandboxes.docker.sandbox import DockerSandbox

log = logging.getLogger(__name__)
GONE_RECHECK_S = 0.5   # a container still running after its runner vanished: looked at again
_RUNTIME_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
__all__ = ["DockerSandbox", "DockerSandboxConfig", "DockerSandboxPool"]


@dataclass(frozen=True, kw_only=True)
class DockerSandboxConfig(SandboxConfig):
    """The keys of ``conf/sandbox/docker.yaml`` beyond the limits every backend honours."""

    image: str = DEFAULT_IMAGE        # built by `python -m sandboxes.docker build-image`
    pool_size: int = 4                # warm containers kept ready
    max_containers: int = 64          # live containers at most (waiting beyond)
    max_idle: int = 16                # used containers kept ready for reuse (>= pool_size)
    reuse: bool = True                # reset and reuse a container after a clean episode
    max_uses: int = 50                # episodes per container before it is replaced
    # per container (memory_mb, fsize_mb, nofile: see SandboxConfig)
    cpus: float = 1.0                 # CPU quota
    pids_limit: int = 128             # processes and threads
    work_dir: str = "/work"           # the writable tmpfs home and working directory
    work_dir_mb: int = 64
    tmp_mb: int = 16                  # /tmp and /dev/shm tmpfs
    user: str = "1000:1000"           # uid:gid of the code (never root)
    keepalive_user: str = "65534:65534"  # PID 1's uid: another uid, so code cannot kill it
    network: bool = False             # True attaches the default bridge (egress!)
    read_only_root: bool = True
    runtime: str = "runc"             # the OCI runtime: runc (Docker's own) | runsc (gVisor) | any
                                      # other registered with the engine (checked at start)
    lifetime_s: int = 3600            # the container exits by itself after this
    # engine
    docker_host: str | None = None    # None: $DOCKER_HOST or unix:///var/run/docker.sock
    docker_call_concurrency: int = 8  # SDK calls in worker threads at once
    reap_interval_s: float = 60.0
    warm_check_s: float = 5.0         # between looks at whether the warm containers still run
    engine_grace_s: float = 30.0      # an engine that stops answering is waited for this long
                                      # (its unanswered calls run again) before the pool is lost
    run_id: str | None = None         # label of this run's containers (default: random)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require("pool_size", self.pool_size >= 0, ">= 0")
        self.require("max_containers", self.max_containers >= 1, ">= 1")
        self.require("max_idle", self.max_idle >= 0, ">= 0")
        self.require("max_uses", self.max_uses >= 1, ">= 1")
        self.require("cpus", self.cpus > 0, "> 0")
        self.require("pids_limit", self.pids_limit >= 8, ">= 8")
        self.require("work_dir_mb", self.work_dir_mb >= 1, ">= 1")
        self.require("tmp_mb", self.tmp_mb >= 1, ">= 1")
        self.require("lifetime_s", self.lifetime_s >= 60, ">= 60")
        self.require("docker_call_concurrency", self.docker_call_concurrency >= 1, ">= 1")
        self.require("reap_interval_s", self.reap_interval_s > 0, "> 0")
        self.require("warm_check_s", self.warm_check_s > 0, "> 0")
        self.require("engine_grace_s", self.engine_grace_s >= 0, ">= 0")
        self.require("user", self.user.split(":")[0] not in ("0", "root"), "a uid other than root")
        self.require("runtime", bool(_RUNTIME_NAME.fullmatch(self.runtime)),
                     "the name of a runtime registered with Docker, e.g. runc or runsc")
        if self.runtime == "runsc":  # gVisor's own threads count against the container's pids
            self.require("pids_limit", self.pids_limit >= 128,
                         ">= 128 with sandbox.runtime=runsc (gVisor's own threads count against "
                         "it; at 64 the sandbox dies)")

    def pool(self) -> DockerSandboxPool:
        return DockerSandboxPool(self)


class DockerSandboxPool(SandboxPool):
    """Warm, hardened containers for episodes. Use as ``async with DockerSandboxPool(cfg)``."""

    def __init__(self, config: DockerSandboxConfig) -> None:
        self.config = config
        self.run_id = self.config.run_id or uuid.uuid4().hex[:12]
        self.owner = engine.Owner.this_process(self.run_id)
        self.client: docker.DockerClient | None = None
        self._ready: deque[Container] = deque()
        self._live: set[Container] = set()
        self._pending = 0  # containers being created
        self._changed = anyio.Event()
        self._names = itertools.count()
        self._stack = AsyncExitStack()
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = False
        self.url = engine.engine_url(self.config.docker_host)
        self.link = EngineLink(self.url, config.engine_grace_s, config.docker_call_concurrency,
                               on_lost=self._notify)
        self.stats = {"created": 0, "reused": 0, "destroyed": 0, "reaped": 0, "lost": 0}

    # -- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        cfg = self.config
        self.client = self.link.client = await self.link.thread(
            engine.connect, cfg.docker_host, max(32, cfg.docker_call_concurrency * 2))
        try:
            await self.link.call(engine.require_image, self.client, cfg.image)
            await self.link.call(engine.require_runtime, self.client, cfg.runtime, self.url)
            self.stats["reaped"] += await self.link.call(engine.reap, self.client)
        except BaseException:
            self.client.close()
            self._closed = True
            raise
        self._tg = await self._stack.enter_async_context(anyio.create_task_group())
        self._tg.start_soon(self._reap_periodically)
        self._tg.start_soon(self._watch_warm)
        self._tg.start_soon(self.link.watch)
        self._fill()
        return self

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
        try:
            await self._stack.aclose()
        finally:
            with anyio.CancelScope(shield=True):
                await self._remove_all()

    async def _remove_all(self) -> None:
        if self.client is None:
            return
        async with anyio.create_task_group() as tg:
            for box in list(self._live):
                tg.start_soon(self._destroy, box)
        self._ready.clear()
        if self.link.lost is None:
            try:
                self.stats["reaped"] += await self.link.call(engine.reap, self.client, self.run_id)
            except (SandboxError, *ENGINE_ERRORS) as e:
                log.warning("sandbox pool: %s", e)
        if self.link.lost is not None:
            log.warning("sandbox pool: the Docker engine at %s is gone; this run's containers "
                        "are left to the next pool's start-up reaper (or `python -m "
                        "sandboxes.docker reap`) and to their lifetime", self.url)
        self.client.close()

    async def _reap_periodically(self) -> None:
        while self.link.lost is None:
            await anyio.sleep(self.config.reap_interval_s)
            try:
                self.stats["reaped"] += await self.link.call(engine.reap, self.client)
            except EngineUnavailable:
                return  # the pool is lost: the next call says so
            except ENGINE_ERRORS as e:  # an API error: try next time
                log.warning("sandbox reaper: %s", e)

    async def _watch_warm(self) -> None:
        """Every ``warm_check_s``, one look at which of the run's containers run: a warm one
        killed from outside (or dead of itself) while it waits is replaced before an episode
        meets it, and counted (``faults/sandbox_lost``), even if no call would have needed it
        before the run ends."""
        while self.link.lost is None:
            await anyio.sleep(self.config.warm_check_s)
            waiting = set(self._ready)  # before the look: a box readied since is not judged by it
            if not waiting:
                continue
            try:
                alive = await self.link.call(engine.running, self.client, self.run_id)
            except EngineUnavailable:
                return  # the pool is lost: the next call says so
            except ENGINE_ERRORS as e:  # an API error: look again next time
                log.warning("sandbox pool: %s", e)
                continue
            for box in [b for b in self._ready if b in waiting and b.id not in alive]:
                self._ready.remove(box)
                self.stats["lost"] += 1
                log.warning("sandbox pool: a warm container was killed from outside; replacing it")
                box.broken = box.accounted = True
                self._release_soon(box)  # broken: destroyed, and the pool filled again

    def metrics(self) -> dict[str, float]:
        """Faults the pool rode out: containers lost under a call (the call ran again) and
        outages of the engine."""
        return {"faults/sandbox_lost": float(self.stats["lost"]),
                "faults/docker_unreachable": float(self.link.outages)}

    async def wait_warm(self) -> int:
        """Wait until no warm container is on its way (before timing episodes, or before
        taking the engine away in a test); returns how many are ready."""
        want = min(self.config.pool_size, self.config.max_containers)
        while len(self._ready) < want and self._pending and self.link.lost is None:
            await self._changed.wait()
        return len(self._ready)

    # -- sessions ----------------------------------------------------------------------------
    @asynccontextmanager
    async def session(self) -> AsyncIterator[DockerSandbox]:
        if self._tg is None or self._closed:
            raise SandboxError("the pool is not open: use `async with DockerSandboxPool(cfg)`")
        sandbox = DockerSandbox(self)
        try:
            yield sandbox
        finally:
            await sandbox._finish()

    async def _acquire(self) -> Container:
        while True:
            self.link.check()
            if self._closed:
                raise SandboxError("the sandbox pool is closed")
            if self._ready:
                box = self._ready.popleft()
                self._fill()
                if box.expires - time.time() < 2 * self.config.max_timeout_s + 60:
                    self._release_soon(box)  # too close to its self-destruct: replace it
                    continue
                return box
            if len(self._live) + self._pending < self.config.max_containers:
                self._pending += 1
                try:
                    return await self._create()
                finally:
                    self._pending -= 1
                    self._notify()
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _fill(self) -> None:
        """Start creating containers until ``pool_size`` exist (ready, in use or on their way;
        those in use come back after a reset, so an episode costs no new container)."""
        cfg = self.config
        while (self._tg is not None and not self._closed and self.link.lost is None
               and len(self._live) + self._pending < min(cfg.pool_size, cfg.max_containers)):
            self._pending += 1
            self._tg.start_soon(self._create_ready)

    async def _create_ready(self) -> None:
        try:
            box = await self._create()
        except SandboxError as e:
            # a warm spare failed; an episode asking for a container creates its own and
            # gets the error itself if the engine is really broken
            if not isinstance(e, EngineUnavailable):  # that one is logged once, by the link
                log.warning("sandbox pool: %s", e)
            return
        finally:
            self._pending -= 1
            self._notify()
        self._ready.append(box)
        self._notify()

    def _release_soon(self, box: Container) -> None:
        """After an episode (or a lost call): reset and keep, or destroy, in the background."""
        if self._tg is not None and not self._closed:
            self._tg.start_soon(self._release, box)

    async def _release(self, box: Container) -> None:
        cfg = self.config
        box.uses += 1
        keep = (cfg.reuse and cfg.read_only_root and not box.broken and box.uses < cfg.max_uses
                and box.expires - time.time() > cfg.lifetime_s / 2
                and len(self._ready) < max(cfg.pool_size, cfg.max_idle))
        if keep:
            frame = None
            with anyio.move_on_after(10):
                try:
                    frame = await box.channel.roundtrip(protocol.request(protocol.OP_RESET))
                except RunnerGone:
                    if await self._lost_box(box):  # killed from outside between two calls
                        self.stats["lost"] += 1
                    box.broken = box.accounted = True  # counted, or the code's doing
            if frame is not None and protocol.parse_response(frame)[0] == 0:
                self.stats["reused"] += 1
                self._ready.append(box)
                self._notify()
                return
        if not box.accounted and await self._killed_after_use(box):
            # killed after its episode's last call, or under a call its episode was cancelled
            # in before the kill was found: nothing ran again
            self.stats["lost"] += 1
            box.accounted = True
        await self._destroy(box)

    async def _killed_after_use(self, box: Container) -> bool:
        """Whether a container going without a reset (not kept) was killed from outside since
        its last call: a fault no call saw, counted all the same (``faults/sandbox_lost``).
        Judged as a call's loss is (:meth:`_gone`: a kill takes a moment to show in the
        state); an engine that does not answer says nothing here (its outage is counted
        apart)."""
        if self.link.lost is not None:
            return False
        try:
            return await self._gone(box)
        except EngineUnavailable:
            return False

    # -- the engine --------------------------------------------------------------------------
    async def _lost_box(self, box: Container) -> bool:
        """Whether ``box``'s runner stream ended for a reason outside the box: the container
        was killed, or the engine had an outage since the stream was attached (a restarted
        engine cuts the streams it carried)."""
        return self.link.outages > box.outages or await self._gone(box)

    async def _gone(self, box: Container) -> bool:
        """Whether ``box``'s container is no longer running (killed from outside: its PID 1
        runs as another uid than the code, so the code cannot end it)."""
        for wait in (0.0, GONE_RECHECK_S):  # a kill takes a moment to show in its state
            await anyio.sleep(wait)
            if not await self.link.call(engine.is_running, self.client, box.id):
                return True
        return False

    # -- containers --------------------------------------------------------------------------
    def _start_container(self) -> Any:
        assert self.client is not None
        cfg = self.config
        return self.client.containers.run(cfg.image, **run_kwargs(
            cfg, f"polyrl-sbx-{self.run_id}-{next(self._names)}", self.owner.labels(cfg.lifetime_s)))

    async def _create(self) -> Container:
        try:
            with anyio.CancelScope(shield=True):  # a cancel must not lose a started container
                container = await self.link.call(self._start_container)
        except docker.errors.APIError as e:
            raise SandboxError(f"could not start a sandbox container: {e.explanation or e}") from e
        except ENGINE_ERRORS as e:  # an error of the SDK itself
            raise SandboxError(f"could not start a sandbox container: {e}") from e
        self.stats["created"] += 1
        channel: RunnerChannel | None = None
        outages = self.link.outages
        try:
            await anyio.lowlevel.checkpoint()  # a pending cancel lands here, with cleanup
            channel = RunnerChannel(await self.link.call(attach_runner, self.client, self.config,
                                                         container.id))
            with anyio.fail_after(30):
                frame = await channel.roundtrip(protocol.request(protocol.OP_PING))
            if protocol.parse_response(frame)[0] != 0:
                raise SandboxError("the sandbox runner did not answer its ping")
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                if channel is not None:
                    channel.close()
                try:
                    if isinstance(e, RunnerGone | TimeoutError):  # the engine, or the image?
                        await self.link.require(e)
                finally:
                    await self._remove(container)
            if isinstance(e, docker.errors.APIError | RunnerGone | TimeoutError):
                raise SandboxError(f"the sandbox runner did not start in {self.config.image}: "
                                   f"{e}") from e
            raise
        box = Container(container, channel, time.time() + self.config.lifetime_s, outages)
        self._live.add(box)
        return box

    async def _remove(self, container: Any) -> bool | None:
        """Remove ``container``: True if this removed it, False if it was gone or going already
        (killed, and Docker's auto-remove begun), None if unknown (no engine to ask)."""
        if self.link.lost is not None:
            return None  # left to the next start's reaper and to its lifetime
        removed = None
        try:
            removed = await self.link.call(engine.remove, self.client, container.id)
        except EngineUnavailable:
            return None  # the pool is lost now: the next call says so
        except ENGINE_ERRORS as e:  # the reaper and the lifetime catch it later
            log.warning("sandbox pool: could not remove %s: %s", container.name, e)
        self.stats["destroyed"] += 1
        return removed

    async def _destroy(self, box: Container) -> None:
        if box not in self._live:
            return
        self._live.discard(box)
        box.channel.close()
        if await self._remove(box.container) is False and not box.accounted and not self._closed:
            # running when last looked at, gone before this removal: killed from outside in
            # between (after its episode's last call), a fault all the same
            self.stats["lost"] += 1
            box.accounted = True
            log.warning("sandbox pool: a container was killed from outside as it was removed")
        self._notify()
        self._fill()
