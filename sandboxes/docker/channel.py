"""The host end of a session runner in a container: the hijacked socket of a long-lived
``docker exec``, which carries Docker's multiplexed stream (8-byte frame headers, stdout and
stderr interleaved); the runner's protocol frames travel on its stdout."""

from __future__ import annotations

import socket
from typing import Any

import anyio

from sandboxes import protocol
from sandboxes.api import SandboxError


class RunnerGone(SandboxError):
    """The runner's stream ended: its process was killed or the container is gone."""


class RunnerChannel:
    """Async request/response over the hijacked exec socket (Docker's multiplexed frames)."""

    def __init__(self, sock_io: Any) -> None:
        self._io = sock_io  # keep the SocketIO (and its HTTP response) alive
        self._sock: socket.socket = getattr(sock_io, "_sock", sock_io)
        self._sock.setblocking(False)
        self._raw = bytearray()
        self._proto = bytearray()
        self.stderr = bytearray()

    async def roundtrip(self, data: bytes) -> bytes:
        view = memoryview(data)
        while view:
            try:
                view = view[self._sock.send(view):]
            except BlockingIOError:
                await anyio.wait_writable(self._sock)
            except OSError as e:
                raise RunnerGone(f"runner stream closed: {e}") from e
        while (frame := protocol.take_frame(self._proto)) is None:
            await self._receive()
        return frame

    async def _receive(self) -> None:
        while True:
            try:
                data = self._sock.recv(1 << 18)
                break
            except BlockingIOError:
                await anyio.wait_readable(self._sock)
            except OSError as e:
                raise RunnerGone(f"runner stream closed: {e}") from e
        if not data:
            raise RunnerGone("runner stream ended")
        self._raw += data
        while len(self._raw) >= 8:
            size = int.from_bytes(self._raw[4:8], "big")
            if len(self._raw) < 8 + size:
                break
            target = self._proto if self._raw[0] == 1 else self.stderr
            if target is self._proto or len(self.stderr) < 65536:
                target += self._raw[8:8 + size]
            del self._raw[:8 + size]

    def close(self) -> None:
        for closer in (getattr(self._io, "close", None), self._sock.close):
            try:
                if closer is not None:
                    closer()
            except OSError:
                pass
