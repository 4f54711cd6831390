"""Tool-call parsing from a model's reply, behind a registry of formats.

The built-in format is Hermes/Qwen's: each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``. A parser
never raises on model output: whatever it cannot read becomes a :class:`CallError` that the
environment turns into an error observation, and parsing goes on with the next call.
Checking calls against the available tools (unknown name, argument types) is the
environment's job, since the parser does not know the tool set.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    index: int  # position among the reply's calls


@dataclass(frozen=True)
class CallError:
    kind: str  # "malformed_json" | "bad_call" | "unclosed"
    message: str
    index: int


@dataclass(frozen=True)
class ParsedReply:
    content: str  # the reply with the calls taken out
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[CallError, ...] = field(default_factory=tuple)

    @property
    def attempted(self) -> int:
        return len(self.calls) + len(self.errors)


class ToolCallParser(ABC):
    @abstractmethod
    def parse(self, reply: str) -> ParsedReply: ...


_PARSERS: dict[str, type[ToolCallParser]] = {}
P = TypeVar("P", bound=type[ToolCallParser])


def register_parser(name: str) -> Callable[[P], P]:
    def decorate(cls: P) -> P:
        _PARSERS[name] = cls
        return cls

    return decorate


def make_parser(name: str) -> ToolCallParser:
    if name not in _PARSERS:
        raise KeyError(f"unknown tool-call format {name!r}; registered: {', '.join(sorted(_PARSERS))}")
    return _PARSERS[name]()


@register_parser("hermes")
class HermesParser(ToolCallParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    @classmethod
    def format(cls, name: str, arguments: dict[str, Any]) -> str:
        """A call in this format, compact JSON (what reference episodes show the model)."""
        body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
        return f"{cls.OPEN}{body}{cls.CLOSE}"

    def parse(self, reply: str) -> ParsedReply:
        calls: list[ToolCall] = []
        errors: list[CallError] = []
        for index, match in enumerate(self._BLOCK.finditer(reply)):
            body, closing = match.group(1).strip(), match.group(2)
            if not closing:
                errors.append(CallError("unclosed", f"tool call {index + 1} has no {self.CLOSE}", index))
                continue
            try:
                data = json.loads(body)
            except json.JSONDecodeError as e:
                errors.append(CallError(
                    "malformed_json", f"tool call {index + 1} is not valid JSON ({e.msg} at "
                    f"position {e.pos})", index))
                continue
            problem = self._shape(data)
            if problem:
                errors.append(CallError("bad_call", f"tool call {index + 1} {problem}", index))
                continue
            calls.append(ToolCall(data["name"], data.get("arguments") or {}, index))
        content = self._BLOCK.sub("", reply).strip()
        return ParsedReply(content, tuple(calls), tuple(errors))

    @staticmethod
    def _shape(data: Any) -> str | None:
        if not isinstance(data, dict):
            return 'must be a JSON object {"name": ..., "arguments": {...}}'
        if not isinstance(data.get("name"), str) or not data["name"]:
            return 'needs a "name" string'
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):  # some models double-encode the arguments
            try:
                data["arguments"] = arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return 'has "arguments" that are not a JSON object'
        if arguments is not None and not isinstance(arguments, dict):
            return 'has "arguments" that are not a JSON object'
        return None
