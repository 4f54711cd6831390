"""Tools a model can call: a name, a JSON schema in the OpenAI function-calling shape, and an
async call that returns a typed :class:`ToolResult` — never an exception for a model mistake.

Most tools are plain typed async functions wrapped with :func:`tool`; the schema comes from
the signature (``str``, ``int``, ``float``, ``bool``, ``list[...]``, ``dict``, ``Literal``,
optional parameters) and the docstring (first paragraph: the description; an ``Args:``
section: one line per parameter). Arguments are checked against the schema before the call,
so a wrong type becomes an ``error`` result the model can read.

Calls are bounded in time: past ``timeout`` seconds the result is ``timeout``. An exception
raised by the tool body is recorded as an ``error`` result with its type and message (a
:class:`ToolError` adds metadata). A body returns the content as a string,
or a :class:`ToolOutput` to add metadata for the trace.

A call is timed with the clock it is handed: the run's one clock (:attr:`envs.base.EnvSpec.clock`,
passed down by :class:`~envs.toolset.ToolSet`), so ``ToolResult.started`` lies on the timeline
of every other span of the run, and ``latency`` is the difference of two of its readings.
(Durations a tool measures inside itself, such as a client's attempts, may use any clock.)

Per-episode state (a sandbox session, an HTTP client) lives in an :class:`EpisodeContext`:
a function tool that declares a parameter annotated ``EpisodeContext`` gets the episode's
context injected (the parameter is left out of the schema), creates its resource on first
use with :meth:`EpisodeContext.resource`, and the environment closes every resource when
the episode ends — also when it is cancelled.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, TypeVar

import anyio

from envs.base import Clock
from sandboxes.api import EngineUnavailable

T = TypeVar("T")


class EpisodeContext:
    """Resources of one episode, created on first use and closed together at its end."""

    def __init__(self) -> None:
        self._stack = AsyncExitStack()
        self._resources: dict[str, Any] = {}
        self._lock = anyio.Lock()
        self.closed = False

    async def resource(self, name: str, factory: Callable[[], AbstractAsyncContextManager[T]]) -> T:
        async with self._lock:  # two concurrent calls of one turn must not both create it
            if self.closed:
                raise RuntimeError("the episode has ended")
            if name not in self._resources:
                self._resources[name] = await self._stack.enter_async_context(factory())
            return self._resources[name]

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):  # release even when the episode was cancelled
            self.closed = True
            await self._stack.aclose()


class ToolStatus(StrEnum):
    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class ToolResult:
    status: ToolStatus
    content: str
    started: float  # a reading of the clock the call was handed, when it began
    latency: float = 0.0  # seconds, measured around the call
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status is ToolStatus.OK


class ToolError(Exception):
    """Raised by a tool body to report a failure with metadata for the trace."""

    def __init__(self, message: str, metadata: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.metadata = metadata or {}


@dataclass(frozen=True)
class ToolOutput:
    """What a tool body may return instead of a plain string: the content the model reads and
    metadata for the trace (attempts made, queries sent, …)."""

    content: str
    metadata: dict[str, Any] = field(default_factory=dict)


class Tool(ABC):
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    timeout: float = 30.0

    @abstractmethod
    async def run(self, arguments: Mapping[str, Any],
                  context: EpisodeContext | None = None) -> str | ToolOutput:
        """Do the work; raise to report an error (it becomes an ``error`` result)."""

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function-calling description of this tool."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    async def __call__(self, arguments: Mapping[str, Any], context: EpisodeContext | None = None,
                       *, clock: Clock) -> ToolResult:
        start = clock()
        problem = check_arguments(self.parameters, arguments)
        if problem is not None:
            return ToolResult(ToolStatus.ERROR, f"{self.name}: {problem}", start,
                              metadata={"error_kind": "bad_arguments"})
        try:
            with anyio.fail_after(self.timeout):
                content = await self.run(arguments, context)
        except TimeoutError:
            return ToolResult(ToolStatus.TIMEOUT, f"{self.name} timed out after {self.timeout:g} s",
                              start, clock() - start, {"error_kind": "timeout"})
        except EngineUnavailable:
            raise  # the backend itself is gone: the run ends (with a checkpoint), not the call
        except Exception as e:  # noqa: BLE001 - a failing tool is recorded, never raised into the episode
            if isinstance(e, ToolError):  # the tool's own account of what went wrong
                message, metadata = f"{self.name}: {e}", {"error_kind": "tool_failed", **e.metadata}
            else:
                message, metadata = f"{self.name} failed: {type(e).__name__}: {e}", {"error_kind": "tool_failed"}
            return ToolResult(ToolStatus.ERROR, message, start, clock() - start, metadata)
        latency = clock() - start
        if isinstance(content, ToolOutput):
            return ToolResult(ToolStatus.OK, content.content, start, latency, dict(content.metadata))
        return ToolResult(ToolStatus.OK, str(content), start, latency)


class FunctionTool(Tool):
    def __init__(self, fn: Callable[..., Awaitable[Any]], name: str | None = None,
                 timeout: float = 30.0) -> None:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"tool {fn.__name__!r} must be an async function")
        self.fn = fn
        self.name = name or fn.__name__
        self.timeout = timeout
        self.description, self.parameters = function_schema(fn)
        hints = typing.get_type_hints(fn)
        self._context_param = next((n for n, h in hints.items() if h is EpisodeContext), None)

    async def run(self, arguments: Mapping[str, Any],
                  context: EpisodeContext | None = None) -> str | ToolOutput:
        kwargs = dict(arguments)
        if self._context_param is not None:
            if context is None:
                raise RuntimeError(f"tool {self.name!r} needs an episode context")
            kwargs[self._context_param] = context
        return await self.fn(**kwargs)


def tool(fn: Callable[..., Awaitable[Any]] | None = None, *, name: str | None = None,
         timeout: float = 30.0) -> Any:
    """Decorator: ``@tool`` or ``@tool(name=..., timeout=...)`` turns an async function into a Tool."""
    if fn is None:
        return lambda f: FunctionTool(f, name=name, timeout=timeout)
    return FunctionTool(fn, name=name, timeout=timeout)


# -- schema from a signature -----------------------------------------------------------------

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean",
                               dict: "object", list: "array"}


def _type_schema(annotation: Any) -> tuple[dict[str, Any], bool]:
    """JSON schema of ``annotation`` and whether None is allowed."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union {annotation!r} in a tool signature")
        return _type_schema(args[0])[0], True
    if origin is Literal:
        values = list(typing.get_args(annotation))
        return {"type": _JSON_TYPES[type(values[0])], "enum": values}, False
    if origin in (list, tuple):
        args = typing.get_args(annotation)
        items = _type_schema(args[0])[0] if args else {}
        return {"type": "array", "items": items}, False
    if origin is dict or annotation is dict:
        return {"type": "object"}, False
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}, False
    raise TypeError(f"unsupported type {annotation!r} in a tool signature")


def _docstring(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    doc = inspect.getdoc(fn) or ""
    parts = re.split(r"^\s*Args:\s*$", doc, maxsplit=1, flags=re.MULTILINE)
    description = " ".join(parts[0].split("\n\n")[0].split())
    params: dict[str, str] = {}
    if len(parts) == 2:
        current = None
        for line in parts[1].splitlines():
            m = re.match(r"^\s*(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line)
            if m:
                current = m.group(1)
                params[current] = m.group(2).strip()
            elif current and line.strip():
                params[current] += " " + line.strip()
    return description, params


def function_schema(fn: Callable[..., Any]) -> tuple[str, dict[str, Any]]:
    """(description, parameters schema) of a typed function."""
    hints = typing.get_type_hints(fn)
    description, docs = _docstring(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, param in inspect.signature(fn).parameters.items():
        if hints.get(name) is EpisodeContext:
            continue  # injected by the environment, not chosen by the model
        if name not in hints:
            raise TypeError(f"tool parameter {name!r} of {fn.__name__} needs a type annotation")
        schema, optional = _type_schema(hints[name])
        if name in docs:
            schema["description"] = docs[name]
        properties[name] = schema
        if param.default is inspect.Parameter.empty and not optional:
            required.append(name)
    return description, {"type": "object", "properties": properties, "required": required,
                         "additionalProperties": False}


def _matches(value: Any, schema: Mapping[str, Any]) -> bool:
    kind = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        items = schema.get("items") or {}
        return isinstance(value, list) and all(_matches(v, items) for v in value)
    return True


def check_arguments(parameters: Mapping[str, Any], arguments: Mapping[str, Any]) -> str | None:
    """One sentence on what is wrong with ``arguments``, or None when they fit the schema."""
    if not isinstance(arguments, Mapping):
        return "arguments must be a JSON object"
    properties = parameters.get("properties", {})
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s): {', '.join(missing)}"
    for key, value in arguments.items():
        if key not in properties:
            if parameters.get("additionalProperties", True) is False:
                return f"unknown argument {key!r}; expected {', '.join(properties) or 'none'}"
            continue
        if value is None:
            continue
        if not _matches(value, properties[key]):
            expected = properties[key].get("enum") or properties[key].get("type")
            return f"argument {key!r} must be {expected}, got {json_type(value)}"
    return None


def json_type(value: Any) -> str:
    for py, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                     (list, "array"), (dict, "object")):
        if isinstance(value, py):
            return name
    return "null" if value is None else type(value).__name__
