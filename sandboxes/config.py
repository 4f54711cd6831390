"""Sandbox configuration: which backend, and the limits every backend honours.

A config is a frozen dataclass, and its class is the choice of backend. :class:`SandboxConfig`
holds the per-call limits every backend enforces; each backend subclasses it with its own keys
and implements :meth:`SandboxConfig.pool`, which returns its pool unopened::

    config = sandbox_config({"_target_": "sandboxes.local.LocalSandboxConfig", "timeout_s": 2})
    async with config.pool() as pool, pool.session() as sb:
        await sb.exec("print(1)")

``conf/sandbox/<name>.yaml`` is such a mapping: ``_target_`` is the dotted path of the subclass
(anything importable, so a backend may live outside this package) and the other keys are its
fields. :func:`sandbox_config` resolves ``_target_`` with importlib (no Hydra here) and builds
the config; a mistake (an unknown key, a ``_target_`` that does not import or is no config, a
value of the wrong type or out of range) is one :class:`~sandboxes.api.SandboxConfigError` line
that names the key. Nothing here branches on a backend's name.

Every limit a model's code runs under lives in the config; nothing an episode passes at run
time can raise it (a call's ``timeout`` and :class:`~sandboxes.api.ExecLimits` only shorten).
Defaults are the safe ones.

Writing a backend: ``@dataclass(frozen=True, kw_only=True)`` on a subclass, its keys as fields,
their checks in ``__post_init__`` after ``super().__post_init__()`` (with :meth:`require`), and
``pool()``. :mod:`sandboxes.local` is a whole backend in one module.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import inspect
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sandboxes.api import ExecLimits, SandboxConfigError, SandboxPool

DEFAULT_TARGET = "sandboxes.docker.DockerSandboxConfig"  # the backend a None config means


@dataclass(frozen=True, kw_only=True)
class SandboxConfig(ABC):
    """The limits of one call and of one session, honoured by every backend."""

    timeout_s: float = 10.0           # wall time of a call when none is given
    max_timeout_s: float = 30.0       # a call's own timeout is capped here
    max_output_bytes: int = 65536     # stdout + stderr; more ends the call (output_truncated)
    host_grace_s: float = 3.0         # the host waits this long past the timeout, then kills
    memory_mb: int = 512              # memory of a session (Docker: the container's; local: RLIMIT_AS)
    fsize_mb: int = 64                # largest file a process may write
    nofile: int = 256                 # open files

    def __post_init__(self) -> None:
        for key, hint in _field_types(type(self)).items():
            _check_type(key, getattr(self, key), hint)
        self.require("timeout_s", self.timeout_s > 0, "> 0")
        self.require("max_timeout_s", self.max_timeout_s > 0, "> 0")
        self.require("max_output_bytes", self.max_output_bytes > 0, "> 0")
        self.require("host_grace_s", self.host_grace_s >= 0, ">= 0")
        self.require("memory_mb", self.memory_mb >= 16, ">= 16")
        self.require("fsize_mb", self.fsize_mb >= 1, ">= 1")
        self.require("nofile", self.nofile >= 16, ">= 16")

    @abstractmethod
    def pool(self) -> SandboxPool:
        """This backend's pool, not yet open: ``async with config.pool() as pool``."""

    def require(self, key: str, ok: bool, rule: str) -> None:
        """Raise ``sandbox.<key> must be <rule>, got <value>`` unless ``ok``."""
        if not ok:
            raise SandboxConfigError(f"sandbox.{key} must be {rule}, got {getattr(self, key)!r}")

    def call_limits(self, timeout: float | None, limits: ExecLimits | None) -> tuple[float, int]:
        """(timeout_s, max_output_bytes) of one call: what it asks for, capped by the config."""
        asked = [t for t in (timeout, limits.timeout_s if limits else None) if t is not None]
        timeout_s = min([self.max_timeout_s, *asked]) if asked else min(self.timeout_s,
                                                                         self.max_timeout_s)
        output = self.max_output_bytes
        if limits is not None and limits.max_output_bytes is not None:
            output = min(output, limits.max_output_bytes)
        return max(timeout_s, 0.001), max(output, 0)


def sandbox_config(values: SandboxConfig | Mapping[str, Any] | None = None) -> SandboxConfig:
    """The config a mapping with a ``_target_`` describes (a ``conf/sandbox/*.yaml`` node as a
    dict or a DictConfig); a config is returned as it is, None gives the Docker defaults."""
    if isinstance(values, SandboxConfig):
        return values
    if values is None:
        values = {"_target_": DEFAULT_TARGET}
    if not isinstance(values, Mapping):
        raise SandboxConfigError(f"sandbox must be a mapping with a _target_, got {values!r}")
    fields = {str(k): v for k, v in values.items()}
    target = fields.pop("_target_", None)
    cls = config_class(target)
    known = sorted(f.name for f in dataclasses.fields(cls) if f.init)
    unknown = sorted(set(fields) - set(known))
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise SandboxConfigError(f"sandbox.{unknown[0]} is not a key of {target}{hint}; "
                                 f"known: {', '.join(known)}")
    return cls(**fields)


def config_class(target: object) -> type[SandboxConfig]:
    """The :class:`SandboxConfig` subclass a dotted path names."""
    if not isinstance(target, str) or not target:
        raise SandboxConfigError(f"sandbox._target_ must name a SandboxConfig subclass, e.g. "
                                 f"{DEFAULT_TARGET}; got {target!r}")
    module_name, _, name = target.rpartition(".")
    if not module_name:
        raise SandboxConfigError(f"sandbox._target_={target} is not a dotted path module.Class")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise SandboxConfigError(f"sandbox._target_={target} cannot be imported: {reason}") from e
    cls = getattr(module, name, None)
    if cls is None:
        raise SandboxConfigError(f"sandbox._target_={target} cannot be imported: "
                                 f"module {module_name} has no {name}")
    if not (inspect.isclass(cls) and issubclass(cls, SandboxConfig)):
        raise SandboxConfigError(f"sandbox._target_={target} is not a subclass of "
                                 f"sandboxes.config.SandboxConfig")
    if inspect.isabstract(cls):
        raise SandboxConfigError(f"sandbox._target_={target} is abstract: name a backend's "
                                 f"config, e.g. {DEFAULT_TARGET}")
    return cls


def make_sandbox_pool(config: SandboxConfig | Mapping[str, Any] | None = None) -> SandboxPool:
    """The unopened pool of a config, a mapping with a ``_target_``, or None (Docker defaults)."""
    return sandbox_config(config).pool()


@functools.cache
def _field_types(cls: type[SandboxConfig]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name in hints}


_KINDS: dict[type, tuple[tuple[type, ...], str]] = {
    bool: ((bool,), "true or false"),
    int: ((int,), "a whole number"),
    float: ((int, float), "a number"),
    str: ((str,), "a string"),
}


def _check_type(key: str, value: Any, hint: Any) -> None:
    """One line when ``value`` does not fit a field of type bool, int, float, str, or X | None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None and len(arms) < len(typing.get_args(hint)):
            return
        hint = arms[0] if len(arms) == 1 else None
    if hint not in _KINDS:
        return  # a type this check does not know: the backend checks it itself
    allowed, what = _KINDS[hint]
    if not isinstance(value, allowed) or (hint is not bool and isinstance(value, bool)):
        raise SandboxConfigError(f"sandbox.{key} must be {what}, got {value!r}")


__all__ = ["DEFAULT_TARGET", "SandboxConfig", "config_class", "make_sandbox_pool",
           "sandbox_config"]
