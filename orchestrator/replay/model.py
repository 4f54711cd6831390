"""A discrete-event model of a continuously-batched inference server, and its fit to PolyTrace.

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

:class:`ServerModel` is pure (the caller supplies the time). The fit (:func:`fit`) replays
trace steps closed-loop: every trajectory's first turn arrives at 0, each later turn when
the previous turn finished plus its recorded tool time; it searches the parameters with
Nelder-Mead on log scale from two starts, minimising makespan error + median end-to-end
error + per-turn latency KS and quantile gap over the fit steps. Limits: one aggregate server (several real engines pooled),
no preemption or KV-cache pressure, prefix-cache hits taken from the trace, not modelled.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np


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


# -- closed-loop replay of trace steps ---------------------------------------------------------------


@dataclass(frozen=True)
class TurnShape:
    spec: RequestSpec
    latency: float  # recorded engine latency
    tool_seconds: float  # recorded tool time after this turn (0 for the last)


Episode = Sequence[TurnShape]


def simulate(params: ServerParams, episodes: Sequence[Episode]) -> tuple[list[float], list[float]]:
    """Replays episodes that all start at 0; returns (per-turn latencies, per-episode e2e)."""
    server = ServerModel(params)
    latencies: list[float] = []
    e2e = [0.0] * len(episodes)
    submitted: dict[int, tuple[int, int, float]] = {}  # rid -> (episode, turn, arrival)
    arrivals: list[tuple[float, int, int]] = [(0.0, i, 0) for i in range(len(episodes)) if episodes[i]]
    heapq.heapify(arrivals)
    rid = 0
    while arrivals or server.running or server.queue:
        next_arrival = arrivals[0][0] if arrivals else math.inf
        event = server.next_event()
        if event is None and not arrivals:
            break
        if event is not None and event <= next_arrival:
            done = server.advance(event)
        else:
            done = []
            while arrivals and arrivals[0][0] <= next_arrival:
                at, ep, turn = heapq.heappop(arrivals)
                submitted[rid] = (ep, turn, at)
                done += server.submit(at, rid, episodes[ep][turn].spec)
                rid += 1
        for r in done:
            ep, turn, at = submitted.pop(r)
            latencies.append(server.t - at)
            shape = episodes[ep][turn]
            if turn + 1 < len(episodes[ep]):
                heapq.heappush(arrivals, (server.t + shape.tool_seconds, ep, turn + 1))
            else:
                e2e[ep] = server.t + shape.tool_seconds
    return latencies, e2e


def ks_statistic(a: Sequence[float], b: Sequence[float]) -> float:
    x, y = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    grid = np.concatenate([x, y])
    cdf_x = np.searchsorted(x, grid, side="right") / len(x)
    cdf_y = np.searchsorted(y, grid, side="right") / len(y)
    return float(np.abs(cdf_x - cdf_y).max())


@dataclass(frozen=True)
class Fidelity:
    makespan_error: float  # relative, signed: simulated / observed - 1
    median_e2e_error: float
    latency_ks: float
    makespan: float
    observed_makespan: float

    @property
    def accuracy(self) -> float:
        return 1.0 - abs(self.makespan_error)


def observed(episodes: Sequence[Episode]) -> tuple[list[float], list[float]]:
    lat = [t.latency for ep in episodes for t in ep]
    e2e = [sum(t.latency + t.tool_seconds for t in ep) for ep in episodes]
    return lat, e2e


def fidelity(sim: tuple[list[float], list[float]], obs: tuple[list[float], list[float]]) -> Fidelity:
    (s_lat, s_e2e), (o_lat, o_e2e) = sim, obs
    return Fidelity(
        makespan_error=max(s_e2e) / max(o_e2e) - 1.0,
        median_e2e_error=float(np.median(s_e2e) / np.median(o_e2e) - 1.0),
        latency_ks=ks_statistic(s_lat, o_lat),
        makespan=max(s_e2e),
        observed_makespan=max(o_e2e),
    )


_FREE = ("step_base", "step_per_seq", "step_per_1k_tokens", "prefill_per_1k", "max_running")


def _params(x: np.ndarray, base: ServerParams) -> ServerParams:
    values = np.exp(x)
    kwargs = {k: float(v) for k, v in zip(_FREE, values, strict=True)}
    kwargs["max_running"] = max(1, int(round(kwargs["max_running"])))
    return replace(base, **kwargs)


def replay_fidelity(params: ServerParams, episodes: Sequence[Episode], replicas: int = 1) -> Fidelity:
    """Simulate ``episodes`` (each played ``replicas`` times) against what was recorded."""
    return fidelity(simulate(params, list(episodes) * replicas), observed(episodes))


_QUANTILES = np.linspace(0.02, 0.98, 49)


def _loss(params: ServerParams, steps: Sequence[Sequence[Episode]], replicas: int = 1) -> float:
    """Makespan and median errors, the latency KS, and the RMS gap of log-latency quantiles
    (smooth where KS is not, so the search can follow it)."""
    total = 0.0
    for episodes in steps:
        sim = simulate(params, list(episodes) * replicas)
        obs = observed(episodes)
        f = fidelity(sim, obs)
        gap = np.log(np.quantile(sim[0], _QUANTILES)) - np.log(np.quantile(obs[0], _QUANTILES))
        total += (2.0 * abs(f.makespan_error) + abs(f.median_e2e_error) + 2.0 * f.latency_ks
                  + float(np.sqrt(np.mean(gap ** 2))))
    return total / len(steps)


def nelder_mead(f, x0: np.ndarray, scale: float = 0.5, iterations: int = 200, tol: float = 1e-4):
    n = len(x0)
    simplex = [x0] + [x0 + scale * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        worst = simplex[-1]
        xr = centroid + (centroid - worst)
        fr = f(xr)
        if fr < values[0]:
            xe = centroid + 2.0 * (centroid - worst)
            fe = f(xe)
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (worst - centroid)
            fc = f(xc)
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:
                best = simplex[0]
                simplex = [best] + [best + 0.5 * (x - best) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    i = int(np.argmin(values))
    return simplex[i], values[i]


# Where the search starts: shares of the turn-0 per-token time given to the per-request and
# per-resident-token terms, and to prefill. The loss has several basins (batch-bound against
# context-bound decoding); the fit runs from each start and keeps the best.
STARTS = ((0.3, 0.3, 0.25), (0.2, 0.6, 0.5))


def initial_guess(steps: Sequence[Sequence[Episode]], seq_share: float = 0.3,
                  token_share: float = 0.3, prefill_share: float = 0.25) -> ServerParams:
    """A start from the trace itself: turn-0 latency per token under the full first batch."""
    episodes = steps[0]
    first = [ep[0] for ep in episodes if ep]
    per_token = float(np.median([t.latency / max(t.spec.completion_tokens, 1) for t in first]))
    batch = len(first)
    return ServerParams(step_base=0.05 * per_token, step_per_seq=seq_share * per_token / batch,
                        step_per_1k_tokens=token_share * per_token / batch,
                        prefill_per_1k=prefill_share * per_token, max_running=batch)


def fit(steps: Sequence[Sequence[Episode]], iterations: int = 90,
        start: ServerParams | None = None, replicas: int = 1) -> tuple[ServerParams, float]:
    """Nelder-Mead on log parameters from each of :data:`STARTS` (or from ``start``)."""
    starts = [start] if start else [initial_guess([list(steps[0]) * replicas], *s) for s in STARTS]
    best: tuple[ServerParams, float] | None = None
    for base in starts:
        x0 = np.log([getattr(base, k) for k in _FREE])
        x, value = nelder_mead(lambda x, base=base: _loss(_params(x, base), steps, replicas), x0,
                               iterations=iterations)
        if best is None or value < best[1]:
            best = (_params(x, base), value)
    assert best is not None
    return best


def episodes_from(records: Iterable) -> list[list[TurnShape]]:
    """Turn shapes of PolyTrace workload records (any object with ``turns``/``tool_calls``)."""
    out = []
    for r in records:
        tool: dict[int, float] = {}
        for c in r.tool_calls:
            tool[c.turn] = tool.get(c.turn, 0.0) + c.latency_s
        out.append([TurnShape(RequestSpec(t.prompt_tokens, t.cached_tokens, t.completion_tokens),
                              t.engine_latency_s, tool.get(t.turn, 0.0)) for t in r.turns])
    return out
