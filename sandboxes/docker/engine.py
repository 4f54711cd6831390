"""The Docker engine: connecting with one clear error, container labels, and the reaper.

Every container this package starts carries labels: ``polyrl.sandbox=1``, the run id, the
owner's host, pid and process start time, and an expiry timestamp. :func:`reap` removes the
containers whose run is over: the given run's own, those past their expiry, and those whose
owner process on this host is gone (also after a SIGKILL, when no cleanup code ran). The pool
calls it at start-up, periodically and at shutdown; ``python -m sandboxes.docker reap`` by hand.
Independently, each container's PID 1 is ``sleep <lifetime>`` under an init, with auto-remove,
so a container nobody reaps still disappears by itself.

An engine that stops answering mid-run (its socket gone, a refused or cut connection, no answer
in time) is :class:`EngineUnavailable` with one sentence naming its URL and the fix
(:func:`stopped_answering`); an answer, even an error (:class:`docker.errors.APIError`), is not.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import docker
import docker.errors
import requests.exceptions

from sandboxes.api import EngineUnavailable, ImageMissing, SandboxConfigError

LABEL = "polyrl.sandbox"
LABEL_RUN = "polyrl.run_id"
LABEL_HOST = "polyrl.owner_host"
LABEL_PID = "polyrl.owner_pid"
LABEL_START = "polyrl.owner_start"
LABEL_EXPIRES = "polyrl.expires"
DEFAULT_HOST = "unix:///var/run/docker.sock"
SETUP_HINT = "start one with `bash scripts/docker_setup.sh`"
RESUME_HINT = ("start it with `bash scripts/docker_setup.sh`, then resume the run from its last "
               "checkpoint with `python -m orchestrator resume=<run_dir>`")
PING_TIMEOUT_S = 10.0
# what a call to a slow, restarting or vanished engine raises besides an API error
ENGINE_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException, OSError)


def engine_url(docker_host: str | None = None) -> str:
    return docker_host or os.environ.get("DOCKER_HOST") or DEFAULT_HOST


def connect(docker_host: str | None = None, max_pool_size: int = 32) -> docker.DockerClient:
    """A client of an engine that answers, or :class:`EngineUnavailable` in one line."""
    url = engine_url(docker_host)
    if url.startswith("unix://") and _socket_error(url[len("unix://"):]) is not None:
        raise EngineUnavailable(f"no Docker engine at {url}; {SETUP_HINT}")
    client = None
    try:
        client = docker.DockerClient(base_url=url, version="auto", max_pool_size=max_pool_size,
                                     timeout=120)
        client.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as e:
        if client is not None:
            client.close()
        raise EngineUnavailable(f"no Docker engine at {url}; {SETUP_HINT}") from e
    return client


def unanswered(error: BaseException) -> bool:
    """Whether a failed SDK call means the engine did not answer (an API error is an answer)."""
    return isinstance(error, requests.exceptions.RequestException | OSError)


def probe(client: docker.DockerClient, url: str,
          timeout: float = PING_TIMEOUT_S) -> BaseException | None:
    """None when the engine at ``url`` (``client``'s) answers a ping within ``timeout``, else
    the error (blocking)."""
    if url.startswith("unix://") and (error := _socket_error(url[len("unix://"):])) is not None:
        return error
    try:
        client.api.get(f"{client.api.base_url}/_ping", timeout=timeout)
    except (requests.exceptions.RequestException, OSError) as e:
        return e
    return None


def stopped_answering(url: str, error: BaseException) -> str:
    """One sentence for an engine that went away mid-run: its URL, why, and the fix."""
    return f"the Docker engine at {url} stopped answering ({_reason(error)}); {RESUME_HINT}"


def _reason(error: BaseException) -> str:
    # the OS-level cause buried in requests' and urllib3's wrappers: "connection refused"
    todo, seen = [error], set()
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.strerror:
            return e.strerror[:1].lower() + e.strerror[1:]
        todo += [a for a in (*e.args, e.__cause__, e.__context__, getattr(e, "reason", None))
                 if isinstance(a, BaseException)]
    if isinstance(error, requests.exceptions.Timeout):
        return "no answer in time"
    return str(error) or type(error).__name__


def _socket_error(path: str) -> OSError | None:
    # checked before docker-py connects, because it leaks the socket of a failed connection
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        try:
            sock.connect(path)
        except OSError as e:
            return e
    return None


def require_image(client: docker.DockerClient, image: str) -> None:
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound as e:
        raise ImageMissing(
            f"image {image} is not in the engine; build it with "
            f"`python -m sandboxes.docker build-image --image {image}` (or pull it)") from e


def require_runtime(client: docker.DockerClient, runtime: str, url: str) -> None:
    """:class:`SandboxConfigError` in one line unless the engine has ``runtime`` registered."""
    known = sorted(client.info().get("Runtimes") or {})
    if runtime not in known:
        hint = ("; `bash scripts/docker_setup.sh` installs gVisor and registers it as runsc"
                if runtime == "runsc" else "")
        raise SandboxConfigError(
            f"sandbox.runtime={runtime} is not a runtime of the Docker engine at "
            f"{client.api.base_url} (it has {', '.join(known) or 'none'}): register it in "
            f"/etc/docker/daemon.json{hint}, or use sandbox.runtime=runc")


def process_start(pid: int) -> str:
    """The start time of a process in clock ticks since boot ('' when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return ""
    return stat[stat.rfind(b")") + 2:].split()[19].decode()


@dataclass(frozen=True)
class Owner:
    run_id: str
    host: str
    pid: int
    start: str

    @classmethod
    def this_process(cls, run_id: str) -> Owner:
        return cls(run_id, socket.gethostname(), os.getpid(), process_start(os.getpid()))

    def labels(self, lifetime_s: float) -> dict[str, str]:
        return {LABEL: "1", LABEL_RUN: self.run_id, LABEL_HOST: self.host,
                LABEL_PID: str(self.pid), LABEL_START: self.start,
                LABEL_EXPIRES: str(int(time.time() + lifetime_s))}


def is_leaked(labels: dict[str, str], run_id: str | None = None, now: float | None = None) -> bool:
    """Whether a labelled container belongs to no live owner (or to ``run_id``)."""
    if run_id is not None and labels.get(LABEL_RUN) == run_id:
        return True
    now = time.time() if now is None else now
    try:
        if float(labels.get(LABEL_EXPIRES, "0")) < now:
            return True
        pid = int(labels.get(LABEL_PID, "0"))
    except ValueError:
        return True
    if labels.get(LABEL_HOST) != socket.gethostname():
        return False  # another machine's run: only its expiry tells
    return process_start(pid) != labels.get(LABEL_START)


@dataclass(frozen=True)
class Labelled:
    id: str
    name: str
    labels: dict[str, str]


def labelled(client: docker.DockerClient) -> list[Labelled]:
    """Every container carrying the project's label (one list call: no per-container lookup
    that would race with auto-removal)."""
    rows = client.api.containers(all=True, filters={"label": f"{LABEL}=1"})
    return [Labelled(row["Id"], (row.get("Names") or ["?"])[0].lstrip("/"), row.get("Labels") or {})
            for row in rows]


def running(client: docker.DockerClient, run_id: str) -> set[str]:
    """The ids of ``run_id``'s containers that run now (one list call)."""
    rows = client.api.containers(filters={"label": f"{LABEL_RUN}={run_id}", "status": "running"})
    return {row["Id"] for row in rows}


def remove(client: docker.DockerClient, container_id: str) -> bool:
    """Force-remove a container; False when it was already gone or going."""
    try:
        client.api.remove_container(container_id, force=True)
        return True
    except docker.errors.NotFound:
        return False
    except docker.errors.APIError as e:
        if e.status_code == 409:  # removal already in progress (auto-remove)
            return False
        raise


def is_running(client: docker.DockerClient, container_id: str) -> bool:
    """Whether the container exists and runs (blocking)."""
    try:
        state = client.api.inspect_container(container_id).get("State") or {}
    except docker.errors.NotFound:
        return False
    return bool(state.get("Running")) and not state.get("Restarting")


def reap(client: docker.DockerClient, run_id: str | None = None) -> int:
    """Remove leaked containers (blocking; see the module docstring). Returns how many."""
    return sum(remove(client, c.id) for c in labelled(client) if is_leaked(c.labels, run_id))
