"""In-process torch inference engine: batched sampling with a KV cache, on CPU or CUDA.

Requests queue on a stream; one scheduler loop takes every request waiting at that moment
(up to ``max_batch_size``) as a wave, left-pads the prompts into one batch, runs a prefill
and then one decode step per token with the model's KV cache until every sequence in the
wave has stopped. Forward passes run in a worker thread so the event loop stays free.

Built from config: the model's ``conf/model`` node (the engine makes its own copy of the
architecture) and a :class:`~orchestrator.weights.WeightUpdate` with the starting weights.

Weight updates: each decode step holds the :class:`~orchestrator.gate.Gate` shared and
:meth:`pause` takes it exclusively, so it returns only at a token boundary (and any task may
call :meth:`resume`). One controller (the pipeline's weight sync) pauses and resumes.
When a wave next takes the lock and finds a newer version, it discards its KV cache and
re-runs the prefill over prompt + tokens generated so far under the new weights; later
tokens carry the new version. This is the "continue under new weights" behaviour.

Limits: a wave is static (requests arriving mid-wave wait for the next wave), and finished
sequences stay in the batch until the wave ends. Good enough for small models; vLLM is the
engine for throughput.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import anyio
import torch
from anyio.abc import TaskGroup

from orchestrator.engines.base import InferenceEngine
from orchestrator.errors import ConfigError, EngineClosed
from orchestrator.gate import Gate
from orchestrator.models.policy import build_policy
from orchestrator.types import FinishReason, Generation, SamplingParams
from orchestrator.weights import WeightUpdate


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    start_version: int = 0
    done: anyio.Event = field(default_factory=anyio.Event)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def result(self) -> Generation:
        assert self.finish_reason is not None
        return Generation(
            token_ids=tuple(self.token_ids),
            logprobs=tuple(self.logprobs),
            versions=tuple(self.versions),
            finish_reason=self.finish_reason,
            start_version=self.start_version,
        )


class TorchEngine(InferenceEngine):
    def __init__(
        self,
        model: Mapping[str, Any],
        weights: WeightUpdate | None = None,
        max_batch_size: int = 64,
        seed: int = 0,
        queue_size: int = 1024,
    ) -> None:
        if max_batch_size < 1:
            raise ConfigError(f"engine.max_batch_size must be >= 1, got {max_batch_size}")
        if queue_size < 1:
            raise ConfigError(f"engine.queue_size must be >= 1, got {queue_size}")
        policy = build_policy(model)  # the engine's own copy: the trainer updates its own
        self.model = policy.model.eval()
        self.device = policy.device
        self.pad_id = policy.tokenizer.pad_id
        self.max_batch_size = max_batch_size
        self.max_positions: int = getattr(self.model.config, "max_position_embeddings", 1 << 30)
        self.version = 0
        if weights is not None:
            self._load(weights)
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._send, self._receive = anyio.create_memory_object_stream[_Request](queue_size)
        self._step_gate = Gate()
        self._paused = False
        self._task_group: TaskGroup | None = None
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(self._scheduler, name="torch-engine-scheduler")
        return self

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._send.aclose()
        if self._task_group is None:  # never started: the scheduler owns no receive stream
            await self._receive.aclose()
        if self._task_group is not None:
            self._task_group.cancel_scope.cancel()
            await self._task_group.__aexit__(None, None, None)

    # -- InferenceEngine -------------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        if self._closed or self._task_group is None:
            raise EngineClosed("the torch engine is not running; use it as `async with engine:`")
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        request = _Request(list(prompt_ids), sampling)
        try:
            await self._send.send(request)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as e:
            raise EngineClosed("the torch engine was closed") from e
        await request.done.wait()
        if request.finish_reason is FinishReason.ABORTED:
            # A cut-off generation is never handed out as if it had finished.
            raise EngineClosed("the torch engine stopped before the request finished")
        return request.result()

    async def update_weights(self, update: WeightUpdate) -> None:
        if not self._paused:
            raise RuntimeError("update_weights must be called between pause() and resume()")
        await anyio.to_thread.run_sync(self._load, update)

    def _load(self, update: WeightUpdate) -> None:
        with torch.no_grad():
            self.model.load_state_dict(update.tensors(), strict=True)
        self.version = update.version

    async def pause(self) -> None:
        if not self._paused:
            await self._step_gate.acquire_exclusive()
            self._paused = True

    async def resume(self) -> None:
        if self._paused:
            await self._step_gate.release_exclusive()
            self._paused = False

    # -- scheduling ----------------------------------------------------------------------

    async def _scheduler(self) -> None:
        async with self._receive:
            try:
                async for first in self._receive:
                    wave = [first]
                    while len(wave) < self.max_batch_size:
                        try:
                            wave.append(self._receive.receive_nowait())
                        except anyio.WouldBlock:
                            break
                    await self._run_wave(wave)
            finally:
                self._abort_waiting()

    def _abort_waiting(self) -> None:
        while True:
            try:
                request = self._receive.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return
            request.finish_reason = FinishReason.ABORTED
            request.done.set()

    async def _run_wave(self, wave: list[_Request]) -> None:
        budgets = []
        for r in wave:
            room = self.max_positions - len(r.prompt_ids)
            budgets.append(max(0, min(r.sampling.max_tokens, room)))
            r.start_version = self.version
        temperature = torch.tensor([r.sampling.temperature for r in wave], device=self.device)
        cache: Any = None
        cache_version = -1
        attention: torch.Tensor | None = None
        positions: torch.Tensor | None = None
        try:
            for i, r in enumerate(wave):
                if budgets[i] == 0:
                    r.finish_reason = FinishReason.LENGTH
            while not all(r.finished for r in wave):
                async with self._step_gate:
                    if cache is None or cache_version != self.version:
                        # First step, or the weights changed under us: prefill from scratch.
                        cache, attention, positions, logits = await anyio.to_thread.run_sync(
                            self._prefill, wave
                        )
                        cache_version = self.version
                    else:
                        assert attention is not None and positions is not None
                        last = torch.tensor(
                            [r.token_ids[-1] if r.token_ids else self.pad_id for r in wave],
                            device=self.device,
                        )
                        attention = torch.cat([attention, attention.new_ones(len(wave), 1)], dim=1)
                        positions = positions + 1
                        cache, logits = await anyio.to_thread.run_sync(
                            self._decode, last, cache, attention, positions
                        )
                    tokens, logprobs = self._sample(logits, temperature)
                for i, r in enumerate(wave):
                    if r.finished:
                        continue
                    token = int(tokens[i])
                    r.token_ids.append(token)
                    r.logprobs.append(float(logprobs[i]))
                    r.versions.append(cache_version)
                    if token in r.sampling.stop_token_ids:
                        r.finish_reason = FinishReason.STOP
                    elif len(r.token_ids) >= budgets[i]:
                        r.finish_reason = FinishReason.LENGTH
        finally:
            for r in wave:
                if r.finish_reason is None:
                    r.finish_reason = FinishReason.ABORTED
                r.done.set()

    def _prefill(self, wave: list[_Request]) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        sequences = [r.prompt_ids + r.token_ids for r in wave]
        width = max(len(s) for s in sequences)
        ids = torch.full((len(wave), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(wave), width), dtype=torch.long)
        for i, s in enumerate(sequences):  # left padding keeps every sequence's end aligned
            ids[i, width - len(s) :] = torch.tensor(s)
            attention[i, width - len(s) :] = 1
        ids, attention = ids.to(self.device), attention.to(self.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            out = self.model(
                input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True
            )
        return out.past_key_values, attention, positions[:, -1:], out.logits[:, -1].float()

    def _decode(
        self, last: torch.Tensor, cache: Any, attention: torch.Tensor, positions: torch.Tensor
    ) -> tuple[Any, torch.Tensor]:
        with torch.inference_mode():
            out = self.model(
                input_ids=last[:, None],
                attention_mask=attention,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
        return out.past_key_values, out.logits[:, -1].float()

    def _sample(self, logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        greedy = temperature <= 0
        scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
        logp = torch.log_softmax(scaled, dim=-1)
        sampled = torch.multinomial(logp.exp(), 1, generator=self._generator).squeeze(-1)
        tokens = torch.where(greedy, logp.argmax(-1), sampled)
        chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
        if not torch.isfinite(chosen).all():  # pragma: no cover - a NaN model is a bug upstream
            raise FloatingPointError("the policy produced non-finite log-probabilities")
        return tokens.cpu(), chosen.cpu()

