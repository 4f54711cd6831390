"""The Docker backend: its config, the warm container pool and the per-episode sandbox (a
stateful Python session). ``DockerSandboxConfig`` sits here, beside the pool its ``pool()``
builds, as a backend's config does (see :mod:`sandboxes.config`).

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

The engine going away mid-run is the operator's problem, not the model's. A watch pings it
every second; an engine that does not answer (a ping, or a container create, exec or remove
with no answer) is an outage, counted once (``faults/docker_unreachable``). Calls that got
no answer wait for it and run again once it answers, for up to ``engine_grace_s``; past that
the pool is lost: the call and every later one raise :class:`~sandboxes.api.EngineUnavailable`
with one sentence naming the engine's URL and the fix, nothing is retried, and shutdown
leaves the containers to the reaper of the next start (and to their own lifetime) instead of
waiting on a dead engine.

A container that disappears under a call (``docker kill``: not the code's doing, since its
PID 1 runs as another uid), or whose runner stream an engine outage cut, is lost, not a
``killed`` result: the call runs once more in a fresh container (the session's state is gone:
``session_reset``), counted as ``faults/sandbox_lost``. :meth:`DockerSandboxPool.metrics`
has both counters.
"""

from __future__ import annotations

import functools
import itertools
import logging
import re
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Self, TypeVar

import anyio
import anyio.lowlevel
import docker
import docker.errors
from docker.types import Ulimit

from sandboxes import protocol
from sandboxes.api import (
    EngineUnavailable,
    ExecLimits,
    ExecResult,
    Language,
    Sandbox,
    SandboxError,
    SandboxPool,
)
from sandboxes.config import SandboxConfig
from sandboxes.docker import engine
from sandboxes.docker.channel import RunnerChannel, RunnerGone
from sandboxes.docker.image import DEFAULT_IMAGE

log = logging.getLogger(__name__)
T = TypeVar("T")
_RUNTIME_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
ENGINE_ERRORS = engine.ENGINE_ERRORS
WATCH_S = 1.0          # between pings of the engine by the pool's watch
WATCH_PING_S = 2.0     # a ping unanswered this long is an outage
GONE_RECHECK_S = 0.5   # a container still running after its runner vanished: looked at again


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


class _Container:
    def __init__(self, container: Any, channel: RunnerChannel, expires: float,
                 outages: int = 0) -> None:
        self.container = container
        self.id: str = container.id
        self.channel = channel
        self.expires = expires
        self.outages = outages  # the engine's outages before its runner stream was attached
        self.uses = 0
        self.broken = False


def _cgroup_oom_kills(container_id: str) -> int | None:
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


class DockerSandbox(Sandbox):
    """One episode's sandbox. If its container is lost (host-side timeout, runner killed) the
    next call transparently gets a fresh one; the result that lost it says ``session_reset``."""

    def __init__(self, pool: DockerSandboxPool) -> None:
        self._pool = pool
        self._container: _Container | None = None
        self._lock = anyio.Lock()
        self.calls = 0

    async def exec(self, code: str, *, language: Language = "python", timeout: float | None = None,
                   limits: ExecLimits | None = None) -> ExecResult:
        timeout_s, max_output = self._pool.config.call_limits(timeout, limits)
        async with self._lock:
            result = await self._exec_once(code, language, timeout_s, max_output, retry=True)
            if result is None:  # the container was lost under the call: once more, afresh
                self._pool.stats["lost"] += 1
                log.warning("sandbox pool: a container was lost under a call (killed, or its "
                            "stream cut by the engine); running the call again in a fresh one")
                result = await self._exec_once(code, language, timeout_s, max_output, retry=False)
                assert result is not None
                result = replace(result, session_reset=True)
            return result

    async def _exec_once(self, code: str, language: Language, timeout_s: float,
                         max_output: int, retry: bool) -> ExecResult | None:
        """One call; None (with ``retry``) when its container disappeared under it."""
        if self._container is None:
            self._container = await self._pool._acquire()
        box = self._container
        self.calls += 1
        oom_before = _cgroup_oom_kills(box.id)
        start = time.perf_counter()
        request = protocol.exec_request(code, language, timeout_s, max_output)
        frame: bytes | None = None
        gone: RunnerGone | None = None
        try:
            with anyio.move_on_after(timeout_s + self._pool.config.host_grace_s) as scope:
                frame = await box.channel.roundtrip(request)
        except RunnerGone as e:
            gone = e
        except BaseException:
            # cancelled mid-call: the stream is out of step, so the container goes and
            # the session's next call starts in a fresh one
            box.broken = True
            self._container = None
            self._pool._release_soon(box)
            raise
        duration = time.perf_counter() - start
        if frame is not None and not scope.cancelled_caught:
            return protocol.to_result(frame, duration)
        # lost: the host deadline passed or the runner died; the container goes
        box.broken = True
        self._container = None
        try:  # ... unless the engine itself went away: then it is not the code's doing
            await self._pool._require_engine(gone)
            if retry and gone is not None and await self._pool._lost_box(box):
                return None  # killed from outside or cut: not the code's doing either
        finally:
            self._pool._release_soon(box)
        if scope.cancelled_caught:
            status = "timeout"
        else:
            oom_after = _cgroup_oom_kills(box.id)
            grew = oom_before is not None and oom_after is not None and oom_after > oom_before
            status = "oom" if grew else "killed"
        return ExecResult("", box.channel.stderr[-2000:].decode("utf-8", "replace"), None,
                          status, duration, session_reset=True)

    async def _finish(self) -> None:
        if self._container is not None:
            self._pool._release_soon(self._container)
            self._container = None


class DockerSandboxPool(SandboxPool):
    """Warm, hardened containers for episodes. Use as ``async with DockerSandboxPool(cfg)``."""

    def __init__(self, config: DockerSandboxConfig) -> None:
        self.config = config
        self.run_id = self.config.run_id or uuid.uuid4().hex[:12]
        self.owner = engine.Owner.this_process(self.run_id)
        self.client: docker.DockerClient | None = None
        self._limiter = anyio.CapacityLimiter(self.config.docker_call_concurrency)
        self._ready: deque[_Container] = deque()
        self._live: set[_Container] = set()
        self._pending = 0  # containers being created
        self._changed = anyio.Event()
        self._names = itertools.count()
        self._stack = AsyncExitStack()
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = False
        self._lost: str | None = None  # why the engine is gone (then nothing calls it again)
        self.url = engine.engine_url(self.config.docker_host)
        self.stats = {"created": 0, "reused": 0, "destroyed": 0, "reaped": 0,
                      "lost": 0, "engine_outages": 0}
        self._down = False  # in an outage: the engine's last ping or call went unanswered

    # -- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        cfg = self.config
        self.client = await self._thread(engine.connect, cfg.docker_host,
                                         max(32, cfg.docker_call_concurrency * 2))
        try:
            await self._call(engine.require_image, self.client, cfg.image)
            await self._call(engine.require_runtime, self.client, cfg.runtime, self.url)
            self.stats["reaped"] += await self._call(engine.reap, self.client)
        except BaseException:
            self.client.close()
            self._closed = True
            raise
        self._tg = await self._stack.enter_async_context(anyio.create_task_group())
        self._tg.start_soon(self._reap_periodically)
        self._tg.start_soon(self._watch_engine)
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
        if self._lost is None:
            try:
                self.stats["reaped"] += await self._call(engine.reap, self.client, self.run_id)
            except (SandboxError, *ENGINE_ERRORS) as e:
                log.warning("sandbox pool: %s", e)
        if self._lost is not None:
            log.warning("sandbox pool: the Docker engine at %s is gone; this run's containers "
                        "are left to the next pool's start-up reaper (or `python -m "
                        "sandboxes.docker reap`) and to their lifetime", self.url)
        self.client.close()

    async def _reap_periodically(self) -> None:
        while self._lost is None:
            await anyio.sleep(self.config.reap_interval_s)
            try:
                self.stats["reaped"] += await self._call(engine.reap, self.client)
            except EngineUnavailable:
                return  # the pool is lost: the next call says so
            except ENGINE_ERRORS as e:  # an API error: try next time
                log.warning("sandbox reaper: %s", e)

    async def _watch_engine(self) -> None:
        """Ping the engine every :data:`WATCH_S`: an unanswered ping is an outage."""
        while self._lost is None:
            await anyio.sleep(WATCH_S)
            await self._ping()

    async def _ping(self) -> BaseException | None:
        """Ping the engine (not behind the pool's call limiter, which calls stuck on a hung
        engine may fill); None when it answered. Notes an outage's start and end."""
        failed = await anyio.to_thread.run_sync(
            functools.partial(engine.probe, self.client, self.url, WATCH_PING_S))
        if failed is None:
            if self._down:
                log.warning("sandbox pool: the Docker engine at %s answers again", self.url)
            self._down = False
        elif not self._down:
            self._down = True
            self.stats["engine_outages"] += 1
            log.warning("sandbox pool: the Docker engine at %s does not answer (%s); waiting "
                        "up to sandbox.engine_grace_s=%g for it", self.url, failed,
                        self.config.engine_grace_s)
        return failed

    def metrics(self) -> dict[str, float]:
        """Faults the pool rode out: containers lost under a call (the call ran again) and
        outages of the engine."""
        return {"faults/sandbox_lost": float(self.stats["lost"]),
                "faults/docker_unreachable": float(self.stats["engine_outages"])}

    async def wait_warm(self) -> int:
        """Wait until no warm container is on its way (before timing episodes, or before
        taking the engine away in a test); returns how many are ready."""
        want = min(self.config.pool_size, self.config.max_containers)
        while len(self._ready) < want and self._pending and self._lost is None:
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

    async def _acquire(self) -> _Container:
        while True:
            if self._lost is not None:
                raise EngineUnavailable(self._lost)
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
        while (self._tg is not None and not self._closed and self._lost is None
               and len(self._live) + self._pending < min(cfg.pool_size, cfg.max_containers)):
            self._pending += 1
            self._tg.start_soon(self._create_ready)

    async def _create_ready(self) -> None:
        try:
            box = await self._create()
        except SandboxError as e:
            # a warm spare failed; an episode asking for a container creates its own and
            # gets the error itself if the engine is really broken
            if not isinstance(e, EngineUnavailable):  # that one is logged once, by _lose
                log.warning("sandbox pool: %s", e)
            return
        finally:
            self._pending -= 1
            self._notify()
        self._ready.append(box)
        self._notify()

    def _release_soon(self, box: _Container) -> None:
        """After an episode (or a lost call): reset and keep, or destroy, in the background."""
        if self._tg is not None and not self._closed:
            self._tg.start_soon(self._release, box)

    async def _release(self, box: _Container) -> None:
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
            if frame is not None and protocol.parse_response(frame)[0] == 0:
                self.stats["reused"] += 1
                self._ready.append(box)
                self._notify()
                return
        await self._destroy(box)

    # -- the engine --------------------------------------------------------------------------
    async def _thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs),
                                              limiter=self._limiter)

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """An SDK call in a worker thread. No answer waits for the engine (up to
        ``engine_grace_s``) and calls again; past that it is :class:`EngineUnavailable` (the
        pool is then lost). An answer that is an error stays a
        :class:`docker.errors.APIError`."""
        while True:
            if self._lost is not None:
                raise EngineUnavailable(self._lost)
            if self._down:  # a known outage: wait for the engine before calling it (docker-py
                await self._await_engine(None)  # leaks the socket of a failed connection)
            try:
                return await self._thread(fn, *args, **kwargs)
            except ENGINE_ERRORS as e:
                if not engine.unanswered(e):
                    raise
                await self._await_engine(e)

    async def _await_engine(self, error: BaseException | None) -> None:
        """The engine did not answer: return once it does, within ``engine_grace_s``; else the
        pool is lost (:class:`EngineUnavailable`)."""
        if self._lost is not None:
            raise EngineUnavailable(self._lost) from error
        deadline = time.monotonic() + self.config.engine_grace_s
        while True:
            failed = await self._ping()
            if failed is None:
                return
            if time.monotonic() >= deadline:
                raise self._lose(failed) from error
            await anyio.sleep(min(WATCH_S, max(deadline - time.monotonic(), 0.0)))

    def _lose(self, error: BaseException) -> EngineUnavailable:
        if self._lost is None:
            self._lost = engine.stopped_answering(self.url, error)
            log.error("sandbox pool: %s", self._lost)
            self._notify()  # episodes waiting for a container hear it now
        return EngineUnavailable(self._lost)

    async def _require_engine(self, error: BaseException | None) -> None:
        """After a lost runner stream: :class:`EngineUnavailable` unless the engine answers."""
        if self._lost is not None:
            raise EngineUnavailable(self._lost) from error
        failed = await self._thread(engine.probe, self.client, self.url)  # bounded in time
        if failed is not None:
            await self._await_engine(failed)

    async def _lost_box(self, box: _Container) -> bool:
        """Whether ``box``'s runner stream ended for a reason outside the box: the container
        was killed, or the engine had an outage since the stream was attached (a restarted
        engine cuts the streams it carried)."""
        return self.stats["engine_outages"] > box.outages or await self._gone(box)

    async def _gone(self, box: _Container) -> bool:
        """Whether ``box``'s container is no longer running (killed from outside: its PID 1
        runs as another uid than the code, so the code cannot end it)."""
        for wait in (0.0, GONE_RECHECK_S):  # a kill takes a moment to show in its state
            await anyio.sleep(wait)
            if not await self._call(engine.is_running, self.client, box.id):
                return True
        return False

    # -- containers --------------------------------------------------------------------------
    def _run_kwargs(self) -> dict[str, Any]:
        cfg = self.config
        uid, _, gid = cfg.user.partition(":")
        gid = gid or uid
        return dict(
            command=["sleep", str(cfg.lifetime_s)], detach=True, auto_remove=True, init=True,
            name=f"polyrl-sbx-{self.run_id}-{next(self._names)}", hostname="sandbox",
            labels=self.owner.labels(cfg.lifetime_s), user=cfg.keepalive_user,
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

    def _start_container(self) -> Any:
        assert self.client is not None
        return self.client.containers.run(self.config.image, **self._run_kwargs())

    def _attach_runner(self, container_id: str) -> Any:
        assert self.client is not None
        cfg = self.config
        argv = ["python3", "-I", "-c", protocol.RUNNER_SOURCE, "--kill-scope", "uid",
                "--wipe", cfg.work_dir, "--wipe", "/tmp", "--wipe", "/dev/shm"]
        env = {"HOME": cfg.work_dir, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
               "PATH": "/usr/local/bin:/usr/bin:/bin"}
        exec_id = self.client.api.exec_create(container_id, argv, stdin=True, stdout=True,
                                              stderr=True, tty=False, user=cfg.user,
                                              workdir=cfg.work_dir, environment=env)["Id"]
        return self.client.api.exec_start(exec_id, socket=True, tty=False)

    async def _create(self) -> _Container:
        try:
            with anyio.CancelScope(shield=True):  # a cancel must not lose a started container
                container = await self._call(self._start_container)
        except docker.errors.APIError as e:
            raise SandboxError(f"could not start a sandbox container: {e.explanation or e}") from e
        except ENGINE_ERRORS as e:  # an error of the SDK itself
            raise SandboxError(f"could not start a sandbox container: {e}") from e
        self.stats["created"] += 1
        channel: RunnerChannel | None = None
        outages = self.stats["engine_outages"]
        try:
            await anyio.lowlevel.checkpoint()  # a pending cancel lands here, with cleanup
            channel = RunnerChannel(await self._call(self._attach_runner, container.id))
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
                        await self._require_engine(e)
                finally:
                    await self._remove(container)
            if isinstance(e, docker.errors.APIError | RunnerGone | TimeoutError):
                raise SandboxError(f"the sandbox runner did not start in {self.config.image}: "
                                   f"{e}") from e
            raise
        box = _Container(container, channel, time.time() + self.config.lifetime_s, outages)
        self._live.add(box)
        return box

    async def _remove(self, container: Any) -> None:
        if self._lost is not None:
            return  # left to the next start's reaper and to its lifetime
        try:
            await self._call(engine.remove, self.client, container.id)
        except EngineUnavailable:
            return  # the pool is lost now: the next call says so
        except ENGINE_ERRORS as e:  # the reaper and the lifetime catch it later
            log.warning("sandbox pool: could not remove %s: %s", container.name, e)
        self.stats["destroyed"] += 1

    async def _destroy(self, box: _Container) -> None:
        if box not in self._live:
            return
        self._live.discard(box)
        box.channel.close()
        await self._remove(box.container)
        self._notify()
        self._fill()
