"""In-process torch inference engine: continuous batching over a KV cache, on CPU or CUDA.

Requests queue on a stream; one scheduler loop owns the resident batch. At every token
boundary it admits waiting requests (while fewer than ``max_batch_size`` are resident),
runs one decode step for the sequences already resident, and prefills the newcomers and
adds them to the batch's cache: a request that arrives mid-generation (an episode back from
a tool call) joins at the next token instead of waiting for the batch to drain. A sequence
that stops is handed out at once and leaves: a resident row takes its place in the cache
and the leading columns left holding only padding are trimmed, so the cache is never wider
than its longest resident sequence. Newcomers of different lengths are prefilled in
length buckets (as many forward passes as keep padding plus ``PREFILL_CALL_TOKENS`` per
pass lowest). Forward passes and sampling run in a worker thread so the event loop stays
free.

``batching="waves"`` keeps static batching for comparison (``bench/engine.py``), through
the same steps: the scheduler admits only while nothing decodes, so the requests waiting
at that moment form a wave and later ones wait until the whole wave has stopped, and a
wave's results are handed out together when it ends. (A finished sequence leaves the cache
at once in both modes: no compute is spent on it.)

KV cache (:class:`~orchestrator.engines.slot_cache.SlotCache`): a ``transformers`` ``DynamicCache`` whose layers' ``keys``
and ``values`` are views of preallocated buffers ``[slots, heads, capacity, head_dim]``,
written in place: a decode step writes one column instead of copying the whole cache, as
``DynamicCache`` does. Every sequence's cached tokens are right-aligned (left padding); its
position ids count its own tokens and the attention mask hides the padding, so its logits
are those of an unpadded forward pass. A sequence's last sampled token is not in the cache
yet: the next decode step feeds it.

Built from config: the model's ``conf/model`` node (the engine makes its own copy of the
architecture) and a :class:`~orchestrator.weights.WeightUpdate` with the starting weights.

Weight updates: each step holds the :class:`~orchestrator.gate.Gate` shared and
:meth:`pause` takes it exclusively, so it returns only at a token boundary (and any task may
call :meth:`resume`). One controller (the pipeline's weight sync) pauses and resumes. When
the next step finds a newer version it discards the KV cache and re-prefills every resident
sequence over prompt + tokens generated so far under the new weights; every token carries
the version that produced it. This is the "continue under new weights" behaviour.

Prefix cache (:class:`PrefixCache`): a finished sequence's keys and values are parked; an
episode's next turn, which extends them with an observation, takes them back and only its
new tokens go through the model (a few are fed one per decode step in the running batch,
nothing being sampled for it until they are all in; more take one pass of their own),
instead of prefilling the whole conversation again.

Limits: a prefix is reused only by a request that extends a whole finished sequence (an
episode's next turn; not a shared system prompt); a resumed request with more than
``FEED_STEPS`` new tokens takes a forward pass of its own for them; prefills are not chunked nor fused with the
decode step (a step with newcomers runs two
or more forward passes); attention is over the padded window (its padding is at most the
longest resident sequence minus each one's length); sliding-window layers are cached in
full, and models whose cache is not plain key/value layers (recurrent or linear attention)
are not supported. Good enough for small models; vLLM is the engine for throughput.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import anyio
import torch
from anyio.abc import TaskGroup
from transformers import DynamicCache

from orchestrator.engines.base import InferenceEngine
from orchestrator.engines.slot_cache import SlotCache
from orchestrator.errors import ConfigError, EngineClosed
from orchestrator.gate import Gate
from orchestrator.models.policy import build_policy, keeps_logits
from orchestrator.types import FinishReason, Generation, SamplingParams
from orchestrator.weights import AdapterMerger, WeightUpdate

BATCHING = ("continuous", "waves")
# Newcomers are prefilled in length buckets, split to minimise the padded tokens plus this
# many per forward pass: a pass's fixed cost in tokens of compute (~64 for the tiny model on
# one CPU thread, where a pass costs ~3 ms and a token ~45 us).
PREFILL_CALL_TOKENS = 64
# A request resumed from the prefix cache with up to this many new tokens has them fed by the
# decode steps (no pass of its own); more go through one forward pass on top of its cache.
FEED_STEPS = 8


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    budget: int = 0  # tokens it may generate: max_tokens, capped by the context
    start_version: int = 0
    done: anyio.Event = field(default_factory=anyio.Event)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    fed: int = 0  # tokens of prompt + generated that are in the KV cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)

    def token(self, i: int) -> int:
        """Token ``i`` of prompt + generated."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.token_ids[i - n]

    def add(self, token: int, logprob: float, version: int) -> None:
        """Record one sampled token; it stops on a stop token or at its budget."""
        if not self.token_ids:
            self.start_version = version
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if token in self.sampling.stop_token_ids:
            self.finish_reason = FinishReason.STOP
        elif len(self.token_ids) >= self.budget:
            self.finish_reason = FinishReason.LENGTH

    def finish(self, reason: FinishReason) -> None:
        """End it and hand it out now."""
        self.finish_reason = reason
        self.done.set()

    def result(self) -> Generation:
        assert self.finish_reason is not None
        return Generation(
            token_ids=tuple(self.token_ids),
            logprobs=tuple(self.logprobs),
            versions=tuple(self.versions),
            finish_reason=self.finish_reason,
            start_version=self.start_version,
        )


@dataclass
class _Batch:
    """The resident sequences in cache row order, their KV cache, and the admitted ones
    waiting for their prefill. Row ``i`` holds its first ``rows[i].length - 1`` tokens in the
    last columns of the cache's window; its last sampled token is the next decode's input."""

    cache: SlotCache
    rows: list[_Request] = field(default_factory=list)
    version: int = -1  # the weights that filled the cache
    joining: list[_Request] = field(default_factory=list)
    stopped: list[_Request] = field(default_factory=list)  # finished, not handed out yet

    @property
    def decoding(self) -> bool:
        return any(not r.finished for r in self.rows)

    @property
    def active(self) -> int:
        return sum(not r.finished for r in self.rows) + len(self.joining)


class TorchEngine(InferenceEngine):
    def __init__(
        self,
        model: Mapping[str, Any],
        weights: WeightUpdate | None = None,
        max_batch_size: int = 64,
        seed: int = 0,
        queue_size: int = 1024,
        batching: str = "continuous",
        prefix_cache_tokens: int = 16384,
    ) -> None:
        if max_batch_size < 1:
            raise ConfigError(f"engine.max_batch_size must be >= 1, got {max_batch_size}")
        if queue_size < 1:
            raise ConfigError(f"engine.queue_size must be >= 1, got {queue_size}")
        if batching not in BATCHING:
            raise ConfigError(f"engine.batching must be one of {', '.join(BATCHING)}, got {batching!r}")
        if prefix_cache_tokens < 0:
            raise ConfigError(f"engine.prefix_cache_tokens must be >= 0, got {prefix_cache_tokens}")
        policy = build_policy(model)  # the engine's own copy: the trainer updates its own
        self.model = policy.model.eval()
        self.device = policy.device
        self.pad_id = policy.tokenizer.pad_id
        self.max_batch_size = max_batch_size
        self.batching = batching
        self.max_positions: int = getattr(self.model.config, "max_position_embeddings", 1 << 30)
        self._keeps_logits = keeps_logits(self.model)
        self.version = 0
        self._weights = AdapterMerger()
        if weights is not None:
            self._load(weights)
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self.prefixes = PrefixCache(prefix_cache_tokens)
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

    @property
    def context_length(self) -> int:
        return self.max_positions

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
        self._weights.load(self.model, update)  # a LoRA update: the adapters merged in
        self.version = update.version

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
        batch = _Batch(SlotCache(self.max_batch_size))
        async with self._receive:
            try:
                async for request in self._receive:  # idle until a request comes
                    self._join(batch, request)
                    while batch.active:
                        await self._step(batch)
                    await anyio.to_thread.run_sync(self._park_drained, batch)
                    # Drained: the next batch reuses the buffers (growing them again from
                    # one slot, every step of a run, cost more than the decode steps did).
                    batch = _Batch(batch.cache.cleared())
            finally:
                self._abort(batch)

    async def _step(self, batch: _Batch) -> None:
        """One token for every resident sequence, under the gate so a pause waits for it."""
        async with self._step_gate:
            self._admit(batch)  # after the gate: requests that came while paused join now
            version = self.version
            tokens, logprobs = await anyio.to_thread.run_sync(self._advance, batch)
        for request, token, logprob in zip(batch.rows, tokens, logprobs, strict=True):
            if request.fed < request.length:  # still feeding a cached prefix's new tokens
                continue
            request.add(token, logprob, version)
            if request.finished:
                batch.stopped.append(request)
        self._hand_out(batch)

    def _hand_out(self, batch: _Batch) -> None:
        """Results go out as soon as their sequence stops (waves: once the whole wave has)."""
        if self.batching == "waves" and batch.decoding:
            return
        for request in batch.stopped:
            request.done.set()
        batch.stopped.clear()

    def _admit(self, batch: _Batch) -> None:
        """Move waiting requests into the batch while it has room (waves: only between waves)."""
        if self.batching == "waves" and batch.decoding:
            return
        while batch.active < self.max_batch_size:
            try:
                request = self._receive.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream):
                return
            self._join(batch, request)

    def _join(self, batch: _Batch, request: _Request) -> None:
        room = self.max_positions - len(request.prompt_ids)
        request.budget = max(0, min(request.sampling.max_tokens, room))
        if request.budget == 0:  # no room to generate: done before it starts
            request.start_version = self.version
            request.finish(FinishReason.LENGTH)
        else:
            batch.joining.append(request)

    def _abort(self, batch: _Batch) -> None:
        """Fail every unfinished admitted and waiting request (the engine is closing); the
        finished ones still go out."""
        cut = [r for r in batch.rows + batch.joining if not r.finished]
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

    def _advance(self, batch: _Batch) -> tuple[list[int], list[float]]:
        """Drop finished rows, decode the resident rows, prefill the joining ones and add
        them; returns one sampled token and its log-prob per row of ``batch.rows`` (-1 and 0
        for a row still feeding a resumed prefix's new tokens: nothing is drawn for it)."""
        with torch.inference_mode():
            self._drop_finished(batch)
            if batch.rows and batch.version != self.version:
                # The weights changed: what is cached is stale; prefill everyone afresh.
                batch.joining = batch.rows + batch.joining
                batch.rows = []
                batch.cache.clear()
            batch.version = self.version
            self._resume_cached(batch)
            logits = []
            if batch.rows:
                logits.append(self._decode(batch))
            joining = sorted(batch.joining, key=lambda r: r.length)
            for bucket in _buckets([r.length for r in joining], PREFILL_CALL_TOKENS):
                cache, joined = self._prefill(joining[bucket])
                batch.cache.add(cache)
                logits.append(joined)
            batch.rows, batch.joining = batch.rows + joining, []
            out_tokens, out_logprobs = [-1] * len(batch.rows), [0.0] * len(batch.rows)
            drawn = [i for i, r in enumerate(batch.rows) if r.fed == r.length]  # the others feed
            if drawn:
                temperature = torch.tensor([batch.rows[i].sampling.temperature for i in drawn],
                                           device=self.device)
                tokens, logprobs = self._sample(torch.cat(logits), temperature)
                for i, token, logprob in zip(drawn, tokens.tolist(), logprobs.tolist(), strict=True):
                    out_tokens[i], out_logprobs[i] = token, logprob
        return out_tokens, out_logprobs

    def _park_drained(self, batch: _Batch) -> None:
        """The last rows of a drained batch finished too: their prefixes are parked as well."""
        with torch.inference_mode():
            self._drop_finished(batch)

    def _drop_finished(self, batch: _Batch) -> None:
        keep = [i for i, r in enumerate(batch.rows) if not r.finished]
        if len(keep) < len(batch.rows):
            if self.prefixes.max_tokens:
                done = [i for i, r in enumerate(batch.rows) if r.finished]
                self.prefixes.park([batch.rows[i] for i in done], batch.cache.rows_kv(
                    done, [batch.rows[i].fed for i in done]), batch.version)
            batch.rows = [batch.rows[i] for i in batch.cache.retain(keep)]
            batch.cache.trim(max((r.fed for r in batch.rows), default=1))

    def _resume_cached(self, batch: _Batch) -> None:
        """Joining requests that extend a parked sequence (an episode's next turn) take its
        cached keys and values and join the resident rows; the decode steps feed them their
        new tokens one at a time (``fed < length``: nothing is sampled until all are in)."""
        if batch.joining and self.prefixes:
            fresh = []
            for request in batch.joining:
                kv = self.prefixes.take(request, self.version)
                if kv is None:
                    fresh.append(request)
                    continue
                request.fed = kv.get_seq_length()
                if request.length - request.fed > FEED_STEPS:
                    self._extend(request, kv)
                batch.cache.add(kv)
                batch.rows.append(request)
            batch.joining = fresh

    def _extend(self, request: _Request, kv: DynamicCache) -> None:
        """One forward pass over a resumed request's new tokens but the last (which the next
        decode step feeds), on top of its cached prefix."""
        start, end = request.fed, request.length - 1
        ids = torch.tensor([[request.token(i) for i in range(start, end)]], device=self.device)
        self.model(input_ids=ids, position_ids=torch.arange(start, end, device=self.device)[None],
                   attention_mask=torch.ones((1, end), dtype=torch.long, device=self.device),
                   past_key_values=kv, use_cache=True, logits_to_keep=1)
        request.fed = end

    def _prefill(self, requests: list[_Request]) -> tuple[DynamicCache, torch.Tensor]:
        """A fresh cache for ``requests`` (prompt + tokens so far, left-padded) and the logits
        of each one's next token. Identical sequences (the samples of one prompt arrive
        together) are computed once and their rows repeated."""
        first: dict[tuple[int, ...], int] = {}
        row_of = [first.setdefault(tuple(r.prompt_ids + r.token_ids), len(first)) for r in requests]
        sequences = [list(s) for s in first]
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(sequences), width), dtype=torch.long)
        for i, s in enumerate(sequences):  # left padding keeps every sequence's end aligned
            ids[i, width - len(s) :] = torch.tensor(s)
            attention[i, width - len(s) :] = 1
        for r in requests:
            r.fed = r.length
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()  # no config: plain full-attention layers, as SlotCache keeps
        out = self.model(
            input_ids=ids.to(self.device), attention_mask=attention.to(self.device),
            position_ids=positions.to(self.device), past_key_values=cache, use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1].float()
        if len(sequences) < len(requests):
            rows = torch.tensor(row_of, device=self.device)
            for layer in cache.layers:
                layer.keys = layer.keys.index_select(0, rows)
                layer.values = layer.values.index_select(0, rows)
            logits = logits.index_select(0, rows)
        return cache, logits

    def _decode(self, batch: _Batch) -> torch.Tensor:
        """Feed every row its next token (its last sampled one, or the next new token of a
        sequence resumed from the prefix cache); the cache's window grows by one column.
        Returns the logits of the rows that draw a token, the rows still feeding a resumed
        prefix's new tokens left out (the LM head runs without them where the model takes
        a per-row ``logits_to_keep``)."""
        cache = batch.cache
        cache.reserve(cache.rows, 0, 1)
        lengths = torch.tensor([r.fed + 1 for r in batch.rows])
        last = torch.tensor([[r.token(r.fed)] for r in batch.rows])
        for r in batch.rows:
            r.fed += 1
        width = cache.width + 1
        attention = (torch.arange(width) >= width - lengths[:, None]).long()
        drawn = torch.tensor([r.fed == r.length for r in batch.rows])  # the others still feed
        select = self._keeps_logits and not bool(drawn.all())
        out = self.model(
            input_ids=last.to(self.device), attention_mask=attention.to(self.device),
            position_ids=(lengths - 1)[:, None].to(self.device), past_key_values=cache,
            use_cache=True, logits_to_keep=drawn[:, None].to(self.device) if select else 1,
        )
        cache.commit(1)
        if select:  # the LM head ran at the drawing rows alone
            return out.logits.float()
        logits = out.logits[:, -1].float()
        return logits if drawn.all() else logits[drawn.to(self.device)]

    def _sample(self, logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        greedy = temperature <= 0
        scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
        logp = torch.log_softmax(scaled, dim=-1)
        tokens = _draw(logp, self._generator)
        if greedy.any():
            tokens = torch.where(greedy, logp.argmax(-1), tokens)
        chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
        if not torch.isfinite(chosen).all():  # pragma: no cover - a NaN model is a bug upstream
            raise FloatingPointError("the policy produced non-finite log-probabilities")
        return tokens.cpu(), chosen.cpu()


def _draw(logp: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row from ``exp(logp)``, by inverting its cumulative distribution at a
    uniform draw (in float64, so rounding cannot reach a token of probability 0).
    ``torch.multinomial`` draws an exponential variate per vocabulary entry: 37 ms a step for
    32 rows of SmolLM2's 49,152 on 2 CPU threads, against 2 ms here."""
    cdf = logp.exp().double().cumsum(-1)
    u = torch.rand((len(cdf), 1), generator=generator, dtype=cdf.dtype, device=cdf.device)
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return picked.squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


def _buckets(lengths: list[int], call_tokens: int) -> list[slice]:
    """Split ascending ``lengths`` into runs prefilled together (each padded to its longest),
    minimising the padded tokens plus ``call_tokens`` per forward pass."""
    cost = [0] * (len(lengths) + 1)
    start = [0] * (len(lengths) + 1)
    for j in range(1, len(lengths) + 1):
        cost[j], start[j] = min((cost[i] + call_tokens + (j - i) * lengths[j - 1], i) for i in range(j))
    runs = []
    j = len(lengths)
    while j:
        runs.append(slice(start[j], j))
        j = start[j]
    return runs[::-1]


# -- the prefix cache --------------------------------------------------------------------------


class PrefixCache:
    """Finished sequences' keys and values, kept for the next turn of their episode.

    A multi-turn episode's next request is its previous prompt and completion plus an
    observation. Without this, every turn prefills the whole conversation again. A finished
    sequence's cached keys and values (prompt + completion, less its last token, which never
    went through the model) are parked under those token ids, newest last; a request whose
    ids extend a parked sequence (of the same weights) takes it and only its new tokens go
    through the model, fed by the decode steps (one per step, in the running batch). Oldest
    entries go first past ``max_tokens`` parked tokens; a weight update drops them all (they
    were computed by the old weights); 0 turns it off.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self.version = -1
        self.hits = 0  # requests that resumed a parked sequence
        self.reused = 0  # tokens they did not prefill again
        self._entries: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = \
            OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._entries)

    def park(self, requests: Sequence[_Request], kvs: Sequence[list[tuple[torch.Tensor, torch.Tensor]]],
             version: int) -> None:
        self._at(version)
        for request, kv in zip(requests, kvs, strict=True):
            if request.finish_reason is FinishReason.ABORTED or request.fed == 0:
                continue
            key = tuple((request.prompt_ids + request.token_ids)[: request.fed])
            if key in self._entries:
                self.tokens -= len(key)
            self._entries[key] = kv
            self.tokens += len(key)
        while self.tokens > self.max_tokens:
            self.tokens -= len(self._entries.popitem(last=False)[0])

    def take(self, request: _Request, version: int) -> DynamicCache | None:
        """The cache of the longest parked sequence ``request`` extends (it leaves the store:
        the request's row holds it now), or None."""
        self._at(version)
        ids = request.prompt_ids + request.token_ids
        best: tuple[int, ...] | None = None
        for key in self._entries:
            n = len(key)
            if n < len(ids) and (best is None or n > len(best)) and ids[n - 1] == key[-1] \
                    and tuple(ids[:n]) == key:
                best = key
        if best is None:
            return None
        self.tokens -= len(best)
        self.hits += 1
        self.reused += len(best)
        cache = DynamicCache()
        for i, (keys, values) in enumerate(self._entries.pop(best)):
            cache.update(keys[None], values[None], i)
        return cache

    def _at(self, version: int) -> None:
        if version != self.version:  # computed by other weights: of no use now
            self._entries.clear()
            self.tokens, self.version = 0, version
