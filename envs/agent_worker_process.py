"""One worker process of ``env.processes`` (:mod:`envs.agent_workers` starts it): it connects
back to the run over a Unix socket, runs every episode it is sent concurrently on its own event
loop, and sends back what each program returned or raised.

``python -m envs.agent_worker_process <socket> <package.module:program> <timeout_s>``
"""

from __future__ import annotations

import logging
import pickle
import sys
import traceback
from typing import Any

import anyio
from anyio.streams.buffered import BufferedByteReceiveStream

from envs.agent import AgentProgram
from envs.agent_workers import receive, send
from envs.base import Task


async def _serve(path: str, program_path: str, timeout_s: float) -> None:
    program = AgentProgram.load(program_path)
    try:
        stream = await anyio.connect_unix(path)
    except OSError:  # the run closed before this worker came up
        return
    buffered, lock = BufferedByteReceiveStream(stream), anyio.Lock()
    scopes: dict[int, anyio.CancelScope] = {}

    async def episode(eid: int, task: Task, endpoint: Any) -> None:
        with anyio.CancelScope() as scope:
            scopes[eid] = scope
            try:
                reply: tuple[Any, ...] = ("done", eid, await program.run(task, endpoint,
                                                                         timeout_s))
            except Exception as e:  # noqa: BLE001 (the program's failure goes back as data)
                reply = ("error", eid, f"{type(e).__name__}: {e}", type(e).__name__,
                         traceback.format_exc())
            finally:
                scopes.pop(eid, None)
            try:
                data = pickle.dumps(reply)
            except Exception as e:  # noqa: BLE001 (whatever pickling raises is the program's)
                message = f"TypeError: the program's result cannot be sent back from its worker: {e}"
                data = pickle.dumps(("error", eid, message, "TypeError", ""))
            await send(stream, lock, data)

    async with anyio.create_task_group() as tg:
        try:
            while True:
                kind, eid, *rest = await receive(buffered)
                if kind == "run":
                    tg.start_soon(episode, eid, *rest)
                elif eid in scopes:
                    scopes[eid].cancel()
        except (anyio.EndOfStream, anyio.IncompleteRead):
            tg.cancel_scope.cancel()  # the run is over


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="agent worker: %(levelname)s %(message)s")
    anyio.run(_serve, sys.argv[1], sys.argv[2], float(sys.argv[3]))
