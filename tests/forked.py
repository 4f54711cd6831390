"""The commands tests run as ``python -m <module> …``, started from a fork server: a process
that imported torch, transformers and Hydra once, and forks a child for each command. The child
is the command's own process (its pid, signals, exit status, stdin/stdout/stderr, working
directory, environment and ``sys.path`` are the command's), but it skips the seconds a new
interpreter spends importing those libraries: most of what a short run of ``python -m
orchestrator`` costs on 2 cores, and the largest part of the test command's time (issue 44).

``run`` and ``Popen`` take the arguments of :func:`subprocess.run` and :class:`subprocess.Popen`
that the tests use. A command that is not ``[sys.executable, "-m", module, …]``, or any command
with ``POLYRL_TEST_FORK=0``, runs as a plain subprocess: that is the way to check a failure
seen here is not the fork server's.

A forked command's own ``python -m orchestrator …`` and ``python -m bench.<name> …`` are forked
from the same server too: a benchmark's runs (``bench.algos``, ``bench.chaos``,
``bench.resume``'s soak …) are such commands, each of which spent more of its seconds importing
than running (a two-step toy run of ``bench.algos``: 11 s, 8 of them imports). Inside a forked
command, :class:`subprocess.Popen` forks those from the server (:func:`_route`) and starts
anything else as it always does, as it does a command given arguments that :class:`Popen`
does not take. A test that calls a benchmark's functions in its own process (``bench.chaos``'s
``soak``) routes them so for a block, with :func:`routed`.

Ray's Python workers in the tests are forked from it too: tests marked ``ray`` give the Ray
clusters they start ``tests/ray_worker.py`` as the job's ``py_executable``
(:func:`ray_workers_env`), a client that has the server fork Ray's worker script and stands in
for it before the raylet. Each actor then skips the ~6 CPU-seconds of imports a new
interpreter pays (half of what a test of ``launcher=ray`` cost). Ray itself is unchanged: the
raylet starts, registers, signals and reaps its workers as it always does.

What a forked command shares with its server, and a new interpreter would not: the libraries
above, imported with the environment of the test process that started the server (a variable
they read at import, such as ``OMP_NUM_THREADS``, is not re-read; no test sets one), and the
hash seed. Each child draws ``random`` and numpy's global generator afresh, as a new process
would.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import io
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

ENABLE_ENV = "POLYRL_TEST_FORK"  # 0: every command a new interpreter
# What the project's commands import, once: with the libraries after safetensors, a forked
# two-step toy run imports in 0.22 CPU-s instead of 0.38 (2026-12-01). Not ray: a Ray worker
# forked from a server that imported it never came up (a bench run waited on its actor). Not
# vllm: importing it in each process's server cost .venv-vllm's run more than it saved.
PRELOAD = ("numpy", "torch", "torch.distributed", "transformers", "hydra", "omegaconf", "anyio",
           "safetensors", "aiohttp", "httpx", "pydantic", "rich", "psutil", "click",
           "transformers.models.llama.modeling_llama", "transformers.generation.utils")
PRELOAD_FROM = {"transformers": ("AutoModelForCausalLM", "AutoTokenizer", "PreTrainedModel"),
                "hydra": ("compose", "initialize_config_dir")}
children_cpu_s = 0.0  # CPU seconds of the commands forked and waited for (tests/cpu_report.py)


# --- the server ---------------------------------------------------------------------------

def serve(path: str) -> None:
    """Import the libraries, listen on ``path`` and fork a child for each request until stdin
    (a pipe from the test process) closes. One thread: forking never copies a lock another
    thread holds."""
    for name in PRELOAD:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for attribute in PRELOAD_FROM.get(name, ()):
            getattr(module, attribute, None)  # transformers' lazy modules import on first use
    # the libraries' objects out of the cyclic collector's reach: a child's full collections
    # skip them (and leave their pages shared): a forked four-step toy run 1.19 -> 0.89 CPU-s
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    inherited = set(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    site_path = [p for p in sys.path[1:] if p not in inherited]  # a new interpreter's, after cwd
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is sys.stdin:
                if not os.read(sys.stdin.fileno(), 4096):
                    return  # the test process ended
            elif key.fileobj is listener:
                connection, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
                pid = os.fork()
                if pid == 0:
                    for held in (listener.fileno(), connection.fileno(), wake_r, wake_w,
                                 *(c.fileno() for c in children.values())):
                        os.close(held)
                    _child(json.loads(message), fds, site_path)  # never returns
                for fd in fds:
                    os.close(fd)
                children[pid] = connection
                _send(connection, {"pid": pid})
            else:
                while os.read(wake_r, 4096) == 4096:
                    pass
        while children:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            if (connection := children.pop(pid, None)) is not None:
                _send(connection, {"returncode": os.waitstatus_to_exitcode(status),
                                   "cpu_s": usage.ru_utime + usage.ru_stime + _forked_cpu_s(path, pid)})
                connection.close()


def _forked_cpu_s(path: str, pid: int) -> float:
    """The CPU seconds of the commands the command ``pid`` had forked (:func:`_route`): they are
    the server's children, not its, so its own usage leaves them out."""
    report = Path(f"{path}.{pid}.cpu")
    if not report.is_file():
        return 0.0
    cpu_s = float(report.read_text())
    report.unlink()
    return cpu_s


def _send(connection: socket.socket, message: dict[str, Any]) -> None:
    try:
        connection.send(json.dumps(message).encode())
    except OSError:
        pass  # the test process stopped waiting: it ended, or its test timed out


def _child(request: dict[str, Any], fds: list[int], site_path: list[str]) -> None:
    """The command, in the forked child: its streams, directory, environment and path, then
    ``runpy`` runs the module as ``python -m`` would, and the process ends as Python's would
    (non-daemon threads joined, atexit handlers run, streams flushed)."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if request["new_session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        env = request["env"]
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(env)
        python_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [request["cwd"], *python_path, *site_path]
        importlib.invalidate_caches()
        _reopen_streams(unbuffered=bool(env.get("PYTHONUNBUFFERED")))
        _reseed()
        if (watched := request.get("watch")) is not None:
            _end_with(watched)
        script = request.get("script")
        if script:
            sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script` sets it
        sys.argv = [script or request["module"], *request["args"]]
        _route(request["server"])
        code = _run(sys.argv[0], script=bool(script))
        if children_cpu_s:  # for the server's report of this command's CPU seconds
            Path(f"{request['server']}.{os.getpid()}.cpu").write_text(str(children_cpu_s))
    except BaseException:  # noqa: BLE001 - the child must end here, never in the server's loop
        traceback.print_exc()
    finally:
        os._exit(code)


ROUTED = ("orchestrator", "bench.")  # the commands a forked command forks from the server too
POPEN_ARGS = {"cwd", "env", "stdin", "stdout", "stderr", "text", "start_new_session"}  # Popen's


def _route(server: str) -> None:
    """In a forked command: :class:`subprocess.Popen` (and so ``subprocess.run`` and its
    kin) forks the project's commands (:data:`ROUTED`) from ``server``, unless the command's
    environment has ``POLYRL_TEST_FORK=0``."""
    global _attached
    _attached = server
    subprocess.Popen = _routing(subprocess.Popen)  # type: ignore[misc]


@contextmanager
def routed() -> Iterator[None]:
    """In this process, for the block, as in a forked command (:func:`_route`): for a test that
    calls a benchmark's own functions, whose runs are ``python -m orchestrator`` commands
    (``bench.chaos``'s soak), so that those fork from this process's server too."""
    real = subprocess.Popen
    subprocess.Popen = _routing(real)  # type: ignore[misc]
    try:
        yield
    finally:
        subprocess.Popen = real  # type: ignore[misc]


def _routing(real: type[subprocess.Popen[Any]]) -> type[subprocess.Popen[Any]]:
    """``real``, save that the project's commands it is given are forked (:class:`Popen`)."""

    class Routed(real):  # type: ignore[misc, valid-type]
        def __new__(cls, args: Any, *rest: Any, **kwargs: Any) -> Any:
            module = _module_of(list(args)) if isinstance(args, list | tuple) and not rest \
                and set(kwargs) <= POPEN_ARGS else None
            if module is not None and (module == ROUTED[0] or module.startswith(ROUTED)):
                return Popen(args, **kwargs)  # not a Routed: __init__ is not called again
            return super().__new__(cls)

    return Routed


def _end_with(pid: int) -> None:
    """End this process (SIGKILL) when process ``pid`` ends: the client standing for it
    (tests/ray_worker.py) may be killed with a signal it cannot pass on."""
    import select

    watched = os.pidfd_open(pid)

    def watch() -> None:
        select.select([watched], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="end-with-client", daemon=True).start()


def _run(target: str, script: bool = False) -> int:
    import runpy

    try:
        if script:
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        code: int = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught one
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # Python joins non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _reopen_streams(unbuffered: bool) -> None:
    """stdin, stdout and stderr as a new interpreter opens them on fds 0-2."""
    def text(fd: int, mode: str, **kwargs: Any) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        buffered: BinaryIO = raw if unbuffered and mode == "w" else (  # type: ignore[assignment]
            io.BufferedWriter(raw) if mode == "w" else io.BufferedReader(raw))
        return io.TextIOWrapper(buffered, encoding="utf-8", write_through=unbuffered, **kwargs)

    sys.stdin = sys.__stdin__ = text(0, "r")
    sys.stdout = sys.__stdout__ = text(1, "w", line_buffering=os.isatty(1))
    sys.stderr = sys.__stderr__ = text(2, "w", errors="backslashreplace", line_buffering=True)


def _reseed() -> None:
    """numpy's global generator, drawn afresh as in a new process (``random`` reseeds itself
    at fork)."""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


# --- the client ---------------------------------------------------------------------------

class _Server:
    """This test process's fork server, started on first use and ended with the process."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="polyrl-forked-")
        self.path = str(Path(self.folder) / "server")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
        self.process = subprocess.Popen([sys.executable, __file__, self.path], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the fork server did not start (exit {self.process.wait()})")
        atexit.register(self.close)

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        assert self.process.stdout is not None
        self.process.stdout.close()
        shutil.rmtree(self.folder, ignore_errors=True)  # its socket, and any CPU report left


_server: _Server | None = None
_server_lock = threading.Lock()
_attached: str | None = None  # in a forked command: its server's path (:func:`_route`)


def _server_path() -> str:
    """The fork server's socket: the one this command was forked from, else this process's own
    (started on first use)."""
    global _server
    if _attached is not None:
        return _attached
    with _server_lock:
        if _server is None or _server.process.poll() is not None:
            _server = _Server()
        return _server.path


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0"


def _module_of(args: list[Any]) -> str | None:
    args = [os.fspath(a) for a in args]
    if len(args) >= 3 and args[0] == sys.executable and args[1] == "-m" and enabled():
        return args[2]
    return None


class Popen:
    """:class:`subprocess.Popen` for ``[sys.executable, "-m", module, …]``, forked from the
    server: ``pid``, ``returncode``, ``stdout`` and ``stderr`` (pipes, when asked for),
    ``poll``, ``wait``, ``communicate``, ``send_signal``, ``terminate`` and ``kill``."""

    def __new__(cls, args: list[str], **kwargs: Any) -> Any:
        if kwargs.get("server") is None and _module_of(list(args)) is None:
            return subprocess.Popen(args, **kwargs)
        return super().__new__(cls)

    def __init__(self, args: list[str], *, cwd: str | Path | None = None,
                 env: dict[str, str] | None = None, stdin: Any = None, stdout: Any = None,
                 stderr: Any = None, text: bool = False, start_new_session: bool = False,
                 server: str | None = None, watch: int | None = None) -> None:
        self.args, self.returncode = [os.fspath(a) for a in args], None
        target = {"module": self.args[2], "args": self.args[3:]} if self.args[1] == "-m" else \
            {"script": self.args[1], "args": self.args[2:]}  # (:func:`start_script`)
        self.stdin = self.stdout = self.stderr = None
        ends: list[int] = []  # the child's stdin, stdout, stderr
        mine: list[int] = []  # what this process closes once the server has them
        for fd, spec, name in ((0, stdin, "stdin"), (1, stdout, "stdout"), (2, stderr, "stderr")):
            if spec == subprocess.PIPE:
                read, write = os.pipe()
                child, parent = (read, write) if fd == 0 else (write, read)
                setattr(self, name, os.fdopen(parent, ("w" if fd == 0 else "r") + ("" if text else "b"),
                                              **({"encoding": "utf-8"} if text else {})))
                ends.append(child)
                mine.append(child)
            elif spec == subprocess.DEVNULL or (spec is None and fd == 0):
                ends.append(os.open(os.devnull, os.O_RDWR))
                mine.append(ends[-1])
            elif spec == subprocess.STDOUT:
                ends.append(ends[1])
            elif spec is None:
                ends.append(fd)
            else:
                ends.append(spec if isinstance(spec, int) else spec.fileno())
        server = server or _server_path()
        self._connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._connection.connect(server)
            request = {**target, "new_session": start_new_session, "watch": watch,
                       "cwd": str(cwd or os.getcwd()), "env": dict(os.environ if env is None else env),
                       "server": server}
            socket.send_fds(self._connection, [json.dumps(request).encode()], ends)
            self.pid = json.loads(self._connection.recv(1 << 16))["pid"]
        finally:
            for fd in mine:
                os.close(fd)
        self._output: dict[str, list[bytes | str]] = {}
        self._readers: list[threading.Thread] = []

    def poll(self) -> int | None:
        if self.returncode is None:
            self._connection.setblocking(False)
            try:
                self._ended(self._connection.recv(1 << 16))
            except BlockingIOError:
                pass
            finally:
                if self.returncode is None:
                    self._connection.setblocking(True)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._connection.settimeout(timeout)
            try:
                self._ended(self._connection.recv(1 << 16))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        assert self.returncode is not None
        return self.returncode

    def _ended(self, message: bytes) -> None:
        global children_cpu_s
        if not message:
            raise RuntimeError(f"the fork server ended before pid {self.pid} did")
        ended = json.loads(message)
        self.returncode = ended["returncode"]
        children_cpu_s += ended["cpu_s"]
        self._connection.close()

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        if not self._readers:
            if self.stdin is not None:
                if input:
                    self.stdin.write(input)
                self.stdin.close()
            for name in ("stdout", "stderr"):
                if (stream := getattr(self, name)) is not None:
                    chunks = self._output.setdefault(name, [])
                    reader = threading.Thread(target=lambda s=stream, c=chunks: c.append(s.read()),
                                              daemon=True)
                    reader.start()
                    self._readers.append(reader)
        for reader in self._readers:
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(timeout)
        for name in ("stdout", "stderr"):
            if (stream := getattr(self, name)) is not None:
                stream.close()
        return tuple(self._output[n][0] if n in self._output else None  # type: ignore[return-value]
                     for n in ("stdout", "stderr"))

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> Popen:  # noqa: PYI034 - __new__ may return a subprocess.Popen
        return self

    def __exit__(self, *_: object) -> None:
        for stream in (self.stdout, self.stderr, self.stdin):
            if stream is not None:
                stream.close()
        self.wait()


def start_script(server: str, args: list[str], watch: int) -> Popen:
    """``[python, script, …]`` forked from ``server`` with this process's streams, directory and
    environment, ended when process ``watch`` ends (tests/ray_worker.py)."""
    return Popen(args, server=server, watch=watch)


RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # Ray reads a job's runtime_env from it at ray.init


def ray_workers_env() -> dict[str, str]:
    """The environment under which a Ray cluster a test starts forks its Python workers from
    this process's fork server (tests/ray_worker.py as the job's ``py_executable``), instead
    of starting each actor as a new interpreter that imports torch and transformers (about 6
    CPU-seconds each on 2 cores, and tests start dozens). Empty with ``POLYRL_TEST_FORK=0``."""
    if not enabled():
        return {}
    client = Path(__file__).with_name("ray_worker.py")
    job = {"runtime_env": {"py_executable": f"{sys.executable} {client} {_server_path()}"}}
    return {RAY_JOB_ENV: json.dumps(job)}


def run(args: list[str], *, capture_output: bool = False, timeout: float | None = None,
        check: bool = False, input: Any = None, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """:func:`subprocess.run` for ``[sys.executable, "-m", module, …]``, forked (:class:`Popen`)."""
    if _module_of(list(args)) is None:
        return subprocess.run(args, capture_output=capture_output, timeout=timeout, check=check,
                              input=input, **kwargs)
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with Popen(args, **kwargs) as process:
        try:
            out, err = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    done = subprocess.CompletedProcess(args, process.returncode, out, err)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    serve(sys.argv[1])
