"""The sandbox interface every backend implements: typed results, limits, errors.

``Sandbox.exec`` runs Python in the episode's session (or a shell command) and returns an
:class:`ExecResult`; a model mistake (an exception, a crash, a timeout, an out-of-memory kill)
is a status, never an exception. Exceptions are for the operator: a bad config, no engine, no
image, a broken pool. A backend is a :class:`SandboxPool` plus the
:class:`~sandboxes.config.SandboxConfig` subclass that builds it (see :mod:`sandboxes.config`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Self

ExecStatus = Literal["ok", "timeout", "oom", "killed", "output_truncated", "error"]
STATUSES: tuple[ExecStatus, ...] = ("ok", "timeout", "oom", "killed", "output_truncated", "error")
Language = Literal["python", "shell"]


@dataclass(frozen=True)
class ExecResult:
    """What one call produced. ``exit_code`` is None when the call did not end by itself
    (timeout, truncation, a lost sandbox); a kill by signal N reads ``128 + N`` (OOM: 137).
    ``session_reset``: the Python state is gone, the next call starts from a fresh namespace."""

    stdout: str
    stderr: str
    exit_code: int | None
    status: ExecStatus
    duration_s: float
    session_reset: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.exit_code == 0


@dataclass(frozen=True)
class ExecLimits:
    """Per-call limits a caller (never the model) may tighten; each is capped by the config."""

    timeout_s: float | None = None
    max_output_bytes: int | None = None


class SandboxConfigError(ValueError):
    """A sandbox config the operator must fix: one line naming the key (``sandbox.<key>``)."""


class SandboxError(RuntimeError):
    """The sandbox service itself is unusable (not a model mistake)."""


class EngineUnavailable(SandboxError):
    """The engine a backend runs on (the Docker daemon, a remote service) does not answer."""


class ImageMissing(SandboxError):
    """The configured image (or equivalent environment) is not available to the backend."""


class Sandbox(ABC):
    """One episode's sandbox: a stateful Python session plus shell commands."""

    @abstractmethod
    async def exec(self, code: str, *, language: Language = "python", timeout: float | None = None,
                   limits: ExecLimits | None = None) -> ExecResult:
        """Run ``code`` (Python in the session, or a ``/bin/sh -c`` command line).

        ``timeout`` and ``limits`` may only shorten the configured maximum."""


class SandboxPool(ABC):
    """Hands each episode its own :class:`Sandbox`; an async context manager."""

    @abstractmethod
    def session(self) -> AbstractAsyncContextManager[Sandbox]:
        """``async with pool.session() as sb:`` — a sandbox for one episode."""

    async def run(self, code: str, *, language: Language = "python",
                  timeout: float | None = None, limits: ExecLimits | None = None) -> ExecResult:
        """One call in a sandbox of its own (a session of one call)."""
        async with self.session() as sandbox:
            return await sandbox.exec(code, language=language, timeout=timeout, limits=limits)

    @abstractmethod
    async def aclose(self) -> None: ...

    def metrics(self) -> dict[str, float]:
        """Faults the pool rode out so far (``faults/…`` counters); none by default."""
        return {}

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()
