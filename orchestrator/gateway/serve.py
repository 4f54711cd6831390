"""A model the run serves itself, behind an OpenAI-compatible URL: what a judge reward calls.

:class:`ModelServer` puts one engine (any :class:`~orchestrator.engines.base.InferenceEngine`,
built from ``conf/engine`` and a ``conf/model`` node like the policy's) behind ``GET
/v1/models`` and ``POST /v1/chat/completions`` (non-streaming, ``n`` = 1), on ``127.0.0.1``
and an ephemeral port unless told otherwise. Its :attr:`~ModelServer.base_url` is plain data:
an environment's judge (``env.judge.url``, :mod:`envs.judge`) calls it as it would any
server, so the environments never import this package.

It differs from the agent :class:`~orchestrator.gateway.server.Gateway` on purpose: nothing it
generates is recorded or trained (no episode, no segments, no spans), and one key (or none)
serves every caller. The request's ``temperature`` (default 0: greedy), ``max_tokens`` (capped
at ``max_tokens``), ``seed`` and ``stop`` strings are honoured; the request's messages are
rendered by the model's chat template. A malformed request is a 400 with OpenAI's error body;
an engine failure a 500 (the caller counts it and goes on).
"""

from __future__ import annotations

import logging
import secrets
from types import TracebackType
from typing import Any, Self

from aiohttp import web

from orchestrator.engines.base import InferenceEngine
from orchestrator.gateway.protocol import BadRequest, chat_request, error_body, parse_json
from orchestrator.models.tokenizer import Tokenizer
from orchestrator.types import FinishReason, SamplingParams

log = logging.getLogger(__name__)


class ModelServer:
    """``engine`` served over HTTP for the block (an async context manager)."""

    def __init__(self, engine: InferenceEngine, tokenizer: Tokenizer, model: str = "judge",
                 max_tokens: int = 512, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.model, self.max_tokens = model, max_tokens
        self.host, self.port = host, port
        self.api_key = api_key
        self.base_url = ""
        self.calls = 0
        self._runner: web.AppRunner | None = None

    @staticmethod
    def new_key() -> str:
        return "sk-polyrl-judge-" + secrets.token_urlsafe(24)

    async def __aenter__(self) -> Self:
        app = web.Application(client_max_size=16 << 20)
        app.add_routes([web.get("/v1/models", self._serve(self._models)),
                        web.post("/v1/chat/completions", self._serve(self._chat))])
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        host, port = self._runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}/v1"
        log.info("model %s served at %s", self.model, self.base_url)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def _serve(self, handler: Any) -> Any:
        async def serve(request: web.Request) -> web.StreamResponse:
            try:
                if self.api_key is not None:
                    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
                    if scheme.lower() != "bearer" or key.strip() != self.api_key:
                        raise BadRequest("a missing or wrong API key", status=401,
                                         code="invalid_api_key")
                return await handler(request)
            except BadRequest as e:
                return web.json_response(e.body(), status=e.status)
            except ConnectionError:
                raise
            except Exception as e:  # the engine failed: the caller's 500, the server goes on
                log.exception("model server: %s failed", request.path)
                return web.json_response(error_body(f"internal error: {type(e).__name__}: {e}",
                                                    "server_error"), status=500)

        return serve

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "polyrl"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = parse_json(await request.read())
        call = chat_request(body, max_n=1)
        if call.sampling.stream:
            raise BadRequest("this server does not stream; send stream=false", "stream")
        temperature = body.get("temperature", 0.0)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or temperature < 0:
            raise BadRequest("'temperature' must be a number >= 0", "temperature")
        try:
            ids = self.tokenizer.chat_prompt(call.messages)
        except ValueError as e:
            raise BadRequest(f"the messages cannot be rendered: {e}", "messages") from e
        limit = min(call.sampling.max_tokens or self.max_tokens, self.max_tokens)
        gen = await self.engine.generate(ids, SamplingParams(
            max_tokens=limit, temperature=float(temperature),
            stop_token_ids=self.tokenizer.stop_ids, seed=call.sampling.seed))
        self.calls += 1
        stops = self.tokenizer.stop_ids
        text = self.tokenizer.decode([t for t in gen.token_ids if t not in stops])
        for stop in call.sampling.stop:
            at = text.find(stop)
            if at >= 0:
                text = text[:at]
        finish = "length" if gen.finish_reason is FinishReason.LENGTH else "stop"
        return web.json_response({
            "id": "chatcmpl-" + secrets.token_hex(8), "object": "chat.completion", "created": 0,
            "model": self.model,
            "choices": [{"index": 0, "finish_reason": finish, "logprobs": None,
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(gen.token_ids),
                      "total_tokens": len(ids) + len(gen.token_ids)}})
