"""Awaiting actor calls: Ray's errors turned into the project's.

A call whose actor is gone raises Ray's ``RayActorError``; the callers here decide what that
means (an engine is re-run elsewhere, a trainer ends the run). A call that raised inside the
actor comes back as ``RayTaskError``: a project error (a :class:`ConfigError` from building an
engine, say) is raised again as itself so its one sentence reaches the user; anything else keeps
Ray's error with the remote traceback.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from orchestrator.errors import PolyRLError

__all__ = ["RayActorError", "result", "result_now", "unwrapped"]


def unwrapped(error: RayTaskError) -> BaseException:
    cause = error.cause
    return cause if isinstance(cause, PolyRLError) else error


async def result(ref: Any) -> Any:
    """Await an ObjectRef (the asyncio backend awaits them natively)."""
    try:
        return await ref
    except RayTaskError as error:
        cause = unwrapped(error)
        if cause is error:
            raise
        raise cause from error


def result_now(ref: Any, timeout: float | None = None) -> Any:
    """Block for an ObjectRef: only outside the run's event loop (building, checkpoints)."""
    try:
        return ray.get(ref, timeout=timeout)
    except RayTaskError as error:
        cause = unwrapped(error)
        if cause is error:
            raise
        raise cause from error
