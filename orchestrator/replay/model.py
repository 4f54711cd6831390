"""A discrete-event model of a continuously-batched inference server.

The model (a fluid version of vLLM / SGLang scheduling):

* at most ``max_running`` requests are resident; later ones wait in a FIFO queue;
* an admitted request is first prefilled: ``prefill_per_1k`` seconds per thousand uncached
  prompt tokens (``prompt_tokens - cached_tokens``) plus ``prefill_base`` per request,
  one request after another, and decoding stalls meanwhile (prefill has priority, as in
  SGLang's default scheduler);
* decoding runs every resident request one token per iteration; an iteration takes
  ``step_base + step_per_seq * B + step_per_1k_tokens * R / 1000`` seconds for ``B``
  requests holding ``R`` tokens (prompt plus generated so far), so a big batch is slow per
  step and fast per token, and a long tail decodes alone at ``~step_base`` per token;
* a request's latency is its finish time minus its arrival: queueing, prefill and decode.

Progress is tracked as a continuous token count shared by every resident request, so the
model advances event to event (arrival, prefill done, request done) in ``O(log n)``, never
token by token: a 2,048-trajectory step takes well under a second of CPU.

:class:`ServerModel` is pure (the caller supplies the time): the replay engine
(:class:`orchestrator.replay.engine.FluidServer`) drives it in (virtual) time, and the fit
(:mod:`orchestrator.replay.fit`) replays trace steps through it closed-loop. Limits: a fit
of a traced deployment is one aggregate server (its engines pooled; ``replay.engines``
replicates it, :func:`orchestrator.replay.engine.replay_router`), no preemption or KV-cache
pressure, prefix-cache hits taken from the trace (a replica that did not serve an episode's previous
turn misses, :mod:`orchestrator.replay.engine`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class ServerParams:
    step_base: float = 0.02  # seconds per decode iteration, empty batch
    step_per_seq: float = 5e-4  # + seconds per resident request
    step_per_1k_tokens: float = 1e-4  # + seconds per thousand resident tokens
    prefill_per_1k: float = 0.05  # seconds per thousand uncached prompt tokens
    prefill_base: float = 0.0  # seconds per request
    max_running: int = 2048

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def thinned(self, factor: float) -> ServerParams:
        """The same server seen by ``1/factor`` of its load: every per-request and per-token
        cost times ``factor``, so a thinned workload sees the same step times and latencies."""
        return replace(self, step_per_seq=self.step_per_seq * factor,
                       step_per_1k_tokens=self.step_per_1k_tokens * factor,
                       prefill_per_1k=self.prefill_per_1k * factor,
                       prefill_base=self.prefill_base * factor,
                       max_running=max(1, round(self.max_running / factor)))


@dataclass(frozen=True)
class RequestSpec:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class ServerModel:
    """The server's state; ``advance(now)`` returns the ids of requests finished by ``now``."""

    def __init__(self, params: ServerParams) -> None:
        self.p = params
        self.t = 0.0
        self.queue: deque[tuple[int, RequestSpec]] = deque()  # waiting for a slot
        self.prefill: deque[tuple[int, RequestSpec, float]] = deque()  # (id, spec, seconds left)
        self.heap: list[tuple[float, int]] = []  # (progress at which it finishes, id)
        self.joined: dict[int, float] = {}  # resident id -> progress when it joined decoding
        self.progress = 0.0  # tokens every resident request has decoded since time 0
        self.offset = 0.0  # sum over resident requests of (context - joined progress)
        self.context: dict[int, int] = {}
        self.paused = False
        self.busy = 0.0  # seconds spent prefilling or decoding

    # -- inputs ------------------------------------------------------------------------------

    def submit(self, now: float, rid: int, spec: RequestSpec) -> list[int]:
        """Add a request at ``now``; returns the requests that finished up to ``now``."""
        finished = self.advance(now)
        self.queue.append((rid, spec))
        self._admit()
        return finished

    @property
    def running(self) -> int:
        return len(self.prefill) + len(self.joined)

    def decoded(self, rid: int) -> int:
        """Tokens request ``rid`` has decoded so far (0 while queued or prefilling)."""
        joined = self.joined.get(rid)
        return 0 if joined is None else int(self.progress - joined + 1e-9)

    @property
    def resident_tokens(self) -> float:
        """Tokens the decoding requests hold (prompt plus generated so far)."""
        return self.offset + len(self.joined) * self.progress

    def _admit(self) -> None:
        while self.queue and self.running < self.p.max_running:
            rid, spec = self.queue.popleft()
            uncached = max(spec.prompt_tokens - spec.cached_tokens, 0)
            seconds = self.p.prefill_base + self.p.prefill_per_1k * uncached / 1000.0
            self.prefill.append((rid, spec, seconds))

    # -- time ------------------------------------------------------------------------------------

    def _step_time(self) -> float:
        b = len(self.joined)
        resident = self.offset + b * self.progress
        return self.p.step_base + self.p.step_per_seq * b + self.p.step_per_1k_tokens * resident / 1000.0

    def next_event(self) -> float | None:
        """When the next internal event happens (None: nothing will happen without input)."""
        if self.paused:
            return None
        if self.prefill:
            return self.t + self.prefill[0][2]
        if self.heap:
            delta = self.heap[0][0] - self.progress
            tau = self._step_time()
            slope = self.p.step_per_1k_tokens * len(self.joined) / 1000.0
            return self.t + tau * delta + slope * delta * delta / 2.0
        return None

    def advance(self, now: float) -> list[int]:
        finished: list[int] = []
        while True:
            event = self.next_event()
            if event is None or event > now:
                self._progress_to(now)
                return finished
            self._progress_to(event)
            finished += self._settle()

    def _progress_to(self, when: float) -> None:
        dt = when - self.t
        if dt <= 0:
            return
        self.t = when
        if self.paused:
            return
        if self.prefill:
            rid, spec, left = self.prefill[0]
            self.prefill[0] = (rid, spec, left - dt)
            self.busy += dt
        elif self.joined:
            tau = self._step_time()
            slope = self.p.step_per_1k_tokens * len(self.joined) / 1000.0
            self.progress += 2.0 * dt / (tau + math.sqrt(tau * tau + 2.0 * slope * dt))
            self.busy += dt

    def _settle(self) -> list[int]:
        """Finish what is due at the current time: a prefill, or decodes."""
        finished = []
        if self.prefill and self.prefill[0][2] <= 1e-12:
            rid, spec, _ = self.prefill.popleft()
            n = max(spec.completion_tokens, 1)
            self.joined[rid] = self.progress
            self.context[rid] = spec.prompt_tokens
            self.offset += spec.prompt_tokens - self.progress
            heapq.heappush(self.heap, (self.progress + n, rid))
            return finished
        while self.heap and self.heap[0][0] <= self.progress + 1e-9:
            _, rid = heapq.heappop(self.heap)
            joined = self.joined.pop(rid)
            self.offset -= self.context.pop(rid) - joined
            finished.append(rid)
        if not self.joined:
            self.offset = 0.0  # no drift from float sums once empty
        self._admit()
        return finished
