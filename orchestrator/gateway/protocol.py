"""The OpenAI wire format: requests read into typed records, responses and errors written out.

A request body is checked field by field before anything runs, and everything wrong with it is
a :class:`BadRequest` — answered with status 400 and OpenAI's error body
(``{"error": {"message", "type", "param", "code"}}``), naming the field to change:

* fields the gateway acts on: ``messages``, ``tools``, ``tool_choice``, ``max_tokens`` /
  ``max_completion_tokens``, ``stop``, ``n``, ``seed``, ``logprobs``, ``stream`` (and
  ``stream_options.include_usage``), ``model``; ``/v1/completions``: ``prompt`` (text or
  token ids), ``echo`` false, the same sampling fields;
* fields checked and then not acted on, because the run decides: ``temperature`` and
  ``top_p`` (every call samples at the run's ``rollout.temperature``, ``rollout.top_p`` and
  ``rollout.top_k`` — an evaluation's ``eval.*`` — since the trainer's importance weights are
  computed against the behaviour log-probs of exactly that sampling), and bookkeeping the gateway has no use for (``metadata``, ``store``, ``user``,
  ``parallel_tool_calls``, ``reasoning_effort``, …);
* fields whose only accepted value is their neutral one (``frequency_penalty`` and
  ``presence_penalty`` 0, no ``logit_bias``, ``response_format`` text, ``top_logprobs`` 0):
  anything else would change the sampling the trainer assumes, or needs alternatives the
  engines do not report;
* any other field is unknown: 400.

Messages become the project's chat messages (:data:`envs.base.Message`): ``developer`` is a
``system`` message, text parts are joined, an assistant's ``tool_calls`` are written into its
content in the model's tool-call format (Hermes: ``HermesParser.format``). ``logprobs`` cover
every sampled token less stop tokens — what is trained — a ``stop`` string's own tokens
included, though the text leaves the string out. ``tool_choice`` is
not enforced: ``none`` leaves the tools out of the prompt and the reply unparsed; ``auto``,
``required`` or a named function offer the tools and let the policy decide (constrained
decoding would change what is trained).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from envs.base import Message
from envs.parsers import HermesParser, ParsedReply
from orchestrator.errors import PolyRLError

MAX_STOP = 4

# Fields OpenAI defines that change nothing here (checked for JSON sanity only).
_IGNORED_CHAT = frozenset({
    "metadata", "store", "user", "parallel_tool_calls", "reasoning_effort", "verbosity",
    "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options", "modalities", "prediction", "web_search_options", "audio",
})
_IGNORED_COMPLETION = frozenset({"user", "suffix", "best_of"})
_MESSAGE_KEYS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls", "refusal", "audio", "function_call",
                  "annotations", "reasoning_content"},
    "tool": {"role", "content", "tool_call_id", "name"},
}


class BadRequest(PolyRLError):
    """A request the gateway refuses: status 400 (or ``status``) with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class Sampling:
    """What a request asks of generation (the run supplies the temperature)."""

    max_tokens: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] = ()  # offered to the model (empty with tool_choice none)
    parse_tools: bool = True  # read tool calls out of the reply (false with tool_choice none)
    sampling: Sampling = field(default_factory=Sampling)


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | tuple[int, ...]
    sampling: Sampling = field(default_factory=Sampling)


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON ({e})") from e
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        return False
    return isinstance(value, kind)


def _number(body: Mapping[str, Any], key: str, low: float, high: float) -> None:
    value = body.get(key)
    if value is None:
        return
    if not _is(value, (int, float)) or not low <= value <= high:
        raise BadRequest(f"'{key}' must be a number from {low:g} to {high:g}, got {value!r}", key)


def _int(body: Mapping[str, Any], key: str, low: int, high: int | None = None,
         why: str = "") -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is(value, int) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise BadRequest(f"'{key}' must be a whole number {bound}{why}, got {value!r}", key)
    return int(value)


def _neutral(body: Mapping[str, Any], key: str, neutral: tuple[Any, ...], why: str) -> None:
    if key in body and body[key] not in neutral:
        raise BadRequest(f"'{key}'={body[key]!r} is not supported: {why}", key)


def _parse_sampling(body: Mapping[str, Any], max_n: int, tokens_key: str) -> Sampling:
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0)
    for key in ("frequency_penalty", "presence_penalty"):
        _number(body, key, -2.0, 2.0)
        _neutral(body, key, (None, 0, 0.0), "penalties would change the sampled distribution "
                 "the trainer corrects for")
    _neutral(body, "logit_bias", (None, {}), "a bias would change the sampled distribution the "
             "trainer corrects for")
    max_tokens = _int(body, tokens_key, 1)
    if tokens_key == "max_completion_tokens" and max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    n = _int(body, "n", 1, max_n, " (env.max_n)")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and len(stop) <= MAX_STOP and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise BadRequest(f"'stop' must be a string or a list of at most {MAX_STOP} strings", "stop")
    if any(not s for s in stops):
        raise BadRequest("'stop' strings must not be empty", "stop")
    stream = body.get("stream")
    if stream is not None and not _is(stream, bool):
        raise BadRequest("'stream' must be true or false", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise BadRequest("'stream_options' may hold only include_usage", "stream_options")
        include_usage = bool(options.get("include_usage", False))
    seed = body.get("seed")
    if seed is not None and not _is(seed, int):
        raise BadRequest("'seed' must be a whole number", "seed")
    return Sampling(max_tokens=max_tokens, n=n or 1, stop=stops, seed=seed,
                    stream=bool(stream), include_usage=include_usage,
                    logprobs=_logprobs(body))


def _logprobs(body: Mapping[str, Any]) -> bool:
    logprobs = body.get("logprobs")
    if isinstance(logprobs, bool) or logprobs is None:
        top = _int(body, "top_logprobs", 0, 20)
        if top:
            raise BadRequest("'top_logprobs' above 0 is not available: the engines report the "
                             "log-prob of the sampled token only (ask for logprobs=true)",
                             "top_logprobs")
        return bool(logprobs)
    if _is(logprobs, int) and logprobs == 0:  # /v1/completions: an int, top-k of alternatives
        return True
    raise BadRequest("'logprobs' must be true or false (alternatives are not reported)", "logprobs")


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", "model")
    return model


def _unknown(body: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    extra = sorted(set(body) - known)
    if extra:
        raise BadRequest(f"unknown field '{extra[0]}' in a {where} request", extra[0])


_CHAT_FIELDS = frozenset({
    "model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens",
    "max_completion_tokens", "stop", "n", "seed", "logprobs", "top_logprobs", "stream",
    "stream_options", "frequency_penalty", "presence_penalty", "logit_bias", "response_format",
    "functions", "function_call",
}) | _IGNORED_CHAT
_COMPLETION_FIELDS = frozenset({
    "model", "prompt", "temperature", "top_p", "max_tokens", "stop", "n", "seed", "logprobs",
    "stream", "stream_options", "frequency_penalty", "presence_penalty", "logit_bias", "echo",
}) | _IGNORED_COMPLETION


def chat_request(body: Mapping[str, Any], max_n: int) -> ChatRequest:
    _unknown(body, _CHAT_FIELDS, "chat completion")
    _neutral(body, "response_format", (None, {"type": "text"}), "structured output needs "
             "constrained decoding, which would change what is trained")
    _neutral(body, "functions", (None, []), "use 'tools'")
    _neutral(body, "function_call", (None,), "use 'tool_choice'")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of messages", "messages")
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("none", "auto", "required") and not (
            isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        raise BadRequest("'tool_choice' must be none, auto, required or "
                         '{"type": "function", "function": {"name": ...}}', "tool_choice")
    offered = () if choice == "none" else tools
    return ChatRequest(
        model=_model(body),
        messages=tuple(_message(m, i) for i, m in enumerate(messages)),
        tools=offered, parse_tools=bool(offered),
        sampling=_parse_sampling(body, max_n, "max_completion_tokens"),
    )


def completion_request(body: Mapping[str, Any], max_n: int) -> CompletionRequest:
    _unknown(body, _COMPLETION_FIELDS, "completion")
    _neutral(body, "echo", (None, False), "the prompt is not echoed back")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        parsed: str | tuple[int, ...] = prompt
    elif isinstance(prompt, list) and prompt and all(_is(t, int) and t >= 0 for t in prompt):
        parsed = tuple(prompt)
    else:
        raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per "
                         "request)", "prompt")
    return CompletionRequest(model=_model(body), prompt=parsed,
                             sampling=_parse_sampling(body, max_n, "max_tokens"))


def _tools(tools: Any) -> tuple[dict[str, Any], ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list of function tools", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]
                and isinstance(fn.get("parameters", {}), dict)):
            raise BadRequest('each tool must be {"type": "function", "function": {"name": ..., '
                             '"parameters": {...}}}', f"tools[{i}]")
    return tuple(tools)


def _text(content: Any, param: str, *, allow_none: bool = False) -> str:
    if content is None and allow_none:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in ("text", "refusal")
                    and isinstance(part.get(part["type"]), str)):
                raise BadRequest("only text content parts are supported", f"{param}[{j}]")
            parts.append(part[part["type"]])
        return "".join(parts)
    raise BadRequest("'content' must be a string or a list of text parts", param)


def _message(message: Any, i: int) -> Message:
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in _MESSAGE_KEYS:
        raise BadRequest(f"each message needs a role: {', '.join(_MESSAGE_KEYS)}", f"{where}.role")
    role = message["role"]
    extra = sorted(set(message) - _MESSAGE_KEYS[role])
    if extra:
        raise BadRequest(f"unknown field '{extra[0]}' in a {role} message", f"{where}.{extra[0]}")
    if role != "assistant":
        return {"role": "system" if role == "developer" else role,
                "content": _text(message.get("content"), f"{where}.content")}
    if message.get("function_call") is not None:
        raise BadRequest("'function_call' is not supported: use 'tool_calls'", f"{where}.function_call")
    content = _text(message.get("content"), f"{where}.content", allow_none=True)
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise BadRequest("'tool_calls' must be a list", f"{where}.tool_calls")
    blocks = [_call_text(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
    return {"role": "assistant", "content": "\n".join([content, *blocks] if content else blocks)}


def _call_text(call: Any, where: str) -> str:
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
        raise BadRequest('a tool call must be {"type": "function", "function": {"name": ..., '
                         '"arguments": "..."}}', where)
    arguments = fn.get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError as e:
        raise BadRequest(f"tool call arguments are not valid JSON ({e.msg})",
                         f"{where}.function.arguments") from e
    if not isinstance(parsed, dict):
        raise BadRequest("tool call arguments must be a JSON object", f"{where}.function.arguments")
    return HermesParser.format(fn["name"], parsed)


# -- responses -----------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


@dataclass(frozen=True)
class Choice:
    """One generated reply, as the response shows it."""

    text: str  # the reply less its stop tokens (and less a matched stop string)
    finish_reason: str  # stop | length | tool_calls
    parsed: ParsedReply | None  # tool calls read from the text (None: not parsed)
    tokens: tuple[str, ...] = ()  # each generated token's text, when logprobs are asked for
    logprobs: tuple[float, ...] = ()
    text_tokens: int = 0  # generated tokens that are not stop tokens


def assistant_message(choice: Choice) -> dict[str, Any]:
    """The OpenAI assistant message of ``choice``: its text, or its tool calls."""
    parsed = choice.parsed
    if parsed is None or not parsed.calls or parsed.errors:  # an unreadable call stays text
        return {"role": "assistant", "content": choice.text}
    calls = [{"id": new_id("call"), "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
             for c in parsed.calls]
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}


def as_message(message: Mapping[str, Any]) -> Message:
    """``message`` (one this gateway wrote) as the chat message a later request echoes."""
    return _message(dict(message), 0)


def _logprobs_content(choice: Choice) -> dict[str, Any]:
    return {"content": [
        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
        for t, lp in zip(choice.tokens, choice.logprobs, strict=True)
    ]}


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def chat_response(model: str, messages: Sequence[dict[str, Any]], choices: Sequence[Choice],
                  want_logprobs: bool, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": i, "message": m, "finish_reason": c.finish_reason,
                     "logprobs": _logprobs_content(c) if want_logprobs else None}
                    for i, (m, c) in enumerate(zip(messages, choices, strict=True))],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chat_chunks(model: str, messages: Sequence[dict[str, Any]], choices: Sequence[Choice],
                want_logprobs: bool, usage_totals: dict[str, int] | None) -> list[dict[str, Any]]:
    """The server-sent events of a streamed chat completion: per choice the role, the text,
    the tool calls, then the finish reason; the usage last when asked for."""
    ident, created = new_id("chatcmpl"), int(time.time())

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": ident, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                             "finish_reason": finish}]}

    out = []
    for i, (message, choice) in enumerate(zip(messages, choices, strict=True)):
        out.append(chunk(i, {"role": "assistant", "content": ""}))
        if message.get("content"):
            out.append(chunk(i, {"content": message["content"]},
                             logprobs=_logprobs_content(choice) if want_logprobs else None))
        if message.get("tool_calls"):
            out.append(chunk(i, {"tool_calls": [{"index": j, **call} for j, call
                                                in enumerate(message["tool_calls"])]}))
        out.append(chunk(i, {}, choice.finish_reason))
    if usage_totals is not None:
        out.append({"id": ident, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [], "usage": usage_totals})
    return out


def completion_response(model: str, choices: Sequence[Choice], want_logprobs: bool,
                        prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    def logprobs(c: Choice) -> dict[str, Any]:
        offsets, at = [], 0
        for t in c.tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": list(c.tokens), "token_logprobs": list(c.logprobs),
                "top_logprobs": None, "text_offset": offsets}

    return {
        "id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": i, "text": c.text, "finish_reason": c.finish_reason,
                     "logprobs": logprobs(c) if want_logprobs else None}
                    for i, c in enumerate(choices)],
        "usage": usage(prompt_tokens, completion_tokens),
    }
