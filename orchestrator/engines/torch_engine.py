"""In-process torch inference engine: continuous batching over a KV cache, on CPU or CUDA.

Requests queue on a stream; one scheduler loop owns the resident batch. Every step is one
forward pass: it admits waiting requests (while fewer than ``max_batch_size`` are
resident), and feeds every resident sequence its last sampled token and every newcomer its
prompt, together, then samples one token for each: a request that arrives mid-generation
(an episode back from a tool call) joins at the next token instead of waiting for the
batch to drain, and its prefill costs no pass of its own. A sequence that stops is handed
out at once and leaves: a resident row takes its place in the cache and the leading
columns left holding only padding are trimmed, so the cache is never wider than its
longest resident sequence. Forward passes and sampling run in a worker thread so the event
loop stays free.

``batching="waves"`` keeps static batching for comparison (``bench/engine.py``), through
the same steps: the scheduler admits only while nothing decodes, so the requests waiting
at that moment form a wave and later ones wait until the whole wave has stopped, and a
wave's results are handed out together when it ends. (A finished sequence leaves the cache
at once in both modes: no compute is spent on it.)

KV cache and attention (:mod:`~orchestrator.engines.slot_cache`): per layer, buffers
``[slots, heads, capacity, head_dim]`` written in place; every sequence's cached tokens are
right-aligned (left padding). A step's tokens go through the model as one flat, unpadded
row (its matrix products see every token of every sequence at once); the model's
attention is replaced by one that reads each token's own sequence from the buffers, so
its logits are those of an unpadded forward pass. The model must use ``transformers``'
attention interface (Llama, Qwen, Mistral, Gemma, GPT-2 and most others do).

Built from config: the model's ``conf/model`` node (the engine makes its own copy of the
architecture) and a :class:`~orchestrator.weights.update.WeightUpdate` with the starting weights.

Weight updates: each step holds the :class:`~orchestrator.engines.rwlock.ReadWriteLock` shared and
:meth:`pause` takes it exclusively, so it returns only at a token boundary (and any task may
call :meth:`resume`). One controller (the pipeline's weight sync) pauses and resumes. When
the next step finds a newer version it discards the KV cache and re-prefills every resident
sequence over prompt + tokens generated so far under the new weights; every token carries
the version that produced it. This is the "continue under new weights" behaviour.
An update that carries a delta (:mod:`orchestrator.weights.delta`) is applied to the tensors the
engine holds when it holds the delta's base exactly, and kept only if the engine's fingerprint
afterwards is the published one; otherwise the full update is loaded (``weights/delta_fallbacks``
counts a delta that failed). In this process updates come by reference and carry no delta:
nothing travels, so there is nothing to save; the delta matters to an engine in another process
(``launcher=ray``).

Attestation (``attest``, :mod:`orchestrator.weights.fingerprint`): after every load the engine
fingerprints the tensors it now holds, at the start of its next decoding step, in the step's
own thread, before it samples a token of those weights; an engine that generates nothing after
a load computes it when asked (:meth:`TorchEngine.attested`, or the next load). The sync does
not wait for it, and no third thread runs beside the trainer's step and the engine's: on 2
cores, computed while paused it cost the default experiment 6.8% of its samples/s, in a thread
of its own 3 to 5%, in the step about nothing measurable (``docs/attestation.md``).

Sampling (:mod:`~orchestrator.engines.sampling`): one token a row at its temperature,
top-p and top-k; a request whose ``SamplingParams.seed`` is set draws from a stream of its own.

Prefix cache (:mod:`~orchestrator.engines.prefix_cache`): an episode's next turn takes back
the keys and values of its previous one; identical newcomers (a group's samples of one prompt)
are computed once and their cache rows copied. The requests and the resident batch are
:mod:`~orchestrator.engines.torch_requests`'s.

Limits: a prefix is reused only by a request that extends a whole finished sequence (an
episode's next turn; not a shared system prompt); prefills are not chunked (a step with a
long newcomer is as long as its prefill); attention is over the padded window (its
padding is at most the longest resident sequence minus each one's length); sliding-window
layers are masked but cached in full, and models whose cache is not plain key/value
layers (recurrent or linear attention) are not supported. Good enough for small models;
vLLM is the engine for throughput.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Self

import anyio
import torch
from anyio import AsyncContextManagerMixin
from anyio.abc import TaskGroup

from orchestrator.engines.base import InferenceEngine
from orchestrator.engines.prefix_cache import PrefixCache, continues_prefix
from orchestrator.engines.rwlock import ReadWriteLock
from orchestrator.engines.sampling import sample
from orchestrator.engines.slot_cache import ATTENTION, SlotCache
from orchestrator.engines.torch_requests import Batch, Pending, Request, known
from orchestrator.errors import ConfigError, EngineClosed
from orchestrator.models.policy import (
    PASSTHROUGH_MASK,
    build_policy,
    cache_argument,
    forward_parameters,
)
from orchestrator.types import FinishReason, Generation, SamplingParams
from orchestrator.weights.delta import Delta, DeltaUnusable, LoadCounter, Loaded, apply
from orchestrator.weights.fingerprint import fingerprint
from orchestrator.weights.update import AdapterMerger, WeightUpdate

log = logging.getLogger(__name__)
BATCHING = ("continuous", "waves")
# Turns of the event loop without a new request after which a burst is taken to be complete
SETTLE_TURNS = 2


class TorchEngine(AsyncContextManagerMixin, InferenceEngine):
    cheap_copy_on_cpu = True  # the model in this process: evaluations may have a copy

    def __init__(
        self,
        model: Mapping[str, Any],
        weights: WeightUpdate | None = None,
        max_batch_size: int = 64,
        seed: int = 0,
        queue_size: int = 1024,
        batching: str = "continuous",
        prefix_cache_tokens: int = 16384,
        prefill_limit_after: int = 24,
        prefill_limit_tokens: int = 64,
        attest: bool = True,
        delta: bool = False,
    ) -> None:
        """``delta`` (``engine.delta``) is the sender's choice, read by the launcher (the trainer
        actor under ``launcher=ray`` sends deltas); this engine applies any delta it is sent."""
        del delta
        if max_batch_size < 1:
            raise ConfigError(f"engine.max_batch_size must be >= 1, got {max_batch_size}")
        if queue_size < 1:
            raise ConfigError(f"engine.queue_size must be >= 1, got {queue_size}")
        if batching not in BATCHING:
            raise ConfigError(f"engine.batching must be one of {', '.join(BATCHING)}, got {batching!r}")
        if prefix_cache_tokens < 0:
            raise ConfigError(f"engine.prefix_cache_tokens must be >= 0, got {prefix_cache_tokens}")
        for name, value in (("prefill_limit_after", prefill_limit_after),
                            ("prefill_limit_tokens", prefill_limit_tokens)):
            if value < 0:
                raise ConfigError(f"engine.{name} must be >= 0 (0: no limit), got {value}")
        policy = build_policy(model)  # the engine's own copy: the trainer updates its own
        self.model = policy.model.eval()
        if not getattr(self.model, "_supports_attention_backend", False):
            raise ConfigError(f"engine=torch needs a model that uses transformers' attention "
                              f"interface, which {type(self.model).__name__} does not; use "
                              f"engine=vllm")
        self.model.config._attn_implementation = ATTENTION  # steps attend through the SlotCache
        self.device = policy.device
        self._passthrough = PASSTHROUGH_MASK.to(self.device)
        self.max_batch_size = max_batch_size
        self.batching = batching
        self.max_positions: int = getattr(self.model.config, "max_position_embeddings", 1 << 30)
        # the LM head at each row's last token only (an index tensor: any transformers version)
        self._keeps_logits = "logits_to_keep" in forward_parameters(self.model)
        self._cache_argument = cache_argument(self.model)
        self.version = 0
        self._weights = AdapterMerger()
        self._attest = attest  # engine.attest: fingerprint the weights after every load
        self._held_print: str | Pending | None = None  # :attr:`fingerprint`
        self._copied: Callable[[], None] | None = None  # releases the update being loaded
        self.loads = LoadCounter()  # bytes each load pulled, deltas applied and failed
        if weights is not None:
            self._load(weights)
        else:
            self._fingerprint()
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self.prefixes = PrefixCache(prefix_cache_tokens)
        self.prefill_limit_after = prefill_limit_after
        self.prefill_limit_tokens = prefill_limit_tokens
        self._held: deque[Request] = deque()  # received, not admitted yet: first in line
        self._send, self._receive = anyio.create_memory_object_stream[Request](queue_size)
        self._step_gate = ReadWriteLock()
        self._paused = False
        self._task_group: TaskGroup | None = None
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncIterator[Self]:
        """``async with engine:`` runs the scheduler in a task group of its own, entered and
        exited in the caller's task (anyio's mixin: no task group held open by hand)."""
        async with anyio.create_task_group() as tg:
            self._task_group = tg
            tg.start_soon(self._scheduler, name="torch-engine-scheduler")
            try:
                yield self
            finally:
                await self.aclose()

    async def aclose(self) -> None:
        """Stop taking requests and stop the scheduler (from any task: this only cancels; the
        ``async with`` block's end waits for it)."""
        if self._closed:
            return
        self._closed = True
        await self._send.aclose()
        if self._task_group is None:  # never started: the scheduler owns no receive stream
            await self._receive.aclose()
        else:
            self._task_group.cancel_scope.cancel()

    # -- InferenceEngine -------------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self.max_positions

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        if self._closed or self._task_group is None:
            raise EngineClosed("the torch engine is not running; use it as `async with engine:`")
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        request = Request(list(prompt_ids), sampling)
        try:
            await self._send.send(request)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as e:
            raise EngineClosed("the torch engine was closed") from e
        await request.done.wait()
        if request.finish_reason is FinishReason.ABORTED:
            # A cut-off generation is never handed out as if it had finished.
            raise EngineClosed("the torch engine stopped before the request finished")
        await request.attested()
        return request.result()

    @property
    def attests(self) -> bool:
        return self._attest

    async def update_weights(self, update: WeightUpdate) -> None:
        if not self._paused:
            raise RuntimeError("update_weights must be called between pause() and resume()")
        if not update.released:  # by reference: the trainer waits until the copy is made
            self._copied = partial(anyio.from_thread.run_sync, update.release)
        await self.attested()  # the last load's fingerprint reads the tensors this one replaces
        try:
            await anyio.to_thread.run_sync(self._load, update)
        finally:
            self._copied = None

    def _release_copied(self) -> None:
        """Let the trainer change its tensors once they are copied: the fingerprint after the
        load reads the engine's own tensors, so the trainer's next step need not wait for it
        (called in :meth:`update_weights`'s worker thread)."""
        copied, self._copied = self._copied, None
        if copied is not None:
            copied()

    def _load(self, update: WeightUpdate) -> None:
        delta, fallback = update.delta, False
        if delta is not None and self._holds(delta):
            if self._load_delta(delta, update.fingerprint or delta.fingerprint):
                self._loaded(update, Loaded(delta.nbytes, delta.full_nbytes, delta=True))
                return
            fallback = True
        self._weights.load(self.model, update)  # a LoRA update: the adapters merged in
        self._release_copied()
        self._fingerprint()
        pulled = update.nbytes + (delta.nbytes if fallback and delta is not None else 0)
        self._loaded(update, Loaded(pulled, update.nbytes, fallback=fallback))

    def _loaded(self, update: WeightUpdate, loaded: Loaded) -> None:
        self.version = update.version
        self.last_load = loaded
        self.loads.add(loaded, offered=update.delta is not None)

    def _holds(self, delta: Delta) -> bool:
        """Whether the engine holds the delta's base exactly (its version and fingerprint)."""
        if self.version != delta.base_version or self._weights.adapters:
            return False
        held = self.fingerprint if self._attest else fingerprint(self.model.state_dict())
        return held == delta.base_fingerprint

    def _load_delta(self, delta: Delta, published: str) -> bool:
        """Apply ``delta`` to the weights held; True if the engine's fingerprint is then
        ``published``. Else the engine holds a bad reconstruction, to be replaced by a full
        load before anything is served (the engine is paused)."""
        try:
            weights = apply(delta, self.model.state_dict())
        except DeltaUnusable as error:
            log.warning("weight delta to version %s not applied: %s; loading the full update",
                        delta.base_version + 1, error)
            return False
        with torch.no_grad():
            self.model.load_state_dict(weights, strict=True)
        self._weights.forget()
        held = fingerprint(self._weights.served(self.model))
        if held != published:
            log.warning("weight delta from version %d: the reconstruction's fingerprint is not "
                        "the published one; loading the full update", delta.base_version)
            return False
        self._held_print = held if self._attest else None
        return True

    def _fingerprint(self) -> None:
        """The attestation: from the tensors the engine now holds, not the update it was sent;
        computed by the next decoding step or when asked (:class:`Pending`)."""
        if not self._attest:
            return
        self._held_print = Pending(lambda: fingerprint(self._weights.served(self.model)))

    @property
    def fingerprint(self) -> str | None:
        """The fingerprint of the weights the engine holds (None: ``attest`` off); waits for
        the one computed after the last load (in an event loop, :meth:`attested` first)."""
        if isinstance(self._held_print, Pending):
            self._held_print = self._held_print.run()
        return self._held_print

    async def attested(self) -> str | None:
        """:attr:`fingerprint`, without blocking the event loop while it is computed."""
        self._held_print = await known(self._held_print)
        return self._held_print

    def metrics(self) -> dict[str, float]:
        return self.loads.metrics()

    async def pause(self) -> None:
        if not self._paused:
            await self._step_gate.acquire_exclusive()
            self._paused = True

    async def resume(self) -> None:
        if self._paused:
            await self._step_gate.release_exclusive()
            self._paused = False

    # -- scheduling (event loop) -------------------------------------------------------

    async def _scheduler(self) -> None:
        batch = Batch(SlotCache(self.max_batch_size, self.device))
        async with self._receive:
            try:
                async for request in self._receive:  # idle until a request comes
                    self._join(batch, request)
                    await self._settle()
                    while batch.active or self._held:
                        await self._step(batch)
                    await anyio.to_thread.run_sync(self._park_drained, batch)
                    # Drained: the next batch reuses the buffers (growing them again from
                    # one slot, every step of a run, cost more than the decode steps did).
                    batch = Batch(batch.cache.cleared())
            finally:
                self._abort(batch)

    async def _settle(self) -> None:
        """Out of idle, let the requests sent in the same burst arrive before the first step.

        A burst (a k = 0 step's whole batch, released at once by admission) reaches the
        engine over a few turns of the event loop, as its senders pass their own awaits. The
        forward pass is not batch-invariant (a row's logits round differently with other rows
        beside it), so a first step that took whichever requests came in its first turn would
        make the log-probs depend on how the senders interleaved; the burst is taken whole
        instead: the loop runs until ``SETTLE_TURNS`` turns in a row bring no new request.
        Costs a few turns of the loop (microseconds) when the engine wakes."""
        quiet = 0
        while quiet < SETTLE_TURNS:
            waiting = self._receive.statistics().current_buffer_used
            await anyio.lowlevel.checkpoint()
            grown = self._receive.statistics().current_buffer_used > waiting
            quiet = 0 if grown else quiet + 1

    async def _step(self, batch: Batch) -> None:
        """One token for every resident sequence, under the gate so a pause waits for it."""
        async with self._step_gate:
            self._admit(batch)  # after the gate: requests that came while paused join now
            version, fingerprint = self.version, self._held_print
            tokens, logprobs = await anyio.to_thread.run_sync(self._advance, batch)
        for request, token, logprob in zip(batch.rows, tokens, logprobs, strict=True):
            request.add(token, logprob, version, fingerprint)
            if request.finished:
                batch.stopped.append(request)
        self._hand_out(batch)

    def _hand_out(self, batch: Batch) -> None:
        """Results go out as soon as their sequence stops (waves: once the whole wave has)."""
        if self.batching == "waves" and batch.decoding:
            return
        for request in batch.stopped:
            request.done.set()
        batch.stopped.clear()

    def _admit(self, batch: Batch) -> None:
        """Move waiting requests into the batch while it has room (waves: only between waves).

        While a resident sequence has generated ``prefill_limit_after`` tokens or more, a
        step admits new prompts (requests that resume no cached prefix) up to
        ``prefill_limit_tokens`` tokens, and at least one: every resident sequence waits
        for a step's prefill, and the long ones, which make the latency tail, would wait
        for every prefill of their whole life. Resumed turns, whose few new tokens cost
        little, and copies of a prompt admitted in the same step are not counted."""
        if self.batching == "waves" and batch.decoding:
            return
        limited = self.prefill_limit_after > 0 and self.prefill_limit_tokens > 0 and any(
            len(r.token_ids) >= self.prefill_limit_after for r in batch.rows if not r.finished)
        prefilled = 0
        prompts: set[tuple[int, ...]] = set()
        while batch.active < self.max_batch_size:
            if self._held:
                request = self._held.popleft()
            else:
                try:
                    request = self._receive.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream):
                    return
            if limited and not self._resumes(batch, request):
                ids = tuple(request.prompt_ids)
                if ids not in prompts:
                    if prompts and prefilled + len(ids) > self.prefill_limit_tokens:
                        self._held.appendleft(request)
                        return
                    prompts.add(ids)
                    prefilled += len(ids)
            self._join(batch, request)

    def _resumes(self, batch: Batch, request: Request) -> bool:
        """Whether ``request`` extends a parked sequence, or one that finished in the last
        step (parked at the start of the next)."""
        ids = request.prompt_ids
        return bool(self.prefixes.extended(ids)) or any(
            r.finished and continues_prefix(ids, tuple(r.prompt_ids + r.token_ids)[: r.fed])
            for r in batch.rows)

    def _join(self, batch: Batch, request: Request) -> None:
        room = self.max_positions - len(request.prompt_ids)
        request.budget = max(0, min(request.sampling.max_tokens, room))
        if request.budget == 0:  # no room to generate: done before it starts
            request.start_version = self.version
            request.finish(FinishReason.LENGTH)
        else:
            batch.joining.append(request)

    def _abort(self, batch: Batch) -> None:
        """Fail every unfinished admitted and waiting request (the engine is closing); the
        finished ones still go out."""
        cut = [r for r in batch.rows + batch.joining if not r.finished] + list(self._held)
        self._held.clear()
        while True:
            try:
                cut.append(self._receive.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
        for request in cut:
            request.finish(FinishReason.ABORTED)
        for request in batch.stopped:
            request.done.set()

    # -- one step (worker thread) ------------------------------------------------------

    def _advance(self, batch: Batch) -> tuple[list[int], list[float]]:
        """Drop finished rows, then one forward pass for the resident rows and the joining
        ones; returns one sampled token and its log-prob per row of ``batch.rows``."""
        if isinstance(self._held_print, Pending):
            self._held_print.run()  # the weights' fingerprint before any token of theirs
        with torch.inference_mode():
            self._drop_finished(batch)
            if batch.rows and batch.version != self.version:
                # The weights changed: what is cached is stale; prefill everyone afresh.
                for request in batch.rows:
                    request.fed = 0
                batch.joining = batch.rows + batch.joining
                batch.rows = []
                batch.cache.clear()
            batch.version = self.version
            if not batch.rows and not batch.joining:  # what was admitted finished at once
                return [], []
            logits = self._forward(batch)
            tokens, logprobs = self._sample(logits, batch.rows)
        return tokens.tolist(), logprobs.tolist()

    def _park_drained(self, batch: Batch) -> None:
        """The last rows of a drained batch finished too: their prefixes are parked as well."""
        with torch.inference_mode():
            self._drop_finished(batch)

    def _drop_finished(self, batch: Batch) -> None:
        keep = [i for i, r in enumerate(batch.rows) if not r.finished]
        if len(keep) < len(batch.rows):
            if self.prefixes.max_tokens:
                done = [i for i, r in enumerate(batch.rows) if r.finished]
                self.prefixes.park([batch.rows[i] for i in done], batch.cache.rows_kv(
                    done, [batch.rows[i].fed for i in done]), batch.version)
            batch.rows = [batch.rows[i] for i in batch.cache.retain(keep)]
            batch.cache.trim(max((r.fed for r in batch.rows), default=1))

    def _forward(self, batch: Batch) -> torch.Tensor:
        """One forward pass over every row's tokens not yet in the cache: a resident row's
        last sampled token; a joining row's prompt and tokens so far, or, when it extends a
        parked sequence (an episode's next turn), only what follows it. The joining rows
        join ``batch.rows``, fewest new tokens first (resumed turns before prompts: their
        attention pads less); a joining sequence identical to another (the samples of one
        prompt arrive together) is computed once and its cache rows copied. Returns the
        logits of every row's next token."""
        cache = batch.cache
        computed: list[Request] = []
        prefixes: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # by id(request)
        first: dict[tuple[int, ...], Request] = {}
        twins: list[tuple[Request, Request]] = []  # (request, the one it copies)
        for request in batch.joining:
            kv = self.prefixes.take(request, self.version) if self.prefixes else None
            if kv is not None:
                prefixes[id(request)] = kv
                request.fed = kv[0][0].shape[1]
            else:
                ids = tuple(request.prompt_ids + request.token_ids)
                if ids in first:
                    twins.append((request, first[ids]))
                    continue
                first[ids] = request
            computed.append(request)
        computed.sort(key=lambda r: r.length - r.fed)
        rows = batch.rows + computed
        lengths = [r.length for r in rows]
        layout = cache.begin([r.length - r.fed for r in rows], lengths)
        for row, request in enumerate(rows):
            if id(request) in prefixes:
                cache.place(row, prefixes[id(request)], lengths[row])
        ids = [r.token(i) for r in rows for i in range(r.fed, r.length)]
        positions = [i for r in rows for i in range(r.fed, r.length)]
        out = self.model(  # the step's inputs copied without waiting for the GPU
            input_ids=torch.tensor([ids]).to(self.device, non_blocking=True),
            position_ids=torch.tensor([positions]).to(self.device, non_blocking=True),
            attention_mask=self._passthrough, use_cache=True, slot_cache=cache,
            **{self._cache_argument: cache},
            logits_to_keep=layout.last if self._keeps_logits else 0)
        cache.commit()
        logits = out.logits[0].float()
        if not self._keeps_logits:
            logits = logits[layout.last]
        for r in rows:
            r.fed = r.length
        if twins:
            row_of = {id(r): row for row, r in enumerate(rows)}
            sources = [row_of[id(source)] for _, source in twins]
            cache.copy_rows(sources, max(lengths[row] for row in sources))
            for request, _ in twins:
                request.fed = request.length
            logits = torch.cat([logits, logits[torch.tensor(sources).to(self.device, non_blocking=True)]])
        batch.rows, batch.joining = rows + [r for r, _ in twins], []
        return logits

    def _sample(self, logits: torch.Tensor, rows: Sequence[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        params = [r.sampling for r in rows]
        temperatures = [p.temperature for p in params]
        temperature = torch.tensor(temperatures, dtype=logits.dtype)
        top_p = top_k = None
        if any(p.top_p < 1 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64).to(self.device)
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k for p in params]).to(self.device)
        variates = None
        if any(r.rng is not None for r in rows):  # seeded requests draw from their own streams
            variates = torch.rand((len(rows), 1), generator=self._generator, dtype=torch.float64,
                                  device=self.device) if any(r.rng is None for r in rows) else None
            own = torch.tensor([[r.rng.random() if r.rng is not None else 0.0] for r in rows],
                               dtype=torch.float64).to(self.device, non_blocking=True)
            if variates is None:
                variates = own
            else:
                seeded = torch.tensor([[r.rng is not None] for r in rows]).to(self.device,
                                                                              non_blocking=True)
                variates = torch.where(seeded, own, variates)
        tokens, chosen = sample(logits, temperature.to(self.device, non_blocking=True),
                                self._generator, uniform=all(t == 1 for t in temperatures),
                                greedy=any(t <= 0 for t in temperatures), variates=variates,
                                top_p=top_p, top_k=top_k)
        # the step's one wait for the device: its tokens and log-probs, copied together
        out = torch.stack([tokens.to(chosen.dtype), chosen]).cpu()
        if not torch.isfinite(out[1]).all():  # pragma: no cover - a NaN model is a bug upstream
            raise FloatingPointError("the policy produced non-finite log-probabilities")
        return out[0].long(), out[1]
