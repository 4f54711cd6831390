"""The session runner: the small program that runs inside a sandbox and executes requests.

Every backend that runs Python sessions shares it (the host side is :mod:`sandboxes.protocol`).
It is sent as source (``python3 -I -c``) and imports only modules built into any CPython (os,
select, signal, struct, sys, time), so it works in any image with an interpreter, and it speaks
a binary protocol over its stdin/stdout (fixed headers, nothing to parse but lengths):

    request  = u32 length, then  u8 op, f64 timeout_s, u32 max_output, body (UTF-8)
    response = u32 length, then  u8 status, i64 exit_code, f64 duration_s, u8 flags,
                                 u32 stdout_len, u32 stderr_len, stdout bytes, stderr bytes

Two processes: the *supervisor* (this loop) and a *kernel* forked from it that holds the
session's Python namespace, so variables persist across requests like a notebook. User code
runs in the kernel (or, for shell requests, in a child of the supervisor) with stdout/stderr on
pipes the supervisor reads. The supervisor enforces the wall time and the output cap itself
and, after every request, SIGKILLs every process the request left behind (background children,
``setsid`` daemons): with ``--kill-scope uid`` that is every process of its own uid but itself
and the kernel — safe only because, in a container, the long-lived PID 1 process runs as another
uid; with ``--kill-scope tree`` (the local sandbox) only the kernel's and children's trees.
A timeout, an overflow or a dead kernel resets the session (flag bit 0): the next request gets
a fresh namespace. A kernel killed by a signal (a segfault from ``ctypes``, SIGKILL) answers
``killed`` with exit code ``128 + N``. The kernel asks the OOM killer to pick it first
(``oom_score_adj``), and an OOM kill is told apart from other SIGKILLs by the memory cgroup's
``oom_kill`` counter.
"""

import os
import select
import signal
import struct
import sys
import time

OP_PING, OP_PYTHON, OP_SHELL, OP_RESET, OP_EXIT = range(5)
OK, TIMEOUT, OOM, KILLED, TRUNCATED, ERROR = range(6)
NO_EXIT = -(1 << 62)
REQ = struct.Struct(">BdI")
RESP = struct.Struct(">BqdBII")
LEN = struct.Struct(">I")
CGROUP_FILES = ("/sys/fs/cgroup/memory/memory.oom_control", "/sys/fs/cgroup/memory.events")


def read_exact(fd, n):
    chunks = []
    while n:
        data = os.read(fd, n)
        if not data:
            return None
        chunks.append(data)
        n -= len(data)
    return b"".join(chunks)


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def oom_kills():
    for path in CGROUP_FILES:
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return 0


def proc_info(pid):
    """(uid, ppid, state) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    return uid, int(fields[1]), fields[0]


def others(scope, keep, roots):
    """Live processes to kill: of our uid (scope uid) or descended from ``roots`` (scope tree)."""
    me, uid = os.getpid(), os.getuid()
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = proc_info(int(name))
            if info is not None and info[2] != b"Z":
                table[int(name)] = info
    if scope == "uid":
        return [p for p, (u, _, _) in table.items() if u == uid and p != me and p not in keep]
    victims = set(r for r in roots if r in table)
    grew = True
    while grew:
        grew = False
        for p, (_, ppid, _) in table.items():
            if ppid in victims and p not in victims:
                victims.add(p)
                grew = True
    return [p for p in victims if p != me and p not in keep]


FORK_WAIT_S = 5.0  # the longest a fork waits for the processes a request left to be reaped
NO_ROOM = b"the sandbox's process limit is full: nothing could be started"


def fork(deadline=None):
    """``os.fork``, waiting while the pids limit is full. The processes a request left behind
    are killed, but each still counts against the container's limit until init reaps it, so a
    fork just after a fork bomb can be refused (EAGAIN) for a few milliseconds. Raises
    BlockingIOError once ``deadline`` (default: FORK_WAIT_S from now) has passed."""
    if deadline is None:
        deadline = time.monotonic() + FORK_WAIT_S
    while True:
        try:
            return os.fork()
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.002)


def set_oom_first():
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


class Kernel:
    """A forked child holding the namespace; it runs one code string per request."""

    def __init__(self, deadline=None):
        self.pid_reaped = False
        ctl_r, self.ctl_w = os.pipe()
        self.res_r, res_w = os.pipe()
        self.out_r, out_w = os.pipe()
        self.err_r, err_w = os.pipe()
        try:
            self.pid = fork(deadline)
        except BlockingIOError:
            for fd in (ctl_r, res_w, out_w, err_w):
                os.close(fd)
            self.close()
            raise
        if self.pid == 0:
            try:
                child_setup(out_w, err_w, keep=(ctl_r, res_w))
                kernel_loop(ctl_r, res_w)
            finally:
                os._exit(0)
        for fd in (ctl_r, res_w, out_w, err_w):
            os.close(fd)
        for fd in (self.out_r, self.err_r, self.res_r):
            os.set_blocking(fd, False)

    def close(self):
        for fd in (self.ctl_w, self.res_r, self.out_r, self.err_r):
            try:
                os.close(fd)
            except OSError:
                pass


def child_setup(out_w, err_w, keep):
    """In a freshly forked child: own session, stdio on the pipes, every other fd closed."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 16)
    set_oom_first()


def kernel_loop(ctl_r, res_w):
    import builtins
    import faulthandler
    import traceback

    faulthandler.enable()  # a crash (a ctypes segfault) shows the cell's line on stderr
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    kernel_pid = os.getpid()
    while True:
        head = read_exact(ctl_r, 4)
        if head is None:
            return
        code = read_exact(ctl_r, LEN.unpack(head)[0]).decode("utf-8", "replace")
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        exit_code = 0
        try:
            run_cell(code, namespace)
        except SystemExit as e:
            exit_code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except BaseException as e:
            tb = e.__traceback__  # show the user's frames, not the kernel's
            while tb is not None and tb.tb_frame.f_code.co_filename != "<cell>":
                tb = tb.tb_next
            traceback.print_exception(type(e), e, tb)
            exit_code = 1
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                stream.flush()
            except Exception:
                pass
        if os.getpid() != kernel_pid:
            os._exit(exit_code & 0xFF)  # a child the cell forked: it must not answer
        write_all(res_w, struct.pack(">q", exit_code))


def run_cell(code, namespace):
    """Exec ``code``; like a notebook cell, print the repr of a final bare expression."""
    import ast

    tree = ast.parse(code, "<cell>", "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<cell>", "exec"), namespace)
    if last is not None:
        value = eval(compile(last, "<cell>", "eval"), namespace)
        if value is not None:
            print(repr(value))


class Supervisor:
    def __init__(self, scope, wipe):
        self.scope = scope
        self.wipe_dirs = wipe
        self.kernel = None
        self.proto_in = os.dup(0)
        self.proto_out = os.dup(1)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)

    def serve(self):
        self.kernel = Kernel()
        while True:
            head = read_exact(self.proto_in, 4)
            if head is None:
                return
            payload = read_exact(self.proto_in, LEN.unpack(head)[0])
            if payload is None:
                return
            op, timeout, max_out = REQ.unpack_from(payload)
            body = payload[REQ.size:]
            if op == OP_EXIT:
                self.reset(wipe=False)
                return
            start = time.monotonic()
            if op == OP_PING:
                result = (OK, 0, 0, b"", b"")
            elif op == OP_PYTHON:
                result = self.run_python(body, start + timeout, max_out)
            elif op == OP_SHELL:
                result = self.run_shell(body, start + timeout, max_out)
            elif op == OP_RESET:
                failures = self.reset(wipe=True)
                result = (OK if not failures else ERROR, failures, 1, b"", b"")
            else:
                result = (ERROR, NO_EXIT, 0, b"", b"unknown op %d" % op)
            status, exit_code, flags, out, err = result
            frame = RESP.pack(status, exit_code, time.monotonic() - start, flags, len(out),
                              len(err)) + out + err
            write_all(self.proto_out, LEN.pack(len(frame)) + frame)

    def run_python(self, body, deadline, max_out):
        try:
            if self.kernel is None:
                self.kernel = Kernel(deadline)
        except BlockingIOError:
            return ERROR, NO_EXIT, 1, b"", NO_ROOM
        kernel = self.kernel
        try:
            while os.read(kernel.res_r, 4096):  # stale answers (from a cell's forked child)
                pass
        except BlockingIOError:
            pass
        oom_before = oom_kills()
        try:
            write_all(kernel.ctl_w, LEN.pack(len(body)) + body)
        except OSError:
            self.reset(wipe=False)
            try:
                kernel = self.kernel = Kernel(deadline)
            except BlockingIOError:
                return ERROR, NO_EXIT, 1, b"", NO_ROOM
            write_all(kernel.ctl_w, LEN.pack(len(body)) + body)
        done = []

        def finished():
            try:
                data = os.read(kernel.res_r, 8)
            except BlockingIOError:
                data = None
            if data and len(data) == 8:
                done.append(("exit", struct.unpack(">q", data)[0]))
                return True
            pid, status = os.waitpid(kernel.pid, os.WNOHANG)
            if pid:
                done.append(("died", status))
                return True
            return False

        outcome, out, err = self.collect(kernel.out_r, kernel.err_r, kernel.res_r, finished,
                                         deadline, max_out)
        if outcome == "done" and done[0][0] == "exit":
            self.kill_strays(keep=(kernel.pid,))
            out, err = self.drain_fds(kernel.out_r, kernel.err_r, out, err, max_out)
            return OK, done[0][1], 0, out, err
        # a timeout, an overflow or a dead kernel: the session starts again
        if outcome == "done":  # it died (a signal, an os._exit): keep what it wrote last
            kernel.pid_reaped = True
            self.kill_strays(keep=())
            out, err = self.drain_fds(kernel.out_r, kernel.err_r, out, err, max_out)
        self.kill_kernel()
        self.kill_strays(keep=())
        status, exit_code = self.classify(outcome, done[0][1] if done else None, oom_before)
        return status, exit_code, 1, bytes(out), bytes(err)

    def run_shell(self, body, deadline, max_out):
        oom_before = oom_kills()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            pid = fork(deadline)
        except BlockingIOError:
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            return ERROR, NO_EXIT, 0, b"", NO_ROOM
        if pid == 0:
            try:
                child_setup(out_w, err_w, keep=())
                os.execv("/bin/sh", ["/bin/sh", "-c", body.decode("utf-8", "replace")])
            finally:
                os._exit(127)
        os.close(out_w)
        os.close(err_w)
        os.set_blocking(out_r, False)
        os.set_blocking(err_r, False)
        waited = []

        def finished():
            wpid, status = os.waitpid(pid, os.WNOHANG)
            if wpid:
                waited.append(status)
            return bool(wpid)

        outcome, out, err = self.collect(out_r, err_r, None, finished, deadline, max_out)
        keep = (self.kernel.pid,) if self.kernel else ()
        if outcome != "done":
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        self.kill_strays(keep=keep, roots=(pid,))
        if not waited:
            waited.append(os.waitpid(pid, 0)[1])
        if outcome == "done":
            out, err = self.drain_fds(out_r, err_r, out, err, max_out)
        os.close(out_r)
        os.close(err_r)
        if outcome == "done" and os.WIFEXITED(waited[0]):
            return OK, os.WEXITSTATUS(waited[0]), 0, out, err
        status, exit_code = self.classify(outcome, waited[0], oom_before)
        return status, exit_code, 0, bytes(out), bytes(err)

    def classify(self, outcome, wait_status, oom_before):
        if outcome == "timeout":
            return TIMEOUT, NO_EXIT
        if outcome == "overflow":
            return TRUNCATED, NO_EXIT
        if wait_status is not None and os.WIFEXITED(wait_status):
            return OK, os.WEXITSTATUS(wait_status)
        sig = os.WTERMSIG(wait_status) if wait_status is not None else signal.SIGKILL
        if oom_kills() > oom_before:
            return OOM, 128 + sig
        return KILLED, 128 + sig

    def collect(self, out_fd, err_fd, done_fd, finished, deadline, max_out):
        """Read output until ``finished()``, the deadline or more than ``max_out`` bytes."""
        out, err = bytearray(), bytearray()
        streams = {out_fd: out, err_fd: err}
        extra = [self.wake_r] + ([done_fd] if done_fd is not None else [])
        while True:
            if finished():
                return "done", out, err
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout", out, err
            ready, _, _ = select.select(list(streams) + extra, [], [], min(left, 0.25))
            for fd in ready:
                if fd not in streams:
                    if fd == self.wake_r:
                        try:
                            os.read(fd, 512)
                        except BlockingIOError:
                            pass
                    continue
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not data:
                    del streams[fd]  # every writer closed it
                    continue
                room = max_out - len(out) - len(err)
                (out if fd == out_fd else err).extend(data[:max(room, 0)])
                if len(data) > room:
                    return "overflow", out, err

    def drain_fds(self, out_fd, err_fd, out, err, max_out):
        for fd, buf in ((out_fd, out), (err_fd, err)):
            while len(out) + len(err) < max_out:
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if not data:
                    break
                buf.extend(data[:max(max_out - len(out) - len(err), 0)])
        return bytes(out), bytes(err)

    def kill_kernel(self):
        if self.kernel is None:
            return
        try:
            os.killpg(self.kernel.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            os.kill(self.kernel.pid, signal.SIGKILL)
        except OSError:
            pass
        if not self.kernel.pid_reaped:
            try:
                os.waitpid(self.kernel.pid, 0)
            except ChildProcessError:
                pass
        self.kernel.close()
        self.kernel = None

    def kill_strays(self, keep, roots=()):
        roots = tuple(roots) + ((self.kernel.pid,) if self.kernel else ())
        for _ in range(200):
            victims = [p for p in others(self.scope, keep, roots) if p not in keep]
            if not victims:
                return
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.001)  # zombies are skipped; their parents (or init) reap them

    def reset(self, wipe):
        """Kill everything, empty the work dirs, start a fresh kernel; returns the failures."""
        self.kill_kernel()
        self.kill_strays(keep=())
        failures = 0
        if wipe:
            for path in self.wipe_dirs:
                failures += wipe_dir(path)
            try:
                self.kernel = Kernel()
            except BlockingIOError:
                failures += 1  # the next Python request starts one
        return failures


def wipe_dir(path):
    failures = 0
    try:
        names = os.listdir(path)
    except OSError:
        return 1
    for name in names:
        p = os.path.join(path, name)
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
                failures += wipe_dir(p)
                os.rmdir(p)
            else:
                os.unlink(p)
        except (OSError, RecursionError):
            failures += 1
    return failures


def main(argv):
    scope, wipe = "uid", []
    args = iter(argv)
    for arg in args:
        if arg == "--kill-scope":
            scope = next(args)
        elif arg == "--wipe":
            wipe.append(next(args))
        elif arg == "--rlimit":  # NAME=VALUE, e.g. AS=1073741824 (the local sandbox)
            import resource

            name, _, value = next(args).partition("=")
            limit = getattr(resource, "RLIMIT_" + name)
            resource.setrlimit(limit, (int(value), int(value)))
    Supervisor(scope, wipe).serve()


if __name__ == "__main__":
    main(sys.argv[1:])
