"""The gateway: an OpenAI-compatible HTTP server in front of the run's engine.

``POST /v1/chat/completions``, ``POST /v1/completions`` and ``GET /v1/models``, served by
aiohttp on ``127.0.0.1`` (an ephemeral port unless ``env.port`` names one; ``env.host``
opens it wider). One :class:`Gateway` serves a whole run; :meth:`Gateway.episode` opens an
episode and hands back its :class:`~orchestrator.gateway.episode.AgentEpisode`, whose
``endpoint`` (base URL, key, model name) is what the agent program gets.

Keys: each episode's is 32 random bytes (``secrets``), sent as ``Authorization: Bearer``,
as any OpenAI client does. A missing, unknown or expired key is answered 401 before the body
is read, and nothing of that call is recorded anywhere. A key dies with its episode: a call
still generating when the episode ends is cancelled and answered 401 too. Any model name is
accepted (the key decides whose policy answers), so programs that name a model run as they
are.

Errors: a :class:`~orchestrator.gateway.protocol.BadRequest` is a 400 with OpenAI's error body
and the run goes on. Anything else under a call (the engine failing) is a 500 for the
program, and is raised again by :func:`~orchestrator.gateway.runner.run_agent_group` once the
episode ends, so the run stops with it rather than training on a broken engine.

Counters (cumulative, added to each step's metrics like the engine's): ``agent/episodes``,
``agent/errors``, ``agent/timeouts``, ``agent/calls``, ``agent/segments``,
``agent/bad_requests``.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

from aiohttp import web

from envs.agent import AgentEndpoint, AgentSpec
from orchestrator.config.schema import RolloutConfig
from orchestrator.engines.base import InferenceEngine
from orchestrator.gateway.episode import AgentEpisode, EpisodeLimits, Reply
from orchestrator.gateway.protocol import (
    BadRequest,
    chat_chunks,
    chat_request,
    chat_response,
    completion_request,
    completion_response,
    error_body,
    parse_json,
    usage,
)
from orchestrator.models.tokenizer import Tokenizer
from orchestrator.trace.recorder import Recorder

log = logging.getLogger(__name__)
KEY_PREFIX = "sk-polyrl-"


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 0
    model: str = "policy"
    max_n: int = 8
    max_calls: int = 64  # per episode
    max_context: int | None = None  # prompt tokens refused from here on (None: not checked)

    @classmethod
    def of(cls, spec: AgentSpec) -> GatewayConfig:
        return cls(host=spec.host, port=spec.port, model=spec.model, max_n=spec.max_n,
                   max_calls=spec.max_calls, max_context=spec.max_context)


class Gateway:
    def __init__(self, engine: InferenceEngine, tokenizer: Tokenizer, recorder: Recorder,
                 config: GatewayConfig | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.recorder = recorder
        self.config = config or GatewayConfig()
        self.counters: Counter[str] = Counter()
        self._episodes: dict[str, AgentEpisode] = {}
        self._runner: web.AppRunner | None = None
        self.base_url = ""
        self.fault: BaseException | None = None  # the first failure that was not the caller's

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        app = web.Application(client_max_size=64 << 20)
        app.add_routes([
            web.post("/v1/chat/completions", self._serve(self._chat)),
            web.post("/v1/completions", self._serve(self._complete)),
            web.get("/v1/models", self._serve(self._models)),
        ])
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}/v1"
        log.info("agent gateway at %s", self.base_url)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for episode in self._episodes.values():
            episode.close()
        self._episodes.clear()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def metrics(self) -> dict[str, float]:
        return {f"agent/{k}": float(v) for k, v in self.counters.items()}

    # -- episodes ----------------------------------------------------------------------------

    @asynccontextmanager
    async def episode(self, rollout: RolloutConfig, worker: str,
                      sample: int) -> AsyncIterator[AgentEpisode]:
        """An episode with a fresh key, valid until the block ends (then it is revoked and any
        call still generating is cancelled)."""
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        limits = EpisodeLimits(
            temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
            max_tokens=rollout.max_tokens,
            max_context=self.config.max_context, max_total_tokens=rollout.max_total_tokens,
            max_calls=self.config.max_calls)
        episode = AgentEpisode(AgentEndpoint(self.base_url, key, self.config.model), self.engine,
                               self.tokenizer, self.recorder, limits, worker, sample)
        self._episodes[key] = episode
        try:
            yield episode
        finally:
            del self._episodes[key]
            episode.close()

    # -- HTTP --------------------------------------------------------------------------------

    def _serve(self, handler: Callable[[web.Request, AgentEpisode], Awaitable[web.StreamResponse]]
               ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def serve(request: web.Request) -> web.StreamResponse:
            try:
                episode = self._episode(request)
                try:
                    return await handler(request, episode)
                except BadRequest as e:
                    self.counters["bad_requests"] += e.status == 400
                    raise
            except BadRequest as e:
                return web.json_response(e.body(), status=e.status)
            except ConnectionError:  # the caller went away (cancelled, timed out): its loss
                raise
            except Exception as e:  # the engine or this server failed: not the caller's doing
                if self.fault is None:
                    self.fault = e
                log.exception("agent gateway: %s failed", request.path)
                return web.json_response(error_body(f"internal error: {type(e).__name__}: {e}",
                                                    "server_error"), status=500)

        return serve

    def _episode(self, request: web.Request) -> AgentEpisode:
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise BadRequest("no API key: send the episode's key as 'Authorization: Bearer <key>'",
                             status=401, code="invalid_api_key")
        episode = self._episodes.get(key.strip())
        if episode is None:
            raise BadRequest("unknown or expired API key (a key lives as long as its episode)",
                             status=401, code="invalid_api_key")
        return episode

    async def _chat(self, request: web.Request, episode: AgentEpisode) -> web.StreamResponse:
        started = self.recorder.now()
        call = chat_request(parse_json(await request.read()), self.config.max_n)
        reply = await episode.chat(call)
        self.counters["calls"] += 1
        model, s = self.config.model, call.sampling
        if not s.stream:
            response = web.json_response(chat_response(model, reply.messages, reply.choices,
                                                       s.logprobs, reply.prompt_tokens,
                                                       reply.completion_tokens))
        else:
            totals = usage(reply.prompt_tokens, reply.completion_tokens) if s.include_usage else None
            response = await _event_stream(request, chat_chunks(model, reply.messages,
                                                                reply.choices, s.logprobs, totals))
        self._timed(episode, started, reply)
        return response

    async def _complete(self, request: web.Request, episode: AgentEpisode) -> web.StreamResponse:
        started = self.recorder.now()
        call = completion_request(parse_json(await request.read()), self.config.max_n)
        reply = await episode.complete(call)
        self.counters["calls"] += 1
        body = completion_response(self.config.model, reply.choices, call.sampling.logprobs,
                                   reply.prompt_tokens, reply.completion_tokens)
        if not call.sampling.stream:
            response = web.json_response(body)
        else:
            chunks = [{**body, "choices": [choice]} for choice in body["choices"]]
            if call.sampling.include_usage:
                chunks.append({**body, "choices": []})
            for chunk in chunks[:-1] if call.sampling.include_usage else chunks:
                chunk.pop("usage", None)
            response = await _event_stream(request, chunks)
        self._timed(episode, started, reply)
        return response

    def _timed(self, episode: AgentEpisode, started: float, reply: Reply) -> None:
        """The call's ``gateway_call`` span, from its body read to its response built (a
        stream's: written), with ``engine_s``, the part spent waiting on the engine: the rest,
        its duration less ``engine_s``, is the gateway's own time (parsing, rendering the
        prompt, building the reply)."""
        self.recorder.add("gateway_call", episode.worker, started, self.recorder.now(),
                          self.engine.version, sample=episode.sample, engine_s=reply.engine_s)

    async def _models(self, request: web.Request, episode: AgentEpisode) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [
            {"id": self.config.model, "object": "model", "created": 0, "owned_by": "polyrl"}]})


async def _event_stream(request: web.Request, chunks: list[dict[str, Any]]) -> web.StreamResponse:
    """``chunks`` as server-sent events, then ``[DONE]``."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    for chunk in chunks:
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
