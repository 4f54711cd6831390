"""Agent programs the gateway tests train, written as their authors would: against the openai
SDK (async, and sync from a worker thread), the OpenAI Agents SDK, and a verifiers
environment. None of them knows it is being trained."""

from __future__ import annotations

import json
from typing import Any

import anyio
from openai import AsyncOpenAI, OpenAI

from envs.base import Task

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def tasks(split: str) -> list[dict[str, Any]]:
    """Sums of two one-digit numbers: train and eval disjoint."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    chosen = pairs[:80] if split == "train" else pairs[80:]
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in chosen]


def digit_share(text: str) -> float:
    """The toy objective a tiny random model can learn in a few steps: the share of the
    reply's characters that are digits."""
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def tool_results(calls: Any) -> list[dict[str, Any]]:
    """Run each `add` call; a malformed one answers with its error."""
    results = []
    for call in calls:
        try:
            args = json.loads(call.function.arguments)
            result = str(int(args["a"]) + int(args["b"]))
        except (ValueError, KeyError, TypeError) as e:
            result = f"error: {e}"
        results.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return results


async def calculator(task: Task, client: AsyncOpenAI) -> float:
    """A tool loop: offer `add`, run whatever calls come back, ask again, until a plain reply
    (at most three calls); reward: the final reply's digit share, 1.0 for the exact sum."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.messages[0]["content"]}]
    reply = ""
    for _ in range(3):
        response = await client.chat.completions.create(
            model="any-model", messages=messages, tools=[ADD_TOOL])
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            reply = message.content or ""
            break
        messages += tool_results(message.tool_calls)
    return 1.0 if reply.strip() == task.answer else digit_share(reply)


def calculator_sync(task: Task, client: OpenAI) -> float:
    """The same loop with the synchronous client (the env runs it in a worker thread)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.messages[0]["content"]}]
    reply = ""
    for _ in range(3):
        message = client.chat.completions.create(
            model="any-model", messages=messages, tools=[ADD_TOOL],
        ).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            reply = message.content or ""
            break
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": str(int(args.get("a", 0)) + int(args.get("b", 0)))})
    return 1.0 if reply.strip() == task.answer else digit_share(reply)


async def transcript(task: Task, client: AsyncOpenAI) -> list[dict[str, Any]]:
    """Returns its transcript; the env's reward functions score it."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.messages[0]["content"]}]
    response = await client.chat.completions.create(model="m", messages=messages)
    return [*messages, response.choices[0].message.model_dump(exclude_none=True)]


def transcript_digits(completion: str, answer: str, metadata: Any,
                      transcript: list[dict[str, Any]]) -> float:
    assert completion == (transcript[-1].get("content") or "")
    return digit_share(completion)


def hangs(completion: str, answer: str, metadata: Any) -> float:
    """A reward that never returns (a stuck verifier)."""
    import time

    time.sleep(3600)
    return 1.0


async def flaky(task: Task, client: AsyncOpenAI) -> float:
    """By task id: two calls (the second extends the first), or a raise after one call, a
    hang, or a raise before any call."""
    kind = task.id % 4
    if kind == 3:
        raise RuntimeError("the program broke before calling the model")
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.messages[0]["content"]}]
    first = await client.chat.completions.create(model="m", messages=messages)
    if kind == 1:
        raise ValueError("the program broke after a call")
    if kind == 2:
        await anyio.sleep_forever()
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "and?"}]
    second = await client.chat.completions.create(model="m", messages=messages)
    return digit_share(second.choices[0].message.content or "")


async def agents_sdk(task: Task, client: AsyncOpenAI) -> float:
    """An OpenAI Agents SDK agent with a function tool, run by its Runner."""
    from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    agent = Agent(name="calculator", instructions="Add.", tools=[add],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    result = await Runner.run(agent, task.messages[0]["content"], max_turns=4,
                              run_config=RunConfig(tracing_disabled=True))
    reply = str(result.final_output)
    return 1.0 if reply.strip() == task.answer else digit_share(reply)
