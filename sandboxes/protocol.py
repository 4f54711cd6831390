"""Host side of the session runner's binary protocol (see :mod:`sandboxes.runner`), shared by
the backends that run the runner: requests to send, frames to cut from a byte stream, results."""

from __future__ import annotations

import struct
from pathlib import Path

from sandboxes.api import STATUSES, ExecResult, Language

RUNNER_SOURCE = (Path(__file__).with_name("runner.py")).read_text()
OP_PING, OP_PYTHON, OP_SHELL, OP_RESET, OP_EXIT = range(5)
NO_EXIT = -(1 << 62)
LEN = struct.Struct(">I")
REQ = struct.Struct(">BdI")
RESP = struct.Struct(">BqdBII")


def request(op: int, body: bytes = b"", timeout_s: float = 0.0, max_output: int = 0) -> bytes:
    payload = REQ.pack(op, timeout_s, max_output) + body
    return LEN.pack(len(payload)) + payload


def exec_request(code: str, language: Language, timeout_s: float, max_output: int) -> bytes:
    op = OP_PYTHON if language == "python" else OP_SHELL
    return request(op, code.encode("utf-8", "replace"), timeout_s, max_output)


def frame_length(buffer: bytes | bytearray) -> int | None:
    """Length of the whole response frame at the start of ``buffer`` once its header is in."""
    if len(buffer) < LEN.size:
        return None
    return LEN.size + LEN.unpack_from(buffer)[0]


def take_frame(buffer: bytearray) -> bytes | None:
    """The whole response frame at the start of ``buffer``, removed from it; None until it is in."""
    n = frame_length(buffer)
    if n is None or len(buffer) < n:
        return None
    frame = bytes(buffer[:n])
    del buffer[:n]
    return frame


def parse_response(frame: bytes) -> tuple[int, int, float, int, bytes, bytes]:
    """(status index, exit code, runner-side duration, flags, stdout, stderr)."""
    status, exit_code, duration, flags, out_len, err_len = RESP.unpack_from(frame, LEN.size)
    body = frame[LEN.size + RESP.size:]
    return status, exit_code, duration, flags, body[:out_len], body[out_len:out_len + err_len]


def to_result(frame: bytes, duration_s: float) -> ExecResult:
    status, exit_code, _, flags, out, err = parse_response(frame)
    return ExecResult(
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        exit_code=None if exit_code == NO_EXIT else exit_code,
        status=STATUSES[status] if status < len(STATUSES) else "error",
        duration_s=duration_s,
        session_reset=bool(flags & 1),
    )
