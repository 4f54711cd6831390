"""Ray's ``py_executable`` in the tests (:func:`forked.ray_workers_env`):
``python ray_worker.py <fork server> <ray's worker script> <its arguments …>``.

The raylet starts this process as a Python worker; it forks the worker from the tests' fork
server (tests/forked.py: torch and transformers imported once), passes its streams, directory
and environment on, forwards the signals it can catch, and exits as the worker did. The worker
ends when this process does, SIGKILL included, so whatever the raylet does to the process it
started reaches the worker. The worker registers with the raylet itself, under its own pid.
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import forked


def main() -> int:
    server, *worker = sys.argv[1:]
    process = forked.start_script(server, [sys.executable, *worker], watch=os.getpid())
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                signal.SIGUSR2):
        signal.signal(sig, lambda sig, _: process.send_signal(sig))
    code = process.wait()
    if code < 0:  # killed by a signal: so is this process, as the raylet would see the worker
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main())
