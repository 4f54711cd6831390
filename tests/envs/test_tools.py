"""Tools (envs/tools.py), the Hermes tool-call parser (envs/parsers.py) and one turn of tool
calls (envs/toolset.py): every malformed-call case ends as an error observation."""

from __future__ import annotations

import json
import time
from typing import Literal

import anyio
import pytest

from envs.parsers import HermesParser, make_parser
from envs.tools import FunctionTool, ToolStatus, check_arguments, tool
from envs.toolset import ToolSet


@tool
async def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return str(a + b)


@tool(timeout=0.05)
async def slow(seconds: float) -> str:
    """Sleep."""
    await anyio.sleep(seconds)
    return "woke"


@tool
async def broken() -> str:
    """Always fails."""
    raise RuntimeError("disk on fire")


@tool
async def search(query: str, topk: int = 3, mode: Literal["bm25", "dense"] = "bm25",
                 tags: list[str] | None = None) -> str:
    """Search the corpus."""
    return f"{query}:{topk}:{mode}:{tags}"


def call(name: str, **arguments: object) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_schema_comes_from_the_signature_and_docstring() -> None:
    fn = add.schema["function"]
    assert fn["name"] == "add" and fn["description"] == "Add two integers."
    assert fn["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first addend"}
    assert fn["parameters"]["required"] == ["a", "b"]
    props = search.parameters["properties"]
    assert props["mode"] == {"type": "string", "enum": ["bm25", "dense"]}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert search.parameters["required"] == ["query"]


def test_untyped_or_sync_functions_are_refused() -> None:
    def sync(x: int) -> str:
        return ""

    async def untyped(x) -> str:  # noqa: ANN001
        return ""

    with pytest.raises(TypeError):
        FunctionTool(sync)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        FunctionTool(untyped)


@pytest.mark.parametrize(("arguments", "fragment"), [
    ({"a": 1}, "missing required argument(s): b"),
    ({"a": 1, "b": "2"}, "argument 'b' must be integer, got string"),
    ({"a": True, "b": 2}, "argument 'a' must be integer, got boolean"),
    ({"a": 1, "b": 2, "c": 3}, "unknown argument 'c'"),
])
def test_argument_checks_name_the_problem(arguments: dict, fragment: str) -> None:
    problem = check_arguments(add.parameters, arguments)
    assert problem is not None and fragment in problem


@pytest.mark.anyio
async def test_a_backend_that_is_gone_ends_the_run_instead_of_the_call() -> None:
    from sandboxes.api import EngineUnavailable

    @tool
    async def sandboxed() -> str:
        """Runs in a sandbox whose engine died."""
        raise EngineUnavailable("the Docker engine stopped answering")

    with pytest.raises(EngineUnavailable):
        await sandboxed({}, clock=time.perf_counter)


@pytest.mark.anyio
async def test_tool_results_are_typed_and_never_raise() -> None:
    clock = time.perf_counter
    ok = await add({"a": 2, "b": 3}, clock=clock)
    assert ok.status is ToolStatus.OK and ok.content == "5" and ok.latency >= 0
    late = await slow({"seconds": 1.0}, clock=clock)
    assert late.status is ToolStatus.TIMEOUT and late.metadata["error_kind"] == "timeout"
    failed = await broken({}, clock=clock)
    assert failed.status is ToolStatus.ERROR and "disk on fire" in failed.content
    wrong = await add({"a": "x", "b": 1}, clock=clock)
    assert wrong.status is ToolStatus.ERROR and wrong.metadata["error_kind"] == "bad_arguments"


def test_hermes_parser_reads_calls_and_keeps_the_text() -> None:
    parsed = HermesParser().parse("Let me add. " + call("add", a=1, b=2) + call("add", a=3, b=4))
    assert parsed.content == "Let me add."
    assert [(c.name, c.arguments, c.index) for c in parsed.calls] == [
        ("add", {"a": 1, "b": 2}, 0), ("add", {"a": 3, "b": 4}, 1)]
    assert parsed.errors == ()
    assert HermesParser().parse("no calls here").calls == ()


@pytest.mark.parametrize(("reply", "kind"), [
    ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "malformed_json"),
    ("<tool_call>[1, 2]</tool_call>", "bad_call"),
    ('<tool_call>{"arguments": {}}</tool_call>', "bad_call"),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "bad_call"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', "unclosed"),
])
def test_hermes_parser_turns_bad_calls_into_errors(reply: str, kind: str) -> None:
    parsed = make_parser("hermes").parse(reply)
    assert parsed.calls == () and [e.kind for e in parsed.errors] == [kind]


def test_double_encoded_arguments_are_accepted() -> None:
    reply = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    assert HermesParser().parse(reply).calls[0].arguments == {"a": 1, "b": 2}


def test_unknown_format_lists_the_registered_ones() -> None:
    with pytest.raises(KeyError, match="hermes"):
        make_parser("nope")


@pytest.mark.anyio
async def test_a_turn_turns_every_mistake_into_an_observation_and_counts_it() -> None:
    tools = ToolSet([add, slow, broken], max_calls_per_turn=2)
    reply = (call("add", a=1, b=2) + "<tool_call>{oops}</tool_call>" + call("nope")
             + call("add", a="x", b=1) + call("add", a=5, b=5))
    outcome = await tools.run_turn(HermesParser().parse(reply))
    contents = [m["content"] for m in outcome.observation]
    assert all(m["role"] == "tool" for m in outcome.observation)
    assert contents[0] == "3"
    assert "not valid JSON" in contents[1]
    assert "unknown tool 'nope'" in contents[2] and "add, broken, slow" in contents[2]
    assert "must be integer" in contents[3]
    assert "too many tool calls" in contents[4]
    m = outcome.metrics
    assert m["tools/calls"] == 5 and m["tools/ok"] == 1 and m["tools/errors"] == 4
    assert m["tools/error/malformed_json"] == 1 and m["tools/error/unknown_tool"] == 1
    assert m["tools/error/bad_arguments"] == 1 and m["tools/error/too_many"] == 1


@pytest.mark.anyio
async def test_calls_of_one_turn_run_concurrently_under_the_cap() -> None:
    running = 0
    peak = 0

    @tool
    async def wait() -> str:
        """Wait a little."""
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await anyio.sleep(0.02)
        running -= 1
        return "done"

    tools = ToolSet([wait], max_calls_per_turn=6, max_concurrency=3)
    outcome = await tools.run_turn(HermesParser().parse(call("wait") * 6))
    assert [m["content"] for m in outcome.observation] == ["done"] * 6
    assert peak == 3


@pytest.mark.anyio
async def test_a_turn_is_timed_with_the_tool_sets_clock() -> None:
    now = 50.0

    @tool
    async def tick() -> str:
        """Take two seconds of the clock."""
        nonlocal now
        now += 2.0
        return "ok"

    tools = ToolSet([tick], clock=lambda: now)
    outcome = await tools.run_turn(HermesParser().parse(call("tick") + call("nope")))
    ran, unknown = outcome.records
    assert (ran.started, ran.latency) == (50.0, 2.0)
    assert (unknown.started, unknown.latency) == (50.0, 0.0)  # never ran: stamped at the turn
